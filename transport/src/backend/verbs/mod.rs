//! Verbs backend (RoCEv2) on the `sideway` crate, which loads `libibverbs.so.1` at run time: the same
//! library works on hosts without rdma-core, where [`probe`] just reports that no device exists.
//!
//! Per rail ([`VerbsDevice`]): device context, PD, the RoCEv2 IPv4-mapped GID, and a registration
//! cache ([`MrCache`]: NCCL registers the same buffer again and again). Per connection and rail
//! ([`QpSet`]): `PRISM_PATHS` UC (or RC) QPs, one per entropy, each with its own GRH flow label so its
//! RoCEv2 UDP source port (and so its ECMP path) differs ([`flow_label`], [`udp_sport`]); one send and
//! one receive CQ (basic CQs: rxe's extended CQ polls forever, research note G1); a registered ring of
//! small send slots and one of receive slots.
//!
//! Data: an RDMA WRITE WITH IMM of the payload from the registered send buffer straight into the
//! receiver's registered buffer (imm = low 32 bits of the PSN, big-endian on the wire, note G3), then a
//! SEND of the 64-byte DATA header on the same QP (a QP keeps order). Every other packet is a SEND. The
//! receiver pairs each header with the WRITE that came just before it on that QP ([`match_header`]);
//! a header without its WRITE, or a WRITE without its header (UC lost one of them), is dropped and
//! counted, and proto's loss recovery resends the packet.
//!
//! Every receive WQE carries one slot of the receive ring; a WRITE WITH IMM consumes a WQE without
//! writing into it (note G4), so WRITEs and SENDs can share one FIFO receive queue.
#![allow(unsafe_code)]

pub use crate::wire::RailPeer;
use crate::wire::{DataPacket, Header, PacketType, DATA_HEADER_LEN};
pub use device::{probe, MrKeys, VerbsDevice};
pub use mr::MrCache;
pub use qp::{PostFail, QpSet, QpStats, RxEvent};

/// Bytes of one send or receive ring slot: the largest control packet (a keyed CTS) fits.
pub const SLOT_BYTES: usize = 1024;
/// Receive WQEs (and ring slots) per QP.
pub const RECV_DEPTH: usize = 256;
/// Send slots per QP (each DATA packet also takes a WRITE WQE without a slot).
pub const SEND_SLOTS: usize = 128;
/// RC retransmission timeout exponent (4.096 µs · 2^t): TCG guests need ≥ 16 (notes §4).
pub const RC_TIMEOUT: u8 = 16;
/// RC retry count (7 = rxe retries for ever, notes §6).
pub const RC_RETRY: u8 = 7;

/// Errors of the verbs backend.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// No usable RDMA device (library missing, no device, no active port, no RoCEv2 IPv4 GID).
    #[error("{0}")]
    NoDevice(String),
    /// A verbs call failed.
    #[error("{what}: {detail}")]
    Call {
        /// What was attempted.
        what: String,
        /// The library's error.
        detail: String,
    },
}

fn call(what: impl Into<String>) -> impl FnOnce(&dyn std::fmt::Display) -> VerbsError {
    let what = what.into();
    move |e| VerbsError::Call { what, detail: e.to_string() }
}

macro_rules! vtry {
    ($e:expr, $what:expr) => {
        $e.map_err(|e| $crate::backend::verbs::call($what)(&e))
    };
}

mod device;
mod mr;
mod qp;
mod ring;

// ---------------------------------------------------------------------------------------------
// Pure parts (unit-tested without a device).

/// The RoCEv2 UDP source port the kernel derives from a GRH flow label (rxe, mlx5:
/// `rdma_flow_label_to_udp_sport`).
pub fn udp_sport(flow_label: u32) -> u16 {
    let fl = flow_label & 0xF_FFFF;
    0xC000 | (((fl & 0x3FFF) ^ (fl >> 14)) as u16)
}

/// First flow label of a connection's QPs: in `1..0x4000 - paths`, so that `base + i` never carries
/// into bit 14 and the `paths` labels give `paths` distinct source ports. Derived from the token, so
/// connections spread over different ports.
pub fn flow_label_base(token: u64, paths: u16) -> u32 {
    let span = 0x4000u64.saturating_sub(u64::from(paths)).max(2) - 1;
    1 + ((token ^ (token >> 29) ^ (token >> 47)) % span) as u32
}

/// Flow label of QP `i` of a connection whose base is `base`.
pub fn flow_label(base: u32, i: u16) -> u32 {
    base + u32::from(i)
}

/// The immediate value of a DATA packet's WRITE: the PSN's low 32 bits (host order; posted as
/// big-endian).
pub fn imm_of(psn: u64) -> u32 {
    psn as u32
}

/// A WRITE WITH IMM that arrived on a QP and waits for its DATA header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingWrite {
    /// The immediate: low 32 bits of the PSN.
    pub psn_low: u32,
    /// Bytes the WRITE placed.
    pub len: u32,
}

/// Does a DATA header (`psn`, payload `len`) belong to the WRITE pending on its QP?
pub fn match_header(pending: Option<PendingWrite>, psn: u64, len: u32) -> bool {
    pending.is_some_and(|p| p.psn_low == imm_of(psn) && p.len == len)
}

/// `(psn, len)` of a bare DATA header with payload (the only packets whose payload comes by WRITE);
/// `None` for anything else (TRUNC and zero-length DATA travel as ordinary packets).
fn classify_header(bytes: &[u8]) -> Option<(u64, u32)> {
    let h = Header::new_checked(bytes).ok()?;
    if h.packet_type().ok()? != PacketType::Data || bytes.len() != DATA_HEADER_LEN {
        return None;
    }
    let p = DataPacket::new_checked_header(bytes).ok()?;
    let trunc = h.flags() & crate::wire::data::FLAG_TRUNC != 0;
    (!trunc).then(|| (p.psn(), p.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sport_follows_the_kernel_fold() {
        // Measured on rxe (research notes §5).
        assert_eq!(udp_sport(0x12345), 0xe341);
        assert_eq!(udp_sport(0x1234c), 0xe348);
        assert_eq!(udp_sport(0xabcde), 0xfcf4);
        assert_eq!(udp_sport(0x0234c), udp_sport(0x12348));
    }

    #[test]
    fn every_connection_gets_distinct_ports_for_its_qps() {
        for token in [0u64, 1, 0xdead_beef, u64::MAX, 0x1234_5678_9abc_def0] {
            for paths in [1u16, 4, 16, 64, 1024] {
                let base = flow_label_base(token, paths);
                assert!(base >= 1, "label 0 would let the kernel pick");
                let mut ports: Vec<u16> = (0..paths).map(|i| udp_sport(flow_label(base, i))).collect();
                assert!(ports.iter().all(|&p| p >= 0xC000));
                ports.sort_unstable();
                ports.dedup();
                assert_eq!(ports.len(), paths as usize, "token {token:#x} paths {paths}");
            }
        }
    }

    #[test]
    fn imm_is_the_low_half_of_the_psn() {
        assert_eq!(imm_of(0x1_0000_0005), 5);
        assert_eq!(imm_of(0xffff_ffff), 0xffff_ffff);
        assert_eq!(imm_of(7).to_be(), u32::from_be_bytes([0, 0, 0, 7]).to_be());
        // What the receiver reads back (u32::from_be of the wire value) is the original.
        assert_eq!(u32::from_be(imm_of(0xabc).to_be()), 0xabc);
    }

    #[test]
    fn a_header_matches_only_its_own_write() {
        let p = Some(PendingWrite { psn_low: 9, len: 4096 });
        assert!(match_header(p, 9, 4096));
        assert!(match_header(p, 9 + (1 << 32), 4096));
        assert!(!match_header(p, 10, 4096));
        assert!(!match_header(p, 9, 4095));
        assert!(!match_header(None, 9, 4096));
    }

    #[test]
    fn only_bare_data_headers_with_payload_wait_for_a_write() {
        use crate::wire::{ControlKind, ControlPacket, ControlRepr, DataRepr};
        let d = DataRepr {
            token: 1,
            cts_ack: 0,
            psn: 77,
            cts_seq: 0,
            sub: 0,
            offset: 0,
            len: 100,
            total_len: 100,
            entropy: 0,
            ts_us: 0,
            trunc: false,
            ce: false,
            retx: false,
        };
        let mut buf = vec![0u8; d.buffer_len()];
        d.emit(&mut DataPacket::new_unchecked(&mut buf[..]));
        assert_eq!(classify_header(&buf[..DATA_HEADER_LEN]), Some((77, 100)));
        assert_eq!(classify_header(&buf), None, "a whole datagram is not a bare header");
        let t = DataRepr { trunc: true, len: 0, total_len: 5000, ..d };
        let mut tb = vec![0u8; t.buffer_len()];
        t.emit(&mut DataPacket::new_unchecked(&mut tb[..]));
        assert_eq!(classify_header(&tb), None);
        let mut c = vec![0u8; crate::wire::CONTROL_LEN];
        ControlRepr { token: 1, cts_ack: 0, kind: ControlKind::Ping, entropy: 0, ts_us: 0, cum_psn: 0 }
            .emit(&mut ControlPacket::new_unchecked(&mut c[..]));
        assert_eq!(classify_header(&c), None);
    }
}
