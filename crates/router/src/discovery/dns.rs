//! The DNS wire format, as much of it as finding a name's addresses needs (RFC 1035, with an EDNS0
//! OPT record so answers up to 4,096 bytes come over UDP): one query out, its answer's A and AAAA
//! records in. Sans-IO: bytes in, bytes out; the sockets are the caller's.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The record types asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Qtype {
    A = 1,
    Aaaa = 28,
}

/// UDP payload size advertised in the OPT record.
pub const UDP_PAYLOAD_MAX: u16 = 4096;

/// What an answer said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The name exists; its addresses of the asked type (possibly none, possibly behind CNAMEs).
    Addresses(Vec<IpAddr>),
    /// NXDOMAIN: no such name.
    NoSuchName,
    /// The answer did not fit a UDP datagram: ask again over TCP.
    Truncated,
}

/// Why an answer could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsError {
    /// Shorter than its own fields say, a label loop, or a pointer out of bounds.
    Malformed(&'static str),
    /// Not the answer to this query (another id or question).
    NotOurs,
    /// The server answered with an error code (2 SERVFAIL, 5 REFUSED, ...).
    Rcode(u8),
    /// A name no query can carry (an empty label, a label over 63 bytes, over 253 in all).
    BadName,
}

impl std::fmt::Display for DnsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DnsError::Malformed(what) => write!(f, "malformed DNS answer: {what}"),
            DnsError::NotOurs => f.write_str("a DNS answer to another query"),
            DnsError::Rcode(2) => f.write_str("the DNS server failed (SERVFAIL)"),
            DnsError::Rcode(5) => f.write_str("the DNS server refused the query (REFUSED)"),
            DnsError::Rcode(c) => write!(f, "the DNS server answered with error code {c}"),
            DnsError::BadName => f.write_str("not a valid DNS name"),
        }
    }
}

/// A query for `name`'s records of type `qtype`, recursion desired.
pub fn encode_query(id: u16, name: &str, qtype: Qtype) -> Result<Vec<u8>, DnsError> {
    let mut out = Vec::with_capacity(32 + name.len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&0x0100u16.to_be_bytes()); // RD
    for count in [1u16, 0, 0, 1] {
        out.extend_from_slice(&count.to_be_bytes());
    }
    encode_name(name, &mut out)?;
    out.extend_from_slice(&(qtype as u16).to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes()); // IN
                                                // OPT: root name, type 41, class = payload size, no extended flags, no options.
    out.push(0);
    out.extend_from_slice(&41u16.to_be_bytes());
    out.extend_from_slice(&UDP_PAYLOAD_MAX.to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    Ok(out)
}

fn encode_name(name: &str, out: &mut Vec<u8>) -> Result<(), DnsError> {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() || name.len() > 253 {
        return Err(DnsError::BadName);
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(DnsError::BadName);
        }
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    Ok(())
}

/// Reads the answer to the query `query` (as [`encode_query`] made it).
pub fn parse_answer(query: &[u8], msg: &[u8]) -> Result<Answer, DnsError> {
    let mut r = Reader { msg, at: 0 };
    let id = r.u16()?;
    let flags = r.u16()?;
    let (qd, an) = (r.u16()?, r.u16()?);
    r.u16()?; // authority
    r.u16()?; // additional
    if query.len() < 12 || id.to_be_bytes() != query[..2] || flags & 0x8000 == 0 || qd != 1 {
        return Err(DnsError::NotOurs);
    }
    // The question must be the one asked before anything else in the answer counts (a stray or
    // spoofed answer to another name, a truncation or NXDOMAIN included, is not ours).
    let asked = &query[12..];
    let start = r.at;
    r.skip_name()?;
    r.take(4)?;
    let question = &msg[start..r.at];
    if asked.len() < question.len() || !question.eq_ignore_ascii_case(&asked[..question.len()]) {
        return Err(DnsError::NotOurs);
    }
    if flags & 0x0200 != 0 {
        return Ok(Answer::Truncated);
    }
    match (flags & 0x000f) as u8 {
        0 => {}
        3 => return Ok(Answer::NoSuchName),
        code => return Err(DnsError::Rcode(code)),
    }
    let mut addrs = Vec::new();
    for _ in 0..an {
        r.skip_name()?;
        let rtype = r.u16()?;
        let class = r.u16()?;
        r.take(4)?; // TTL
        let len = r.u16()? as usize;
        let data = r.take(len)?;
        match (rtype, class, len) {
            (1, 1, 4) => addrs.push(IpAddr::V4(Ipv4Addr::new(data[0], data[1], data[2], data[3]))),
            (28, 1, 16) => {
                let mut b = [0u8; 16];
                b.copy_from_slice(data);
                addrs.push(IpAddr::V6(Ipv6Addr::from(b)));
            }
            (1 | 28, 1, _) => return Err(DnsError::Malformed("an address record of the wrong length")),
            _ => {} // CNAME and the like: the server follows them and includes their targets' records.
        }
    }
    Ok(Answer::Addresses(addrs))
}

struct Reader<'a> {
    msg: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DnsError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.msg.len());
        let end = end.ok_or(DnsError::Malformed("shorter than its fields say"))?;
        let s = &self.msg[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u16(&mut self) -> Result<u16, DnsError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    /// Steps over a name: labels ending in a zero byte or a compression pointer (which ends it here).
    fn skip_name(&mut self) -> Result<(), DnsError> {
        for _ in 0..128 {
            let len = self.take(1)?[0];
            match len & 0xc0 {
                0x00 if len == 0 => return Ok(()),
                0x00 => {
                    self.take(len as usize)?;
                }
                0xc0 => {
                    self.take(1)?;
                    return Ok(());
                }
                _ => return Err(DnsError::Malformed("a reserved label type")),
            }
        }
        Err(DnsError::Malformed("a name of over 127 labels"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer to `query` with `records` (type, data) owned by a pointer to the question's name.
    fn answer(query: &[u8], rcode: u8, truncated: bool, records: &[(u16, &[u8])]) -> Vec<u8> {
        let question_end = 12 + query[12..].iter().position(|&b| b == 0).unwrap() + 1 + 4;
        let mut m = query[..2].to_vec();
        let flags = 0x8180u16 | u16::from(rcode) | if truncated { 0x0200 } else { 0 };
        m.extend_from_slice(&flags.to_be_bytes());
        for c in [1u16, records.len() as u16, 0, 0] {
            m.extend_from_slice(&c.to_be_bytes());
        }
        m.extend_from_slice(&query[12..question_end]);
        for (rtype, data) in records {
            m.extend_from_slice(&[0xc0, 12]);
            m.extend_from_slice(&rtype.to_be_bytes());
            m.extend_from_slice(&1u16.to_be_bytes());
            m.extend_from_slice(&30u32.to_be_bytes());
            m.extend_from_slice(&(data.len() as u16).to_be_bytes());
            m.extend_from_slice(data);
        }
        m
    }

    #[test]
    fn a_query_carries_the_name_type_and_an_opt_record() {
        let q = encode_query(0xbeef, "decode.pdserve.svc.", Qtype::A).unwrap();
        assert_eq!(&q[..12], &[0xbe, 0xef, 1, 0, 0, 1, 0, 0, 0, 0, 0, 1]);
        assert_eq!(&q[12..36], b"\x06decode\x07pdserve\x03svc\x00\x00\x01\x00\x01");
        assert_eq!(&q[36..], &[0, 0, 41, 0x10, 0, 0, 0, 0, 0, 0, 0]);
        for bad in ["", ".", "a..b", &"x".repeat(64), &"abc.".repeat(70)] {
            assert_eq!(encode_query(1, bad, Qtype::A), Err(DnsError::BadName), "{bad:?}");
        }
    }

    #[test]
    fn addresses_cnames_and_errors_are_read() {
        let q = encode_query(7, "prefill.test", Qtype::A).unwrap();
        let a = answer(&q, 0, false, &[(5, b"\x03abc\xc0\x0c"), (1, &[10, 0, 0, 2]), (1, &[10, 0, 0, 3])]);
        let want = vec!["10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap()];
        assert_eq!(parse_answer(&q, &a), Ok(Answer::Addresses(want)));
        let q6 = encode_query(8, "prefill.test", Qtype::Aaaa).unwrap();
        let six: [u8; 16] = "fd00::7".parse::<Ipv6Addr>().unwrap().octets();
        let a6 = answer(&q6, 0, false, &[(28, &six)]);
        assert_eq!(parse_answer(&q6, &a6), Ok(Answer::Addresses(vec!["fd00::7".parse().unwrap()])));
        assert_eq!(parse_answer(&q, &answer(&q, 0, false, &[])), Ok(Answer::Addresses(vec![])));
        assert_eq!(parse_answer(&q, &answer(&q, 3, false, &[])), Ok(Answer::NoSuchName));
        assert_eq!(parse_answer(&q, &answer(&q, 0, true, &[])), Ok(Answer::Truncated));
        assert_eq!(parse_answer(&q, &answer(&q, 2, false, &[])), Err(DnsError::Rcode(2)));
    }

    #[test]
    fn answers_to_other_queries_and_broken_ones_are_refused() {
        let q = encode_query(7, "prefill.test", Qtype::A).unwrap();
        let other_id = encode_query(9, "prefill.test", Qtype::A).unwrap();
        let other_name = encode_query(7, "decode.test", Qtype::A).unwrap();
        for other in [other_id, other_name] {
            let a = answer(&other, 0, false, &[(1, &[10, 0, 0, 9])]);
            assert_eq!(parse_answer(&q, &a), Err(DnsError::NotOurs));
        }
        // A query echoed back is not an answer.
        assert_eq!(parse_answer(&q, &q), Err(DnsError::NotOurs));
        let good = answer(&q, 0, false, &[(1, &[10, 0, 0, 2])]);
        for cut in 0..good.len() {
            assert!(parse_answer(&q, &good[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad_len = good.clone();
        let n = bad_len.len();
        bad_len[n - 5] = 3; // an A record of 3 bytes
        assert!(parse_answer(&q, &bad_len[..n - 1]).is_err());
        // Every byte flipped to every value: an error or an answer, never a panic.
        for i in 0..good.len() {
            for v in [0u8, 0x3f, 0x40, 0xc0, 0xff] {
                let mut m = good.clone();
                m[i] = v;
                let _ = parse_answer(&q, &m);
            }
        }
    }
}
