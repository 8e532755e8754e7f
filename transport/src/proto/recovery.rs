//! Loss recovery of the sending half: acknowledgements (SACK and cumulative), time-based loss
//! detection and the tail-loss probe (RFC 8985, RACK-TLP, over sprayed paths), the reorder count as a
//! secondary signal, per-path retransmission timeouts as the backstop, and (re)transmission on a
//! healthy path.
//!
//! **Time-based detection.** The sender remembers when each transmission left. A SACK names which
//! arrived; the most recently *sent* of them is RACK's reference (its send time and its RTT). A packet
//! still in flight that was sent before it is lost once it is overdue. Overtaken on its own path (a
//! path keeps its order), it was due when that packet arrived: the larger of the reference RTT and
//! that packet's, plus the measured reordering window: the largest lateness seen lately (how much
//! later than the reference allowed an overtaken packet, or a copy declared lost, was acknowledged)
//! with a quarter's margin, or RFC 8985's window (a quarter of the minimum RTT times a factor that
//! grows by one whenever a loss turns out spurious and falls back to one after 16 SRTTs without
//! that), whichever is larger, never above 4 SRTTs. Overtaken only by packets on other paths
//! (sprayed paths differ in RTT), its path is suspect after the larger of the reference RTT and the
//! path's SRTT + 2 RTTVAR, and it is lost after the larger of the reference RTT and twice the
//! connection's (or the path's) SRTT + 4 RTTVAR, plus RFC 8985's window. A timer
//! fires at the earliest such deadline, so a loss is found about one RTT and a window after it left,
//! whatever the RTO.
//!
//! **Tail-loss probe.** The last packets of a burst have nothing sent after them to reveal their loss.
//! When nothing was acknowledged for a probe timeout with packets in flight, one packet goes out as a
//! probe: new data if there is some (beyond the window), else the newest packet in flight again, on
//! another path. The timeout is two smoothed RTTs (plus the receiver's SACK delay unless the last
//! packet ended a message), or twice the time what is in flight (sent after the newest transmission
//! acknowledged) needs to drain at the measured delivery rate plus a minimum RTT, if that is
//! shorter: a connection that sends its window at once measures RTTs that are mostly its own queue,
//! and a packet sent after the queue drained (a retransmission, a message's end) is due long before
//! two such RTTs (a 1 MiB message at 1 GB/s with 5 % loss took 2.65 times as long as without loss
//! with two SRTTs, 1.2 times with this). Its
//! acknowledgement is a reference sent after everything before it, so the time-based rule finds the
//! rest of the tail lost; recovery takes about two RTTs. While the silence lasts, further probes
//! follow at doubling intervals (RFC 8985 sends one and leaves the rest to the RTO; a sprayed
//! connection whose receiver stalled would then wait out an RTO on every path), up to
//! `TLP_MAX_BACKOFF`; the per-path RTO stays the backstop.
//!
//! **Count.** A packet past its expected arrival is lost without waiting out the reordering window
//! once `reorder_threshold` later transmissions were acknowledged (adaptive; the PSN distance for
//! first copies), as RFC 8985's duplicate threshold, only while no reordering was seen lately.

use prism_lb::Feedback;

use super::connection::Connection;
use super::path::TxEntry;
use super::sender::{PktState, SentPkt};
use super::Micros;
use crate::wire::sack::ECHO_BY_PSN;
use crate::wire::SackRepr;

/// An RTT this far above the path's base RTT (in addition to doubling it) counts as congestion when
/// the receiver did not report any: the delay-based verdict REPS needs on networks without ECN.
const DELAY_CONGESTION_SLACK_US: u64 = 50;

/// RTT variations above its path's smoothed RTT (the connection's while the path has no sample)
/// after which a packet overtaken only on other paths makes its path suspect. Half of the RTO's
/// four: on the rail fabric, whose loaded RTTs swing from 10 to 70 ms, the RTO's margin let a
/// failed spine's paths be suspected only 2-3 RTTs after the fault (bytes off the dead path after
/// 1.4-3.2 RTTs under PRO and DR); with two, 0.5-2.1 under every policy, and fault-free runs no
/// slower (1.04-1.11x the bound). None at all was as quick but cost REPS its lead over the
/// balanced reference in the simulator's k = 6 fat tree (686 against 638 µs; with two 635 against
/// 627), where random spraying got faster with two (1,166 -> 783 µs). Suspicions this quick come
/// often under congestion: they must not each date the failure episode anew (`Paths::set_health`).
const SUSPECT_RTTVARS: u64 = 2;

/// Smallest reordering window, µs: the clock's granularity.
const REO_WND_MIN_US: u64 = 1;

/// Smoothed RTTs without a spurious loss after which the reordering window's factor falls back to
/// one (RFC 8985 section 6.2 counts 16 recoveries; a sprayed connection has many losses per round
/// trip, so time is the measure).
const REO_RESET_RTTS: u64 = 16;

/// Tail-loss probes sent after one silence, each after twice the wait of the one before (then only
/// the per-path RTO): a stalled receiver (a descheduled process whose socket buffers overflowed) is
/// found again within about twice its stall, not at the RTO floor.
const TLP_MAX_BACKOFF: u32 = 8;

/// Largest reordering window factor (of min RTT / 4); the window is also capped at `REO_MAX_SRTTS`
/// smoothed RTTs.
const REO_MULT_MAX: u32 = 256;

/// The reordering window grows (on spurious losses) up to this many smoothed RTTs. RFC 8985 stops at
/// one; the RTTs of sprayed paths under queueing can differ by more, so the window may keep growing
/// while losses keep turning out spurious.
const REO_MAX_SRTTS: u64 = 4;

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

/// What a retransmission timeout says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// The path fails: its expired packets are lost, it becomes suspect or dead.
    Blamed,
    /// Nothing against the path (a packet from before the last stall, or the last of a window
    /// clogged by a black hole), but the peer is alive: the expired packets are resent.
    NotBlamed,
    /// The peer has been silent since the packet left: a probe, nothing written off.
    PeerSilent,
}

/// What a SACK's echo told about its triggering packet.
#[derive(Debug, Clone, Copy)]
pub(super) struct Echo {
    entropy: u16,
    ts_us: u32,
    rtt_us: u32,
    congested: bool,
}

/// Copies written off by tail-loss probes kept until a later transmission is acknowledged (probes
/// back off exponentially: a handful are outstanding at most).
const PROBED_COPIES: usize = 16;

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
        self.tx.acked_before = (self.tx.acked_tx_end, self.tx.rack_rtt_us);
        if sack.spurious {
            self.stats.spurious_retransmissions += 1;
            self.on_spurious();
        }
        let echo = sack
            .echo
            .and_then(|(entropy, ts)| self.echo_ts(entropy, ts))
            .and_then(|(entropy, ts)| self.echo_sample(entropy, ts, sack.congested, now));
        if let Some(e) = echo {
            // The echoed copy (whichever PSN, even a duplicate) left at `now - rtt` and arrived: a
            // reference for the time-based rule, even when its PSN was acknowledged before (a
            // tail-loss probe resending a packet that had arrived must still reveal the losses).
            let sent = now.saturating_sub(u64::from(e.rtt_us));
            if sent > self.tx.acked_sent_at {
                self.tx.acked_sent_at = sent;
                self.tx.rack_rtt_us = u64::from(e.rtt_us);
            }
        }
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
        self.tx.acked_before = (self.tx.acked_tx_end, self.tx.rack_rtt_us);
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

    /// The (entropy, send timestamp) an echo names. An echo by PSN (`ECHO_BY_PSN`: a verbs WRITE
    /// whose header the receiver rebuilt) is looked up: the copy of that PSN sent on that entropy
    /// (the latest, or the one before it); None when the PSN is no longer outstanding or no copy
    /// went that way.
    fn echo_ts(&self, entropy: u16, ts: u32) -> Option<(u16, u32)> {
        if entropy & ECHO_BY_PSN == 0 {
            return Some((entropy, ts));
        }
        let entropy = entropy & !ECHO_BY_PSN;
        let tx = &self.tx;
        let i = ts.wrapping_sub(tx.snd_una as u32) as usize;
        let rec = tx.ring.get(i)?;
        if rec.entropy == entropy {
            Some((entropy, rec.sent_at as u32))
        } else if rec.resent && rec.prev_copy.0 == entropy {
            Some((entropy, rec.prev_copy.1 as u32))
        } else {
            None
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
        tx.last_new_ack_at = now;
        let exact = echo.filter(|e| e.entropy == rec.entropy && e.ts_us == rec.sent_at as u32);
        // For a packet sent more than once, only the echo tells which copy arrived. Crediting the
        // latest copy when an older one arrived would make every transmission before it look
        // overtaken (a cascade of false losses) and the wrong path look healthy.
        let known_copy = !rec.resent || exact.is_some();
        if let Some(e) = echo.filter(|e| rec.resent && (e.entropy, e.ts_us) == (rec.prev_copy.0, rec.prev_copy.1 as u32)) {
            // The copy before, declared lost, arrived after all: the window was this much too short.
            let late = u64::from(e.rtt_us).saturating_sub(tx.acked_before.1);
            tx.reo_late_us[0] = tx.reo_late_us[0].max(late);
        }
        let (rtt_us, congested) = match exact {
            Some(e) => (e.rtt_us, e.congested),
            None => (now.saturating_sub(rec.sent_at).min(u64::from(u32::MAX)) as u32, false),
        };
        if known_copy {
            let (acked_tx_end, rack_rtt_us) = tx.acked_before;
            if acked_tx_end > rec.tx_seq {
                // Overtaken: a transmission sent after it was acknowledged before. RACK would have
                // called it lost this long before it arrived, without a reordering window.
                let late = u64::from(rtt_us).saturating_sub(rack_rtt_us);
                tx.reo_late_us[0] = tx.reo_late_us[0].max(late);
            }
            tx.delivered = (tx.delivered.0 + u64::from(rec.len), now);
            let (bytes, since) = rec.delivered_at_send;
            if now > since {
                let rate = (tx.delivered.0 - bytes).saturating_mul(1000) / (now - since);
                tx.rate_max[0] = tx.rate_max[0].max(rate);
            }
            tx.acked_tx_end = tx.acked_tx_end.max(rec.tx_seq + 1);
            if rec.sent_at >= tx.acked_sent_at {
                // RACK's reference: the most recently sent packet known delivered, and its RTT.
                tx.acked_sent_at = rec.sent_at;
                tx.rack_rtt_us = u64::from(rtt_us);
            }
        }
        self.paths.push_event(Feedback::Ack { entropy: rec.entropy, rtt_us, congested, bytes: rec.len, now_us: now });
        if known_copy {
            self.paths.delivered(rec.entropy, rec.tx_seq, rec.sent_at, u64::from(rtt_us), now, &mut self.stats.paths);
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
        tx.last_spurious_at = self.now;
    }

    /// Start a new measuring period for the largest lateness and delivery rate every `REO_RESET_RTTS`
    /// smoothed RTTs (each is the larger of the current and the previous period's).
    fn roll_measuring_period(&mut self) {
        let srtt = self.ctl_rtt.srtt_us().unwrap_or(0);
        let tx = &mut self.tx;
        if self.now.saturating_sub(tx.reo_late_since) > REO_RESET_RTTS * srtt {
            tx.reo_late_us = [0, tx.reo_late_us[0]];
            tx.rate_max = [0, tx.rate_max[0]];
            tx.reo_late_since = self.now;
        }
    }

    /// The reordering windows, (RFC 8985's, measured): min RTT / 4 times the adaptive factor, and the
    /// larger of that and the lateness measured lately with a margin; both at most `REO_MAX_SRTTS`
    /// smoothed RTTs.
    fn reo_wnd(&mut self) -> (Micros, Micros) {
        let srtt = self.ctl_rtt.srtt_us().unwrap_or(0);
        if self.tx.reo_mult > 1 && self.now.saturating_sub(self.tx.last_spurious_at) > REO_RESET_RTTS * srtt {
            self.tx.reo_mult = 1;
        }
        let tx = &self.tx;
        let quarter = tx.min_rtt_us.unwrap_or(0) / 4;
        let base = (u64::from(tx.reo_mult) * quarter).max(REO_WND_MIN_US);
        // The lateness measured is the largest of the packets that were not declared lost first, so
        // the window keeps a margin above it (a quarter more, and the RFC's step).
        let late = tx.reo_late_us[0].max(tx.reo_late_us[1]);
        let measured = if late > 0 { base.max(late + late / 4 + quarter) } else { base };
        let cap = |w: Micros| match self.ctl_rtt.srtt_us() {
            Some(srtt) => w.min((REO_MAX_SRTTS * srtt).max(REO_WND_MIN_US)),
            None => w,
        };
        (cap(base), cap(measured))
    }

    /// When transmission `rec` is overdue, as (suspect from, lost from, lost by the count from).
    ///
    /// When a packet sent after it on its own path arrived (a path keeps its packets in order), it
    /// was due when that one arrived: RACK's reference RTT or that packet's, whichever is larger,
    /// plus the measured reordering window `reo.1` (paths that do reorder their own packets; a
    /// smoothed RTT and its variation are no measure of that: a connection that sends its window
    /// at once sees RTTs from one to a thousand times the minimum in every burst, all from its own
    /// queue). The count rule waits for the path's usual RTT (SRTT + 4 RTTVAR) at least.
    ///
    /// When only packets on other paths overtook it, its path's usual RTT (SRTT + 2 RTTVAR, the
    /// connection's while the path has no sample) plus the window `reo.0` marks the path suspect
    /// (avoided by new packets: cheap if wrong), and twice the spread of every path's RTT (the
    /// larger of the path's and the connection's SRTT + 4 RTTVAR) declares it lost (a
    /// retransmission: costly if wrong, and queueing spreads sprayed paths' RTTs further than any
    /// estimate shows; the fault-free 128-host fat tree of seed 000 otherwise resent ~900 packets
    /// per run that were not lost).
    fn expected_at(&self, rec: &SentPkt, reo: (Micros, Micros)) -> (Micros, Micros, Micros) {
        let path = self.paths.get(rec.entropy);
        let conn = self.ctl_rtt.expected_us().unwrap_or(0);
        let own = path.rtt.expected_us().unwrap_or(conn);
        let rack = self.tx.rack_rtt_us;
        if path.delivered_tx_end > rec.tx_seq {
            let at = rec.sent_at.saturating_add(rack.max(path.delivered_rtt_us));
            let due = at.saturating_add(reo.1);
            (due, due, at.max(rec.sent_at.saturating_add(own)))
        } else {
            let spread = own.max(conn);
            let lost = rec.sent_at.saturating_add(rack.max(2 * spread));
            let typical = path.rtt.srtt_plus_var_us(SUSPECT_RTTVARS).or(self.ctl_rtt.srtt_plus_var_us(SUSPECT_RTTVARS)).unwrap_or(spread);
            (rec.sent_at.saturating_add(rack.max(typical)).saturating_add(reo.0), lost.saturating_add(reo.0), lost)
        }
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
        self.blame_probed_copies(now);
        self.detect_losses(now);
    }

    /// A tail-loss probe writes off the packet it sends again without blaming the old copy's path
    /// (nothing was heard at all, which may be the peer's doing). During a failure episode, once a
    /// transmission sent after that copy is acknowledged, the copy's loss is what the time-based rule
    /// blames: its path did not deliver while another did. Without it, when a rail failed under a
    /// connection whose last burst crossed before the failure on some of that rail's paths (so those
    /// stayed alive and proven), each probe of the tail went to one of them, was lost, and was written
    /// off by the next probe, four times in a row; and the next message's packets went there again
    /// (`proto_net`'s receive-only rail test, seed 7: 4 timeouts 5 ms after the failure). Outside an
    /// episode a probe is mostly spurious (the copy it wrote off was queued, not lost: on loopback
    /// the probe's copy often overtakes it), and blaming those copies' paths made them suspect for a
    /// while: DR's rotation carried 12 % fewer packets on one of 16 entropies.
    fn blame_probed_copies(&mut self, now: Micros) {
        if self.paths.episode_start().is_none() {
            self.tx.probed_copies.clear();
            return;
        }
        while let Some(&(entropy, tx_seq, sent_at)) = self.tx.probed_copies.front() {
            if tx_seq >= self.tx.acked_tx_end {
                break;
            }
            self.tx.probed_copies.pop_front();
            self.loss_against_path(entropy, tx_seq, sent_at, now, now);
        }
    }

    /// Transmission `tx_seq` on `entropy`, sent at `sent_at`, was found lost (from `due` on) while a
    /// later one arrived: the policy hears of it, and the path is held to it unless the peer stalled
    /// (`blame_loss`) or the path delivered a later packet of its own (`Paths::lost`).
    fn loss_against_path(&mut self, entropy: u16, tx_seq: u64, sent_at: Micros, due: Micros, now: Micros) {
        let blame = self.blame_loss(entropy, sent_at, due);
        let own_path = self.paths.get(entropy).delivered_tx_end > tx_seq;
        self.paths.push_event(Feedback::Nack { entropy, own_path, now_us: now });
        self.paths.lost(entropy, tx_seq, sent_at, blame, now, &mut self.stats.paths);
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
        self.roll_measuring_period();
        let reo = self.reo_wnd();
        let reordering_unseen = self.tx.reo_mult == 1 && self.tx.reo_late_us == [0, 0];
        let mut timer: Option<Micros> = None;
        let mut i = 0;
        while let Some(&(tx_seq, psn)) = self.tx.tx_order.get(i) {
            i += 1;
            if !self.tx.is_live(tx_seq, psn) {
                continue;
            }
            let rec = &self.tx.ring[(psn - self.tx.snd_una) as usize];
            // Candidates were sent before RACK's reference (transmissions are in sending order).
            // Packets handed over at the same instant are one batch, which the backend sends grouped
            // by path (one system call per source port): within it only a path's own order holds.
            if rec.sent_at >= self.tx.acked_sent_at {
                if tx_seq >= self.tx.acked_tx_end {
                    break;
                }
                if self.paths.get(rec.entropy).delivered_tx_end <= tx_seq {
                    continue;
                }
            }
            let (suspect_due, due, count_from) = self.expected_at(rec, reo);
            let (entropy, sent_at) = (rec.entropy, rec.sent_at);
            // RFC 8985's duplicate threshold, which (as there) skips the window only while no
            // reordering was seen lately: no spurious loss, no packet acknowledged after one sent
            // later.
            let counted = reordering_unseen && tx_seq + u64::from(self.tx.reorder_threshold) < self.tx.acked_tx_end;
            if due <= now {
                self.declare_lost(psn, now, LossCause::Time, due);
                continue;
            }
            if count_from <= now && counted {
                // Many later packets arrived: no need to wait out the reordering window.
                self.declare_lost(psn, now, LossCause::Count, count_from);
                continue;
            }
            // On a path already found failing, a packet is lost halfway between suspect and lost.
            let failing_due = suspect_due + (due - suspect_due) / 2;
            if failing_due <= now && !self.paths.get(entropy).alive() {
                self.declare_lost(psn, now, LossCause::Time, failing_due);
                continue;
            }
            let mut at = due;
            if suspect_due > now {
                at = at.min(suspect_due);
            } else {
                self.overdue(entropy, tx_seq, sent_at, suspect_due, now);
                if failing_due > now {
                    at = at.min(failing_due);
                }
            }
            if counted && count_from > now {
                at = at.min(count_from);
            }
            timer = Some(timer.map_or(at, |t| t.min(at)));
        }
        self.tx.rack_timer = timer;
    }

    /// Whether a packet on `entropy` sent at `sent_at` and overdue from `due` on may be held against
    /// its path. Not when the packet that overtook it (RACK's reference) left much later, later than
    /// the path's RTO and than the packet's own deadline after it: then nothing sent around the same
    /// time got through on any path (a stall of the peer or of this host), or a stall already
    /// exempted it. The deadline counts because under spraying it is often longer than the path's
    /// RTO (the spread of every path's RTT, twice); measured against the RTO alone, every loss found
    /// by time in a busy connection, whose reference keeps moving, looked like a stall, and a
    /// black-holed path that kept delivering nothing was never suspected.
    fn blame_loss(&self, entropy: u16, sent_at: Micros, due: Micros) -> bool {
        let horizon = self.paths.get(entropy).rto_us().max(due.saturating_sub(sent_at));
        sent_at >= self.tx.exempt_before && self.tx.acked_sent_at <= sent_at.saturating_add(horizon)
    }

    /// A packet on `entropy` is overdue (from `due` on) against packets on other paths but not lost
    /// yet: its path becomes suspect (unless the peer stalled: the same test as for a loss).
    fn overdue(&mut self, entropy: u16, tx_seq: u64, sent_at: Micros, due: Micros, now: Micros) {
        if self.blame_loss(entropy, sent_at, due) {
            self.paths.overdue(entropy, tx_seq, sent_at, now, &mut self.stats.paths);
        }
    }

    /// Transmission `psn` is lost, found by `cause` from `due` on (the deadline it missed).
    pub(super) fn declare_lost(&mut self, psn: u64, now: Micros, cause: LossCause, due: Micros) {
        let tx = &mut self.tx;
        let rec = &mut tx.ring[(psn - tx.snd_una) as usize];
        debug_assert_eq!(rec.state, PktState::InFlight);
        rec.state = PktState::Lost;
        rec.probed = cause == LossCause::Probe;
        let (entropy, tx_seq, sent_at) = (rec.entropy, rec.tx_seq, rec.sent_at);
        if cause != LossCause::Probe && rec.in_episode {
            self.stats.episode_losses += 1;
            self.stats.episode_losses_resent += u64::from(rec.resent);
        }
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
                if cause == LossCause::Time {
                    self.stats.time_losses += 1;
                } else {
                    self.stats.reorder_losses += 1;
                }
                self.loss_against_path(entropy, tx_seq, sent_at, due, now);
            }
            // One timeout writes off every expired packet of its path at once; it counts once, in
            // `path_timeout`, so a lost tail SACK does not look like a run of losses.
            LossCause::Timeout => self.stats.timeout_losses += 1,
            LossCause::Probe if self.paths.episode_start().is_some() => {
                let copies = &mut self.tx.probed_copies;
                if copies.len() >= PROBED_COPIES {
                    copies.pop_front();
                }
                copies.push_back((entropy, tx_seq, sent_at));
            }
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
        // Two smoothed RTTs, plus the receiver's SACK delay unless the last packet sent ended a
        // message (acknowledged at once: a one-packet message's loss costs 2 SRTTs, not 2 SRTTs and
        // the delay).
        let delay = if self.tx.tail_last { 0 } else { self.cfg.sack_delay_us };
        let mut pto = match self.ctl_rtt.srtt_us() {
            Some(srtt) => 2 * srtt + delay,
            None => self.ctl_rtt.rto_us(),
        };
        // The smoothed RTT of a connection that sends its window at once is mostly the queue its own
        // bursts build: a packet sent after the queue drained (a retransmission, the end of a
        // message) is due much sooner. What is in flight drains at the delivery rate measured
        // lately, so its last packet is due a minimum RTT after that: the probe waits twice the
        // smaller of that and the SRTT. Only what was sent after the newest transmission
        // acknowledged still drains: an older packet in flight was overtaken, and the time-based
        // rule deals with it. (A floor from the fastest delivery ever, for a burst larger than the
        // recent ones, removed the spurious probes of one-at-a-time mixes but delayed the probes
        // that find losses on failed links: the simulator's 000-failures, OFAN 56 -> 70 us.)
        let rate = self.tx.rate_max[0].max(self.tx.rate_max[1]);
        if let (Some(min_rtt), true) = (self.tx.min_rtt_us, rate > 0) {
            let queued = u64::from(self.tx.in_flight).min(self.tx.next_tx_seq.saturating_sub(self.tx.acked_tx_end));
            let drain = min_rtt + (queued * self.cfg.max_payload as u64).saturating_mul(1000) / rate;
            pto = pto.min(2 * drain + delay);
        }
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
        let conn_rto = self.ctl_rtt.rto_us();
        for e in 0..self.cfg.n_paths {
            let path = self.paths.get(e);
            let mut rto = path.rto_us();
            match path.rto_deadline() {
                Some(d) if d <= now => {}
                _ => continue,
            }
            if conn_rto > rto {
                // The path's floor is its connection's RTO when it last sent, and that has grown
                // since (the first RTT samples of a run come in after its first bursts left, and a
                // path without samples of its own has only the floor): in a traced fault-free run on
                // the rail fabric about half the timeouts were of such paths, at 20 ms where the
                // connection had measured 28-50 ms. The floor catches up and the timer is judged again.
                let path = self.paths.get_mut(e);
                path.rto_floor_us = conn_rto;
                rto = path.rto_us();
                if path.rto_deadline().is_some_and(|d| d > now) {
                    continue;
                }
            }
            let path = self.paths.get(e);
            let (front_tx_seq, front_sent_at) = path.queue.front().map_or((0, 0), |f| (f.tx_seq, f.sent_at));
            if self.tx.acked_sent_at <= front_sent_at && now.saturating_sub(self.tx.last_new_ack_at) < rto / 4 {
                // The acknowledgements keep coming but none yet for a packet sent after this one:
                // the queue it waits in (its host's, shared by every path) is still draining what
                // was sent before it. The timer restarts (RFC 6298 5.3: an acknowledgement of new
                // data restarts it). On the rail fabric nearly every timeout of a fault-free run
                // (150-200) was of a packet of a connection's first bursts, queued behind the
                // bursts of every connection of its host, all spurious. A black-holed path's
                // packets are overtaken by later ones on other paths and time out as before.
                self.paths.get_mut(e).rto_fired_at = now;
                continue;
            }
            let verdict = self.path_timeout(e, front_tx_seq, front_sent_at, now);
            if verdict == Verdict::PeerSilent {
                // The peer went silent (a stall): writing off and resending every packet in flight
                // would only add to what it has to work through. A probe asks whether it is back; its
                // acknowledgement lets the time-based rule find what was really lost.
                self.tx.tlp_due = true;
                continue;
            }
            // Not the path's fault: only its oldest packet is resent (as TCP resends one segment on a
            // timeout). Once that copy is acknowledged it was sent after all the others, so the
            // time-based rule finds what else was lost; on a peer that was only slow (its receive
            // queue held more than an RTO's worth), one duplicate per path, not every packet again.
            let only_oldest = verdict == Verdict::NotBlamed;
            let dead = !self.paths.get(e).usable();
            while let Some(&TxEntry { tx_seq, psn, sent_at }) = self.paths.get(e).queue.front() {
                if !self.tx.is_live(tx_seq, psn) {
                    self.paths.get_mut(e).queue.pop_front();
                } else if dead || sent_at.saturating_add(rto) <= now {
                    self.paths.get_mut(e).queue.pop_front();
                    self.declare_lost(psn, now, LossCause::Timeout, now);
                    if only_oldest {
                        // The peer is heard but nothing sent after this packet came back: when the
                        // whole window went into failed paths (a rail or an uplink that a chunk is
                        // planned on, all dead) and nothing is blamed, the policy would put the copy
                        // there again, timeout after timeout (on the rail fabric with a host's NIC
                        // black-holed, one DR connection did so 649 times until its 20 s stall
                        // limit). It goes on the path proven most recently instead (a keepalive's or
                        // a probe's answer proves one); once it is acknowledged, the losses of what
                        // was sent before it are found by time and blamed on their paths
                        // (`proto_net`'s stuck-window test).
                        self.tx.retx_to_freshest = true;
                        break;
                    }
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

    /// Whether a packet sent at or after `since` is still in flight on the path proven most recently
    /// (or no path was ever proven): only then does the peer's silence since `since` say that the
    /// peer stalled. When every packet sent since went on paths without recent proof (a window
    /// planned on a rail that failed), silence is what those paths would give with the peer alive.
    fn asked_on_freshest_since(&self, since: Micros) -> bool {
        let Some(f) = self.paths.freshest(None) else { return true };
        self.paths.get(f).queue.iter().any(|t| t.sent_at >= since && self.tx.is_live(t.tx_seq, t.psn))
    }

    /// The RTO of the path's oldest packet in flight (transmission `tx_seq`, sent at `sent_at`) expired.
    ///
    /// The path is blamed (suspect, then dead; the policy hears of it) only if a packet sent after
    /// this one arrived: then other paths get through and this one does not. When nothing sent since
    /// came back, the peer or this host stalled (a descheduled process, a full receive queue) and
    /// every path would look dead at once; a probe goes out instead of the packets, the timer backs
    /// off, what was sent until the peer is heard again is not held against any path, and the peer
    /// timeout deals with a peer that is really gone.
    fn path_timeout(&mut self, entropy: u16, tx_seq: u64, sent_at: Micros, now: Micros) -> Verdict {
        self.stats.timeouts += 1;
        // Blame the path when something sent after this packet arrived (other paths get through), or
        // when no other path has packets of that age still waiting (this path is the only one stuck).
        let rto = self.paths.get(entropy).rto_us();
        // (A tail-loss probe does not count: it went out because nothing was heard, and it may have
        // landed on another broken path.)
        let probe = self.tx.tlp_tx_seq;
        let others_stuck =
            (0..self.cfg.n_paths).filter(|&o| o != entropy).any(|o| {
                self.paths.get(o).queue.front().is_some_and(|f| {
                    self.tx.is_live(f.tx_seq, f.psn) && f.sent_at <= sent_at.saturating_add(rto) && Some(f.tx_seq) != probe
                })
            });
        // "After" in sending order: a packet handed over with this one but queued behind it counts
        // (the time-based rule, which runs long before an RTO, must not count it: a batch drains
        // one packet after the other, grouped by path). Without it, an application-limited
        // connection, which sends a message as one batch and nothing until it completes, held no
        // loss revealed by a timeout against its path, never began a failure episode, and sprayed
        // every later batch into a failed spine as well (`proto_net`'s
        // `an_application_limited_connection_leaves_a_failed_spine_within_three_rtts`). (An earlier
        // build that blamed every batch mate, queued before or after, made the fault-free rail
        // fabric's PRO CCT 1.21-1.28x its bound; with this rule 1.04-1.10x in 6 runs.)
        let blame = sent_at >= self.tx.exempt_before && (self.tx.acked_tx_end > tx_seq || !others_stuck);
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
            let silent = others_stuck && self.last_heard <= sent_at && self.asked_on_freshest_since(sent_at);
            self.tx.stalled |= silent;
            self.stats.stall_timeouts += 1;
            tracing::debug!(entropy, silent, "retransmission timeout not blamed on the path");
            return if silent { Verdict::PeerSilent } else { Verdict::NotBlamed };
        }
        self.paths.timed_out(entropy, tx_seq, sent_at, self.tx.next_tx_seq, now, &mut self.stats.paths);
        Verdict::Blamed
    }
}
