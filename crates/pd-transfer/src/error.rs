//! The crate's one error type. (How a transfer ended is not an error of the API but protocol data:
//! [`crate::FailReason`], carried in `Reject` and `Abort` and reported in events.)

use std::fmt;
use std::io;
use std::net::SocketAddr;

use pdserve_kvcache::BlockId;

/// Why a call on the protocol, the framing or an endpoint was refused.
#[derive(Debug)]
#[non_exhaustive]
pub enum TransferError {
    /// This transfer is already live on this side.
    Duplicate,
    /// `limit` transfers are already live on this side.
    TooMany { limit: usize },
    /// No such transfer, or it is not waiting for destinations.
    NotDescribed,
    /// The destinations are not as many as the sender's blocks; the transfer ended.
    BlockCount { sender: u32, receiver: u32 },
    /// The sending side cannot be reached.
    Connect { addr: SocketAddr, error: io::Error },
    /// A frame's length prefix is over [`crate::FRAME_BYTES_MAX`].
    FrameTooLarge { bytes: usize },
    /// A frame is not a message of this protocol.
    MalformedFrame,
    /// The worker's KV memory refused a block (out of range, wrong size).
    BlockIo { block: BlockId },
}

// Compared by variant and data; an I/O error by its kind.
impl PartialEq for TransferError {
    fn eq(&self, other: &Self) -> bool {
        use TransferError::*;
        match (self, other) {
            (Duplicate, Duplicate) | (NotDescribed, NotDescribed) | (MalformedFrame, MalformedFrame) => true,
            (TooMany { limit: a }, TooMany { limit: b }) => a == b,
            (BlockCount { sender: a, receiver: b }, BlockCount { sender: c, receiver: d }) => {
                (a, b) == (c, d)
            }
            (Connect { addr: a, error: e }, Connect { addr: b, error: f }) => a == b && e.kind() == f.kind(),
            (FrameTooLarge { bytes: a }, FrameTooLarge { bytes: b }) => a == b,
            (BlockIo { block: a }, BlockIo { block: b }) => a == b,
            _ => false,
        }
    }
}

impl fmt::Display for TransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransferError::Duplicate => write!(f, "this transfer is already live here"),
            TransferError::TooMany { limit } => write!(f, "{limit} transfers are already live here"),
            TransferError::NotDescribed => write!(f, "no such transfer is waiting for its destinations"),
            TransferError::BlockCount { sender, receiver } => {
                write!(f, "the sender holds {sender} blocks, the receiver gave {receiver} destinations")
            }
            TransferError::Connect { addr, error } => {
                write!(f, "cannot reach the prefill worker at {addr}: {error}")
            }
            TransferError::FrameTooLarge { bytes } => write!(f, "a frame of {bytes} bytes is over the limit"),
            TransferError::MalformedFrame => write!(f, "a malformed frame"),
            TransferError::BlockIo { block } => write!(f, "KV memory refused {block}"),
        }
    }
}

impl std::error::Error for TransferError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TransferError::Connect { error, .. } => Some(error),
            _ => None,
        }
    }
}
