//! The one owner of per-path state: every path's RTT, transmissions in flight and health, the
//! failure episode, probing of suspect and dead paths, and the cached retransmission deadlines. It
//! turns what the sender learns (a delivery, a loss, a timeout, a PONG) into health changes and into
//! [`Feedback`] events for the path policy, which the connection hands on in order.
//!
//! Health, in round trips (RFC 8985's spirit applied per path):
//! - **Alive**: carries new packets.
//! - **Suspect**: lost a packet while packets sent after it on other paths arrived (found by the
//!   time-based detector, one RTT and a reordering window after it left), or had a retransmission
//!   timeout. New packets and retransmissions avoid it while alive paths exist, and a probe PING goes
//!   out on it at once. A PONG, or a delivered packet sent after the loss, makes it alive again; a loss
//!   taken back (the packet was only late) too.
//! - **Dead**: a second loss in a row of a packet sent after it became suspect, `path_dead_after`
//!   timeouts in a row, or two probes unanswered for a probe wait (the connection's RTO) each. A loss of a packet older than one the path
//!   delivered counts for nothing: that is random loss on a working path. Avoided by everything; probed again after `revive_wait`
//!   (a few RTOs, doubled per unanswered probe up to `path_revive_us`), at most one dead-path probe per
//!   RTO per connection, longest-waiting first; a PONG revives it, and a revival probes every other
//!   dead path at once (the failure that killed them together may have ended together).
//!
//! While some path is suspect or dead a failure episode is going on: new packets keep to paths proven
//! to work since shortly before the first of them went bad (a failing spine takes many entropies at once, and a
//! spraying connection finds each only by losing a packet on it), or since a newer failure: a path
//! proven during the episode going bad (dying; or suspected, unless a suspicion proved false within
//! the last two RTTs, as under congestion).

use std::collections::VecDeque;

use prism_lb::Feedback;

use super::deadline::RtoDeadlines;
use super::path::{Path, Probe};
use super::rtt::RttEstimator;
use super::stats::{PathHealth, PathStats};
use super::Micros;

/// Losses in a row on one path (a timeout counts as one; a loss later found spurious is taken
/// back), with nothing sent on it after them delivered in between, that kill it. The first makes it
/// suspect (avoided and probed); a second one, typically a packet that was already in flight on it
/// behind the first, confirms it.
const LOSS_RUN_DEAD: u32 = 2;

/// During a failure episode, fewer paths proven since it began than this: other live paths are used
/// too (explored), so the connection never squeezes itself onto one or two paths.
const MIN_PROVEN_PATHS: usize = 4;

/// During a failure episode, alive paths proven since it began that a connection wants: while it
/// has fewer, it explores unproven ones with PINGs (see `Paths::next_explore`). (Exploring every
/// path instead made things worse in the simulator's rail black hole: CCT 629 -> 699 ms, three
/// times the timeouts, the PONGs' small-packet RTT samples pulling the connection's RTO down.)
const EXPLORE_TARGET: usize = 2 * MIN_PROVEN_PATHS;

/// Probes of a suspect path that must go unanswered (each for a probe wait) before it is dead: one
/// lost PING or PONG under random loss does not kill a path.
const SUSPECT_PROBES: u32 = 2;

/// A dead path's first probe waits this many probe waits (RTOs) after it died.
const FIRST_REVIVE_RTOS: u64 = 4;

/// Smoothed RTTs after a suspect path came back during which a suspicion does not date the failure
/// episode anew (`Paths::set_health`).
const FALSE_ALARM_RTTS: u64 = 2;

/// How fit a path is for a new packet, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Fitness {
    /// Alive and, during a failure episode, proven since it began.
    Good,
    /// Good, but during a failure episode its oldest packet in flight is later than the latest
    /// round trip allows (see `Connection::fitness_now`): perhaps behind the failure.
    Doubtful,
    /// Alive but not proven during the episode.
    Unproven,
    /// Suspect: lost something recently.
    Suspect,
    /// Dead.
    Dead,
}

#[derive(Debug)]
pub(crate) struct Paths {
    list: Vec<Path>,
    deadlines: RtoDeadlines,
    /// Paths dead now.
    dead: u16,
    /// Paths suspect now.
    suspect: u16,
    /// The failure episode: since when only paths proven since then carry new packets. Ends when no
    /// path is dead any more.
    episode_since: Option<Micros>,
    /// Send time of the packet whose loss was last held against its path: a death it causes dates
    /// the episode from there.
    blamed_sent_at: Option<Micros>,
    /// When a suspect path last came back (its late packet arrived, a later one did, or a probe was
    /// answered): suspicions are not reliable evidence of a failure just now.
    false_alarm_at: Option<Micros>,
    /// Paths whose probe is due, in order.
    probes_due: VecDeque<u16>,
    /// Dead-path probes are paced per connection: the next one not before this.
    next_probe_at: Micros,
    /// When the last revival (`probe_dead_paths`) queued its probes: one sent since then belongs to
    /// that round (or came later) and is not sent again by the next revival of the same burst.
    round_at: Option<Micros>,
    /// Exploring PINGs are paced per connection: the next one not before this.
    next_explore_at: Micros,
    /// Where the search for the next path to explore starts.
    explore_cursor: u16,
    /// The path whose exploring PING should go out next.
    explore_due: Option<u16>,
    /// Whether a path may be waiting to be explored: cleared when a search found none, set by every
    /// health change (the only way a candidate can appear: an episode starting or dated anew, a path
    /// coming back or a proven one going bad), so the hot path does not search every path in vain.
    explore_wanted: bool,
    ctl_rr: u16,
    /// The step of `ctl_rr` (see [`ctl_stride`]).
    ctl_stride: u16,
    path_dead_after: u32,
    path_revive_us: u64,
    /// Feedback for the path policy, in the order it happened.
    events: Vec<Feedback>,
}

/// The step between successive control packets' entropies: the number nearest `n` times the golden
/// ratio's fraction (0.618...) that has no factor in common with `n`, so the rotation still visits
/// every entropy once per `n` packets, while successive ones land far apart and every block of
/// entropies gets its share early on (the engine numbers entropies rail-major: each rail is such a
/// block, whatever the number of rails). Stepping by one walked a whole rail's block first: with a
/// rail failed, 128 keepalives in a row (12.8 s at one per 100 ms) went into it and the peer timed
/// out, and both copies of a CTS, on neighbouring entropies, went into the same rail.
fn ctl_stride(n: u16) -> u16 {
    fn gcd(a: u32, b: u32) -> u32 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    if n <= 2 {
        return 1;
    }
    let n32 = u32::from(n);
    let golden = (n32 * 618 + 500) / 1000;
    (golden..n32).chain(1..golden).find(|&s| gcd(s, n32) == 1).unwrap_or(1) as u16
}

impl Paths {
    pub(crate) fn new(n: u16, rtt: &RttEstimator, path_dead_after: u32, path_revive_us: u64) -> Self {
        Self {
            list: (0..n).map(|_| Path::new(rtt.clone())).collect(),
            deadlines: RtoDeadlines::new(n),
            dead: 0,
            suspect: 0,
            episode_since: None,
            blamed_sent_at: None,
            false_alarm_at: None,
            probes_due: VecDeque::new(),
            next_probe_at: 0,
            round_at: None,
            next_explore_at: 0,
            explore_cursor: 0,
            explore_due: None,
            explore_wanted: false,
            ctl_rr: 0,
            ctl_stride: ctl_stride(n),
            path_dead_after,
            path_revive_us,
            events: Vec::new(),
        }
    }

    pub(crate) fn len(&self) -> u16 {
        self.list.len() as u16
    }

    pub(crate) fn get(&self, e: u16) -> &Path {
        &self.list[e as usize]
    }

    /// Path `e` for changes to its transmissions or RTT (its cached deadline is recomputed).
    pub(crate) fn get_mut(&mut self, e: u16) -> &mut Path {
        self.deadlines.touch(e);
        &mut self.list[e as usize]
    }

    /// Feedback for the policy since the last call, oldest first.
    pub(crate) fn take_events(&mut self) -> std::vec::Drain<'_, Feedback> {
        self.events.drain(..)
    }

    pub(crate) fn push_event(&mut self, fb: Feedback) {
        self.events.push(fb);
    }

    /// The earliest retransmission deadline of any path (cached; only changed paths are looked at).
    pub(crate) fn earliest_rto(&mut self) -> Option<Micros> {
        self.deadlines.earliest(&self.list)
    }

    /// While a failure episode is going on, the time a path must have been proven since to carry new
    /// packets: the episode's start once enough paths were proven since then; until then the time
    /// that admits the `MIN_PROVEN_PATHS` alive paths proven most recently (the freshest evidence
    /// there is), so new packets neither squeeze onto one or two paths nor spread over every path
    /// again, half of them behind the failure. None without an episode (or without such paths).
    pub(crate) fn episode(&self) -> Option<Micros> {
        let since = self.episode_since?;
        // The MIN_PROVEN_PATHS latest proofs of alive paths, newest first.
        let mut top = [0 as Micros; MIN_PROVEN_PATHS];
        let mut n = 0;
        for t in self.list.iter().filter(|p| p.alive()).filter_map(|p| p.last_ok_sent_at) {
            if n < MIN_PROVEN_PATHS {
                top[n] = t;
                n += 1;
            } else if t > top[n - 1] {
                top[n - 1] = t;
            } else {
                continue;
            }
            top[..n].sort_unstable_by(|a, b| b.cmp(a));
        }
        (n == MIN_PROVEN_PATHS).then(|| since.min(top[n - 1]))
    }

    /// The start of the failure episode going on, however few paths were proven since: a
    /// retransmission keeps to those (it must not be lost again), even where new packets may not yet.
    pub(crate) fn episode_start(&self) -> Option<Micros> {
        self.episode_since
    }

    pub(crate) fn fitness(&self, e: u16, episode: Option<Micros>) -> Fitness {
        let p = &self.list[e as usize];
        match p.health {
            PathHealth::Dead => Fitness::Dead,
            PathHealth::Suspect => Fitness::Suspect,
            PathHealth::Alive if p.proven_in(episode) => Fitness::Good,
            PathHealth::Alive => Fitness::Unproven,
        }
    }

    /// The alive path (other than `avoid`) proven most recently, if any was.
    pub(crate) fn freshest(&self, avoid: Option<u16>) -> Option<u16> {
        self.freshest_where(avoid, &mut |_| true)
    }

    /// [`Paths::freshest`] among the entropies `allowed` accepts.
    pub(crate) fn freshest_where(&self, avoid: Option<u16>, allowed: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        self.list
            .iter()
            .enumerate()
            .filter(|&(e, p)| Some(e as u16) != avoid && p.alive() && allowed(e as u16))
            .filter_map(|(e, p)| p.last_ok_sent_at.map(|t| (t, e as u16)))
            .max_by_key(|&(t, _)| t)
            .map(|(_, e)| e)
    }

    /// Whether any path is not alive (then picks must be checked).
    pub(crate) fn any_bad(&self) -> bool {
        self.dead > 0 || self.suspect > 0
    }

    /// Round-robin over the fittest paths, for control packets, so they are not stuck on a broken one.
    pub(crate) fn ctl_entropy(&mut self) -> u16 {
        let n = self.len();
        let episode = self.episode();
        let mut best: Option<(Fitness, u16)> = None;
        for _ in 0..n {
            let e = self.ctl_rr % n;
            self.ctl_rr = ((u32::from(e) + u32::from(self.ctl_stride)) % u32::from(n)) as u16;
            let f = self.fitness(e, episode);
            if f == Fitness::Good {
                return e;
            }
            if !matches!(best, Some((bf, _)) if bf <= f) {
                best = Some((f, e));
            }
        }
        best.map_or(0, |(_, e)| e)
    }

    /// Transmission `tx_seq` on `e`, sent at `sent_at`, arrived. Sent after the path's last loss or
    /// timeout, it proves the path works: its loss run ends and it is alive again (unless dead: only a
    /// probe revives a dead path, since late packets from before the failure prove nothing).
    pub(crate) fn delivered(&mut self, e: u16, tx_seq: u64, sent_at: Micros, rtt_us: u64, now: Micros, ps: &mut [PathStats]) {
        let p = &mut self.list[e as usize];
        p.last_ok_sent_at = Some(p.last_ok_sent_at.map_or(sent_at, |t| t.max(sent_at)));
        if tx_seq >= p.delivered_tx_end {
            p.delivered_tx_end = tx_seq + 1;
            p.delivered_rtt_us = rtt_us;
        }
        if tx_seq > p.last_loss_tx_seq {
            p.consecutive_losses = 0;
        }
        if p.timeout_tx_seq.is_some_and(|t| tx_seq < t) {
            return;
        }
        p.consecutive_timeouts = 0;
        if p.health == PathHealth::Suspect && p.consecutive_losses == 0 {
            self.set_health(e, PathHealth::Alive, now, ps);
        }
    }

    /// A loss on `e` turned out to be a late arrival: take it back.
    pub(crate) fn loss_taken_back(&mut self, e: u16, now: Micros, ps: &mut [PathStats]) {
        let p = &mut self.list[e as usize];
        p.consecutive_losses = p.consecutive_losses.saturating_sub(1);
        if p.health == PathHealth::Suspect && p.consecutive_losses == 0 && p.consecutive_timeouts == 0 {
            self.set_health(e, PathHealth::Alive, now, ps);
        }
    }

    /// Transmission `tx_seq` on `e`, sent at `sent_at`, was found lost by the time-based detector or
    /// the reorder count while later packets arrived. `blame`: the loss says something about the path
    /// (not a stall of the peer).
    pub(crate) fn lost(&mut self, e: u16, tx_seq: u64, sent_at: Micros, blame: bool, now: Micros, ps: &mut [PathStats]) {
        let p = &mut self.list[e as usize];
        p.last_loss_tx_seq = p.last_loss_tx_seq.max(tx_seq);
        if !blame || p.delivered_tx_end > tx_seq {
            // A stall, or a packet sent after it on the same path arrived (random loss on a path
            // that works): nothing against the path.
            return;
        }
        if p.health == PathHealth::Suspect && sent_at <= p.bad_since {
            // Already in flight when the path became suspect: the same event (a burst) as the loss
            // that made it so. Whether it works is for its probes to tell.
            return;
        }
        p.consecutive_losses += 1;
        self.blamed_sent_at = Some(sent_at);
        if p.consecutive_losses >= LOSS_RUN_DEAD && p.health != PathHealth::Dead {
            tracing::debug!(entropy = e, run = p.consecutive_losses, "path lost every recent packet");
            self.set_health(e, PathHealth::Dead, now, ps);
        } else if p.health == PathHealth::Alive {
            self.set_health(e, PathHealth::Suspect, now, ps);
        }
    }

    /// The RTO of `e`'s oldest packet in flight (transmission `tx_seq`, sent at `sent_at`) expired and
    /// the path is blamed for it. `next_tx_seq`: transmissions from here on were sent after it.
    pub(crate) fn timed_out(&mut self, e: u16, tx_seq: u64, sent_at: Micros, next_tx_seq: u64, now: Micros, ps: &mut [PathStats]) {
        let p = &mut self.list[e as usize];
        p.consecutive_timeouts += 1;
        p.consecutive_losses += 1;
        p.last_loss_tx_seq = p.last_loss_tx_seq.max(tx_seq);
        p.timeout_tx_seq = Some(next_tx_seq);
        self.blamed_sent_at = Some(sent_at);
        self.events.push(Feedback::Timeout {
            entropy: Some(e),
            max_rtt_us: p.max_rtt_since_timeout_us,
            base_rtt_us: p.base_rtt_us.unwrap_or(0),
            now_us: now,
        });
        p.max_rtt_since_timeout_us = 0;
        let dead = p.consecutive_timeouts >= self.path_dead_after || p.consecutive_losses >= LOSS_RUN_DEAD;
        tracing::debug!(entropy = e, consecutive = p.consecutive_timeouts, "retransmission timeout");
        if p.health != PathHealth::Dead {
            self.set_health(e, if dead { PathHealth::Dead } else { PathHealth::Suspect }, now, ps);
        }
    }

    /// Transmission `tx_seq` on alive path `e` is overdue while later packets on other paths arrived:
    /// suspect (avoided and probed) unless the path delivered a later packet of its own.
    pub(crate) fn overdue(&mut self, e: u16, tx_seq: u64, sent_at: Micros, now: Micros, ps: &mut [PathStats]) {
        let p = &self.list[e as usize];
        if p.health == PathHealth::Alive && p.delivered_tx_end <= tx_seq {
            self.blamed_sent_at = Some(sent_at);
            self.set_health(e, PathHealth::Suspect, now, ps);
        }
    }

    /// A PONG echoing `ts` (the PING's timestamp, low 32 bits of its send time) answered a PING on
    /// `e`: it works. An exploring PING's answer proves the path from the PING's send time on.
    pub(crate) fn pong(&mut self, e: u16, ts: u32, now: Micros, ps: &mut [PathStats]) {
        let Some(p) = self.list.get_mut(e as usize) else { return };
        if let Some(at) = p.explored_at.filter(|&at| at as u32 == ts) {
            p.explored_at = None;
            if p.health == PathHealth::Alive {
                p.last_ok_sent_at = Some(p.last_ok_sent_at.map_or(at, |t| t.max(at)));
                return;
            }
        }
        let Probe::Sent(at) = p.probe else {
            // A keepalive's answer (neither an exploring PING's nor a probe's): the path carried a
            // PING and its PONG just now, the freshest evidence a silent window may have (a
            // retransmission after a timeout nobody is blamed for goes on the path proven last).
            if p.health == PathHealth::Alive {
                let sent = now.saturating_sub(u64::from((now as u32).wrapping_sub(ts)));
                p.last_ok_sent_at = Some(p.last_ok_sent_at.map_or(sent, |t| t.max(sent)));
            }
            return;
        };
        let revived = p.health == PathHealth::Dead;
        p.consecutive_timeouts = 0;
        p.consecutive_losses = 0;
        p.timeout_tx_seq = None;
        p.probe = Probe::Idle;
        p.revive_wait = 0;
        p.last_ok_sent_at = Some(p.last_ok_sent_at.map_or(at, |t| t.max(at)));
        self.set_health(e, PathHealth::Alive, now, ps);
        if revived {
            self.probe_dead_paths(at, now);
        }
    }

    /// A dead path answered a probe sent at `since` (the answer came at `now`): whatever killed it
    /// had ended by then, and it may have killed the other dead paths too (a spine failure takes many
    /// entropies at once), so each of them is probed now rather than one per RTO in turn after waits
    /// of up to `path_revive_us`. A probe of theirs sent before `since` may have died in the same
    /// failure and is sent again, unless it left after the previous revival (the answers to one
    /// round come back one by one, each a revival). One PING per dead path per round: a path that
    /// stays dead backs off as usual when it goes unanswered.
    fn probe_dead_paths(&mut self, since: Micros, now: Micros) {
        let round_at = self.round_at;
        for (e, p) in self.list.iter_mut().enumerate() {
            if p.health != PathHealth::Dead {
                continue;
            }
            let again = match p.probe {
                Probe::Idle => true,
                Probe::Sent(t) => t < since && round_at.is_none_or(|r| t < r),
                Probe::Due => false,
            };
            if again {
                p.probe = Probe::Due;
                self.probes_due.push_back(e as u16);
            }
        }
        self.round_at = Some(now);
    }

    /// A path went bad whose failure began when a packet sent at `since` left. The first starts the
    /// failure episode. A path that had been proven during the episode going bad means a failure
    /// newer than the episode's start: the proof of every path that delivered before `since` is
    /// stale (a spine that fails while an earlier episode lingers, a congestion loss's dead path
    /// not yet revived, takes paths that worked after that episode began), so the episode is dated
    /// from the newer failure (`redate`, see `set_health` for when).
    fn date_episode(&mut self, since: Micros, redate: bool) {
        match self.episode_since {
            None => self.episode_since = Some(since),
            Some(t) if redate && since > t => self.episode_since = Some(since),
            Some(_) => {}
        }
    }

    /// Move a path to a new health state, telling the policy when it dies or comes back.
    fn set_health(&mut self, e: u16, health: PathHealth, now: Micros, ps: &mut [PathStats]) {
        let was = self.list[e as usize].health;
        if was == health {
            return;
        }
        self.explore_wanted = true;
        match was {
            PathHealth::Dead => self.dead -= 1,
            PathHealth::Suspect => self.suspect -= 1,
            PathHealth::Alive => {}
        }
        match health {
            PathHealth::Dead => self.dead += 1,
            PathHealth::Suspect => self.suspect += 1,
            PathHealth::Alive => {}
        }
        if health != PathHealth::Alive {
            // The failure had begun when the packet whose loss revealed it was sent: a path that
            // delivered a packet sent after that works. (Without such a loss, an RTO before now.)
            // (Taken: a packet blamed long ago, whose loss changed no state, must not date a later
            // failure; from then on every path that delivered anything looked proven, dead ones
            // included.)
            let p = &self.list[e as usize];
            let since = self.blamed_sent_at.take().unwrap_or(now.saturating_sub(p.rtt.rto_us()));
            // A suspicion dates the episode anew only while suspicions have been right lately: under
            // congestion, packets late behind queues make paths suspect all the time and most come
            // back, and when every such suspicion moved the episode's start to its packet only the
            // few paths proven since then (`MIN_PROVEN_PATHS`) carried new packets, whose queues
            // then overflowed (the simulator's 128-host permutation with host spraying at 4 MiB:
            // 2.1x the bound instead of 1.2x). A death always does. (Only deaths: on the rail
            // fabric the black hole's bytes left the dead spine beyond 3 RTTs on 4 of 32 first
            // tries, against 0 of 40 with every suspicion; `docs/fabric.md`.)
            let quiet =
                self.false_alarm_at.is_none_or(|t| now.saturating_sub(t) > FALSE_ALARM_RTTS * p.rtt.srtt_us().unwrap_or(p.rtt.rto_us()));
            let redate = (health == PathHealth::Dead || quiet) && self.episode_since.is_some_and(|t| p.proven_since(t));
            self.date_episode(since, redate);
        }
        if was == PathHealth::Suspect && health == PathHealth::Alive {
            self.false_alarm_at = Some(now);
        }
        let p = &mut self.list[e as usize];
        p.health = health;
        ps[e as usize].state = health;
        ps[e as usize].state_changes += 1;
        match health {
            PathHealth::Dead => {
                p.bad_since = now;
                if !matches!(p.probe, Probe::Sent(_)) {
                    p.probe = Probe::Idle;
                }
                tracing::info!(entropy = e, timeouts = p.consecutive_timeouts, losses = p.consecutive_losses, "path marked dead");
                self.events.push(Feedback::PathState { entropy: e, alive: false, now_us: now });
            }
            PathHealth::Suspect => {
                // A failing spine takes many entropies at once and a spraying connection finds each
                // only by losing a packet on it: from the first suspicion on, new packets keep to paths
                // proven since (shortly before) it (`date_episode` above).
                p.bad_since = now;
                p.probe_failures = 0;
                if p.probe == Probe::Idle {
                    p.probe = Probe::Due;
                    self.probes_due.push_back(e);
                }
            }
            PathHealth::Alive => {
                p.probe = Probe::Idle;
                p.revive_wait = 0;
                if was == PathHealth::Dead {
                    tracing::info!(entropy = e, "path alive again");
                    self.events.push(Feedback::PathState { entropy: e, alive: true, now_us: now });
                }
            }
        }
        if self.dead == 0 && self.suspect == 0 {
            self.episode_since = None;
        }
    }

    /// The next probe to send, if one is due: the path is marked probed at `now`.
    pub(crate) fn next_probe(&mut self, now: Micros, ps: &mut [PathStats]) -> Option<u16> {
        while let Some(e) = self.probes_due.pop_front() {
            let p = &mut self.list[e as usize];
            if p.probe == Probe::Due && p.health != PathHealth::Alive {
                p.probe = Probe::Sent(now);
                ps[e as usize].probes_sent += 1;
                return Some(e);
            }
            if p.probe == Probe::Due {
                p.probe = Probe::Idle;
            }
        }
        None
    }

    /// The next alive path to explore, if the connection should: a failure episode is going on,
    /// fewer than `EXPLORE_TARGET` alive paths were proven since it began, and some alive path was
    /// neither proven nor explored since then.
    fn explore_candidate(&self) -> Option<u16> {
        let since = self.episode_since?;
        if self.list.iter().filter(|p| p.alive() && p.proven_since(since)).take(EXPLORE_TARGET).count() >= EXPLORE_TARGET {
            return None;
        }
        let n = self.len();
        (0..n).map(|k| (self.explore_cursor + k) % n).find(|&e| {
            let p = &self.list[e as usize];
            p.alive() && !p.proven_since(since) && p.explored_at.is_none_or(|t| t < since)
        })
    }

    /// During a failure episode, queue the next alive path to explore with a PING, one per `pace`:
    /// new packets keep to proven paths (or, until there are enough, to those proven last), and only
    /// a PING finds out whether an unproven one works without losing data on it when it does not
    /// (half of them, behind a failed spine). Each path is explored once per episode start; its
    /// PONG proves it (`pong`).
    pub(crate) fn schedule_explore(&mut self, now: Micros, pace: Micros) {
        if !self.explore_wanted || now < self.next_explore_at || self.explore_due.is_some() {
            return;
        }
        match self.explore_candidate() {
            Some(e) => {
                self.explore_cursor = (e + 1) % self.len();
                self.explore_due = Some(e);
                self.next_explore_at = now.saturating_add(pace);
            }
            None => self.explore_wanted = false,
        }
    }

    /// The exploring PING to send now, if one is queued (`schedule_explore`).
    pub(crate) fn next_explore(&mut self, now: Micros, ps: &mut [PathStats]) -> Option<u16> {
        let e = self.explore_due.take()?;
        self.list[e as usize].explored_at = Some(now);
        ps[e as usize].probes_sent += 1;
        Some(e)
    }

    /// When the next exploring PING should be queued, if there is one to send and none is waiting
    /// to go out.
    pub(crate) fn explore_deadline(&self) -> Option<Micros> {
        if !self.explore_wanted || self.explore_due.is_some() {
            return None;
        }
        self.explore_candidate().map(|_| self.next_explore_at)
    }

    /// No exploring PING is queued, and none can be until a health change wants one
    /// (`schedule_explore` does nothing).
    pub(crate) fn explore_idle(&self) -> bool {
        !self.explore_wanted && self.explore_due.is_none()
    }

    /// Probes not yet sent.
    pub(crate) fn probe_pending(&self) -> bool {
        !self.probes_due.is_empty()
    }

    /// When a probe timer expires: a probe went unanswered, or a dead path's next probe comes due.
    /// `probe_wait`: how long a probe may take (the connection's RTO).
    pub(crate) fn timer_deadline(&self, probe_wait: Micros) -> Option<Micros> {
        if self.dead == 0 && self.suspect == 0 {
            return None;
        }
        self.list
            .iter()
            .filter(|p| p.health != PathHealth::Alive)
            .filter_map(|p| match p.probe {
                Probe::Sent(at) => Some(at.saturating_add(probe_wait)),
                Probe::Idle if p.health == PathHealth::Dead => {
                    Some(p.bad_since.saturating_add(self.revive_wait(p, probe_wait)).max(self.next_probe_at))
                }
                Probe::Idle | Probe::Due => None,
            })
            .min()
    }

    fn revive_wait(&self, p: &Path, probe_wait: Micros) -> Micros {
        if p.revive_wait == 0 {
            (FIRST_REVIVE_RTOS * probe_wait).min(self.path_revive_us)
        } else {
            p.revive_wait
        }
    }

    /// Run the probe timers: an unanswered probe makes a suspect path dead and backs off a dead one's
    /// next probe; the longest-waiting dead path whose probe time came gets one, paced per connection.
    /// A probe unanswered while nothing at all was heard from the peer since it left (`last_heard`)
    /// says nothing about the path: the peer stalled; it is simply sent again.
    pub(crate) fn on_timers(&mut self, now: Micros, probe_wait: Micros, last_heard: Micros, ps: &mut [PathStats]) {
        if self.dead == 0 && self.suspect == 0 {
            return;
        }
        let mut next: Option<(Micros, u16)> = None;
        for e in 0..self.len() {
            let wait = self.revive_wait(&self.list[e as usize], probe_wait);
            let p = &mut self.list[e as usize];
            match (p.health, p.probe) {
                (PathHealth::Alive, _) => {}
                (health, Probe::Sent(at)) if at.saturating_add(probe_wait) <= now => {
                    p.probe = Probe::Idle;
                    if last_heard <= at && health == PathHealth::Suspect {
                        p.probe = Probe::Due;
                        self.probes_due.push_back(e);
                    } else if health == PathHealth::Dead {
                        p.revive_wait = wait.saturating_mul(2).min(self.path_revive_us.max(wait));
                        p.bad_since = now;
                    } else {
                        p.probe_failures += 1;
                        if p.probe_failures >= SUSPECT_PROBES {
                            tracing::debug!(entropy = e, "probes of a suspect path unanswered");
                            self.blamed_sent_at = None;
                            self.set_health(e, PathHealth::Dead, now, ps);
                        } else {
                            p.probe = Probe::Due;
                            self.probes_due.push_back(e);
                        }
                    }
                }
                (PathHealth::Dead, Probe::Idle) => {
                    let due = p.bad_since.saturating_add(wait);
                    if due <= now && !matches!(next, Some((d, _)) if d <= due) {
                        next = Some((due, e));
                    }
                }
                _ => {}
            }
        }
        if let Some((_, e)) = next.filter(|_| self.next_probe_at <= now) {
            let p = &mut self.list[e as usize];
            if p.revive_wait == 0 {
                p.revive_wait = (FIRST_REVIVE_RTOS * probe_wait).min(self.path_revive_us);
            }
            p.probe = Probe::Due;
            self.probes_due.push_back(e);
            self.next_probe_at = now.saturating_add(probe_wait);
        }
    }

    /// Forget every transmission in flight (the connection died).
    pub(crate) fn clear_in_flight(&mut self, ps: &mut [PathStats]) {
        self.deadlines.touch_all();
        self.probes_due.clear();
        for (p, s) in self.list.iter_mut().zip(ps) {
            p.queue.clear();
            p.in_flight = 0;
            s.in_flight = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four paths, each of which delivered a packet sent at `t` (transmission `e`) with an RTT of
    /// 500 µs, so all are proven from `t` on.
    fn proven_at(t: Micros) -> (Paths, Vec<PathStats>) {
        let rtt = RttEstimator::new(100, 1_000_000, 1_000);
        let mut paths = Paths::new(4, &rtt, 3, 100_000);
        let mut ps = vec![PathStats::default(); 4];
        for e in 0..4u16 {
            paths.get_mut(e).rtt.sample(500);
            paths.delivered(e, u64::from(e), t, 500, t + 500, &mut ps);
        }
        (paths, ps)
    }

    #[test]
    fn a_suspicion_of_a_path_proven_during_the_episode_dates_it_anew_while_suspicions_were_right() {
        let (mut paths, mut ps) = proven_at(1_000);
        // Transmission 10 on path 0, sent at 500, is overdue while later ones on other paths arrived.
        paths.overdue(0, 10, 500, 2_000, &mut ps);
        assert_eq!(paths.get(0).health, PathHealth::Suspect);
        assert_eq!(paths.episode_start(), Some(500), "the first suspicion dates the episode from its packet");
        // Path 1, proven (at 1,000) after the episode began, goes bad: a newer failure (a spine
        // failing while an earlier episode lingers); no suspicion has turned out wrong.
        paths.overdue(1, 20, 1_500, 3_000, &mut ps);
        assert_eq!(paths.episode_start(), Some(1_500));
    }

    #[test]
    fn after_a_suspect_path_came_back_only_a_death_dates_the_episode_anew() {
        let (mut paths, mut ps) = proven_at(1_000);
        paths.overdue(0, 10, 500, 2_000, &mut ps);
        // A packet sent before the episode's start does not move it; path 3 keeps the episode going.
        paths.overdue(3, 40, 400, 2_050, &mut ps);
        assert_eq!(paths.episode_start(), Some(500));
        // Path 0's packet was only late (behind a queue): it arrived, and the path is alive again.
        paths.delivered(0, 10, 500, 1_600, 2_100, &mut ps);
        assert_eq!(paths.get(0).health, PathHealth::Alive);
        // Within two SRTTs (1 ms) of that false alarm, a suspicion of a path proven during the
        // episode is what congestion does: the episode keeps its start.
        paths.overdue(1, 20, 1_500, 2_200, &mut ps);
        assert_eq!(paths.get(1).health, PathHealth::Suspect);
        assert_eq!(paths.episode_start(), Some(500), "a suspicion right after a false alarm must not move the episode's start");
        // Path 2, proven at 1,000, loses a packet and then one sent after it became suspect: it
        // died, a failure newer than the episode's start.
        paths.lost(2, 30, 1_200, true, 2_300, &mut ps);
        assert_eq!(paths.get(2).health, PathHealth::Suspect);
        assert_eq!(paths.episode_start(), Some(500), "its suspicion alone does not");
        paths.lost(2, 31, 2_400, true, 3_000, &mut ps);
        assert_eq!(paths.get(2).health, PathHealth::Dead);
        assert_eq!(paths.episode_start(), Some(2_400), "the death dates the episode from the packet that confirmed it");
    }

    #[test]
    fn control_packets_step_across_rails_and_still_visit_every_entropy() {
        for n in [1u16, 2, 3, 4, 16, 32, 96, 128, 256, 384, 1024, 4096] {
            let s = ctl_stride(n);
            let mut seen = vec![false; n as usize];
            let mut e = 0u32;
            for _ in 0..n {
                seen[e as usize] = true;
                e = (e + u32::from(s)) % u32::from(n);
            }
            assert!(seen.iter().all(|&x| x), "n {n}, stride {s}: not every entropy visited");
        }
        // 2 to 8 rails of 128 entropies: within the first 64 control packets every rail gets its
        // share (at least half of an even one) and none gets more than 3 in a row.
        for rails in [2u32, 3, 4, 8] {
            let n = rails * 128;
            let s = u32::from(ctl_stride(n as u16));
            let seq: Vec<u32> = (0..64u32).map(|k| (k * s % n) / 128).collect();
            for r in 0..rails {
                let hits = seq.iter().filter(|&&x| x == r).count() as u32;
                assert!(hits >= 64 / rails / 2, "{rails} rails: rail {r} got {hits} of 64: {seq:?}");
            }
            let longest = seq.chunk_by(|a, b| a == b).map(|c| c.len()).max().unwrap();
            assert!(longest <= 3, "{rails} rails: {longest} in a row on one rail: {seq:?}");
        }
    }
}
