//! A worker's part of a request's trace (`--otlp-traces-endpoint`): a server span for the request,
//! parented on the `traceparent` its caller sent (the router's leg; a new trace when none or an
//! invalid one came), and a span per stage this worker ran it through, laid end to end from the
//! engine's per-stage times (`Timings`): queue and prefill; or, on a decode worker, the KV transfer
//! (with the pull inside it), its queue and decode. The prefill worker's stages a decode worker
//! reports are the prefill worker's own spans, not repeated here. A prefill worker adds, once the
//! decode worker's pull has ended, `kv transfer (served)`: from its offer to that end, with the
//! transfer's outcome.

use std::time::{Duration, Instant};

use pdserve_api::Role;
use pdserve_engine::Timings;
use pdserve_trace::{AttrValue, Exporter, Span, SpanKind, Status, TraceContext};

/// A request's span context here, and its caller's span.
#[derive(Debug, Clone, Copy)]
pub(super) struct RequestTrace {
    pub ctx: TraceContext,
    pub parent: Option<[u8; 8]>,
}

impl RequestTrace {
    pub(super) fn new(caller: Option<TraceContext>) -> RequestTrace {
        match caller {
            Some(caller) => RequestTrace { ctx: caller.child(), parent: Some(caller.span_id) },
            None => RequestTrace { ctx: TraceContext::new_root(), parent: None },
        }
    }
}

/// How a request ended, for its span.
pub(super) struct Ended<'a> {
    pub request_id: &'a str,
    pub name: &'a str,
    pub received: Instant,
    pub role: Role,
    /// `Ok(finish reason)` or `Err(the error's type and message)`.
    pub result: Result<&'a str, (String, String)>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub timings: Option<&'a Timings>,
}

/// Exports the request's span and its stages' spans.
pub(super) fn export(exporter: &Exporter, t: RequestTrace, e: &Ended<'_>) {
    // The caller did not sample the trace: nothing is exported.
    if t.ctx.flags & 1 == 0 {
        return;
    }
    let now = Instant::now();
    let mut root = Span::with_context(t.ctx, t.parent, e.name, SpanKind::Server, e.received, now);
    root.attr("gen_ai.request.id", AttrValue::Str(e.request_id.to_owned()))
        .attr("pdserve.role", AttrValue::Str(e.role.as_str().to_owned()))
        .attr("gen_ai.usage.prompt_tokens", AttrValue::Int(e.prompt_tokens as i64))
        .attr("gen_ai.usage.completion_tokens", AttrValue::Int(e.completion_tokens as i64))
        .attr(
            "gen_ai.latency.e2e",
            AttrValue::Float(now.saturating_duration_since(e.received).as_secs_f64()),
        );
    root.status = match &e.result {
        Ok(reason) => {
            root.attr("gen_ai.response.finish_reasons", AttrValue::Str(format!("[\"{reason}\"]")));
            Status::Ok
        }
        Err((kind, message)) => {
            root.attr("error.type", AttrValue::Str(kind.clone()));
            Status::Error(message.clone())
        }
    };
    let ctx = root.context;
    exporter.export(root);
    let Some(timings) = e.timings else { return };
    // The stages run one after another from the request's arrival here.
    let mut at = e.received;
    let mut transfer: Option<(Instant, Instant)> = None;
    // (A decode worker computes some prompts itself: those have no transfer.)
    let pulled = timings.0.iter().any(|&(name, _)| name == "transfer_ms");
    for &(name, ms) in &timings.0 {
        let (span_name, own) = match (e.role, name) {
            // The prefill worker's stages, as it reported them: its own spans.
            (Role::Decode, "prefill_queue_ms" | "prefill_ms") if pulled => continue,
            // Inside the transfer: placed at its end, below.
            (_, "kv_pull_ms") => ("kv pull", false),
            (_, "queue_ms" | "decode_queue_ms") => ("queue", true),
            (_, "prefill_ms") => ("prefill", true),
            (_, "transfer_ms") => ("kv transfer", true),
            (_, "decode_ms") => ("decode", true),
            _ => continue,
        };
        let d = Duration::from_secs_f64(ms.max(0.0) / 1e3);
        if own {
            let end = at + d;
            if name == "transfer_ms" {
                transfer = Some((at, end));
            }
            exporter.export(stage(&ctx, span_name, at, end, e.request_id));
            at = end;
        } else if let Some((_, end)) = transfer {
            exporter.export(stage(&ctx, span_name, end.checked_sub(d).unwrap_or(end), end, e.request_id));
        }
    }
}

/// A stage's span under the request's, with the request's id.
fn stage(ctx: &TraceContext, name: &str, start: Instant, end: Instant, request_id: &str) -> Span {
    let mut s = Span::between(ctx, name, SpanKind::Internal, start, end);
    s.attr("gen_ai.request.id", AttrValue::Str(request_id.to_owned()));
    s
}

/// Prefill offers remembered for their `kv transfer (served)` span at most.
pub(super) const OFFERS_TRACED_MAX: usize = 4096;

/// The prefill side of a request's KV transfer: from the offer (`since`) to now, when the engine
/// said the transfer ended with `outcome`; under the request's span here.
pub(super) fn export_served(
    exporter: &Exporter,
    t: RequestTrace,
    request_id: &str,
    since: Instant,
    outcome: &str,
) {
    if t.ctx.flags & 1 == 0 {
        return;
    }
    let mut s = Span::between(&t.ctx, "kv transfer (served)", SpanKind::Internal, since, Instant::now());
    s.attr("gen_ai.request.id", AttrValue::Str(request_id.to_owned()))
        .attr("pdserve.transfer.outcome", AttrValue::Str(outcome.to_owned()));
    s.status = if outcome == "completed" { Status::Ok } else { Status::Error(format!("transfer {outcome}")) };
    exporter.export(s);
}
