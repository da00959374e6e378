//! Agents through prefill/decode without tail stalls: a shortened agent run (growing multi-round
//! conversations, real worker processes, the router in front of a prefill and a decode worker) against
//! the PD stack and a unified worker on the same cores, alternating. From the second round on, the PD
//! stack's TTFT p99 stays within a bound of the unified worker's (the tail once grew to 59x: every
//! round's prompt went through the prefill worker's queue, the transfer and the pull), and it computes
//! no more of each round than the unified worker does (the decode worker holds the history, generated
//! tokens included). Ratios, not absolute times: the machine's speed cancels out.

mod common;

use std::time::Duration;

use common::router::RouterThread;
use common::Worker;
use pdserve_loadgen::{run_point, Load, PointResult, Progress, Shape, Slo, Target};
use pdserve_router::Role;

/// The bound on PD / unified TTFT p99 over rounds 2 on. At this scale (8 agents x 4 rounds, 2 cores)
/// the ratio measured 0.70-0.92 with conditional disaggregation and 1.47-1.61 without it (every round
/// through the prefill worker, `--max-local-prefill-bytes 0`), which also computed 1.04-1.11 of each
/// new token against the unified worker's 0.84-0.92. (`cargo xtask bench agents`'s goal at 32 agents
/// is 2x.)
const P99_RATIO_MAX: f64 = 1.25;

/// Summed TTFT p99 of rounds 2 on, and computed / new prompt tokens over those rounds.
fn later_rounds(p: &PointResult) -> (f64, f64) {
    let later: Vec<_> = p.rounds.iter().filter(|r| r.round >= 1).collect();
    let p99: f64 = later.iter().map(|r| r.ttft.p99.as_secs_f64()).sum();
    let computed: u64 = later.iter().filter_map(|r| r.computed_tokens()).sum();
    let new: u64 = later.iter().map(|r| r.new_tokens).sum();
    (p99, computed as f64 / new.max(1) as f64)
}

#[test]
fn pd_agents_tail_stays_near_the_unified_workers() {
    let blocks = ["--kv-blocks", "1024"];
    let unified = Worker::start(&blocks);
    let prefill = Worker::start(&["--role", "prefill", "--kv-shm", blocks[0], blocks[1]]);
    let decode = Worker::start(&["--role", "decode", blocks[0], blocks[1]]);
    let router = RouterThread::start(&[(&prefill, Role::Prefill), (&decode, Role::Decode)]);
    let targets = [
        Target::parse(&format!("http://{}", router.addr)).unwrap(),
        Target::parse(&format!("http://{}", unified.addr)).unwrap(),
    ];
    let load = Load::Agents { agents: 8, rounds: 4, tool_words: 40 };
    let shape =
        Shape { prompt_words: 150, max_tokens: 16, timeout: Duration::from_secs(120), ..Shape::default() };
    let mut ratios = Vec::new();
    let mut computed = Vec::new();
    for _ in 0..2 {
        let points: Vec<PointResult> = targets
            .iter()
            .map(|t| run_point(t, &load, &shape, &Slo::default(), &Progress::quiet()))
            .collect();
        for p in &points {
            assert_eq!((p.ok, p.hung), (32, 0), "{}: {:?}", p.target, p.errors);
        }
        let (pd, un) = (later_rounds(&points[0]), later_rounds(&points[1]));
        ratios.push(pd.0 / un.0);
        computed.push((pd.1, un.1));
    }
    // Rounds 2-4 went to the decode worker that held each conversation (2 runs x 8 agents x 3 rounds),
    // a few perhaps through prefill when it had no room.
    let metrics = String::from_utf8(router.send("GET", "/metrics", "").read_to_end().unwrap()).unwrap();
    let local: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("router_requests_dispatched_total{plan=\"decode_local\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(local >= 36.0, "{local} of 48 later rounds computed where their history was");
    eprintln!("PD / unified TTFT p99, rounds 2-4: {ratios:.2?}; computed per new token (PD, unified): {computed:.2?}");
    ratios.sort_by(f64::total_cmp);
    // The better of the two alternations: one noisy neighbour on a shared machine may spoil one.
    assert!(
        ratios[0] <= P99_RATIO_MAX,
        "PD TTFT p99 over rounds 2-4 is {ratios:?} x the unified worker's (bound {P99_RATIO_MAX})"
    );
    for (pd, un) in computed {
        assert!(pd <= un + 0.15, "PD computed {pd:.2} of each new token, unified {un:.2}");
    }
}
