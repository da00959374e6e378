//! A subscriber that stops reading costs the publisher nothing: its own batches are dropped (counted)
//! once its queue and socket are full, `publish` never waits, and a subscriber beside it that reads
//! gets every batch in order.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pdserve_kv_events::{KvEvent, KvEventsConfig, Publisher, Subscription};

#[test]
fn a_subscriber_that_stops_reading_loses_its_batches_counted_and_holds_up_no_one() {
    let cfg = KvEventsConfig::parse(
        r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "topic": "kv", "hwm": 8}"#,
    )
    .unwrap()
    .unwrap();
    let p = Publisher::start(&cfg).unwrap();
    let wait = Duration::from_secs(10);
    let at = std::net::SocketAddr::from(([127, 0, 0, 1], p.pub_addr().unwrap().port()));
    let mut reader = Subscription::connect(at, b"kv", wait).unwrap();
    let _stalled = Subscription::connect(at, b"kv", wait).unwrap();
    // Both subscriptions in place: ZMQ's PUB drops what comes before.
    let until = Instant::now() + wait;
    while p.stats().subscribers.load(Ordering::Relaxed) < 2 {
        assert!(Instant::now() < until, "the subscribers never connected");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));

    // Batches of 64 KiB of token ids, well past what the stalled subscriber's socket buffers hold.
    let batch = |i: u64| vec![KvEvent::stored(vec![i], None, (0..16_384).collect(), 16_384)];
    let (mut seqs, mut slowest) = (Vec::new(), Duration::ZERO);
    for i in 0..600u64 {
        let t = Instant::now();
        assert!(p.publish(batch(i)), "batch {i} dropped before numbering");
        slowest = slowest.max(t.elapsed());
        // The reader takes each batch before the next is published (its own queue never fills).
        let b = loop {
            match reader.next(wait).unwrap() {
                Some(b) => break b,
                None => assert!(Instant::now() < t + wait, "batch {i} never reached the reader"),
            }
        };
        assert_eq!(b.events.len(), 1);
        seqs.push(b.seq);
    }
    let first = seqs[0];
    assert_eq!(seqs, (first..first + 600).collect::<Vec<_>>(), "the reader got every batch, in order");
    let dropped = p.stats().subscriber_batches_dropped.load(Ordering::Relaxed);
    assert!(dropped > 0, "nothing counted as dropped for the subscriber that never read");
    assert!(slowest < Duration::from_secs(1), "publish waited {slowest:?}");
}
