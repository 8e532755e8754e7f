//! Putting DATA on the wire: the tail-loss probe, retransmissions, then new data within the window,
//! each on a path the policy picks and the path health allows.

use prism_lb::PathCtx;

use super::connection::Connection;
use super::path::TxEntry;
use super::paths::{Fitness, Paths};
use super::recovery::LossCause;
use super::sender::PktState;
use super::{Micros, MsgId, PayloadSource, Transmit, OOO_WINDOW_PKTS};
use crate::wire::{DataPacket, DataRepr, DATA_HEADER_LEN};

/// During a failure episode a packet the policy placed on an unfit path goes to the nearest fit path
/// with fewer packets than this in flight, while there is one (see `Connection::pick_path`).
const CORRECTED_IN_FLIGHT: u32 = 2;

impl Connection {
    /// The next DATA packet (the tail-loss probe, a retransmission, then new data within the window).
    pub(super) fn poll_data(&mut self, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Option<Transmit> {
        let probe = std::mem::take(&mut self.tx.tlp_due);
        self.tx.probe_pick = probe;
        let t = self.poll_data_inner(probe, now, src, out);
        self.tx.probe_pick = false;
        t
    }

    fn poll_data_inner(&mut self, probe: bool, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Option<Transmit> {
        if probe && !self.tx.has_retransmission() {
            let window_full = self.tx.next_psn() - self.tx.snd_una >= OOO_WINDOW_PKTS;
            if window_full || !self.max_new_payload(out.len()).is_some_and(|m| self.next_new_due(now, m)) {
                // No new data to probe with: send the newest packet in flight again.
                if let Some(psn) = self.tx.newest_in_flight() {
                    self.declare_lost(psn, now, LossCause::Probe, now);
                }
            } else if let Some(t) = self.poll_new_data(now, src, out) {
                self.tx.tlp_tx_seq = Some(self.tx.next_tx_seq - 1);
                return Some(t);
            }
        }
        // The probe goes out whatever the window (RFC 8985 section 7.3): when the packets that fill
        // the window were all lost and the peer is only silent, nothing else would ever leave (a
        // connection under a 2-packet window waited out 11 doubled RTOs, 102 ms, in the simulator).
        if self.tx.in_flight >= self.cfg.window_pkts && !probe {
            return None;
        }
        if self.tx.has_retransmission() {
            let psn = *self.tx.retx_queue.front().expect("has_retransmission");
            let len = self.tx.ring[(psn - self.tx.snd_una) as usize].len as usize;
            if out.len() < DATA_HEADER_LEN + len {
                tracing::warn!(buffer = out.len(), need = DATA_HEADER_LEN + len, "transmit buffer too small for a retransmission");
                if probe {
                    self.tx.tlp_due = true;
                }
                return None;
            }
            self.tx.retx_queue.pop_front();
            let probed = self.tx.ring[(psn - self.tx.snd_una) as usize].probed;
            let t = self.transmit_data(psn, true, now, src, out);
            if probed || probe {
                self.tx.tlp_tx_seq = Some(self.tx.next_tx_seq - 1);
            }
            return Some(t);
        }
        if self.tx.in_flight >= self.cfg.window_pkts {
            return None;
        }
        if self.tx.next_psn() - self.tx.snd_una >= OOO_WINDOW_PKTS {
            return None;
        }
        self.poll_new_data(now, src, out)
    }

    /// The next packet of new data, if any.
    fn poll_new_data(&mut self, now: Micros, src: &mut dyn PayloadSource, out: &mut [u8]) -> Option<Transmit> {
        let max_payload = self.chunk_capped(self.max_new_payload(out.len())?, now);
        // The next packet waits (parked) while its send's start time is not reached (`gate.rs`).
        if !self.next_new_due(now, max_payload) {
            return None;
        }
        let (rec, done) = self.gates.parked.take()?;
        if out.len() < DATA_HEADER_LEN + rec.len as usize {
            // Parked when a larger buffer was offered.
            tracing::warn!(buffer = out.len(), need = DATA_HEADER_LEN + rec.len as usize, "transmit buffer too small for new data");
            self.gates.parked = Some((rec, done));
            return None;
        }
        self.gate_passed(now);
        if done {
            self.gates.forget(rec.msg);
        }
        let psn = self.tx.push_new(rec, done, now);
        Some(self.transmit_data(psn, false, now, src, out))
    }

    /// `max_payload`, cut so that the next new packet ends where the policy's plan chunk (or run of
    /// chunks bound for the same rail and uplink) ends, at the first line boundary from there: a
    /// chunk that ends inside a line takes that line whole, so the next chunk's first packet starts
    /// on a line. A packet that crossed a chunk boundary took the next chunk's first bytes to its own
    /// chunk's rail and uplink: on the rail fabric, under Ethereal's exact split (4 MiB per uplink
    /// per flow), the uplinks of one flow carried 4.16-4.39 MB. The packet parked at a start gate
    /// was cut when it was parked.
    fn chunk_capped(&mut self, max_payload: u64, now: Micros) -> u64 {
        if self.gates.parked.is_some() {
            return max_payload;
        }
        let Some((msg, offset)) = self.tx.next_new_at() else { return max_payload };
        let ctx = PathCtx { msg: msg.0, offset, n_paths: self.cfg.n_paths, retransmit: false, avoid: None, now_us: now };
        match self.policy.chunk_end(&ctx) {
            Some(end) if end > offset => max_payload.min((end - offset).next_multiple_of(crate::wire::LINE_BYTES as u64)),
            _ => max_payload,
        }
    }

    /// The most payload a new packet in a buffer of `out_len` bytes carries: whole lines only, so every
    /// packet but a buffer's last one ends on a line boundary of the message.
    fn max_new_payload(&self, out_len: usize) -> Option<u64> {
        Some(super::config::line_floor(self.cfg.max_payload.min(out_len.checked_sub(DATA_HEADER_LEN)?)) as u64)
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
        if self.tx.in_flight == 0 {
            // Nothing in flight: the time until now was idle, not delivery.
            self.tx.delivered.1 = now;
        }
        let delivered = self.tx.delivered;
        let rec = &mut self.tx.ring[idx];
        rec.delivered_at_send = delivered;
        if retx {
            rec.prev_copy = (old.entropy, old.sent_at);
        }
        rec.state = PktState::InFlight;
        rec.probed = false;
        rec.entropy = entropy;
        rec.sent_at = now;
        rec.tx_seq = tx_seq;
        rec.resent |= retx;
        rec.in_episode = self.paths.episode_start().is_some();
        self.tx.tail_last = old.offset + u64::from(old.len) >= old.total;
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
        path.rto_floor_us = ctl_rtt.rto_us();
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
        let episode = if retransmit { self.paths.episode_start() } else { self.paths.episode() };
        let checked = self.paths.any_bad() || episode.is_some();
        // (See `TxState::retx_to_freshest`.)
        let to_freshest = retransmit && std::mem::take(&mut self.tx.retx_to_freshest);
        if n > 1 && checked && !self.tx.probe_pick && !(retransmit && (episode.is_some() || to_freshest)) {
            // A policy that walks its paths in an order (PRO) continues the walk past the unfit
            // ones: the packets it re-places spread like its other picks. Correcting its pick
            // afterwards (below) put every one whose pick was unfit on the fit path nearest after
            // it: during a failure episode, with a block of unproven paths, one path took them all.
            let Self { policy, paths, tx, .. } = self;
            let rack_rtt_us = tx.rack_rtt_us;
            let mut fit = |e: u16| e < n && Some(e) != avoid && fitness_at(paths, rack_rtt_us, e, episode, now) == Fitness::Good;
            if let Some(e) = policy.pick_fit(&ctx, None, &mut fit) {
                return e;
            }
        }
        let first = self.policy.pick(&ctx) % n;
        if n == 1 {
            return first;
        }
        if std::mem::take(&mut self.tx.probe_pick) {
            // A tail-loss probe goes out because nothing was heard for a while: when the paths the
            // packets in flight took all failed (a policy that keeps to a few paths, all behind a
            // failed link) another copy on one of them tells nothing. It goes on a fit path with
            // nothing in flight, nearest after the policy's choice, so successive probes try
            // different paths and the first that gets through reveals the losses. While the peer is
            // silent (a stall, or every path the policy picks failed: a window planned on one rail
            // when that rail's NIC dies) the search starts where control packets rotate to (a
            // stride near 0.618 of the path count, so successive probes alternate between blocks
            // of entropies and residues): starting at the policy's pick kept every probe in the
            // failed rail's block, and the peer was heard again only by a keepalive, 100-200 ms on.
            let start = if self.tx.stalled { self.paths.ctl_entropy() } else { first };
            let idle_fit = |c: &Self, e| Some(e) != avoid && c.paths.get(e).in_flight == 0 && c.paths.fitness(e, episode) == Fitness::Good;
            if let Some(e) = self.nearest_after(&ctx, start, true, &idle_fit) {
                return e;
            }
            // A chunk pinned to paths that are all alive but unproven keeps its probe there too
            // (see `pinned_unproven`): on the rail fabric most probes of Ethereal's sub-flows left
            // their uplinks this way during episodes begun by other uplinks' late packets. Not while
            // the peer is silent: then the probe searches for any path that gets through.
            if !self.tx.stalled && self.pinned_unproven(&ctx, episode, now) {
                let idle = |c: &Self, e| Some(e) != avoid && c.paths.get(e).in_flight == 0;
                if let Some(e) = self
                    .nearest_after(&ctx, start, true, &idle)
                    .or_else(|| self.nearest_after(&ctx, start, true, &|_: &Self, e| Some(e) != avoid))
                {
                    return e;
                }
            }
            if let Some(e) = self.nearest_after(&ctx, start, false, &idle_fit) {
                return e;
            }
        }
        if retransmit && (to_freshest || episode.is_some()) {
            // A retransmission during a failure episode must not be lost again: it goes on the path
            // proven most recently (the freshest evidence that a path works). A path proven only
            // shortly after the episode's start may have failed a moment later (the start is the
            // lost packet's send time; packets sent after it still crossed before the failure),
            // and the policy's nearest proven path absorbed retransmission after retransmission
            // until its own losses showed.
            let Self { policy, paths, .. } = self;
            if let Some(e) = paths.freshest_where(avoid, &mut |e| policy.allows(&ctx, None, e)).or_else(|| paths.freshest(avoid)) {
                return e;
            }
        }
        if Some(first) != avoid && (!checked || self.fitness_now(first, episode, now) == Fitness::Good) {
            return first;
        }
        let second = self.policy.pick(&PathCtx { avoid: Some(first), ..ctx }) % n;
        if Some(second) != avoid && self.fitness_now(second, episode, now) == Fitness::Good {
            return second;
        }
        // The fittest path, nearest after the policy's first choice; never the lost copy's. During a
        // failure episode, first among those with fewer than `CORRECTED_IN_FLIGHT` packets in flight:
        // a burst handed over at one instant (a window's worth) otherwise piles onto the fit path
        // after each run of unfit ones, and when that path's proof dates from just before the failure
        // (its packet of the lost one's burst crossed first; or it was admitted as one of the paths
        // proven last) the whole pile is lost on it (`proto_net`'s false-alarm test: 9 packets on one
        // failed path in one trace; over 80 seeds 4 transfers beyond 3 RTTs instead of 14).
        // (Only a path the policy allows for this chunk: a chunk pinned to an uplink keeps to it.)
        if episode.is_some() {
            if let Some(e) = self.nearest_after(&ctx, (first + 1) % n, true, &|c: &Self, e| {
                Some(e) != avoid && c.paths.get(e).in_flight < CORRECTED_IN_FLIGHT && c.fitness_now(e, episode, now) == Fitness::Good
            }) {
                return e;
            }
        }
        if self.pinned_unproven(&ctx, episode, now) {
            if Some(first) != avoid && self.policy.allows(&ctx, None, first) {
                return first;
            }
            if let Some(e) = self.nearest_after(&ctx, (first + 1) % n, true, &|_: &Self, e| Some(e) != avoid) {
                return e;
            }
        }
        if let Some(e) = self
            .nearest_after(&ctx, (first + 1) % n, false, &|c: &Self, e| Some(e) != avoid && c.fitness_now(e, episode, now) == Fitness::Good)
        {
            return e;
        }
        let mut best: Option<(Fitness, u16)> = None;
        for e in (1..n).map(|k| (first + k) % n).chain([first]) {
            if Some(e) == avoid {
                continue;
            }
            let f = self.fitness_now(e, episode, now);
            if !matches!(best, Some((bf, _)) if bf <= f) {
                best = Some((f, e));
            }
        }
        best.map_or(first, |(_, e)| e)
    }

    /// Whether the policy pins this chunk to some of the paths (Ethereal's uplink), none of them fit
    /// now and all alive but unproven (or doubtful): then its packet keeps to them (the policy's pick,
    /// else the nearest path it allows). A failure episode keeps new packets to paths proven since it
    /// began, and a pinned chunk's paths were often all unproven: its own packets still queued, the
    /// others idle, the episode begun by another uplink's late packet. Each new packet and tail-loss
    /// probe then went to a proven path of another uplink: on the rail fabric 1-31 packets per run (up
    /// to 270 KB) left the uplinks Ethereal's plan put them on, the largest part of its uplink spread
    /// (the episodes came from losses found by time, mostly spurious). When one of the chunk's paths
    /// is suspect or dead its uplink may be failing, and the packet leaves it as before.
    fn pinned_unproven(&mut self, ctx: &PathCtx, episode: Option<Micros>, now: Micros) -> bool {
        let mut pinned = false;
        for e in 0..self.cfg.n_paths {
            if !self.policy.allows(ctx, None, e) {
                pinned = true;
            } else if !matches!(self.fitness_now(e, episode, now), Fitness::Doubtful | Fitness::Unproven) {
                // A fit one is taken as usual; a suspect or dead one may mean the uplink fails.
                return false;
            }
        }
        pinned
    }

    /// The first entropy from `start` on (in entropy order, wrapping) that `ok` accepts and the policy
    /// allows for this chunk (a chunk pinned to an uplink keeps to it), else (unless `allowed_only`)
    /// the first `ok` accepts.
    fn nearest_after(&mut self, ctx: &PathCtx, start: u16, allowed_only: bool, ok: &dyn Fn(&Self, u16) -> bool) -> Option<u16> {
        let n = self.cfg.n_paths;
        let mut other = None;
        for e in (0..n).map(|k| (start + k) % n) {
            if !ok(self, e) {
                continue;
            }
            if self.policy.allows(ctx, None, e) {
                return Some(e);
            }
            other.get_or_insert(e);
        }
        other.filter(|_| !allowed_only)
    }

    /// How fit path `e` is for a packet now. During a failure episode a proven path whose oldest
    /// packet in flight left longer ago than the latest round trip (RACK's reference RTT or the
    /// path's own, whichever is larger, and a quarter more) is only doubtful: the episode dates from
    /// the lost packet's send time, packets sent after it still crossed the failing link before it
    /// failed, and such a path, proven but behind the failure, otherwise took new packets (a policy
    /// that keeps to its paths, PRO, several) until its first loss was found, a reordering window
    /// later. Nothing is declared: the path is only passed over while better ones exist.
    fn fitness_now(&self, e: u16, episode: Option<Micros>, now: Micros) -> Fitness {
        fitness_at(&self.paths, self.tx.rack_rtt_us, e, episode, now)
    }

    /// Whether new packets would go on path `entropy` now: it is alive and, during a failure episode
    /// (some paths died), it was proven to work since the episode began. A driver whose other
    /// connections share this one's paths (same source and destination address and port) can steer
    /// their control packets with it.
    pub fn path_preferred(&self, entropy: u16) -> bool {
        entropy < self.cfg.n_paths && self.paths.fitness(entropy, self.paths.episode()) == Fitness::Good
    }
}

/// How fit path `e` is for a packet now (see `Connection::fitness_now`; `rack_rtt_us` is the
/// connection's RACK reference RTT). A free function so that a pick can consult it while the
/// connection's policy is borrowed.
fn fitness_at(paths: &Paths, rack_rtt_us: u64, e: u16, episode: Option<Micros>, now: Micros) -> Fitness {
    let f = paths.fitness(e, episode);
    if f != Fitness::Good || episode.is_none() {
        return f;
    }
    let path = paths.get(e);
    let rtt = rack_rtt_us.max(path.delivered_rtt_us);
    match path.queue.front() {
        Some(oldest) if oldest.sent_at.saturating_add(rtt + rtt / 4) < now => Fitness::Doubtful,
        _ => f,
    }
}

#[cfg(test)]
mod tests {
    use prism_lb::{PathCtx, PathPolicy};

    use super::super::config::ProtoConfig;
    use super::super::connection::Connection;
    use super::super::MsgId;

    /// A chunk pinned to uplink 2 of 4 (entropies `e % 4 == 2`), as Ethereal's plan pins one: picks
    /// walk that uplink's entropies, and `allows` tells the transport so.
    struct PinnedToUplink2(u16);

    impl PathPolicy for PinnedToUplink2 {
        fn name(&self) -> &'static str {
            "pinned"
        }
        fn pick(&mut self, ctx: &PathCtx) -> u16 {
            self.0 = (self.0 + 1) % (ctx.n_paths / 4);
            4 * self.0 + 2
        }
        fn allows(&mut self, _ctx: &PathCtx, _uplink: Option<u16>, e: u16) -> bool {
            e % 4 == 2
        }
    }

    /// 64 paths; path 1 (uplink 1) lost a packet sent at 1 ms (a failure episode since then); uplink 0's
    /// paths delivered packets sent after it (proven); uplink 2's carried nothing since (unproven).
    fn conn_in_an_episode() -> Connection {
        let cfg = ProtoConfig { n_paths: 64, ..ProtoConfig::default() };
        let mut c = Connection::new(cfg, 1, 2, Box::new(PinnedToUplink2(0)), 0);
        for e in [0u16, 4, 8, 12] {
            c.paths.delivered(e, 10 + u64::from(e), 1_500, 300, 1_800, &mut c.stats.paths);
        }
        c.paths.lost(1, 5, 1_000, true, 2_000, &mut c.stats.paths);
        assert_eq!(c.paths.episode(), Some(1_000), "the loss began a failure episode");
        c
    }

    #[test]
    fn a_pinned_chunk_whose_paths_are_all_unproven_keeps_to_them_during_an_episode() {
        // On the rail fabric another uplink's late packet began an episode while this sub-flow's own
        // packets still waited in a deep queue: each new packet went to a proven path of another
        // uplink, and up to 270 KB per run left the uplinks Ethereal's plan put them on.
        let mut c = conn_in_an_episode();
        for k in 0..32 {
            let e = c.pick_path(MsgId(0), k * 8832, false, None, 2_000);
            assert_eq!(e % 4, 2, "new packet {k} left its uplink for entropy {e}");
        }
    }

    #[test]
    fn a_tail_loss_probe_of_a_pinned_chunk_whose_paths_are_all_unproven_keeps_to_them() {
        let mut c = conn_in_an_episode();
        for k in 0..8 {
            c.tx.probe_pick = true;
            let e = c.pick_path(MsgId(0), k * 8832, false, None, 2_000);
            assert_eq!(e % 4, 2, "probe {k} left its uplink for entropy {e}");
            assert_eq!(c.paths.get(e).in_flight, 0, "probe {k} on a path with packets in flight");
        }
    }

    #[test]
    fn a_pinned_chunk_leaves_its_uplink_once_one_of_its_paths_is_suspect() {
        // Its uplink may be failing: a proven path elsewhere beats losing the packet.
        let mut c = conn_in_an_episode();
        c.paths.lost(6, 7, 1_100, true, 2_100, &mut c.stats.paths);
        for k in 0..8 {
            let e = c.pick_path(MsgId(0), k * 8832, false, None, 2_100);
            assert_eq!(e % 4, 0, "new packet {k} went to {e}, not to a proven path");
            c.tx.probe_pick = true;
            let e = c.pick_path(MsgId(0), k * 8832, false, None, 2_100);
            assert_eq!(e % 4, 0, "probe {k} went to {e}, not to a proven path");
        }
    }
}
