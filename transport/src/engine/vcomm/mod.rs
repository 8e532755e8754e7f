//! One comm's verbs side: its QPs on every rail, the registrations of its outstanding buffers, and the
//! translation between proto's datagrams and verbs operations (see `backend::verbs` for the scheme).
//!
//! Sender: proto writes a DATA header (its payload is not copied: the payload source only notes which
//! bytes proto wanted), the payload goes as an RDMA WRITE WITH IMM from the send buffer to the address
//! and rkey the receiver's CTS advertised; no header travels with it: a descriptor SEND per run of
//! an item's packets (`desc`) and the immediate (the PSN) let the receiver rebuild it. A
//! retransmission goes as fragments the receiver copies while the receive is posted (`bounce`),
//! never as a WRITE. Receiver: proto's CTS is re-emitted with the buffers' registered addresses and
//! per-rail rkeys; a rebuilt header goes to `Connection::handle_rebuilt_data`, every other packet to
//! `handle_datagram`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

mod bounce;
pub(crate) use bounce::shallow_receive_queue;
mod desc;
mod fence;
mod recreate;

use self::bounce::{fill_fragment, frag_len, BounceTx, Reassembly};
use self::desc::{DescRx, DescTx};
use self::fence::{parse_fence, Fences};
use super::planned::Plans;
use super::revive::{self, QpCtlRx, Revive};
use super::TransportError;
use crate::backend::verbs::{Depths, MrKeys, PostFail, QpSet, QpStats, RailPeer, RxEvent, VerbsDevice, SLOT_BYTES};
use crate::engine::SendBuf;
use crate::proto::{Connection, MsgId, NoPlacement, PayloadSource, Placer, ProtoConfig};
use crate::wire::{CtsKeys, CtsPacket, CtsRepr, DataPacket, DataRepr, Header, PacketType, CTS_MAX_KEY_RAILS, DATA_HEADER_LEN};
use crate::wire::{DescRepr, FragRepr, QP_CTL_LEN};

/// Most packets one transmit call posts (keeps test() short).
const MAX_TX: usize = 256;
/// Keyed CTS kept per connection (older ones are long matched).
const MAX_REMOTE_CTS: usize = 1024;

/// Records what proto asked for instead of copying it: the verbs backend sends from the buffer itself.
#[derive(Default)]
struct Recorder {
    last: Option<(MsgId, u64, usize)>,
}

impl PayloadSource for Recorder {
    fn read(&mut self, msg: MsgId, offset: u64, out: &mut [u8]) {
        self.last = Some((msg, offset, out.len()));
    }
}

/// Counters of the verbs side of one comm.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub(crate) struct VerbsCounters {
    /// DATA whose CTS keys were unknown (not posted; proto resends).
    pub missing_keys: u64,
    /// DATA outside the advertised buffer (never posted).
    pub bad_remote_range: u64,
    /// Packets not posted because the QP was dead.
    pub dead_qp_drops: u64,
    /// Packets not posted because the send queue was full.
    pub sq_full_drops: u64,
    /// CTS sent with keys.
    pub keyed_cts_sent: u64,
    /// Keyed CTS received.
    pub keyed_cts_received: u64,
    /// Retransmissions not posted because an earlier copy of the same PSN was still in a send queue.
    pub retx_held: u64,
    /// FENCEs sent (sender, UC: answering a request).
    pub fences_sent: u64,
    /// FENCEs received.
    pub fences_received: u64,
    /// FENCE requests sent (receiver, UC: a packet came by fragments; again after 20 ms).
    pub fence_requests: u64,
    /// Receives completed without their FENCE after 2 s.
    pub fence_give_ups: u64,
    /// Receives whose completion waited for a FENCE (UC only).
    pub receives_held: u64,
    /// Dead QPs re-created (reset and connected again to the peer's re-created QP), either side
    /// starting it.
    pub qp_recreated: u64,
    /// Re-creation attempts that failed (a verbs call failed, or the peer did not answer in 2 s).
    pub qp_recreate_failed: u64,
    /// QP control packets (REQ/ACK) sent and received.
    pub qp_ctl_sent: u64,
    /// QP control packets received.
    pub qp_ctl_received: u64,
    /// QP control packets dropped: malformed, naming no QP, or stale (an ACK nobody waits for).
    pub qp_ctl_dropped: u64,
}

/// Registered ranges of one buffer: (addr, len) and its keys per rail.
struct BufMem {
    addr: usize,
    keys: Vec<MrKeys>,
}

pub(crate) struct VerbsComm {
    pub rails: Vec<QpSet>,
    paths: u16,
    /// Send slots per QP fragments leave free for control packets (a quarter of them).
    frag_slot_reserve: usize,
    /// Sender: keyed CTS by sequence number.
    remote: BTreeMap<u64, CtsRepr>,
    /// Receiver: which receive each CTS sequence number stands for (proto numbers its CTS 0, 1, 2,
    /// ... in the order of successful `post_recv` calls).
    recv_seq: HashMap<u64, MsgId>,
    next_recv_seq: u64,
    mem: HashMap<MsgId, Vec<BufMem>>,
    txbuf: Vec<u8>,
    ctsbuf: Vec<u8>,
    /// FENCE bookkeeping (both directions).
    fences: Fences,
    fence_rr: usize,
    /// Re-creation state per QP, indexed rail * paths + q; our control packets waiting for a live QP.
    revive: Vec<Revive>,
    ctl_out: VecDeque<[u8; QP_CTL_LEN]>,
    /// This end connected (its REQs win when both ends ask at once).
    connector: bool,
    /// Per rail: QPs are being re-created (for one info log per rail event).
    rail_reviving: Vec<bool>,
    /// Payload of proto's packets (every one but an item's last).
    max_payload: u32,
    /// Descriptors: the sender's runs, the receiver's descriptors and waiting WRITEs.
    desc_tx: DescTx,
    desc_rx: DescRx,
    /// Retransmissions as fragments: the sender's waiting ones, the receiver's partial packets.
    bounce_tx: BounceTx,
    reasm: Reassembly,
    pub counters: VerbsCounters,
}

impl Drop for VerbsComm {
    /// The QPs go first, so no WRITE still queued can touch a buffer after its registration is
    /// released (NCCL may have deregistered and freed it the moment close returns); then every
    /// registration this comm holds is released, those of requests still in flight and those of sends
    /// whose last WRITE had not left the send queue (`release_later`) alike.
    fn drop(&mut self) {
        let devs: Vec<Arc<VerbsDevice>> = self.rails.iter().map(|s| s.device().clone()).collect();
        self.rails.clear();
        self.fences.clear_release_later();
        for (_, mems) in self.mem.drain() {
            for m in &mems {
                for (dev, k) in devs.iter().zip(&m.keys) {
                    dev.release(k.key);
                }
            }
        }
    }
}

impl VerbsComm {
    /// QPs on every rail for connection `token` (INIT, receives posted).
    /// `connector`: this end connected (rather than accepted).
    pub fn create(
        devs: &[Arc<VerbsDevice>],
        paths: u16,
        rc: bool,
        depths: Depths,
        token: u64,
        proto: &ProtoConfig,
        connector: bool,
    ) -> Result<Self, TransportError> {
        let max_payload = proto.max_payload;
        let base = crate::backend::verbs::flow_label_base(token, paths);
        let rails = devs.iter().map(|d| QpSet::new(d, paths, rc, base, depths)).collect::<Result<Vec<_>, _>>().map_err(|e| {
            TransportError::ConnectionFailed(format!("creating QPs: {e}{}", crate::backend::verbs::memlock_hint(depths, paths)))
        })?;
        Ok(Self {
            rails,
            paths: paths.max(1),
            frag_slot_reserve: depths.send_slots / 4,
            remote: BTreeMap::new(),
            recv_seq: HashMap::new(),
            next_recv_seq: 0,
            mem: HashMap::new(),
            txbuf: vec![0u8; DATA_HEADER_LEN + max_payload],
            ctsbuf: vec![0u8; SLOT_BYTES],
            fences: Fences::new(!rc),
            fence_rr: 0,
            revive: (0..devs.len()).flat_map(|r| (0..paths.max(1)).map(move |q| Revive::new(r as u8, q))).collect(),
            ctl_out: VecDeque::new(),
            connector,
            rail_reviving: vec![false; devs.len()],
            max_payload: u32::try_from(max_payload).unwrap_or(u32::MAX),
            desc_tx: DescTx::default(),
            desc_rx: DescRx::new(proto.window_pkts as usize),
            bounce_tx: BounceTx::default(),
            reasm: Reassembly::default(),
            counters: VerbsCounters::default(),
        })
    }

    /// Our QPs' connection data, per rail.
    pub fn local(&self) -> Vec<RailPeer> {
        self.rails.iter().map(QpSet::local).collect()
    }

    /// Connect our QPs to the peer's (rails paired by index).
    pub fn connect(&mut self, peers: &[RailPeer]) -> Result<(), TransportError> {
        if peers.len() != self.rails.len() {
            return Err(TransportError::ConnectionFailed(format!(
                "peer has {} verbs rails, this end {} (use the same PRISM_IB_HCA count on both)",
                peers.len(),
                self.rails.len()
            )));
        }
        for (set, p) in self.rails.iter_mut().zip(peers) {
            set.connect(p).map_err(|e| TransportError::ConnectionFailed(format!("connecting QPs: {e}")))?;
        }
        Ok(())
    }

    /// Register (or find the registration of) each buffer on every rail, for message `msg`.
    pub fn register(&mut self, msg: MsgId, bufs: &[(usize, usize)]) -> Result<(), TransportError> {
        let mut mems = Vec::with_capacity(bufs.len());
        for &(addr, len) in bufs {
            if len == 0 {
                // Nothing is ever written to or read from an empty buffer.
                let none = MrKeys { key: (0, 0), lkey: 0, rkey: 0 };
                mems.push(BufMem { addr, keys: vec![none; self.rails.len()] });
                continue;
            }
            let mut keys = Vec::with_capacity(self.rails.len());
            for set in &self.rails {
                match set.device().acquire_covering(addr, len) {
                    Ok(k) => keys.push(k),
                    Err(e) => {
                        for (set, k) in self.rails.iter().zip(&keys) {
                            set.device().release(k.key);
                        }
                        for m in &mems {
                            self.release_mem(m);
                        }
                        return Err(TransportError::InvalidArgument(format!("registering {len} bytes at {addr:#x}: {e}")));
                    }
                }
            }
            mems.push(BufMem { addr, keys });
        }
        self.mem.insert(msg, mems);
        Ok(())
    }

    /// A receive was posted as `msg`: remember its CTS sequence number.
    pub fn recv_posted(&mut self, msg: MsgId) {
        self.recv_seq.insert(self.next_recv_seq, msg);
        self.next_recv_seq += 1;
    }

    fn release_mem(&self, m: &BufMem) {
        for (set, k) in self.rails.iter().zip(&m.keys) {
            set.device().release(k.key);
        }
    }

    /// Message `msg` is done: drop its registrations (for a send with WRITEs still queued, once they
    /// have left).
    pub fn release(&mut self, msg: MsgId) {
        if self.fences.keeps(msg) {
            return;
        }
        self.release_now(msg);
    }

    fn release_now(&mut self, msg: MsgId) {
        if let Some(mems) = self.mem.remove(&msg) {
            for m in &mems {
                self.release_mem(m);
            }
        }
        if let Some(seq) = self.recv_seq.iter().find(|(_, m)| **m == msg).map(|(s, _)| *s) {
            // From here a fragment of this receive finds no posted receive and is dropped.
            self.recv_seq.remove(&seq);
            self.reasm.forget(seq);
            self.fences.forget_recv(seq);
        }
    }

    /// Reap completions and feed every received packet to `conn`; a retransmission's fragments are
    /// copied into the receive buffers through `sink` (NCCL's buffers of the posted receives).
    pub fn poll(&mut self, conn: &mut Connection, now: u64, sink: &mut dyn Placer) {
        let mut done_psns = Vec::new();
        let mut fences = Vec::new();
        let mut ctls = Vec::new();
        let mut descs = Vec::new();
        let mut writes = Vec::new();
        let mut reassembled = Vec::new();
        let paths = self.paths as usize;
        let Self { rails, remote, counters, desc_rx, reasm, recv_seq, .. } = self;
        let nrails = rails.len();
        for (r, set) in rails.iter_mut().enumerate() {
            set.poll_send(|psn| done_psns.push(psn));
            set.check_states();
            set.poll_recv(|ev| match ev {
                RxEvent::Write { q, imm, len } => writes.push(((r * paths + q) as u16, imm, len)),
                RxEvent::Packet(b) => {
                    if b.starts_with(crate::wire::verbs_frag::FRAG_MAGIC) {
                        let Ok((f, payload)) = FragRepr::parse(b) else {
                            reasm.counters.frags_bad += 1;
                            return;
                        };
                        // Only into a receive that is still posted: once it went back to NCCL its
                        // CTS sequence number names nothing and the fragment is dropped.
                        let Some(&msg) = recv_seq.get(&f.cts_seq) else {
                            reasm.counters.frags_stale += 1;
                            return;
                        };
                        if let Some(h) = reasm.on_frag(&f, payload, |off, data| sink.place(msg, f.sub as usize, off, data)) {
                            reassembled.push(((f.cts_seq, f.sub), h));
                        }
                        return;
                    }
                    if let Some(f) = parse_fence(b) {
                        fences.push(f);
                        return;
                    }
                    if b.starts_with(crate::wire::verbs_desc::DESC_MAGIC) {
                        match DescRepr::parse(b) {
                            Ok(d) => descs.push(d),
                            Err(_) => desc_rx.counters.descs_bad += 1,
                        }
                        return;
                    }
                    match revive::classify(b, nrails, paths) {
                        QpCtlRx::NotCtl => {}
                        QpCtlRx::Bad => {
                            counters.qp_ctl_dropped += 1;
                            return;
                        }
                        QpCtlRx::Ctl(c) => {
                            counters.qp_ctl_received += 1;
                            ctls.push(c);
                            return;
                        }
                    }
                    if let Some(c) = keyed_cts(b) {
                        if c.keys.is_some_and(|k| k.rails as usize == nrails) {
                            counters.keyed_cts_received += 1;
                            keep_keyed_cts(remote, c, |s| conn.cts_in_use(s));
                        }
                    }
                    conn.handle_datagram(b, now, &mut NoPlacement);
                }
            });
        }
        // Descriptors first: a run's WRITEs on other QPs may have overtaken its descriptor.
        let mut rebuilt = Vec::new();
        for d in descs {
            self.desc_rx.on_desc(d, &mut rebuilt);
        }
        for (entropy, imm, len) in writes {
            self.desc_rx.on_write(entropy, imm, len, &mut rebuilt);
        }
        for h in &rebuilt {
            conn.handle_rebuilt_data(h, now);
        }
        for (t, h) in &reassembled {
            self.fences.bounced(*t);
            conn.handle_rebuilt_data(h, now);
        }
        for psn in done_psns {
            self.write_done(psn);
        }
        for f in fences {
            self.fences.on_packet(f, &mut self.counters);
        }
        for c in ctls {
            self.on_ctl(&c, now);
        }
        self.revive_tick(now, conn);
        self.flush_posts();
    }

    /// Post what the QPs queued (one doorbell per QP with work); WRITEs that could not be posted
    /// count as done (the NIC never saw them).
    fn flush_posts(&mut self) {
        let mut failed = Vec::new();
        for set in &mut self.rails {
            set.flush(|psn| failed.push(psn));
        }
        for psn in failed {
            self.write_done(psn);
        }
    }

    /// Post what proto wants to send; `sends` are NCCL's send buffers (a retransmission's fragments
    /// are copied from them).
    pub fn transmit(&mut self, conn: &mut Connection, now: u64, sends: &HashMap<MsgId, Box<dyn SendBuf>>, plans: &Plans) {
        self.flush_fences(conn);
        self.post_bounces(sends);
        self.queue_transmit(conn, now, plans);
        self.post_bounces(sends);
        self.flush_posts();
    }

    /// Post the fragments of waiting retransmissions, in order, as far as send slots allow. One
    /// whose send or QP went away is dropped (proto resends it elsewhere, or the send is over).
    fn post_bounces(&mut self, sends: &HashMap<MsgId, Box<dyn SendBuf>>) {
        let Self { bounce_tx, rails, reasm, frag_slot_reserve, .. } = self;
        let c = &mut reasm.counters;
        while let Some(b) = bounce_tx.pending.front_mut() {
            let end = b.send_off.checked_add(u64::from(b.hdr.pkt_len));
            let buf = sends.get(&b.msg).filter(|s| end.is_some_and(|e| e <= s.len() as u64));
            let room = rails.get(b.rail).map(|set| set.send_room(b.q));
            let (Some(buf), Some(Ok(room))) = (buf, room) else {
                bounce_tx.pending.pop_front();
                c.bounces_dropped += 1;
                continue;
            };
            // Fragments leave a quarter of the QP's send slots to control packets (a CTS or SACK
            // must not wait behind a retransmission's 74 fragments).
            for _ in 0..room.saturating_sub(*frag_slot_reserve) {
                if b.hdr.frag_off >= b.hdr.pkt_len {
                    break;
                }
                let posted = rails[b.rail].post_send_with(b.q, |slot| fill_fragment(b, slot, |off, out| buf.read(off as usize, out)));
                if posted.is_err() {
                    break;
                }
                c.frags_sent += 1;
                b.hdr.frag_off += frag_len(b.hdr.pkt_len, b.hdr.frag_off);
            }
            if b.hdr.frag_off < b.hdr.pkt_len {
                return;
            }
            bounce_tx.pending.pop_front();
        }
    }

    fn queue_transmit(&mut self, conn: &mut Connection, now: u64, plans: &Plans) {
        let mut rec = Recorder::default();
        for _ in 0..MAX_TX {
            rec.last = None;
            let Some(t) = conn.poll_transmit(now, &mut rec, &mut self.txbuf) else { return };
            let nrails = self.rails.len();
            let rail = (t.entropy / self.paths) as usize % nrails;
            let q = (t.entropy % self.paths) as usize;
            let ptype = Header::new_checked(&self.txbuf[..t.len]).ok().and_then(|h| h.packet_type().ok());
            let res = match ptype {
                Some(PacketType::Data) => self.post_data(rail, q, t.len, rec.last, plans),
                Some(PacketType::Cts) => self.post_cts(rail, q, t.len),
                _ => self.rails[rail].post_send(q, &self.txbuf[..t.len]).map_err(Some),
            };
            match res {
                Ok(()) | Err(None) => {}
                Err(Some(PostFail::Dead)) => self.counters.dead_qp_drops += 1,
                Err(Some(PostFail::Full)) => self.counters.sq_full_drops += 1,
                Err(Some(PostFail::TooBig)) => tracing::warn!(len = t.len, "packet larger than a verbs slot: not sent"),
            }
        }
    }

    /// Err(None): not posted, already counted.
    fn post_data(
        &mut self,
        rail: usize,
        q: usize,
        len: usize,
        read: Option<(MsgId, u64, usize)>,
        plans: &Plans,
    ) -> Result<(), Option<PostFail>> {
        let bytes = &self.txbuf[..len];
        let Ok(d) = DataPacket::new_checked(bytes).and_then(|p| DataRepr::parse(&p)) else { return Err(None) };
        if d.len == 0 || d.trunc {
            return self.rails[rail].post_send(q, &bytes[..DATA_HEADER_LEN]).map_err(Some);
        }
        let Some((msg, off, n)) = read.filter(|&(_, off, n)| off == d.offset && n == d.len as usize) else {
            self.counters.missing_keys += 1;
            return Err(None);
        };
        let Some(local) = self.mem.get(&msg).and_then(|m| m.first()) else {
            self.counters.missing_keys += 1;
            return Err(None);
        };
        let Some(cts) = self.remote.get(&d.cts_seq) else {
            self.counters.missing_keys += 1;
            return Err(None);
        };
        let (Some(keys), sub) = (cts.keys, d.sub as usize) else {
            self.counters.missing_keys += 1;
            return Err(None);
        };
        // proto checked this against the CTS it parsed; check again before the NIC writes remote memory.
        let size = cts.bufs().get(sub).map_or(0, |b| b.size);
        let end = d.offset.checked_add(u64::from(d.len));
        if sub >= cts.n as usize || end.is_none_or(|e| e > size) {
            self.counters.bad_remote_range += 1;
            return Err(None);
        }
        if d.retx {
            // Never a second WRITE into the buffer: the packet goes as fragments the receiver
            // copies only while the receive is posted, once its one WRITE left the send queue.
            if !self.fences.may_write_again(d.psn) {
                self.counters.retx_held += 1;
            } else if self.bounce_tx.queue(rail, q, msg, off, &d) {
                self.reasm.counters.retx_bounced += 1;
            } else {
                self.reasm.counters.bounces_dropped += 1;
            }
            return Err(None);
        }
        let raddr = keys.addr[sub] + d.offset;
        let rkey = keys.rkey[sub][rail.min(CTS_MAX_KEY_RAILS - 1)];
        let laddr = (local.addr as u64) + off;
        let lkey = local.keys[rail].lkey;
        let pkt = u64::from(self.max_payload);
        let (desc, send_desc) = self
            .desc_tx
            .describe(&d, self.max_payload, |from| plans.lock().get(&msg.0).and_then(|m| m.layout_break(from, pkt, d.total_len)));
        let desc = desc.to_bytes();
        let desc = send_desc.then_some(&desc[..]);
        let posted = self.rails[rail].post_data(q, laddr, lkey, n as u32, raddr, rkey, d.psn, d.retx, desc);
        if let Err(e) = posted {
            if send_desc {
                self.desc_tx.forget(d.cts_seq, d.sub);
            }
            return Err(Some(e));
        }
        if send_desc {
            self.desc_rx.counters.descs_sent += 1;
        }
        self.fences.posted(d.psn, (d.cts_seq, d.sub), msg);
        Ok(())
    }

    fn post_cts(&mut self, rail: usize, q: usize, len: usize) -> Result<(), Option<PostFail>> {
        let Ok(mut c) = CtsPacket::new_checked(&self.txbuf[..len]).and_then(|p| CtsRepr::parse(&p)) else { return Err(None) };
        if let Some(mems) = self.recv_seq.get(&c.cts_seq).and_then(|m| self.mem.get(m)) {
            let mut k = CtsKeys { rails: self.rails.len() as u8, ..CtsKeys::default() };
            for (i, m) in mems.iter().enumerate().take(c.n as usize) {
                k.addr[i] = m.addr as u64;
                for (r, key) in m.keys.iter().enumerate().take(CTS_MAX_KEY_RAILS) {
                    k.rkey[i][r] = key.rkey;
                }
            }
            c.keys = Some(k);
            self.counters.keyed_cts_sent += 1;
        }
        let n = c.buffer_len();
        c.emit(&mut CtsPacket::new_unchecked(&mut self.ctsbuf[..n]));
        self.rails[rail].post_send(q, &self.ctsbuf[..n]).map_err(Some)
    }

    /// Per-rail, per-QP counters, and their totals over the comm's QPs (work per MiB of data).
    pub fn stats(&self) -> serde_json::Value {
        let mut all = Vec::new();
        let rails: Vec<serde_json::Value> = self
            .rails
            .iter()
            .map(|s| {
                let qps: Vec<QpStats> = s.stats();
                all.extend(qps.iter().cloned());
                serde_json::json!({ "device": s.device().name, "qps": qps })
            })
            .collect();
        serde_json::json!({
            "counters": self.counters,
            "descriptors": self.desc_rx.counters,
            "bounce": self.reasm.counters,
            "totals": VerbsTotals::of(&all),
            "rails": rails,
        })
    }
}

/// Work of one comm's QPs, summed, and per MiB of data (sent: WRITE bytes posted; received: bytes
/// the received WRITEs placed). Control packets are included in the counts.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub(crate) struct VerbsTotals {
    pub wqes: u64,
    pub doorbells: u64,
    pub signalled: u64,
    pub send_cqes: u64,
    pub recv_cqes: u64,
    pub recv_doorbells: u64,
    pub writes: u64,
    pub sends: u64,
    pub write_bytes: u64,
    pub recv_write_bytes: u64,
    pub wqes_per_mib: f64,
    pub doorbells_per_mib: f64,
    pub send_cqes_per_mib: f64,
    pub recv_cqes_per_mib: f64,
    pub recv_doorbells_per_mib: f64,
}

impl VerbsTotals {
    fn of(qps: &[QpStats]) -> Self {
        let mut t = Self::default();
        for q in qps {
            t.wqes += q.wqes;
            t.doorbells += q.doorbells;
            t.signalled += q.signalled;
            t.send_cqes += q.send_cqes;
            t.recv_cqes += q.recv_cqes;
            t.recv_doorbells += q.recv_doorbells;
            t.writes += q.writes;
            t.sends += q.sends;
            t.write_bytes += q.write_bytes;
            t.recv_write_bytes += q.recv_write_bytes;
        }
        let per = |n: u64, bytes: u64| if bytes == 0 { 0.0 } else { n as f64 * 1_048_576.0 / bytes as f64 };
        t.wqes_per_mib = per(t.wqes, t.write_bytes);
        t.doorbells_per_mib = per(t.doorbells, t.write_bytes);
        t.send_cqes_per_mib = per(t.send_cqes, t.write_bytes);
        t.recv_cqes_per_mib = per(t.recv_cqes, t.recv_write_bytes);
        t.recv_doorbells_per_mib = per(t.recv_doorbells, t.recv_write_bytes);
        t
    }
}

/// Keep keyed CTS `c`: the sender's WRITEs into its buffers need its addresses and rkeys. Past
/// `MAX_REMOTE_CTS`, the oldest that proto no longer sends into (`in_use`) goes; one it still does
/// stays however old (a grouped receive's buffer waiting for its tag): proto bounds those itself
/// (CTS groups held, the window).
fn keep_keyed_cts(remote: &mut BTreeMap<u64, CtsRepr>, c: CtsRepr, in_use: impl Fn(u64) -> bool) {
    let seq = c.cts_seq;
    remote.insert(seq, c);
    let excess = remote.len().saturating_sub(MAX_REMOTE_CTS);
    if excess > 0 {
        // (The new one is not proto's yet: it parses the CTS after this.)
        let old: Vec<u64> = remote.keys().copied().filter(|&s| s != seq && !in_use(s)).take(excess).collect();
        for s in old {
            remote.remove(&s);
        }
    }
}

/// A keyed CTS, parsed (None for anything else).
fn keyed_cts(b: &[u8]) -> Option<CtsRepr> {
    let h = Header::new_checked(b).ok()?;
    if h.packet_type().ok()? != PacketType::Cts {
        return None;
    }
    CtsPacket::new_checked(b).and_then(|p| CtsRepr::parse(&p)).ok().filter(|c| c.keys.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Completion, RecvSpec};

    struct Zeros;
    impl PayloadSource for Zeros {
        fn read(&mut self, _: MsgId, _: u64, out: &mut [u8]) {
            out.fill(0);
        }
    }

    /// A sender and a receiver connection over a lossless network; every CTS the sender gets is
    /// keyed (as `post_cts` keys it) and kept as `poll` keeps it; `unkeyed` lists the CTS
    /// sequence numbers of DATA the sender emitted whose keys `remote` no longer held (`post_data`
    /// posts none of them: `missing_keys`).
    struct Pair {
        s: Connection,
        r: Connection,
        now: u64,
        remote: BTreeMap<u64, CtsRepr>,
        unkeyed: Vec<u64>,
        received: usize,
    }

    impl Pair {
        fn new() -> Self {
            let cfg = ProtoConfig::default();
            let s = Connection::new(cfg.clone(), 1, 2, Box::new(prism_lb::path::Spray::new(1)), 0);
            let r = Connection::new(cfg, 2, 1, Box::new(prism_lb::path::Spray::new(2)), 0);
            Self { s, r, now: 0, remote: BTreeMap::new(), unkeyed: Vec::new(), received: 0 }
        }

        fn pump(&mut self) {
            let mut buf = vec![0u8; 70_000];
            for _ in 0..100 {
                self.now += 100;
                let now = self.now;
                for c in [&mut self.s, &mut self.r] {
                    if c.poll_timeout().is_some_and(|t| t <= now) {
                        c.handle_timeout(now);
                    }
                }
                while let Some(t) = self.s.poll_transmit(now, &mut Zeros, &mut buf) {
                    let b = &buf[..t.len];
                    let is_data = Header::new_checked(b).ok().and_then(|h| h.packet_type().ok()) == Some(PacketType::Data);
                    if is_data {
                        let d = DataPacket::new_checked(b).and_then(|p| DataRepr::parse(&p)).expect("DATA");
                        if d.len > 0 && !self.remote.contains_key(&d.cts_seq) {
                            self.unkeyed.push(d.cts_seq);
                        }
                    }
                    self.r.handle_datagram(b, now, &mut NoPlacement);
                }
                while let Some(t) = self.r.poll_transmit(now, &mut Zeros, &mut buf) {
                    let b = &buf[..t.len];
                    let is_cts = Header::new_checked(b).ok().and_then(|h| h.packet_type().ok()) == Some(PacketType::Cts);
                    if is_cts {
                        let mut c = CtsPacket::new_checked(b).and_then(|p| CtsRepr::parse(&p)).expect("CTS");
                        c.keys = Some(CtsKeys { rails: 1, ..CtsKeys::default() });
                        keep_keyed_cts(&mut self.remote, c, |s| self.s.cts_in_use(s));
                    }
                    self.s.handle_datagram(b, now, &mut NoPlacement);
                }
                while self.s.poll_completion().is_some() {}
                while let Some(c) = self.r.poll_completion() {
                    self.received += usize::from(matches!(c, Completion::Received { .. }));
                }
            }
        }
    }

    /// The sender keeps the newest `MAX_REMOTE_CTS` keyed CTS, assuming older ones are long
    /// matched. With tags they need not be: a grouped receive whose tag-2 buffer waits for a
    /// tag-2 send stays open at both ends (proto holds its CTS group) while any number of
    /// tag-1 messages go by, each with a CTS of its own. Once 1,024 of them went, the group's keys
    /// are gone: the tag-2 send's DATA is never posted (`missing_keys`), nor its retransmissions,
    /// and the receiver will not send the CTS again (the sender acknowledged it). The receive hangs
    /// until the stall watchdog fails every request of the connection. UDP delivers it.
    #[test]
    fn a_cts_group_waiting_for_one_tag_keeps_its_keys_while_other_tags_go_by() {
        let mut p = Pair::new();
        let spec = |tag| RecvSpec { len: 128, tag };
        p.r.post_recv(&[spec(1), spec(2)], 0).expect("grouped receive");
        p.s.post_send(128, 1, 0).expect("send");
        p.pump();
        for _ in 0..(MAX_REMOTE_CTS + 16) {
            p.r.post_recv(&[spec(1)], p.now).expect("receive");
            p.s.post_send(128, 1, p.now).expect("send");
            p.pump();
        }
        assert_eq!(p.received, MAX_REMOTE_CTS + 16, "every tag-1 receive completed");
        assert!(p.unkeyed.is_empty());
        p.s.post_send(128, 2, p.now).expect("the tag-2 send");
        p.pump();
        assert!(p.unkeyed.is_empty(), "DATA for CTS {:?} found no keys: never posted, the grouped receive hangs", p.unkeyed);
    }
}
