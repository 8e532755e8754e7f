//! DESC: verbs backend, engine level (never given to proto). Describes a run of DATA packets of one
//! send item (one receive buffer of one grouped receive) whose payloads travel as RDMA WRITE WITH
//! IMM without a header: the receiver rebuilds each packet's DATA header from this descriptor, the
//! WRITE's immediate (the PSN's low 31 bits, bit 31 = retransmission) and the completion's byte count.
//! Packet `first_psn + k` carries the bytes at `offset + k * pkt_bytes` of the buffer (every packet
//! but the run's last carries exactly `pkt_bytes`). Sent once before a run's first WRITE, and again
//! before a WRITE whose packet carries a newer `cts_ack` (a retransmission is no WRITE: it travels
//! as fragments, [`super::verbs_frag`], which carry their own header).
//!
//! Layout (64 bytes, big-endian):
//! ```text
//!  0..4    magic      "PDSC"
//!  4       sub        index of the buffer within the grouped receive
//!  5..8    zero
//!  8..16   token      the receiver's connection token (as DATA carries it)
//! 16..24   cts_ack    the sender's CTS acknowledgement (as DATA carries it)
//! 24..32   cts_seq    sequence number of the CTS (grouped receive)
//! 32..40   first_psn  PSN of the run's first packet
//! 40..48   offset     byte offset of the run's first packet in the buffer
//! 48..56   total_len  bytes of the whole send into this buffer (DATA's total_len)
//! 56..60   pkt_bytes  payload bytes of each packet but the last
//! 60..64   npkts      packets in the run
//! ```
//! A proto packet starts with its version byte, never with the magic.

use super::field::{put_u32, put_u64, u32_at, u64_at};
use super::WireError;

/// Bytes of a DESC.
pub const DESC_LEN: usize = 64;
/// Magic of a DESC.
pub const DESC_MAGIC: &[u8; 4] = b"PDSC";
/// Largest payload of one described packet (`PRISM_IB_CHUNK`'s upper bound).
pub const DESC_MAX_PKT: u32 = 1 << 24;

const SUB: usize = 4;
const TOKEN: usize = 8;
const CTS_ACK: usize = 16;
const CTS_SEQ: usize = 24;
const FIRST_PSN: usize = 32;
const OFFSET: usize = 40;
const TOTAL: usize = 48;
const PKT: usize = 56;
const NPKTS: usize = 60;

/// A descriptor's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescRepr {
    /// Index of the buffer within the grouped receive.
    pub sub: u8,
    /// The receiver's token.
    pub token: u64,
    /// The sender's CTS acknowledgement.
    pub cts_ack: u64,
    /// CTS sequence number of the grouped receive.
    pub cts_seq: u64,
    /// PSN of the run's first packet.
    pub first_psn: u64,
    /// Offset of the run's first packet in the buffer.
    pub offset: u64,
    /// Bytes of the whole send into this buffer.
    pub total_len: u64,
    /// Payload of each packet but the last.
    pub pkt_bytes: u32,
    /// Packets in the run.
    pub npkts: u32,
}

impl DescRepr {
    /// Parse a DESC: exactly [`DESC_LEN`] bytes with the magic, a packet size in
    /// `1..=DESC_MAX_PKT`, at least one packet, PSNs and bytes that do not overflow and a run that
    /// ends within `total_len`.
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        if b.len() < DESC_LEN {
            return Err(WireError::Truncated { need: DESC_LEN, have: b.len() });
        }
        if &b[..4] != DESC_MAGIC {
            return Err(WireError::BadField { field: "desc magic", value: u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])) });
        }
        if b.len() > DESC_LEN {
            return Err(WireError::TrailingBytes { expected: DESC_LEN, actual: b.len() });
        }
        let r = Self {
            sub: b[SUB],
            token: u64_at(b, TOKEN),
            cts_ack: u64_at(b, CTS_ACK),
            cts_seq: u64_at(b, CTS_SEQ),
            first_psn: u64_at(b, FIRST_PSN),
            offset: u64_at(b, OFFSET),
            total_len: u64_at(b, TOTAL),
            pkt_bytes: u32_at(b, PKT),
            npkts: u32_at(b, NPKTS),
        };
        if r.pkt_bytes == 0 || r.pkt_bytes > DESC_MAX_PKT {
            return Err(WireError::BadField { field: "desc pkt_bytes", value: u64::from(r.pkt_bytes) });
        }
        if r.npkts == 0 || r.first_psn.checked_add(u64::from(r.npkts)).is_none() {
            return Err(WireError::BadField { field: "desc npkts", value: u64::from(r.npkts) });
        }
        // The run's last packet starts inside the send.
        let last = u64::from(r.npkts - 1).checked_mul(u64::from(r.pkt_bytes)).and_then(|x| x.checked_add(r.offset));
        if last.is_none_or(|l| l >= r.total_len) {
            return Err(WireError::BadRange { offset: r.offset, len: u64::from(r.npkts) * u64::from(r.pkt_bytes), limit: r.total_len });
        }
        Ok(r)
    }

    /// Offset and payload length of packet `psn` given the `len` its WRITE placed, when `psn` is in
    /// the run and `len` is what that packet carries (`pkt_bytes`, or the rest of the send for the
    /// last packet of the send); None otherwise.
    pub fn place(&self, psn: u64, len: u32) -> Option<u64> {
        let k = psn.checked_sub(self.first_psn).filter(|&k| k < u64::from(self.npkts))?;
        let off = k.checked_mul(u64::from(self.pkt_bytes))?.checked_add(self.offset)?;
        let rest = self.total_len.checked_sub(off)?;
        let want = rest.min(u64::from(self.pkt_bytes));
        (want > 0 && u64::from(len) == want).then_some(off)
    }

    /// The packet as an array.
    pub fn to_bytes(&self) -> [u8; DESC_LEN] {
        let mut b = [0u8; DESC_LEN];
        b[..4].copy_from_slice(DESC_MAGIC);
        b[SUB] = self.sub;
        put_u64(&mut b, TOKEN, self.token);
        put_u64(&mut b, CTS_ACK, self.cts_ack);
        put_u64(&mut b, CTS_SEQ, self.cts_seq);
        put_u64(&mut b, FIRST_PSN, self.first_psn);
        put_u64(&mut b, OFFSET, self.offset);
        put_u64(&mut b, TOTAL, self.total_len);
        put_u32(&mut b, PKT, self.pkt_bytes);
        put_u32(&mut b, NPKTS, self.npkts);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DescRepr {
        DescRepr {
            sub: 2,
            token: 0x0102_0304_0506_0708,
            cts_ack: 9,
            cts_seq: 8,
            first_psn: 1000,
            offset: 0,
            total_len: 3 * 65536 + 100,
            pkt_bytes: 65536,
            npkts: 4,
        }
    }

    #[test]
    fn round_trips_and_starts_with_the_magic() {
        let b = sample().to_bytes();
        assert_eq!(&b[..4], b"PDSC");
        assert_eq!(DescRepr::parse(&b), Ok(sample()));
        assert!(DescRepr::parse(&b[..63]).is_err());
        let mut long = b.to_vec();
        long.push(0);
        assert!(DescRepr::parse(&long).is_err());
    }

    #[test]
    fn refuses_runs_outside_the_send_and_bad_sizes() {
        for bad in [
            DescRepr { pkt_bytes: 0, ..sample() },
            DescRepr { pkt_bytes: DESC_MAX_PKT + 1, ..sample() },
            DescRepr { npkts: 0, ..sample() },
            DescRepr { npkts: 5, ..sample() },
            DescRepr { offset: 65536, ..sample() },
            DescRepr { first_psn: u64::MAX - 1, ..sample() },
            DescRepr { offset: u64::MAX, npkts: 1, ..sample() },
            DescRepr { npkts: u32::MAX, pkt_bytes: DESC_MAX_PKT, ..sample() },
        ] {
            assert!(DescRepr::parse(&bad.to_bytes()).is_err(), "{bad:?}");
        }
        let mut b = sample().to_bytes();
        b[0] = b'X';
        assert!(DescRepr::parse(&b).is_err());
    }

    #[test]
    fn places_each_packet_of_the_run_and_only_with_its_own_length() {
        let d = sample();
        assert_eq!(d.place(1000, 65536), Some(0));
        assert_eq!(d.place(1002, 65536), Some(2 * 65536));
        assert_eq!(d.place(1003, 100), Some(3 * 65536), "the send's last packet carries the rest");
        assert_eq!(d.place(1003, 65536), None);
        assert_eq!(d.place(1001, 100), None, "a short packet that is not the last");
        assert_eq!(d.place(999, 65536), None);
        assert_eq!(d.place(1004, 65536), None);
        let mid = DescRepr { first_psn: 2000, offset: 65536, npkts: 2, ..sample() };
        assert_eq!(mid.place(2000, 65536), Some(65536));
        assert_eq!(mid.place(2001, 65536), Some(2 * 65536));
    }
}
