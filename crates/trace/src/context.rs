//! W3C Trace Context: the `traceparent` header (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`)
//! and fresh random ids.

use std::sync::atomic::{AtomicU64, Ordering};

/// A trace id, a span id in it, and the trace flags (bit 0: sampled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl TraceContext {
    /// A `traceparent` value, if valid: version `00` (a later version's first four fields are read
    /// too, as the spec asks), lowercase hex, neither id all zeros. Anything else is `None`: the
    /// request then starts a trace of its own.
    pub fn parse(traceparent: &str) -> Option<TraceContext> {
        let s = traceparent.trim();
        let mut parts = s.split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let version = unhex::<1>(version)?[0];
        if version == 0xff || (version == 0 && parts.next().is_some()) {
            return None;
        }
        let trace_id = unhex::<16>(trace)?;
        let span_id = unhex::<8>(span)?;
        let flags = unhex::<1>(flags)?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext { trace_id, span_id, flags })
    }

    /// The `traceparent` header value naming this span as the parent.
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-{:02x}", hex(&self.trace_id), hex(&self.span_id), self.flags)
    }

    /// A new trace (sampled), its first span `span_id`.
    pub fn new_root() -> TraceContext {
        let mut trace_id = [0u8; 16];
        trace_id[..8].copy_from_slice(&random_u64().to_be_bytes());
        trace_id[8..].copy_from_slice(&random_u64().to_be_bytes());
        TraceContext { trace_id, span_id: new_span_id(), flags: 1 }
    }

    /// A child span of this one: same trace and flags, a new span id.
    pub fn child(&self) -> TraceContext {
        TraceContext { span_id: new_span_id(), ..*self }
    }

    /// The trace id in hex (as logs and `/debug/requests` show it).
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    pub fn span_id_hex(&self) -> String {
        hex(&self.span_id)
    }
}

/// A new span id (never all zeros).
pub fn new_span_id() -> [u8; 8] {
    loop {
        let v = random_u64();
        if v != 0 {
            return v.to_be_bytes();
        }
    }
}

/// Ids unique in this process and, with overwhelming probability, across processes: a counter and
/// a per-process seed (the kernel's random bytes, else the time and pid) through a bijective mixer.
fn random_u64() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let seed = *SEED.get_or_init(|| {
        let mut b = [0u8; 8];
        let from_kernel = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
            .is_ok();
        if from_kernel {
            u64::from_le_bytes(b)
        } else {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ (u64::from(std::process::id()) << 32)
        }
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // splitmix64 of seed + n * golden gamma: distinct n give distinct outputs.
    let mut z = seed.wrapping_add(n.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_parses_formats_and_refuses_what_the_spec_refuses() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = TraceContext::parse(v).unwrap();
        assert_eq!((c.traceparent(), c.flags), (v.to_owned(), 1));
        assert_eq!(c.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        // A future version: its first four fields are read, whatever follows.
        assert!(
            TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra").is_some()
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "garbage",
            "",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
        let root = TraceContext::new_root();
        let child = root.child();
        assert_eq!((child.trace_id, child.flags), (root.trace_id, 1));
        assert_ne!(child.span_id, root.span_id);
        assert_ne!(TraceContext::new_root().trace_id, root.trace_id);
    }
}
