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
    /// per packet; `layout_break` says where, from a packet's offset on, proto's packets first stop
    /// being `pkt` bytes each before the buffer's end (a plan chunk that is not a whole number of
    /// packets, `ChunkMap::layout_break`), asked only when a new run begins.
    ///
    /// A run describes no packet past that break: its WRITEs travel on other QPs than the descriptor
    /// of the run after the break and may overtake it, and the receiver would rebuild them from the
    /// earlier run, whose whole-packet spacing no longer holds there (the wrong offset; proto then
    /// refused the real packet as overlapping and the receive ended on the stall watchdog).
    pub(super) fn describe(&mut self, d: &DataRepr, pkt: u32, layout_break: impl FnOnce(u64) -> Option<u64>) -> (DescRepr, bool) {
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
        let npkts = match layout_break(d.offset).filter(|&b| b > d.offset && b < d.total_len) {
            // Whole packets up to the break; the short one that ends there gets a run of its own.
            Some(b) => ((b - d.offset) / u64::from(pkt)).max(1),
            None => rest.div_ceil(u64::from(pkt)),
        };
        let mut r = DescRepr {
            sub: d.sub,
            token: d.token,
            cts_ack: d.cts_ack,
            cts_seq: d.cts_seq,
            first_psn: d.psn,
            offset: d.offset,
            total_len: d.total_len,
            pkt_bytes: pkt,
            npkts: npkts.clamp(1, u64::from(u32::MAX)) as u32,
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
    /// The newest run's first PSN when it came: its own PSN is near it (the immediate carries 31
    /// bits; a WRITE still waiting 2^30 PSNs later is stale and goes).
    near: u64,
}

/// PSNs after which a waiting WRITE is stale (half the immediate's 31-bit span).
const HELD_SPAN: u64 = 1 << 30;

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
            if d.first_psn.abs_diff(h.near) >= HELD_SPAN {
                self.counters.writes_held_dropped += 1;
                continue;
            }
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
        let near = self.descs.last_key_value().map_or(0, |(&k, _)| k);
        let h = Held { entropy, imm, len, near };
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

    /// No plan: proto's packets are all `PKT` bytes but a buffer's last.
    fn no_break(_: u64) -> Option<u64> {
        None
    }

    /// A plan of `chunk`-byte chunks, each on another rail than its neighbours (what
    /// `ChunkMap::layout_break` says for it; tested there).
    fn chunks(chunk: u64, total: u64) -> impl FnOnce(u64) -> Option<u64> {
        move |from| {
            (1..).map(|k| k * chunk).skip_while(|&e| e <= from).take_while(|&e| e < total).find(|&e| (e - from) % u64::from(PKT) != 0)
        }
    }

    /// (psn, offset, len) as proto cuts two `chunk`-byte chunks (160 KiB) from PSN `first`: two
    /// `PKT` packets and the shorter rest, twice.
    fn two_short_ended_chunks(first: u64, chunk: u64) -> Vec<(u64, u64, u64)> {
        let pkt = u64::from(PKT);
        (0..2u64)
            .flat_map(|c| {
                let (psn, base) = (first + 3 * c, c * chunk);
                [(psn, base, pkt), (psn + 1, base + pkt, pkt), (psn + 2, base + 2 * pkt, chunk - 2 * pkt)]
            })
            .collect()
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
            let (desc, send) = tx.describe(p, PKT, no_break);
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
        assert!(tx.describe(&data(10, 0, PKT, total, false), PKT, no_break).1);
        let (d, send) = tx.describe(&DataRepr { cts_ack: 4, ..data(11, u64::from(PKT), PKT, total, false) }, PKT, no_break);
        assert!(send, "the acknowledgement moved from 3 to 4");
        assert_eq!((d.cts_ack, d.first_psn, d.offset), (4, 10, 0), "the same run, with the new acknowledgement");
        assert!(!tx.describe(&DataRepr { cts_ack: 4, ..data(12, 2 * u64::from(PKT), PKT, total, false) }, PKT, no_break).1);
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
        assert!(tx.describe(&data(10, 0, PKT, total, false), PKT, no_break).1);
        assert!(!tx.describe(&data(11, u64::from(PKT), PKT, total, false), PKT, no_break).1);
        let (d, send) = tx.describe(&data(11, u64::from(PKT), PKT, total, true), PKT, no_break);
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
        let (d, _) = tx.describe(&data(10, 0, PKT, total, false), PKT, no_break);
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
            rx.on_desc(tx.describe(&d, PKT, no_break).0, &mut out);
        }
        assert_eq!(rx.descs.len(), 2064);
        rx.on_write(0, imm_of(10_000 + 3000 - 2000, false), 128, &mut out);
        assert_eq!(out.len(), 1, "a run 2,000 runs back is still described");
        rx.on_write(0, imm_of(10_000 + 10, false), 128, &mut out);
        assert_eq!(out.len(), 1, "the oldest runs are forgotten");
        assert_eq!(DescRx::new(0).max_descs, RX_DESCS);
    }

    /// A plan chunk that is not a whole number of packets (two verbs rails, PRISM_CHUNK = 160 KiB
    /// over 64 KiB packets: `chunk_capped` cuts a 32 KiB packet at every chunk end) puts a short
    /// packet in the middle of a buffer. The buffer's first descriptor went out before anybody knew:
    /// it describes every later PSN of the buffer at whole-packet spacing. The second WRITE of the
    /// run that starts after the short packet travels on another QP than that run's descriptor and
    /// may arrive before it; it must not be rebuilt from the stale first descriptor: its offset
    /// would be wrong, proto would count the wrong bytes, the packet that really holds those bytes
    /// would then be refused as overlapping on every retransmission, and the receive could only
    /// end by the stall watchdog.
    #[test]
    fn a_write_after_a_short_packet_is_never_rebuilt_from_the_stale_first_descriptor() {
        let chunk = 160 * 1024u64;
        let total = 2 * chunk;
        // (psn, offset, len) as proto cuts them: two 64 KiB packets, the 32 KiB rest of the chunk,
        // and again for the second chunk.
        let pkts = two_short_ended_chunks(100, chunk);
        let mut tx = DescTx::default();
        let descs: Vec<(DescRepr, bool)> =
            pkts.iter().map(|&(psn, off, len)| tx.describe(&data(psn, off, len as u32, total, false), PKT, chunks(chunk, total))).collect();
        let sent: Vec<u64> = descs.iter().filter(|d| d.1).map(|d| d.0.first_psn).collect();
        assert_eq!(sent, vec![100, 102, 103], "runs start at the buffer, at the short packet and after it (the last one ends the buffer)");
        let mut rx = DescRx::new(512);
        let mut out = Vec::new();
        // The first descriptor came; PSN 104 (true offset 224 KiB) took another QP than the
        // descriptor of its run (PSN 103's) and arrives before it.
        rx.on_desc(descs[0].0, &mut out);
        rx.on_write(3, imm_of(104, false), PKT, &mut out);
        for h in &out {
            let d = parsed(h);
            assert_eq!(d.offset, pkts[4].1, "PSN {} rebuilt at offset {} (its bytes are at {})", d.psn, d.offset, pkts[4].1);
        }
        // Once the run's own descriptor comes, the WRITE is placed where its bytes are.
        rx.on_desc(descs[3].0, &mut out);
        let got: Vec<(u64, u64)> = out.iter().map(parsed).map(|d| (d.psn, d.offset)).collect();
        assert_eq!(got, vec![(104, pkts[4].1)]);
    }

    /// The same arrival order end to end: every WRITE of the buffer above lands (the NIC writes
    /// it where the sender's CTS keys say), descriptors and WRITEs reach the receiver in the order
    /// the QPs deliver them, and the rebuilt headers go to the receiving connection. The receive
    /// must complete; with a header rebuilt from the stale descriptor it cannot.
    #[test]
    fn a_buffer_with_a_short_packet_in_its_middle_completes_whatever_order_its_writes_come_in() {
        use crate::proto::{Completion, Connection, ProtoConfig, RecvSpec};
        let chunk = 160 * 1024u64;
        let total = 2 * chunk;
        let pkts = two_short_ended_chunks(0, chunk);
        let mut tx = DescTx::default();
        let mut rx = DescRx::new(512);
        let mut conn = Connection::new(ProtoConfig::default(), 7, 8, Box::new(prism_lb::path::Spray::new(1)), 0);
        let id = conn.post_recv(&[RecvSpec { len: total, tag: 0 }], 0).expect("post_recv");
        let mut out = Vec::new();
        let mut descs = Vec::new();
        for &(psn, off, len) in &pkts {
            let d = DataRepr { token: 7, cts_ack: 0, cts_seq: 0, sub: 0, ..data(psn, off, len as u32, total, false) };
            let (desc, send) = tx.describe(&d, PKT, chunks(chunk, total));
            descs.push(send.then_some(desc));
        }
        // Descriptor of PSN 0, then the WRITE of PSN 4 (another QP than PSN 3's descriptor), then
        // everything else in PSN order, each descriptor just before its run's first WRITE.
        rx.on_desc(descs[0].expect("the first packet starts a run"), &mut out);
        rx.on_write(1, imm_of(4, false), PKT, &mut out);
        for (k, &(psn, _, len)) in pkts.iter().enumerate().filter(|&(k, _)| k != 4) {
            if let Some(d) = descs[k] {
                rx.on_desc(d, &mut out);
            }
            rx.on_write(0, imm_of(psn, false), len as u32, &mut out);
        }
        for h in &out {
            conn.handle_rebuilt_data(h, 10);
        }
        let done = std::iter::from_fn(|| conn.poll_completion()).find(|c| matches!(c, Completion::Received { msg, .. } if *msg == id));
        assert!(
            done.is_some(),
            "the receive did not complete although every byte landed: {} headers rebuilt, drops {:?}",
            out.len(),
            conn.stats().dropped
        );
    }

    /// A WRITE whose descriptor never came (the descriptor SEND was lost on UC, or with a QP that
    /// died while later WRITEs of the run took live QPs) waits in `held`, and nothing ages it out
    /// but `RX_HELD` newer waiting WRITEs: on a healthy connection it stays for good. The
    /// immediate carries only the PSN's low 31 bits, so 2^31 PSNs later (36 minutes of one-packet
    /// messages at 10^6 per second) the descriptor of a new receive whose run contains the same
    /// low bits rebuilds the stale WRITE as that receive's packet, before the packet's own WRITE
    /// landed: proto counts bytes that are not in the buffer yet and completes the receive early
    /// (NCCL reads stale data; the real WRITE then lands in a buffer NCCL has back).
    #[test]
    fn a_stale_held_write_is_not_rebuilt_for_a_run_2_pow_31_psns_later() {
        let mut rx = DescRx::new(512);
        let mut tx = DescTx::default();
        let mut out = Vec::new();
        // PSN 5 (a 128-byte message, CTS 5): its WRITE came, its descriptor never did. proto
        // resent it as fragments and the receive completed long ago.
        rx.on_write(0, imm_of(5, false), 128, &mut out);
        assert!(out.is_empty());
        // A long healthy run of one-packet messages: every WRITE rebuilt from its descriptor.
        for i in 6..2000u64 {
            let d = DataRepr { cts_seq: i, ..data(i, 0, 128, 128, false) };
            rx.on_desc(tx.describe(&d, PKT, no_break).0, &mut out);
            rx.on_write(0, imm_of(i, false), 128, &mut out);
        }
        assert_eq!(out.len(), 1994);
        out.clear();
        // 2^31 PSNs after PSN 5: the descriptor of a new 128-byte message (CTS 10^9) comes; its
        // WRITE has not landed yet.
        let psn = 5 + (1u64 << 31);
        let d = DataRepr { cts_seq: 1_000_000_000, ..data(psn, 0, 128, 128, false) };
        rx.on_desc(tx.describe(&d, PKT, no_break).0, &mut out);
        let rebuilt: Vec<(u64, u64)> = out.iter().map(parsed).map(|h| (h.psn, h.cts_seq)).collect();
        assert!(rebuilt.is_empty(), "the stale WRITE of PSN 5 was rebuilt as {rebuilt:?}: the receive completes before its WRITE landed");
    }

    /// A packet that is not proto's usual size gets a run of its own, described exactly.
    #[test]
    fn an_odd_packet_gets_its_own_run() {
        let total = 10 * u64::from(PKT);
        let mut tx = DescTx::default();
        let (d, send) = tx.describe(&data(50, 3 * 4096, 4096, total, false), PKT, no_break);
        assert!(send);
        assert_eq!((d.pkt_bytes, d.npkts, d.offset), (4096, 1, 3 * 4096));
        assert_eq!(d.place(50, 4096), Some(3 * 4096));
        assert!(DescRepr::parse(&d.to_bytes()).is_ok());
    }
}
