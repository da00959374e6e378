//! Admission control: a bounded number of requests in flight to workers, a bounded queue in front of
//! it (lower `priority` first, then arrival: vLLM's field) with a per-request queue deadline, and the
//! `Retry-After` estimate from the measured drain rate. A request that finds the queue full takes the
//! place of the queued one with the highest priority value if its own is lower (that one is answered
//! 429); otherwise it is answered 429 itself. Sans-IO: the loop offers requests, reports finishes, and
//! dispatches what [`Admission::next_dispatch`] yields.

use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Requests dispatched to workers at once.
    pub in_flight_max: usize,
    /// Requests waiting for a dispatch slot.
    pub queued_max: usize,
    /// Longest wait in the queue.
    pub queue_timeout: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig { in_flight_max: 1024, queued_max: 1024, queue_timeout: Duration::from_secs(10) }
    }
}

/// The answer to an offered request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Dispatch now (the in-flight count already includes it).
    Dispatch,
    /// Waiting in the queue; [`Admission::next_dispatch`] yields it later.
    Queued,
    /// Queue full: answer 429 with this `Retry-After`.
    Full { retry_after_s: u32 },
    /// Queued in the place of `victim`, which had a higher priority value: answer it 429 with this
    /// `Retry-After`.
    Displaced { victim: u64, retry_after_s: u32 },
}

/// A queued request.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    id: u64,
    priority: i32,
    /// Arrival order.
    seq: u64,
    deadline: Instant,
}

impl Waiting {
    fn key(&self) -> (i32, u64) {
        (self.priority, self.seq)
    }
}

const DRAIN_BUCKETS: usize = 10;

#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    in_flight: usize,
    /// In dispatch order: lower priority value first, then arrival.
    queue: Vec<Waiting>,
    next_seq: u64,
    /// Finishes per second over the last `DRAIN_BUCKETS` seconds, as a ring keyed by whole seconds.
    drain: [(u64, u32); DRAIN_BUCKETS],
    origin: Instant,
}

impl Admission {
    pub fn new(config: AdmissionConfig, now: Instant) -> Self {
        Admission {
            config,
            in_flight: 0,
            queue: Vec::new(),
            next_seq: 0,
            drain: [(0, 0); DRAIN_BUCKETS],
            origin: now,
        }
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Offers request `id` of `priority` (lower first).
    pub fn offer(&mut self, id: u64, priority: i32, now: Instant) -> Admit {
        if self.in_flight < self.config.in_flight_max && self.queue.is_empty() {
            self.in_flight += 1;
            return Admit::Dispatch;
        }
        self.next_seq += 1;
        let w = Waiting { id, priority, seq: self.next_seq, deadline: now + self.config.queue_timeout };
        if self.queue.len() < self.config.queued_max {
            self.enqueue(w);
            return Admit::Queued;
        }
        match self.queue.last() {
            Some(worst) if worst.priority > priority && self.config.queued_max > 0 => {
                let victim = worst.id;
                self.queue.pop();
                self.enqueue(w);
                Admit::Displaced { victim, retry_after_s: self.retry_after_s(now) }
            }
            _ => Admit::Full { retry_after_s: self.retry_after_s(now) },
        }
    }

    fn enqueue(&mut self, w: Waiting) {
        let at = self.queue.partition_point(|q| q.key() <= w.key());
        self.queue.insert(at, w);
    }

    /// A dispatched request ended (any outcome): frees its slot and counts toward the drain rate.
    pub fn finished(&mut self, now: Instant) {
        debug_assert!(self.in_flight > 0);
        self.in_flight = self.in_flight.saturating_sub(1);
        let sec = now.saturating_duration_since(self.origin).as_secs();
        let b = &mut self.drain[(sec as usize) % DRAIN_BUCKETS];
        if b.0 != sec {
            *b = (sec, 0);
        }
        b.1 += 1;
    }

    /// The next queued request to dispatch, if a slot is free (the in-flight count includes it).
    pub fn next_dispatch(&mut self) -> Option<u64> {
        if self.in_flight >= self.config.in_flight_max {
            return None;
        }
        if self.queue.is_empty() {
            return None;
        }
        let w = self.queue.remove(0);
        self.in_flight += 1;
        Some(w.id)
    }

    /// Takes queued requests whose queue deadline has passed, oldest first.
    pub fn expired(&mut self, now: Instant, out: &mut Vec<u64>) {
        let mut due: Vec<Waiting> = self.queue.iter().filter(|w| w.deadline <= now).copied().collect();
        if due.is_empty() {
            return;
        }
        self.queue.retain(|w| w.deadline > now);
        due.sort_by_key(|w| (w.deadline, w.seq));
        out.extend(due.iter().map(|w| w.id));
    }

    /// Takes a queued request out (its client left). False if it was not queued.
    pub fn remove(&mut self, id: u64) -> bool {
        let before = self.queue.len();
        self.queue.retain(|w| w.id != id);
        self.queue.len() != before
    }

    /// Finishes per second, averaged over the last few whole seconds.
    pub fn drain_per_s(&self, now: Instant) -> f64 {
        let sec = now.saturating_duration_since(self.origin).as_secs();
        let window = (DRAIN_BUCKETS as u64 - 1).min(sec.max(1));
        let total: u64 = self
            .drain
            .iter()
            .filter(|(s, _)| *s < sec && sec - *s <= window)
            .map(|&(_, n)| u64::from(n))
            .sum();
        total as f64 / window as f64
    }

    /// Seconds until a request sent now would likely get a queue slot: the queue's length over the drain
    /// rate, at least 1, at most 60; the queue timeout when nothing has drained lately.
    pub fn retry_after_s(&self, now: Instant) -> u32 {
        let rate = self.drain_per_s(now);
        let secs = if rate > 0.0 {
            (self.queue.len() as f64 + 1.0) / rate
        } else {
            self.config.queue_timeout.as_secs_f64()
        };
        secs.ceil().clamp(1.0, 60.0) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adm(in_flight_max: usize, queued_max: usize) -> (Admission, Instant) {
        let t = Instant::now();
        let c = AdmissionConfig { in_flight_max, queued_max, queue_timeout: Duration::from_secs(2) };
        (Admission::new(c, t), t)
    }

    #[test]
    fn dispatch_then_queue_then_full() {
        let (mut a, t) = adm(2, 2);
        assert_eq!(a.offer(1, 0, t), Admit::Dispatch);
        assert_eq!(a.offer(2, 0, t), Admit::Dispatch);
        assert_eq!(a.offer(3, 0, t), Admit::Queued);
        assert_eq!(a.offer(4, 0, t), Admit::Queued);
        assert!(
            matches!(a.offer(5, 0, t), Admit::Full { retry_after_s: 2 }),
            "no drain yet: the queue timeout"
        );
        assert_eq!(a.next_dispatch(), None, "no free slot");
        a.finished(t);
        assert_eq!(a.next_dispatch(), Some(3), "FIFO");
        assert_eq!(a.next_dispatch(), None);
        assert_eq!((a.in_flight(), a.queued()), (2, 1));
    }

    /// Lower priority values leave the queue first (then arrival order); a request that finds the
    /// queue full takes the place of the queued one with the highest value if its own is lower, and
    /// that one is the one answered 429; an equal or higher value is refused itself.
    #[test]
    fn priority_orders_the_queue_and_displaces_the_least_urgent() {
        let (mut a, t) = adm(1, 3);
        assert_eq!(a.offer(1, 0, t), Admit::Dispatch);
        assert_eq!(a.offer(2, 5, t), Admit::Queued);
        assert_eq!(a.offer(3, 0, t), Admit::Queued);
        assert_eq!(a.offer(4, 5, t), Admit::Queued);
        // Full: an equal value (5) is refused itself; a lower one (-1) displaces the last 5 (id 4).
        assert!(matches!(a.offer(5, 5, t), Admit::Full { .. }));
        assert!(matches!(a.offer(6, -1, t), Admit::Displaced { victim: 4, .. }));
        assert!(matches!(a.offer(7, 0, t), Admit::Displaced { victim: 2, .. }));
        // Nothing lower than 0 queued is left to displace for a 0.
        assert!(matches!(a.offer(8, 0, t), Admit::Full { .. }));
        let mut order = Vec::new();
        for _ in 0..3 {
            a.finished(t);
            order.extend(a.next_dispatch());
        }
        assert_eq!(order, vec![6, 3, 7], "-1 first, then the 0s in arrival order");
        assert_eq!(a.queued(), 0);
    }

    #[test]
    fn queue_deadline_and_removal() {
        let (mut a, t) = adm(0, 8);
        for id in 0..4 {
            assert_eq!(a.offer(id, 0, t + Duration::from_millis(id * 100)), Admit::Queued);
        }
        assert!(a.remove(1));
        assert!(!a.remove(1));
        let mut out = Vec::new();
        a.expired(t + Duration::from_millis(2250), &mut out);
        assert_eq!(out, vec![0, 2]);
        assert_eq!(a.queued(), 1);
    }

    #[test]
    fn retry_after_follows_the_drain_rate() {
        let (mut a, t) = adm(4, 100);
        for i in 0..4 {
            assert_eq!(a.offer(i, 0, t), Admit::Dispatch);
        }
        for i in 4..24 {
            assert_eq!(a.offer(i, 0, t), Admit::Queued);
        }
        // Two finishes per second for three seconds.
        for s in 0..3u64 {
            for _ in 0..2 {
                a.finished(t + Duration::from_millis(s * 1000 + 100));
                assert!(a.next_dispatch().is_some());
            }
        }
        let now = t + Duration::from_millis(3500);
        assert!((a.drain_per_s(now) - 2.0).abs() < 1e-9, "{}", a.drain_per_s(now));
        // 14 still queued + this one, at 2 per second: 7.5 s, rounded up.
        assert_eq!(a.queued(), 14);
        assert_eq!(a.retry_after_s(now), 8);
    }
}
