//! The per-process load balancer: the configured policies plus the state they share among flows (RailS
//! loads per destination, PRO's counter and DR's pointer per destination leaf, Ethereal's bad-path marks).
//! Shared state sits behind `std::sync::Mutex`es so the transport may use one runtime from several
//! threads; nothing here does I/O, reads a clock or starts a thread.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rand::{rngs::SmallRng, Rng, SeedableRng};

use crate::config::{LbConfig, PathKind, ProStart};
use crate::feedback::Feedback;
use crate::path::{lock, DeadSet, Dr, DrShared, Ecmp, PathCtx, PathPolicy, Pinned, Pro, ProShared, Reps, Spray};
use crate::plan::{Chunk, Plan, PlanError, SendReq};
use crate::rail::{rail_policy, RailChunk, RailPolicy};
use crate::rate::{CcKind, Mcc, NoRate, RateController};
use crate::split::{split, BadPaths, Batcher, SplitEnv, SplitKind};
use crate::splitmix64;
use crate::topology::Topology;

/// One flow as the path layer sees it: this process's traffic to one host on one rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowInfo {
    /// Destination host id.
    pub dst_host: usize,
    /// Rail (local and remote NIC).
    pub rail: u16,
}

/// (rail, destination leaf, pinned uplink) → state shared by the flows with that key.
type LeafKey = (u16, u32, Option<u16>);

/// A leaf id for hosts the topology does not know: their flows share a private bucket.
const UNKNOWN_LEAF: u32 = u32::MAX;

struct RailShared {
    policy: Box<dyn RailPolicy>,
    alive: Vec<bool>,
    scratch: Vec<RailChunk>,
}

struct SplitShared {
    bad: BadPaths,
    rng: SmallRng,
}

struct Inner {
    cfg: LbConfig,
    topo: Topology,
    host: usize,
    seed: u64,
    rails: Mutex<RailShared>,
    split: Mutex<SplitShared>,
    pro: Mutex<HashMap<LeafKey, Arc<Mutex<ProShared>>>>,
    dr: Mutex<HashMap<LeafKey, Arc<Mutex<DrShared>>>>,
}

/// The load balancer of one process (or one rail group). Cheap to clone; clones share state.
#[derive(Clone)]
pub struct LbRuntime {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for LbRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LbRuntime").field("config", &self.inner.cfg.describe()).field("host", &self.inner.host).finish()
    }
}

fn key_seed(seed: u64, k: &LeafKey) -> u64 {
    splitmix64(seed ^ splitmix64(k.0 as u64 ^ splitmix64(k.1 as u64 ^ splitmix64(k.2.map_or(u64::MAX, |u| u as u64)))))
}

impl LbRuntime {
    /// A runtime for host `host` of `topo` with `cfg`'s policies; `seed` fixes every random choice.
    pub fn new(cfg: LbConfig, topo: Topology, host: usize, seed: u64) -> Result<Self, PlanError> {
        if !topo.knows_host(host) {
            return Err(PlanError::UnknownHost { host, known: topo.hosts().len() });
        }
        let rails = topo.rails();
        let inner = Inner {
            rails: Mutex::new(RailShared {
                policy: rail_policy(cfg.rail, rails, cfg.lpt_tie, splitmix64(seed ^ 1)),
                alive: vec![true; rails as usize],
                scratch: Vec::new(),
            }),
            split: Mutex::new(SplitShared { bad: BadPaths::default(), rng: SmallRng::seed_from_u64(splitmix64(seed ^ 2)) }),
            pro: Mutex::new(HashMap::new()),
            dr: Mutex::new(HashMap::new()),
            cfg,
            topo,
            host,
            seed,
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The configuration.
    pub fn config(&self) -> &LbConfig {
        &self.inner.cfg
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.inner.topo
    }

    /// This process's host id.
    pub fn host(&self) -> usize {
        self.inner.host
    }

    /// Plan one message: its chunks, each with a rail and possibly a pinned uplink.
    pub fn plan(&self, req: &SendReq, now_us: u64) -> Result<Plan, PlanError> {
        let mut v = self.plan_batch(std::slice::from_ref(req), now_us)?;
        Ok(v.pop().unwrap_or_default())
    }

    /// Plan a batch of messages together (Ethereal's Algorithm 1 sees all flows to a leaf at once; LPT
    /// sorts all chunks largest first). `result[i]` is the plan of `reqs[i]`.
    pub fn plan_batch(&self, reqs: &[SendReq], now_us: u64) -> Result<Vec<Plan>, PlanError> {
        let inner = &*self.inner;
        if let Some(r) = reqs.iter().find(|r| !inner.topo.knows_host(r.dst_host)) {
            return Err(PlanError::UnknownHost { host: r.dst_host, known: inner.topo.hosts().len() });
        }
        let chunk = inner.cfg.chunk_bytes;
        let mut plans: Vec<Plan> =
            reqs.iter().map(|r| Plan { chunks: Vec::with_capacity(r.len.div_ceil(chunk as u64) as usize) }).collect();
        let mut rs = lock(&inner.rails);
        let RailShared { policy, alive, scratch } = &mut *rs;
        scratch.clear();
        policy.assign(inner.host, reqs, chunk, alive, scratch);
        if inner.cfg.split == SplitKind::None {
            let chunk = |c: &RailChunk| Chunk { rail: c.rail, uplink: None, subflow: 0, offset: c.offset, len: c.len, start_after_us: 0 };
            if let [only] = plans.as_mut_slice() {
                only.chunks.extend(scratch.iter().map(chunk));
            } else {
                for c in scratch.iter() {
                    plans[c.msg as usize].chunks.push(chunk(c));
                }
            }
        } else {
            let mut sp = lock(&inner.split);
            let SplitShared { bad, rng } = &mut *sp;
            let env = SplitEnv { topo: &inner.topo, host: inner.host, now_us, rng, bad, params: &inner.cfg.ethereal };
            split(inner.cfg.split, env, reqs, scratch, inner.topo.rails(), &mut plans);
        }
        Ok(plans)
    }

    /// A sends batcher with the configured window (`PRISM_ETHEREAL_BATCH_US`), for Ethereal's interceptor.
    pub fn batcher<T>(&self) -> Batcher<T> {
        Batcher::new(self.inner.cfg.ethereal.batch_us)
    }

    /// The path policy of one flow (`seed` fixes its random choices). It honours plan chunks' uplink pins
    /// through [`PathPolicy::pick_for`] and shares PRO/DR state with the other flows to the same leaf.
    pub fn path_policy(&self, flow: FlowInfo, seed: u64) -> Box<dyn PathPolicy> {
        Box::new(self.flow_paths(flow, seed))
    }

    /// The same as [`LbRuntime::path_policy`], as its concrete type.
    pub fn flow_paths(&self, flow: FlowInfo, seed: u64) -> FlowPaths {
        let t = &self.inner.topo;
        let my_leaf = t.leaf_of(self.inner.host, flow.rail).unwrap_or(0);
        let dst_leaf = t.leaf_of(flow.dst_host, flow.rail).unwrap_or(UNKNOWN_LEAF);
        let uplinks = t.leaf(my_leaf).uplinks;
        let ethereal = (self.inner.cfg.split == SplitKind::Ethereal).then(|| Reroute {
            msg: None,
            to: vec![None; uplinks as usize],
            rng: SmallRng::seed_from_u64(splitmix64(seed ^ 3)),
        });
        FlowPaths {
            rt: self.clone(),
            rail: flow.rail,
            my_leaf,
            dst_leaf,
            uplinks,
            seed,
            unpinned: None,
            pinned: (0..uplinks).map(|_| None).collect(),
            dead: DeadSet::default(),
            ethereal,
            classes: (0, Vec::new()),
        }
    }

    /// A rate controller for one flow (`PRISM_CC`).
    pub fn rate_controller(&self) -> Box<dyn RateController> {
        self.inner.cfg.rate_controller()
    }

    /// Declare a rail dead or alive; the rail layer stops or resumes using it (an extension of RailS,
    /// which has no failure handling).
    pub fn set_rail_alive(&self, rail: u16, alive: bool) {
        if let Some(a) = lock(&self.inner.rails).alive.get_mut(rail as usize) {
            *a = alive;
        }
    }

    /// Forget the rail layer's accumulated loads (a new round, when the caller knows one began).
    pub fn reset_rail_loads(&self) {
        lock(&self.inner.rails).policy.reset();
    }

    /// Mark an uplink of this host's leaf on `rail` bad (for `PRISM_ETHEREAL_RESET_US`) or good again.
    pub fn mark_uplink(&self, rail: u16, uplink: u16, alive: bool, now_us: u64) {
        let mut sp = lock(&self.inner.split);
        if alive {
            sp.bad.mark_good(rail, uplink);
        } else {
            sp.bad.mark_bad(rail, uplink, now_us.saturating_add(self.inner.cfg.ethereal.reset_us));
        }
    }

    /// A JSON picture of the shared state, for stats.
    pub fn describe_state(&self) -> serde_json::Value {
        let rs = lock(&self.inner.rails);
        let sp = lock(&self.inner.split);
        serde_json::json!({
            "config": self.inner.cfg.describe(),
            "rail": { "policy": rs.policy.name(), "alive": rs.alive, "state": rs.policy.describe_state() },
            "bad_uplinks": sp.bad.describe(),
            "pro_leaves": lock(&self.inner.pro).len(),
            "dr_leaves": lock(&self.inner.dr).len(),
        })
    }

    /// Where PRO's counter C of `key` starts (`PRISM_PRO_START`): with `rack`, this host's position among
    /// the hosts of its leaf on that rail, plus a shift all of them derive alike from (rail, own leaf,
    /// pin), so the hosts of one rack start on consecutive paths whatever leaf each sends to, and racks
    /// are independent of each other; `random` (or a host the topology does not list) draws it from this
    /// runtime's seed.
    fn pro_start(&self, key: &LeafKey) -> u32 {
        let inner = &*self.inner;
        let random = key_seed(inner.seed, key) as u32;
        if inner.cfg.pro_start == ProStart::Random || !inner.topo.lists_hosts() {
            return random;
        }
        let (rail, _dst_leaf, pin) = *key;
        let Some(my_leaf) = inner.topo.leaf_of(inner.host, rail) else { return random };
        let index = (0..inner.host).filter(|&h| inner.topo.leaf_of(h, rail) == Some(my_leaf)).count() as u32;
        let shift = key_seed(0, &(rail, my_leaf, pin)) as u16 as u32;
        shift + index
    }

    fn make_policy(&self, rail: u16, dst_leaf: u32, pin: Option<u16>, seed: u64) -> Box<dyn PathPolicy> {
        let inner = &*self.inner;
        let key = (rail, dst_leaf, pin);
        match inner.cfg.path {
            PathKind::Spray => Box::new(Spray::new(seed)),
            PathKind::Ecmp => Box::new(Ecmp::new(seed)),
            PathKind::Reps => Box::new(Reps::new(inner.cfg.reps, seed)),
            PathKind::Pro => {
                let sh = lock(&inner.pro).entry(key).or_insert_with(|| ProShared::shared(self.pro_start(&key))).clone();
                Box::new(Pro::new(sh))
            }
            PathKind::Dr => {
                let sh = lock(&inner.dr).entry(key).or_insert_with(|| DrShared::shared(key_seed(inner.seed, &key))).clone();
                Box::new(Dr::new(sh))
            }
        }
    }
}

/// Ethereal's reaction inside one flow: on a NACK or timeout, the affected sub-flow moves to a random good
/// uplink for the rest of its message ("without redistributing all active flows").
struct Reroute {
    msg: Option<u64>,
    to: Vec<Option<u16>>,
    rng: SmallRng,
}

/// The path policy of one flow: an unpinned policy for chunks the split layer left free and one policy per
/// uplink for pinned chunks, created when first needed (so PRO counts a flow as active once it sends).
pub struct FlowPaths {
    rt: LbRuntime,
    rail: u16,
    my_leaf: u32,
    dst_leaf: u32,
    uplinks: u16,
    seed: u64,
    unpinned: Option<Box<dyn PathPolicy>>,
    pinned: Vec<Option<Pinned>>,
    dead: DeadSet,
    ethereal: Option<Reroute>,
    /// For the number of entropies it was made for: each uplink's entropies (retransmissions under
    /// Ethereal, `FlowPaths::retx_uplink`).
    classes: (u16, Vec<Vec<u16>>),
}

impl std::fmt::Debug for FlowPaths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowPaths").field("rail", &self.rail).field("dst_leaf", &self.dst_leaf).finish()
    }
}

impl FlowPaths {
    fn replay_dead(&self, p: &mut dyn PathPolicy) {
        // A policy created late still learns which entropies the flow was told are dead.
        for e in self.dead.iter() {
            p.feedback(&Feedback::PathState { entropy: e, alive: false, now_us: 0 });
        }
    }

    fn unpinned(&mut self) -> &mut Box<dyn PathPolicy> {
        if self.unpinned.is_none() {
            let mut p = self.rt.make_policy(self.rail, self.dst_leaf, None, self.seed);
            self.replay_dead(p.as_mut());
            self.unpinned = Some(p);
        }
        self.unpinned.as_mut().expect("just created")
    }

    fn pinned(&mut self, u: u16) -> &mut Pinned {
        if self.pinned[u as usize].is_none() {
            let inner = self.rt.make_policy(self.rail, self.dst_leaf, Some(u), splitmix64(self.seed ^ (u as u64 + 1)));
            let rt = self.rt.clone();
            let leaf = self.my_leaf;
            let mut p = Pinned::new(inner, u, Box::new(move |e| rt.inner.topo.uplink_of_entropy(leaf, e)));
            self.replay_dead(&mut p);
            self.pinned[u as usize] = Some(p);
        }
        self.pinned[u as usize].as_mut().expect("just created")
    }

    fn effective_uplink(&mut self, u: u16, msg: u64) -> u16 {
        let u = u % self.uplinks.max(1);
        match &mut self.ethereal {
            Some(r) => {
                if r.msg.is_none_or_lt(msg) {
                    r.msg = Some(msg);
                    r.to.iter_mut().for_each(|t| *t = None);
                }
                r.to[u as usize].unwrap_or(u)
            }
            None => u,
        }
    }

    /// Under Ethereal, the uplink a retransmission of a chunk the split layer pinned to uplink `u` goes
    /// to, when it is not the sub-flow's own (there, the sub-flow's policy picks, as for any of its
    /// packets).
    fn foreign_retx_uplink(&mut self, ctx: &PathCtx, u: u16) -> Option<u16> {
        let v = self.retx_uplink(ctx)?;
        (v != self.effective_uplink(u, ctx.msg)).then_some(v)
    }

    /// Under Ethereal, the uplink of a retransmission (`None` for other packets, or without
    /// Ethereal): one of the good uplinks that have entropies, chosen by a hash of the packet's
    /// message and offset. Ethereal's plan balances first transmissions; a retransmission is bytes no
    /// plan counted, and kept on its sub-flow's uplink every one of them loaded that uplink alone: on
    /// the rail fabric a window declared lost behind a deep queue at an iteration's start (15
    /// packets, most of them spurious) put 0.6 % of an uplink's bytes on one uplink in 16-20 runs of
    /// 40 (`docs/fabric.md`). Hashed, a window's packets spread over the uplinks. A hash and not a
    /// rotation: the transport asks `allows` about the same packet several times and must get one
    /// answer.
    fn retx_uplink(&mut self, ctx: &PathCtx) -> Option<u16> {
        if !ctx.retransmit || self.ethereal.is_none() {
            return None;
        }
        let mut good = lock(&self.rt.inner.split).bad.good_uplinks(self.rail, self.uplinks, ctx.now_us);
        let classes = self.uplink_classes(ctx.n_paths);
        good.retain(|&u| classes.get(u as usize).is_some_and(|c| !c.is_empty()));
        let h = splitmix64(self.seed ^ splitmix64(ctx.msg ^ ctx.offset.rotate_left(32)));
        good.get((h % good.len().max(1) as u64) as usize).copied()
    }

    /// Each uplink's entropies among `0..n_paths` (an uplink may have none when there are fewer
    /// entropies than uplinks).
    fn uplink_classes(&mut self, n_paths: u16) -> &[Vec<u16>] {
        if self.classes.0 != n_paths || self.classes.1.is_empty() {
            let topo = &self.rt.inner.topo;
            self.classes = (n_paths, (0..self.uplinks).map(|u| topo.uplink_entropies(self.my_leaf, u, n_paths)).collect());
        }
        &self.classes.1
    }

    /// An entropy of uplink `v` for a retransmission, from a random one of its entropies on: not the
    /// lost copy's, one `ok` accepts. Drawn here rather than by `v`'s own policy, whose state (ECMP's
    /// entropy of the message, PRO's walk) belongs to the sub-flows pinned there.
    fn retx_entropy(&mut self, ctx: &PathCtx, v: u16, ok: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        let start = self.ethereal.as_mut().map_or(0, |r| r.rng.gen::<u32>()) as usize;
        let class = self.uplink_classes(ctx.n_paths.max(1)).get(v as usize)?;
        (0..class.len()).map(|k| class[(start + k) % class.len()]).find(|&e| Some(e) != ctx.avoid && ok(e))
    }

    /// Move every sub-flow now on uplink `bad` to a random good uplink other than `bad`.
    fn reroute(&mut self, bad: u16, now_us: u64) {
        let Some(r) = &mut self.ethereal else { return };
        let good: Vec<u16> =
            lock(&self.rt.inner.split).bad.good_uplinks(self.rail, self.uplinks, now_us).into_iter().filter(|&u| u != bad).collect();
        if good.is_empty() {
            return;
        }
        for u in 0..self.uplinks {
            if r.to[u as usize].unwrap_or(u) == bad {
                r.to[u as usize] = Some(good[r.rng.gen_range(0..good.len())]);
            }
        }
    }
}

/// `Option<u64>` "is unset or below": the reroute table belongs to the newest message seen.
trait NoneOrLt {
    fn is_none_or_lt(&self, x: u64) -> bool;
}

impl NoneOrLt for Option<u64> {
    fn is_none_or_lt(&self, x: u64) -> bool {
        match *self {
            None => true,
            Some(m) => m < x,
        }
    }
}

impl PathPolicy for FlowPaths {
    fn name(&self) -> &'static str {
        self.rt.inner.cfg.path.name()
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        self.pick_for(ctx, None)
    }

    fn pick_for(&mut self, ctx: &PathCtx, uplink: Option<u16>) -> u16 {
        match uplink {
            None => self.unpinned().pick(ctx),
            Some(u) => {
                let foreign = self.foreign_retx_uplink(ctx, u).and_then(|v| self.retx_entropy(ctx, v, &mut |_| true));
                foreign.unwrap_or_else(|| {
                    let u = self.effective_uplink(u, ctx.msg);
                    self.pinned(u).pick(ctx)
                })
            }
        }
    }

    fn pick_burst(&mut self, ctx: &PathCtx, uplink: Option<u16>, out: &mut [u16]) {
        match uplink {
            None => self.unpinned().pick_burst(ctx, None, out),
            Some(u) => {
                let u = self.effective_uplink(u, ctx.msg);
                self.pinned(u).pick_burst(ctx, None, out)
            }
        }
    }

    fn pick_fit(&mut self, ctx: &PathCtx, uplink: Option<u16>, fit: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        match uplink {
            None => self.unpinned().pick_fit(ctx, None, fit),
            Some(u) => match self.foreign_retx_uplink(ctx, u) {
                Some(v) => self.retx_entropy(ctx, v, fit),
                None => {
                    let u = self.effective_uplink(u, ctx.msg);
                    self.pinned(u).pick_fit(ctx, None, fit)
                }
            },
        }
    }

    fn allows(&mut self, ctx: &PathCtx, uplink: Option<u16>, e: u16) -> bool {
        match uplink {
            None => true,
            Some(u) => {
                if let Some(v) = self.foreign_retx_uplink(ctx, u) {
                    return self.rt.inner.topo.uplink_of_entropy(self.my_leaf, e) == v;
                }
                let u = self.effective_uplink(u, ctx.msg);
                self.pinned(u).allows(ctx, None, e)
            }
        }
    }

    fn feedback(&mut self, fb: &Feedback) {
        self.dead.apply(fb);
        let class = fb.entropy().map(|e| self.rt.inner.topo.uplink_of_entropy(self.my_leaf, e));
        match fb {
            Feedback::Ack { .. } | Feedback::Nack { .. } => {
                match class.and_then(|u| self.pinned.get_mut(u as usize)).and_then(Option::as_mut) {
                    Some(p) => p.feedback(fb),
                    None => {
                        if let Some(p) = &mut self.unpinned {
                            p.feedback(fb);
                        }
                    }
                }
            }
            Feedback::Timeout { .. } | Feedback::PathState { .. } => {
                if let Some(p) = &mut self.unpinned {
                    p.feedback(fb);
                }
                self.pinned.iter_mut().flatten().for_each(|p| p.feedback(fb));
            }
        }
        if self.ethereal.is_none() {
            return;
        }
        let now = fb.now_us();
        let reset = self.rt.inner.cfg.ethereal.reset_us;
        match (*fb, class) {
            // A NACK in the paper is a RoCE QP's: a gap in one sub-flow's packets on one path. Only a
            // loss its own path proves (a later packet on the same entropy arrived) is that; a packet
            // only overtaken on other uplinks waited in a deeper queue.
            (Feedback::Nack { own_path: true, .. }, Some(u)) => self.reroute(u, now),
            (Feedback::Timeout { .. }, Some(u)) | (Feedback::PathState { alive: false, .. }, Some(u)) => {
                // Ethereal's failure signal: future batches avoid this uplink until the reset timer fires.
                lock(&self.rt.inner.split).bad.mark_bad(self.rail, u, now.saturating_add(reset));
                self.reroute(u, now);
            }
            (Feedback::PathState { alive: true, .. }, Some(u)) => lock(&self.rt.inner.split).bad.mark_good(self.rail, u),
            _ => {}
        }
    }

    fn describe_state(&self) -> serde_json::Value {
        let pinned: Vec<_> = self.pinned.iter().flatten().map(|p| p.describe_state()).collect();
        serde_json::json!({
            "rail": self.rail,
            "dst_leaf": self.dst_leaf,
            "unpinned": self.unpinned.as_ref().map(|p| p.describe_state()),
            "pinned": pinned,
        })
    }
}

impl LbConfig {
    /// The shared runtime for host `host` of `topo`; `seed` fixes every random choice.
    pub fn runtime(&self, topo: Topology, host: usize, seed: u64) -> Result<LbRuntime, PlanError> {
        LbRuntime::new(self.clone(), topo, host, seed)
    }

    /// A rate controller for one flow (`PRISM_CC`).
    pub fn rate_controller(&self) -> Box<dyn RateController> {
        match self.cc {
            CcKind::None => Box::new(NoRate),
            CcKind::Mcc => Box::new(Mcc::new(self.mcc)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PathKind;

    fn req(dst: usize, len: u64) -> SendReq {
        SendReq { dst_host: dst, len, flow: 0, home_rail: 0 }
    }

    #[test]
    fn the_runtime_can_be_shared_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<LbRuntime>();
        fn send<T: Send>() {}
        send::<FlowPaths>();
    }

    #[test]
    fn unknown_hosts_are_rejected_when_the_topology_lists_hosts() {
        let topo = Topology::leaf_spine(4, 2, 1, 2).unwrap();
        assert_eq!(LbConfig::default().runtime(topo.clone(), 9, 0).unwrap_err(), PlanError::UnknownHost { host: 9, known: 4 });
        let rt = LbConfig::default().runtime(topo, 0, 0).unwrap();
        assert!(rt.plan(&req(4, 10), 0).unwrap_err().to_string().contains("host 4 is not in the topology"));
        // Without a host list any id is a host.
        let rt = LbConfig::default().runtime(Topology::single_leaf(2), 12345, 0).unwrap();
        assert_eq!(rt.plan(&req(999, 10), 0).unwrap().total_bytes(), 10);
    }

    #[test]
    fn a_rail_declared_dead_gets_no_chunks_until_it_comes_back() {
        let rt = LbConfig::default().runtime(Topology::single_leaf(4), 0, 0).unwrap();
        rt.set_rail_alive(2, false);
        let p = rt.plan(&req(1, 1 << 20), 0).unwrap();
        assert_eq!(p.bytes_per_rail(4)[2], 0);
        rt.set_rail_alive(2, true);
        rt.reset_rail_loads();
        let p = rt.plan(&req(1, 1 << 20), 0).unwrap();
        assert_eq!(p.bytes_per_rail(4), vec![256 << 10; 4]);
    }

    #[test]
    fn an_empty_message_has_an_empty_plan() {
        let rt = LbConfig { split: SplitKind::Ethereal, ..LbConfig::default() }
            .runtime(Topology::leaf_spine(4, 2, 1, 4).unwrap(), 0, 0)
            .unwrap();
        assert!(rt.plan(&req(3, 0), 0).unwrap().chunks.is_empty());
    }

    #[test]
    fn the_state_reads_as_json_with_the_configuration() {
        let cfg = LbConfig { path: PathKind::Pro, split: SplitKind::Ethereal, ..LbConfig::default() };
        let rt = cfg.runtime(Topology::leaf_spine(4, 2, 2, 4).unwrap(), 0, 0).unwrap();
        rt.plan(&req(3, 1 << 20), 0).unwrap();
        rt.mark_uplink(1, 2, false, 0);
        let mut p = rt.path_policy(FlowInfo { dst_host: 3, rail: 0 }, 1);
        let ctx = PathCtx { msg: 0, offset: 0, n_paths: 16, retransmit: false, avoid: None, now_us: 0 };
        p.pick_for(&ctx, Some(1));
        let s = rt.describe_state();
        assert_eq!(s["config"], cfg.describe());
        assert_eq!(s["rail"]["policy"], "lpt");
        assert_eq!(s["bad_uplinks"][0]["uplink"], 2);
        assert_eq!(s["pro_leaves"], 1);
        assert_eq!(p.describe_state()["pinned"][0]["uplink"], 1);
        assert_eq!(p.name(), "pro");
    }

    #[test]
    fn a_burst_through_the_runtime_stays_on_the_pinned_uplink() {
        let cfg = LbConfig { path: PathKind::Dr, split: SplitKind::Ethereal, ..LbConfig::default() };
        let rt = cfg.runtime(Topology::leaf_spine(4, 2, 1, 4).unwrap(), 0, 0).unwrap();
        let mut p = rt.path_policy(FlowInfo { dst_host: 3, rail: 0 }, 1);
        let ctx = PathCtx { msg: 0, offset: 0, n_paths: 64, retransmit: false, avoid: None, now_us: 0 };
        let mut out = [0u16; 32];
        p.pick_burst(&ctx, Some(3), &mut out);
        assert!(out.iter().all(|&e| e % 4 == 3), "{out:?}");
        // DR over the 16 entropies of uplink 3: 32 packets visit each exactly twice.
        let mut seen = std::collections::HashMap::new();
        out.iter().for_each(|&e| *seen.entry(e).or_insert(0) += 1);
        assert!(seen.len() == 16 && seen.values().all(|&c| c == 2), "{seen:?}");
    }

    /// The PRO walk of every sending host of leaf 0 of a 2 × `per_leaf` leaf-spine with `m` paths, each
    /// host sending one flow to a host of leaf 1: `rounds` packets per host, in lockstep.
    fn pro_rounds(start: &str, per_leaf: usize, m: u16, rounds: usize) -> Vec<Vec<u16>> {
        let vars: std::collections::BTreeMap<String, String> =
            [("PRISM_PATH", "pro"), ("PRISM_PRO_START", start)].iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let cfg = LbConfig::from_vars(&vars).unwrap();
        let topo = Topology::leaf_spine(2 * per_leaf, per_leaf, 1, m).unwrap();
        let mut flows: Vec<Box<dyn PathPolicy>> = (0..per_leaf)
            .map(|h| cfg.runtime(topo.clone(), h, 1000 + h as u64).unwrap().path_policy(FlowInfo { dst_host: per_leaf + h, rail: 0 }, 7))
            .collect();
        let ctx = PathCtx { msg: 0, offset: 0, n_paths: m, retransmit: false, avoid: None, now_us: 0 };
        (0..rounds).map(|_| flows.iter_mut().map(|f| f.pick(&ctx)).collect()).collect()
    }

    #[test]
    fn pro_rack_start_staggers_the_hosts_of_a_leaf_on_distinct_uplinks_every_round() {
        // PRO's motivation (Fig. 2): in-phase senders under one ToR; with rack starts no two share an
        // uplink in any round, as with the ideal round robin at the ToR.
        for (per_leaf, m) in [(61usize, 64u16), (8, 8), (5, 8), (3, 4)] {
            for (r, round) in pro_rounds("rack", per_leaf, m, 3 * m as usize).iter().enumerate() {
                let mut u = round.clone();
                u.sort_unstable();
                u.dedup();
                assert_eq!(u.len(), per_leaf, "{per_leaf} hosts, M = {m}, round {r}: {round:?}");
            }
        }
    }

    #[test]
    fn pro_random_start_lets_hosts_of_a_leaf_collide_on_an_uplink() {
        // What `rack` fixes: 61 independent starts over 64 paths (birthday problem) put two hosts on one
        // uplink in lockstep, every round.
        let rounds = pro_rounds("random", 61, 64, 4);
        let mut u = rounds[0].clone();
        u.sort_unstable();
        u.dedup();
        assert!(u.len() < 61, "{:?}", rounds[0]);
        // Each host is still a full round robin (span 1): the collision persists.
        for w in rounds.windows(2) {
            for (a, b) in w[0].iter().zip(&w[1]) {
                assert_eq!((a + 1) % 64, *b);
            }
        }
    }
}
