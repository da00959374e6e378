//! Thousands of flights on a virtual clock, each against workers that answer, refuse, drop stale
//! connections, die mid-answer, stall, answer with errors or answer too much, with clients that leave
//! and deadlines that pass; client requests (unified, disaggregated, forwarded GETs, the router's own
//! `/health/generate`) and pair probes without a client. After every run: each flight finished exactly
//! once, with the status, outcome and stage its cause calls for, by its deadline; its client got
//! exactly one answer (unless it left, or there was none); every leg it sent ended or was closed, at
//! most one at a time; and when it did not complete, every worker it reached was told to abort (unless
//! that worker ended the request itself with an error). Flights that may migrate move to another
//! worker when theirs dies or stalls: their workers write resume marks, and a completed stream holds
//! every token exactly once, in order, and never a mark.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use pdserve_api::{Outcome, Stage};
use pdserve_router::{Action, Flight, FlightSpec, LegFailure, LegId, LegKind, Plan, Purpose};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What a worker does with one leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    /// Answers 200 (a stream when asked) after `ms`.
    Answer { ms: u64 },
    /// The connection is refused: nothing was sent.
    Refuse,
    /// The pooled connection was closed by the worker: fails before any byte.
    Stale,
    /// Sends the head (and, streaming, some bytes), then the connection breaks.
    Die { ms: u64 },
    /// Never answers.
    Stall,
    /// Answers with an error of its own.
    Error { status: u16, ms: u64 },
    /// (Prefill) answers 200 without a handle.
    NoHandle,
}

/// Something the world will tell a flight at a time.
#[derive(Debug, Clone)]
enum Ev {
    Head {
        leg: LegId,
        status: u16,
        sse: bool,
        marks: bool,
    },
    Data {
        leg: LegId,
        bytes: Vec<u8>,
    },
    End {
        leg: LegId,
    },
    Failed {
        leg: LegId,
        failure: LegFailure,
    },
    ClientGone,
    Deadline,
    /// The shell's stall sweep.
    StallCheck,
}

/// What the sim records of one flight.
#[derive(Debug, Default)]
struct Record {
    finishes: Vec<pdserve_router::flight::Finish>,
    finished_at: Option<Duration>,
    after_finish: usize,
    responses: Vec<u16>,
    stream_started: bool,
    stream_ended: usize,
    stream_bytes: Vec<u8>,
    /// Legs sent, by id: (worker, ended).
    legs: BTreeMap<u32, (u32, bool)>,
    /// Each sent leg's kind.
    kinds: HashMap<u32, LegKind>,
    /// The leg whose event came last.
    last_leg: Option<LegId>,
    /// The last stage the flight announced.
    stage: Option<Stage>,
    open_at_once_max: usize,
    aborts: HashSet<u32>,
    /// Legs whose worker ended the request itself with an error answer.
    answered_error: HashSet<u32>,
    /// Legs that failed on a stale pooled connection: their worker never saw the request.
    stale_legs: HashSet<u32>,
    /// The event delivered just before `Finished`.
    cause: Option<&'static str>,
    last_status: Option<u16>,
    client_left: bool,
    /// The flight has a client (not a pair probe).
    client: bool,
    /// Per sent leg: it was asked for resume marks, and the tokens its body said the client had.
    resume: HashMap<u32, (bool, usize)>,
    /// A decode-local flight went on through a prefill worker (a refusal for load, a migration).
    fell_back: bool,
}

const HANDLE_ANSWER: &[u8] =
    br#"{"pd_transfer":{"addr":"127.0.0.1:1","transfer":9,"epoch":1,"shm":null},"usage":{}}"#;

struct World {
    rng: Rng,
    flights: Vec<Flight>,
    records: Vec<Record>,
    starts: Vec<Duration>,
    /// (time, flight, event), in insertion order at equal times.
    queue: BTreeMap<(Duration, u64), (usize, Ev)>,
    seq: u64,
    streaming: Vec<bool>,
    plans: Vec<Plan>,
    /// Per flight, per leg: the behaviour drawn.
    behaviour: HashMap<(usize, u32), Behaviour>,
    epoch: Instant,
}

impl World {
    fn at(&mut self, t: Duration, flight: usize, ev: Ev) {
        self.seq += 1;
        self.queue.insert((t, self.seq), (flight, ev));
    }

    fn draw(&mut self, kind: LegKind) -> Behaviour {
        let r = self.rng.below(100);
        match r {
            0..=44 => Behaviour::Answer { ms: 1 + self.rng.below(80) },
            45..=54 => Behaviour::Refuse,
            55..=62 => Behaviour::Stale,
            63..=72 => Behaviour::Die { ms: 1 + self.rng.below(60) },
            73..=80 => Behaviour::Stall,
            81..=94 => Behaviour::Error {
                status: [400, 429, 500, 502, 503][self.rng.below(5) as usize],
                ms: 1 + self.rng.below(40),
            },
            _ if kind == LegKind::Prefill => Behaviour::NoHandle,
            _ => Behaviour::Answer { ms: 5 },
        }
    }

    /// Carries out flight `f`'s actions at time `now`, like the router's shell (with workers 0-3
    /// unified, 10-13 prefill, 20-23 decode).
    fn drive(&mut self, f: usize, now: Duration) {
        loop {
            let Some(a) = self.flights[f].poll_action() else { return };
            let rec = &mut self.records[f];
            if !rec.finishes.is_empty() {
                rec.after_finish += 1;
                continue;
            }
            match a {
                Action::OpenLeg { leg, kind, exclude, pinned, .. } => {
                    let base = match kind {
                        LegKind::Main => 0,
                        LegKind::Prefill => 10,
                        LegKind::Decode => 20,
                    };
                    let cands: Vec<u32> = (base..base + 4).filter(|w| !exclude.contains(w)).collect();
                    let worker = match pinned {
                        Some(w) => w,
                        None if cands.is_empty() || self.rng.chance(3) => {
                            self.records[f].cause = Some("no_worker");
                            let reason = "no worker".to_owned();
                            self.flights[f].handle_leg_failed(leg, LegFailure::NoWorker { reason });
                            continue;
                        }
                        None => cands[self.rng.below(cands.len() as u64) as usize],
                    };
                    let b = self.draw(kind);
                    self.behaviour.insert((f, leg.0), b);
                    if b == Behaviour::Refuse {
                        self.records[f].cause = Some("refused");
                        let reason = "refused".to_owned();
                        self.flights[f].handle_leg_failed(leg, LegFailure::Refused { worker, reason });
                        continue;
                    }
                    let t = self.epoch + now;
                    self.flights[f].handle_leg_sent(leg, worker, t);
                    let req = self.flights[f].leg_request(kind, "w", None, None, t);
                    let req = String::from_utf8_lossy(&req).into_owned();
                    let marks = req.contains("x-pdserve-resumable: 1");
                    let body = req.split("\r\n\r\n").nth(1).unwrap_or("");
                    // A decode leg carries the prefill worker's handle, unless the decode worker
                    // computes the prompt itself.
                    let handle = body.contains("pd_transfer");
                    let plan = self.flights[f].plan();
                    assert_eq!(
                        handle,
                        kind == LegKind::Decode && plan == Plan::Disaggregated,
                        "flight {f}: a {kind:?} leg under {plan:?}: {body}"
                    );
                    if kind == LegKind::Prefill && self.plans[f] == Plan::DecodeLocal {
                        self.records[f].fell_back = true;
                    }
                    let had = serde_json::from_str::<serde_json::Value>(body)
                        .ok()
                        .and_then(|v| v["pd_resume"]["tokens"].as_array().map(Vec::len))
                        .unwrap_or(0);
                    self.records[f].resume.insert(leg.0, (marks, had));
                    let rec = &mut self.records[f];
                    rec.last_status = None;
                    rec.legs.insert(leg.0, (worker, false));
                    rec.kinds.insert(leg.0, kind);
                    rec.last_leg = Some(leg);
                    let open = rec.legs.values().filter(|(_, ended)| !ended).count();
                    rec.open_at_once_max = rec.open_at_once_max.max(open);
                    let sse = self.streaming[f] && kind != LegKind::Prefill;
                    // A stream with resume marks: tokens numbered on from what the client has.
                    let marked = |from: usize, n: usize| {
                        let mut out = String::new();
                        for t in from + 1..=from + n {
                            out.push_str(&format!("data: {{\"t\":{t}}}\n\n: pdserve-tokens 5 {t}\n\n"));
                        }
                        out.into_bytes()
                    };
                    let (marks, had) = (marks && sse, had);
                    match b {
                        Behaviour::Answer { ms } => {
                            let t = now + Duration::from_millis(ms);
                            self.at(t, f, Ev::Head { leg, status: 200, sse, marks });
                            let body = if kind == LegKind::Prefill {
                                HANDLE_ANSWER.to_vec()
                            } else if marks {
                                let mut b = marked(had, 3);
                                b.extend_from_slice(b"data: [DONE]\n\n");
                                b
                            } else if sse {
                                b"data: {\"x\":1}\n\ndata: [DONE]\n\n".to_vec()
                            } else {
                                b"{\"choices\":[]}".to_vec()
                            };
                            self.at(t, f, Ev::Data { leg, bytes: body });
                            self.at(t + Duration::from_millis(1), f, Ev::End { leg });
                        }
                        Behaviour::Stale => {
                            self.at(now, f, Ev::Failed { leg, failure: LegFailure::Stale });
                        }
                        Behaviour::Die { ms } => {
                            let t = now + Duration::from_millis(ms);
                            self.at(t, f, Ev::Head { leg, status: 200, sse, marks });
                            if marks {
                                self.at(t, f, Ev::Data { leg, bytes: marked(had, 1) });
                            }
                            self.at(t, f, Ev::Data { leg, bytes: b"data: {\"x\"".to_vec() });
                            let failure = LegFailure::Broken { reason: "reset".into() };
                            self.at(t + Duration::from_millis(1), f, Ev::Failed { leg, failure });
                        }
                        // Streams a token, then goes quiet: with a stall timeout the flight moves on.
                        Behaviour::Stall if marks => {
                            let t = now + Duration::from_millis(2);
                            self.at(t, f, Ev::Head { leg, status: 200, sse, marks });
                            self.at(t, f, Ev::Data { leg, bytes: marked(had, 1) });
                        }
                        Behaviour::Stall => {}
                        Behaviour::Error { status, ms } => {
                            let t = now + Duration::from_millis(ms);
                            self.at(t, f, Ev::Head { leg, status, sse: false, marks: false });
                            let kind = match status {
                                429 => "queue_full",
                                503 => "no_capacity",
                                _ => "x",
                            };
                            let body =
                                format!(r#"{{"error":{{"type":"{kind}","message":"m","code":{status}}}}}"#);
                            self.at(t, f, Ev::Data { leg, bytes: body.into_bytes() });
                            self.at(t, f, Ev::End { leg });
                        }
                        Behaviour::NoHandle => {
                            self.at(
                                now + Duration::from_millis(2),
                                f,
                                Ev::Head { leg, status: 200, sse: false, marks: false },
                            );
                            self.at(
                                now + Duration::from_millis(2),
                                f,
                                Ev::Data { leg, bytes: b"{}".to_vec() },
                            );
                            self.at(now + Duration::from_millis(3), f, Ev::End { leg });
                        }
                        Behaviour::Refuse => unreachable!(),
                    }
                }
                Action::StartStream { .. } => {
                    assert!(rec.responses.is_empty() && !rec.stream_started, "flight {f}: a second answer");
                    rec.stream_started = true;
                }
                Action::Forward(bytes) => {
                    assert!(
                        rec.stream_started && rec.stream_ended == 0,
                        "flight {f}: bytes outside a stream"
                    );
                    rec.stream_bytes.extend_from_slice(&bytes);
                }
                Action::EndStream => rec.stream_ended += 1,
                Action::Respond(r) => {
                    assert!(!rec.stream_started, "flight {f}: a response after its stream started");
                    rec.responses.push(r.status);
                }
                Action::CloseLeg { leg } => {
                    let l = rec.legs.get_mut(&leg.0).expect("closes a leg it sent");
                    assert!(!l.1, "flight {f}: leg {} closed after it ended", leg.0);
                    l.1 = true;
                }
                Action::Abort { worker, .. } => {
                    rec.aborts.insert(worker);
                }
                Action::Stage { stage, .. } => rec.stage = Some(stage),
                Action::Finished(fin) => {
                    rec.finishes.push(fin);
                    rec.finished_at = Some(now);
                }
            }
        }
    }

    fn deliver(&mut self, f: usize, ev: Ev, now: Duration) {
        let t = self.epoch + now;
        if !self.records[f].finishes.is_empty() {
            return; // the shell drops a finished flight and what comes for it
        }
        let cause = match &ev {
            Ev::Head { .. } | Ev::Data { .. } => "data",
            Ev::End { .. } => "end",
            Ev::Failed { failure: LegFailure::Stale, .. } => "stale",
            Ev::Failed { .. } => "broken",
            Ev::ClientGone => "client",
            Ev::Deadline => "deadline",
            Ev::StallCheck => "stall",
        };
        self.records[f].last_leg = match &ev {
            Ev::Head { leg, .. } | Ev::Data { leg, .. } | Ev::End { leg } | Ev::Failed { leg, .. } => {
                Some(*leg)
            }
            Ev::ClientGone | Ev::Deadline | Ev::StallCheck => self.records[f].last_leg,
        };
        match ev {
            Ev::Head { leg, status, sse, marks } => {
                self.records[f].last_status = Some(status);
                let ct = if sse { "text/event-stream" } else { "application/json" };
                self.flights[f].handle_leg_head(leg, status, Some(ct), None, marks);
            }
            Ev::Data { leg, bytes } => self.flights[f].handle_leg_data(leg, &bytes, t),
            Ev::End { leg } => {
                let rec = &mut self.records[f];
                let l = rec.legs.get_mut(&leg.0).expect("a sent leg");
                if !l.1 {
                    l.1 = true;
                    if rec.last_status.is_some_and(|s| s >= 300) {
                        rec.answered_error.insert(leg.0);
                    }
                    self.flights[f].handle_leg_end(leg, t);
                }
            }
            Ev::Failed { leg, failure } => {
                let rec = &mut self.records[f];
                if failure == LegFailure::Stale {
                    rec.stale_legs.insert(leg.0);
                }
                let l = rec.legs.get_mut(&leg.0).expect("a sent leg");
                if !l.1 {
                    l.1 = true;
                    self.flights[f].handle_leg_failed(leg, failure);
                }
            }
            Ev::ClientGone => {
                self.records[f].client_left = true;
                self.flights[f].handle_cancel(true);
            }
            Ev::Deadline => self.flights[f].handle_timeout(t),
            Ev::StallCheck => self.flights[f].handle_stall(t),
        }
        self.records[f].cause = Some(cause);
        self.drive(f, now);
        if let Some(d) = self.flights[f].stall_deadline() {
            self.at(d.duration_since(self.epoch), f, Ev::StallCheck);
        }
    }
}

#[derive(Debug, Default)]
struct Tally {
    by_outcome: BTreeMap<&'static str, usize>,
    /// Kinds of flight and end that must each have happened for the run to prove anything.
    cases: BTreeMap<&'static str, usize>,
}

fn run(seed: u64, flights: usize) -> Tally {
    let epoch = Instant::now();
    let mut w = World {
        rng: Rng(seed | 1),
        flights: Vec::new(),
        records: Vec::new(),
        starts: Vec::new(),
        queue: BTreeMap::new(),
        seq: 0,
        streaming: Vec::new(),
        plans: Vec::new(),
        behaviour: HashMap::new(),
        epoch,
    };
    for i in 0..flights {
        let start = Duration::from_millis(w.rng.below(2_000));
        let deadline = start + Duration::from_millis(20 + w.rng.below(400));
        let (purpose, plan) = match w.rng.below(100) {
            0..=4 => (Purpose::HealthGenerate, Plan::Unified),
            5..=9 => {
                (Purpose::PairProbe { prefill: 10 + w.rng.below(4) as u32, decode: 20 }, Plan::Disaggregated)
            }
            10..=14 => (Purpose::Client, Plan::Forward),
            r if r < 45 => (Purpose::Client, Plan::Unified),
            r if r < 65 => (Purpose::Client, Plan::DecodeLocal),
            _ => (Purpose::Client, Plan::Disaggregated),
        };
        let client = !matches!(purpose, Purpose::PairProbe { .. });
        let get = plan == Plan::Forward;
        let stream = !get && client && w.rng.chance(50);
        let spec = FlightSpec {
            request_id: format!("r{i}"),
            purpose,
            method_get: get,
            path: if get { "/v1/models".into() } else { "/v1/chat/completions".into() },
            body: if get {
                Vec::new()
            } else {
                format!(r#"{{"messages":[],"stream":{stream}}}"#).into_bytes()
            },
            prompt: String::new(),
            received: epoch + start,
            deadline: epoch + deadline,
            retries_max: 2,
            // Now and then an answer over the bound: the flight must give up on it.
            body_bytes_max: if w.rng.chance(4) { 8 } else { 1 << 20 },
            migrations_max: if w.rng.chance(50) { 2 } else { 0 },
            stall_timeout: w.rng.chance(50).then(|| Duration::from_millis(30)),
        };
        w.flights.push(Flight::new(spec, client));
        w.records.push(Record { client, ..Record::default() });
        w.starts.push(start);
        w.streaming.push(stream);
        w.plans.push(plan);
        w.at(deadline, i, Ev::Deadline);
        if client && w.rng.chance(15) {
            let gone = start + Duration::from_millis(w.rng.below(300));
            w.at(gone, i, Ev::ClientGone);
        }
    }
    // Admission: each flight is dispatched at its start, unified or disaggregated.
    let mut order: Vec<usize> = (0..flights).collect();
    order.sort_by_key(|&i| w.starts[i]);
    let mut next = 0;
    let mut steps = 0;
    loop {
        steps += 1;
        assert!(steps < 1_000_000, "livelock");
        let due_start = order.get(next).map(|&i| w.starts[i]);
        let due_ev = w.queue.keys().next().map(|k| k.0);
        match (due_start, due_ev) {
            (Some(s), e) if e.is_none_or(|e| s <= e) => {
                let f = order[next];
                next += 1;
                let plan = w.plans[f];
                w.flights[f].handle_dispatch(plan);
                w.records[f].cause = Some("dispatch");
                w.drive(f, s);
            }
            (_, Some(_)) => {
                let (&(t, k), _) = w.queue.iter().next().unwrap();
                let (f, ev) = w.queue.remove(&(t, k)).unwrap();
                w.deliver(f, ev, t);
            }
            (None, None) => break,
            _ => unreachable!(),
        }
    }
    let mut tally = Tally::default();
    for (f, rec) in w.records.iter().enumerate() {
        let spec = w.flights[f].spec();
        assert_eq!(rec.finishes.len(), 1, "flight {f} finished {} times: {rec:?}", rec.finishes.len());
        assert_eq!(rec.after_finish, 0, "flight {f}: actions after Finished");
        let fin = &rec.finishes[0];
        *tally.by_outcome.entry(fin.outcome.as_str()).or_default() += 1;
        // Marks never reach the client; a completed marked stream has every token once, in order.
        let text = String::from_utf8_lossy(&rec.stream_bytes);
        assert!(!text.contains("pdserve-"), "flight {f}: a resume mark reached the client: {text}");
        let marked = rec.resume.values().any(|&(m, _)| m) && w.streaming[f];
        if marked && fin.outcome == Outcome::Completed {
            let tokens: Vec<usize> =
                text.split("{\"t\":").skip(1).filter_map(|t| t.split('}').next()?.parse().ok()).collect();
            let expected: Vec<usize> = (1..=tokens.len()).collect();
            assert_eq!(tokens, expected, "flight {f}: tokens lost or repeated: {text}");
            assert!(tokens.len() >= 3 && text.ends_with("data: [DONE]\n\n"), "flight {f}: {text}");
        }
        assert!(fin.migrations.len() <= spec.migrations_max as usize, "flight {f}: {:?}", fin.migrations);
        if fin.migrations.contains(&pdserve_router::flight::Migration::Stalled) {
            *tally.cases.entry("stalled").or_default() += 1;
        }
        if rec.fell_back {
            // Only a first leg that did not do its work sends a decode-local request on through prefill.
            let first = w.behaviour.get(&(f, 0)).copied();
            *tally
                .cases
                .entry(if fin.migrations.is_empty() { "local_fell_back" } else { "local_migrated" })
                .or_default() += 1;
            assert!(
                !matches!(first, Some(Behaviour::Answer { .. })),
                "flight {f}: fell back after an answer: {rec:?}"
            );
        }
        if !fin.migrations.is_empty() {
            *tally
                .cases
                .entry(if fin.outcome == Outcome::Completed {
                    "migrated_completed"
                } else {
                    "migrated_other"
                })
                .or_default() += 1;
        }
        let case = match (spec.purpose, w.plans[f], rec.cause) {
            (Purpose::PairProbe { .. }, _, _) => "pair_probe",
            (_, Plan::Forward, _) => "forward",
            (_, _, Some("data")) if fin.outcome == Outcome::Failed => "answer_too_big",
            (_, _, Some("stale")) => "stale_twice",
            _ => "other",
        };
        *tally.cases.entry(case).or_default() += 1;
        // By its deadline.
        let deadline = spec.deadline.duration_since(epoch);
        assert!(rec.finished_at.unwrap() <= deadline, "flight {f} ended after its deadline: {rec:?}");
        // One answer to a client that stayed; none where there is no client.
        let answers = rec.responses.len() + usize::from(rec.stream_started);
        if !rec.client {
            assert_eq!((answers, fin.status), (0, 0), "flight {f}: a probe has no one to answer");
        } else if rec.client_left {
            assert!(answers <= 1, "flight {f}: {answers} answers");
            assert!(fin.outcome == Outcome::Cancelled || rec.cause != Some("client"), "{rec:?}");
        } else {
            assert_eq!(answers, 1, "flight {f}: {answers} answers: {rec:?}");
            if rec.stream_started {
                assert_eq!(
                    rec.stream_ended, 1,
                    "flight {f}: the stream was ended {} times",
                    rec.stream_ended
                );
                assert_eq!(fin.status, 200);
            } else {
                assert_eq!(fin.status, rec.responses[0], "flight {f}: finish and answer disagree");
            }
        }
        // Legs: at most one open at a time, each ended or closed.
        assert!(rec.open_at_once_max <= 1, "flight {f}: {} legs open at once", rec.open_at_once_max);
        for (leg, (worker, ended)) in &rec.legs {
            assert!(ended, "flight {f}: leg {leg} at worker {worker} neither ended nor closed: {rec:?}");
        }
        // The stage it ended in is the last one it announced (the router's queue if none), and a
        // failed leg's own stage.
        assert_eq!(fin.stage, rec.stage.unwrap_or(Stage::RouterQueued), "flight {f}: {rec:?}");
        if matches!(rec.cause, Some("broken" | "stale" | "data")) && fin.outcome == Outcome::Failed {
            let kind = rec.last_leg.and_then(|l| rec.kinds.get(&l.0)).copied();
            let expected = match kind {
                Some(LegKind::Prefill) => Stage::Prefilling,
                // (A later try's leg streams only once its own head says so.)
                _ if rec.stream_started && rec.last_status == Some(200) => Stage::Streaming,
                _ => Stage::Decoding,
            };
            assert_eq!(fin.stage, expected, "flight {f}: a failed {kind:?} leg: {rec:?}");
        }
        // The status its cause calls for.
        let error_text = String::from_utf8_lossy(&rec.stream_bytes);
        let failed_status = match (rec.client, spec.purpose) {
            (false, _) => 0,
            (true, Purpose::HealthGenerate) => 503,
            _ if rec.stream_started => 200,
            _ => 502,
        };
        match (rec.cause, fin.outcome) {
            (Some("deadline"), o) => {
                assert_eq!(o, Outcome::TimedOut, "flight {f}: {rec:?}");
                if rec.stream_started {
                    // The error events, unless the worker's own `[DONE]` had already gone out.
                    assert!(error_text.ends_with("data: [DONE]\n\n"), "{error_text}");
                    let worker_done =
                        error_text.matches("[DONE]").count() == 1 && !error_text.contains("\"error\"");
                    assert!(error_text.contains("deadline_exceeded") || worker_done, "{error_text}");
                } else if !rec.client {
                    assert_eq!(fin.status, 0);
                } else if spec.purpose == Purpose::Client {
                    assert_eq!(fin.status, 504);
                } else {
                    assert_eq!(fin.status, 503, "a health probe answers 503 with the reason");
                }
            }
            (Some("client"), o) => assert_eq!(o, Outcome::Cancelled, "flight {f}"),
            (Some("stall"), o) => {
                assert_eq!((o, fin.status), (Outcome::Failed, failed_status), "flight {f}: {rec:?}");
            }
            (Some("no_worker" | "refused"), o) => {
                let status = match () {
                    _ if !rec.client => 0,
                    _ if rec.stream_started => 200,
                    _ => 503,
                };
                assert_eq!((o, fin.status), (Outcome::Rejected, status), "flight {f}");
            }
            (Some("broken" | "stale"), o) => {
                assert_eq!((o, fin.status), (Outcome::Failed, failed_status), "flight {f}: {rec:?}");
                if rec.stream_started {
                    assert!(error_text.contains("upstream_failed"), "{error_text}");
                }
            }
            (Some("end"), Outcome::Completed) => {
                // Only the workers it moved away from were told to drop it.
                assert!(
                    rec.aborts.is_empty() || !fin.migrations.is_empty(),
                    "flight {f}: aborts after completing"
                )
            }
            (Some("end"), _) => {}
            (Some("dispatch"), o) => {
                assert!(matches!(o, Outcome::Rejected | Outcome::Failed), "flight {f}: {o:?} {rec:?}");
            }
            (Some("data"), o) => {
                // An answer over `body_bytes_max`: the worker's bytes are not forwarded.
                assert_eq!((o, fin.status), (Outcome::Failed, failed_status), "flight {f}: {rec:?}");
            }
            (cause, o) => panic!("flight {f}: finished by {cause:?} as {o:?}"),
        }
        // Aborts at every worker the request reached, unless it completed or the worker ended it.
        // A worker sent a new leg holds the request again, whatever it answered before: what counts is
        // the last leg that reached it.
        if fin.outcome != Outcome::Completed {
            let mut last: BTreeMap<u32, u32> = BTreeMap::new();
            for (leg, (w, _)) in rec.legs.iter().filter(|(leg, _)| !rec.stale_legs.contains(leg)) {
                last.insert(*w, *leg);
            }
            for (worker, leg) in &last {
                if !rec.answered_error.contains(leg) {
                    assert!(
                        rec.aborts.contains(worker),
                        "flight {f}: worker {worker} was never told to abort: {rec:?}"
                    );
                }
            }
        }
    }
    tally
}

#[test]
fn thousands_of_flights_end_exactly_once_and_leave_nothing_behind() {
    let mut total = Tally::default();
    for seed in 1..=8 {
        let t = run(seed * 7919, 1_500);
        for (k, v) in t.by_outcome {
            *total.by_outcome.entry(k).or_default() += v;
        }
        for (k, v) in t.cases {
            *total.cases.entry(k).or_default() += v;
        }
    }
    for c in [
        "pair_probe",
        "forward",
        "answer_too_big",
        "stale_twice",
        "migrated_completed",
        "migrated_other",
        "stalled",
        "local_fell_back",
        "local_migrated",
    ] {
        assert!(total.cases.get(c).copied().unwrap_or(0) > 20, "{c}: {:?}", total.cases);
    }
    // Every kind of end happened, so every path above was checked.
    for o in ["completed", "rejected", "cancelled", "timed_out", "failed"] {
        assert!(total.by_outcome.get(o).copied().unwrap_or(0) > 50, "{o}: {:?}", total.by_outcome);
    }
}
