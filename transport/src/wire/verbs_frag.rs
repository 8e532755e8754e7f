//! FRAG: verbs backend, engine level (never given to proto). A retransmitted DATA packet travels as
//! SENDs into the receiver's own receive slots, never as an RDMA WRITE into NCCL's buffer: the
//! receiver copies each fragment's payload into the receive buffer only while that receive is
//! still posted, and gives proto the packet's rebuilt DATA header once every fragment came. So a
//! retransmission, however late, cannot land in a buffer NCCL already has back (a WRITE is placed
//! by the NIC before anybody could check it).
//!
//! Layout (64-byte header, big-endian, then the fragment's payload):
//! ```text
//!  0..4    magic      "PFRG"
//!  4       sub        index of the buffer within the grouped receive
//!  5..7    entropy    the path the sender chose for the packet
//!  7       zero
//!  8..16   token      the receiver's connection token (as DATA carries it)
//! 16..24   cts_ack    the sender's CTS acknowledgement (as DATA carries it)
//! 24..32   cts_seq    sequence number of the CTS (grouped receive)
//! 32..40   psn        the packet's PSN
//! 40..48   offset     byte offset of the packet in the buffer
//! 48..56   total_len  bytes of the whole send into this buffer (DATA's total_len)
//! 56..60   pkt_len    payload bytes of the whole packet
//! 60..64   frag_off   offset of this fragment's payload within the packet
//! 64..     payload    1 ..= pkt_len - frag_off bytes
//! ```
//! A proto packet starts with its version byte, never with the magic.

use super::field::{put_u32, put_u64, u32_at, u64_at};
use super::verbs_desc::DESC_MAX_PKT;
use super::WireError;

/// Bytes of a FRAG's header (its payload follows).
pub const FRAG_HEADER_LEN: usize = 64;
/// Magic of a FRAG.
pub const FRAG_MAGIC: &[u8; 4] = b"PFRG";

const SUB: usize = 4;
const ENTROPY: usize = 5;
const TOKEN: usize = 8;
const CTS_ACK: usize = 16;
const CTS_SEQ: usize = 24;
const PSN: usize = 32;
const OFFSET: usize = 40;
const TOTAL: usize = 48;
const PKT_LEN: usize = 56;
const FRAG_OFF: usize = 60;

/// A fragment's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FragRepr {
    /// Index of the buffer within the grouped receive.
    pub sub: u8,
    /// The path the sender chose for the packet.
    pub entropy: u16,
    /// The receiver's token.
    pub token: u64,
    /// The sender's CTS acknowledgement.
    pub cts_ack: u64,
    /// CTS sequence number of the grouped receive.
    pub cts_seq: u64,
    /// PSN of the packet.
    pub psn: u64,
    /// Offset of the packet in the buffer.
    pub offset: u64,
    /// Bytes of the whole send into this buffer.
    pub total_len: u64,
    /// Payload of the whole packet.
    pub pkt_len: u32,
    /// Offset of this fragment's payload within the packet.
    pub frag_off: u32,
}

impl FragRepr {
    /// Parse a FRAG: the header and its payload (returned), a packet of `1..=DESC_MAX_PKT` bytes
    /// that lies within `total_len`, and a non-empty payload that lies within the packet.
    pub fn parse(b: &[u8]) -> Result<(Self, &[u8]), WireError> {
        if b.len() < FRAG_HEADER_LEN {
            return Err(WireError::Truncated { need: FRAG_HEADER_LEN, have: b.len() });
        }
        if &b[..4] != FRAG_MAGIC {
            return Err(WireError::BadField { field: "frag magic", value: u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])) });
        }
        let r = Self {
            sub: b[SUB],
            entropy: u16::from_be_bytes([b[ENTROPY], b[ENTROPY + 1]]),
            token: u64_at(b, TOKEN),
            cts_ack: u64_at(b, CTS_ACK),
            cts_seq: u64_at(b, CTS_SEQ),
            psn: u64_at(b, PSN),
            offset: u64_at(b, OFFSET),
            total_len: u64_at(b, TOTAL),
            pkt_len: u32_at(b, PKT_LEN),
            frag_off: u32_at(b, FRAG_OFF),
        };
        if r.pkt_len == 0 || r.pkt_len > DESC_MAX_PKT {
            return Err(WireError::BadField { field: "frag pkt_len", value: u64::from(r.pkt_len) });
        }
        if r.offset.checked_add(u64::from(r.pkt_len)).is_none_or(|end| end > r.total_len) {
            return Err(WireError::BadRange { offset: r.offset, len: u64::from(r.pkt_len), limit: r.total_len });
        }
        let payload = &b[FRAG_HEADER_LEN..];
        let end = u64::from(r.frag_off) + payload.len() as u64;
        if payload.is_empty() || end > u64::from(r.pkt_len) {
            return Err(WireError::BadRange { offset: u64::from(r.frag_off), len: payload.len() as u64, limit: u64::from(r.pkt_len) });
        }
        Ok((r, payload))
    }

    /// Write the header into the first [`FRAG_HEADER_LEN`] bytes of `b` (the caller puts the
    /// payload after it).
    pub fn emit(&self, b: &mut [u8]) {
        b[..4].copy_from_slice(FRAG_MAGIC);
        b[SUB] = self.sub;
        b[ENTROPY..ENTROPY + 2].copy_from_slice(&self.entropy.to_be_bytes());
        b[ENTROPY + 2] = 0;
        put_u64(b, TOKEN, self.token);
        put_u64(b, CTS_ACK, self.cts_ack);
        put_u64(b, CTS_SEQ, self.cts_seq);
        put_u64(b, PSN, self.psn);
        put_u64(b, OFFSET, self.offset);
        put_u64(b, TOTAL, self.total_len);
        put_u32(b, PKT_LEN, self.pkt_len);
        put_u32(b, FRAG_OFF, self.frag_off);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> FragRepr {
        FragRepr {
            sub: 1,
            entropy: 0x0203,
            token: 0x0102_0304_0506_0708,
            cts_ack: 9,
            cts_seq: 8,
            psn: 1000,
            offset: 65536,
            total_len: 3 * 65536,
            pkt_len: 65536,
            frag_off: 896,
        }
    }

    fn packet(r: &FragRepr, payload: usize) -> Vec<u8> {
        let mut b = vec![0xa5u8; FRAG_HEADER_LEN + payload];
        r.emit(&mut b);
        b
    }

    #[test]
    fn round_trips_with_its_payload_and_starts_with_the_magic() {
        let b = packet(&sample(), 896);
        assert_eq!(&b[..4], b"PFRG");
        let (r, p) = FragRepr::parse(&b).unwrap();
        assert_eq!(r, sample());
        assert_eq!(p.len(), 896);
        assert!(p.iter().all(|&x| x == 0xa5));
        assert!(FragRepr::parse(&b[..63]).is_err());
    }

    #[test]
    fn refuses_packets_outside_the_send_and_payloads_outside_the_packet() {
        for (bad, payload) in [
            (FragRepr { pkt_len: 0, ..sample() }, 10),
            (FragRepr { pkt_len: DESC_MAX_PKT + 1, ..sample() }, 10),
            (FragRepr { offset: 2 * 65536 + 1, ..sample() }, 10),
            (FragRepr { offset: u64::MAX, ..sample() }, 10),
            (FragRepr { frag_off: 65536 - 10, ..sample() }, 11),
            (FragRepr { frag_off: u32::MAX, ..sample() }, 1),
            (sample(), 0),
        ] {
            assert!(FragRepr::parse(&packet(&bad, payload)).is_err(), "{bad:?} with {payload} bytes");
        }
        let mut b = packet(&sample(), 10);
        b[0] = b'X';
        assert!(FragRepr::parse(&b).is_err());
        assert!(FragRepr::parse(&packet(&FragRepr { frag_off: 65536 - 10, ..sample() }, 10)).is_ok(), "the packet's last bytes");
    }
}
