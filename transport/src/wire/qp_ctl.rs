//! QP control: verbs backend, engine level (never given to proto). Re-creates a dead QP with the peer
//! (see `engine::revive`): a REQ carries the asker's reset QP, the ACK the answerer's.
//!
//! Layout (20 bytes, big-endian):
//! ```text
//!  0..4    magic     "PQPR"
//!  4       kind      1 = REQ, 2 = ACK
//!  5       rail      rail of the QP
//!  6..8    entropy   index of the QP on its rail
//!  8..12   epoch     the asker's attempt number (never 0)
//! 12..16   qpn       the sender's QP number (24 bits, never 0)
//! 16..20   psn       the sender's first PSN (24 bits)
//! ```
//! Whether `rail` and `entropy` name a QP of the connection is for the connection to check.
//! A proto packet starts with its version byte, never with the magic.

use super::field::{put_u16, put_u32, u16_at, u32_at};
use super::WireError;

/// Bytes of a QP control packet.
pub const QP_CTL_LEN: usize = 20;
/// Magic of a QP control packet.
pub const QP_CTL_MAGIC: &[u8; 4] = b"PQPR";

const KIND: usize = 4;
const RAIL: usize = 5;
const ENTROPY: usize = 6;
const EPOCH: usize = 8;
const QPN: usize = 12;
const PSN: usize = 16;

/// Largest QP number and PSN (24 bits).
const MAX_24: u32 = 0xFF_FFFF;

/// REQ or ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpCtlKind {
    /// "I reset my QP; reset yours and connect it to mine."
    Req = 1,
    /// "Done; here is mine."
    Ack = 2,
}

/// Does this datagram claim to be a QP control packet (does it start with the magic)?
pub fn is_qp_ctl(b: &[u8]) -> bool {
    b.len() >= 4 && &b[..4] == QP_CTL_MAGIC
}

/// A checked view of a QP control packet: exactly [`QP_CTL_LEN`] bytes with the magic.
#[derive(Debug, Clone)]
pub struct QpCtlPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> QpCtlPacket<T> {
    /// A view without checks; accessors panic on a buffer shorter than [`QP_CTL_LEN`].
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer holding exactly one QP control packet.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        if b.len() < QP_CTL_LEN {
            return Err(WireError::Truncated { need: QP_CTL_LEN, have: b.len() });
        }
        if !is_qp_ctl(b) {
            return Err(WireError::BadField { field: "qp control magic", value: u64::from(u32_at(b, 0)) });
        }
        if b.len() > QP_CTL_LEN {
            return Err(WireError::TrailingBytes { expected: QP_CTL_LEN, actual: b.len() });
        }
        Ok(Self { buffer })
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// Kind code.
    pub fn kind_code(&self) -> u8 {
        self.b()[KIND]
    }
    /// Rail.
    pub fn rail(&self) -> u8 {
        self.b()[RAIL]
    }
    /// QP index on the rail.
    pub fn entropy(&self) -> u16 {
        u16_at(self.b(), ENTROPY)
    }
    /// Attempt number.
    pub fn epoch(&self) -> u32 {
        u32_at(self.b(), EPOCH)
    }
    /// QP number.
    pub fn qpn(&self) -> u32 {
        u32_at(self.b(), QPN)
    }
    /// First PSN.
    pub fn psn(&self) -> u32 {
        u32_at(self.b(), PSN)
    }
}

/// A QP control packet's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCtlRepr {
    /// REQ or ACK.
    pub kind: QpCtlKind,
    /// Rail of the QP.
    pub rail: u8,
    /// Index of the QP on its rail.
    pub q: u16,
    /// The asker's attempt number (never 0).
    pub epoch: u32,
    /// The sender's QP number (1..=0xFFFFFF).
    pub qpn: u32,
    /// The sender's first PSN (0..=0xFFFFFF).
    pub psn: u32,
}

impl QpCtlRepr {
    /// Parse a QP control packet: known kind, epoch and QPN not 0, QPN and PSN within 24 bits.
    pub fn parse<T: AsRef<[u8]>>(p: &QpCtlPacket<T>) -> Result<Self, WireError> {
        let kind = match p.kind_code() {
            1 => QpCtlKind::Req,
            2 => QpCtlKind::Ack,
            k => return Err(WireError::UnknownType { got: k }),
        };
        let c = Self { kind, rail: p.rail(), q: p.entropy(), epoch: p.epoch(), qpn: p.qpn(), psn: p.psn() };
        if c.epoch == 0 {
            return Err(WireError::BadField { field: "qp control epoch", value: 0 });
        }
        if c.qpn == 0 || c.qpn > MAX_24 {
            return Err(WireError::BadField { field: "qp control qpn", value: u64::from(c.qpn) });
        }
        if c.psn > MAX_24 {
            return Err(WireError::BadField { field: "qp control psn", value: u64::from(c.psn) });
        }
        Ok(c)
    }

    /// Bytes of the packet.
    pub fn buffer_len(&self) -> usize {
        QP_CTL_LEN
    }

    /// Write the packet into the first [`QP_CTL_LEN`] bytes of the buffer.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut QpCtlPacket<T>) {
        let b = &mut p.buffer.as_mut()[..QP_CTL_LEN];
        b[..4].copy_from_slice(QP_CTL_MAGIC);
        b[KIND] = self.kind as u8;
        b[RAIL] = self.rail;
        put_u16(b, ENTROPY, self.q);
        put_u32(b, EPOCH, self.epoch);
        put_u32(b, QPN, self.qpn);
        put_u32(b, PSN, self.psn);
    }

    /// The packet as an array.
    pub fn to_bytes(&self) -> [u8; QP_CTL_LEN] {
        let mut b = [0u8; QP_CTL_LEN];
        self.emit(&mut QpCtlPacket::new_unchecked(&mut b[..]));
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes engine/revive.rs's hand-written encoder (`QpCtl::encode`) produced before this module.
    #[test]
    fn emit_matches_the_golden_bytes() {
        let r = QpCtlRepr { kind: QpCtlKind::Ack, rail: 3, q: 0x0102, epoch: 0x0a0b_0c0d, qpn: 0x12_3456, psn: 0xab_cdef };
        assert_eq!(r.to_bytes(), [b'P', b'Q', b'P', b'R', 2, 3, 1, 2, 0x0a, 0x0b, 0x0c, 0x0d, 0, 0x12, 0x34, 0x56, 0, 0xab, 0xcd, 0xef]);
    }

    #[test]
    fn zero_epoch_zero_qpn_and_wide_fields_are_refused() {
        let good = QpCtlRepr { kind: QpCtlKind::Req, rail: 0, q: 0, epoch: 1, qpn: 1, psn: 0 };
        for bad in [
            QpCtlRepr { epoch: 0, ..good },
            QpCtlRepr { qpn: 0, ..good },
            QpCtlRepr { qpn: 1 << 24, ..good },
            QpCtlRepr { psn: 1 << 24, ..good },
        ] {
            let b = bad.to_bytes();
            assert!(QpCtlRepr::parse(&QpCtlPacket::new_checked(&b[..]).unwrap()).is_err(), "{bad:?} accepted");
        }
        let mut b = good.to_bytes();
        b[KIND] = 0;
        assert_eq!(QpCtlRepr::parse(&QpCtlPacket::new_checked(&b[..]).unwrap()), Err(WireError::UnknownType { got: 0 }));
    }
}
