//! The selection policies on table-like scenarios.

use pdserve_router::*;

fn workers(loads: &[u32]) -> Vec<Candidate> {
    loads.iter().enumerate().map(|(i, &l)| Candidate { worker: i as u32, outstanding: l }).collect()
}

#[test]
fn round_robin_cycles() {
    let mut p = RoundRobin::default();
    let w = workers(&[5, 0, 9]);
    let picks: Vec<usize> = (0..6).map(|_| p.pick(&w, "")).collect();
    assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
}

#[test]
fn least_outstanding_takes_the_idlest_first_on_ties() {
    let mut p = LeastOutstanding;
    assert_eq!(p.pick(&workers(&[3, 1, 1, 2]), ""), 1);
    assert_eq!(p.pick(&workers(&[0]), ""), 0);
}

#[test]
fn power_of_two_never_picks_the_busiest_of_two_and_spreads_load() {
    let mut p = PowerOfTwo::new(42);
    assert_eq!(p.pick(&workers(&[9]), ""), 0);
    let w = workers(&[100, 0]);
    assert!((0..50).all(|_| p.pick(&w, "") == 1), "of two, the idle one always wins");
    let w = workers(&[0, 0, 0, 0]);
    let mut counts = [0; 4];
    for _ in 0..4000 {
        counts[p.pick(&w, "")] += 1;
    }
    assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
}

#[test]
fn cache_aware_follows_prefixes_until_the_load_is_imbalanced() {
    let mut p = CacheAware::new(CacheAwareConfig {
        balance_abs_threshold: 4,
        balance_rel_threshold: 2.0,
        ..Default::default()
    });
    let system = "You are a meticulous assistant that answers questions about astronomy with care. ";
    let w = workers(&[0, 0, 0]);
    let first = p.pick(&w, &format!("{system}What is a pulsar?"));
    p.routed(first as u32, &format!("{system}What is a pulsar?"));
    // A different prompt goes to a worker that has cached nothing yet.
    let other = "Translate into French: the cat sleeps on the warm windowsill all afternoon.";
    let second = p.pick(&w, other);
    assert_ne!(second, first);
    p.routed(second as u32, other);
    // The shared system prompt goes back to the first worker ...
    assert_eq!(p.pick(&w, &format!("{system}How far is Vega?")), first);
    // ... unless that worker is overloaded, when the idlest wins.
    let mut loads = vec![0; 3];
    loads[first] = 20;
    let idle = (0..3).find(|&i| i != first && i != second).unwrap();
    loads[second] = 1;
    assert_eq!(p.pick(&workers(&loads), &format!("{system}How far is Vega?")), idle);
    // A removed worker's tree is forgotten.
    p.forget(first as u32);
    let w2 = workers(&[0, 0, 0]);
    let again = p.pick(&w2, &format!("{system}How far is Vega?"));
    assert_ne!(again, second, "the translation worker holds no astronomy prefix");
}

#[test]
fn cache_aware_memory_is_bounded() {
    let mut p =
        CacheAware::new(CacheAwareConfig { nodes_per_worker_max: 64, chunk_bytes: 4, ..Default::default() });
    let w = workers(&[0, 0]);
    let prompt = |i: usize| format!("prompt number {i:04} with some text that differs {i:04}");
    // Everything goes to worker 0: far more chunks than its tree may hold.
    for i in 0..1000 {
        p.routed(0, &prompt(i));
    }
    // The latest prefix is remembered; the oldest was dropped when the bounded tree started over, so
    // its prompt now goes to the worker that has cached the least.
    assert_eq!(p.pick(&w, &prompt(999)), 0);
    assert_eq!(p.pick(&w, &prompt(0)), 1);
}
