//! RailS (seed 004, `seed-rails.md` §2): LPT rail assignment. Messages are cut into atomic chunks
//! (`PRISM_CHUNK`, 32 KiB as in the paper), sorted largest first, and each goes to the rail with the
//! fewest bytes assigned so far.
//!
//! Reading (the digest's §1.4 and pitfalls P2–P4): loads are kept **per destination host** (Theorem 3
//! needs every (source, destination) pair spread evenly, per-source totals are not enough); ties go to the
//! rail with the least total load of this host, then to the first rail of a scan that starts at
//! `(src_host + dst_host) mod N`, so hosts do not all start on rail 0 (the digest's all-to-rail-0
//! hotspot). NCCL shows no all-to-all round, so loads are never reset on their own; they only count
//! assigned bytes (never decremented on completion) and are rebased to their minimum after each batch.
//! `TieBreak::Lowest` keeps the paper's unspecified "lowest index wins" for comparison.

use std::collections::HashMap;

use super::{alive_mask, RailChunk, RailPolicy};
use crate::plan::{cut, SendReq};

/// How LPT breaks ties between equally loaded rails (`PRISM_LPT_TIE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TieBreak {
    /// Scan from rail `(src_host + dst_host) mod N` (the default; avoids the rail-0 hotspot).
    Rotated,
    /// Scan from rail 0 (the paper's literal reading; shown to pile receivers onto one rail).
    Lowest,
}

impl TieBreak {
    /// The name as written in `PRISM_LPT_TIE`.
    pub fn name(self) -> &'static str {
        match self {
            TieBreak::Rotated => "rotated",
            TieBreak::Lowest => "lowest",
        }
    }
}

/// LPT over rails with per-destination loads.
#[derive(Debug)]
pub struct Lpt {
    rails: u16,
    tie: TieBreak,
    per_dst: HashMap<usize, Vec<u64>>,
    total: Vec<u64>,
}

impl Lpt {
    /// LPT over `rails` rails (at least 1, at most 64).
    pub fn new(rails: u16, tie: TieBreak) -> Self {
        let rails = rails.clamp(1, 64);
        Self { rails, tie, per_dst: HashMap::new(), total: vec![0; rails as usize] }
    }

    /// Bytes assigned to each rail towards `dst_host` (after rebasing: differences are what count).
    pub fn load(&self, dst_host: usize) -> Vec<u64> {
        self.per_dst.get(&dst_host).cloned().unwrap_or_else(|| vec![0; self.rails as usize])
    }

    fn start(&self, src: usize, dst: usize) -> usize {
        match self.tie {
            TieBreak::Rotated => (src.wrapping_add(dst)) % self.rails as usize,
            TieBreak::Lowest => 0,
        }
    }
}

/// The least-loaded usable rail: key (load towards the destination, total load), first in scan order
/// from `start` among equals.
#[inline]
fn argmin(dst_load: &[u64], total: &[u64], start: usize, mask: u64) -> usize {
    let n = dst_load.len();
    let mut best = usize::MAX;
    let mut best_key = (u64::MAX, u64::MAX);
    let mut j = start;
    for _ in 0..n {
        if mask >> j & 1 == 1 {
            let key = (dst_load[j], total[j]);
            if key < best_key {
                best_key = key;
                best = j;
            }
        }
        j += 1;
        if j == n {
            j = 0;
        }
    }
    best
}

fn rebase(v: &mut [u64]) {
    let m = v.iter().copied().min().unwrap_or(0);
    v.iter_mut().for_each(|x| *x -= m);
}

/// Greedy least-loaded assignment of one message's chunks with packed keys (load towards the
/// destination in the high half, total load in the low half; dead rails hold the maximum). Scans from
/// `start` and keeps the first minimum, so ties rotate.
fn greedy<K: Copy + Ord + std::ops::AddAssign>(
    key: &mut [K],
    start: usize,
    chunks: impl Iterator<Item = (u64, u32)>,
    out: &mut Vec<RailChunk>,
    weight: impl Fn(u32) -> K,
) {
    let n = key.len();
    // The scan order from `start`, computed once: a plain index walk is several times faster than a
    // chained range per chunk, and this loop runs once per chunk of every message.
    let mut order = [0usize; 64];
    for (i, o) in order[..n].iter_mut().enumerate() {
        *o = (start + i) % n;
    }
    let order = &order[..n];
    for (off, len) in chunks {
        let mut best = start;
        let mut best_key = key[start];
        for &j in &order[1..] {
            let k = key[j];
            // Written as selects so the compiler can avoid a hard-to-predict branch.
            let lt = k < best_key;
            best_key = if lt { k } else { best_key };
            best = if lt { j } else { best };
        }
        key[best] += weight(len);
        out.push(RailChunk { msg: 0, offset: off, len, rail: best as u16 });
    }
}

impl RailPolicy for Lpt {
    fn name(&self) -> &'static str {
        "lpt"
    }

    fn assign(&mut self, src_host: usize, reqs: &[SendReq], chunk_bytes: u32, alive: &[bool], out: &mut Vec<RailChunk>) {
        let n = self.rails as usize;
        let mask = alive_mask(alive, n);
        // Each distinct destination of the batch gets a slot holding its load vector while we work.
        let mut slots: Vec<(usize, Vec<u64>)> = Vec::new();
        let mut slot_of = Vec::with_capacity(reqs.len());
        for r in reqs {
            let s = match slots.iter().position(|(d, _)| *d == r.dst_host) {
                Some(s) => s,
                None => {
                    let v = self.per_dst.remove(&r.dst_host).unwrap_or_else(|| vec![0; n]);
                    slots.push((r.dst_host, v));
                    slots.len() - 1
                }
            };
            slot_of.push(s);
        }
        let mut place = |this: &mut Self, slots: &mut Vec<(usize, Vec<u64>)>, msg: usize, offset: u64, len: u32| {
            let (dst, load) = &mut slots[slot_of[msg]];
            let j = argmin(load, &this.total, this.start(src_host, *dst), mask);
            load[j] += len as u64;
            this.total[j] += len as u64;
            out.push(RailChunk { msg: msg as u32, offset, len, rail: j as u16 });
        };
        if reqs.len() == 1 {
            // One message (the common case): offset order is already largest first (only the tail is
            // shorter), and with one destination the two keys pack into one integer per rail.
            let (dst, load) = &mut slots[0];
            let start = self.start(src_host, *dst);
            let len = reqs[0].len;
            out.reserve(len.div_ceil(chunk_bytes.max(1) as u64) as usize);
            let alive_rails = || (0..n).filter(|&j| mask >> j & 1 == 1);
            let fits = alive_rails().all(|j| load[j].max(self.total[j]).saturating_add(len) < 1 << 32);
            if fits {
                let mut key = [u64::MAX; 64];
                alive_rails().for_each(|j| key[j] = load[j] << 32 | self.total[j]);
                greedy(&mut key[..n], start, cut(len, chunk_bytes), out, |l| (l as u64) << 32 | l as u64);
                alive_rails().for_each(|j| (load[j], self.total[j]) = (key[j] >> 32, key[j] & 0xffff_ffff));
            } else {
                let mut key = [u128::MAX; 64];
                alive_rails().for_each(|j| key[j] = (load[j] as u128) << 64 | self.total[j] as u128);
                greedy(&mut key[..n], start, cut(len, chunk_bytes), out, |l| (l as u128) << 64 | l as u128);
                alive_rails().for_each(|j| (load[j], self.total[j]) = ((key[j] >> 64) as u64, key[j] as u64));
            }
        } else {
            let mut all: Vec<(u32, u32, u64)> = Vec::new();
            for (m, r) in reqs.iter().enumerate() {
                all.extend(cut(r.len, chunk_bytes).map(|(off, len)| (len, m as u32, off)));
            }
            // Stable: equal sizes keep batch order, then offset order.
            all.sort_by_key(|c| std::cmp::Reverse(c.0));
            for (len, m, off) in all {
                place(self, &mut slots, m as usize, off, len);
            }
        }
        for (dst, mut load) in slots {
            rebase(&mut load);
            self.per_dst.insert(dst, load);
        }
        rebase(&mut self.total);
    }

    fn reset(&mut self) {
        self.per_dst.clear();
        self.total.iter_mut().for_each(|x| *x = 0);
    }

    fn describe_state(&self) -> serde_json::Value {
        serde_json::json!({ "tie": self.tie.name(), "destinations": self.per_dst.len(), "total_load": self.total })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB32: u32 = 32 * 1024;

    fn req(dst: usize, len: u64) -> SendReq {
        SendReq { dst_host: dst, len, flow: 0, home_rail: 0 }
    }

    fn spread(l: &[u64]) -> u64 {
        l.iter().max().unwrap() - l.iter().min().unwrap()
    }

    #[test]
    fn rail_loads_towards_each_destination_differ_by_at_most_one_chunk() {
        // 8 rails, messages of awkward sizes to 5 destinations, planned one by one and in batches.
        let mut lpt = Lpt::new(8, TieBreak::Rotated);
        let mut out = Vec::new();
        let sizes = [1u64, 4095, 32768, 100_000, 1 << 20, 3 * 32768 + 7, 77, 250_000];
        for (i, &len) in sizes.iter().enumerate() {
            out.clear();
            let batch: Vec<_> = (0..5).map(|d| req(d, len + d as u64 * 1000)).collect();
            if i % 2 == 0 {
                lpt.assign(3, &batch, KIB32, &[], &mut out);
            } else {
                for b in &batch {
                    lpt.assign(3, std::slice::from_ref(b), KIB32, &[], &mut out);
                }
            }
            for d in 0..5 {
                let l = lpt.load(d);
                assert!(spread(&l) <= KIB32 as u64, "round {i}, dst {d}: {l:?}");
            }
        }
    }

    #[test]
    fn a_64_mib_message_puts_exactly_8_mib_on_each_of_8_rails() {
        let mut lpt = Lpt::new(8, TieBreak::Rotated);
        let mut out = Vec::new();
        lpt.assign(0, &[req(1, 64 << 20)], KIB32, &[], &mut out);
        let mut per = [0u64; 8];
        out.iter().for_each(|c| per[c.rail as usize] += c.len as u64);
        assert_eq!(per, [8 << 20; 8]);
    }

    #[test]
    fn an_8_gib_message_beyond_32_bit_keys_puts_exactly_1_gib_on_each_of_8_rails() {
        let mut lpt = Lpt::new(8, TieBreak::Rotated);
        let mut out = Vec::new();
        lpt.assign(0, &[req(1, 8 << 30)], 16 << 20, &[], &mut out);
        let mut per = [0u64; 8];
        out.iter().for_each(|c| per[c.rail as usize] += c.len as u64);
        assert_eq!(per, [1 << 30; 8]);
    }

    #[test]
    fn dead_rails_get_nothing_and_the_rest_stay_within_one_chunk() {
        let mut lpt = Lpt::new(4, TieBreak::Rotated);
        let mut out = Vec::new();
        lpt.assign(0, &[req(1, 1_000_000)], KIB32, &[true, false, true, true], &mut out);
        let mut per = [0u64; 4];
        out.iter().for_each(|c| per[c.rail as usize] += c.len as u64);
        assert_eq!(per[1], 0);
        let live = [per[0], per[2], per[3]];
        assert!(spread(&live) <= KIB32 as u64, "{per:?}");
    }

    /// The digest's P2 experiment: M hosts, N = 8 rails, one 32 KiB chunk from every host to every other,
    /// planned destination by destination; worst receive NIC load over the average receive NIC load.
    fn worst_receive_nic_over_average(m: usize, chunks_per_dst: u64, tie: TieBreak) -> f64 {
        let n = 8usize;
        let mut rx = vec![vec![0u64; n]; m];
        for src in 0..m {
            let mut lpt = Lpt::new(n as u16, tie);
            let mut out = Vec::new();
            for dst in (0..m).filter(|&d| d != src) {
                out.clear();
                lpt.assign(src, &[req(dst, chunks_per_dst * KIB32 as u64)], KIB32, &[], &mut out);
                for c in &out {
                    rx[dst][c.rail as usize] += c.len as u64;
                }
            }
        }
        let total: u64 = rx.iter().flatten().sum();
        let avg = total as f64 / (m * n) as f64;
        let worst = *rx.iter().flatten().max().unwrap() as f64;
        worst / avg
    }

    #[test]
    fn rotated_tie_break_avoids_the_all_to_one_rail_hotspot_at_9_hosts() {
        // Digest table (M = 9, N = 8, one chunk per destination): lowest-index ties 8.00, rotated 2.00.
        let lowest = worst_receive_nic_over_average(9, 1, TieBreak::Lowest);
        let rotated = worst_receive_nic_over_average(9, 1, TieBreak::Rotated);
        assert!((lowest - 8.0).abs() < 1e-9, "lowest-index ties: {lowest}");
        assert!(rotated <= 2.0 + 1e-9, "rotated ties: {rotated}");
    }

    #[test]
    fn rotated_tie_break_keeps_receive_nics_within_1_5x_at_17_hosts() {
        // Digest: M = 17 → 1.50 rotated, 8.00 lowest-index.
        let lowest = worst_receive_nic_over_average(17, 1, TieBreak::Lowest);
        let rotated = worst_receive_nic_over_average(17, 1, TieBreak::Rotated);
        assert!((lowest - 8.0).abs() < 1e-9, "lowest-index ties: {lowest}");
        assert!(rotated <= 1.5 + 1e-9, "rotated ties: {rotated}");
    }

    #[test]
    fn the_digests_receive_hotspot_table_is_reproduced() {
        // seed-rails.md Appendix A: (M, chunks per destination, lowest-index ties, rotated ties).
        let table =
            [(9, 1, 8.00, 2.00), (9, 3, 2.67, 2.00), (9, 8, 1.00, 1.00), (17, 1, 8.00, 1.50), (128, 1, 8.00, 1.07), (128, 5, 1.60, 1.03)];
        for (m, k, lowest, rotated) in table {
            let l = worst_receive_nic_over_average(m, k, TieBreak::Lowest);
            let r = worst_receive_nic_over_average(m, k, TieBreak::Rotated);
            assert!((l - lowest).abs() < 0.005 && (r - rotated).abs() < 0.005, "M = {m}, k = {k}: {l:.3} / {r:.3}");
        }
    }

    #[test]
    fn eight_chunks_per_destination_balance_every_receive_nic_exactly() {
        // Digest: 8 chunks per destination → 1.00 with either tie rule.
        assert!((worst_receive_nic_over_average(9, 8, TieBreak::Rotated) - 1.0).abs() < 1e-9);
        assert!((worst_receive_nic_over_average(9, 8, TieBreak::Lowest) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_batch_is_placed_largest_chunk_first() {
        // Two messages: the 5-byte one must not claim an empty rail before any 32 KiB chunk does.
        let mut lpt = Lpt::new(2, TieBreak::Lowest);
        let mut out = Vec::new();
        lpt.assign(0, &[req(1, 5), req(1, 2 * KIB32 as u64)], KIB32, &[], &mut out);
        assert_eq!(out.iter().map(|c| c.len).collect::<Vec<_>>(), vec![KIB32, KIB32, 5]);
    }
}
