//! Ethereal's flow interceptor in the engine: sends posted on any comm of this engine within
//! `PRISM_ETHEREAL_BATCH_US` of the first one are planned together (`LbRuntime::plan_batch`), so that
//! Algorithm 1 sees every flow to a destination leaf at once.
//!
//! A batched send is posted to proto at once (its matching and request id do not change) but held
//! there (`Connection::hold_send`) until its batch is planned. The batch is planned by whichever
//! comm first finds its window over: a post after the window, or a comm's progress at or after the
//! deadline (every comm with a held send wakes for it, see `CommCore::next_wake`). The plan of each
//! send goes into its comm's plan table; the comm releases the send in proto with the plan's start
//! times on its next progress. No send waits longer than the window.
//!
//! Lock order: a comm's lock, then this batcher's, then any comm's plan table. Nothing here takes a
//! comm's lock, so comms never wait for each other.

use parking_lot::Mutex;
use prism_lb::{Batcher, LbRuntime, SendReq};

use super::planned::{ChunkMap, Plans};

/// A send waiting for its batch: its comm's plan table and its proto message id.
pub(crate) struct Waiting {
    plans: Plans,
    msg: u64,
}

/// The open batch of the engine's sends.
pub(crate) struct SendBatches {
    batcher: Mutex<Batcher<Waiting>>,
}

impl SendBatches {
    /// A batcher for `rt`'s window (`PRISM_ETHEREAL_BATCH_US`).
    pub fn new(rt: &LbRuntime) -> Self {
        Self { batcher: Mutex::new(rt.batcher()) }
    }

    /// Queue send `msg` of the comm whose plan table is `plans`. A send after the open batch's window
    /// closes that batch: it is planned now, and this send opens the next one.
    pub fn push(&self, rt: &LbRuntime, plans: &Plans, msg: u64, req: SendReq, now: u64) {
        let mut b = self.batcher.lock();
        let ready = b.push(Waiting { plans: plans.clone(), msg }, req, now);
        deliver(rt, ready, now);
        let ready = b.poll(now);
        deliver(rt, ready, now);
    }

    /// Plan the open batch if its window is over at `now`.
    pub fn poll(&self, rt: &LbRuntime, now: u64) {
        let mut b = self.batcher.lock();
        let ready = b.poll(now);
        deliver(rt, ready, now);
    }

    /// When the open batch is due (None: no send waits).
    pub fn deadline(&self) -> Option<u64> {
        self.batcher.lock().deadline()
    }
}

/// Plan a batch at `now` and put each send's plan into its comm's table. A batch that cannot be
/// planned still releases its sends, each with an empty plan (it stays on its own rail).
fn deliver(rt: &LbRuntime, batch: Vec<(Waiting, SendReq)>, now: u64) {
    if batch.is_empty() {
        return;
    }
    let reqs: Vec<SendReq> = batch.iter().map(|b| b.1).collect();
    let plans = match rt.plan_batch(&reqs, now) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!("no plan for a batch of {} sends ({e}); they stay on their own rails", reqs.len());
            vec![Default::default(); reqs.len()]
        }
    };
    for ((w, _), plan) in batch.into_iter().zip(plans) {
        w.plans.lock().insert(w.msg, ChunkMap::from_plan(&plan, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_lb::{LbConfig, Topology};
    use std::collections::BTreeMap;
    use std::sync::Arc;

    /// Host 0 on leaf 0 sends to hosts 1..=5 on leaf 1; both leaves have 4 uplinks.
    fn runtime(window_us: &str, jitter_us: &str) -> LbRuntime {
        let v: BTreeMap<String, String> = [
            ("PRISM_SPLIT", "ethereal"),
            ("PRISM_ETHEREAL_BATCH_US", window_us),
            ("PRISM_ETHEREAL_JITTER_US", jitter_us),
            ("PRISM_CHUNK", "4096"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let hosts: Vec<String> = (0..6).map(|h| format!(r#"{{"leaves": [{}]}}"#, u32::from(h > 0))).collect();
        let topo = format!(r#"{{"rails": 1, "uplinks": 4, "hosts": [{}]}}"#, hosts.join(","));
        LbConfig::from_vars(&v).unwrap().runtime(Topology::from_json(&topo).unwrap(), 0, 11).unwrap()
    }

    fn req(dst: usize) -> SendReq {
        SendReq { dst_host: dst, len: 1 << 20, flow: dst as u64, home_rail: 0 }
    }

    /// Bytes per uplink over the given plan tables, and the sub-flows of each send.
    fn spread(tables: &[Plans]) -> (BTreeMap<Option<u16>, u64>, Vec<usize>) {
        let mut per = BTreeMap::new();
        let mut subflows = Vec::new();
        for t in tables {
            for m in t.lock().values() {
                for ((_, u), b) in m.uplinks() {
                    *per.entry(u).or_insert(0) += b;
                }
                subflows.push(m.subflows());
            }
        }
        (per, subflows)
    }

    #[test]
    fn five_sends_within_the_window_get_one_plan_balanced_over_four_uplinks() {
        let rt = runtime("50", "2");
        let b = SendBatches::new(&rt);
        let tables: Vec<Plans> = (0..5).map(|_| Arc::default()).collect();
        for (k, t) in tables.iter().enumerate() {
            b.push(&rt, t, 0, req(k + 1), 1_000 + 10 * k as u64);
        }
        // Nothing is planned before the window of the first send is over, and then all five at once.
        assert_eq!(b.deadline(), Some(1_050));
        b.poll(&rt, 1_049);
        assert!(tables.iter().all(|t| t.lock().is_empty()));
        b.poll(&rt, 1_050);
        assert_eq!(b.deadline(), None);
        let (per, mut subflows) = spread(&tables);
        // Algorithm 1 with n = 5, s = 4: four whole flows, one on each uplink, and the fifth in four
        // quarters; every uplink carries 5/4 of a flow (Theorem 1).
        subflows.sort_unstable();
        assert_eq!(subflows, vec![1, 1, 1, 1, 4]);
        assert_eq!(per.len(), 4, "{per:?}");
        assert!(per.values().all(|&b| b == 5 << 18), "{per:?}");
        // The plan is plan_batch's for the five sends (same seed, same instant).
        let same = runtime("50", "2").plan_batch(&(1..=5).map(req).collect::<Vec<_>>(), 1_050).unwrap();
        for (k, t) in tables.iter().enumerate() {
            let want = ChunkMap::from_plan(&same[k], 1_050);
            assert_eq!(t.lock()[&0].uplinks().collect::<Vec<_>>(), want.uplinks().collect::<Vec<_>>(), "send {k}");
            assert_eq!(t.lock()[&0].starts(), want.starts(), "send {k}");
        }
    }

    #[test]
    fn a_send_after_the_window_is_planned_apart_and_closes_the_batch_before_it() {
        let rt = runtime("50", "2");
        let b = SendBatches::new(&rt);
        let (t1, t2): (Plans, Plans) = (Arc::default(), Arc::default());
        b.push(&rt, &t1, 0, req(1), 1_000);
        b.push(&rt, &t2, 0, req(2), 1_051);
        // The first was planned when the second came (not later than its window), alone: split in four.
        assert_eq!(t1.lock()[&0].subflows(), 4);
        assert!(t2.lock().is_empty());
        assert_eq!(b.deadline(), Some(1_101));
        b.poll(&rt, 1_101);
        assert_eq!(t2.lock()[&0].subflows(), 4);
    }

    #[test]
    fn start_delays_count_from_the_planning_time() {
        let rt = runtime("50", "1000");
        let b = SendBatches::new(&rt);
        let t: Plans = Arc::default();
        b.push(&rt, &t, 7, req(1), 1_000);
        b.poll(&rt, 1_060);
        let starts = t.lock()[&7].starts().to_vec();
        // Four sub-flows, each starting 0 to 1000 µs after planning (at 1060), not after posting.
        assert!((1..=4).contains(&starts.len()) && starts.iter().all(|s| (1_060..=2_060).contains(&s.1)), "{starts:?}");
        assert_eq!(starts[0].0, 0);
        assert_eq!(t.lock()[&7].subflows(), 4);
    }
}
