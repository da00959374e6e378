//! Figures of one point: percentiles, goodput, errors, hung requests, the generator's own CPU.

use std::collections::BTreeMap;
use std::time::Duration;

use pdserve_telemetry::{LatencyHistogram, LatencySummary};
use serde_json::json;

use crate::{Load, Observation, Slo};

/// The percentiles of `samples` (through the workspace's one latency histogram).
fn percentiles(samples: impl Iterator<Item = Duration>) -> LatencySummary {
    let h = LatencyHistogram::new();
    for d in samples {
        h.record(d);
    }
    h.summary()
}

#[derive(Debug, Clone)]
pub struct PointResult {
    pub target: String,
    pub load: String,
    pub x: f64,
    pub wall: Duration,
    pub sent: u64,
    pub ok: u64,
    pub output_tokens: u64,
    pub ttft: LatencySummary,
    /// Gaps between content events: a server that puts several tokens in one event has fewer, longer ones.
    pub itl: LatencySummary,
    /// Time per output token after the first, per request: (e2e - TTFT) / (output tokens - 1), whatever
    /// the server's event sizes (vLLM's TPOT).
    pub tpot: LatencySummary,
    pub e2e: LatencySummary,
    /// Successful requests that met both SLOs.
    pub good: u64,
    /// Failures by status code and error type (`"429 queue_full"`, `"0 connect"`, ...).
    pub errors: BTreeMap<String, u64>,
    /// Requests with no terminal event within their deadline plus the grace period.
    pub hung: u64,
    /// The generator's own CPU seconds over the point.
    pub cpu_s: f64,
    /// Mean per-stage milliseconds the server reported, with how many requests reported each.
    pub stages: BTreeMap<String, (f64, u64)>,
    /// Agents workload: the figures of each round (empty for other loads).
    pub rounds: Vec<RoundResult>,
}

/// One round of the agents workload, over its successful requests.
#[derive(Debug, Clone)]
pub struct RoundResult {
    pub round: u32,
    pub ok: u64,
    pub ttft: LatencySummary,
    pub prompt_tokens: u64,
    /// Prompt tokens the server reported as cached (`None`: the server reports none).
    pub cached_tokens: Option<u64>,
    /// Prompt tokens new in this round: the growth of each agent's prompt since its previous round
    /// (the whole prompt in the first).
    pub new_tokens: u64,
    /// KV bytes moved between prefill and decode workers (`None`: not reported).
    pub kv_pulled_bytes: Option<u64>,
}

impl RoundResult {
    /// Prompt tokens the server computed: the prompt less what it found cached.
    pub fn computed_tokens(&self) -> Option<u64> {
        self.cached_tokens.map(|c| self.prompt_tokens.saturating_sub(c))
    }

    /// Computed tokens per new token (1.0: only what was new was computed).
    pub fn computed_per_new(&self) -> Option<f64> {
        self.computed_tokens().map(|c| c as f64 / self.new_tokens.max(1) as f64)
    }

    fn from_outcomes(outcomes: &[Observation]) -> Vec<RoundResult> {
        let ok: Vec<(u32, u32, &Observation)> = outcomes
            .iter()
            .filter(|o| o.ok())
            .filter_map(|o| o.agent_round.map(|(a, r)| (a, r, o)))
            .collect();
        let prompt_of: BTreeMap<(u32, u32), u64> =
            ok.iter().map(|&(a, r, o)| ((a, r), o.prompt_tokens)).collect();
        let rounds = ok.iter().map(|&(_, r, _)| r + 1).max().unwrap_or(0);
        (0..rounds)
            .map(|round| {
                let these: Vec<&(u32, u32, &Observation)> =
                    ok.iter().filter(|(_, r, _)| *r == round).collect();
                let sum_opt = |f: &dyn Fn(&Observation) -> Option<u64>| -> Option<u64> {
                    these.iter().map(|(_, _, o)| f(o)).reduce(|a, b| Some(a? + b?)).flatten()
                };
                RoundResult {
                    round,
                    ok: these.len() as u64,
                    ttft: percentiles(these.iter().filter_map(|(_, _, o)| o.ttft)),
                    prompt_tokens: these.iter().map(|(_, _, o)| o.prompt_tokens).sum(),
                    cached_tokens: sum_opt(&|o| o.cached_tokens),
                    new_tokens: these
                        .iter()
                        .map(|&&(a, r, o)| {
                            let before = r.checked_sub(1).and_then(|p| prompt_of.get(&(a, p)).copied());
                            o.prompt_tokens.saturating_sub(before.unwrap_or(0))
                        })
                        .sum(),
                    kv_pulled_bytes: sum_opt(&|o| o.kv_pulled_bytes),
                }
            })
            .collect()
    }

    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "round": self.round, "ok": self.ok, "ttft": self.ttft.to_json(),
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens(), "new_tokens": self.new_tokens,
            "computed_per_new": self.computed_per_new(), "kv_pulled_bytes": self.kv_pulled_bytes,
        })
    }
}

impl PointResult {
    pub fn from_outcomes(
        target: &str,
        load: &Load,
        outcomes: &[Observation],
        wall: Duration,
        cpu_s: f64,
        slo: &Slo,
    ) -> PointResult {
        let ok: Vec<&Observation> = outcomes.iter().filter(|o| o.ok()).collect();
        let mut errors = BTreeMap::new();
        for o in outcomes.iter().filter(|o| !o.ok()) {
            let key = format!("{} {}", o.status, o.error.as_deref().unwrap_or("unterminated"));
            *errors.entry(key).or_insert(0) += 1;
        }
        let good = ok
            .iter()
            .filter(|o| o.ttft.is_some_and(|t| t <= slo.ttft) && o.tpot().unwrap_or_default() <= slo.tpot)
            .count() as u64;
        PointResult {
            target: target.to_owned(),
            load: load.label(),
            x: load.x(),
            wall,
            sent: outcomes.len() as u64,
            ok: ok.len() as u64,
            output_tokens: ok.iter().map(|o| o.output_tokens).sum(),
            ttft: percentiles(ok.iter().filter_map(|o| o.ttft)),
            itl: percentiles(ok.iter().flat_map(|o| o.itl.iter().copied())),
            tpot: percentiles(ok.iter().filter_map(|o| o.tpot())),
            e2e: percentiles(ok.iter().map(|o| o.e2e)),
            good,
            errors,
            hung: outcomes.iter().filter(|o| o.hung).count() as u64,
            cpu_s,
            stages: crate::stage_means(outcomes),
            rounds: RoundResult::from_outcomes(outcomes),
        }
    }

    pub fn requests_per_s(&self) -> f64 {
        self.ok as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    pub fn tokens_per_s(&self) -> f64 {
        self.output_tokens as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    pub fn goodput_per_s(&self) -> f64 {
        self.good as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    /// The generator's CPU use as a fraction of one core.
    pub fn cpu_cores(&self) -> f64 {
        self.cpu_s / self.wall.as_secs_f64().max(1e-9)
    }

    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "target": self.target, "load": self.load, "x": self.x, "wall_s": self.wall.as_secs_f64(),
            "sent": self.sent, "ok": self.ok, "requests_per_s": self.requests_per_s(),
            "output_tokens_per_s": self.tokens_per_s(), "goodput_per_s": self.goodput_per_s(),
            "ttft": self.ttft.to_json(), "itl": self.itl.to_json(), "tpot": self.tpot.to_json(), "e2e": self.e2e.to_json(),
            "errors": self.errors, "hung": self.hung, "generator_cpu_cores": self.cpu_cores(),
            "stages_mean_ms": self.stages.iter().map(|(k, (m, n))| (k.clone(), json!({"mean_ms": m, "requests": n}))).collect::<serde_json::Map<_, _>>(),
            "rounds": self.rounds.iter().map(RoundResult::to_json).collect::<Vec<_>>(),
        })
    }
}

/// This process's user + system CPU seconds (Linux `/proc/self/stat`; 0 elsewhere).
pub(crate) fn own_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = [11, 12].iter().filter_map(|&i| f.get(i).and_then(|v| v.parse::<u64>().ok())).sum();
    // USER_HZ is 100 on every Linux configuration this runs on.
    ticks as f64 / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(ttft_ms: u64, e2e_ms: u64, tokens: u64) -> Observation {
        Observation {
            status: 200,
            ttft: Some(Duration::from_millis(ttft_ms)),
            e2e: Duration::from_millis(e2e_ms),
            output_tokens: tokens,
            terminal: true,
            ..Observation::default()
        }
    }

    #[test]
    fn goodput_needs_both_slos() {
        let slo = Slo { ttft: Duration::from_millis(100), tpot: Duration::from_millis(10) };
        let outcomes = vec![
            o(50, 140, 10),  // tpot 10 ms: good
            o(150, 200, 10), // ttft too slow
            o(50, 500, 10),  // tpot 50 ms: too slow
            Observation {
                status: 429,
                error: Some("queue_full".into()),
                terminal: true,
                ..Observation::default()
            },
            Observation { hung: true, error: Some("hung".into()), ..Observation::default() },
        ];
        let load = Load::Closed { concurrency: 2, requests: 5 };
        let r = PointResult::from_outcomes("t", &load, &outcomes, Duration::from_secs(1), 0.1, &slo);
        assert_eq!((r.sent, r.ok, r.good, r.hung), (5, 3, 1, 1));
        assert_eq!(r.errors.get("429 queue_full"), Some(&1));
        assert_eq!(r.errors.get("0 hung"), Some(&1));
        assert_eq!(r.ttft.count, 3);
        assert!((r.ttft.p50_ms() - 50.0).abs() < 0.5, "{:?}", r.ttft);
        assert_eq!(r.output_tokens, 30);
        // Time per output token after the first, per request, however the tokens were grouped into
        // events: (140 - 50) / 9, (200 - 150) / 9 and (500 - 50) / 9 ms.
        assert_eq!(r.tpot.count, 3);
        assert!((r.tpot.max_ms() - 50.0).abs() < 0.1 && (r.tpot.p50_ms() - 10.0).abs() < 0.1, "{:?}", r.tpot);
    }

    #[test]
    fn rounds_count_new_and_computed_tokens_per_agent() {
        let turn = |agent: u32, round: u32, prompt: u64, cached: u64, ttft_ms: u64| Observation {
            prompt_tokens: prompt,
            cached_tokens: Some(cached),
            kv_pulled_bytes: Some(1000),
            agent_round: Some((agent, round)),
            ..o(ttft_ms, 2 * ttft_ms, 4)
        };
        let outcomes = vec![
            turn(0, 0, 300, 0, 400),
            turn(1, 0, 310, 16, 500),
            turn(0, 1, 460, 288, 60),
            turn(1, 1, 480, 304, 80),
            // A failed turn counts nowhere.
            Observation { agent_round: Some((2, 1)), status: 500, ..Observation::default() },
        ];
        let load = Load::Agents { agents: 3, rounds: 2, tool_words: 40 };
        let r =
            PointResult::from_outcomes("t", &load, &outcomes, Duration::from_secs(1), 0.0, &Slo::default());
        let (r0, r1) = (&r.rounds[0], &r.rounds[1]);
        assert_eq!((r0.ok, r0.new_tokens, r0.computed_tokens()), (2, 610, Some(594)));
        assert_eq!((r1.ok, r1.new_tokens, r1.computed_tokens()), (2, 330, Some(348)));
        assert_eq!(r1.kv_pulled_bytes, Some(2000));
        assert!((r1.computed_per_new().unwrap() - 348.0 / 330.0).abs() < 1e-9);
        assert!(r1.ttft.p50_ms() < r0.ttft.p50_ms() / 4.0);
    }
}
