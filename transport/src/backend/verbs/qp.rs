//! The QPs of one connection on one rail ([`QpSet`]): creation, connection, posting WRITEs and
//! SENDs, reaping completions, pairing each DATA header with its WRITE, and reset for re-creation.

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
use super::{
    classify_header, flow_label, imm_of, match_header, udp_sport, PendingWrite, VerbsError, RC_RETRY, RC_TIMEOUT, RECV_DEPTH, SEND_SLOTS,
    SLOT_BYTES,
};

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
    /// DATA headers delivered with their payload in place.
    pub placed: u64,
    /// Other packets received.
    pub received: u64,
    /// WRITEs whose header never came (the next completion was not their header).
    pub orphan_writes: u64,
    /// DATA headers without their WRITE.
    pub orphan_headers: u64,
    /// Error completions.
    pub errors: u64,
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
    pending: Option<PendingWrite>,
    /// PSNs of the WRITEs posted and not yet completed locally, in posting order (a send queue
    /// completes in order).
    write_psns: std::collections::VecDeque<u64>,
    stats: QpStats,
}

/// What a receive completion brought.
pub enum RxEvent<'a> {
    /// A DATA header whose payload its WRITE already placed.
    Placed(&'a [u8]),
    /// Any other packet (CTS, SACK, control, payload-less DATA).
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

const KIND_WRITE: u64 = 0;
const KIND_SLOT: u64 = 1;

fn wr_id(q: usize, gen: u16, kind: u64, slot: usize) -> u64 {
    (u64::from(gen) << 48) | (((q as u64) & 0xffff) << 32) | (kind << 24) | slot as u64
}

/// (QP index, generation, kind, slot).
fn wr_parts(id: u64) -> (usize, u16, u64, usize) {
    (((id >> 32) & 0xffff) as usize, (id >> 48) as u16, (id >> 24) & 0xff, (id & 0xff_ffff) as usize)
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
    rc: bool,
    connected: bool,
    /// The peer's GID on this rail (known once connected).
    peer_gid: [u8; 16],
}

impl QpSet {
    /// Create `paths` QPs (UC, or RC when `rc`) in INIT with their receives posted; flow labels
    /// start at `fl_base`.
    pub fn new(dev: &Arc<VerbsDevice>, paths: u16, rc: bool, fl_base: u32) -> Result<Self, VerbsError> {
        let n = paths.max(1) as usize;
        let send_wr = (2 * SEND_SLOTS) as u32;
        let send_cq = vtry!(dev.ctx.create_cq_builder().setup_cqe(send_wr * n as u32).build(), "create send CQ")?;
        let recv_cq = vtry!(dev.ctx.create_cq_builder().setup_cqe((RECV_DEPTH * n) as u32).build(), "create recv CQ")?;
        let send_ring = Ring::new(dev, SEND_SLOTS * n)?;
        let recv_ring = Ring::new(dev, RECV_DEPTH * n)?;
        let mut qps = Vec::with_capacity(n);
        for i in 0..n {
            let mut b = dev.pd.create_qp_builder();
            b.setup_qp_type(if rc { QueuePairType::ReliableConnection } else { QueuePairType::UnreliableConnection })
                // UC has no RDMA READ: the default op flags make rxe refuse the QP (note G2).
                .setup_send_ops_flags(SendOperationFlags::Write | SendOperationFlags::WriteWithImmediate | SendOperationFlags::Send)
                .setup_max_send_wr(send_wr)
                .setup_max_recv_wr(RECV_DEPTH as u32)
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
            let stats = QpStats { qpn: qp.qp_number(), flow_label: fl, udp_sport: udp_sport(fl), ..QpStats::default() };
            let psn = rand::random::<u32>() & 0xFF_FFFF;
            qps.push(Qp {
                qp,
                psn,
                gen: 0,
                wrs_in_flight: 0,
                slots_in_flight: 0,
                next_slot: 0,
                pending: None,
                write_psns: std::collections::VecDeque::new(),
                stats,
            });
        }
        let mut set = Self { qps, send_cq, recv_cq, send_ring, recv_ring, dev: dev.clone(), rc, connected: false, peer_gid: [0; 16] };
        for q in 0..n {
            for s in 0..RECV_DEPTH {
                set.post_recv(q, q * RECV_DEPTH + s)?;
            }
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
        qp.pending = None;
        let drained: Vec<u64> = qp.write_psns.drain(..).collect();
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(1)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        vtry!(qp.qp.modify(&a), format!("QP {:#x} RESET->INIT", qp.stats.qpn))?;
        qp.psn = rand::random::<u32>() & 0xFF_FFFF;
        let (qpn, psn) = (qp.qp.qp_number(), qp.psn);
        for s in 0..RECV_DEPTH {
            self.post_recv(q, q * RECV_DEPTH + s)?;
        }
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

    fn post_recv(&mut self, q: usize, slot: usize) -> Result<(), VerbsError> {
        let addr = self.recv_ring.addr(slot);
        let lkey = self.recv_ring.mr.lkey();
        let gen = self.qps[q].gen;
        let qp = &mut self.qps[q].qp;
        let mut g = qp.start_post_recv();
        let h = g.construct_wr(wr_id(q, gen, KIND_SLOT, slot));
        // SAFETY: the slot lies inside the registered receive ring, which outlives the QP; each slot
        // is posted at most once at a time (reposted only after its completion was consumed).
        unsafe { h.setup_sge(lkey, addr, SLOT_BYTES as u32) };
        vtry!(g.post(), "post receive")
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
        if qp.wrs_in_flight + wrs > 2 * SEND_SLOTS || (slot && qp.slots_in_flight >= SEND_SLOTS) {
            qp.stats.sq_full += 1;
            return Err(PostFail::Full);
        }
        Ok(())
    }

    fn take_slot(&mut self, q: usize, bytes: &[u8]) -> usize {
        let qp = &mut self.qps[q];
        let slot = q * SEND_SLOTS + qp.next_slot;
        qp.next_slot = (qp.next_slot + 1) % SEND_SLOTS;
        self.send_ring.slot_mut(slot)[..bytes.len()].copy_from_slice(bytes);
        slot
    }

    /// Post a SEND of `bytes` (a whole control packet, or a payload-less DATA header) on QP `q`.
    pub fn post_send(&mut self, q: usize, bytes: &[u8]) -> Result<(), PostFail> {
        if bytes.len() > SLOT_BYTES {
            return Err(PostFail::TooBig);
        }
        self.check_postable(q, 1, true)?;
        let slot = self.take_slot(q, bytes);
        let addr = self.send_ring.addr(slot);
        let lkey = self.send_ring.mr.lkey();
        let qp = &mut self.qps[q];
        let mut g = qp.qp.start_post_send();
        let h = g.construct_wr(wr_id(q, qp.gen, KIND_SLOT, slot), WorkRequestFlags::Signaled).setup_send();
        // SAFETY: the slot is inside the registered send ring, which outlives the QP; it is not
        // reused before this WR's completion (slots_in_flight < SEND_SLOTS, completions are FIFO).
        unsafe { h.setup_sge(lkey, addr, bytes.len() as u32) };
        if let Err(e) = g.post() {
            tracing::warn!(qpn = qp.stats.qpn, "post send failed: {e}");
            qp.stats.errors += 1;
            return Err(PostFail::Dead);
        }
        qp.wrs_in_flight += 1;
        qp.slots_in_flight += 1;
        qp.stats.sends += 1;
        Ok(())
    }

    /// Post a DATA packet on QP `q`: WRITE WITH IMM of `len` bytes from `local` (registered, `lkey`)
    /// to `remote` (`rkey`), then a SEND of its 64-byte `header`. The caller checked the ranges.
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
        header: &[u8],
    ) -> Result<(), PostFail> {
        if header.len() > SLOT_BYTES {
            return Err(PostFail::TooBig);
        }
        self.check_postable(q, 2, true)?;
        let slot = self.take_slot(q, header);
        let haddr = self.send_ring.addr(slot);
        let ring_lkey = self.send_ring.mr.lkey();
        let qp = &mut self.qps[q];
        let mut g = qp.qp.start_post_send();
        let w =
            g.construct_wr(wr_id(q, qp.gen, KIND_WRITE, 0), WorkRequestFlags::Signaled).setup_write_imm(rkey, remote, imm_of(psn).to_be());
        // SAFETY: `local..local + len` lies in memory registered with `lkey` that the caller keeps
        // registered and unchanged until the send completes (the engine holds the registration for
        // the message's lifetime).
        unsafe { w.setup_sge(lkey, local, len) };
        let h = g.construct_wr(wr_id(q, qp.gen, KIND_SLOT, slot), WorkRequestFlags::Signaled).setup_send();
        // SAFETY: as in post_send.
        unsafe { h.setup_sge(ring_lkey, haddr, header.len() as u32) };
        if let Err(e) = g.post() {
            tracing::warn!(qpn = qp.stats.qpn, "post write failed: {e}");
            qp.stats.errors += 1;
            return Err(PostFail::Dead);
        }
        qp.wrs_in_flight += 2;
        qp.slots_in_flight += 1;
        qp.write_psns.push_back(psn);
        qp.stats.writes += 1;
        qp.stats.write_bytes += u64::from(len);
        qp.stats.sends += 1;
        Ok(())
    }

    /// Reap send completions (frees slots; an error completion kills its QP); `write_done` gets the
    /// PSN of every WRITE that completed (successfully or not: either way the NIC is done with it).
    pub fn poll_send(&mut self, mut write_done: impl FnMut(u64)) {
        loop {
            let Ok(poller) = self.send_cq.start_poll() else { return };
            let mut n = 0;
            for wc in poller {
                n += 1;
                let (q, gen, kind, _) = wr_parts(wc.wr_id());
                let Some(qp) = self.qps.get_mut(q) else { continue };
                if gen != qp.gen {
                    // Posted before a reset: already accounted for by reset_qp.
                    continue;
                }
                qp.wrs_in_flight = qp.wrs_in_flight.saturating_sub(1);
                if kind == KIND_SLOT {
                    qp.slots_in_flight = qp.slots_in_flight.saturating_sub(1);
                } else if let Some(psn) = qp.write_psns.pop_front() {
                    write_done(psn);
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

    /// Reap receive completions and hand each packet to `deliver` (then repost its slot).
    pub fn poll_recv(&mut self, mut deliver: impl FnMut(RxEvent<'_>)) {
        loop {
            let Ok(poller) = self.recv_cq.start_poll() else { return };
            let wcs: Vec<(u64, u32, u32, u32, u32)> =
                poller.map(|wc| (wc.wr_id(), wc.status(), wc.opcode(), wc.byte_len(), u32::from_be(wc.imm_data()))).collect();
            if wcs.is_empty() {
                return;
            }
            for (id, status, opcode, len, imm) in wcs {
                let (q, gen, _, slot) = wr_parts(id);
                if q >= self.qps.len() || slot >= RECV_DEPTH * self.qps.len() || gen != self.qps[q].gen {
                    // A receive posted before a reset (flushed): its slot was posted again then.
                    continue;
                }
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
                    if qp.pending.is_some() {
                        qp.stats.orphan_writes += 1;
                    }
                    qp.pending = Some(PendingWrite { psn_low: imm, len });
                } else if opcode == WorkCompletionOperationType::Receive as u32 {
                    let n = (len as usize).min(SLOT_BYTES);
                    let bytes = &self.recv_ring.slot(slot)[..n];
                    let qp = &mut self.qps[q];
                    match classify_header(bytes) {
                        Some((psn, plen)) if plen > 0 => {
                            let pending = qp.pending.take();
                            if match_header(pending, psn, plen) {
                                qp.stats.placed += 1;
                                deliver(RxEvent::Placed(bytes));
                            } else {
                                if pending.is_some() {
                                    qp.stats.orphan_writes += 1;
                                }
                                qp.stats.orphan_headers += 1;
                            }
                        }
                        _ => {
                            qp.stats.received += 1;
                            deliver(RxEvent::Packet(bytes));
                        }
                    }
                }
                if let Err(e) = self.post_recv(q, slot) {
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
    fn wr_ids_carry_qp_kind_and_slot() {
        assert_eq!(wr_parts(wr_id(15, 0, KIND_SLOT, 4095)), (15, 0, KIND_SLOT, 4095));
        assert_eq!(wr_parts(wr_id(0, 0, KIND_WRITE, 0)), (0, 0, KIND_WRITE, 0));
        assert_eq!(wr_parts(wr_id(1023, 0xffff, KIND_SLOT, RECV_DEPTH * 1024 - 1)), (1023, 0xffff, KIND_SLOT, RECV_DEPTH * 1024 - 1));
        assert_eq!(wr_parts(wr_id(7, 3, KIND_WRITE, 0)).1, 3, "the generation survives");
    }
}
