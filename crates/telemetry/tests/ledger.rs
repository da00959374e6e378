//! The request ledger and its watchdog scan, on a virtual clock.

use std::time::{Duration, Instant};

use pdserve_api::Stage;
use pdserve_telemetry::{RequestLedger, TelemetryError};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn lifecycle_and_debug_json() {
    let t0 = Instant::now();
    let mut l = RequestLedger::new("decode-0", 16);
    l.admit("req-a", Stage::DecodeQueued, t0, t0 + ms(10_000), "http://127.0.0.1:8102").unwrap();
    l.admit("req-b", Stage::PrefillQueued, t0 + ms(100), t0 + ms(500), "").unwrap();
    l.set_stage("req-a", Stage::Decoding, t0 + ms(300)).unwrap();
    l.set_counts("req-a", 412, 37, 27).unwrap();
    // Re-entering the same stage keeps its clock.
    l.set_stage("req-a", Stage::Decoding, t0 + ms(900)).unwrap();

    let now = t0 + ms(1000);
    let v = l.debug_json(now, 1_733_000_000_000, Duration::ZERO);
    assert_eq!(v["process"], "decode-0");
    assert_eq!(v["now_ms"], 1_733_000_000_000u64);
    let reqs = v["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 2);
    // Oldest first.
    assert_eq!(reqs[0]["id"], "req-a");
    assert_eq!(reqs[0]["stage"], "decoding");
    assert_eq!(reqs[0]["stage_age_ms"], 700);
    assert_eq!(reqs[0]["age_ms"], 1000);
    assert_eq!(reqs[0]["deadline_ms"], 9000);
    assert_eq!(reqs[0]["worker"], "http://127.0.0.1:8102");
    assert_eq!(
        (reqs[0]["tokens_in"].as_u64(), reqs[0]["tokens_out"].as_u64(), reqs[0]["kv_blocks"].as_u64()),
        (Some(412), Some(37), Some(27))
    );
    assert_eq!(reqs[1]["deadline_ms"], -500);
    assert!(reqs[0].get("waiting_for").is_none());

    // What a queued request waits for, per request and per stage: the stage's oldest request, how
    // long it has been there.
    l.admit("req-c", Stage::PrefillQueued, t0 + ms(400), t0 + ms(9000), "").unwrap();
    l.set_waiting("req-b", Some("kv_blocks")).unwrap();
    let v = l.debug_json(now, 0, Duration::ZERO);
    assert_eq!(v["requests"][1]["waiting_for"], "kv_blocks");
    assert_eq!(
        v["stages"],
        serde_json::json!({
            "prefill_queued": {"requests": 2, "oldest_ms": 900, "oldest_id": "req-b", "waiting_for": "kv_blocks"},
            "decoding": {"requests": 1, "oldest_ms": 700, "oldest_id": "req-a"},
        })
    );
    l.finish("req-c");

    // `older_than` filters by age.
    let v = l.debug_json(now, 0, ms(950));
    assert_eq!(v["requests"].as_array().unwrap().len(), 1);

    assert_eq!(l.finish("req-a").unwrap().tokens_out, 37);
    assert_eq!(l.finish("req-a"), None);
    assert_eq!(l.len(), 1);
}

#[test]
fn watchdog_reports_what_passed_its_deadline_most_overdue_first() {
    let t0 = Instant::now();
    let mut l = RequestLedger::new("prefill-0", 16);
    l.admit("late", Stage::Prefilling, t0, t0 + ms(100), "").unwrap();
    l.admit("later", Stage::KvHeld, t0, t0 + ms(50), "").unwrap();
    l.admit("fine", Stage::Prefilling, t0, t0 + ms(5000), "").unwrap();
    assert!(l.overdue(t0 + ms(49)).is_empty());
    let due = l.overdue(t0 + ms(200));
    let ids: Vec<(&str, Stage, u128)> =
        due.iter().map(|o| (o.id.as_str(), o.stage, o.overdue_by.as_millis())).collect();
    assert_eq!(ids, [("later", Stage::KvHeld, 150), ("late", Stage::Prefilling, 100)]);
    for o in due {
        l.finish(&o.id);
    }
    assert!(l.overdue(t0 + ms(200)).is_empty());
    assert_eq!(l.len(), 1);
}

#[test]
fn bounded_and_explicit_errors() {
    let t0 = Instant::now();
    let mut l = RequestLedger::new("router", 2);
    l.admit("a", Stage::RouterQueued, t0, t0, "").unwrap();
    assert_eq!(
        l.admit("a", Stage::RouterQueued, t0, t0, ""),
        Err(TelemetryError::DuplicateRequest { id: "a".into() })
    );
    l.admit("b", Stage::RouterQueued, t0, t0, "").unwrap();
    assert_eq!(
        l.admit("c", Stage::RouterQueued, t0, t0, ""),
        Err(TelemetryError::LedgerFull { capacity: 2 })
    );
    assert_eq!(
        l.set_stage("zz", Stage::Decoding, t0),
        Err(TelemetryError::UnknownRequest { id: "zz".into() })
    );
    let names: Vec<&str> = Stage::ALL.iter().map(|s| s.as_str()).collect();
    assert_eq!(
        names,
        [
            "router_queued",
            "prefill_queued",
            "prefilling",
            "kv_held",
            "kv_transfer",
            "decode_queued",
            "decoding",
            "streaming",
            "migrating"
        ]
    );
}
