//! FENCE (verbs): a receive completes only once the sender said that none of its WRITEs to the
//! buffer can still land (the packet is [`crate::wire::fence`]). The sender sends one per buffer
//! once the WRITEs of a completed send left its queues; the receiver holds the receive until its
//! FENCEs came, asks again after 20 ms (or twice the usual wait for a FENCE, when that is longer: a
//! slow peer is not flooded with requests) and gives up after 2 s.
//!
//! The bookkeeping ([`Fences`]) is pure (no device, no clock of its own), so the guarantee is tested
//! here: with a retransmission posted only once every older copy of its PSN left the send queue,
//! and a FENCE only once every WRITE to its buffer left it, a receive is never completed (its buffer
//! never goes back to NCCL) while a WRITE into that buffer, first copy or retransmission, is still
//! queued at the sender. What the FENCE cannot see: a WRITE that left the send queue is on the wire
//! (UC) or acknowledged (RC); on UC the FENCE, a SEND on another QP, could overtake such a WRITE on
//! a path slower by more than the FENCE's own trip (and a receive given up after 2 s has no FENCE).

use std::collections::{HashMap, HashSet, VecDeque};

use crate::proto::MsgId;
use crate::wire::{FenceKind, FencePacket, FenceRepr};

use super::{VerbsComm, VerbsCounters};

/// The receiver asks again for a FENCE it has waited this long for (µs).
const FENCE_REQ_US: u64 = 20_000;
/// ... and gives up waiting after this long (µs): a peer that answers nothing writes nothing either.
const FENCE_GIVE_UP_US: u64 = 2_000_000;
/// The receiver never waits longer than this before asking again (µs).
const FENCE_REQ_MAX_US: u64 = 500_000;
/// FENCEs the sender remembers (to answer repeated requests).
const FENCES_KEPT: usize = 4096;

/// The FENCE in `b`, or None when `b` is not a (well-formed) FENCE.
pub(super) fn parse_fence(b: &[u8]) -> Option<FenceRepr> {
    FencePacket::new_checked(b).and_then(|p| FenceRepr::parse(&p)).ok()
}

/// A receive proto finished whose completion waits for the sender's FENCEs.
struct Held {
    msg: MsgId,
    sizes: Vec<u64>,
    need: Vec<(u64, u8)>,
    since: u64,
    asked: u64,
}

/// A receive buffer: (CTS sequence number, index within the grouped receive).
pub(super) type Target = (u64, u8);

/// FENCE bookkeeping of one comm, both directions.
#[derive(Default)]
pub(super) struct Fences {
    /// WRITEs per PSN posted and not completed locally. A retransmission waits until none is left:
    /// an older copy still queued could otherwise land after the receive completed and its buffer was
    /// reused (an RDMA WRITE is placed before anybody can check it).
    writes_out: HashMap<u64, u32>,
    /// Sender: the buffer each outstanding PSN writes into, WRITEs left per buffer, the buffer of
    /// each send, buffers whose FENCE waits for their WRITEs, FENCEs sent.
    psn_target: HashMap<u64, Target>,
    writes_to: HashMap<Target, u32>,
    msg_target: HashMap<MsgId, Target>,
    fence_wait: HashSet<Target>,
    fenced: VecDeque<Target>,
    /// FENCEs and FENCE requests to send.
    pub(super) out: VecDeque<FenceRepr>,
    /// Sends done whose registrations wait for their last WRITE to leave the send queue.
    release_later: HashMap<Target, MsgId>,
    /// Receiver: FENCEs received, and the receives waiting for theirs.
    got: HashSet<Target>,
    held: Vec<Held>,
    /// Smoothed wait of held receives for their FENCEs (µs; 0 before the first).
    wait_us: u64,
}

impl Fences {
    /// May a retransmission of `psn` be posted as a WRITE now (no older copy is queued)?
    pub(super) fn may_write_again(&self, psn: u64) -> bool {
        !self.writes_out.contains_key(&psn)
    }

    /// A WRITE of `psn` (send `msg`) into buffer `t` was queued.
    pub(super) fn posted(&mut self, psn: u64, t: Target, msg: MsgId) {
        *self.writes_out.entry(psn).or_insert(0) += 1;
        if self.psn_target.insert(psn, t).is_none() {
            *self.writes_to.entry(t).or_insert(0) += 1;
        }
        self.msg_target.insert(msg, t);
    }

    /// A WRITE of `psn` left the send queue. Returns a send whose registrations may go now.
    pub(super) fn write_done(&mut self, psn: u64) -> Option<MsgId> {
        let n = self.writes_out.get_mut(&psn)?;
        *n -= 1;
        if *n > 0 {
            return None;
        }
        self.writes_out.remove(&psn);
        let t = self.psn_target.remove(&psn)?;
        let left = self.writes_to.get_mut(&t).map(|n| {
            *n -= 1;
            *n
        });
        if left == Some(0) {
            self.writes_to.remove(&t);
            if self.fence_wait.remove(&t) {
                self.fence(t);
                return self.release_later.remove(&t);
            }
        }
        None
    }

    /// Tell the receiver that no WRITE into buffer `t` is left on this side.
    fn fence(&mut self, t: Target) {
        self.fenced.push_back(t);
        while self.fenced.len() > FENCES_KEPT {
            self.fenced.pop_front();
        }
        self.out.push_back(FenceRepr { kind: FenceKind::Fence, cts_seq: t.0, sub: t.1 });
    }

    /// Proto completed send `msg` (every byte acknowledged): its FENCE goes out once none of its
    /// WRITEs is left in a send queue (then its registrations may go too).
    pub(super) fn sent(&mut self, msg: MsgId) {
        let Some(t) = self.msg_target.remove(&msg) else { return };
        if self.writes_to.get(&t).is_some_and(|&n| n > 0) {
            self.fence_wait.insert(t);
            self.release_later.insert(t, msg);
        } else {
            self.fence(t);
        }
    }

    /// Must send `msg`'s registrations stay (a WRITE of it is still queued)?
    pub(super) fn keeps(&self, msg: MsgId) -> bool {
        self.release_later.values().any(|m| *m == msg)
    }

    /// Forget the sends waiting for their WRITEs (the QPs are gone).
    pub(super) fn clear_release_later(&mut self) {
        self.release_later.clear();
    }

    /// A FENCE or FENCE request from the peer.
    pub(super) fn on_packet(&mut self, f: FenceRepr, counters: &mut VerbsCounters) {
        let t = (f.cts_seq, f.sub);
        if f.kind == FenceKind::Fence {
            counters.fences_received += 1;
            self.got.insert(t);
        } else if self.fenced.contains(&t) {
            self.out.push_back(FenceRepr { kind: FenceKind::Fence, cts_seq: t.0, sub: t.1 });
        }
    }

    /// Proto completed receive `msg` (CTS `cts_seq`, None when unknown): `Some(sizes)` to report
    /// now, or `None` while a FENCE from the sender is missing (a stale WRITE could still land; the
    /// buffer must not go back to NCCL yet).
    pub(super) fn received(
        &mut self,
        msg: MsgId,
        cts_seq: Option<u64>,
        sizes: Vec<u64>,
        now: u64,
        counters: &mut VerbsCounters,
    ) -> Option<Vec<u64>> {
        let Some(cts_seq) = cts_seq else { return Some(sizes) };
        let need: Vec<Target> =
            sizes.iter().enumerate().filter(|&(_, &n)| n > 0).map(|(i, _)| (cts_seq, i as u8)).filter(|t| !self.got.remove(t)).collect();
        if need.is_empty() {
            return Some(sizes);
        }
        counters.receives_held += 1;
        self.held.push(Held { msg, sizes, need, since: now, asked: now });
        None
    }

    /// Held receives whose FENCEs arrived (or that waited too long); asks again for missing ones.
    pub(super) fn released(&mut self, now: u64, counters: &mut VerbsCounters) -> Vec<(MsgId, Vec<u64>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.held.len() {
            let h = &mut self.held[i];
            let got = &mut self.got;
            h.need.retain(|t| !got.remove(t));
            let give_up = now.saturating_sub(h.since) > FENCE_GIVE_UP_US;
            if h.need.is_empty() {
                // How long a FENCE takes here (7/8 smoothing; give-ups do not count).
                let w = now.saturating_sub(h.since);
                self.wait_us = if self.wait_us == 0 { w } else { (7 * self.wait_us + w) / 8 };
            }
            if h.need.is_empty() || give_up {
                if give_up && !h.need.is_empty() {
                    counters.fence_give_ups += 1;
                    tracing::warn!(cts_seq = h.need[0].0, "no FENCE from the sender after 2 s: completing the receive anyway");
                }
                let h = self.held.swap_remove(i);
                out.push((h.msg, h.sizes));
                continue;
            }
            if now.saturating_sub(h.asked) > FENCE_REQ_US.max(2 * self.wait_us).min(FENCE_REQ_MAX_US) {
                h.asked = now;
                for &(c, s) in &h.need {
                    self.out.push_back(FenceRepr { kind: FenceKind::Request, cts_seq: c, sub: s });
                    counters.fence_requests += 1;
                }
            }
            i += 1;
        }
        out
    }
}

impl VerbsComm {
    /// A WRITE of `psn` left the send queue.
    pub(super) fn write_done(&mut self, psn: u64) {
        if let Some(m) = self.fences.write_done(psn) {
            self.release_now(m);
        }
    }

    /// Proto completed send `msg`.
    pub fn sent(&mut self, msg: MsgId) {
        self.fences.sent(msg);
    }

    /// Proto completed receive `msg`: `Some(sizes)` to report now, `None` while its FENCE is missing.
    pub fn received(&mut self, msg: MsgId, sizes: Vec<u64>, now: u64) -> Option<Vec<u64>> {
        let cts_seq = self.recv_seq.iter().find(|(_, m)| **m == msg).map(|(s, _)| *s);
        self.fences.received(msg, cts_seq, sizes, now, &mut self.counters)
    }

    /// Held receives whose FENCEs arrived (or that waited too long); asks again for missing ones.
    pub fn released(&mut self, now: u64) -> Vec<(MsgId, Vec<u64>)> {
        self.fences.released(now, &mut self.counters)
    }

    /// Send queued FENCE packets on a live QP (rotating over rails and QPs).
    pub(super) fn flush_fences(&mut self) {
        while let Some(f) = self.fences.out.front().copied() {
            let posted = self.post_on_live_qp(&f.to_bytes());
            if !posted {
                return;
            }
            if f.kind == FenceKind::Fence {
                self.counters.fences_sent += 1;
            }
            self.fences.out.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Target = (4, 0);
    const SEND: MsgId = MsgId(1);
    const RECV: MsgId = MsgId(2);

    fn fence_of(t: Target) -> FenceRepr {
        FenceRepr { kind: FenceKind::Fence, cts_seq: t.0, sub: t.1 }
    }

    /// The case the FENCE exists for, step by step: PSN 7's first WRITE sits in a slow send queue,
    /// proto resends it, the first copy arrives and both ends' proto are done. The receive must not
    /// go back to NCCL before the retransmission left the sender's queue.
    #[test]
    fn a_late_retransmission_cannot_land_in_a_reused_receive_buffer() {
        let mut c = VerbsCounters::default();
        let (mut tx, mut rx) = (Fences::default(), Fences::default());
        tx.posted(7, B, SEND);
        assert!(!tx.may_write_again(7), "no second WRITE while the first is queued");
        assert_eq!(tx.write_done(7), None);
        assert!(tx.may_write_again(7));
        tx.posted(7, B, SEND);
        // The first copy arrived: the receiver's proto completes, the SACK completes the send.
        assert_eq!(rx.received(RECV, Some(4), vec![100], 0, &mut c), None, "held until the FENCE");
        tx.sent(SEND);
        assert!(tx.keeps(SEND), "the send buffer stays registered while its WRITE is queued");
        assert!(tx.out.is_empty(), "no FENCE while the retransmission is queued");
        // The receiver asks again after 20 ms; the sender has nothing to answer yet.
        assert!(rx.released(FENCE_REQ_US + 1, &mut c).is_empty());
        let asks: Vec<FenceRepr> = rx.out.drain(..).collect();
        assert_eq!(asks, vec![FenceRepr { kind: FenceKind::Request, cts_seq: 4, sub: 0 }]);
        for f in asks {
            tx.on_packet(f, &mut c);
        }
        assert!(tx.out.is_empty());
        // The retransmission left the queue: FENCE, and the send's registrations may go.
        assert_eq!(tx.write_done(7), Some(SEND));
        let fences: Vec<FenceRepr> = tx.out.drain(..).collect();
        assert_eq!(fences, vec![fence_of(B)]);
        for f in fences {
            rx.on_packet(f, &mut c);
        }
        assert_eq!(rx.released(FENCE_REQ_US + 2, &mut c), vec![(RECV, vec![100])]);
        assert_eq!((c.receives_held, c.fence_requests, c.fences_received, c.fence_give_ups), (1, 1, 1, 0));
    }

    /// A FENCE that came before proto completed the receive lets it complete at once; a request
    /// for a buffer already fenced is answered again (the first FENCE was lost).
    #[test]
    fn an_early_fence_counts_and_a_repeated_request_is_answered() {
        let mut c = VerbsCounters::default();
        let (mut tx, mut rx) = (Fences::default(), Fences::default());
        tx.posted(1, B, SEND);
        tx.write_done(1);
        tx.sent(SEND);
        let f: Vec<FenceRepr> = tx.out.drain(..).collect();
        assert_eq!(f, vec![fence_of(B)]);
        tx.on_packet(FenceRepr { kind: FenceKind::Request, cts_seq: 4, sub: 0 }, &mut c);
        assert_eq!(tx.out.drain(..).collect::<Vec<_>>(), vec![fence_of(B)]);
        rx.on_packet(f[0], &mut c);
        assert_eq!(rx.received(RECV, Some(4), vec![100, 0], 0, &mut c), Some(vec![100, 0]), "empty buffers need none");
    }

    /// A peer whose FENCEs take 50 ms is asked again only after twice that, not every 20 ms.
    #[test]
    fn the_receiver_asks_again_after_twice_the_usual_wait() {
        let mut c = VerbsCounters::default();
        let mut rx = Fences::default();
        for i in 0..20u64 {
            let t0 = i * 1_000_000;
            assert_eq!(rx.received(RECV, Some(i), vec![1], t0, &mut c), None);
            assert!(rx.released(t0 + 30_000, &mut c).is_empty());
            rx.on_packet(FenceRepr { kind: FenceKind::Fence, cts_seq: i, sub: 0 }, &mut c);
            assert_eq!(rx.released(t0 + 50_000, &mut c).len(), 1);
            rx.out.clear();
        }
        assert!(c.fence_requests >= 1, "the first waits asked after 20 ms");
        let asked = c.fence_requests;
        let t0 = 100_000_000;
        assert_eq!(rx.received(RECV, Some(99), vec![1], t0, &mut c), None);
        assert!(rx.released(t0 + 60_000, &mut c).is_empty());
        assert_eq!(c.fence_requests, asked, "no request before twice the usual wait");
        assert!(rx.released(t0 + 110_000, &mut c).is_empty());
        assert_eq!(c.fence_requests, asked + 1);
    }

    /// Tiny deterministic generator (no dependency, same sequence on every run).
    struct Lcg(u64);
    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 33) % n.max(1)
        }
    }

    /// One buffer, `PSNS` packets, random interleavings of: a queued WRITE copy leaving the send
    /// queue (and landing, or lost), proto resending an unacknowledged PSN (also spuriously), SACKs,
    /// FENCE traffic (either way, delayed or lost) and the receiver's timers; simulated time stays
    /// under the 2 s give-up. Returns how many copies landed after the receive went back to NCCL
    /// (`honest` false: the sender ignores `may_write_again`, to show the check can fail) and
    /// whether the receive completed.
    fn simulate(seed: u64, honest: bool) -> (u32, bool) {
        const PSNS: u64 = 6;
        let mut g = Lcg(seed);
        let mut c = VerbsCounters::default();
        let (mut tx, mut rx) = (Fences::default(), Fences::default());
        let mut queued: Vec<u64> = Vec::new();
        let mut arrived = [false; PSNS as usize];
        let mut acked = [false; PSNS as usize];
        let (mut proto_recv_done, mut proto_send_done, mut released) = (false, false, false);
        let mut late = 0;
        let mut to_rx: Vec<FenceRepr> = Vec::new();
        let mut to_tx: Vec<FenceRepr> = Vec::new();
        for p in 0..PSNS {
            tx.posted(p, B, SEND);
            queued.push(p);
        }
        let mut now = 0u64;
        for _ in 0..3000 {
            now += 500;
            match g.below(6) {
                0 if !queued.is_empty() => {
                    let p = queued.remove(g.below(queued.len() as u64) as usize);
                    if honest {
                        tx.write_done(p);
                    } else {
                        // A broken sender accounts for nothing: no FENCE ever waits.
                        tx.writes_out.remove(&p);
                        tx.writes_to.remove(&B);
                    }
                    if g.below(4) > 0 {
                        if released {
                            late += 1;
                        }
                        arrived[p as usize] = true;
                    }
                }
                1 => {
                    let p = g.below(PSNS);
                    if !acked[p as usize] && (!honest || tx.may_write_again(p)) {
                        tx.posted(p, B, SEND);
                        queued.push(p);
                    }
                }
                2 => {
                    acked = arrived;
                    if acked.iter().all(|&a| a) && !proto_send_done {
                        proto_send_done = true;
                        tx.sent(SEND);
                        if !honest {
                            tx.fence(B);
                        }
                    }
                }
                3 => {
                    to_rx.extend(tx.out.drain(..));
                    to_tx.extend(rx.out.drain(..));
                }
                4 => {
                    for f in std::mem::take(&mut to_rx) {
                        if g.below(5) > 0 {
                            rx.on_packet(f, &mut c);
                        }
                    }
                    for f in std::mem::take(&mut to_tx) {
                        if g.below(5) > 0 {
                            tx.on_packet(f, &mut c);
                        }
                    }
                }
                _ => {}
            }
            if arrived.iter().all(|&a| a) && !proto_recv_done {
                proto_recv_done = true;
                released |= rx.received(RECV, Some(B.0), vec![PSNS * 100], now, &mut c).is_some();
            }
            released |= !rx.released(now, &mut c).is_empty();
        }
        assert!(now < FENCE_GIVE_UP_US, "the simulation must not reach the give-up");
        (late, released)
    }

    #[test]
    fn no_write_lands_after_the_receive_completed_in_any_interleaving() {
        let mut completed = 0;
        for seed in 0..500 {
            let (late, released) = simulate(seed, true);
            assert_eq!(late, 0, "seed {seed}: a WRITE landed in a buffer NCCL had back");
            completed += u32::from(released);
        }
        assert!(completed > 400, "only {completed} of 500 receives completed: the model is too lossy to test anything");
        let broken: u32 = (0..500).map(|seed| simulate(seed, false).0).sum();
        assert!(broken > 0, "the check never catches a sender that ignores the rules");
    }
}
