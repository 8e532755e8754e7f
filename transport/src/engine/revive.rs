//! Re-creating dead verbs QPs in the background (pure: no I/O, no clock; times are passed in, in µs).
//!
//! A QP that got an error completion or went to the error state is dead. Once its rail's port is
//! active again, the side that saw it die resets it (RESET -> INIT, receives posted again, new PSN)
//! and sends a REQ with its (QPN, PSN) over a live QP of the connection. The peer resets its own QP
//! of the same (rail, entropy) too - a UC receiver may be wedged even when it saw no error - connects
//! it to ours (RTR, RTS) and answers with an ACK carrying its (QPN, PSN); the asker then connects its
//! QP and both are live again. proto finds the path alive with its next probe.
//!
//! REQs are sent again every [`RESEND_US`] until answered; an attempt not answered within
//! [`ATTEMPT_US`] fails and the next one waits [`MIN_BACKOFF_US`], doubling up to [`MAX_BACKOFF_US`].
//! When both sides ask at once, the connecting side's REQ wins: the accepting side drops its own
//! attempt and answers. The answerer remembers the last REQ it answered so that a duplicate gets the
//! same ACK rather than another reset.
//!
//! The packets are [`crate::wire::qp_ctl`]'s; [`classify`] also checks that one names a QP of the
//! connection.

use crate::wire::qp_ctl::{is_qp_ctl, QpCtlKind as CtlKind, QpCtlPacket, QpCtlRepr as QpCtl};

/// REQ sent again after this long without an ACK (µs).
pub(crate) const RESEND_US: u64 = 100_000;
/// An attempt fails when its REQ is not answered within this long (µs).
pub(crate) const ATTEMPT_US: u64 = 2_000_000;
/// Wait after the first failed attempt (µs); one attempt per QP per this long at most.
pub(crate) const MIN_BACKOFF_US: u64 = 500_000;
/// Longest wait between attempts (µs).
pub(crate) const MAX_BACKOFF_US: u64 = 8_000_000;

/// What a received packet is, as far as QP control goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QpCtlRx {
    /// Not a QP control packet (hand it on).
    NotCtl,
    /// A QP control packet that is malformed or names a QP that does not exist: drop and count.
    Bad,
    /// A valid one.
    Ctl(QpCtl),
}

/// Classify `b`, checking a QP control packet against this connection's `rails` and `paths` per rail.
pub(crate) fn classify(b: &[u8], rails: usize, paths: usize) -> QpCtlRx {
    if !is_qp_ctl(b) {
        return QpCtlRx::NotCtl;
    }
    match QpCtlPacket::new_checked(b).and_then(|p| QpCtl::parse(&p)) {
        Ok(c) if (c.rail as usize) < rails && (c.q as usize) < paths => QpCtlRx::Ctl(c),
        _ => QpCtlRx::Bad,
    }
}

/// Where one QP stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// In use (or never seen dead).
    Live,
    /// Dead; the next attempt may start at `next_try`.
    Dead { next_try: u64 },
    /// Our QP was reset and our REQ is out.
    Asking { epoch: u32, since: u64, last_sent: u64, qpn: u32, psn: u32 },
}

/// What the caller must do for a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Nothing,
    /// Reset our QP (to INIT, receives posted, new PSN), then call [`Revive::asking`] with its QPN
    /// and PSN (or [`Revive::failed`]).
    Reset,
    /// Send this packet on a live QP.
    Send(QpCtl),
    /// Reset our QP, connect it to the peer's `(qpn, psn)`, then call [`Revive::answered`] (or
    /// [`Revive::failed`]).
    ResetAndConnect {
        qpn: u32,
        psn: u32,
    },
    /// Connect our (reset) QP to the peer's `(qpn, psn)`, then call [`Revive::connected`] (or
    /// [`Revive::failed`]).
    Connect {
        qpn: u32,
        psn: u32,
    },
}

/// The re-creation state of one QP, identified by (rail, q).
#[derive(Debug, Clone)]
pub(crate) struct Revive {
    pub rail: u8,
    pub q: u16,
    pub state: State,
    backoff: u64,
    epoch: u32,
    /// The last REQ we answered: (peer's epoch, peer's PSN) and our ACK.
    answered: Option<(u32, u32, QpCtl)>,
    /// The newest peer epoch our own REQ won over: copies of it still on the way are stale.
    overruled: u32,
}

impl Revive {
    pub(crate) fn new(rail: u8, q: u16) -> Self {
        Self { rail, q, state: State::Live, backoff: MIN_BACKOFF_US, epoch: 0, answered: None, overruled: 0 }
    }

    /// Periodic step: `dead` = the QP is dead now, `port_active` = its rail's port is up (asked only
    /// when an attempt is due).
    pub(crate) fn tick(&mut self, now: u64, dead: bool, port_active: impl FnOnce() -> bool) -> Action {
        match self.state {
            State::Live if dead => {
                // First attempt as soon as the port is up.
                self.state = State::Dead { next_try: now };
                Action::Nothing
            }
            State::Live => Action::Nothing,
            State::Dead { .. } if !dead => {
                // Revived by a REQ the peer sent (answered elsewhere) - nothing to do.
                self.state = State::Live;
                Action::Nothing
            }
            State::Dead { next_try } if now >= next_try => {
                if port_active() {
                    Action::Reset
                } else {
                    // Look again in MIN_BACKOFF_US (a port that is down costs no backoff).
                    self.state = State::Dead { next_try: now + MIN_BACKOFF_US };
                    Action::Nothing
                }
            }
            State::Dead { .. } => Action::Nothing,
            State::Asking { since, .. } if now.saturating_sub(since) >= ATTEMPT_US => {
                self.fail(now);
                Action::Nothing
            }
            State::Asking { epoch, since, last_sent, qpn, psn } if now.saturating_sub(last_sent) >= RESEND_US => {
                self.state = State::Asking { epoch, since, last_sent: now, qpn, psn };
                Action::Send(self.req(epoch, qpn, psn))
            }
            State::Asking { .. } => Action::Nothing,
        }
    }

    fn req(&self, epoch: u32, qpn: u32, psn: u32) -> QpCtl {
        QpCtl { kind: CtlKind::Req, rail: self.rail, q: self.q, epoch, qpn, psn }
    }

    fn fail(&mut self, now: u64) {
        self.state = State::Dead { next_try: now + self.backoff };
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF_US);
    }

    /// Our QP was reset after [`Action::Reset`]: returns the REQ to send.
    pub(crate) fn asking(&mut self, now: u64, qpn: u32, psn: u32) -> QpCtl {
        self.epoch = self.epoch.wrapping_add(1).max(1);
        self.state = State::Asking { epoch: self.epoch, since: now, last_sent: now, qpn, psn };
        self.req(self.epoch, qpn, psn)
    }

    /// A reset, connect or answer failed: back off.
    pub(crate) fn failed(&mut self, now: u64) {
        self.fail(now);
    }

    /// We answered `req` with our QP `(qpn, psn)`: returns the ACK to send; the QP is live.
    pub(crate) fn answered(&mut self, req: &QpCtl, qpn: u32, psn: u32) -> QpCtl {
        let ack = QpCtl { kind: CtlKind::Ack, rail: self.rail, q: self.q, epoch: req.epoch, qpn, psn };
        self.answered = Some((req.epoch, req.psn, ack));
        self.state = State::Live;
        self.backoff = MIN_BACKOFF_US;
        ack
    }

    /// Our QP is connected after [`Action::Connect`]: it is live.
    pub(crate) fn connected(&mut self) {
        self.state = State::Live;
        self.backoff = MIN_BACKOFF_US;
    }

    /// A control packet for this QP arrived. `we_win`: our REQs take precedence when both sides ask.
    /// Returns the action and whether the packet was stale (ignored).
    pub(crate) fn on_ctl(&mut self, c: &QpCtl, we_win: bool) -> (Action, bool) {
        match c.kind {
            CtlKind::Req => {
                if let Some((e, p, ack)) = self.answered {
                    if e == c.epoch && p == c.psn {
                        return (Action::Send(ack), false);
                    }
                    if c.epoch <= e {
                        return (Action::Nothing, true);
                    }
                }
                if c.epoch <= self.overruled {
                    return (Action::Nothing, true);
                }
                if we_win && matches!(self.state, State::Asking { .. }) {
                    // The peer answers ours (and gives this attempt up: its next one has a newer
                    // epoch).
                    self.overruled = c.epoch;
                    return (Action::Nothing, true);
                }
                (Action::ResetAndConnect { qpn: c.qpn, psn: c.psn }, false)
            }
            CtlKind::Ack => match self.state {
                State::Asking { epoch, .. } if epoch == c.epoch => (Action::Connect { qpn: c.qpn, psn: c.psn }, false),
                _ => (Action::Nothing, true),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1000;

    #[test]
    fn packets_round_trip_and_bad_ones_are_told_apart() {
        let c = QpCtl { kind: CtlKind::Req, rail: 1, q: 15, epoch: 3, qpn: 0x11, psn: 0xab_cdef };
        let b = c.to_bytes();
        assert_eq!(classify(&b, 2, 16), QpCtlRx::Ctl(c));
        let a = QpCtl { kind: CtlKind::Ack, ..c };
        assert_eq!(classify(&a.to_bytes(), 2, 16), QpCtlRx::Ctl(a));
        assert_eq!(classify(&b, 1, 16), QpCtlRx::Bad, "rail out of range");
        assert_eq!(classify(&b, 2, 15), QpCtlRx::Bad, "entropy out of range");
        assert_eq!(classify(&b[..19], 2, 16), QpCtlRx::Bad, "short");
        let mut k = b;
        k[4] = 3;
        assert_eq!(classify(&k, 2, 16), QpCtlRx::Bad, "unknown kind");
        let mut p = b;
        p[16] = 1;
        assert_eq!(classify(&p, 2, 16), QpCtlRx::Bad, "PSN wider than 24 bits");
        assert_eq!(classify(&QpCtl { qpn: 0, ..c }.to_bytes(), 2, 16), QpCtlRx::Bad, "QPN 0");
        assert_eq!(classify(&QpCtl { epoch: 0, ..c }.to_bytes(), 2, 16), QpCtlRx::Bad, "epoch 0");
        // Other packets pass through: a proto packet starts with its version byte, FENCE with PFNC.
        assert_eq!(classify(&[1u8; 64], 2, 16), QpCtlRx::NotCtl);
        assert_eq!(classify(b"PFNC\x01\0\0\0\0\0\0\0\0\0\0\x05", 2, 16), QpCtlRx::NotCtl);
        assert_eq!(classify(b"PQ", 2, 16), QpCtlRx::NotCtl);
    }

    #[test]
    fn a_dead_qp_waits_for_its_port_then_asks_and_connects_on_the_ack() {
        let mut r = Revive::new(0, 3);
        assert_eq!(r.tick(0, false, || panic!("port asked while live")), Action::Nothing);
        assert_eq!(r.tick(10, true, || panic!("not yet due")), Action::Nothing);
        // Port down: no attempt, look again 500 ms later.
        assert_eq!(r.tick(20, true, || false), Action::Nothing);
        assert_eq!(r.tick(20 + 499 * MS, true, || panic!("rate limited")), Action::Nothing);
        assert_eq!(r.tick(20 + 500 * MS, true, || true), Action::Reset);
        let t = 20 + 500 * MS;
        let req = r.asking(t, 0x42, 77);
        assert_eq!(req, QpCtl { kind: CtlKind::Req, rail: 0, q: 3, epoch: 1, qpn: 0x42, psn: 77 });
        assert_eq!(r.tick(t + 50 * MS, true, || true), Action::Nothing);
        assert_eq!(r.tick(t + RESEND_US, true, || true), Action::Send(req), "resent");
        // A stale ACK (other epoch) is ignored; the right one connects.
        let stale = QpCtl { kind: CtlKind::Ack, epoch: 9, qpn: 0x99, psn: 1, ..req };
        assert_eq!(r.on_ctl(&stale, true), (Action::Nothing, true));
        let ack = QpCtl { kind: CtlKind::Ack, qpn: 0x99, psn: 5, ..req };
        assert_eq!(r.on_ctl(&ack, true), (Action::Connect { qpn: 0x99, psn: 5 }, false));
        r.connected();
        assert_eq!(r.state, State::Live);
        assert_eq!(r.on_ctl(&ack, true), (Action::Nothing, true), "duplicate ACK");
    }

    #[test]
    fn unanswered_attempts_back_off_exponentially() {
        let mut r = Revive::new(1, 0);
        r.tick(0, true, || true);
        let mut t = 0;
        let mut waits = Vec::new();
        for _ in 0..6 {
            // Wait until the next attempt is due.
            let mut s = t;
            while r.tick(s, true, || true) != Action::Reset {
                s += 10 * MS;
            }
            waits.push((s - t) / MS);
            r.asking(s, 0x10, 1);
            t = s + ATTEMPT_US;
            assert_eq!(r.tick(t, true, || true), Action::Nothing, "attempt times out");
            assert!(matches!(r.state, State::Dead { .. }));
        }
        assert_eq!(waits, vec![0, 500, 1000, 2000, 4000, 8000]);
        // Success resets the backoff.
        let mut s = t;
        while r.tick(s, true, || true) != Action::Reset {
            s += 10 * MS;
        }
        let req = r.asking(s, 0x10, 1);
        let ack = QpCtl { kind: CtlKind::Ack, ..req };
        assert!(matches!(r.on_ctl(&ack, false).0, Action::Connect { .. }));
        r.connected();
        r.tick(s + 1, true, || true);
        r.failed(s + 1);
        assert_eq!(r.state, State::Dead { next_try: s + 1 + MIN_BACKOFF_US });
    }

    #[test]
    fn the_peer_resets_on_a_req_even_when_live_and_repeats_its_ack_for_duplicates() {
        let mut r = Revive::new(0, 2);
        let req = QpCtl { kind: CtlKind::Req, rail: 0, q: 2, epoch: 4, qpn: 0x20, psn: 9 };
        assert_eq!(r.on_ctl(&req, false), (Action::ResetAndConnect { qpn: 0x20, psn: 9 }, false));
        let ack = r.answered(&req, 0x30, 11);
        assert_eq!(ack, QpCtl { kind: CtlKind::Ack, rail: 0, q: 2, epoch: 4, qpn: 0x30, psn: 11 });
        assert_eq!(r.on_ctl(&req, false), (Action::Send(ack), false), "duplicate REQ: same ACK, no reset");
        let older = QpCtl { epoch: 3, psn: 1, ..req };
        assert_eq!(r.on_ctl(&older, false), (Action::Nothing, true), "late older REQ ignored");
        let newer = QpCtl { epoch: 5, psn: 2, qpn: 0x21, ..req };
        assert_eq!(r.on_ctl(&newer, false), (Action::ResetAndConnect { qpn: 0x21, psn: 2 }, false));
    }

    /// Both ends' QP died and each asks at once: (connector, acceptor, the connector's REQ, the
    /// acceptor's REQ).
    fn both_asking() -> (Revive, Revive, QpCtl, QpCtl) {
        let mut conn = Revive::new(0, 0);
        let mut acc = Revive::new(0, 0);
        conn.tick(0, true, || true);
        acc.tick(0, true, || true);
        assert_eq!(conn.tick(0, true, || true), Action::Reset);
        assert_eq!(acc.tick(0, true, || true), Action::Reset);
        let req_c = conn.asking(0, 0x100, 1);
        let req_a = acc.asking(0, 0x200, 2);
        (conn, acc, req_c, req_a)
    }

    #[test]
    fn when_both_ask_the_connecting_side_wins() {
        let (mut conn, mut acc, req_c, req_a) = both_asking();
        // The connector ignores the acceptor's REQ; the acceptor answers the connector's.
        assert_eq!(conn.on_ctl(&req_a, true), (Action::Nothing, true));
        assert_eq!(acc.on_ctl(&req_c, false), (Action::ResetAndConnect { qpn: 0x100, psn: 1 }, false));
        let ack = acc.answered(&req_c, 0x200, 3);
        assert_eq!(acc.state, State::Live);
        assert_eq!(conn.on_ctl(&ack, true), (Action::Connect { qpn: 0x200, psn: 3 }, false));
        conn.connected();
        assert_eq!(conn.state, State::Live);
    }

    /// Both ends ask at once and the connector wins, but the acceptor's REQ was resent (every
    /// 100 ms while unanswered) and a copy is still on its way when the connector connects to the
    /// acceptor's ACK. That copy names the acceptor's QP as it was before it answered (its first
    /// PSN since changed: answering reset the QP again). The connector must not reset its freshly
    /// connected QP and connect it to that stale PSN: on RC both QPs then expect PSNs the other
    /// no longer sends, every WRITE is refused until both die again, and the acceptor ignores the
    /// connector's ACK (it is live), so the path stays down a whole extra re-creation cycle.
    #[test]
    fn a_late_copy_of_the_losing_req_does_not_reset_the_winner_again() {
        let (mut conn, mut acc, req_c, req_a) = both_asking();
        assert_eq!(acc.tick(RESEND_US, true, || true), Action::Send(req_a), "resent, unanswered");
        assert_eq!(conn.on_ctl(&req_a, true), (Action::Nothing, true));
        assert_eq!(acc.on_ctl(&req_c, false), (Action::ResetAndConnect { qpn: 0x100, psn: 1 }, false));
        let ack = acc.answered(&req_c, 0x200, 3);
        assert_eq!(conn.on_ctl(&ack, true), (Action::Connect { qpn: 0x200, psn: 3 }, false));
        conn.connected();
        // The resent copy arrives now.
        assert_eq!(conn.on_ctl(&req_a, true).0, Action::Nothing, "the winner re-created its live QP for a REQ the peer gave up");
        assert_eq!(conn.state, State::Live);
    }

    #[test]
    fn a_qp_revived_by_the_peer_leaves_the_dead_state() {
        let mut r = Revive::new(0, 0);
        r.tick(0, true, || false);
        assert!(matches!(r.state, State::Dead { .. }));
        assert_eq!(r.tick(1, false, || panic!("live")), Action::Nothing);
        assert_eq!(r.state, State::Live);
    }
}
