//! A request between tokenizing and the engine thread: staged while its constraint compiles (on
//! `grammar.rs`'s threads), then started: its text state kept, the output it resumes replayed, and
//! handed to the engine thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::TrySendError;
use pdserve_api::Role;

use super::{lock, Text, TextThread};
use crate::core::{resumed_is_complete, Submission};
use crate::grammar::Compile;
use crate::shell::Command;
use crate::{EngineError, Finish};

/// A request tokenized, its text state ready, waiting for its constraint to compile.
#[derive(Debug)]
pub(crate) struct Staged {
    pub(super) sub: Box<Submission>,
    pub(super) text: Text,
}

/// A staged request waiting for its constraint: when it was queued, when its compile began, and the
/// flag that tells a compiling thread nobody waits for it any more.
#[derive(Debug)]
pub(crate) struct Compiling {
    pub(super) staged: Staged,
    pub(super) queued: Instant,
    pub(super) started: Option<Instant>,
    pub(super) cancel: Arc<AtomicBool>,
}

impl Compiling {
    /// When it is past its bound: `bound` after its compile began or, still queued, after it was
    /// queued (the compiling threads are busy).
    pub(super) fn due(&self, bound: Duration) -> Option<Instant> {
        self.started.unwrap_or(self.queued).checked_add(bound)
    }
}

impl TextThread {
    /// News from the compiling threads: a staged request's compile began, or ended (it goes on, or
    /// ends with what is wrong).
    pub(super) fn compile(&mut self, c: Compile) {
        let (id, guide, took) = match c {
            Compile::Started { id, at } => {
                if let Some(c) = self.compiling.get_mut(&id) {
                    c.started = Some(at);
                }
                return;
            }
            Compile::Done { id, guide, took } => (id, guide, took),
        };
        let Some(Compiling { mut staged, .. }) = self.compiling.remove(&id) else { return }; // ended meanwhile
        self.metrics.grammar_compile.record(took);
        match guide {
            Ok(mut g) => {
                // The constraint is where the output moved away from left it.
                if let Some(t) = staged.sub.resumed.iter().find(|&&t| g.accept(t).is_err()) {
                    let problem = format!("resumed token {t} does not match the output constraint");
                    return self.reject(id, EngineError::InvalidInput { problem });
                }
                staged.sub.guide = Some(*g);
                self.start(staged);
            }
            Err(problem) => {
                let problem = format!("the output constraint is not usable: {problem}");
                self.reject(id, EngineError::InvalidInput { problem });
            }
        }
    }

    /// Ends the staged requests whose constraints did not compile in time (a 400: the constraint's
    /// cost) or did not get a compiling thread in time (a 429: the threads are busy), and forgets
    /// those the handle's watchdog ended meanwhile; each one's job is cancelled.
    pub(super) fn compile_timeouts(&mut self, now: Instant) {
        let bound = self.compile_timeout;
        let late: Vec<u64> = self
            .compiling
            .iter()
            .filter(|(_, c)| c.due(bound).is_some_and(|d| d <= now))
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            let Some(c) = self.compiling.remove(&id) else { continue };
            c.cancel.store(true, Ordering::Relaxed);
            let error = if c.started.is_some() {
                let problem = format!(
                    "the output constraint did not compile within {:.1} s; simplify the schema or grammar",
                    bound.as_secs_f64()
                );
                EngineError::InvalidInput { problem }
            } else {
                EngineError::Busy { limit: self.compiler.capacity() }
            };
            self.reject(id, error);
        }
        let live = lock(&self.live);
        self.compiling.retain(|id, c| {
            let alive = live.streams.contains_key(id);
            if !alive {
                c.cancel.store(true, Ordering::Relaxed);
            }
            alive
        });
    }

    /// A request tokenized (and its constraint compiled): its text state is kept, the output it
    /// resumes replayed, and it goes to the engine thread (or ends here, when the output it resumes
    /// had already ended it).
    pub(super) fn start(&mut self, staged: Staged) {
        let Staged { sub, text } = staged;
        let id = sub.id;
        let resumed = sub.resumed.clone();
        match lock(&self.live).streams.get_mut(&id) {
            Some(s) => {
                s.prompt_tokens = sub.tokens.len().saturating_sub(resumed.len());
                s.resumed = resumed.len();
            }
            None => return, // the watchdog ended it while it waited here
        }
        self.texts.insert(id, text);
        // The resumed tokens' text again, so stop strings and the caller's parsers are where
        // the worker before left them.
        let replay = if self.info.role == Role::Prefill { &[][..] } else { &resumed[..] };
        for &t in replay {
            if let Some(s) = lock(&self.live).streams.get_mut(&id) {
                s.completion_tokens += 1;
            }
            let r = catch_unwind(AssertUnwindSafe(|| self.text(id, t, 0.0, Vec::new(), false, true)));
            if let Err(p) = r {
                let reason = format!("internal error while detokenizing: {}", crate::core::panic_text(&p));
                return self.reject(id, EngineError::InvalidInput { problem: reason });
            }
        }
        // Ended by what it had already generated (the move came after its last token, before
        // its end): it ends here as it would have there.
        let stopped = self.texts.get(&id).and_then(|t| t.stopped.clone());
        let context = self.info.context_tokens;
        let full = resumed_is_complete(
            sub.tokens.len(),
            resumed.len(),
            sub.max_tokens,
            context,
            sub.remote.is_some(),
        );
        if self.texts.get(&id).is_some_and(|t| t.calls_done) {
            return self.end_resumed(id, Finish::ToolCalls);
        }
        match stopped {
            Some(s) => return self.end_resumed(id, Finish::StopString(s)),
            None if full => return self.end_resumed(id, Finish::Length),
            None => {}
        }
        match self.commands.try_send(Command::Submit(sub)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                let limit = self.commands.capacity().unwrap_or(0);
                self.reject(id, EngineError::Busy { limit });
            }
            Err(TrySendError::Disconnected(_)) => self.reject(id, EngineError::Stopped),
        }
    }
}
