//! Ethereal (seed 001, `seed-ethereal.md` §2): divide-and-conquer splitting. Per (source host,
//! destination leaf), n equal flows over s uplinks: ⌊n/s⌋ whole flows per uplink, and each of the
//! r = n mod s remaining flows cut into s/g equal pieces (g = gcd(r, s)), r/g pieces per uplink, so every
//! uplink carries exactly n·f/s bytes (Theorem 1). Rack-local flows are never split.
//!
//! Readings: the split count is Algorithm 1's s/g, not §3.2's "r/g subflows" typo (digest §2.3, pitfall
//! 1). Flows of unequal size (pitfall 4) are grouped by size and Algorithm 1 runs per size class, which
//! keeps every uplink's share exact. A "flow" is what one connection sends on one rail in a batch (its
//! messages' parts the rail layer put there): proto serves a connection's messages one after the other,
//! so they are one long-lived flow as in the paper, and a split flow cuts each of its messages into its
//! pieces. Bad-path marks are keyed by (rail, uplink), the paper's per-host path id (pitfall 6), and expire
//! after `PRISM_ETHEREAL_RESET_US`; new batches use only good uplinks (all of them if none is good). The
//! unspecified knobs (batch window, start jitter, reset timer) are parameters; their defaults are ours.

use std::collections::HashMap;

use crate::gcd;
use crate::plan::SendReq;

/// Ethereal's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EtherealParams {
    /// Sends posted within this many µs of the first one form one batch (`PRISM_ETHEREAL_BATCH_US`).
    pub batch_us: u64,
    /// Each sub-flow starts after a random delay in `0..=jitter_us` µs (`PRISM_ETHEREAL_JITTER_US`).
    pub jitter_us: u32,
    /// A bad-path mark expires after this many µs (`PRISM_ETHEREAL_RESET_US`).
    pub reset_us: u64,
}

impl Default for EtherealParams {
    fn default() -> Self {
        Self { batch_us: 0, jitter_us: 2, reset_us: 10_000 }
    }
}

/// Algorithm 1's counts for `n` equal flows over `s` uplinks (the digest's worked-example columns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitCounts {
    /// q = ⌊n/s⌋ whole flows on every uplink.
    pub whole_per_uplink: usize,
    /// r = n mod s flows that get split.
    pub remainder: usize,
    /// g = gcd(r, s) (0 when r = 0).
    pub gcd: usize,
    /// s/g pieces per split flow (0 when r = 0).
    pub pieces_per_split_flow: usize,
    /// r/g pieces of split flows on every uplink (0 when r = 0).
    pub split_pieces_per_uplink: usize,
    /// s·q + r·s/g sub-flows in total.
    pub subflows: usize,
    /// r·(s − g)/g flows created beyond the original n.
    pub extra_flows: usize,
}

/// Algorithm 1's counts for `n` flows over `s ≥ 1` uplinks.
pub fn split_counts(n: usize, s: usize) -> SplitCounts {
    let s = s.max(1);
    let q = n / s;
    let r = n % s;
    if r == 0 {
        return SplitCounts {
            whole_per_uplink: q,
            remainder: 0,
            gcd: 0,
            pieces_per_split_flow: 0,
            split_pieces_per_uplink: 0,
            subflows: s * q,
            extra_flows: 0,
        };
    }
    let g = gcd(r as u64, s as u64) as usize;
    SplitCounts {
        whole_per_uplink: q,
        remainder: r,
        gcd: g,
        pieces_per_split_flow: s / g,
        split_pieces_per_uplink: r / g,
        subflows: s * q + r * s / g,
        extra_flows: r * (s - g) / g,
    }
}

/// Algorithm 1 for one group of `n` equal flows: for each flow, the uplink of each of its pieces (one
/// entry for a whole flow, s/g for a split one). `uplinks` are the good uplinks; the round-robin over them
/// begins at `start` (Ethereal's randomised position). Pieces of one flow land on distinct uplinks.
pub fn assign_flows(n: usize, uplinks: &[u16], start: usize) -> Vec<Vec<u16>> {
    let s = uplinks.len().max(1);
    let at = |k: usize| uplinks.get((start + k) % s).copied().unwrap_or(0);
    let c = split_counts(n, s);
    let whole = c.whole_per_uplink * s;
    let mut out: Vec<Vec<u16>> = (0..whole).map(|t| vec![at(t)]).collect();
    let mut k = whole;
    for _ in whole..n {
        out.push((0..c.pieces_per_split_flow).map(|i| at(k + i)).collect());
        k += c.pieces_per_split_flow;
    }
    out
}

/// Bad-path marks with a reset timer, per (rail, uplink) of this host.
#[derive(Debug, Default)]
pub struct BadPaths {
    until_us: HashMap<(u16, u16), u64>,
}

impl BadPaths {
    /// Mark `uplink` of `rail` bad until `until_us`.
    pub fn mark_bad(&mut self, rail: u16, uplink: u16, until_us: u64) {
        let e = self.until_us.entry((rail, uplink)).or_insert(0);
        *e = (*e).max(until_us);
    }

    /// Clear a mark (the transport saw the path alive again).
    pub fn mark_good(&mut self, rail: u16, uplink: u16) {
        self.until_us.remove(&(rail, uplink));
    }

    /// The good uplinks among `0..s` of `rail` at `now_us` (expired marks are dropped); all of them when
    /// every one is bad, since some path beats none.
    pub fn good_uplinks(&mut self, rail: u16, s: u16, now_us: u64) -> Vec<u16> {
        self.until_us.retain(|_, &mut t| t > now_us);
        let good: Vec<u16> = (0..s).filter(|&u| !self.until_us.contains_key(&(rail, u))).collect();
        if good.is_empty() {
            (0..s).collect()
        } else {
            good
        }
    }

    /// The marks, for stats.
    pub fn describe(&self) -> serde_json::Value {
        let v: Vec<_> = self
            .until_us
            .iter()
            .map(|(&(rail, uplink), &until)| serde_json::json!({ "rail": rail, "uplink": uplink, "until_us": until }))
            .collect();
        serde_json::Value::Array(v)
    }
}

/// Ethereal's flow interceptor: gathers the sends posted within a short window into one batch, so
/// Algorithm 1 sees every flow to a destination leaf at once. Sans-IO: the caller passes the time and asks
/// when to come back.
#[derive(Debug)]
pub struct Batcher<T> {
    window_us: u64,
    opened_us: u64,
    pending: Vec<(T, SendReq)>,
}

impl<T> Batcher<T> {
    /// A batcher with the given window (0: only sends posted at the same instant are batched).
    pub fn new(window_us: u64) -> Self {
        Self { window_us, opened_us: 0, pending: Vec::new() }
    }

    /// Queue a send. Returns the previous batch, to be planned now, when this send falls outside its
    /// window; the send then opens a new batch.
    pub fn push(&mut self, id: T, req: SendReq, now_us: u64) -> Vec<(T, SendReq)> {
        let mut ready = Vec::new();
        if !self.pending.is_empty() && now_us != self.opened_us && now_us >= self.opened_us + self.window_us {
            ready = std::mem::take(&mut self.pending);
        }
        if self.pending.is_empty() {
            self.opened_us = now_us;
        }
        self.pending.push((id, req));
        ready
    }

    /// The batch to plan now, if its window has passed at `now_us`.
    pub fn poll(&mut self, now_us: u64) -> Vec<(T, SendReq)> {
        match self.deadline() {
            Some(d) if now_us >= d => std::mem::take(&mut self.pending),
            _ => Vec::new(),
        }
    }

    /// When the open batch is due (`None` when nothing waits).
    pub fn deadline(&self) -> Option<u64> {
        (!self.pending.is_empty()).then(|| self.opened_us + self.window_us)
    }

    /// Everything pending, now (e.g. at close).
    pub fn flush(&mut self) -> Vec<(T, SendReq)> {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_counts_match_the_digests_worked_examples_for_16_uplinks() {
        // (n, q, r, g, s/g, total sub-flows, r/g, extra flows), digest §2.3 table.
        let table = [
            (1, 0, 1, 1, 16, 16, 1, 15),
            (2, 0, 2, 2, 8, 16, 1, 14),
            (3, 0, 3, 1, 16, 48, 3, 45),
            (4, 0, 4, 4, 4, 16, 1, 12),
            (5, 0, 5, 1, 16, 80, 5, 75),
            (8, 0, 8, 8, 2, 16, 1, 8),
            (12, 0, 12, 4, 4, 48, 3, 36),
            (15, 0, 15, 1, 16, 240, 15, 225),
            (16, 1, 0, 0, 0, 16, 0, 0),
            (17, 1, 1, 1, 16, 32, 1, 15),
            (24, 1, 8, 8, 2, 32, 1, 8),
        ];
        for (n, q, r, g, m, total, per_uplink, extra) in table {
            let c = split_counts(n, 16);
            assert_eq!(
                (c.whole_per_uplink, c.remainder, c.gcd, c.pieces_per_split_flow, c.subflows, c.split_pieces_per_uplink, c.extra_flows),
                (q, r, g, m, total, per_uplink, extra),
                "n = {n}"
            );
        }
    }

    #[test]
    fn every_uplink_gets_the_same_number_of_flow_sixteenths() {
        // Count in units of f/s: a whole flow is s units, a piece of a split flow is g units.
        for s in [2usize, 4, 8, 16] {
            let ups: Vec<u16> = (0..s as u16).collect();
            for n in 1..=64 {
                for start in [0, 3] {
                    let a = assign_flows(n, &ups, start);
                    let g = split_counts(n, s).gcd;
                    let mut units = vec![0usize; s];
                    for flow in &a {
                        let each = if flow.len() == 1 { s } else { g };
                        flow.iter().for_each(|&u| units[u as usize] += each);
                    }
                    assert!(units.iter().all(|&x| x == n), "n = {n}, s = {s}: {units:?}");
                }
            }
        }
    }

    #[test]
    fn pieces_of_one_flow_use_distinct_uplinks() {
        let ups: Vec<u16> = (0..16).collect();
        for n in 1..=64 {
            for flow in assign_flows(n, &ups, 5) {
                let mut f = flow.clone();
                f.sort_unstable();
                f.dedup();
                assert_eq!(f.len(), flow.len(), "n = {n}: {flow:?}");
            }
        }
    }

    #[test]
    fn only_good_uplinks_are_used_and_marks_expire_after_the_reset_time() {
        let mut b = BadPaths::default();
        b.mark_bad(0, 2, 1_000);
        assert_eq!(b.good_uplinks(0, 4, 500), vec![0, 1, 3]);
        assert_eq!(b.good_uplinks(1, 4, 500), vec![0, 1, 2, 3], "marks are per rail");
        assert_eq!(b.good_uplinks(0, 4, 1_000), vec![0, 1, 2, 3], "expired at the reset time");
        let a = assign_flows(3, &[0, 1, 3], 0);
        assert!(a.iter().flatten().all(|&u| u != 2));
    }

    #[test]
    fn all_uplinks_bad_falls_back_to_all() {
        let mut b = BadPaths::default();
        (0..4).for_each(|u| b.mark_bad(0, u, 99));
        assert_eq!(b.good_uplinks(0, 4, 1), vec![0, 1, 2, 3]);
    }

    fn req(len: u64) -> SendReq {
        SendReq { dst_host: 1, len, flow: 0, home_rail: 0 }
    }

    #[test]
    fn sends_within_the_window_form_one_batch() {
        let mut b = Batcher::new(10);
        assert!(b.push(1, req(1), 100).is_empty());
        assert!(b.push(2, req(2), 105).is_empty());
        assert_eq!(b.deadline(), Some(110));
        assert!(b.poll(109).is_empty());
        let batch = b.poll(110);
        assert_eq!(batch.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(b.deadline(), None);
    }

    #[test]
    fn a_send_after_the_window_closes_the_previous_batch() {
        let mut b = Batcher::new(10);
        b.push(1, req(1), 100);
        let ready = b.push(2, req(2), 111);
        assert_eq!(ready.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1]);
        assert_eq!(b.flush().iter().map(|x| x.0).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn a_zero_window_batches_sends_of_the_same_instant() {
        let mut b = Batcher::new(0);
        b.push(1, req(1), 7);
        b.push(2, req(1), 7);
        assert_eq!(b.poll(7).len(), 2);
    }
}
