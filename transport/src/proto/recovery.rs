//! Loss recovery of the sending half: acknowledgements (SACK and cumulative), time-based loss
//! detection and the tail-loss probe (RFC 8985, RACK-TLP, over sprayed paths), the reorder count as a
//! secondary signal, per-path retransmission timeouts as the backstop, and (re)transmission on a
//! healthy path.
//!
//! **Time-based detection.** The sender remembers when each transmission left. A SACK names which
//! arrived; the most recently *sent* of them is RACK's reference (its send time and its RTT). A packet
//! still in flight that was sent before it is lost once it is overdue: its expected arrival (send time
//! plus the larger of the reference RTT and what its own path's RTT distribution allows, SRTT + 4
//! RTTVAR, since sprayed paths differ) plus a reordering window has passed. The window is a quarter of the minimum RTT, times a factor
//! that grows by one whenever a loss turns out spurious (the packet arrives after all, or the receiver
//! reports a duplicate of a resend) and falls back to one after 16 losses without that, never above
//! the smoothed RTT. A timer fires at the earliest such deadline, so a loss is found about one RTT
//! and a window after it left, whatever the RTO.
//!
//! **Tail-loss probe.** The last packets of a burst have nothing sent after them to reveal their loss.
//! When nothing was acknowledged for a probe timeout (two smoothed RTTs plus the receiver's SACK
//! delay) with packets in flight, one packet goes out as a probe: new data if there is some (beyond
//! the window), else the newest packet in flight again, on another path. Its acknowledgement is a
//! reference sent after everything before it, so the time-based rule finds the rest of the tail lost;
//! recovery takes about two RTTs. While the silence lasts, further probes follow at doubling intervals
//! (RFC 8985 sends one and leaves the rest to the RTO; a sprayed connection whose receiver stalled
//! would then wait out an RTO on every path), up to `TLP_MAX_BACKOFF`; the per-path RTO stays the
//! backstop.
//!
//! **Count.** A packet past its expected arrival is lost without waiting out the reordering window
//! once `reorder_threshold` later transmissions were acknowledged (adaptive; the PSN distance for
//! first copies).

use prism_lb::{Feedback, PathCtx};

use super::connection::Connection;
use super::path::TxEntry;
use super::paths::Fitness;
use super::sender::{PktState, SentPkt};
use super::{Micros, MsgId, PayloadSource, Transmit, OOO_WINDOW_PKTS};
use crate::wire::{DataPacket, DataRepr, SackRepr, DATA_HEADER_LEN};

/// An RTT this far above the path's base RTT (in addition to doubling it) counts as congestion when
/// the receiver did not report any: the delay-based verdict REPS needs on networks without ECN.
const DELAY_CONGESTION_SLACK_US: u64 = 50;

/// Smallest reordering window, µs: the clock's granularity.
const REO_WND_MIN_US: u64 = 1;

/// Losses found without a spurious one in between after which the reordering window's factor falls
/// back to one (RFC 8985 section 6.2).
const REO_RESET_LOSSES: u32 = 16;

/// Tail-loss probes sent after one silence, each after twice the wait of the one before (then only
/// the per-path RTO): a stalled receiver (a descheduled process whose socket buffers overflowed) is
/// found again within about twice its stall, not at the RTO floor.
const TLP_MAX_BACKOFF: u32 = 8;

/// Largest reordering window factor (of min RTT / 4); the window is also capped at the smoothed RTT.
const REO_MULT_MAX: u32 = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LossCause {
    /// Overdue while a packet sent after it arrived (time-based, RACK).
    Time,
    /// `reorder_threshold` later transmissions were acknowledged.
    Count,
    /// Its path's retransmission timeout expired.
    Timeout,
    /// Not a loss: resent as the tail-loss probe.
    Probe,
}

/// What a SACK's echo told about its triggering packet.
#[derive(Debug, Clone, Copy)]
pub(super) struct Echo {
    entropy: u16,
    ts_us: u32,
    rtt_us: u32,
    congested: bool,
}

impl Connection {
    /// Hand the policy what the paths reported, in order.
    pub(super) fn flush_feedback(&mut self) {
        for fb in self.paths.take_events() {
            self.policy.feedback(&fb);
        }
    }

    /// Check a SACK against what was sent before acting on any of it.
    pub(super) fn sack_is_consistent(&self, sack: &SackRepr) -> bool {
        if sack.cum_psn > self.tx.next_psn() {
            return false;
        }
        let top = (0..4).rev().find(|&j| sack.bitmap[j] != 0).map(|j| 64 * j as u64 + 63 - u64::from(sack.bitmap[j].leading_zeros()));
        top.map_or(0, |t| sack.base_psn + t + 1) <= self.tx.next_psn()
    }

    /// Apply a SACK (already checked with `sack_is_consistent`).
    pub(super) fn on_sack(&mut self, sack: &SackRepr, now: Micros) {
        self.stats.sacks_received += 1;
        if sack.spurious {
            self.stats.spurious_retransmissions += 1;
            self.on_spurious();
        }
        let echo = sack.echo.and_then(|(entropy, ts)| self.echo_sample(entropy, ts, sack.congested, now));
        self.ack_through(sack.cum_psn, now, echo);
        for j in 0..4 {
            let mut word = sack.bitmap[j];
            while word != 0 {
                let psn = sack.base_psn + 64 * j as u64 + u64::from(word.trailing_zeros());
                word &= word - 1;
                if psn >= self.tx.snd_una {
                    self.mark_sacked(psn, now, echo);
                }
            }
        }
        self.after_acks(now);
    }

    /// Apply a bare cumulative acknowledgement (from a control packet).
    pub(super) fn on_cum_ack(&mut self, cum_psn: u64, now: Micros) {
        self.ack_through(cum_psn, now, None);
        self.after_acks(now);
    }

    fn ack_through(&mut self, cum_psn: u64, now: Micros, echo: Option<Echo>) {
        let mut psn = self.tx.snd_una;
        while psn < cum_psn {
            self.mark_sacked(psn, now, echo);
            psn += 1;
        }
    }

    /// An RTT sample from an echoed timestamp: exact for the path it names, whatever got retransmitted.
    fn echo_sample(&mut self, entropy: u16, ts_us: u32, congested: bool, now: Micros) -> Option<Echo> {
        let rtt = (now as u32).wrapping_sub(ts_us);
        if entropy >= self.cfg.n_paths || rtt > i32::MAX as u32 {
            return None;
        }
        let path = self.paths.get_mut(entropy);
        path.rtt.sample(u64::from(rtt));
        let base = *path.base_rtt_us.get_or_insert(rtt);
        path.base_rtt_us = Some(base.min(rtt));
        path.max_rtt_since_timeout_us = path.max_rtt_since_timeout_us.max(rtt);
        let ps = &mut self.stats.paths[entropy as usize];
        ps.record_rtt(u64::from(rtt));
        ps.srtt_us = path.rtt.srtt_us().unwrap_or(0);
        ps.rto_us = path.rtt.rto_us();
        self.ctl_rtt.sample(u64::from(rtt));
        let tx = &mut self.tx;
        tx.min_rtt_us = Some(tx.min_rtt_us.map_or(u64::from(rtt), |m| m.min(u64::from(rtt))));
        let delayed = u64::from(rtt) > 2 * u64::from(base) + DELAY_CONGESTION_SLACK_US;
        Some(Echo { entropy, ts_us, rtt_us: rtt, congested: congested || delayed })
    }

    fn mark_sacked(&mut self, psn: u64, now: Micros, echo: Option<Echo>) {
        let tx = &mut self.tx;
        let Some(rec) = tx.ring.get_mut((psn - tx.snd_una) as usize) else { return };
        let was = rec.state;
        rec.state = PktState::Sacked;
        let rec = *rec;
        match was {
            PktState::Sacked => return,
            PktState::InFlight => {
                tx.in_flight -= 1;
                self.paths.get_mut(rec.entropy).in_flight -= 1;
                self.stats.paths[rec.entropy as usize].in_flight -= 1;
            }
            PktState::Lost if rec.probed => {}
            PktState::Lost => {
                // The "lost" packet was only late: it does not count against its path either.
                self.stats.spurious_retransmissions += 1;
                self.paths.loss_taken_back(rec.entropy, now, &mut self.stats.paths);
                self.on_spurious();
            }
        }
        let tx = &mut self.tx;
        tx.tlp_count = 0;
        tx.tlp_base = now;
        let exact = echo.filter(|e| e.entropy == rec.entropy && e.ts_us == rec.sent_at as u32);
        // For a packet sent more than once, only the echo tells which copy arrived. Crediting the
        // latest copy when an older one arrived would make every transmission before it look
        // overtaken (a cascade of false losses) and the wrong path look healthy.
        let known_copy = !rec.resent || exact.is_some();
        let (rtt_us, congested) = match exact {
            Some(e) => (e.rtt_us, e.congested),
            None => (now.saturating_sub(rec.sent_at).min(u64::from(u32::MAX)) as u32, false),
        };
        if known_copy {
            tx.acked_tx_end = tx.acked_tx_end.max(rec.tx_seq + 1);
            if rec.sent_at >= tx.acked_sent_at {
                // RACK's reference: the most recently sent packet known delivered, and its RTT.
                tx.acked_sent_at = rec.sent_at;
                tx.rack_rtt_us = u64::from(rtt_us);
            }
        }
        self.paths.push_event(Feedback::Ack { entropy: rec.entropy, rtt_us, congested, bytes: rec.len, now_us: now });
        if known_copy {
            self.paths.delivered(rec.entropy, rec.tx_seq, rec.sent_at, now, &mut self.stats.paths);
        }
        self.clean_path_front(rec.entropy);
        if !rec.trunc {
            self.tx.send_acked(rec.msg, &mut self.completions);
        }
    }

    /// A loss was declared for a packet that had only been overtaken: the count threshold is too
    /// tight (+1, as PRO grows its out-of-order window per repeated arrival) and so is the time window.
    fn on_spurious(&mut self) {
        let tx = &mut self.tx;
        tx.reorder_threshold = (tx.reorder_threshold + 1).min(self.cfg.window_pkts.max(self.cfg.reorder_threshold));
        self.stats.reorder_threshold = tx.reorder_threshold;
        tx.reo_mult = (tx.reo_mult + 1).min(REO_MULT_MAX);
        tx.losses_since_spurious = 0;
    }

    /// The reordering window: min RTT / 4 times the adaptive factor, at most the smoothed RTT.
    fn reo_wnd(&self) -> Micros {
        let quarter = self.tx.min_rtt_us.unwrap_or(0) / 4;
        let wnd = (u64::from(self.tx.reo_mult) * quarter).max(REO_WND_MIN_US);
        match self.ctl_rtt.srtt_us() {
            Some(srtt) => wnd.min(srtt.max(REO_WND_MIN_US)),
            None => wnd,
        }
    }

    /// When transmission `rec` should have arrived: after the larger of RACK's reference RTT and what
    /// its own path's RTT distribution allows (SRTT + 4 RTTVAR; a path without samples takes the
    /// connection's, which spans every path's).
    fn expected_at(&self, rec: &SentPkt) -> Micros {
        let path = self.paths.get(rec.entropy).rtt.expected_us().or_else(|| self.ctl_rtt.expected_us()).unwrap_or(0);
        rec.sent_at.saturating_add(self.tx.rack_rtt_us.max(path))
    }

    /// After acknowledgements: release the acknowledged prefix and look for losses.
    fn after_acks(&mut self, now: Micros) {
        let tx = &mut self.tx;
        let una = tx.snd_una;
        while tx.ring.front().is_some_and(|r| r.state == PktState::Sacked) {
            tx.ring.pop_front();
            tx.snd_una += 1;
        }
        if tx.snd_una != una {
            tx.una_moved_at = now;
        }
        self.detect_losses(now);
    }

    /// The time-based rule and the count rule over every transmission sent before RACK's reference;
    /// re-arms the time-based timer for the earliest one not yet overdue.
    pub(super) fn detect_losses(&mut self, now: Micros) {
        while let Some(&(tx_seq, psn)) = self.tx.tx_order.front() {
            if self.tx.is_live(tx_seq, psn) {
                break;
            }
            self.tx.tx_order.pop_front();
        }
        let reo = self.reo_wnd();
        let mut timer: Option<Micros> = None;
        let mut i = 0;
        while let Some(&(tx_seq, psn)) = self.tx.tx_order.get(i) {
            i += 1;
            if tx_seq >= self.tx.acked_tx_end {
                break;
            }
            if !self.tx.is_live(tx_seq, psn) {
                continue;
            }
            let expected = self.expected_at(&self.tx.ring[(psn - self.tx.snd_una) as usize]);
            let due = expected.saturating_add(reo);
            if due <= now {
                self.declare_lost(psn, now, LossCause::Time);
            } else if expected <= now && tx_seq + u64::from(self.tx.reorder_threshold) < self.tx.acked_tx_end {
                // Many later packets arrived: no need to wait out the reordering window.
                self.declare_lost(psn, now, LossCause::Count);
            } else {
                let at = if expected > now { expected.min(due) } else { due };
                let at = if tx_seq + u64::from(self.tx.reorder_threshold) < self.tx.acked_tx_end { at } else { due };
                timer = Some(timer.map_or(at, |t| t.min(at)));
            }
        }
        self.tx.rack_timer = timer;
    }

    pub(super) fn declare_lost(&mut self, psn: u64, now: Micros, cause: LossCause) {
        let tx = &mut self.tx;
        let rec = &mut tx.ring[(psn - tx.snd_una) as usize];
        debug_assert_eq!(rec.state, PktState::InFlight);
        rec.state = PktState::Lost;
        rec.probed = cause == LossCause::Probe;
        let (entropy, tx_seq, sent_at) = (rec.entropy, rec.tx_seq, rec.sent_at);
        tx.in_flight -= 1;
        if cause == LossCause::Probe {
            tx.retx_queue.push_front(psn);
        } else {
            tx.retx_queue.push_back(psn);
        }
        self.paths.get_mut(entropy).in_flight -= 1;
        self.stats.paths[entropy as usize].in_flight -= 1;
        match cause {
            LossCause::Time | LossCause::Count => {
                // Overtaken by packets sent much later (more than an RTO after it) means nothing sent
                // around the same time got through on any path: a stall of the peer or of this host,
                // not this path.
                let path_rto = self.paths.get(entropy).rtt.rto_us();
                let blame = sent_at >= tx.exempt_before && tx.acked_sent_at <= sent_at.saturating_add(path_rto);
                if cause == LossCause::Time {
                    self.stats.time_losses += 1;
                    tx.losses_since_spurious += 1;
                    if tx.losses_since_spurious >= REO_RESET_LOSSES {
                        tx.reo_mult = 1;
                        tx.losses_since_spurious = 0;
                    }
                } else {
                    self.stats.reorder_losses += 1;
                }
                self.paths.push_event(Feedback::Nack { entropy, now_us: now });
                self.paths.lost(entropy, tx_seq, sent_at, blame, now, &mut self.stats.paths);
            }
            // One timeout writes off every expired packet of its path at once; it counts once, in
            // `path_timeout`, so a lost tail SACK does not look like a run of losses.
            LossCause::Timeout => self.stats.timeout_losses += 1,
            LossCause::Probe => {}
        }
        self.clean_path_front(entropy);
    }

    /// Keep the invariant that a path's queue front is a packet in flight on it.
    fn clean_path_front(&mut self, entropy: u16) {
        let tx = &self.tx;
        let q = &mut self.paths.get_mut(entropy).queue;
        while let Some(f) = q.front() {
            if tx.is_live(f.tx_seq, f.psn) {
                return;
            }
            q.pop_front();
        }
    }

    /// When the tail-loss probe is due: packets are in flight and nothing was acknowledged or sent for
    /// a probe timeout, doubled for every probe already sent since the last acknowledgement.
    pub(super) fn tlp_deadline(&self) -> Option<Micros> {
        if self.tx.in_flight == 0 || self.tx.tlp_count > TLP_MAX_BACKOFF {
            return None;
        }
        let pto = match self.ctl_rtt.srtt_us() {
            Some(srtt) => 2 * srtt + self.cfg.sack_delay_us,
            None => self.ctl_rtt.rto_us(),
        };
        Some(self.tx.tlp_base.saturating_add(pto.max(1) << self.tx.tlp_count))
    }

    pub(super) fn on_tlp_timer(&mut self, now: Micros) {
        if self.tlp_deadline().is_some_and(|d| d <= now) {
            self.tx.tlp_count += 1;
            self.tx.tlp_due = true;
            self.stats.tail_probes += 1;
        }
    }

    /// Earliest retransmission timeout of any path.
    pub(super) fn rto_deadline(&mut self) -> Option<Micros> {
        self.paths.earliest_rto()
    }

    /// Fire every expired per-path RTO: the path gets a timeout (suspect, dead after
    /// `path_dead_after`), its expired packets are lost and will be resent elsewhere.
    pub(super) fn on_rto(&mut self, now: Micros) {
        if !matches!(self.paths.earliest_rto(), Some(d) if d <= now) {
            return;
        }
        for e in 0..self.cfg.n_paths {
            let path = self.paths.get(e);
            let rto = path.rtt.rto_us();
            match path.rto_deadline() {
                Some(d) if d <= now => {}
                _ => continue,
            }
            let (front_tx_seq, front_sent_at) = path.queue.front().map_or((0, 0), |f| (f.tx_seq, f.sent_at));
            if !self.path_timeout(e, front_tx_seq, front_sent_at, now) {
                // The peer went silent (a stall): writing off and resending every packet in flight
                // would only add to what it has to work through. A probe asks whether it is back; its
                // acknowledgement lets the time-based rule find what was really lost.
                self.tx.tlp_due = true;
                continue;
            }
            let dead = !self.paths.get(e).usable();
            while let Some(&TxEntry { tx_seq, psn, sent_at }) = self.paths.get(e).queue.front() {
                if !self.tx.is_live(tx_seq, psn) {
                    self.paths.get_mut(e).queue.pop_front();
                } else if dead || sent_at.saturating_add(rto) <= now {
                    self.paths.get_mut(e).queue.pop_front();
                    self.declare_lost(psn, now, LossCause::Timeout);
                } else {
                    break;
                }
            }
        }
        // A loss that hid as reordering until the timer fired: the threshold is too loose.
        let tx = &mut self.tx;
        tx.reorder_threshold = (tx.reorder_threshold / 2).max(self.cfg.reorder_threshold);
        self.stats.reorder_threshold = tx.reorder_threshold;
    }

    /// The RTO of the path's oldest packet in flight (transmission `tx_seq`, sent at `sent_at`) expired.
    ///
    /// The path is blamed (suspect, then dead; the policy hears of it) only if a packet sent after
    /// this one arrived: then other paths get through and this one does not. When nothing sent since
    /// came back, the peer or this host stalled (a descheduled process, a full receive queue) and
    /// every path would look dead at once; a probe goes out instead of the packets, the timer backs
    /// off, what was sent until the peer is heard again is not held against any path, and the peer
    /// timeout deals with a peer that is really gone.
    ///
    /// Returns whether the path was blamed.
    fn path_timeout(&mut self, entropy: u16, tx_seq: u64, sent_at: Micros, now: Micros) -> bool {
        self.stats.timeouts += 1;
        // Blame the path when something sent after this packet arrived (other paths get through), or
        // when no other path has packets of that age still waiting (this path is the only one stuck).
        let rto = self.paths.get(entropy).rtt.rto_us();
        // (A tail-loss probe does not count: it went out because nothing was heard, and it may have
        // landed on another broken path.)
        let probe = self.tx.tlp_tx_seq;
        let others_stuck =
            (0..self.cfg.n_paths).filter(|&o| o != entropy).any(|o| {
                self.paths.get(o).queue.front().is_some_and(|f| {
                    self.tx.is_live(f.tx_seq, f.psn) && f.sent_at <= sent_at.saturating_add(rto) && Some(f.tx_seq) != probe
                })
            });
        let blame = sent_at >= self.tx.exempt_before && (self.tx.acked_sent_at > sent_at || !others_stuck);
        if self.ctl_rtt.srtt_us().is_none() && !matches!(self.tx.unsampled_backoff_at, Some(t) if sent_at < t) {
            // No RTT measured yet and a packet timed out: the initial RTO is too short for this
            // network, so back off what paths not yet measured inherit, once per round (RFC 6298 5.5).
            self.ctl_rtt.on_timeout();
            self.tx.unsampled_backoff_at = Some(now);
        }
        let path = self.paths.get_mut(entropy);
        path.rtt.on_timeout();
        path.rto_fired_at = now;
        let ps = &mut self.stats.paths[entropy as usize];
        ps.timeouts += 1;
        ps.rto_us = path.rtt.rto_us();
        if !blame {
            // A stall only if the peer has not been heard since this packet left. Otherwise the peer
            // is alive, and the packet was either exempt already or the last of a window clogged by
            // a black hole (every packet still in flight lost on dead paths, so nothing sent after it
            // could arrive): treating that as a stall exempted every packet in flight at the next SACK,
            // and their timeouts declared the next stall, so a black-holed path was never blamed.
            self.tx.stalled |= others_stuck && self.last_heard <= sent_at;
            self.stats.stall_timeouts += 1;
            tracing::debug!(entropy, "retransmission timeout while the peer was silent: not blamed on the path");
            return false;
        }
        self.paths.timed_out(entropy, tx_seq, sent_at, self.tx.next_tx_seq, now, &mut self.stats.paths);
        true
    }

    /// The next DATA packet (the tail-loss probe, a retransmission, then new data within the window).
    pub(super) fn poll_data(&mut self, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Option<Transmit> {
        let probe = std::mem::take(&mut self.tx.tlp_due);
        if probe && !self.tx.has_retransmission() {
            if self.tx.tx_queue.is_empty() || self.tx.next_psn() - self.tx.snd_una >= OOO_WINDOW_PKTS {
                // No new data to probe with: send the newest packet in flight again.
                if let Some(psn) = self.tx.newest_in_flight() {
                    self.declare_lost(psn, now, LossCause::Probe);
                }
            } else if let Some(t) = self.poll_new_data(now, src, out) {
                self.tx.tlp_tx_seq = Some(self.tx.next_tx_seq - 1);
                return Some(t);
            }
        }
        if self.tx.in_flight >= self.cfg.window_pkts {
            return None;
        }
        if self.tx.has_retransmission() {
            let psn = *self.tx.retx_queue.front().expect("has_retransmission");
            let len = self.tx.ring[(psn - self.tx.snd_una) as usize].len as usize;
            if out.len() < DATA_HEADER_LEN + len {
                tracing::warn!(buffer = out.len(), need = DATA_HEADER_LEN + len, "transmit buffer too small for a retransmission");
                return None;
            }
            self.tx.retx_queue.pop_front();
            let probed = self.tx.ring[(psn - self.tx.snd_una) as usize].probed;
            let t = self.transmit_data(psn, true, now, src, out);
            if probed {
                self.tx.tlp_tx_seq = Some(self.tx.next_tx_seq - 1);
            }
            return Some(t);
        }
        if self.tx.next_psn() - self.tx.snd_una >= OOO_WINDOW_PKTS {
            return None;
        }
        self.poll_new_data(now, src, out)
    }

    /// The next packet of new data, if any.
    fn poll_new_data(&mut self, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Option<Transmit> {
        // Whole lines only: every packet but a buffer's last one ends on a line boundary of the message.
        let max_payload = super::config::line_floor(self.cfg.max_payload.min(out.len().checked_sub(DATA_HEADER_LEN)?)) as u64;
        let (rec, done) = self.tx.next_new_packet(max_payload, now)?;
        let psn = self.tx.push_new(rec, done, now);
        Some(self.transmit_data(psn, false, now, src, out))
    }

    /// Put PSN `psn` on a path and into `out`.
    fn transmit_data(&mut self, psn: u64, retx: bool, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Transmit {
        let idx = (psn - self.tx.snd_una) as usize;
        let old = self.tx.ring[idx];
        let entropy = if retx {
            self.pick_path(old.msg, old.offset, true, Some(old.entropy), now)
        } else {
            self.pick_path(old.msg, old.offset, false, None, now)
        };
        let tx_seq = self.tx.next_tx_seq;
        self.tx.next_tx_seq += 1;
        let rec = &mut self.tx.ring[idx];
        rec.state = PktState::InFlight;
        rec.probed = false;
        rec.entropy = entropy;
        rec.sent_at = now;
        rec.tx_seq = tx_seq;
        rec.resent |= retx;
        let repr = DataRepr {
            token: self.peer_token,
            cts_ack: self.tx.cts_next,
            psn,
            cts_seq: old.cts_seq,
            sub: old.sub,
            offset: old.offset,
            len: old.len,
            total_len: old.total,
            entropy,
            ts_us: now as u32,
            trunc: old.trunc,
            ce: false,
            retx,
        };
        let total = repr.buffer_len();
        let mut pkt = DataPacket::new_unchecked(&mut out[..total]);
        repr.emit(&mut pkt);
        if old.len > 0 {
            src.read(old.msg, old.offset, &mut pkt.payload_mut()[..old.len as usize]);
        }
        // A path nothing was measured on yet times out after the connection's RTO, not the configured
        // initial one: with queues deeper than that initial value, every first packet on a fresh
        // entropy (a spraying or exploring policy uses many) would time out spuriously, be resent,
        // and blame a path that works.
        let ctl_rtt = &self.ctl_rtt;
        let path = self.paths.get_mut(entropy);
        path.rtt.inherit_initial(ctl_rtt);
        path.queue.push_back(TxEntry { tx_seq, psn, sent_at: now });
        path.in_flight += 1;
        self.tx.tx_order.push_back((tx_seq, psn));
        self.tx.in_flight += 1;
        self.tx.ack_pending = false;
        self.tx.tlp_base = now;
        self.stats.data_pkts_sent += 1;
        self.stats.data_bytes_sent += u64::from(old.len);
        let ps = &mut self.stats.paths[entropy as usize];
        ps.pkts_sent += 1;
        ps.bytes_sent += u64::from(old.len);
        ps.in_flight += 1;
        if retx {
            self.stats.retransmissions += 1;
            ps.retransmissions += 1;
        }
        Transmit { entropy, len: total }
    }

    /// The policy's entropy for one packet, corrected when it names a path that is not alive (or not
    /// proven during a failure episode), or (for a retransmission) the path the lost copy took.
    fn pick_path(&mut self, msg: MsgId, offset: u64, retransmit: bool, avoid: Option<u16>, now: Micros) -> u16 {
        self.flush_feedback();
        let n = self.cfg.n_paths;
        let ctx = PathCtx { msg: msg.0, offset, n_paths: n, retransmit, avoid, now_us: now };
        let first = self.policy.pick(&ctx) % n;
        if n == 1 {
            return first;
        }
        let episode = self.paths.episode();
        let checked = self.paths.any_bad() || episode.is_some();
        if Some(first) != avoid && (!checked || self.paths.fitness(first, episode) == Fitness::Good) {
            return first;
        }
        let second = self.policy.pick(&PathCtx { avoid: Some(first), ..ctx }) % n;
        if Some(second) != avoid && self.paths.fitness(second, episode) == Fitness::Good {
            return second;
        }
        // The fittest path, nearest after the policy's first choice; never the lost copy's.
        let mut best: Option<(Fitness, u16)> = None;
        for e in (1..n).map(|k| (first + k) % n).chain([first]) {
            if Some(e) == avoid {
                continue;
            }
            let f = self.paths.fitness(e, episode);
            if f == Fitness::Good {
                return e;
            }
            if !matches!(best, Some((bf, _)) if bf <= f) {
                best = Some((f, e));
            }
        }
        best.map_or(first, |(_, e)| e)
    }

    /// Whether new packets would go on path `entropy` now: it is alive and, during a failure episode
    /// (some paths died), it was proven to work since the episode began. A driver whose other
    /// connections share this one's paths (same source and destination address and port) can steer
    /// their control packets with it.
    pub fn path_preferred(&self, entropy: u16) -> bool {
        entropy < self.cfg.n_paths && self.paths.fitness(entropy, self.paths.episode()) == Fitness::Good
    }
}
