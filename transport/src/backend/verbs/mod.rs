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
//! receiver's registered buffer, without a header: the immediate carries the PSN's low 31 bits and
//! a retransmission bit ([`imm_of`], big-endian on the wire, note G3; never set by this build, whose
//! retransmissions are fragments), the receive completion the byte count, and a descriptor SEND
//! (`wire::verbs_desc`) sent before an item's first WRITE the rest; the receiving comm rebuilds the
//! DATA header (`engine::vcomm`). Every other packet is a SEND, a retransmitted DATA packet too, in
//! fragments that fit a receive slot (`wire::verbs_frag`).
//!
//! Every receive WQE carries one slot of the receive ring; a WRITE WITH IMM consumes a WQE without
//! writing into it (note G4), so WRITEs and SENDs can share one FIFO receive queue.
#![allow(unsafe_code)]

pub use crate::wire::RailPeer;
pub use device::{probe, MrKeys, VerbsDevice};
pub use mr::MrCache;
pub use qp::{PostFail, QpSet, QpStats, RxEvent, REPOST_BATCH};

/// Bytes of one send or receive ring slot: the largest control packet (a keyed CTS) fits.
pub const SLOT_BYTES: usize = 1024;
/// Receive WQEs (and ring slots) per QP by default (`PRISM_IB_RECV_DEPTH`).
pub const RECV_DEPTH: usize = 256;
/// Send slots per QP by default (`PRISM_IB_SEND_SLOTS`; each DATA packet also takes a WRITE WQE
/// without a slot).
pub const SEND_SLOTS: usize = 128;

/// How deep one connection's QPs are: receive WQEs (each with a ring slot) and send slots per QP.
/// Each slot is [`SLOT_BYTES`] of registered memory, so one connection takes
/// `paths x (recv + send_slots) x SLOT_BYTES` per rail (6 MiB with the defaults and 16 paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Depths {
    /// Receive WQEs (and receive ring slots) per QP.
    pub recv: usize,
    /// Send ring slots per QP (at most twice as many send WQEs in flight).
    pub send_slots: usize,
}

impl Depths {
    /// Registered ring bytes of one connection with `paths` QPs on one rail.
    pub fn ring_bytes(&self, paths: usize) -> usize {
        paths.max(1) * (self.recv + self.send_slots) * SLOT_BYTES
    }
}

/// What a failed QP set creation adds to its error: the connection's registered rings and the
/// process's `RLIMIT_MEMLOCK` (registration pins memory, and past that limit it fails).
pub fn memlock_hint(depths: Depths, paths: u16) -> String {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    let limit = match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, _)) if soft == RLIM_INFINITY => "unlimited".to_string(),
        Ok((soft, _)) => format!("{} KiB", soft >> 10),
        Err(e) => format!("unknown ({e})"),
    };
    format!(
        " (each connection registers {} KiB of rings per rail: PRISM_PATHS={paths} x (PRISM_IB_RECV_DEPTH={} + \
         PRISM_IB_SEND_SLOTS={}) x {} bytes; RLIMIT_MEMLOCK is {limit})",
        depths.ring_bytes(usize::from(paths)) >> 10,
        depths.recv,
        depths.send_slots,
        SLOT_BYTES
    )
}
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

/// Bit 31 of the immediate: the WRITE is a retransmission.
pub const IMM_RETX: u32 = 1 << 31;

/// The immediate value of a DATA packet's WRITE: the PSN's low 31 bits, bit 31 set on a
/// retransmission (host order; posted as big-endian).
pub fn imm_of(psn: u64, retx: bool) -> u32 {
    (psn as u32 & !IMM_RETX) | if retx { IMM_RETX } else { 0 }
}

/// The PSN an immediate names, given a PSN `near` it (within 2^30): the value whose low 31 bits
/// are the immediate's, nearest to `near`; and the retransmission bit.
pub fn psn_of_imm(imm: u32, near: u64) -> (u64, bool) {
    let low = u64::from(imm & !IMM_RETX);
    let span = 1u64 << 31;
    let base = near & !(span - 1);
    let cands = [base.checked_sub(span), Some(base), base.checked_add(span)];
    let psn = cands.into_iter().flatten().map(|b| b | low).min_by_key(|&p| p.abs_diff(near)).unwrap_or(low);
    (psn, imm & IMM_RETX != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_creation_names_the_rings_and_the_memlock_limit() {
        let h = memlock_hint(Depths { recv: 64, send_slots: 32 }, 16);
        assert!(h.contains("registers 1536 KiB of rings per rail"), "{h}");
        assert!(h.contains("PRISM_PATHS=16 x (PRISM_IB_RECV_DEPTH=64 + PRISM_IB_SEND_SLOTS=32) x 1024 bytes"), "{h}");
        assert!(h.contains("RLIMIT_MEMLOCK is "), "{h}");
    }

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
    fn imm_carries_the_low_31_bits_and_the_retransmission_bit() {
        assert_eq!(imm_of(0x1_0000_0005, false), 5);
        assert_eq!(imm_of(0x8000_0005, true), 5 | IMM_RETX);
        assert_eq!(u32::from_be(imm_of(0xabc, false).to_be()), 0xabc);
        for near in [0u64, 5, 1 << 30, (1 << 31) - 3, 1 << 31, 3 << 31, 0x1234_5678_9abc, u64::MAX / 2] {
            for d in [-(1i64 << 29), -7, -1, 0, 1, 9, 1 << 29] {
                let Some(psn) = near.checked_add_signed(d) else { continue };
                for retx in [false, true] {
                    assert_eq!(psn_of_imm(imm_of(psn, retx), near), (psn, retx), "psn {psn:#x} near {near:#x}");
                }
            }
        }
    }
}
