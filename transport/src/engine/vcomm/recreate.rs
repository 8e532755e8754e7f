//! Re-creating dead QPs (verbs): `revive` decides, this carries it out on the comm's QPs and sends
//! the QP control packets ([`crate::wire::qp_ctl`]) over a live QP.

use super::super::revive::Action;
use super::VerbsComm;
use crate::backend::verbs::VerbsError;
use crate::proto::Connection;
use crate::wire::QpCtlRepr;

impl VerbsComm {
    /// Step every QP's re-creation (see `revive`): dead QPs whose port is up are reset and asked
    /// for; unanswered REQs are resent; attempts time out.
    pub(super) fn revive_tick(&mut self, now: u64, conn: &Connection) {
        let paths = self.paths as usize;
        for r in 0..self.rails.len() {
            let mut port: Option<bool> = None;
            let mut any_dead = false;
            for q in 0..paths {
                let dead = self.rails[r].is_dead(q);
                any_dead |= dead;
                let set = &self.rails[r];
                let active = || *port.get_or_insert_with(|| set.port_active());
                let act = self.revive[r * paths + q].tick(now, dead, active);
                match act {
                    Action::Reset => self.start_recreate(r, q, now),
                    Action::Send(c) => self.ctl_out.push_back(c.to_bytes()),
                    _ => {}
                }
            }
            if any_dead != self.rail_reviving[r] {
                self.rail_reviving[r] = any_dead;
                let dev = &self.rails[r].device().name;
                if any_dead {
                    let n = (0..paths).filter(|&q| self.rails[r].is_dead(q)).count();
                    tracing::info!(rail = r, %dev, "{n} of {paths} QPs dead: re-creating them in the background once the port is active");
                } else {
                    tracing::info!(rail = r, %dev, "all {paths} QPs live again (re-created so far on this comm: {})", self.counters.qp_recreated);
                }
            }
        }
        self.flush_ctl(conn);
    }

    /// Reset QP `q` of rail `r` to a fresh one (its QPN and PSN returned); the WRITEs it still had
    /// outstanding are finished as the reset drained them.
    pub(super) fn reset_qp(&mut self, r: usize, q: usize) -> Result<(u32, u32), VerbsError> {
        let (qpn, psn, drained) = self.rails[r].reset_qp(q)?;
        for p in drained {
            self.write_done(p);
        }
        Ok((qpn, psn))
    }

    pub(super) fn start_recreate(&mut self, r: usize, q: usize, now: u64) {
        let i = r * self.paths as usize + q;
        match self.reset_qp(r, q) {
            Ok((qpn, psn)) => {
                let req = self.revive[i].asking(now, qpn, psn);
                self.ctl_out.push_back(req.to_bytes());
            }
            Err(e) => {
                tracing::debug!(rail = r, q, "QP reset failed: {e}");
                self.counters.qp_recreate_failed += 1;
                self.revive[i].failed(now);
            }
        }
    }

    /// A REQ or ACK from the peer.
    pub(super) fn on_ctl(&mut self, c: &QpCtlRepr, now: u64) {
        let (r, q) = (c.rail as usize, c.q as usize);
        let i = r * self.paths as usize + q;
        let (act, stale) = self.revive[i].on_ctl(c, self.connector);
        if stale {
            self.counters.qp_ctl_dropped += 1;
        }
        match act {
            Action::Send(a) => self.ctl_out.push_back(a.to_bytes()),
            Action::ResetAndConnect { qpn, psn } => {
                let res = self.reset_qp(r, q).and_then(|(lqpn, lpsn)| self.rails[r].reconnect_qp(q, qpn, psn).map(|()| (lqpn, lpsn)));
                match res {
                    Ok((lqpn, lpsn)) => {
                        self.counters.qp_recreated += 1;
                        let ack = self.revive[i].answered(c, lqpn, lpsn);
                        self.ctl_out.push_back(ack.to_bytes());
                    }
                    Err(e) => {
                        tracing::debug!(rail = r, q, "QP re-creation for the peer failed: {e}");
                        self.counters.qp_recreate_failed += 1;
                        self.revive[i].failed(now);
                    }
                }
            }
            Action::Connect { qpn, psn } => match self.rails[r].reconnect_qp(q, qpn, psn) {
                Ok(()) => {
                    self.counters.qp_recreated += 1;
                    self.revive[i].connected();
                }
                Err(e) => {
                    tracing::debug!(rail = r, q, "connecting the re-created QP failed: {e}");
                    self.counters.qp_recreate_failed += 1;
                    self.revive[i].failed(now);
                }
            },
            Action::Reset | Action::Nothing => {}
        }
    }

    /// Post `bytes` as a SEND on the next live QP, rotating over rails and QPs, one whose path `conn`
    /// trusts first; false if none took it.
    pub(super) fn post_on_live_qp(&mut self, bytes: &[u8], conn: &Connection) -> bool {
        self.post_rotating(0, self.rails.len() * self.paths as usize, bytes, conn)
    }

    /// Post `bytes` as a SEND on a live QP of rail `r`, rotating over its QPs, one whose path `conn`
    /// trusts first; false if none took it.
    pub(super) fn post_on_rail(&mut self, r: usize, bytes: &[u8], conn: &Connection) -> bool {
        let paths = self.paths as usize;
        self.post_rotating(r * paths, paths, bytes, conn)
    }

    /// Post `bytes` on the QP of one of the `n` entropies from `first`, rotating: first one whose path
    /// `conn` would send new packets on now (a QP that merely has no error can sit on a black-holed
    /// path, and a FENCE or its request lost there held a receive for its whole 2 s), else any live
    /// one; false if none took it.
    fn post_rotating(&mut self, first: usize, n: usize, bytes: &[u8], conn: &Connection) -> bool {
        let paths = self.paths as usize;
        for healthy_only in [true, false] {
            for _ in 0..n {
                let k = first + self.fence_rr % n;
                self.fence_rr = self.fence_rr.wrapping_add(1);
                let (r, q) = (k / paths, k % paths);
                if healthy_only && !conn.path_preferred(k as u16) {
                    continue;
                }
                if !self.rails[r].is_dead(q) && self.rails[r].post_send(q, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    }

    /// Send queued QP control packets on live QPs (rotating; a lost one is resent by its timer).
    pub(super) fn flush_ctl(&mut self, conn: &Connection) {
        while let Some(c) = self.ctl_out.front().copied() {
            let posted = self.post_on_live_qp(&c, conn);
            if !posted {
                // No live QP: the REQ timers try again.
                self.ctl_out.clear();
                return;
            }
            self.counters.qp_ctl_sent += 1;
            self.ctl_out.pop_front();
        }
    }
}
