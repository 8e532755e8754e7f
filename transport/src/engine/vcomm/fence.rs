//! FENCE (verbs): a receive completes only once the sender said that none of its WRITEs to the
//! buffer can still land (the packet is [`crate::wire::fence`]). The sender sends one per buffer
//! once the WRITEs of a completed send left its queues; the receiver holds the receive until its
//! FENCEs came, asks again after 20 ms and gives up after 2 s.

use crate::proto::MsgId;
use crate::wire::{FenceKind, FencePacket, FenceRepr};

use super::VerbsComm;

/// The receiver asks again for a FENCE it has waited this long for (µs).
const FENCE_REQ_US: u64 = 20_000;
/// ... and gives up waiting after this long (µs): a peer that answers nothing writes nothing either.
const FENCE_GIVE_UP_US: u64 = 2_000_000;
/// FENCEs the sender remembers (to answer repeated requests).
const FENCES_KEPT: usize = 4096;

/// The FENCE in `b`, or None when `b` is not a (well-formed) FENCE.
pub(super) fn parse_fence(b: &[u8]) -> Option<FenceRepr> {
    FencePacket::new_checked(b).and_then(|p| FenceRepr::parse(&p)).ok()
}

/// A receive proto finished whose completion waits for the sender's FENCEs.
pub(super) struct Held {
    msg: MsgId,
    sizes: Vec<u64>,
    need: Vec<(u64, u8)>,
    since: u64,
    asked: u64,
}

impl VerbsComm {
    /// A WRITE of `psn` left the send queue.
    pub(super) fn write_done(&mut self, psn: u64) {
        let Some(n) = self.writes_out.get_mut(&psn) else { return };
        *n -= 1;
        if *n > 0 {
            return;
        }
        self.writes_out.remove(&psn);
        let Some(t) = self.psn_target.remove(&psn) else { return };
        let left = self.writes_to.get_mut(&t).map(|n| {
            *n -= 1;
            *n
        });
        if left == Some(0) {
            self.writes_to.remove(&t);
            if self.fence_wait.remove(&t) {
                self.fence(t);
                if let Some(m) = self.release_later.remove(&t) {
                    self.release_now(m);
                }
            }
        }
    }

    /// Tell the receiver that no WRITE into buffer `t` is left on this side.
    pub(super) fn fence(&mut self, t: (u64, u8)) {
        self.fenced.push_back(t);
        while self.fenced.len() > FENCES_KEPT {
            self.fenced.pop_front();
        }
        self.fence_out.push_back(FenceRepr { kind: FenceKind::Fence, cts_seq: t.0, sub: t.1 });
    }

    /// Proto completed send `msg` (every byte acknowledged): its FENCE goes out once none of its
    /// WRITEs is left in a send queue.
    pub fn sent(&mut self, msg: MsgId) {
        let Some(t) = self.msg_target.remove(&msg) else { return };
        if self.writes_to.get(&t).is_some_and(|&n| n > 0) {
            self.fence_wait.insert(t);
            self.release_later.insert(t, msg);
        } else {
            self.fence(t);
        }
    }

    /// Proto completed receive `msg`: `Some(sizes)` to report now, or `None` while a FENCE from the
    /// sender is missing (a stale WRITE could still land; the buffer must not go back to NCCL yet).
    pub fn received(&mut self, msg: MsgId, sizes: Vec<u64>, now: u64) -> Option<Vec<u64>> {
        let Some(cts_seq) = self.recv_seq.iter().find(|(_, m)| **m == msg).map(|(s, _)| *s) else { return Some(sizes) };
        let need: Vec<(u64, u8)> = sizes
            .iter()
            .enumerate()
            .filter(|&(_, &n)| n > 0)
            .map(|(i, _)| (cts_seq, i as u8))
            .filter(|t| !self.fences_got.remove(t))
            .collect();
        if need.is_empty() {
            return Some(sizes);
        }
        self.counters.receives_held += 1;
        self.held.push(Held { msg, sizes, need, since: now, asked: now });
        None
    }

    /// Held receives whose FENCEs arrived (or that waited too long); asks again for missing ones.
    pub fn released(&mut self, now: u64) -> Vec<(MsgId, Vec<u64>)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.held.len() {
            let h = &mut self.held[i];
            let got = &mut self.fences_got;
            h.need.retain(|t| !got.remove(t));
            let give_up = now.saturating_sub(h.since) > FENCE_GIVE_UP_US;
            if h.need.is_empty() || give_up {
                if give_up && !h.need.is_empty() {
                    self.counters.fence_give_ups += 1;
                    tracing::warn!(cts_seq = h.need[0].0, "no FENCE from the sender after 2 s: completing the receive anyway");
                }
                let h = self.held.swap_remove(i);
                out.push((h.msg, h.sizes));
                continue;
            }
            if now.saturating_sub(h.asked) > FENCE_REQ_US {
                h.asked = now;
                for &(c, s) in &h.need {
                    self.fence_out.push_back(FenceRepr { kind: FenceKind::Request, cts_seq: c, sub: s });
                    self.counters.fence_requests += 1;
                }
            }
            i += 1;
        }
        out
    }

    /// Send queued FENCE packets on a live QP (rotating over rails and QPs).
    pub(super) fn flush_fences(&mut self) {
        while let Some(f) = self.fence_out.front().copied() {
            let posted = self.post_on_live_qp(&f.to_bytes());
            if !posted {
                return;
            }
            if f.kind == FenceKind::Fence {
                self.counters.fences_sent += 1;
            }
            self.fence_out.pop_front();
        }
    }
}
