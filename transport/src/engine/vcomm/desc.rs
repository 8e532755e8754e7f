//! DATA without a header SEND: the sender describes each run of an item's packets once
//! ([`crate::wire::verbs_desc`]) and sends every payload as a bare WRITE WITH IMM; the receiver
//! rebuilds each packet's DATA header from the descriptor, the immediate and the completion's byte
//! count, and gives it to proto. WRITEs whose descriptor has not come yet (it travels on another QP)
//! wait, a bounded number of them.

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::backend::verbs::psn_of_imm;
use crate::wire::{DataPacket, DataRepr, DescRepr, DATA_HEADER_LEN};

/// Runs the sender remembers (one per receive buffer being written; older ones are long done).
const TX_RUNS: usize = 4096;
/// Descriptors the receiver keeps at least; more with a larger window: more than the runs a full
/// window can have in flight (each packet a run of its own in the worst case).
const RX_DESCS: usize = 1024;
/// WRITEs the receiver holds while their descriptor is missing.
const RX_HELD: usize = 1024;

/// Sender side: the run each (cts_seq, sub) buffer's packets are described by.
#[derive(Default)]
pub(super) struct DescTx {
    runs: HashMap<(u64, u8), DescRepr>,
    order: VecDeque<(u64, u8)>,
}

impl DescTx {
    /// The descriptor DATA packet `d` belongs to, and whether it must be sent before the packet's
    /// WRITE: a new run (the first packet of a buffer, or one the current run does not describe
    /// exactly) or a retransmission (its descriptor may have been lost). `pkt` is proto's payload
    /// per packet.
    pub(super) fn describe(&mut self, d: &DataRepr, pkt: u32) -> (DescRepr, bool) {
        let key = (d.cts_seq, d.sub);
        if let Some(r) = self.runs.get_mut(&key) {
            if r.place(d.psn, d.len) == Some(d.offset) {
                // The receiver learns the sender's CTS acknowledgement only from descriptors (the
                // WRITEs carry no header): a newer one goes out with the packet, or the receiver
                // resends its CTS after two round trips (a run of 1 MiB receives posted ahead had
                // more CTS retransmissions than CTSs).
                let newer = d.cts_ack > r.cts_ack;
                r.cts_ack = r.cts_ack.max(d.cts_ack);
                return (*r, d.retx || newer);
            }
        }
        let rest = d.total_len.saturating_sub(d.offset);
        let pkt = pkt.max(1);
        let mut r = DescRepr {
            sub: d.sub,
            token: d.token,
            cts_ack: d.cts_ack,
            cts_seq: d.cts_seq,
            first_psn: d.psn,
            offset: d.offset,
            total_len: d.total_len,
            pkt_bytes: pkt,
            npkts: rest.div_ceil(u64::from(pkt)).clamp(1, u64::from(u32::MAX)) as u32,
        };
        if r.place(d.psn, d.len) != Some(d.offset) {
            // Not proto's usual packet: a run of its own.
            r.pkt_bytes = d.len;
            r.npkts = 1;
        }
        if self.runs.insert(key, r).is_none() {
            self.order.push_back(key);
            while self.order.len() > TX_RUNS {
                if let Some(old) = self.order.pop_front() {
                    self.runs.remove(&old);
                }
            }
        }
        (r, true)
    }

    /// The descriptor of buffer (`cts_seq`, `sub`) could not be posted: describe its next packet
    /// afresh.
    pub(super) fn forget(&mut self, cts_seq: u64, sub: u8) {
        self.runs.remove(&(cts_seq, sub));
    }
}

/// What the receiver did with a WRITE or a descriptor.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub(crate) struct DescCounters {
    /// Descriptors sent.
    pub descs_sent: u64,
    /// Descriptors received (well-formed).
    pub descs_received: u64,
    /// Descriptors dropped as malformed.
    pub descs_bad: u64,
    /// WRITEs whose header was rebuilt and given to proto.
    pub writes_rebuilt: u64,
    /// WRITEs that waited for their descriptor.
    pub writes_held: u64,
    /// WRITEs dropped while waiting (too many waiting; proto resends them).
    pub writes_held_dropped: u64,
}

/// A WRITE waiting for its descriptor.
#[derive(Clone, Copy)]
struct Held {
    entropy: u16,
    imm: u32,
    len: u32,
}

/// Receiver side: the descriptors received and the WRITEs waiting for theirs.
#[derive(Default)]
pub(super) struct DescRx {
    max_descs: usize,
    descs: BTreeMap<u64, DescRepr>,
    held: VecDeque<Held>,
    pub counters: DescCounters,
}

impl DescRx {
    /// For a connection with a window of `window_pkts` packets.
    pub(super) fn new(window_pkts: usize) -> Self {
        Self { max_descs: RX_DESCS.max(window_pkts.saturating_add(64)), ..Self::default() }
    }

    /// A descriptor came (already parsed and checked): keep it and rebuild the waiting WRITEs it
    /// describes into `out` (each a 64-byte DATA header).
    pub(super) fn on_desc(&mut self, d: DescRepr, out: &mut Vec<[u8; DATA_HEADER_LEN]>) {
        self.counters.descs_received += 1;
        self.descs.insert(d.first_psn, d);
        while self.descs.len() > self.max_descs.max(1) {
            self.descs.pop_first();
        }
        if self.held.is_empty() {
            return;
        }
        let held = std::mem::take(&mut self.held);
        for h in held {
            match rebuild(&d, h) {
                Some(hdr) => {
                    self.counters.writes_rebuilt += 1;
                    out.push(hdr);
                }
                None => self.held.push_back(h),
            }
        }
    }

    /// A WRITE placed `len` bytes with immediate `imm` on entropy `entropy`: its rebuilt header in
    /// `out`, or it waits for its descriptor.
    pub(super) fn on_write(&mut self, entropy: u16, imm: u32, len: u32, out: &mut Vec<[u8; DATA_HEADER_LEN]>) {
        let h = Held { entropy, imm, len };
        if let Some(hdr) = self.descs.values().rev().find_map(|d| rebuild(d, h)) {
            self.counters.writes_rebuilt += 1;
            out.push(hdr);
            return;
        }
        self.counters.writes_held += 1;
        self.held.push_back(h);
        while self.held.len() > RX_HELD {
            self.held.pop_front();
            self.counters.writes_held_dropped += 1;
        }
    }
}

/// The DATA header of WRITE `h` when descriptor `d` describes it (its PSN in the run and its
/// length the packet's).
fn rebuild(d: &DescRepr, h: Held) -> Option<[u8; DATA_HEADER_LEN]> {
    let (psn, retx) = psn_of_imm(h.imm, d.first_psn);
    let offset = d.place(psn, h.len)?;
    let r = DataRepr {
        token: d.token,
        cts_ack: d.cts_ack,
        psn,
        cts_seq: d.cts_seq,
        sub: d.sub,
        offset,
        len: h.len,
        total_len: d.total_len,
        entropy: h.entropy,
        // Not known here: the SACK echoes the PSN instead (`Connection::handle_rebuilt_data`).
        ts_us: 0,
        trunc: false,
        ce: false,
        retx,
    };
    let mut b = [0u8; DATA_HEADER_LEN];
    r.emit(&mut DataPacket::new_unchecked(&mut b[..]));
    Some(b)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::backend::verbs::imm_of;

    const PKT: u32 = 65536;

    /// A DATA packet of buffer (2, 1) of connection 7 (shared with `bounce`'s tests).
    pub(in crate::engine::vcomm) fn data(psn: u64, offset: u64, len: u32, total: u64, retx: bool) -> DataRepr {
        DataRepr {
            token: 7,
            cts_ack: 3,
            psn,
            cts_seq: 2,
            sub: 1,
            offset,
            len,
            total_len: total,
            entropy: 5,
            ts_us: 99,
            trunc: false,
            ce: false,
            retx,
        }
    }

    fn parsed(h: &[u8; DATA_HEADER_LEN]) -> DataRepr {
        DataRepr::parse(&DataPacket::new_checked_header(&h[..]).unwrap()).unwrap()
    }

    /// The sender describes a buffer's packets once; the receiver rebuilds every header exactly
    /// (but the timestamp), whether the WRITE comes before or after the descriptor.
    #[test]
    fn headers_are_rebuilt_from_one_descriptor_in_any_order() {
        let total = 3 * u64::from(PKT) + 1280;
        let pkts: Vec<DataRepr> =
            (0..4u64).map(|k| data(100 + k, k * u64::from(PKT), if k < 3 { PKT } else { 1280 }, total, false)).collect();
        let mut tx = DescTx::default();
        let mut sent = Vec::new();
        for p in &pkts {
            let (desc, send) = tx.describe(p, PKT);
            if send {
                sent.push(desc);
            }
        }
        assert_eq!(sent.len(), 1, "one descriptor for the buffer");
        let mut rx = DescRx::new(512);
        let mut out = Vec::new();
        // Packet 2 overtakes the descriptor (another QP); the others come after it.
        rx.on_write(9, imm_of(pkts[2].psn, false), pkts[2].len, &mut out);
        assert!(out.is_empty());
        assert_eq!(rx.counters.writes_held, 1);
        let d = DescRepr::parse(&sent[0].to_bytes()).unwrap();
        rx.on_desc(d, &mut out);
        for p in [&pkts[0], &pkts[1], &pkts[3]] {
            rx.on_write(9, imm_of(p.psn, false), p.len, &mut out);
        }
        let got: Vec<DataRepr> = out.iter().map(parsed).collect();
        let want: Vec<DataRepr> = [2, 0, 1, 3].iter().map(|&k| DataRepr { entropy: 9, ts_us: 0, ..pkts[k] }).collect();
        assert_eq!(got, want);
    }

    /// The WRITEs carry no header, so a CTS acknowledgement that grows during a run reaches the
    /// receiver only in a descriptor sent again with the packet that carries it.
    #[test]
    fn a_newer_cts_acknowledgement_resends_the_descriptor() {
        let total = 3 * u64::from(PKT);
        let mut tx = DescTx::default();
        assert!(tx.describe(&data(10, 0, PKT, total, false), PKT).1);
        let (d, send) = tx.describe(&DataRepr { cts_ack: 4, ..data(11, u64::from(PKT), PKT, total, false) }, PKT);
        assert!(send, "the acknowledgement moved from 3 to 4");
        assert_eq!((d.cts_ack, d.first_psn, d.offset), (4, 10, 0), "the same run, with the new acknowledgement");
        assert!(!tx.describe(&DataRepr { cts_ack: 4, ..data(12, 2 * u64::from(PKT), PKT, total, false) }, PKT).1);
        let mut rx = DescRx::new(512);
        let mut out = Vec::new();
        rx.on_desc(d, &mut out);
        rx.on_write(0, imm_of(12, false), PKT, &mut out);
        assert_eq!(parsed(&out[0]).cts_ack, 4);
    }

    #[test]
    fn a_retransmission_resends_the_descriptor_and_keeps_its_flag() {
        let total = 2 * u64::from(PKT);
        let mut tx = DescTx::default();
        assert!(tx.describe(&data(10, 0, PKT, total, false), PKT).1);
        assert!(!tx.describe(&data(11, u64::from(PKT), PKT, total, false), PKT).1);
        let (d, send) = tx.describe(&data(11, u64::from(PKT), PKT, total, true), PKT);
        assert!(send);
        let mut rx = DescRx::new(512);
        let mut out = Vec::new();
        rx.on_desc(d, &mut out);
        rx.on_write(0, imm_of(11, true), PKT, &mut out);
        assert!(parsed(&out[0]).retx);
    }

    /// WRITEs that no descriptor describes (wrong length, PSN outside every run) are never given
    /// to proto, and at most `RX_HELD` of them are kept.
    #[test]
    fn undescribed_writes_are_held_bounded_and_never_rebuilt_wrongly() {
        let total = 2 * u64::from(PKT);
        let mut tx = DescTx::default();
        let (d, _) = tx.describe(&data(10, 0, PKT, total, false), PKT);
        let mut rx = DescRx::new(512);
        let mut out = Vec::new();
        rx.on_desc(d, &mut out);
        rx.on_write(0, imm_of(10, false), PKT - 128, &mut out);
        rx.on_write(0, imm_of(12, false), PKT, &mut out);
        rx.on_write(0, imm_of(9, false), PKT, &mut out);
        assert!(out.is_empty());
        for i in 0..(RX_HELD as u64 + 10) {
            rx.on_write(0, imm_of(1_000_000 + i, false), PKT, &mut out);
        }
        assert!(out.is_empty());
        assert_eq!(rx.held.len(), RX_HELD);
        assert_eq!(rx.counters.writes_held_dropped, 13);
    }

    /// A full window of one-packet runs stays described; older descriptors go first.
    #[test]
    fn a_window_of_runs_stays_described() {
        let mut rx = DescRx::new(2000);
        let mut out = Vec::new();
        let mut tx = DescTx::default();
        for i in 0..3000u64 {
            let d = DataRepr { cts_seq: i, ..data(10_000 + i, 0, 128, 128, false) };
            rx.on_desc(tx.describe(&d, PKT).0, &mut out);
        }
        assert_eq!(rx.descs.len(), 2064);
        rx.on_write(0, imm_of(10_000 + 3000 - 2000, false), 128, &mut out);
        assert_eq!(out.len(), 1, "a run 2,000 runs back is still described");
        rx.on_write(0, imm_of(10_000 + 10, false), 128, &mut out);
        assert_eq!(out.len(), 1, "the oldest runs are forgotten");
        assert_eq!(DescRx::new(0).max_descs, RX_DESCS);
    }

    /// A packet that is not proto's usual size gets a run of its own, described exactly.
    #[test]
    fn an_odd_packet_gets_its_own_run() {
        let total = 10 * u64::from(PKT);
        let mut tx = DescTx::default();
        let (d, send) = tx.describe(&data(50, 3 * 4096, 4096, total, false), PKT);
        assert!(send);
        assert_eq!((d.pkt_bytes, d.npkts, d.offset), (4096, 1, 3 * 4096));
        assert_eq!(d.place(50, 4096), Some(3 * 4096));
        assert!(DescRepr::parse(&d.to_bytes()).is_ok());
    }
}
