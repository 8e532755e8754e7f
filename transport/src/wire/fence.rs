//! FENCE: verbs backend, engine level (never given to proto). The sender of a message tells the
//! receiver that no RDMA WRITE to one of its buffers is left in the sender's queues; the receiver may ask
//! again for one it waits for.
//!
//! Layout (16 bytes, big-endian):
//! ```text
//!  0..4    magic     "PFNC"
//!  4       kind      1 = FENCE, 2 = FENCE_REQ (the receiver asks again)
//!  5       sub       index of the buffer within the grouped receive
//!  6..8    zero
//!  8..16   cts_seq   sequence number of the CTS (grouped receive)
//! ```
//! A proto packet starts with its version byte, never with the magic.

use super::field::{put_u64, u64_at};
use super::WireError;

/// Bytes of a FENCE.
pub const FENCE_LEN: usize = 16;
/// Magic of a FENCE.
pub const FENCE_MAGIC: &[u8; 4] = b"PFNC";

const KIND: usize = 4;
const SUB: usize = 5;
const CTS_SEQ: usize = 8;

/// FENCE or FENCE_REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FenceKind {
    /// No WRITE to this buffer is left in the sender's queues.
    Fence = 1,
    /// The receiver asks again.
    Request = 2,
}

/// A checked view of a FENCE: exactly [`FENCE_LEN`] bytes with the magic.
#[derive(Debug, Clone)]
pub struct FencePacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> FencePacket<T> {
    /// A view without checks; accessors panic on a buffer shorter than [`FENCE_LEN`].
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer holding exactly one FENCE.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        if b.len() < FENCE_LEN {
            return Err(WireError::Truncated { need: FENCE_LEN, have: b.len() });
        }
        if &b[..4] != FENCE_MAGIC {
            return Err(WireError::BadField { field: "fence magic", value: u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])) });
        }
        if b.len() > FENCE_LEN {
            return Err(WireError::TrailingBytes { expected: FENCE_LEN, actual: b.len() });
        }
        Ok(Self { buffer })
    }

    /// Kind code.
    pub fn kind_code(&self) -> u8 {
        self.buffer.as_ref()[KIND]
    }
    /// Buffer index within the grouped receive.
    pub fn sub(&self) -> u8 {
        self.buffer.as_ref()[SUB]
    }
    /// CTS sequence number.
    pub fn cts_seq(&self) -> u64 {
        u64_at(self.buffer.as_ref(), CTS_SEQ)
    }
}

/// A FENCE's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FenceRepr {
    /// FENCE or FENCE_REQ.
    pub kind: FenceKind,
    /// CTS sequence number of the grouped receive.
    pub cts_seq: u64,
    /// Index of the buffer within it.
    pub sub: u8,
}

impl FenceRepr {
    /// Parse a FENCE; an unknown kind is `UnknownType`.
    pub fn parse<T: AsRef<[u8]>>(p: &FencePacket<T>) -> Result<Self, WireError> {
        let kind = match p.kind_code() {
            1 => FenceKind::Fence,
            2 => FenceKind::Request,
            k => return Err(WireError::UnknownType { got: k }),
        };
        Ok(Self { kind, cts_seq: p.cts_seq(), sub: p.sub() })
    }

    /// Bytes of the packet.
    pub fn buffer_len(&self) -> usize {
        FENCE_LEN
    }

    /// Write the packet into the first [`FENCE_LEN`] bytes of the buffer (every byte of them is written).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut FencePacket<T>) {
        let b = &mut p.buffer.as_mut()[..FENCE_LEN];
        b.fill(0);
        b[..4].copy_from_slice(FENCE_MAGIC);
        b[KIND] = self.kind as u8;
        b[SUB] = self.sub;
        put_u64(b, CTS_SEQ, self.cts_seq);
    }

    /// The packet as an array.
    pub fn to_bytes(&self) -> [u8; FENCE_LEN] {
        let mut b = [0u8; FENCE_LEN];
        self.emit(&mut FencePacket::new_unchecked(&mut b[..]));
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes engine/vcomm.rs's hand-written encoder produced before this module existed.
    #[test]
    fn emit_matches_the_golden_bytes() {
        let r = FenceRepr { kind: FenceKind::Request, cts_seq: 0x0102_0304_0506_0708, sub: 7 };
        assert_eq!(r.to_bytes(), [b'P', b'F', b'N', b'C', 2, 7, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        let r = FenceRepr { kind: FenceKind::Fence, cts_seq: 9, sub: 0 };
        assert_eq!(r.to_bytes(), [b'P', b'F', b'N', b'C', 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9]);
    }

    #[test]
    fn unknown_kind_is_refused() {
        let mut b = FenceRepr { kind: FenceKind::Fence, cts_seq: 1, sub: 1 }.to_bytes();
        b[KIND] = 3;
        assert_eq!(FenceRepr::parse(&FencePacket::new_checked(&b[..]).unwrap()), Err(WireError::UnknownType { got: 3 }));
    }
}
