//! Packet formats: zero-copy checked views and plain `Repr` structs, parsed and emitted big-endian.
//!
//! Every Prism packet opens with the 20-byte common header of [`header`] (version, type, flags,
//! destination token, CTS acknowledgement); one file per packet type describes the rest of its layout:
//! [`data`] (payload), [`cts`] (clear-to-send: the receiver's posted buffers), [`sack`] (selective
//! acknowledgement) and [`control`] (ACK, PING, PONG, CLOSE).
//!
//! The engine's own formats, never given to proto, have their own magic instead of the common header:
//! [`hello`] (the connection handshake over TCP) with the [`verbs_block`] that follows it on verbs, and,
//! on the verbs backend's QPs, [`verbs_desc`] (describes a run of header-less WRITEs),
//! [`verbs_frag`] (a retransmission's fragments), [`fence`] (no WRITE to a buffer is left in flight)
//! and [`qp_ctl`] (re-creating a dead QP). A proto packet starts with its version byte, never with one of those magics.
//!
//! A view's `new_checked` checks the length, version and type once; a `Repr::parse` then checks the
//! fields that relate to each other (offsets, counts, ranges). Code past `parse` works on a `Repr` that
//! cannot be malformed. Nothing here allocates but the verbs block's `Repr` (read once per connection).

pub mod control;
pub mod cts;
pub mod data;
pub mod fence;
pub mod header;
pub mod hello;
pub mod qp_ctl;
pub mod sack;
pub mod verbs_block;
pub mod verbs_desc;
pub mod verbs_frag;

pub use control::{ControlKind, ControlPacket, ControlRepr, CONTROL_LEN};
pub use cts::{CtsBuf, CtsKeys, CtsPacket, CtsRepr, CTS_KEYED_MAX_LEN, CTS_MAX_KEY_RAILS, CTS_MAX_LEN};
pub use data::{DataPacket, DataRepr, DATA_HEADER_LEN};
pub use fence::{FenceKind, FencePacket, FenceRepr, FENCE_LEN};
pub use header::{Header, PacketType, HEADER_LEN};
pub use hello::{HelloBackend, HelloKind, HelloPacket, HelloRepr, HELLO_LEN, HELLO_MAX_BLOCK, HELLO_MAX_RAILS, HELLO_VERSION};
pub use qp_ctl::{QpCtlKind, QpCtlPacket, QpCtlRepr, QP_CTL_LEN};
pub use sack::{SackPacket, SackRepr, SACK_BITMAP_PSNS, SACK_LEN};
pub use verbs_block::{RailPeer, VerbsBlock, VerbsBlockRepr};
pub use verbs_desc::{DescRepr, DESC_LEN};
pub use verbs_frag::{FragRepr, FRAG_HEADER_LEN};

/// Protocol version this build speaks; packets of any other version are dropped.
pub const VERSION: u8 = 1;

/// Most buffers one grouped receive (one CTS) may carry (NCCL's `maxRecvs`).
pub const MAX_RECV_BUFS: usize = 8;

/// Bytes of the largest header: a DATA packet is at most `MAX_HEADER_LEN + payload` bytes.
pub const MAX_HEADER_LEN: usize = DATA_HEADER_LEN;

/// Every DATA packet's payload starts at a multiple of this many bytes of its buffer, and every packet
/// but the last of a buffer carries a multiple of it: NCCL's LL reader trusts a 16-byte line (LL128: a
/// 128-byte line) once its flags are new, so no write may end inside a line (NCCL's IB transport
/// aligns its writes to 128 bytes for the same reason).
pub const LINE_BYTES: usize = 128;

/// Smallest payload size a connection uses (one line); every control packet fits in
/// `MAX_HEADER_LEN + MIN_PAYLOAD` bytes, so a datagram buffer sized for DATA also fits any control packet.
pub const MIN_PAYLOAD: usize = LINE_BYTES;

const _: () = assert!(CTS_MAX_LEN <= MAX_HEADER_LEN + MIN_PAYLOAD);
const _: () = assert!(SACK_LEN <= MAX_HEADER_LEN + MIN_PAYLOAD);
const _: () = assert!(CONTROL_LEN <= MAX_HEADER_LEN + MIN_PAYLOAD);

/// Why a datagram could not be parsed. Each variant maps to one drop counter of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The datagram ends before the fields its header promises.
    #[error("packet truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes the packet needs.
        need: usize,
        /// Bytes the datagram has.
        have: usize,
    },
    /// The version byte is not [`VERSION`].
    #[error("unsupported protocol version {got} (this build speaks version {VERSION})")]
    BadVersion {
        /// Version found in the packet.
        got: u8,
    },
    /// The type byte (or a control packet's kind) names no known packet.
    #[error("unknown packet type {got}")]
    UnknownType {
        /// Type found in the packet.
        got: u8,
    },
    /// A view of one type was asked to read a packet of another type.
    #[error("packet type {got} where type {expected} was expected")]
    WrongType {
        /// Type the view reads.
        expected: u8,
        /// Type found in the packet.
        got: u8,
    },
    /// The datagram is longer than the packet its header describes.
    #[error("packet has {actual} bytes but its header describes {expected}")]
    TrailingBytes {
        /// Bytes the header describes.
        expected: usize,
        /// Bytes the datagram has.
        actual: usize,
    },
    /// An offset/length pair does not fit inside the range it must stay in.
    #[error("range {offset}+{len} exceeds the limit {limit}")]
    BadRange {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// The range must end at or before this.
        limit: u64,
    },
    /// A field holds a value outside what the format allows.
    #[error("field {field} has invalid value {value}")]
    BadField {
        /// Name of the field.
        field: &'static str,
        /// The value found.
        value: u64,
    },
}

/// The destination token of a datagram (which local connection it is for), without parsing the rest.
/// `None` when the datagram is too short to carry one.
pub fn peek_token(bytes: &[u8]) -> Option<u64> {
    (bytes.len() >= HEADER_LEN).then(|| Header::new_unchecked(bytes).token())
}

/// Set the congestion-experienced flag of a DATA packet in place (for a driver that saw an ECN CE mark
/// on the datagram, or a simulated switch). Returns false, changing nothing, for any other datagram.
pub fn mark_congestion_experienced(bytes: &mut [u8]) -> bool {
    match DataPacket::new_checked(&mut *bytes) {
        Ok(mut p) => {
            let flags = p.header().flags();
            p.header_mut().set_flags(flags | data::FLAG_CE);
            true
        }
        Err(_) => false,
    }
}

/// Big-endian field access on slices whose length the caller checked.
pub(crate) mod field {
    pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_be_bytes([b[at], b[at + 1]])
    }
    pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
        let mut a = [0u8; 4];
        a.copy_from_slice(&b[at..at + 4]);
        u32::from_be_bytes(a)
    }
    pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[at..at + 8]);
        u64::from_be_bytes(a)
    }
    pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
        b[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peek_token_reads_the_destination_token_of_any_type() {
        let mut buf = [0u8; CONTROL_LEN];
        let repr = ControlRepr { token: 0xfeed_beef_0123_4567, cts_ack: 3, kind: ControlKind::Ping, entropy: 2, ts_us: 9, cum_psn: 0 };
        repr.emit(&mut ControlPacket::new_unchecked(&mut buf[..]));
        assert_eq!(peek_token(&buf), Some(0xfeed_beef_0123_4567));
        assert_eq!(peek_token(&buf[..HEADER_LEN - 1]), None);
    }

    #[test]
    fn congestion_mark_sets_only_the_ce_flag_of_data_packets() {
        let repr = DataRepr { len: 0, ..data::tests::sample() };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut DataPacket::new_unchecked(&mut buf[..]));
        assert!(mark_congestion_experienced(&mut buf));
        let parsed = DataRepr::parse(&DataPacket::new_checked(&buf[..]).unwrap()).unwrap();
        assert_eq!(parsed, DataRepr { ce: true, ..repr });

        let mut ctl = [0u8; CONTROL_LEN];
        ControlRepr { token: 1, cts_ack: 0, kind: ControlKind::Ack, entropy: 0, ts_us: 0, cum_psn: 0 }
            .emit(&mut ControlPacket::new_unchecked(&mut ctl[..]));
        let before = ctl;
        assert!(!mark_congestion_experienced(&mut ctl));
        assert_eq!(ctl, before);
    }
}
