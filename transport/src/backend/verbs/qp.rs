//! The QPs of one connection on one rail ([`QpSet`]): creation, connection, posting WRITEs and
//! SENDs, reaping completions, and reset for re-creation.

use std::collections::VecDeque;
use std::sync::Arc;

use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, GenericCompletionQueue, WorkCompletionOperationType, WorkCompletionStatus};
use sideway::ibverbs::device_context::PortState;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard as _, QueuePair as _, QueuePairAttribute, QueuePairState, QueuePairType, SendOperationFlags,
    SetScatterGatherEntry as _, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use crate::wire::RailPeer;

use super::device::VerbsDevice;
use super::ring::Ring;
use super::{flow_label, imm_of, udp_sport, Depths, VerbsError, RC_RETRY, RC_TIMEOUT, SLOT_BYTES};

/// Counters of one QP (serialized into `PRISM_STATS`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct QpStats {
    /// Local QP number.
    pub qpn: u32,
    /// Flow label of its GRH.
    pub flow_label: u32,
    /// UDP source port the kernel derives from it.
    pub udp_sport: u16,
    /// WRITE WITH IMM posted.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// SENDs posted.
    pub sends: u64,
    /// Packets not posted: send queue full.
    pub sq_full: u64,
    /// Packets not posted: the QP is dead.
    pub dead_drops: u64,
    /// Send work requests posted (a DATA packet is two: its WRITE and its header SEND).
    pub wqes: u64,
    /// Send doorbells: calls that post a chain of send work requests.
    pub doorbells: u64,
    /// Send work requests posted signalled (each gives one send completion).
    pub signalled: u64,
    /// Send completions reaped.
    pub send_cqes: u64,
    /// Receive completions reaped (WRITE WITH IMM and SEND alike).
    pub recv_cqes: u64,
    /// Payload bytes placed by received WRITEs (the completions' byte_len).
    pub recv_write_bytes: u64,
    /// Receive doorbells: calls that post a chain of receive work requests.
    pub recv_doorbells: u64,
    /// WRITE WITH IMM received (payload in place, header to be rebuilt).
    pub placed: u64,
    /// Packets received by SEND.
    pub received: u64,
    /// Error completions.
    pub errors: u64,
    /// Fewest receives this QP had posted when its completions were reaped (before posting the
    /// consumed ones again): how close its receive queue came to running dry. A WRITE or SEND that
    /// finds none is dropped on UC (and waits on RC), so a value near 0 asks for a deeper
    /// `PRISM_IB_RECV_DEPTH`.
    pub recv_posted_min: u64,
    /// The QP went to the error state or reported an error completion (and is not re-created yet).
    pub dead: bool,
    /// Times the QP was re-created (reset and connected again to the peer's) after it died.
    pub recreated: u64,
}

struct Qp {
    // The QP must be destroyed before its CQs (sideway asserts on ibv_destroy_cq).
    qp: ExtendedQueuePair,
    psn: u32,
    /// Bumped by every reset; carried in the work request ids so that completions of WRs posted
    /// before a reset are recognised and ignored.
    gen: u16,
    wrs_in_flight: usize,
    slots_in_flight: usize,
    next_slot: usize,
    /// Work requests accepted since the last [`QpSet::flush`], posted by it as one chain.
    queued: Vec<Wr>,
    /// Work requests posted and not known complete, in posting order (a send queue completes in
    /// order, so a completion of sequence number `s` completes every older one too).
    outstanding: VecDeque<Out>,
    /// Sequence number of the next posted send work request (carried in its wr_id).
    next_seq: u32,
    /// Work requests posted unsignalled since the last signalled one.
    unsignalled: usize,
    /// Receive slots consumed and not posted again yet (posted in chains of [`REPOST_BATCH`]).
    repost: Vec<usize>,
    /// Receives posted and not yet seen completed.
    recv_posted: usize,
    stats: QpStats,
}

/// Consumed receive slots are posted again once this many wait, as one chain (one doorbell): the
/// receive queue then never has fewer than `Depths::recv - REPOST_BATCH` receives posted after a
/// reap, and a slow link (one completion per poll) no longer costs a doorbell per packet received.
pub const REPOST_BATCH: usize = 16;

/// A send work request waiting for [`QpSet::flush`].
#[derive(Clone, Copy)]
enum Wr {
    /// SEND of `len` bytes of send-ring slot `slot`.
    Send { slot: usize, len: u32 },
    /// WRITE WITH IMM of `len` bytes from `local` (`lkey`) to `remote` (`rkey`), for PSN `psn`
    /// (`retx`: a retransmission).
    Write { local: u64, lkey: u32, len: u32, remote: u64, rkey: u32, psn: u64, retx: bool },
}

/// A posted send work request not yet known complete.
#[derive(Clone, Copy)]
struct Out {
    seq: u32,
    /// It holds a send-ring slot.
    slot: bool,
    /// It is the WRITE of this PSN.
    write_psn: Option<u64>,
}

/// What a receive completion brought.
pub enum RxEvent<'a> {
    /// A WRITE WITH IMM placed `len` bytes on QP `q`; `imm` is its immediate (host order).
    Write {
        /// QP index (entropy on this rail).
        q: usize,
        /// The immediate.
        imm: u32,
        /// Bytes placed.
        len: u32,
    },
    /// A packet that came by SEND (descriptors, CTS, SACK, control, payload-less DATA).
    Packet(&'a [u8]),
}

/// Why a packet was not posted (proto's loss recovery resends DATA; control is resent by its timers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostFail {
    /// The QP is dead.
    Dead,
    /// The send queue is full.
    Full,
    /// The packet does not fit a slot.
    TooBig,
}

/// A send work request is signalled at least once every this many (and the last of every chain),
/// so completions free slots in time and no posted work request goes unaccounted for long.
pub const SIGNAL_EVERY: usize = 16;

/// The wr_id of a receive (its ring slot) or of a send work request (its sequence number), both
/// with the QP's index and generation.
fn wr_id(q: usize, gen: u16, low: u32) -> u64 {
    (u64::from(gen) << 48) | (((q as u64) & 0xffff) << 32) | u64::from(low)
}

/// (QP index, generation, slot or sequence number).
fn wr_parts(id: u64) -> (usize, u16, u32) {
    (((id >> 32) & 0xffff) as usize, (id >> 48) as u16, id as u32)
}

/// How many entries of `outstanding` (oldest first, consecutive sequence numbers) a completion of
/// sequence number `seq` completes; 0 when `seq` is not among them.
fn completes(outstanding: &VecDeque<Out>, seq: u32) -> usize {
    let Some(front) = outstanding.front() else { return 0 };
    let i = seq.wrapping_sub(front.seq) as usize;
    if i < outstanding.len() {
        i + 1
    } else {
        0
    }
}

/// One connection's QPs on one rail.
pub struct QpSet {
    // Drop order matters: QPs, then CQs, then rings (their MRs), then the device.
    qps: Vec<Qp>,
    send_cq: Arc<BasicCompletionQueue>,
    recv_cq: Arc<BasicCompletionQueue>,
    send_ring: Ring,
    recv_ring: Ring,
    dev: Arc<VerbsDevice>,
    depths: Depths,
    rc: bool,
    connected: bool,
    /// The peer's GID on this rail (known once connected).
    peer_gid: [u8; 16],
}

impl QpSet {
    /// Create `paths` QPs (UC, or RC when `rc`) in INIT with their receives posted, as deep as
    /// `depths` says; flow labels start at `fl_base`.
    pub fn new(dev: &Arc<VerbsDevice>, paths: u16, rc: bool, fl_base: u32, depths: Depths) -> Result<Self, VerbsError> {
        let n = paths.max(1) as usize;
        let Depths { recv: recv_depth, send_slots } = depths;
        let send_wr = (2 * send_slots) as u32;
        let send_cq = vtry!(dev.ctx.create_cq_builder().setup_cqe(send_wr * n as u32).build(), "create send CQ")?;
        let recv_cq = vtry!(dev.ctx.create_cq_builder().setup_cqe((recv_depth * n) as u32).build(), "create recv CQ")?;
        let send_ring = Ring::new(dev, send_slots * n)?;
        let recv_ring = Ring::new(dev, recv_depth * n)?;
        let mut qps = Vec::with_capacity(n);
        for i in 0..n {
            let mut b = dev.pd.create_qp_builder();
            b.setup_qp_type(if rc { QueuePairType::ReliableConnection } else { QueuePairType::UnreliableConnection })
                // UC has no RDMA READ: the default op flags make rxe refuse the QP (note G2).
                .setup_send_ops_flags(SendOperationFlags::Write | SendOperationFlags::WriteWithImmediate | SendOperationFlags::Send)
                .setup_max_send_wr(send_wr)
                .setup_max_recv_wr(recv_depth as u32)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1)
                .setup_send_cq(GenericCompletionQueue::from(send_cq.clone()))
                .setup_recv_cq(GenericCompletionQueue::from(recv_cq.clone()));
            let mut qp = vtry!(b.build_ex(), "create QP")?;
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(1)
                .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
            vtry!(qp.modify(&a), "QP RESET->INIT")?;
            let fl = flow_label(fl_base, i as u16);
            let stats = QpStats {
                qpn: qp.qp_number(),
                flow_label: fl,
                udp_sport: udp_sport(fl),
                recv_posted_min: recv_depth as u64,
                ..QpStats::default()
            };
            let psn = rand::random::<u32>() & 0xFF_FFFF;
            qps.push(Qp {
                qp,
                psn,
                gen: 0,
                wrs_in_flight: 0,
                slots_in_flight: 0,
                next_slot: 0,
                queued: Vec::new(),
                outstanding: VecDeque::new(),
                next_seq: 0,
                unsignalled: 0,
                repost: Vec::with_capacity(REPOST_BATCH),
                recv_posted: 0,
                stats,
            });
        }
        let mut set =
            Self { qps, send_cq, recv_cq, send_ring, recv_ring, dev: dev.clone(), depths, rc, connected: false, peer_gid: [0; 16] };
        for q in 0..n {
            set.post_recvs(q, q * recv_depth..(q + 1) * recv_depth)?;
        }
        Ok(set)
    }

    /// Our side's connection data.
    pub fn local(&self) -> RailPeer {
        RailPeer { gid: self.dev.gid, qps: self.qps.iter().map(|q| (q.qp.qp_number(), q.psn)).collect() }
    }

    /// The device.
    pub fn device(&self) -> &Arc<VerbsDevice> {
        &self.dev
    }

    /// Move every QP to RTR and RTS towards the peer's QPs (paired by index).
    pub fn connect(&mut self, peer: &RailPeer) -> Result<(), VerbsError> {
        if peer.qps.len() != self.qps.len() {
            return Err(VerbsError::Call {
                what: "connect QPs".into(),
                detail: format!("peer has {} QPs on this rail, we have {}", peer.qps.len(), self.qps.len()),
            });
        }
        self.peer_gid = peer.gid;
        for (q, &(rqpn, rpsn)) in peer.qps.iter().enumerate() {
            self.connect_qp(q, rqpn, rpsn)?;
        }
        self.connected = true;
        Ok(())
    }

    /// Move QP `q` (in INIT) to RTR and RTS towards the peer's QP `rqpn` whose first PSN is `rpsn`.
    fn connect_qp(&mut self, q: usize, rqpn: u32, rpsn: u32) -> Result<(), VerbsError> {
        let gid = Gid { raw: self.peer_gid };
        let qp = &mut self.qps[q];
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(0).setup_port(1).setup_service_level(0).setup_grh(&gid, qp.stats.flow_label, self.dev.gid_index, 64, 0);
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(self.dev.mtu)
            .setup_dest_qp_num(rqpn)
            .setup_rq_psn(rpsn & 0xFF_FFFF)
            .setup_address_vector(&ah);
        if self.rc {
            a.setup_max_dest_read_atomic(0).setup_min_rnr_timer(12);
        }
        vtry!(qp.qp.modify(&a), format!("QP {:#x} INIT->RTR", qp.stats.qpn))?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToSend).setup_sq_psn(qp.psn);
        if self.rc {
            a.setup_timeout(RC_TIMEOUT).setup_retry_cnt(RC_RETRY).setup_rnr_retry(7).setup_max_read_atomic(0);
        }
        vtry!(qp.qp.modify(&a), format!("QP {:#x} RTR->RTS", qp.stats.qpn))?;
        tracing::debug!(
            dev = %self.dev.name, qpn = qp.stats.qpn, rqpn, flow_label = qp.stats.flow_label,
            udp_sport = qp.stats.udp_sport, "QP connected; expected RoCEv2 source port {:#x}", qp.stats.udp_sport
        );
        Ok(())
    }

    /// Is the rail's port active (the link is up)?
    pub fn port_active(&self) -> bool {
        self.dev.ctx.query_port(1).is_ok_and(|p| p.port_state() == PortState::Active)
    }

    /// Reset dead QP `q` for re-creation: RESET (drops every outstanding WR; their completions
    /// still in the CQs are ignored by generation), INIT, receives posted again, a new first PSN.
    /// The QP stays dead until [`Self::reconnect_qp`]. Returns its (QPN, PSN) for the peer and the
    /// PSNs of the WRITEs that were still queued (the NIC is done with them).
    pub fn reset_qp(&mut self, q: usize) -> Result<(u32, u32, Vec<u64>), VerbsError> {
        let qp = self.qps.get_mut(q).ok_or_else(|| VerbsError::Call { what: "reset QP".into(), detail: format!("no QP {q}") })?;
        qp.stats.dead = true;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Reset);
        vtry!(qp.qp.modify(&a), format!("QP {:#x} ->RESET", qp.stats.qpn))?;
        qp.gen = qp.gen.wrapping_add(1);
        qp.wrs_in_flight = 0;
        qp.slots_in_flight = 0;
        qp.unsignalled = 0;
        let mut drained: Vec<u64> = qp.outstanding.drain(..).filter_map(|o| o.write_psn).collect();
        drained.extend(qp.queued.drain(..).filter_map(|w| match w {
            Wr::Write { psn, .. } => Some(psn),
            Wr::Send { .. } => None,
        }));
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(1)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        vtry!(qp.qp.modify(&a), format!("QP {:#x} RESET->INIT", qp.stats.qpn))?;
        qp.psn = rand::random::<u32>() & 0xFF_FFFF;
        let (qpn, psn) = (qp.qp.qp_number(), qp.psn);
        // Every slot of the QP is posted again below, those waiting to be reposted too (RESET
        // dropped every receive posted).
        qp.repost.clear();
        qp.recv_posted = 0;
        let d = self.depths.recv;
        self.post_recvs(q, q * d..(q + 1) * d)?;
        Ok((qpn, psn, drained))
    }

    /// Connect QP `q` (after [`Self::reset_qp`]) to the peer's re-created QP; it is live again.
    pub fn reconnect_qp(&mut self, q: usize, rqpn: u32, rpsn: u32) -> Result<(), VerbsError> {
        if q >= self.qps.len() || !self.connected {
            return Err(VerbsError::Call { what: "reconnect QP".into(), detail: format!("no connected QP {q}") });
        }
        self.connect_qp(q, rqpn, rpsn)?;
        let qp = &mut self.qps[q];
        qp.stats.dead = false;
        qp.stats.recreated += 1;
        Ok(())
    }

    /// Post receives of ring slots `slots` on QP `q`, as one chain (one doorbell).
    fn post_recvs(&mut self, q: usize, slots: impl IntoIterator<Item = usize>) -> Result<(), VerbsError> {
        let lkey = self.recv_ring.mr.lkey();
        let gen = self.qps[q].gen;
        let ring = &self.recv_ring;
        let qp = &mut self.qps[q];
        let mut g = qp.qp.start_post_recv();
        let mut n = 0;
        for slot in slots {
            let h = g.construct_wr(wr_id(q, gen, slot as u32));
            // SAFETY: the slot lies inside the registered receive ring, which outlives the QP; each
            // slot is posted at most once at a time (reposted only after its completion was consumed).
            unsafe { h.setup_sge(lkey, ring.addr(slot), SLOT_BYTES as u32) };
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        qp.stats.recv_doorbells += 1;
        vtry!(g.post(), "post receive")?;
        qp.recv_posted += n;
        Ok(())
    }

    /// Number of QPs (entropies on this rail).
    pub fn paths(&self) -> usize {
        self.qps.len()
    }

    fn check_postable(&mut self, q: usize, wrs: usize, slot: bool) -> Result<(), PostFail> {
        let qp = &mut self.qps[q];
        if qp.stats.dead || !self.connected {
            qp.stats.dead_drops += 1;
            return Err(PostFail::Dead);
        }
        let slots = self.depths.send_slots;
        if qp.wrs_in_flight + wrs > 2 * slots || (slot && qp.slots_in_flight >= slots) {
            qp.stats.sq_full += 1;
            return Err(PostFail::Full);
        }
        Ok(())
    }

    fn take_slot(&mut self, q: usize, bytes: &[u8]) -> usize {
        let slots = self.depths.send_slots;
        let qp = &mut self.qps[q];
        let slot = q * slots + qp.next_slot;
        qp.next_slot = (qp.next_slot + 1) % slots;
        self.send_ring.slot_mut(slot)[..bytes.len()].copy_from_slice(bytes);
        slot
    }

    /// SENDs QP `q` can queue now (each takes a send slot), or why none: a dead QP.
    pub fn send_room(&self, q: usize) -> Result<usize, PostFail> {
        let qp = &self.qps[q];
        if qp.stats.dead || !self.connected {
            return Err(PostFail::Dead);
        }
        let slots = self.depths.send_slots;
        Ok(slots.saturating_sub(qp.slots_in_flight).min((2 * slots).saturating_sub(qp.wrs_in_flight)))
    }

    /// Queue a SEND on QP `q` whose bytes `fill` writes into the send slot (at most [`SLOT_BYTES`];
    /// it returns how many it wrote); [`Self::flush`] posts it.
    pub fn post_send_with(&mut self, q: usize, fill: impl FnOnce(&mut [u8]) -> usize) -> Result<(), PostFail> {
        self.check_postable(q, 1, true)?;
        let slots = self.depths.send_slots;
        let qp = &mut self.qps[q];
        let slot = q * slots + qp.next_slot;
        qp.next_slot = (qp.next_slot + 1) % slots;
        let len = fill(self.send_ring.slot_mut(slot)).min(SLOT_BYTES);
        let qp = &mut self.qps[q];
        qp.queued.push(Wr::Send { slot, len: len as u32 });
        qp.wrs_in_flight += 1;
        qp.slots_in_flight += 1;
        Ok(())
    }

    /// Queue a SEND of `bytes` (a whole control packet, or a payload-less DATA header) on QP `q`;
    /// [`Self::flush`] posts it.
    pub fn post_send(&mut self, q: usize, bytes: &[u8]) -> Result<(), PostFail> {
        if bytes.len() > SLOT_BYTES {
            return Err(PostFail::TooBig);
        }
        self.check_postable(q, 1, true)?;
        let slot = self.take_slot(q, bytes);
        let qp = &mut self.qps[q];
        qp.queued.push(Wr::Send { slot, len: bytes.len() as u32 });
        qp.wrs_in_flight += 1;
        qp.slots_in_flight += 1;
        Ok(())
    }

    /// Queue a DATA packet on QP `q`: a SEND of its descriptor `desc` when given, then a WRITE WITH
    /// IMM of `len` bytes from `local` (registered, `lkey`) to `remote` (`rkey`) whose immediate
    /// names `psn` and `retx`; [`Self::flush`] posts them. The caller checked the ranges.
    #[allow(clippy::too_many_arguments)]
    pub fn post_data(
        &mut self,
        q: usize,
        local: u64,
        lkey: u32,
        len: u32,
        remote: u64,
        rkey: u32,
        psn: u64,
        retx: bool,
        desc: Option<&[u8]>,
    ) -> Result<(), PostFail> {
        if desc.is_some_and(|d| d.len() > SLOT_BYTES) {
            return Err(PostFail::TooBig);
        }
        self.check_postable(q, 1 + usize::from(desc.is_some()), desc.is_some())?;
        if let Some(d) = desc {
            let slot = self.take_slot(q, d);
            let qp = &mut self.qps[q];
            qp.queued.push(Wr::Send { slot, len: d.len() as u32 });
            qp.wrs_in_flight += 1;
            qp.slots_in_flight += 1;
        }
        let qp = &mut self.qps[q];
        qp.queued.push(Wr::Write { local, lkey, len, remote, rkey, psn, retx });
        qp.wrs_in_flight += 1;
        Ok(())
    }

    /// Post every queued work request, one chain (one doorbell) per QP; a work request is
    /// signalled when it is a chain's last or [`SIGNAL_EVERY`] went unsignalled before it. A QP
    /// whose post fails is dead; the PSNs of the WRITEs that were not posted go to `write_done`
    /// (proto resends their packets).
    pub fn flush(&mut self, mut write_done: impl FnMut(u64)) {
        let ring_lkey = self.send_ring.mr.lkey();
        for (q, qp) in self.qps.iter_mut().enumerate() {
            if qp.queued.is_empty() {
                continue;
            }
            let n = qp.queued.len();
            let first = qp.outstanding.len();
            let mut g = qp.qp.start_post_send();
            for (i, wr) in qp.queued.iter().enumerate() {
                let seq = qp.next_seq;
                qp.next_seq = qp.next_seq.wrapping_add(1);
                qp.unsignalled += 1;
                let signal = i + 1 == n || qp.unsignalled >= SIGNAL_EVERY;
                let flags = if signal {
                    qp.unsignalled = 0;
                    qp.stats.signalled += 1;
                    WorkRequestFlags::Signaled
                } else {
                    WorkRequestFlags::none()
                };
                let id = wr_id(q, qp.gen, seq);
                match *wr {
                    Wr::Send { slot, len } => {
                        let h = g.construct_wr(id, flags).setup_send();
                        // SAFETY: the slot is inside the registered send ring, which outlives the
                        // QP; it is not reused before this WR completed (slots_in_flight <
                        // depths.send_slots, completions are FIFO).
                        unsafe { h.setup_sge(ring_lkey, self.send_ring.addr(slot), len) };
                        qp.outstanding.push_back(Out { seq, slot: true, write_psn: None });
                    }
                    Wr::Write { local, lkey, len, remote, rkey, psn, retx } => {
                        let w = g.construct_wr(id, flags).setup_write_imm(rkey, remote, imm_of(psn, retx).to_be());
                        // SAFETY: `local..local + len` lies in memory registered with `lkey` that the
                        // caller keeps registered and unchanged until the WRITE completes (the engine
                        // holds the registration until `write_done` reported this PSN).
                        unsafe { w.setup_sge(lkey, local, len) };
                        qp.outstanding.push_back(Out { seq, slot: false, write_psn: Some(psn) });
                        qp.stats.writes += 1;
                        qp.stats.write_bytes += u64::from(len);
                    }
                }
            }
            if let Err(e) = g.post() {
                tracing::warn!(qpn = qp.stats.qpn, "post send failed: {e}; QP marked dead");
                qp.stats.errors += 1;
                qp.stats.dead = true;
                for o in qp.outstanding.drain(first..) {
                    qp.wrs_in_flight = qp.wrs_in_flight.saturating_sub(1);
                    if o.slot {
                        qp.slots_in_flight = qp.slots_in_flight.saturating_sub(1);
                    }
                    if let Some(psn) = o.write_psn {
                        write_done(psn);
                    }
                }
                qp.queued.clear();
                continue;
            }
            for w in qp.queued.drain(..) {
                if matches!(w, Wr::Send { .. }) {
                    qp.stats.sends += 1;
                }
            }
            qp.stats.wqes += n as u64;
            qp.stats.doorbells += 1;
        }
    }

    /// Reap send completions (a completion completes its work request and every older one of its
    /// QP: frees slots; an error completion kills its QP); `write_done` gets the PSN of every WRITE
    /// that completed (successfully or not: either way the NIC is done with it).
    pub fn poll_send(&mut self, mut write_done: impl FnMut(u64)) {
        loop {
            let Ok(poller) = self.send_cq.start_poll() else { return };
            let mut n = 0;
            for wc in poller {
                n += 1;
                let (q, gen, seq) = wr_parts(wc.wr_id());
                let Some(qp) = self.qps.get_mut(q) else { continue };
                if gen != qp.gen {
                    // Posted before a reset: already accounted for by reset_qp.
                    continue;
                }
                qp.stats.send_cqes += 1;
                for o in qp.outstanding.drain(..completes(&qp.outstanding, seq)) {
                    qp.wrs_in_flight = qp.wrs_in_flight.saturating_sub(1);
                    if o.slot {
                        qp.slots_in_flight = qp.slots_in_flight.saturating_sub(1);
                    }
                    if let Some(psn) = o.write_psn {
                        write_done(psn);
                    }
                }
                if wc.status() != WorkCompletionStatus::Success as u32 {
                    qp.stats.errors += 1;
                    if !qp.stats.dead {
                        tracing::warn!(dev = %self.dev.name, qpn = qp.stats.qpn, status = wc.status(), "send completion error: QP marked dead");
                    }
                    qp.stats.dead = true;
                }
            }
            if n == 0 {
                return;
            }
        }
    }

    /// Reap receive completions and hand each packet to `deliver`; the slots are posted again per
    /// QP in chains of [`REPOST_BATCH`].
    pub fn poll_recv(&mut self, mut deliver: impl FnMut(RxEvent<'_>)) {
        let mut wcs: Vec<(u64, u32, u32, u32, u32)> = Vec::new();
        while let Ok(poller) = self.recv_cq.start_poll() {
            wcs.clear();
            wcs.extend(poller.map(|wc| (wc.wr_id(), wc.status(), wc.opcode(), wc.byte_len(), u32::from_be(wc.imm_data()))));
            if wcs.is_empty() {
                break;
            }
            for &(id, status, opcode, len, imm) in &wcs {
                let (q, gen, slot) = wr_parts(id);
                let slot = slot as usize;
                if q >= self.qps.len() || slot >= self.depths.recv * self.qps.len() || gen != self.qps[q].gen {
                    // A receive posted before a reset (flushed): its slot was posted again then.
                    continue;
                }
                self.qps[q].stats.recv_cqes += 1;
                self.qps[q].recv_posted = self.qps[q].recv_posted.saturating_sub(1);
                if status != WorkCompletionStatus::Success as u32 {
                    let qp = &mut self.qps[q];
                    qp.stats.errors += 1;
                    if status != WorkCompletionStatus::WorkRequestFlushedError as u32 && !qp.stats.dead {
                        tracing::warn!(dev = %self.dev.name, qpn = qp.stats.qpn, status, "receive completion error: QP marked dead");
                    }
                    qp.stats.dead = true;
                    continue;
                }
                if opcode == WorkCompletionOperationType::ReceiveWithImmediate as u32 {
                    let qp = &mut self.qps[q];
                    qp.stats.recv_write_bytes += u64::from(len);
                    qp.stats.placed += 1;
                    deliver(RxEvent::Write { q, imm, len });
                } else if opcode == WorkCompletionOperationType::Receive as u32 {
                    let n = (len as usize).min(SLOT_BYTES);
                    self.qps[q].stats.received += 1;
                    deliver(RxEvent::Packet(&self.recv_ring.slot(slot)[..n]));
                }
                self.qps[q].repost.push(slot);
            }
            // A QP that died had its receives flushed: that is not a queue running dry.
            for qp in self.qps.iter_mut().filter(|qp| !qp.stats.dead) {
                qp.stats.recv_posted_min = qp.stats.recv_posted_min.min(qp.recv_posted as u64);
            }
            for q in 0..self.qps.len() {
                if self.qps[q].repost.len() < REPOST_BATCH {
                    continue;
                }
                let slots = std::mem::take(&mut self.qps[q].repost);
                let res = self.post_recvs(q, slots.iter().copied());
                self.qps[q].repost = slots;
                self.qps[q].repost.clear();
                if let Err(e) = res {
                    let qp = &mut self.qps[q];
                    if !qp.stats.dead {
                        tracing::warn!(qpn = qp.stats.qpn, "repost receive failed: {e}; QP marked dead");
                    }
                    qp.stats.dead = true;
                }
            }
        }
    }

    /// Mark QPs that left RTS (rxe moves a QP to ERR on local errors) as dead.
    pub fn check_states(&mut self) {
        for qp in &mut self.qps {
            if self.connected && !qp.stats.dead && matches!(qp.qp.state(), QueuePairState::Error | QueuePairState::SendQueueError) {
                tracing::warn!(qpn = qp.stats.qpn, "QP in the error state: marked dead");
                qp.stats.dead = true;
            }
        }
    }

    /// Is QP `q` dead?
    pub fn is_dead(&self, q: usize) -> bool {
        self.qps.get(q).is_none_or(|q| q.stats.dead)
    }

    /// Counters of every QP.
    pub fn stats(&self) -> Vec<QpStats> {
        self.qps.iter().map(|q| q.stats.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_carry_qp_generation_and_slot_or_sequence() {
        assert_eq!(wr_parts(wr_id(15, 0, 4095)), (15, 0, 4095));
        assert_eq!(wr_parts(wr_id(0, 0, 0)), (0, 0, 0));
        let top = (super::super::RECV_DEPTH * 1024 - 1) as u32;
        assert_eq!(wr_parts(wr_id(1023, 0xffff, top)), (1023, 0xffff, top));
        assert_eq!(wr_parts(wr_id(7, 3, u32::MAX)), (7, 3, u32::MAX), "a full sequence number and the generation survive");
    }

    fn outs(first: u32, n: u32) -> VecDeque<Out> {
        (0..n).map(|i| Out { seq: first.wrapping_add(i), slot: i % 2 == 1, write_psn: None }).collect()
    }

    #[test]
    fn a_completion_completes_its_request_and_every_older_one() {
        let o = outs(10, 16);
        assert_eq!(completes(&o, 10), 1);
        assert_eq!(completes(&o, 25), 16, "the last one completes all");
        assert_eq!(completes(&o, 17), 8);
        assert_eq!(completes(&o, 26), 0, "not posted yet: nothing");
        assert_eq!(completes(&o, 9), 0, "already completed: nothing");
        assert_eq!(completes(&VecDeque::new(), 0), 0);
        // Across the wrap of the 32-bit sequence number.
        let w = outs(u32::MAX - 2, 6);
        assert_eq!(completes(&w, u32::MAX), 3);
        assert_eq!(completes(&w, 2), 6);
        assert_eq!(completes(&w, 3), 0);
    }
}
