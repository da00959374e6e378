//! OTLP's trace protobuf (`opentelemetry/proto/collector/trace/v1/trace_service.proto` and
//! `trace/v1/trace.proto`), written by hand: `ExportTraceServiceRequest` with one `ResourceSpans`
//! (the service's name) and one `ScopeSpans`.

use crate::{AttrValue, Span, SpanKind, Status};

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field) << 3 | u64::from(wire));
}

/// A length-delimited field (wire type 2).
fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    key(out, field, 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// A nested message, encoded by `f`.
fn message(out: &mut Vec<u8>, field: u32, f: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    f(&mut inner);
    bytes(out, field, &inner);
}

fn fixed64(out: &mut Vec<u8>, field: u32, v: u64) {
    key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        key(out, field, 0);
        varint(out, v);
    }
}

/// `KeyValue { key = 1; AnyValue value = 2 }`, `AnyValue { string_value = 1; bool_value = 2;
/// int_value = 3; double_value = 4 }`.
fn attribute(out: &mut Vec<u8>, field: u32, k: &str, v: &AttrValue) {
    message(out, field, |kv| {
        bytes(kv, 1, k.as_bytes());
        message(kv, 2, |any| match v {
            AttrValue::Str(s) => bytes(any, 1, s.as_bytes()),
            AttrValue::Bool(b) => {
                key(any, 2, 0);
                varint(any, u64::from(*b));
            }
            AttrValue::Int(i) => {
                key(any, 3, 0);
                varint(any, *i as u64);
            }
            AttrValue::Float(f) => fixed64(any, 4, f.to_bits()),
        });
    });
}

/// `Span` (trace.proto): trace_id 1, span_id 2, parent_span_id 4, name 5, kind 6,
/// start_time_unix_nano 7 and end_time_unix_nano 8 (fixed64), attributes 9, events 11, status 15,
/// flags 16 (fixed32).
fn span(out: &mut Vec<u8>, s: &Span) {
    message(out, 2, |m| {
        bytes(m, 1, &s.context.trace_id);
        bytes(m, 2, &s.context.span_id);
        if let Some(p) = &s.parent {
            bytes(m, 4, p);
        }
        bytes(m, 5, s.name.as_bytes());
        uint(m, 6, s.kind.number());
        fixed64(m, 7, s.start_unix_nanos);
        fixed64(m, 8, s.end_unix_nanos);
        for (k, v) in &s.attributes {
            attribute(m, 9, k, v);
        }
        for (t, name) in &s.events {
            message(m, 11, |e| {
                fixed64(e, 1, *t);
                bytes(e, 2, name.as_bytes());
            });
        }
        // Status { message = 2; code = 3 } (0 unset, 1 ok, 2 error).
        match &s.status {
            Status::Unset => {}
            Status::Ok => message(m, 15, |st| uint(st, 3, 1)),
            Status::Error(msg) => message(m, 15, |st| {
                bytes(st, 2, msg.as_bytes());
                uint(st, 3, 2);
            }),
        }
        // flags: the W3C trace flags in the low byte.
        key(m, 16, 5);
        m.extend_from_slice(&u32::from(s.context.flags).to_le_bytes());
    });
}

/// `ExportTraceServiceRequest { repeated ResourceSpans resource_spans = 1 }`, `ResourceSpans {
/// Resource resource = 1; repeated ScopeSpans scope_spans = 2 }`, `Resource { repeated KeyValue
/// attributes = 1 }`, `ScopeSpans { InstrumentationScope scope = 1; repeated Span spans = 2 }`,
/// `InstrumentationScope { name = 1; version = 2 }`.
pub fn export_request(service_name: &str, spans: &[Span]) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + spans.len() * 160);
    message(&mut out, 1, |rs| {
        message(rs, 1, |res| attribute(res, 1, "service.name", &AttrValue::Str(service_name.to_owned())));
        message(rs, 2, |ss| {
            message(ss, 1, |scope| {
                bytes(scope, 1, b"pdserve");
                bytes(scope, 2, env!("CARGO_PKG_VERSION").as_bytes());
            });
            for s in spans {
                span(ss, s);
            }
        });
    });
    out
}

impl SpanKind {
    /// OTLP's `Span.SpanKind` numbers.
    pub(crate) const fn number(self) -> u64 {
        self as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_keys_are_protobufs() {
        let mut v = Vec::new();
        varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
        let mut k = Vec::new();
        key(&mut k, 16, 5);
        assert_eq!(k, [0x85, 0x01]);
        let mut f = Vec::new();
        fixed64(&mut f, 7, 1);
        assert_eq!(f, [0x39, 1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(SpanKind::Server.number(), 2);
    }
}
