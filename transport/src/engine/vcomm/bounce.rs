//! Retransmissions without WRITEs into NCCL's memory (issue 13): the first copy of every DATA
//! packet is an RDMA WRITE WITH IMM straight into the receive buffer, but a retransmission goes as
//! SENDs of fragments ([`crate::wire::verbs_frag`]) into the receiver's own receive slots. The
//! receiver copies a fragment's payload into the receive buffer only while that receive is posted
//! (its CTS sequence number still names an open receive), and hands proto the packet's rebuilt DATA
//! header once all its fragments came. A late or spurious retransmission of a receive NCCL already
//! has back finds no receive and is dropped and counted.
//!
//! With at most one WRITE per PSN (a retransmission is posted only once its first copy left the send
//! queue, `Fences::may_write_again`), a receive whose packets all came by WRITE has nothing left to
//! land. On RC a WRITE that left the send queue has landed or never will (its QP is in error), so no
//! receive waits for anything; on UC the first copy of a packet that came by fragments may still be on
//! the wire, and such a receive waits for a FENCE (see `fence`).
//!
//! Fragments carry whole 128-byte lines, so every boundary they make in a receive buffer falls on one.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};

use crate::backend::verbs::SLOT_BYTES;
use crate::proto::MsgId;
use crate::wire::{DataPacket, DataRepr, FragRepr, DATA_HEADER_LEN, FRAG_HEADER_LEN, LINE_BYTES};

/// Payload bytes per fragment: what a receive slot holds after the header, in whole 128-byte lines.
pub(super) const FRAG_PAYLOAD: usize = (SLOT_BYTES - FRAG_HEADER_LEN) / LINE_BYTES * LINE_BYTES;
// A fragment fits a receive slot and carries whole 128-byte lines.
const _: () = assert!(FRAG_HEADER_LEN + FRAG_PAYLOAD <= SLOT_BYTES && FRAG_PAYLOAD.is_multiple_of(LINE_BYTES) && FRAG_PAYLOAD > 0);
/// Packets being reassembled at once; the oldest partial packet is dropped beyond (proto resends it).
const REASM_MAX: usize = 256;
/// Retransmissions waiting for send slots; beyond, a new one is dropped (proto resends it).
const PENDING_MAX: usize = 256;

/// What the fragment path did, both directions.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub(crate) struct BounceCounters {
    /// Retransmitted packets sent as fragments (instead of a WRITE).
    pub retx_bounced: u64,
    /// Fragments posted.
    pub frags_sent: u64,
    /// Retransmissions dropped before all their fragments were posted (the send or its QP went
    /// away, or too many were waiting for send slots).
    pub bounces_dropped: u64,
    /// Fragments received well-formed.
    pub frags_received: u64,
    /// Fragments of a receive that is no longer posted (dropped: nothing is written).
    pub frags_stale: u64,
    /// Fragments dropped as malformed, and fragments that conflicted with their packet's earlier ones
    /// (other bytes for the same PSN; the packet restarts from them).
    pub frags_bad: u64,
    /// Fragments received again (dropped).
    pub frags_dup: u64,
    /// Packets whose fragments all came (given to proto).
    pub packets_reassembled: u64,
    /// Partly received packets dropped to bound memory (proto resends them).
    pub partial_dropped: u64,
}

/// Fragments a packet of `len` payload bytes travels in.
pub(super) fn frag_count(len: u32) -> usize {
    (len as usize).div_ceil(FRAG_PAYLOAD).max(1)
}

/// Why `depth` receives per QP are too few for packets of `pkt_len` bytes, if they are: one
/// retransmitted packet is [`frag_count`] SENDs on one QP, each taking a receive, and the receiver
/// posts consumed ones again only in chains of `REPOST_BATCH`; a burst that finds the queue empty is
/// dropped on UC (Soft-RoCE with 32 receives per QP lost 13-19 % of the fragments of a rail failure's
/// retransmissions) and waits on RC.
pub(crate) fn shallow_receive_queue(depth: usize, pkt_len: u32) -> Option<String> {
    let need = frag_count(pkt_len) + crate::backend::verbs::REPOST_BATCH;
    (depth < need).then(|| {
        format!(
            "PRISM_IB_RECV_DEPTH={depth} is below what one retransmitted {pkt_len}-byte packet needs on its QP \
             ({} fragments + {} for reposting = {need}): retransmissions may lose fragments on UC",
            frag_count(pkt_len),
            crate::backend::verbs::REPOST_BATCH
        )
    })
}

/// Payload bytes of the fragment at `frag_off` of a packet of `pkt_len` bytes (sender and receiver
/// cut alike: every fragment but the last carries [`FRAG_PAYLOAD`]).
pub(super) fn frag_len(pkt_len: u32, frag_off: u32) -> u32 {
    pkt_len.saturating_sub(frag_off).min(FRAG_PAYLOAD as u32)
}

/// A retransmission whose fragments are being posted: the packet, where its payload starts in the
/// send `msg`, and the next fragment's offset within the packet.
pub(super) struct Bounce {
    pub rail: usize,
    pub q: usize,
    pub msg: MsgId,
    pub send_off: u64,
    pub hdr: FragRepr,
}

/// Sender side: retransmissions waiting for send slots, in order.
#[derive(Default)]
pub(super) struct BounceTx {
    pub pending: VecDeque<Bounce>,
}

impl BounceTx {
    /// Queue retransmission `d` (payload at `send_off` of send `msg`) for rail `rail`, QP `q`;
    /// false when too many are waiting (dropped).
    pub(super) fn queue(&mut self, rail: usize, q: usize, msg: MsgId, send_off: u64, d: &DataRepr) -> bool {
        if self.pending.len() >= PENDING_MAX {
            return false;
        }
        let hdr = FragRepr {
            sub: d.sub,
            entropy: d.entropy,
            token: d.token,
            cts_ack: d.cts_ack,
            cts_seq: d.cts_seq,
            psn: d.psn,
            offset: d.offset,
            total_len: d.total_len,
            pkt_len: d.len,
            frag_off: 0,
        };
        self.pending.push_back(Bounce { rail, q, msg, send_off, hdr });
        true
    }
}

/// Fill `slot` with the fragment of `b` at `b.hdr.frag_off`, its payload read by `read(send offset,
/// out)`; returns the fragment's length.
pub(super) fn fill_fragment(b: &Bounce, slot: &mut [u8], read: impl FnOnce(u64, &mut [u8])) -> usize {
    let n = frag_len(b.hdr.pkt_len, b.hdr.frag_off) as usize;
    b.hdr.emit(&mut slot[..FRAG_HEADER_LEN]);
    read(b.send_off + u64::from(b.hdr.frag_off), &mut slot[FRAG_HEADER_LEN..FRAG_HEADER_LEN + n]);
    FRAG_HEADER_LEN + n
}

/// A packet being reassembled: its first fragment, the newest CTS acknowledgement its fragments
/// carried, the fragments that came.
struct Partial {
    first: FragRepr,
    cts_ack: u64,
    have: Vec<u64>,
    missing: usize,
}

impl Partial {
    fn new(f: &FragRepr) -> Self {
        let n = frag_count(f.pkt_len);
        Self { first: *f, cts_ack: f.cts_ack, have: vec![0; n.div_ceil(64)], missing: n }
    }
}

/// Whether `a` and `b` are fragments of the same packet: the same bytes for the same place. Copies
/// sent at different times may differ in the rest: a later retransmission carries a newer CTS
/// acknowledgement and takes another path, and its fragments complete what an earlier copy, partly
/// lost, began.
fn same_packet(a: &FragRepr, b: &FragRepr) -> bool {
    (a.sub, a.token, a.cts_seq, a.psn, a.offset, a.total_len, a.pkt_len)
        == (b.sub, b.token, b.cts_seq, b.psn, b.offset, b.total_len, b.pkt_len)
}

/// Receiver side: packets whose fragments are coming.
#[derive(Default)]
pub(super) struct Reassembly {
    parts: HashMap<(u64, u8, u64), Partial>,
    order: VecDeque<(u64, u8, u64)>,
    pub counters: BounceCounters,
}

impl Reassembly {
    /// Fragment `f` with `payload`, of a receive that is posted: `place(offset in the buffer,
    /// bytes)` copies the payload (the caller checks the range against the buffer once more); the
    /// packet's rebuilt DATA header once every fragment came.
    pub(super) fn on_frag(&mut self, f: &FragRepr, payload: &[u8], place: impl FnOnce(u64, &[u8])) -> Option<[u8; DATA_HEADER_LEN]> {
        self.counters.frags_received += 1;
        let off = f.frag_off as usize;
        let want = frag_len(f.pkt_len, f.frag_off) as usize;
        if !off.is_multiple_of(FRAG_PAYLOAD) || payload.len() != want {
            self.counters.frags_bad += 1;
            return None;
        }
        let key = (f.cts_seq, f.sub, f.psn);
        if let Entry::Vacant(e) = self.parts.entry(key) {
            e.insert(Partial::new(f));
            self.order.push_back(key);
            while self.order.len() > REASM_MAX {
                if let Some(old) = self.order.pop_front() {
                    if self.parts.remove(&old).is_some() {
                        self.counters.partial_dropped += 1;
                    }
                }
            }
        }
        let p = self.parts.get_mut(&key)?;
        if !same_packet(&p.first, f) {
            // The same PSN of the same receive as another packet: only a confused peer sends that.
            // The newer copy wins; keeping the older would refuse every later copy, and the packet
            // could never complete.
            self.counters.frags_bad += 1;
            *p = Partial::new(f);
        }
        p.cts_ack = p.cts_ack.max(f.cts_ack);
        let k = off / FRAG_PAYLOAD;
        let (w, bit) = (k / 64, 1u64 << (k % 64));
        if p.have[w] & bit != 0 {
            self.counters.frags_dup += 1;
            return None;
        }
        place(f.offset + f.frag_off as u64, payload);
        p.have[w] |= bit;
        p.missing -= 1;
        if p.missing > 0 {
            return None;
        }
        let cts_ack = p.cts_ack;
        self.parts.remove(&key);
        self.order.retain(|k| *k != key);
        self.counters.packets_reassembled += 1;
        let r = DataRepr {
            token: f.token,
            cts_ack,
            psn: f.psn,
            cts_seq: f.cts_seq,
            sub: f.sub,
            offset: f.offset,
            len: f.pkt_len,
            total_len: f.total_len,
            entropy: f.entropy,
            ts_us: 0,
            trunc: false,
            ce: false,
            retx: true,
        };
        let mut b = [0u8; DATA_HEADER_LEN];
        r.emit(&mut DataPacket::new_unchecked(&mut b[..]));
        Some(b)
    }

    /// Forget the partial packets of receive `cts_seq` (it is done).
    pub(super) fn forget(&mut self, cts_seq: u64) {
        if self.parts.is_empty() {
            return;
        }
        self.parts.retain(|k, _| k.0 != cts_seq);
        let parts = &self.parts;
        self.order.retain(|k| parts.contains_key(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_receive_queue_shallower_than_one_packets_fragments_is_named() {
        assert_eq!(frag_count(65_536), 74);
        assert_eq!(shallow_receive_queue(256, 65_536), None);
        assert_eq!(shallow_receive_queue(90, 65_536), None, "74 fragments + 16");
        let w = shallow_receive_queue(89, 65_536).expect("one short");
        assert!(w.starts_with("PRISM_IB_RECV_DEPTH=89 is below") && w.contains("(74 fragments + 16 for reposting = 90)"), "{w}");
        assert!(shallow_receive_queue(32, 8_192).is_none(), "10 fragments + 16 fit in 32");
    }

    const PKT: u32 = 65536;

    fn data(psn: u64, offset: u64, len: u32) -> DataRepr {
        super::super::desc::tests::data(psn, offset, len, 4 * u64::from(PKT), true)
    }

    /// The fragments of `d` whose send holds byte `i` = `i % 251` at offset `i`.
    fn fragments(d: &DataRepr) -> Vec<Vec<u8>> {
        let mut tx = BounceTx::default();
        assert!(tx.queue(0, 0, MsgId(1), d.offset, d));
        let mut b = tx.pending.pop_front().unwrap();
        let mut out = Vec::new();
        while b.hdr.frag_off < b.hdr.pkt_len {
            let mut slot = vec![0u8; SLOT_BYTES];
            let n = fill_fragment(&b, &mut slot, |off, out| {
                for (i, x) in out.iter_mut().enumerate() {
                    *x = ((off as usize + i) % 251) as u8;
                }
            });
            slot.truncate(n);
            out.push(slot);
            b.hdr.frag_off += (n - FRAG_HEADER_LEN) as u32;
        }
        out
    }

    fn feed(rx: &mut Reassembly, buf: &mut [u8], frag: &[u8]) -> Option<DataRepr> {
        let (f, payload) = FragRepr::parse(frag).unwrap();
        rx.on_frag(&f, payload, |off, data| buf[off as usize..off as usize + data.len()].copy_from_slice(data))
            .map(|h| DataRepr::parse(&DataPacket::new_checked_header(&h[..]).unwrap()).unwrap())
    }

    /// A 64 KiB retransmission travels in 74 fragments of whole 128-byte lines that fit a receive
    /// slot; in any order, the receiver places every byte where the packet belongs and rebuilds its
    /// header (flagged as a retransmission) exactly once, after the last fragment.
    #[test]
    fn a_retransmission_is_reassembled_in_place_from_fragments_in_any_order() {
        let d = data(11, u64::from(PKT), PKT);
        let mut frags = fragments(&d);
        assert_eq!(frags.len(), frag_count(PKT));
        assert_eq!(frags.len(), 74);
        frags.reverse();
        frags.swap(3, 40);
        let mut buf = vec![0u8; 4 * PKT as usize];
        let mut rx = Reassembly::default();
        let last = frags.pop().unwrap();
        for f in &frags {
            assert_eq!(feed(&mut rx, &mut buf, f), None);
        }
        assert_eq!(feed(&mut rx, &mut buf, &frags[7]), None, "a duplicate changes nothing");
        let h = feed(&mut rx, &mut buf, &last).expect("the last fragment completes the packet");
        assert_eq!(h, DataRepr { ts_us: 0, ..d });
        for (i, &x) in buf.iter().enumerate() {
            let inside = (u64::from(PKT)..2 * u64::from(PKT)).contains(&(i as u64));
            assert_eq!(x, if inside { (i % 251) as u8 } else { 0 }, "byte {i}");
        }
        assert_eq!((rx.counters.packets_reassembled, rx.counters.frags_dup), (1, 1));
        assert!(rx.parts.is_empty() && rx.order.is_empty());
    }

    /// A later retransmission (a newer CTS acknowledgement, another path) completes what an earlier
    /// copy, partly lost, began; a fragment not cut where the sender cuts places nothing; a copy
    /// that conflicts with the packet (other bytes for the PSN) restarts it rather than blocking every
    /// later copy (a failure-verbs run stalled for 20 s on that: every retransmission of a packet
    /// whose first copy lost fragments with the rail was refused).
    #[test]
    fn a_later_copy_completes_a_packet_and_nothing_blocks_it() {
        let d = data(11, 0, 1000);
        let first = fragments(&d);
        let later = fragments(&DataRepr { cts_ack: 4, entropy: 9, ..d });
        assert_eq!(first.len(), 2);
        let mut buf = vec![0u8; 4 * PKT as usize];
        let mut rx = Reassembly::default();
        assert_eq!(feed(&mut rx, &mut buf, &first[0]), None, "the first copy's second fragment is lost");
        let h = feed(&mut rx, &mut buf, &later[1]).expect("the later copy completes the packet");
        assert_eq!((h.cts_ack, h.len, h.offset), (4, 1000, 0), "the newest acknowledgement");
        assert_eq!(rx.counters.frags_bad, 0);

        let (mut g, payload) = FragRepr::parse(&first[1]).unwrap();
        let payload = payload.to_vec();
        g.frag_off = 128;
        assert_eq!(rx.on_frag(&g, &payload, |_, _| panic!("placed a misaligned fragment")), None);
        assert_eq!(rx.counters.frags_bad, 1);

        assert_eq!(feed(&mut rx, &mut buf, &first[0]), None);
        let (mut f, _) = FragRepr::parse(&first[1]).unwrap();
        f.total_len += 128;
        assert_eq!(rx.on_frag(&f, &payload, |_, _| {}), None, "a conflicting copy restarts the packet");
        assert_eq!(rx.counters.frags_bad, 2);
        assert_eq!(feed(&mut rx, &mut buf, &first[0]), None);
        assert!(feed(&mut rx, &mut buf, &first[1]).is_some(), "the packet still completes");
    }

    /// Memory stays bounded: beyond 256 partial packets the oldest goes (proto resends it); a
    /// receive that is done takes its partial packets with it.
    #[test]
    fn partial_packets_are_bounded_and_forgotten_with_their_receive() {
        let mut rx = Reassembly::default();
        let mut buf = vec![0u8; 4 * PKT as usize];
        for psn in 0..300u64 {
            let frags = fragments(&data(psn, 0, PKT));
            assert_eq!(feed(&mut rx, &mut buf, &frags[0]), None);
        }
        assert_eq!(rx.parts.len(), REASM_MAX);
        assert_eq!(rx.counters.partial_dropped, 300 - REASM_MAX as u64);
        rx.forget(2);
        assert!(rx.parts.is_empty() && rx.order.is_empty());
    }
}
