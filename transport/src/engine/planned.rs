//! The path policy a comm hands to `proto`: it follows the lb runtime's plan of each message.
//!
//! A comm spans every rail. Its entropies are numbered rail-major: entropy `e` is source port
//! `e % paths` of rail `e / paths`, so proto's per-entropy timers and states cover every rail and a dead
//! rail simply shows up as dead entropies. For each packet this policy finds the plan chunk holding the
//! packet's offset (rail layer: which rail; split layer: which uplink) and asks that rail's path policy
//! (PRO, REPS, spray, ...) for an entropy on that uplink.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use prism_lb::{Feedback, FlowInfo, LbRuntime, PathCtx, PathPolicy, Plan, RateController};

/// A plan reduced to what a pick needs, sorted by offset.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChunkMap {
    /// (offset, end, rail, uplink), sorted by offset, covering the message.
    spans: Vec<(u64, u64, u16, Option<u16>)>,
    /// Per span: where the run of adjacent spans with its rail and uplink ends (a packet may cross
    /// the chunk boundaries inside a run, which change nothing about where it goes).
    run_ends: Vec<u64>,
    /// Ethereal's start jitter: (offset, not before) in engine µs, sorted by offset, one entry where the
    /// start time changes; empty when no chunk has a start delay.
    starts: Vec<(u64, u64)>,
}

impl ChunkMap {
    /// The plan made at `planned_us`: chunk start delays count from then.
    pub fn from_plan(plan: &Plan, planned_us: u64) -> Self {
        let mut spans: Vec<_> = plan.chunks.iter().map(|c| (c.offset, c.offset + u64::from(c.len), c.rail, c.uplink)).collect();
        spans.sort_unstable_by_key(|s| s.0);
        let mut starts = Vec::new();
        if plan.chunks.iter().any(|c| c.start_after_us > 0) {
            let mut by_offset: Vec<(u64, u64)> =
                plan.chunks.iter().map(|c| (c.offset, planned_us.saturating_add(u64::from(c.start_after_us)))).collect();
            by_offset.sort_unstable_by_key(|s| s.0);
            for s in by_offset {
                if starts.last().is_none_or(|l: &(u64, u64)| l.1 != s.1) {
                    starts.push(s);
                }
            }
        }
        let mut run_ends = vec![0; spans.len()];
        for i in (0..spans.len()).rev() {
            let s = spans[i];
            run_ends[i] = match spans.get(i + 1) {
                Some(n) if n.0 == s.1 && (n.2, n.3) == (s.2, s.3) => run_ends[i + 1],
                _ => s.1,
            };
        }
        Self { spans, run_ends, starts }
    }

    /// (offset, not before) for `Connection::set_send_starts` (empty: no chunk waits).
    pub fn starts(&self) -> &[(u64, u64)] {
        &self.starts
    }

    /// Bytes per (rail, pinned uplink); `None` for chunks the path layer may send on any uplink.
    pub fn uplinks(&self) -> impl Iterator<Item = ((u16, Option<u16>), u64)> + '_ {
        self.spans.iter().map(|s| ((s.2, s.3), s.1 - s.0))
    }

    /// Sub-flows of the message: its distinct (rail, uplink) pairs.
    pub fn subflows(&self) -> usize {
        let mut v: Vec<(u16, Option<u16>)> = self.spans.iter().map(|s| (s.2, s.3)).collect();
        v.sort_unstable();
        v.dedup();
        v.len()
    }

    fn at(&self, offset: u64) -> Option<(u16, Option<u16>)> {
        let i = self.spans.partition_point(|s| s.0 <= offset).checked_sub(1)?;
        let s = self.spans[i];
        (offset < s.1 || s.0 == s.1).then_some((s.2, s.3))
    }

    /// Where the run of adjacent spans with the rail and uplink of the span holding `offset` ends, if
    /// a span holds it.
    fn end_at(&self, offset: u64) -> Option<u64> {
        let i = self.spans.partition_point(|s| s.0 <= offset).checked_sub(1)?;
        (offset < self.spans[i].1).then_some(self.run_ends[i])
    }

    /// Where proto's packets, cut at `pkt` bytes from `from` on and at the end of every run of spans
    /// (rounded up to a line, `Connection::chunk_capped`), first stop lying on the grid of `pkt` from
    /// `from`: the first run end before `total` at a distance from `from` that is not a whole number
    /// of packets. Up to there every packet is `pkt` bytes; the one that ends there is shorter.
    pub(crate) fn layout_break(&self, from: u64, pkt: u64, total: u64) -> Option<u64> {
        let i = self.spans.partition_point(|s| s.1 <= from);
        let line = crate::wire::LINE_BYTES as u64;
        self.run_ends
            .get(i..)?
            .iter()
            .map(|e| e.next_multiple_of(line))
            .filter(|&e| e > from && e < total)
            .find(|&e| !(e - from).is_multiple_of(pkt.max(1)))
    }

    /// Bytes per rail (for stats and tests).
    pub fn rails(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        self.spans.iter().map(|s| (s.2, s.1 - s.0))
    }
}

/// Plans of the messages in flight on one comm, by proto message id.
pub(crate) type Plans = Arc<Mutex<HashMap<u64, ChunkMap>>>;

/// The comm's rate controller (`PRISM_CC`), fed by the path feedback and read by the engine.
pub(crate) type SharedRate = Arc<Mutex<Box<dyn RateController>>>;

/// A run of new packets of one message kept on one entropy (see [`PlannedPaths::with_train`]).
#[derive(Debug, Clone, Copy)]
struct Train {
    msg: u64,
    /// Offsets `start..end` of the message: the run's bytes, within one plan span.
    start: u64,
    end: u64,
    /// The plan span (rail, uplink) the run lies in.
    span: (u16, Option<u16>),
    entropy: u16,
}

/// One policy per rail, steered by the plans.
pub(crate) struct PlannedPaths {
    paths: u16,
    home: u16,
    rails: Vec<Box<dyn PathPolicy>>,
    plans: Plans,
    rate: Option<SharedRate>,
    /// Bytes of a message's new packets kept on one entropy (0: every packet picked on its own).
    train_bytes: u64,
    train: Option<Train>,
}

impl PlannedPaths {
    /// Path policies for a comm to `dst_host` whose home (NCCL device) rail is `home`.
    pub fn new(rt: &LbRuntime, dst_host: usize, rails: u16, paths: u16, home: u16, seed: u64, plans: Plans) -> Self {
        let rails = (0..rails).map(|rail| rt.path_policy(FlowInfo { dst_host, rail }, seed ^ (u64::from(rail) << 48))).collect();
        Self { paths, home, rails, plans, rate: None, train_bytes: 0, train: None }
    }

    /// Keep a message's new packets on one entropy for `bytes` of its offsets at a time (within one
    /// plan span, and while the entropy is fit): the UDP backend sends a socket's consecutive
    /// datagrams of equal size as one GSO train, so picking every datagram on its own made trains of
    /// about `batch / paths` datagrams and one `sendmsg` per few datagrams. The policy is asked once
    /// per run: PRO's walk and DR's rotation step per run, spraying draws per run.
    pub fn with_train(mut self, bytes: u64) -> Self {
        self.train_bytes = bytes;
        self
    }

    fn span_at(&self, ctx: &PathCtx) -> (u16, Option<u16>) {
        let (rail, uplink) = self.plans.lock().get(&ctx.msg).and_then(|m| m.at(ctx.offset)).unwrap_or((self.home, None));
        (rail.min(self.rails.len() as u16 - 1), uplink)
    }

    /// The entropy of the run this new packet continues, if it continues one.
    fn train_for(&self, ctx: &PathCtx, span: (u16, Option<u16>)) -> Option<u16> {
        let t = self.train?;
        (!ctx.retransmit
            && t.msg == ctx.msg
            && (t.start..t.end).contains(&ctx.offset)
            && t.span == span
            && ctx.avoid != Some(t.entropy)
            && t.entropy < ctx.n_paths)
            .then_some(t.entropy)
    }

    /// A new packet at `ctx.offset` went on `entropy` as the first of a run.
    fn start_train(&mut self, ctx: &PathCtx, span: (u16, Option<u16>), entropy: u16) {
        if self.train_bytes == 0 || ctx.retransmit {
            return;
        }
        let start = ctx.offset;
        self.train = Some(Train { msg: ctx.msg, start, end: start.saturating_add(self.train_bytes), span, entropy });
    }

    /// `ctx` as rail `rail`'s policy sees it: its own entropies, and the entropy to avoid only if it
    /// is one of them.
    fn rail_ctx(&self, ctx: &PathCtx, rail: u16) -> PathCtx {
        let avoid = ctx.avoid.and_then(|a| {
            let (r, e) = self.split(a);
            (r == rail as usize).then_some(e)
        });
        PathCtx { n_paths: self.paths, avoid, ..*ctx }
    }

    fn pick_in(&mut self, ctx: &PathCtx, span: (u16, Option<u16>)) -> u16 {
        let (rail, uplink) = span;
        let inner = self.rail_ctx(ctx, rail);
        let e = self.rails[rail as usize].pick_for(&inner, uplink) % self.paths;
        rail * self.paths + e
    }

    /// Also report every feedback event to `rate` (packet delays for MCC).
    pub fn with_rate(mut self, rate: SharedRate) -> Self {
        self.rate = Some(rate);
        self
    }

    fn split(&self, e: u16) -> (usize, u16) {
        ((e / self.paths) as usize, e % self.paths)
    }
}

impl PathPolicy for PlannedPaths {
    fn name(&self) -> &'static str {
        self.rails.first().map_or("planned", |p| p.name())
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        let span = self.span_at(ctx);
        if let Some(e) = self.train_for(ctx, span) {
            return e;
        }
        let e = self.pick_in(ctx, span);
        self.start_train(ctx, span, e);
        e
    }

    fn pick_fit(&mut self, ctx: &PathCtx, _uplink: Option<u16>, fit: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        let span = self.span_at(ctx);
        if let Some(e) = self.train_for(ctx, span).filter(|&e| fit(e)) {
            return Some(e);
        }
        let (rail, uplink) = span;
        let inner = self.rail_ctx(ctx, rail);
        let base = rail * self.paths;
        if let Some(e) = self.rails[rail as usize].pick_fit(&inner, uplink, &mut |e| fit(base + e)) {
            let e = base + e % self.paths;
            self.start_train(ctx, span, e);
            return Some(e);
        }
        if (0..self.paths).any(|e| fit(base + e)) {
            return None;
        }
        // No entropy of the chunk's rail is fit: the rail is failing (this host's NIC, its link or
        // its leaf, or the peer's). The packet goes to the next rail with a fit entropy, picked by
        // that rail's own policy (unpinned: an uplink is a rail's own), so a dead rail's share
        // spreads over the other rails' paths as their own chunks do. Left to the transport's
        // correction, every such packet went to the fit entropy nearest after the pick: the first
        // of the next rail, one path carrying the dead rail's whole share.
        // A policy without an order of its own (`pick_fit` is `None`: spraying, REPS) is corrected
        // within that rail, to the fit entropy nearest after its pick.
        let n = self.rails.len() as u16;
        for k in 1..n {
            let r = (rail + k) % n;
            let b = r * self.paths;
            let inner = self.rail_ctx(ctx, r);
            let policy = &mut self.rails[r as usize];
            let local = policy.pick_fit(&inner, None, &mut |e| fit(b + e)).map(|e| e % self.paths).or_else(|| {
                let first = policy.pick_for(&inner, None) % self.paths;
                (0..self.paths).map(|j| (first + j) % self.paths).find(|&e| fit(b + e))
            });
            if let Some(e) = local {
                self.start_train(ctx, span, b + e);
                return Some(b + e);
            }
        }
        None
    }

    fn chunk_end(&mut self, ctx: &PathCtx) -> Option<u64> {
        self.plans.lock().get(&ctx.msg).and_then(|m| m.end_at(ctx.offset))
    }

    fn allows(&mut self, ctx: &PathCtx, _uplink: Option<u16>, e: u16) -> bool {
        let (rail, uplink) = self.span_at(ctx);
        if uplink.is_none() {
            // Unpinned chunks may be placed anywhere, as before pinning existed.
            return true;
        }
        let (r, local) = self.split(e);
        let inner = self.rail_ctx(ctx, rail);
        r == rail as usize && self.rails.get_mut(r).is_some_and(|p| p.allows(&inner, uplink, local))
    }

    fn feedback(&mut self, fb: &Feedback) {
        if let Some(rate) = &self.rate {
            rate.lock().feedback(fb);
        }
        let Some(entropy) = fb.entropy() else {
            // A timeout whose path is unknown concerns every rail.
            for p in &mut self.rails {
                p.feedback(fb);
            }
            return;
        };
        let (rail, e) = self.split(entropy);
        let local = match *fb {
            Feedback::Ack { rtt_us, congested, bytes, now_us, .. } => Feedback::Ack { entropy: e, rtt_us, congested, bytes, now_us },
            Feedback::Nack { own_path, now_us, .. } => Feedback::Nack { entropy: e, own_path, now_us },
            Feedback::Timeout { max_rtt_us, base_rtt_us, now_us, .. } => {
                Feedback::Timeout { entropy: Some(e), max_rtt_us, base_rtt_us, now_us }
            }
            Feedback::PathState { alive, now_us, .. } => Feedback::PathState { entropy: e, alive, now_us },
        };
        if let Some(p) = self.rails.get_mut(rail) {
            p.feedback(&local);
        }
    }

    fn describe_state(&self) -> serde_json::Value {
        serde_json::Value::Array(self.rails.iter().map(|p| p.describe_state()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_lb::{LbConfig, Topology};
    use std::collections::BTreeMap;

    fn runtime(vars: &[(&str, &str)], rails: u16) -> LbRuntime {
        let v: BTreeMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        LbConfig::from_vars(&v).unwrap().runtime(Topology::single_leaf(rails), 7, 1).unwrap()
    }

    fn ctx(msg: u64, offset: u64) -> PathCtx {
        PathCtx { msg, offset, n_paths: 32, retransmit: false, avoid: None, now_us: 0 }
    }

    #[test]
    fn packets_follow_their_chunks_rail() {
        let rt = runtime(&[("PRISM_RAIL", "rr"), ("PRISM_CHUNK", "4096")], 2);
        let plans: Plans = Arc::default();
        let plan = rt.plan(&prism_lb::SendReq { dst_host: 9, len: 64 * 1024, flow: 1, home_rail: 0 }, 0).unwrap();
        let map = ChunkMap::from_plan(&plan, 0);
        let expect: Vec<(u64, u16)> = plan.chunks.iter().map(|c| (c.offset, c.rail)).collect();
        plans.lock().insert(5, map);
        let mut p = PlannedPaths::new(&rt, 9, 2, 16, 0, 3, plans);
        let mut per_rail = [0u32; 2];
        for (offset, rail) in expect {
            for k in 0..4 {
                let e = p.pick(&ctx(5, offset + k * 1024));
                assert_eq!(e / 16, rail, "offset {offset}");
                per_rail[rail as usize] += 1;
            }
        }
        assert_eq!(per_rail[0], per_rail[1], "rr alternates rails");
    }

    /// Where the verbs sender's descriptor runs must stop (`vcomm::desc`): proto cuts a packet at
    /// every end of a run of chunks on one rail, so 64 KiB packets over 160 KiB chunks alternating
    /// between two rails leave the 64 KiB grid at every chunk end; 32 KiB packets never do.
    #[test]
    fn the_packet_layout_breaks_where_a_run_of_chunks_ends_off_the_packet_grid() {
        let chunk = 160 * 1024;
        let rt = runtime(&[("PRISM_RAIL", "rr"), ("PRISM_CHUNK", "163840")], 2);
        let total = 4 * chunk + 1000;
        let plan = rt.plan(&prism_lb::SendReq { dst_host: 9, len: total, flow: 1, home_rail: 0 }, 0).unwrap();
        let rails: Vec<u16> = plan.chunks.iter().map(|c| c.rail).collect();
        assert!(rails.windows(2).all(|w| w[0] != w[1]), "rr alternates rails: {rails:?}");
        let map = ChunkMap::from_plan(&plan, 0);
        let pkt = 64 * 1024;
        assert_eq!(map.layout_break(0, pkt, total), Some(chunk));
        assert_eq!(map.layout_break(2 * pkt, pkt, total), Some(chunk), "the short packet itself");
        assert_eq!(map.layout_break(chunk, pkt, total), Some(2 * chunk));
        assert_eq!(map.layout_break(3 * chunk, pkt, total), Some(4 * chunk));
        assert_eq!(map.layout_break(4 * chunk, pkt, total), None, "the last chunk ends the message");
        assert_eq!(map.layout_break(0, 32 * 1024, total), None, "32 KiB packets fit every chunk end");
        // One rail: one run, the message's.
        let one = runtime(&[("PRISM_CHUNK", "163840")], 1);
        let plan = one.plan(&prism_lb::SendReq { dst_host: 9, len: total, flow: 1, home_rail: 0 }, 0).unwrap();
        assert_eq!(ChunkMap::from_plan(&plan, 0).layout_break(0, pkt, total), None);
    }

    #[test]
    fn a_chunk_end_is_where_the_plan_chunk_holding_the_offset_ends() {
        let rt = runtime(&[("PRISM_RAIL", "rr"), ("PRISM_CHUNK", "4096")], 2);
        let plans: Plans = Arc::default();
        let plan = rt.plan(&prism_lb::SendReq { dst_host: 9, len: 64 * 1024 + 100, flow: 1, home_rail: 0 }, 0).unwrap();
        plans.lock().insert(5, ChunkMap::from_plan(&plan, 0));
        let mut p = PlannedPaths::new(&rt, 9, 2, 16, 0, 3, plans);
        // rr alternates rails chunk by chunk: every chunk is a run of its own.
        for c in &plan.chunks {
            let end = c.offset + u64::from(c.len);
            for off in [c.offset, c.offset + u64::from(c.len) / 2, end - 1] {
                assert_eq!(p.chunk_end(&ctx(5, off)), Some(end), "offset {off}");
            }
        }
        assert_eq!(p.chunk_end(&ctx(5, 64 * 1024 + 100)), None, "past the message");
        assert_eq!(p.chunk_end(&ctx(6, 0)), None, "a message without plan");
        // Chunks that go where their neighbours go are one run: a packet need not end between them.
        let rt1 = runtime(&[("PRISM_CHUNK", "4096")], 1);
        let one: Plans = Arc::default();
        let plan1 = rt1.plan(&prism_lb::SendReq { dst_host: 9, len: 64 * 1024, flow: 1, home_rail: 0 }, 0).unwrap();
        assert!(plan1.chunks.len() > 1, "the single-rail plan has {} chunk(s)", plan1.chunks.len());
        one.lock().insert(5, ChunkMap::from_plan(&plan1, 0));
        let mut p1 = PlannedPaths::new(&rt1, 9, 1, 16, 0, 3, one);
        assert_eq!(p1.chunk_end(&ctx(5, 5000)), Some(64 * 1024));
    }

    #[test]
    fn a_message_without_plan_stays_on_the_home_rail() {
        let rt = runtime(&[], 3);
        let mut p = PlannedPaths::new(&rt, 1, 3, 8, 2, 3, Arc::default());
        for off in 0..100 {
            let e = p.pick(&PathCtx { n_paths: 24, ..ctx(1, off * 100) });
            assert!((16..24).contains(&e), "{e}");
        }
    }

    /// With runs of 4 datagrams of 1,000 bytes: each run of a message's new packets keeps one
    /// entropy; the next run, another message, a retransmission, an avoided entropy and a plan span
    /// boundary each pick afresh; the policy (spraying) still uses every entropy.
    #[test]
    fn a_train_keeps_a_run_of_new_packets_on_one_entropy_within_its_span() {
        let rt = runtime(&[("PRISM_RAIL", "rr"), ("PRISM_CHUNK", "8192")], 2);
        let plans: Plans = Arc::default();
        let plan = rt.plan(&prism_lb::SendReq { dst_host: 9, len: 64 * 1024, flow: 1, home_rail: 0 }, 0).unwrap();
        plans.lock().insert(5, ChunkMap::from_plan(&plan, 0));
        let mut p = PlannedPaths::new(&rt, 9, 2, 16, 0, 3, plans).with_train(4000);
        let picks: Vec<u16> = (0..64).map(|k| p.pick(&ctx(5, k * 1000))).collect();
        let mut used = std::collections::BTreeSet::new();
        // (span's start offset, run's first packet): a run starts at the first packet of a span or
        // 4,000 bytes after the previous run's start.
        let mut run: Option<(u64, usize)> = None;
        for (k, &e) in picks.iter().enumerate() {
            used.insert(e);
            let off = k as u64 * 1000;
            let chunk = plan.chunks.iter().find(|c| (c.offset..c.offset + u64::from(c.len)).contains(&off)).unwrap();
            let first = match run {
                Some((span, first)) if span == chunk.offset && off < first as u64 * 1000 + 4000 => first,
                _ => k,
            };
            run = Some((chunk.offset, first));
            assert_eq!(e, picks[first], "packet {k} left its run (started at packet {first})");
            assert_eq!(e / 16, chunk.rail, "packet {k} off its chunk's rail");
        }
        assert!(used.len() >= 8, "runs still spread: {used:?}");
        // A retransmission is picked on its own and leaves the run alone.
        let run = p.pick(&ctx(5, 60_000));
        let r = p.pick(&PathCtx { retransmit: true, avoid: Some(run), ..ctx(5, 1000) });
        assert_ne!(r, run);
        assert_eq!(p.pick(&ctx(5, 61_000)), run, "the run goes on after a retransmission");
        // Avoiding the run's entropy (the transport found it unfit) starts a new run.
        let other = p.pick(&PathCtx { avoid: Some(run), ..ctx(5, 62_000) });
        assert_ne!(other, run);
        assert_eq!(p.pick(&ctx(5, 63_000)), other);
        // Another message starts its own run.
        let _ = p.pick(&ctx(6, 0));
        assert!(p.train.is_some_and(|t| t.msg == 6 && t.start == 0));
    }

    #[test]
    fn a_retransmission_avoids_the_lost_entropy_on_the_same_rail() {
        let rt = runtime(&[], 1);
        let mut p = PlannedPaths::new(&rt, 1, 1, 4, 0, 3, Arc::default());
        for _ in 0..200 {
            let e = p.pick(&PathCtx { retransmit: true, avoid: Some(2), n_paths: 4, ..ctx(1, 0) });
            assert_ne!(e, 2);
        }
    }

    /// A whole rail failing (none of its entropies fit): its chunks go to the other rail, spread by
    /// that rail's policy over its entropies, not piled on the first of them; a rail with one fit
    /// entropy left keeps its chunks; with no rail fit the transport corrects the pick.
    #[test]
    fn a_failing_rails_packets_spread_over_the_other_rails_paths() {
        for path in ["spray", "pro", "reps", "dr"] {
            let rt = runtime(&[("PRISM_RAIL", "rr"), ("PRISM_CHUNK", "4096"), ("PRISM_PATH", path)], 2);
            let plans: Plans = Arc::default();
            let plan = rt.plan(&prism_lb::SendReq { dst_host: 9, len: 64 * 1024, flow: 1, home_rail: 0 }, 0).unwrap();
            let on_rail0: Vec<u64> = plan.chunks.iter().filter(|c| c.rail == 0).map(|c| c.offset).collect();
            assert!(!on_rail0.is_empty(), "{path}: the plan put nothing on rail 0");
            plans.lock().insert(5, ChunkMap::from_plan(&plan, 0));
            let mut p = PlannedPaths::new(&rt, 9, 2, 16, 0, 3, plans);
            let mut per_entropy = [0u32; 32];
            for k in 0..512u64 {
                let off = on_rail0[(k as usize) % on_rail0.len()] + (k / on_rail0.len() as u64) % 4 * 1024;
                let c = PathCtx { retransmit: k % 2 == 1, ..ctx(5, off) };
                let e = p.pick_fit(&c, None, &mut |e| e >= 16).expect("rail 1 is fit");
                assert!(e >= 16, "{path}: entropy {e} on the failing rail");
                per_entropy[e as usize] += 1;
            }
            let used = per_entropy.iter().filter(|&&c| c > 0).count();
            let most = *per_entropy.iter().max().unwrap();
            assert!(used >= 12 && most <= 512 / 4, "{path}: rail 1's entropies carried {per_entropy:?}");
            // One fit entropy left on rail 0: the chunk stays there (PRO and DR continue their order
            // onto it; spraying and REPS leave the correction to the transport).
            let e = p.pick_fit(&ctx(5, on_rail0[0]), None, &mut |e| e == 3 || e >= 16);
            assert!(e.is_none() || e == Some(3), "{path}: {e:?}");
            assert_eq!(p.pick_fit(&ctx(5, on_rail0[0]), None, &mut |_| false), None, "{path}: nothing fit anywhere");
        }
    }
}
