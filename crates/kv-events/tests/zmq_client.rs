//! A real ZMQ subscriber (pyzmq, libzmq inside) reading a publisher's batches and decoding them with
//! msgspec in vLLM's event schema, field by field; its replay socket asked for what it missed.

mod subscriber;

use std::time::{Duration, Instant};

use pdserve_kv_events::{KvEvent, KvEventsConfig, PubEndpoint, Publisher};
use subscriber::Subscriber;

/// Publishes `AllBlocksCleared` every 50 ms until the subscriber has one (its subscription is then in
/// place: ZMQ's PUB drops what comes before), then says which sequence it got.
fn until_subscribed(p: &Publisher, s: &Subscriber) -> u64 {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        p.publish(vec![KvEvent::AllBlocksCleared]);
        if let Some(v) = s.try_next(Duration::from_millis(50)) {
            assert!(v["decode_error"].is_null(), "{v}");
            return v["seq"].as_u64().unwrap();
        }
        assert!(Instant::now() < until, "no batch reached the subscriber in 30 s");
    }
}

#[test]
fn a_libzmq_subscriber_decodes_the_events_in_vllm_schema_and_replays() {
    let cfg = KvEventsConfig::parse(
        r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0",
            "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv@pod-7@smol", "buffer_steps": 1000}"#,
    )
    .unwrap()
    .unwrap();
    let p = Publisher::start(&cfg).unwrap();
    let pub_addr = format!("127.0.0.1:{}", p.pub_addr().unwrap().port());
    let replay_addr = p.replay_addr().unwrap().to_string();
    let mut s = Subscriber::start(&pub_addr, &replay_addr, "kv@");
    let first = until_subscribed(&p, &s);
    while s.try_next(Duration::from_millis(200)).is_some() {} // probes still in flight
    let tokens: Vec<u32> = (100..132).collect();
    p.publish(vec![
        KvEvent::stored(vec![u64::MAX - 1, 7], None, tokens.clone(), 16),
        KvEvent::stored(vec![9], Some(7), (500..516).collect(), 16),
    ]);
    p.publish(vec![KvEvent::removed(vec![9, 7]), KvEvent::AllBlocksCleared]);
    let a = s.next(Duration::from_secs(10));
    let b = s.next(Duration::from_secs(10));
    assert_eq!(b["seq"].as_u64(), a["seq"].as_u64().map(|x| x + 1), "consecutive sequence numbers");
    assert_eq!((a["topic"].as_str(), a["rank"].as_u64()), (Some("kv@pod-7@smol"), Some(0)));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!((a["ts"].as_f64().unwrap() - now).abs() < 60.0);
    let e = &a["events"][0];
    assert_eq!(e["type"], "BlockStored");
    assert_eq!(e["block_hashes"], serde_json::json!([u64::MAX - 1, 7]));
    assert!(e["parent_block_hash"].is_null());
    assert_eq!(e["token_ids"], serde_json::json!(tokens));
    assert_eq!((e["block_size"].as_u64(), e["medium"].as_str()), (Some(16), Some("GPU")));
    assert!(e["lora_id"].is_null() && e["lora_name"].is_null() && e["group_idx"].is_null());
    assert_eq!(
        (a["events"][1]["parent_block_hash"].as_u64(), a["events"][1]["block_hashes"][0].as_u64()),
        (Some(7), Some(9))
    );
    assert_eq!(b["events"][0]["type"], "BlockRemoved");
    assert_eq!(b["events"][0]["block_hashes"], serde_json::json!([9, 7]));
    assert_eq!(b["events"][1]["type"], "AllBlocksCleared");
    // Replay from the first probe the subscriber saw: every batch since, in order, then the end.
    s.send(&format!("replay {first}"));
    let mut seqs = Vec::new();
    loop {
        let v = s.next(Duration::from_secs(10));
        if v["replay_end"] == true {
            break;
        }
        assert_eq!(v["replay"], true, "{v}");
        seqs.push(v["seq"].as_u64().unwrap());
    }
    let last = b["seq"].as_u64().unwrap();
    assert_eq!(seqs, (first..=last).collect::<Vec<_>>());
    // A subscriber to another topic is sent nothing: the publisher filters by prefix, as ZMQ's PUB
    // does (so the batches written grow by one per batch: the first subscriber's).
    let other = Subscriber::start(&pub_addr, &replay_addr, "other");
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let until = Instant::now() + Duration::from_secs(10);
    while p.stats().subscribers.load(std::sync::atomic::Ordering::Relaxed) < 2 {
        assert!(Instant::now() < until, "the second subscriber never connected");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300)); // its subscription arrives
    let sent = load(&p.stats().subscriber_batches_sent);
    for _ in 0..5 {
        p.publish(vec![KvEvent::AllBlocksCleared]);
    }
    for _ in 0..5 {
        assert!(s.try_next(Duration::from_secs(5)).is_some(), "the first subscriber gets every batch");
    }
    assert!(other.try_next(Duration::from_millis(300)).is_none(), "a batch for another topic arrived");
    assert_eq!(load(&p.stats().subscriber_batches_sent) - sent, 5, "batches written to the other subscriber");
    assert_eq!(p.stats().batches_dropped.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// A queue that overflows drops batches (counted), and `publish` never blocks.
#[test]
fn a_full_queue_drops_and_counts() {
    let cfg = KvEventsConfig::parse(
        r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "max_queue_size": 1}"#,
    )
    .unwrap()
    .unwrap();
    let p = Publisher::start(&cfg).unwrap();
    let t = Instant::now();
    let sent = (0..10_000).filter(|_| p.publish(vec![KvEvent::AllBlocksCleared])).count();
    assert!(t.elapsed() < Duration::from_secs(5));
    let dropped = p.stats().batches_dropped.load(std::sync::atomic::Ordering::Relaxed) as usize;
    assert_eq!(sent + dropped, 10_000);
}

#[test]
fn the_config_is_vllms_and_mistakes_are_named() {
    assert_eq!(KvEventsConfig::parse("{}").unwrap(), None);
    assert_eq!(
        KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#).unwrap(),
        None
    );
    let c = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#).unwrap().unwrap();
    assert_eq!(
        (c.endpoint, c.replay_endpoint, c.topic.as_str()),
        (PubEndpoint::Bind("0.0.0.0:5557".parse().unwrap()), None, "")
    );
    // vLLM's rule: `*` or `::` binds, any other endpoint connects out.
    let endpoint = |e: &str| {
        KvEventsConfig::parse(&format!(r#"{{"enable_kv_cache_events": true, "endpoint": "{e}"}}"#))
            .map(|c| c.unwrap().endpoint)
    };
    assert_eq!(endpoint("tcp://[::]:5557"), Ok(PubEndpoint::Bind("[::]:5557".parse().unwrap())));
    assert_eq!(
        endpoint("tcp://indexer.llm-d.svc.cluster.local:5557"),
        Ok(PubEndpoint::Connect("indexer.llm-d.svc.cluster.local:5557".into()))
    );
    assert_eq!(endpoint("tcp://10.0.0.5:5557"), Ok(PubEndpoint::Connect("10.0.0.5:5557".into())));
    for (bad, says) in [
        (r#"{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:0"}"#, "tcp://*:PORT to bind"),
        (r#"{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}"#, "tcp://"),
        (r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#, "zmq or null"),
        (r#"{"enable_kv_cache_events": "yes"}"#, "true or false"),
        (r#"{"enable_kv_cache_events": true, "hwm": -1}"#, "positive integer"),
        (r#"{"enable_kv_cache_events": true, "topics": "x"}"#, "unknown key"),
    ] {
        let e = KvEventsConfig::parse(bad).unwrap_err();
        assert!(e.contains(says), "{bad}: {e}");
    }
}

/// An endpoint naming a host (vLLM's rule: neither `*` nor `::` in it) makes the publisher connect out
/// to a subscriber that binds there, as llm-d's indexer has vLLM pods do: a pyzmq SUB socket bound
/// to a port gets the batches, decoded in vLLM's schema.
#[test]
fn a_publisher_given_a_host_connects_out_to_a_subscriber_that_binds() {
    let (s, addr) = Subscriber::bound("kv@");
    let cfg = KvEventsConfig::parse(&format!(
        r#"{{"enable_kv_cache_events": true, "endpoint": "tcp://{addr}", "topic": "kv@pod-9@smol"}}"#
    ))
    .unwrap()
    .unwrap();
    assert_eq!(cfg.endpoint, PubEndpoint::Connect(addr.clone()));
    let p = Publisher::start(&cfg).unwrap();
    assert_eq!(p.pub_addr(), None, "nothing bound");
    let first = until_subscribed(&p, &s);
    assert_eq!(p.stats().subscribers.load(std::sync::atomic::Ordering::Relaxed), 1);
    p.publish(vec![KvEvent::stored(vec![11], None, (0..16).collect(), 16)]);
    let v = loop {
        let v = s.next(Duration::from_secs(10));
        if v["events"][0]["type"] == "BlockStored" {
            break v;
        }
    };
    assert!(v["seq"].as_u64().unwrap() > first, "{v}");
    assert_eq!(
        (v["topic"].as_str(), v["events"][0]["block_hashes"][0].as_u64()),
        (Some("kv@pod-9@smol"), Some(11))
    );
}
