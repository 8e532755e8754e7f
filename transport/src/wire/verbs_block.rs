//! The verbs handshake block: follows a HELLO of the verbs backend (its length is the HELLO's
//! `block_len`) and tells the peer, per rail, the GID and every QP's number and first PSN.
//!
//! Layout (big-endian):
//! ```text
//!  0       rails     number of rail entries
//!  1..4    zero
//!  4..     per rail: gid (16 bytes), qps (u16), then qps × (qpn u32, psn u32)
//! ```
//! The block must end exactly after its last rail. Unlike the other formats here its `Repr` allocates
//! (a list of rails of lists of QPs); it is read once per connection.

use super::field::{put_u16, put_u32, u16_at, u32_at};
use super::WireError;

/// Bytes before the first rail entry.
pub const VERBS_BLOCK_HEADER_LEN: usize = 4;
/// Bytes of a rail entry before its QPs.
const RAIL_HEADER_LEN: usize = 18;
/// Bytes per QP.
const QP_LEN: usize = 8;

/// One side's QPs on one rail, as the handshake tells them to the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailPeer {
    /// The side's GID.
    pub gid: [u8; 16],
    /// (QP number, first PSN) per entropy.
    pub qps: Vec<(u32, u32)>,
}

impl RailPeer {
    /// Bytes of this rail's entry.
    pub fn encoded_len(&self) -> usize {
        RAIL_HEADER_LEN + QP_LEN * self.qps.len()
    }
}

/// A checked view of a verbs block: every rail entry complete, nothing after the last.
#[derive(Debug, Clone)]
pub struct VerbsBlock<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> VerbsBlock<T> {
    /// A view without checks.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer holding exactly one verbs block.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        if b.len() < VERBS_BLOCK_HEADER_LEN {
            return Err(WireError::Truncated { need: VERBS_BLOCK_HEADER_LEN, have: b.len() });
        }
        let mut at = VERBS_BLOCK_HEADER_LEN;
        for _ in 0..b[0] {
            if b.len() < at + RAIL_HEADER_LEN {
                return Err(WireError::Truncated { need: at + RAIL_HEADER_LEN, have: b.len() });
            }
            let need = at + RAIL_HEADER_LEN + QP_LEN * usize::from(u16_at(b, at + 16));
            if b.len() < need {
                return Err(WireError::Truncated { need, have: b.len() });
            }
            at = need;
        }
        if b.len() > at {
            return Err(WireError::TrailingBytes { expected: at, actual: b.len() });
        }
        Ok(Self { buffer })
    }

    /// Number of rail entries.
    pub fn rail_count(&self) -> u8 {
        self.buffer.as_ref()[0]
    }

    /// The rail entries, in order (the view must have been checked).
    pub fn rails(&self) -> impl Iterator<Item = RailPeer> + '_ {
        let b = self.buffer.as_ref();
        let mut at = VERBS_BLOCK_HEADER_LEN;
        (0..b[0]).map(move |_| {
            let mut gid = [0u8; 16];
            gid.copy_from_slice(&b[at..at + 16]);
            let n = usize::from(u16_at(b, at + 16));
            let first = at + RAIL_HEADER_LEN;
            let qps = (0..n).map(|i| (u32_at(b, first + QP_LEN * i), u32_at(b, first + QP_LEN * i + 4))).collect();
            at = first + QP_LEN * n;
            RailPeer { gid, qps }
        })
    }
}

/// A verbs block's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsBlockRepr {
    /// Per rail, in rail order (at most 255; each with at most 65535 QPs).
    pub rails: Vec<RailPeer>,
}

impl VerbsBlockRepr {
    /// Parse a checked block.
    pub fn parse<T: AsRef<[u8]>>(p: &VerbsBlock<T>) -> Result<Self, WireError> {
        Ok(Self { rails: p.rails().collect() })
    }

    /// Bytes of the block.
    pub fn buffer_len(&self) -> usize {
        VERBS_BLOCK_HEADER_LEN + self.rails.iter().map(RailPeer::encoded_len).sum::<usize>()
    }

    /// Write the block; the buffer must hold [`Self::buffer_len`] bytes. The caller keeps the counts in
    /// range (at most 255 rails, 65535 QPs per rail).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut VerbsBlock<T>) {
        let b = p.buffer.as_mut();
        b[..VERBS_BLOCK_HEADER_LEN].copy_from_slice(&[self.rails.len() as u8, 0, 0, 0]);
        let mut at = VERBS_BLOCK_HEADER_LEN;
        for r in &self.rails {
            b[at..at + 16].copy_from_slice(&r.gid);
            put_u16(b, at + 16, r.qps.len() as u16);
            at += RAIL_HEADER_LEN;
            for &(qpn, psn) in &r.qps {
                put_u32(b, at, qpn);
                put_u32(b, at + 4, psn);
                at += QP_LEN;
            }
        }
    }

    /// The block as a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut VerbsBlock::new_unchecked(&mut v[..]));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes `vcomm::encode_peers` with `RailPeer::encode` (backend/verbs.rs) produced before this
    /// module existed.
    #[test]
    fn emit_matches_the_golden_bytes() {
        let r = VerbsBlockRepr {
            rails: vec![RailPeer { gid: [7; 16], qps: vec![(0x11, 0xab_cdef), (0x12, 1)] }, RailPeer { gid: [2; 16], qps: vec![] }],
        };
        let mut want = vec![2, 0, 0, 0];
        want.extend_from_slice(&[7; 16]);
        want.extend_from_slice(&[0, 2, 0, 0, 0, 0x11, 0, 0xab, 0xcd, 0xef, 0, 0, 0, 0x12, 0, 0, 0, 1]);
        want.extend_from_slice(&[2; 16]);
        want.extend_from_slice(&[0, 0]);
        assert_eq!(r.to_vec(), want);
    }

    #[test]
    fn short_long_and_empty_blocks_are_refused() {
        let r = VerbsBlockRepr { rails: vec![RailPeer { gid: [1; 16], qps: vec![(0x11, 5), (0x12, 6)] }] };
        let b = r.to_vec();
        assert_eq!(VerbsBlockRepr::parse(&VerbsBlock::new_checked(&b[..]).unwrap()).unwrap(), r);
        assert!(VerbsBlock::new_checked(&b[..b.len() - 1]).is_err());
        let mut long = b.clone();
        long.push(0);
        assert!(VerbsBlock::new_checked(&long[..]).is_err());
        assert!(VerbsBlock::new_checked(&[][..]).is_err());
    }
}
