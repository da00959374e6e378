//! The words for where a request is and how it ended, the same in every process.

use std::fmt;

/// What a worker does with a request (its `--role`, and the role a router registers it under).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prompt and generation in one process.
    Unified,
    /// Prompt only: computes the KV and the first token, then offers the KV to a decode worker.
    Prefill,
    /// Generation only: pulls the prompt's KV from a prefill worker.
    Decode,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Unified, Role::Prefill, Role::Decode];

    /// `unified` (or `regular`), `prefill`, `decode`.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "unified" | "regular" => Some(Role::Unified),
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Unified => "unified",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a live request is. The router and every worker record these in their ledgers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Waiting in the router's admission queue.
    RouterQueued,
    /// Waiting for a prefill step (a unified or prefill worker).
    PrefillQueued,
    Prefilling,
    /// Prefill done; the KV waits under a lease for the decode worker.
    KvHeld,
    /// The decode worker is pulling the KV.
    KvTransfer,
    /// KV in place; waiting for a decode slot (a decode worker).
    DecodeQueued,
    Decoding,
    /// (Router) the response is streaming to the client.
    Streaming,
    /// (Router) being re-dispatched after a worker failed mid-request.
    Migrating,
}

impl Stage {
    pub const ALL: [Stage; 9] = [
        Stage::RouterQueued,
        Stage::PrefillQueued,
        Stage::Prefilling,
        Stage::KvHeld,
        Stage::KvTransfer,
        Stage::DecodeQueued,
        Stage::Decoding,
        Stage::Streaming,
        Stage::Migrating,
    ];

    /// The queued stage of a worker of `role`: a decode worker's waiting request is `decode_queued`.
    pub fn queued(role: Role) -> Stage {
        match role {
            Role::Unified | Role::Prefill => Stage::PrefillQueued,
            Role::Decode => Stage::DecodeQueued,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::RouterQueued => "router_queued",
            Stage::PrefillQueued => "prefill_queued",
            Stage::Prefilling => "prefilling",
            Stage::KvHeld => "kv_held",
            Stage::KvTransfer => "kv_transfer",
            Stage::DecodeQueued => "decode_queued",
            Stage::Decoding => "decoding",
            Stage::Streaming => "streaming",
            Stage::Migrating => "migrating",
        }
    }

    /// The words a message uses for it ("while it was ...").
    pub fn describe(self) -> &'static str {
        match self {
            Stage::RouterQueued => "queued in the router",
            Stage::PrefillQueued | Stage::DecodeQueued => "queued",
            Stage::Prefilling => "prefilling",
            Stage::KvHeld => "holding its KV for the decode worker",
            Stage::KvTransfer => "waiting for its KV transfer",
            Stage::Decoding => "decoding",
            Stage::Streaming => "streaming",
            Stage::Migrating => "migrating",
        }
    }

    pub fn parse(s: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a request ended: the `outcome` label of every `requests_finished_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Completed,
    /// Refused before any work: bad input, overload, no capacity.
    Rejected,
    /// The client or an operator ended it.
    Cancelled,
    /// Its deadline passed.
    TimedOut,
    /// Something broke: a worker, the transfer, a bug.
    Failed,
}

impl Outcome {
    pub const ALL: [Outcome; 5] =
        [Outcome::Completed, Outcome::Rejected, Outcome::Cancelled, Outcome::TimedOut, Outcome::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Rejected => "rejected",
            Outcome::Cancelled => "cancelled",
            Outcome::TimedOut => "timed_out",
            Outcome::Failed => "failed",
        }
    }

    /// The outcome of an answer with `status` whose error body (if any) is unknown.
    pub fn of_status(status: u16) -> Outcome {
        match status {
            200..=399 => Outcome::Completed,
            499 => Outcome::Cancelled,
            504 => Outcome::TimedOut,
            400..=499 | 501 | 503 => Outcome::Rejected,
            _ => Outcome::Failed,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn words_round_trip() {
        for s in Stage::ALL {
            assert_eq!(Stage::parse(s.as_str()), Some(s));
        }
        for r in Role::ALL {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert_eq!(Stage::queued(Role::Decode), Stage::DecodeQueued);
        assert_eq!(Stage::queued(Role::Unified), Stage::PrefillQueued);
    }

    #[test]
    fn a_status_alone_gives_the_same_outcome_as_its_kinds() {
        for k in ErrorKind::ALL {
            assert_eq!(Outcome::of_status(k.status()), k.outcome(), "{k}");
        }
        assert_eq!(Outcome::of_status(200), Outcome::Completed);
    }
}
