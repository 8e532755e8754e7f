//! The rail baselines RailS compares against in spirit: `rr` (chunks round-robin over the rails, one
//! pointer per destination, starting at a per-host rotation), `hash` (a whole connection on one rail,
//! chosen by hash: the multi-NIC picture of ECMP) and `single` (the connection's own NIC only, as NCCL's
//! IB transport does). Chunks are `PRISM_CHUNK` bytes for all of them, so only the rail choice differs.

use std::collections::HashMap;

use super::{alive_mask, RailChunk, RailPolicy};
use crate::plan::{cut, SendReq};
use crate::splitmix64;

/// The first usable rail at or after `from` (wrapping), for a mask that has at least one bit set.
fn next_usable(mask: u64, n: usize, from: usize) -> usize {
    let mut r = if from >= n { from % n } else { from };
    for _ in 0..n {
        if mask >> r & 1 == 1 {
            return r;
        }
        r = if r + 1 == n { 0 } else { r + 1 };
    }
    0
}

/// Round-robin over rails, one pointer per destination host.
#[derive(Debug)]
pub struct RoundRobin {
    rails: u16,
    next: HashMap<usize, usize>,
}

impl RoundRobin {
    /// Round-robin over `rails` rails.
    pub fn new(rails: u16) -> Self {
        Self { rails: rails.clamp(1, 64), next: HashMap::new() }
    }
}

impl RailPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "rr"
    }

    fn assign(&mut self, src_host: usize, reqs: &[SendReq], chunk_bytes: u32, alive: &[bool], out: &mut Vec<RailChunk>) {
        let n = self.rails as usize;
        let mask = alive_mask(alive, n);
        for (m, r) in reqs.iter().enumerate() {
            let ptr = self.next.entry(r.dst_host).or_insert(src_host.wrapping_add(r.dst_host) % n);
            for (off, len) in cut(r.len, chunk_bytes) {
                let rail = next_usable(mask, n, *ptr);
                *ptr = if rail + 1 == n { 0 } else { rail + 1 };
                out.push(RailChunk { msg: m as u32, offset: off, len, rail: rail as u16 });
            }
        }
    }

    fn reset(&mut self) {
        self.next.clear();
    }
}

/// One rail per connection: a seeded hash of (source, destination, connection) picks it.
#[derive(Debug)]
pub struct HashRail {
    rails: u16,
    seed: u64,
}

impl HashRail {
    /// Hash rails over `rails` rails; `seed` varies the hash between runs.
    pub fn new(rails: u16, seed: u64) -> Self {
        Self { rails: rails.clamp(1, 64), seed }
    }
}

impl RailPolicy for HashRail {
    fn name(&self) -> &'static str {
        "hash"
    }

    fn assign(&mut self, src_host: usize, reqs: &[SendReq], chunk_bytes: u32, alive: &[bool], out: &mut Vec<RailChunk>) {
        let n = self.rails as usize;
        let mask = alive_mask(alive, n);
        let usable = mask.count_ones() as u64;
        for (m, r) in reqs.iter().enumerate() {
            let h = splitmix64(self.seed ^ splitmix64(src_host as u64 ^ splitmix64(r.dst_host as u64 ^ splitmix64(r.flow))));
            // The k-th usable rail, so a dead rail moves only the connections it carried.
            let k = (h % usable) as u32;
            let rail = (0..n).filter(|&j| mask >> j & 1 == 1).nth(k as usize).unwrap_or(0);
            out.extend(cut(r.len, chunk_bytes).map(|(off, len)| RailChunk { msg: m as u32, offset: off, len, rail: rail as u16 }));
        }
    }
}

/// Every chunk on the connection's own rail (or the next usable one when it is dead).
#[derive(Debug)]
pub struct SingleRail {
    rails: u16,
}

impl SingleRail {
    /// Single-rail policy for `rails` rails.
    pub fn new(rails: u16) -> Self {
        Self { rails: rails.clamp(1, 64) }
    }
}

impl RailPolicy for SingleRail {
    fn name(&self) -> &'static str {
        "single"
    }

    fn assign(&mut self, _src_host: usize, reqs: &[SendReq], chunk_bytes: u32, alive: &[bool], out: &mut Vec<RailChunk>) {
        let n = self.rails as usize;
        let mask = alive_mask(alive, n);
        for (m, r) in reqs.iter().enumerate() {
            let rail = next_usable(mask, n, r.home_rail as usize % n);
            out.extend(cut(r.len, chunk_bytes).map(|(off, len)| RailChunk { msg: m as u32, offset: off, len, rail: rail as u16 }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(dst: usize, len: u64, flow: u64, home: u16) -> SendReq {
        SendReq { dst_host: dst, len, flow, home_rail: home }
    }

    fn rails_of(p: &mut dyn RailPolicy, r: SendReq, alive: &[bool]) -> Vec<u16> {
        let mut out = Vec::new();
        p.assign(2, &[r], 1000, alive, &mut out);
        out.iter().map(|c| c.rail).collect()
    }

    #[test]
    fn rr_cycles_through_all_4_rails_per_destination() {
        let mut p = RoundRobin::new(4);
        let a = rails_of(&mut p, req(1, 8000, 0, 0), &[]);
        // Start at (src 2 + dst 1) mod 4 = 3.
        assert_eq!(a, vec![3, 0, 1, 2, 3, 0, 1, 2]);
        // The pointer persists per destination and is independent across destinations.
        assert_eq!(rails_of(&mut p, req(1, 1000, 0, 0), &[]), vec![3]);
        assert_eq!(rails_of(&mut p, req(2, 1000, 0, 0), &[]), vec![0]);
    }

    #[test]
    fn rr_skips_a_dead_rail() {
        let mut p = RoundRobin::new(4);
        let a = rails_of(&mut p, req(1, 8000, 0, 0), &[true, true, false, true]);
        assert!(!a.contains(&2), "{a:?}");
    }

    #[test]
    fn hash_keeps_a_whole_connection_on_one_rail_and_spreads_connections() {
        let mut p = HashRail::new(8, 11);
        let mut used = [0u32; 8];
        for flow in 0..800 {
            let a = rails_of(&mut p, req(1, 5000, flow, 0), &[]);
            assert!(a.iter().all(|&r| r == a[0]));
            assert_eq!(rails_of(&mut p, req(1, 3000, flow, 0), &[])[0], a[0], "flow {flow} moved");
            used[a[0] as usize] += 1;
        }
        // 100 expected per rail; a fair hash stays within ±40%.
        assert!(used.iter().all(|&u| (60..140).contains(&u)), "{used:?}");
    }

    #[test]
    fn single_uses_the_home_rail_and_fails_over_to_the_next() {
        let mut p = SingleRail::new(4);
        assert_eq!(rails_of(&mut p, req(1, 3000, 0, 2), &[]), vec![2, 2, 2]);
        assert_eq!(rails_of(&mut p, req(1, 1000, 0, 2), &[true, true, false, true]), vec![3]);
    }
}
