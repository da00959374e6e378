//! The selection policies on table-like scenarios.

use pdserve_router::*;

fn workers(loads: &[u32]) -> Vec<Candidate> {
    loads.iter().enumerate().map(|(i, &l)| Candidate::new(i as u32, l)).collect()
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
    // The latest prefix is remembered; the oldest was forgotten (least recently used), so its prompt
    // now goes to the worker that has cached the least.
    assert_eq!(p.pick(&w, &prompt(999)), 0);
    assert_eq!(p.pick(&w, &prompt(0)), 1);
}

#[test]
fn cache_aware_forgets_old_branches_first_and_keeps_a_prefix_in_use() {
    let max = 256;
    let mut p =
        CacheAware::new(CacheAwareConfig { nodes_per_worker_max: max, chunk_bytes: 8, ..Default::default() });
    let w = workers(&[0, 0]);
    let system = "You are an agent with tools: read_file, write_file, run_tests. Follow the plan. ";
    let agent = |i: usize| format!("{system}Task {i:05}: inspect module {i:05} and report its tests.");
    // An agent harness: every request shares the system prompt; the tasks differ.
    for i in 0..2_000 {
        p.routed(0, &agent(i));
        assert!(p.remembered(0) <= max, "the tree outgrew its bound: {}", p.remembered(0));
    }
    // The shared prefix is in every request, so it is never the least recently used: still matched.
    assert_eq!(p.pick(&w, &agent(5_000)), 0);
    let c = p.last_choice().unwrap();
    assert_eq!((c.worker, c.rule), (0, "cache_match"));
    assert!(c.matched[0].1 >= system.len() - 8, "{c:?}");
    assert_eq!(c.matched[1], (1, 0));
    // The latest task is remembered whole; the first ones were forgotten.
    p.pick(&w, &agent(1_999));
    assert_eq!(p.last_choice().unwrap().matched[0].1, agent(1_999).len());
    p.pick(&w, &agent(0));
    assert!(p.last_choice().unwrap().matched[0].1 < agent(0).len());
}

#[test]
fn cache_aware_forgets_whole_old_conversations_before_any_part_of_a_recent_one() {
    let max = 400;
    let mut p =
        CacheAware::new(CacheAwareConfig { nodes_per_worker_max: max, chunk_bytes: 8, ..Default::default() });
    let w = workers(&[0, 0]);
    // Conversations grow as long chains: each round resends the last one and adds to it.
    let conversation = |c: usize, rounds: usize| -> String {
        (0..rounds)
            .map(|r| format!("Conversation {c:03}, round {r:02}: read file {c}-{r} and go on. "))
            .collect()
    };
    for c in 0..20 {
        for r in 1..=3 {
            p.routed(0, &conversation(c, r));
        }
    }
    assert!(p.remembered(0) <= max);
    // The latest conversations are remembered whole, the oldest are gone whole.
    p.pick(&w, &conversation(19, 3));
    assert_eq!(p.last_choice().unwrap().matched[0].1, conversation(19, 3).len());
    p.pick(&w, &conversation(0, 3));
    // (All that is left of it is the first chunk, "Conversa", which every conversation shares.)
    assert!(p.last_choice().unwrap().matched[0].1 <= 8, "{:?}", p.last_choice());
}

#[test]
fn cache_aware_explains_load_imbalance_and_cold_choices() {
    let mut p = CacheAware::new(CacheAwareConfig {
        balance_abs_threshold: 4,
        balance_rel_threshold: 2.0,
        ..Default::default()
    });
    let prompt = "Summarise the design of the scheduler in three sentences, please.";
    p.routed(0, prompt);
    assert_eq!(p.pick(&workers(&[20, 1]), prompt), 1);
    assert_eq!(p.last_choice().unwrap().rule, "load_imbalance");
    assert_eq!(p.last_choice().unwrap().matched, vec![(0, prompt.len()), (1, 0)]);
    assert_eq!(p.pick(&workers(&[0, 0]), "Something else entirely, with no shared prefix."), 1);
    assert_eq!(p.last_choice().unwrap().rule, "least_cached");
}

/// What the router reads to send a conversation's next round straight to the decode worker holding
/// it: that worker and how much of the prompt it holds; nothing when no cache matches well enough or
/// the load overrides the cache; and asking changes no later pick.
#[test]
fn cache_aware_names_the_holder_of_a_prompts_prefix() {
    let mut p = CacheAware::new(CacheAwareConfig {
        balance_abs_threshold: 4,
        balance_rel_threshold: 2.0,
        ..Default::default()
    });
    let round1 = "You review pull requests for a storage engine. Here is the diff of the compaction code.";
    let w = workers(&[0, 0]);
    let first = p.pick(&w, round1) as u32;
    p.routed(first, round1);
    let round2 = format!("{round1}\nThe diff looks fine.\nNow check the tests.");
    let (holder, held) = p.holder(&w, &round2).expect("a cache match");
    assert_eq!(holder, first);
    assert!(held <= round1.len() && held + 16 > round1.len(), "{held} of {} held", round1.len());
    assert_eq!(p.pick(&w, &round2) as u32, first, "the pick agrees");
    assert_eq!(p.last_choice().unwrap().rule, "cache_match");
    // Unrelated text: no holder.
    assert_eq!(p.holder(&w, "Translate into French: the cat sleeps on the warm windowsill."), None);
    // The holder overloaded: the pick goes by load, so there is no holder to send the round to.
    let mut loads = vec![0, 0];
    loads[first as usize] = 20;
    assert_eq!(p.holder(&workers(&loads), &round2), None);
    // Policies that know no cache name none.
    assert_eq!(RoundRobin::default().holder(&w, &round2), None);
}
