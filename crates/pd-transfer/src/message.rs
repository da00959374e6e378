//! Wire messages and their binary framing: `[u32 length][u8 kind][fields...]`, little-endian.

use std::fmt;

use crate::TransferError;

/// Element type of the KV memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
    fn code(self) -> u8 {
        match self {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
            Dtype::F16 => 2,
        }
    }
    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => Dtype::F32,
            1 => Dtype::Bf16,
            2 => Dtype::F16,
            _ => return None,
        })
    }
}

/// The shape of one KV block on both sides; a transfer between different layouts is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_size: u32,
    pub dtype: Dtype,
    /// One latent per position and layer (multi-head latent attention: `num_kv_heads` 1, `head_dim`
    /// the latent's width) instead of K and V.
    pub latent: bool,
}

impl Layout {
    /// Bytes of one block: K and V (or the latent) for every layer.
    pub fn block_bytes(&self) -> usize {
        (if self.latent { 1 } else { 2 })
            * self.num_layers as usize
            * self.block_size as usize
            * self.num_kv_heads as usize
            * self.head_dim as usize
            * self.dtype.bytes()
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers x {} {} x {} head dim, {} tokens per block, {:?}",
            self.num_layers,
            self.num_kv_heads,
            if self.latent { "latent" } else { "kv heads" },
            self.head_dim,
            self.block_size,
            self.dtype
        )
    }
}

/// One transfer incarnation. The epoch tells a retry of the same transfer id from a late message of
/// an earlier attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferKey {
    pub transfer: u64,
    pub epoch: u32,
}

impl fmt::Display for TransferKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "transfer {}.{}", self.transfer, self.epoch)
    }
}

/// Why a transfer did not complete. Sent in `Reject` and `Abort`, and reported in events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailReason {
    UnknownTransfer,
    StaleEpoch,
    LayoutMismatch {
        sender: Layout,
        receiver: Layout,
    },
    BlockCountMismatch {
        sender: u32,
        receiver: u32,
    },
    AlreadyClaimed,
    /// The prefill side's lease ran out.
    LeaseExpired,
    /// The decode side's wait for the data ran out.
    DataTimeout,
    /// Ended on purpose (client disconnect, router abort, shutdown), from either side.
    Aborted,
    /// A malformed or out-of-range message.
    Protocol,
    /// A block's bytes did not match its checksum (it was never written into KV memory).
    Checksum,
}

impl FailReason {
    fn code(&self) -> u8 {
        match self {
            FailReason::UnknownTransfer => 1,
            FailReason::StaleEpoch => 2,
            FailReason::LayoutMismatch { .. } => 3,
            FailReason::BlockCountMismatch { .. } => 4,
            FailReason::AlreadyClaimed => 5,
            FailReason::LeaseExpired => 6,
            FailReason::DataTimeout => 7,
            FailReason::Aborted => 8,
            FailReason::Protocol => 9,
            FailReason::Checksum => 10,
        }
    }

    /// A stable word for metrics labels and error types.
    pub fn as_str(&self) -> &'static str {
        match self {
            FailReason::UnknownTransfer => "unknown_transfer",
            FailReason::StaleEpoch => "stale_epoch",
            FailReason::LayoutMismatch { .. } => "layout_mismatch",
            FailReason::BlockCountMismatch { .. } => "block_count_mismatch",
            FailReason::AlreadyClaimed => "already_claimed",
            FailReason::LeaseExpired => "lease_expired",
            FailReason::DataTimeout => "data_timeout",
            FailReason::Aborted => "aborted",
            FailReason::Protocol => "protocol_error",
            FailReason::Checksum => "checksum",
        }
    }
}

impl fmt::Display for FailReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailReason::LayoutMismatch { sender, receiver } => {
                write!(f, "KV layout mismatch: prefill has {sender}, decode has {receiver}")
            }
            FailReason::BlockCountMismatch { sender, receiver } => {
                write!(f, "block count mismatch: prefill holds {sender}, decode expects {receiver}")
            }
            other => f.write_str(other.as_str()),
        }
    }
}

/// What the prefill side knows of a prompt that the decode side needs to go on from it: the prompt's
/// token ids, the first token with its log-probabilities, and how long the prefill side took. It
/// travels in the `Accept`, so a router between the two workers forwards only a small handle.
#[derive(Debug, Clone, Default)]
pub struct PromptMeta {
    pub prompt: Vec<u32>,
    pub first_token: u32,
    /// The first token's log-probability under the model.
    pub first_logprob: f32,
    /// The most likely alternatives for the first token, when the request asked for them.
    pub first_top: Vec<(u32, f32)>,
    /// Microseconds the request waited in the prefill worker's queue, and then took to prefill.
    pub queue_us: u64,
    pub prefill_us: u64,
    /// Prompt tokens the prefill worker found in its prefix cache instead of computing.
    pub cached_tokens: u32,
}

/// Most prompt tokens a `PromptMeta` carries, and most alternatives for the first token.
pub const PROMPT_TOKENS_MAX: usize = 1 << 20;
pub const FIRST_TOP_MAX: usize = 64;

// Log-probabilities compare bit for bit, so a decoded frame equals the one encoded (NaN included)
// and `Message` can be `Eq`.
impl PartialEq for PromptMeta {
    fn eq(&self, o: &Self) -> bool {
        self.prompt == o.prompt
            && self.first_token == o.first_token
            && self.first_logprob.to_bits() == o.first_logprob.to_bits()
            && self.first_top.len() == o.first_top.len()
            && self
                .first_top
                .iter()
                .zip(&o.first_top)
                .all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits())
            && (self.queue_us, self.prefill_us, self.cached_tokens)
                == (o.queue_us, o.prefill_us, o.cached_tokens)
    }
}

impl Eq for PromptMeta {}

/// A protocol message. `Block` carries the block's bytes on the wire; the state machines only see its
/// header, and the I/O shell moves the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Decode → prefill: describe this transfer and get ready to send it. `shared`: the decode worker
    /// can read the prefill worker's shared KV region (same host), so blocks may be named instead of
    /// sent.
    Pull { key: TransferKey, layout: Layout, shared: bool },
    /// Prefill → decode: the pull is accepted; the transfer has `blocks` blocks and this prompt. The
    /// decode side makes room for them, then answers `Ready`.
    Accept { key: TransferKey, blocks: u32, meta: Box<PromptMeta> },
    /// Decode → prefill: the destination blocks are allocated; send blocks `from..` (the decode side
    /// holds the KV of the blocks before `from` in its own prefix cache already). With `from` equal to
    /// the block count nothing is sent and the sender answers as to a `Done`.
    Ready { key: TransferKey, from: u32 },
    /// Prefill → decode: the pull is refused; the transfer is over.
    Reject { key: TransferKey, reason: FailReason },
    /// Prefill → decode: block `index` follows (`len` bytes, whose checksum, `block_checksum`, is
    /// `crc`; 0 for none).
    Block { key: TransferKey, index: u32, len: u32, crc: u32 },
    /// Prefill → decode: block `index` is slot `slot` of the prefill worker's shared KV region,
    /// whose checksum (`block_checksum`, 0 for none) is `crc`.
    BlockAt { key: TransferKey, index: u32, slot: u32, crc: u32 },
    /// Decode → prefill: this many blocks are written (flow control).
    Ack { key: TransferKey, written: u32 },
    /// Decode → prefill: every block is written; confirm that the lease held throughout.
    Done { key: TransferKey },
    /// Prefill → decode: the lease held until `Done` arrived, so every block read was intact.
    Confirm { key: TransferKey },
    /// Either way: the transfer is over.
    Abort { key: TransferKey, reason: FailReason },
}

impl Message {
    pub fn key(&self) -> TransferKey {
        match self {
            Message::Pull { key, .. }
            | Message::Accept { key, .. }
            | Message::Ready { key, .. }
            | Message::Reject { key, .. }
            | Message::Block { key, .. }
            | Message::BlockAt { key, .. }
            | Message::Ack { key, .. }
            | Message::Done { key }
            | Message::Confirm { key }
            | Message::Abort { key, .. } => *key,
        }
    }
}

/// Largest frame accepted (a block of the largest supported layout plus headers).
pub const FRAME_BYTES_MAX: usize = 64 << 20;

fn put_layout(out: &mut Vec<u8>, l: &Layout) {
    for v in [l.num_layers, l.num_kv_heads, l.head_dim, l.block_size] {
        out.extend(v.to_le_bytes());
    }
    out.push(l.dtype.code());
    out.push(u8::from(l.latent));
}

fn put_reason(out: &mut Vec<u8>, r: &FailReason) {
    out.push(r.code());
    match r {
        FailReason::LayoutMismatch { sender, receiver } => {
            put_layout(out, sender);
            put_layout(out, receiver);
        }
        FailReason::BlockCountMismatch { sender, receiver } => {
            out.extend(sender.to_le_bytes());
            out.extend(receiver.to_le_bytes());
        }
        _ => {}
    }
}

fn put_meta(out: &mut Vec<u8>, m: &PromptMeta) {
    out.extend(m.first_token.to_le_bytes());
    out.extend(m.first_logprob.to_bits().to_le_bytes());
    out.extend(m.queue_us.to_le_bytes());
    out.extend(m.prefill_us.to_le_bytes());
    out.extend(m.cached_tokens.to_le_bytes());
    out.extend((m.first_top.len() as u32).to_le_bytes());
    for (t, p) in &m.first_top {
        out.extend(t.to_le_bytes());
        out.extend(p.to_bits().to_le_bytes());
    }
    out.extend((m.prompt.len() as u32).to_le_bytes());
    for t in &m.prompt {
        out.extend(t.to_le_bytes());
    }
}

/// Appends `msg` framed; for `Block`, `data` (exactly `len` bytes) follows the header.
pub fn encode(msg: &Message, data: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend([0u8; 4]);
    let key = msg.key();
    let kind: u8 = match msg {
        Message::Pull { .. } => 1,
        Message::Accept { .. } => 2,
        Message::Reject { .. } => 3,
        Message::Block { .. } => 4,
        Message::Ack { .. } => 5,
        Message::Done { .. } => 6,
        Message::Abort { .. } => 7,
        Message::BlockAt { .. } => 8,
        Message::Confirm { .. } => 9,
        Message::Ready { .. } => 10,
    };
    out.push(kind);
    out.extend(key.transfer.to_le_bytes());
    out.extend(key.epoch.to_le_bytes());
    match msg {
        Message::Pull { layout, shared, .. } => {
            put_layout(out, layout);
            out.push(u8::from(*shared));
        }
        Message::BlockAt { index, slot, crc, .. } => {
            out.extend(index.to_le_bytes());
            out.extend(slot.to_le_bytes());
            out.extend(crc.to_le_bytes());
        }
        Message::Accept { blocks, meta, .. } => {
            out.extend(blocks.to_le_bytes());
            put_meta(out, meta);
        }
        Message::Reject { reason, .. } | Message::Abort { reason, .. } => put_reason(out, reason),
        Message::Block { index, len, crc, .. } => {
            out.extend(index.to_le_bytes());
            out.extend(len.to_le_bytes());
            out.extend(crc.to_le_bytes());
            debug_assert_eq!(data.len(), *len as usize);
            out.extend_from_slice(data);
        }
        Message::Ack { written, .. } => out.extend(written.to_le_bytes()),
        Message::Ready { from, .. } => out.extend(from.to_le_bytes()),
        Message::Done { .. } | Message::Confirm { .. } => {}
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Some(u64::from_le_bytes(a))
    }
    fn layout(&mut self) -> Option<Layout> {
        Some(Layout {
            num_layers: self.u32()?,
            num_kv_heads: self.u32()?,
            head_dim: self.u32()?,
            block_size: self.u32()?,
            dtype: Dtype::from_code(self.u8()?)?,
            latent: match self.u8()? {
                0 => false,
                1 => true,
                _ => return None,
            },
        })
    }
    fn meta(&mut self) -> Option<PromptMeta> {
        let first_token = self.u32()?;
        let first_logprob = f32::from_bits(self.u32()?);
        let queue_us = self.u64()?;
        let prefill_us = self.u64()?;
        let cached_tokens = self.u32()?;
        let top = self.u32()? as usize;
        if top > FIRST_TOP_MAX {
            return None;
        }
        let mut first_top = Vec::with_capacity(top);
        for _ in 0..top {
            first_top.push((self.u32()?, f32::from_bits(self.u32()?)));
        }
        let n = self.u32()? as usize;
        if n > PROMPT_TOKENS_MAX || self.0.len() < n * 4 {
            return None;
        }
        let prompt = (0..n).map(|_| self.u32()).collect::<Option<Vec<u32>>>()?;
        Some(PromptMeta {
            prompt,
            first_token,
            first_logprob,
            first_top,
            queue_us,
            prefill_us,
            cached_tokens,
        })
    }
    fn reason(&mut self) -> Option<FailReason> {
        Some(match self.u8()? {
            1 => FailReason::UnknownTransfer,
            2 => FailReason::StaleEpoch,
            3 => FailReason::LayoutMismatch { sender: self.layout()?, receiver: self.layout()? },
            4 => FailReason::BlockCountMismatch { sender: self.u32()?, receiver: self.u32()? },
            5 => FailReason::AlreadyClaimed,
            6 => FailReason::LeaseExpired,
            7 => FailReason::DataTimeout,
            8 => FailReason::Aborted,
            9 => FailReason::Protocol,
            10 => FailReason::Checksum,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<'a> {
    pub msg: Message,
    /// The block's bytes (empty unless `msg` is `Block`).
    pub data: &'a [u8],
    /// Bytes of the input the frame took.
    pub consumed: usize,
}

/// Decodes one frame from the front of `buf`; `Ok(None)` if it is not complete yet.
pub fn decode(buf: &[u8]) -> Result<Option<Frame<'_>>, TransferError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > FRAME_BYTES_MAX {
        return Err(TransferError::FrameTooLarge { bytes: len });
    }
    if buf.len() < 4 + len {
        return Ok(None);
    }
    let mut r = Reader(&buf[4..4 + len]);
    let msg = (|| {
        let kind = r.u8()?;
        let key = TransferKey { transfer: r.u64()?, epoch: r.u32()? };
        let mut data: &[u8] = &[];
        let m = match kind {
            1 => Message::Pull {
                key,
                layout: r.layout()?,
                shared: match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return None,
                },
            },
            2 => Message::Accept { key, blocks: r.u32()?, meta: Box::new(r.meta()?) },
            3 => Message::Reject { key, reason: r.reason()? },
            4 => {
                let index = r.u32()?;
                let len = r.u32()?;
                let crc = r.u32()?;
                data = r.take(len as usize)?;
                Message::Block { key, index, len, crc }
            }
            5 => Message::Ack { key, written: r.u32()? },
            6 => Message::Done { key },
            7 => Message::Abort { key, reason: r.reason()? },
            8 => Message::BlockAt { key, index: r.u32()?, slot: r.u32()?, crc: r.u32()? },
            9 => Message::Confirm { key },
            10 => Message::Ready { key, from: r.u32()? },
            _ => return None,
        };
        if !r.0.is_empty() {
            return None;
        }
        Some((m, data))
    })();
    match msg {
        Some((msg, data)) => Ok(Some(Frame { msg, data, consumed: 4 + len })),
        None => Err(TransferError::MalformedFrame),
    }
}
