//! The router's part of a request's trace (`--otlp-traces-endpoint`): a server span for the request,
//! parented on the client's `traceparent` when it sends a valid one (a new trace otherwise), a span
//! for its wait in the router's queue, and a client span per leg (prefill, decode, unified; each
//! retry and each migration's leg its own), whose context each leg carries to its worker as
//! `traceparent`, so the workers' spans join the same trace. Built from what the shell sees of the
//! flight and exported when it finishes; the flight itself stays clock- and trace-free.

use std::time::Instant;

use pdserve_api::Outcome;
use pdserve_trace::{AttrValue, Exporter, Span, SpanKind, Status, TraceContext};

use crate::flight::{Finish, FlightSpec, LegKind, Retry};

#[derive(Debug)]
struct LegTrace {
    ctx: TraceContext,
    kind: LegKind,
    worker: String,
    retry: Option<Retry>,
    /// A migration opened it (the request moved off the leg before).
    moved: bool,
    start: Instant,
    end: Option<Instant>,
}

/// One flight's spans so far.
#[derive(Debug)]
pub(crate) struct FlightTrace {
    /// The router's span for the request.
    root: TraceContext,
    /// The client's span, when it sent one.
    parent: Option<[u8; 8]>,
    dispatched: Option<Instant>,
    legs: Vec<LegTrace>,
    /// When a leg went out to replace one that was lost (a migration), in order.
    moves: Vec<Instant>,
    /// The trace is sampled (the client's flag; a trace of our own always is): else nothing is
    /// exported, and the legs still pass the context on.
    sampled: bool,
}

impl FlightTrace {
    /// A request's trace: under the client's span if `traceparent` is valid, else a new one.
    pub(crate) fn new(traceparent: Option<&str>) -> FlightTrace {
        let (root, parent) = match traceparent.and_then(TraceContext::parse) {
            Some(client) => (client.child(), Some(client.span_id)),
            None => (TraceContext::new_root(), None),
        };
        let sampled = root.flags & 1 == 1;
        FlightTrace { root, parent, dispatched: None, legs: Vec::new(), moves: Vec::new(), sampled }
    }

    pub(crate) fn trace_id(&self) -> String {
        self.root.trace_id_hex()
    }

    /// The request left the router's queue.
    pub(crate) fn dispatched(&mut self, now: Instant) {
        self.dispatched.get_or_insert(now);
    }

    /// A leg goes to `worker`: the one before it is over; the `traceparent` the leg carries.
    pub(crate) fn leg(&mut self, kind: LegKind, worker: &str, retry: Option<Retry>, now: Instant) -> String {
        let mut moved = false;
        if let Some(l) = self.legs.last_mut() {
            l.end.get_or_insert(now);
            // Not a retry of a leg that never went out, nor the decode leg after its prefill leg:
            // the request moved.
            if retry.is_none() && !(l.kind == LegKind::Prefill && kind == LegKind::Decode) {
                self.moves.push(now);
                moved = true;
            }
        }
        let ctx = self.root.child();
        self.legs.push(LegTrace {
            ctx,
            kind,
            worker: worker.to_owned(),
            retry,
            moved,
            start: now,
            end: None,
        });
        ctx.traceparent()
    }

    /// Exports the flight's spans, ending `now` as `f` says.
    pub(crate) fn export(self, exporter: &Exporter, spec: &FlightSpec, f: &Finish, now: Instant) {
        if !self.sampled {
            return;
        }
        let completed = f.outcome == Outcome::Completed;
        let name = format!("{} {}", if spec.method_get { "GET" } else { "POST" }, spec.path);
        let mut root =
            Span::with_context(self.root, self.parent, &name, SpanKind::Server, spec.received, now);
        root.attr("gen_ai.request.id", AttrValue::Str(spec.request_id.clone()))
            .attr("http.route", AttrValue::Str(spec.path.clone()))
            .attr("http.response.status_code", AttrValue::Int(i64::from(f.status)))
            .attr("pdserve.outcome", AttrValue::Str(f.outcome.as_str().to_owned()))
            .attr("pdserve.stage", AttrValue::Str(f.stage.as_str().to_owned()))
            .attr("pdserve.legs", AttrValue::Int(self.legs.len() as i64))
            .attr("pdserve.migrations", AttrValue::Int(f.migrations.len() as i64));
        for (i, m) in f.migrations.iter().enumerate() {
            let at = self.moves.get(i).map_or(root.end_unix_nanos, |&t| pdserve_trace::unix_nanos(t));
            root.events.push((at, format!("migration: {}", m.as_str())));
        }
        root.status = if completed {
            Status::Ok
        } else {
            let why = f.error.map_or_else(|| f.outcome.as_str().to_owned(), |k| k.as_str().to_owned());
            Status::Error(f.message.clone().map_or(why.clone(), |m| format!("{why}: {m}")))
        };
        let root_ctx = root.context;
        exporter.export(root);
        if let Some(d) = self.dispatched {
            exporter.export(Span::between(&root_ctx, "router queue", SpanKind::Internal, spec.received, d));
        }
        let kinds: Vec<LegKind> = self.legs.iter().map(|l| l.kind).collect();
        let last = self.legs.len().saturating_sub(1);
        let mut migrations = f.migrations.iter();
        for (i, l) in self.legs.into_iter().enumerate() {
            let kind = match l.kind {
                LegKind::Main => "unified",
                LegKind::Prefill => "prefill",
                LegKind::Decode => "decode",
            };
            let end = l.end.unwrap_or(now);
            let name = format!("{kind} leg");
            let mut s =
                Span::with_context(l.ctx, Some(root_ctx.span_id), &name, SpanKind::Client, l.start, end);
            s.attr("pdserve.worker", AttrValue::Str(l.worker))
                .attr("gen_ai.request.id", AttrValue::Str(spec.request_id.clone()));
            // The leg a migration opened says why the request moved.
            if let Some(m) = if l.moved { migrations.next() } else { None } {
                s.attr("pdserve.migration", AttrValue::Str(m.as_str().to_owned()));
            }
            if let Some(r) = l.retry {
                let why = match r {
                    Retry::Refused => "refused",
                    Retry::Stale => "stale",
                };
                s.attr("pdserve.retry", AttrValue::Str(why.to_owned()));
            }
            // A leg that another of its kind followed (a retry, a migration) did not do its part;
            // the last one ended as the request did; a prefill leg its decode leg followed did.
            s.status = if i == last {
                if completed {
                    Status::Ok
                } else {
                    Status::Error(f.message.clone().unwrap_or_else(|| f.outcome.as_str().to_owned()))
                }
            } else if kinds[i + 1..].contains(&l.kind) {
                Status::Error("another leg took over".into())
            } else {
                Status::Ok
            };
            exporter.export(s);
        }
    }
}
