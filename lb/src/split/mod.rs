//! Split layer: how the bytes a message puts on one rail become sub-flows over the source leaf's uplinks.
//! A sub-flow is pinned to one uplink (the chunk's `uplink`); the path layer then only uses entropies that
//! leave on that uplink.

mod ethereal;
mod fixed;

pub use ethereal::{assign_flows, split_counts, BadPaths, Batcher, EtherealParams, SplitCounts};
pub use fixed::fixed_uplinks;

use std::collections::BTreeMap;

use rand::{rngs::SmallRng, seq::SliceRandom, Rng};

use crate::plan::{Chunk, Plan, SendReq};
use crate::rail::RailChunk;
use crate::topology::Topology;

/// Which split policy to run (`PRISM_SPLIT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitKind {
    /// Do not split: the path layer may use every entropy for every chunk.
    None,
    /// Ethereal's Algorithm 1 per destination leaf.
    Ethereal,
    /// Every flow in k equal sub-flows on random uplinks (MP-RDMA-k).
    Fixed(u16),
}

impl SplitKind {
    /// The value as written in `PRISM_SPLIT`.
    pub fn describe(self) -> String {
        match self {
            SplitKind::None => "none".into(),
            SplitKind::Ethereal => "ethereal".into(),
            SplitKind::Fixed(k) => format!("fixed:{k}"),
        }
    }
}

/// Everything the split layer needs besides the messages.
pub(crate) struct SplitEnv<'a> {
    pub topo: &'a Topology,
    pub host: usize,
    pub now_us: u64,
    pub rng: &'a mut SmallRng,
    pub bad: &'a mut BadPaths,
    pub params: &'a EtherealParams,
}

/// One connection's portions on one rail: (`SendReq::flow`, rail).
type FlowKey = (u64, u16);

/// How one (message, rail) portion is cut: the uplink of each piece (in piece order) and its start delay.
struct Pieces {
    uplinks: Vec<Option<u16>>,
    jitter_us: Vec<u32>,
}

/// Turn rail chunks into the plans of the batch. `plans[m]` receives message `m`'s chunks.
pub(crate) fn split(kind: SplitKind, env: SplitEnv<'_>, reqs: &[SendReq], rc: &[RailChunk], rails: u16, plans: &mut [Plan]) {
    if kind == SplitKind::None {
        for c in rc {
            plans[c.msg as usize].chunks.push(Chunk {
                rail: c.rail,
                uplink: None,
                subflow: 0,
                offset: c.offset,
                len: c.len,
                start_after_us: 0,
            });
        }
        return;
    }
    let nr = rails as usize;
    // The byte ranges of each (message, rail) portion, in offset order.
    let per = rc.len() / (reqs.len() * nr).max(1) + 1;
    let mut portions: Vec<Vec<(u64, u32)>> = (0..reqs.len() * nr).map(|_| Vec::with_capacity(per)).collect();
    for c in rc {
        portions[c.msg as usize * nr + c.rail as usize].push((c.offset, c.len));
    }
    // Single messages arrive in offset order already; batches sorted by size may not.
    for p in portions.iter_mut().filter(|p| p.windows(2).any(|w| w[0].0 > w[1].0)) {
        p.sort_unstable_by_key(|r| r.0);
    }
    let bytes = |p: &[(u64, u32)]| p.iter().map(|r| r.1 as u64).sum::<u64>();

    let mut cuts: Vec<Option<Pieces>> = (0..portions.len()).map(|_| None).collect();
    // Ethereal's flows: a connection's portions on one rail (`SendReq::flow`, in message order). Proto
    // serves a connection's messages one after the other within one window, so the messages of one
    // connection in a batch are one flow that runs concurrently with the other connections' flows (the
    // paper's flows are long-lived connections), not separate flows: a whole flow puts every message
    // of it on its uplink, a split flow cuts every message of it into its pieces, so the connection
    // uses all of its uplinks at once. (Planned per message, 8 messages of one connection over 4
    // uplinks went 2 per uplink, one uplink at a time, and the 5 flows of the rail fabric's Ethereal
    // scenario collided on some uplinks while others idled: CCT 2x the bound.)
    let mut flows: BTreeMap<FlowKey, Vec<usize>> = BTreeMap::new();
    // Groups of equal-size remote flows per (rail, destination leaf, size), in a deterministic order
    // (by each flow's first portion).
    let mut groups: BTreeMap<(u16, u32, u64), Vec<(usize, FlowKey)>> = BTreeMap::new();
    for (i, p) in portions.iter().enumerate() {
        if p.is_empty() {
            continue;
        }
        let (m, rail) = (i / nr, (i % nr) as u16);
        let my_leaf = env.topo.leaf_of(env.host, rail);
        let dst_leaf = env.topo.leaf_of(reqs[m].dst_host, rail);
        let remote = match (my_leaf, dst_leaf) {
            (Some(a), Some(b)) => a != b,
            _ => false,
        };
        let s = my_leaf.map(|l| env.topo.leaf(l).uplinks).unwrap_or(1);
        match kind {
            SplitKind::Ethereal if remote => flows.entry((reqs[m].flow, rail)).or_default().push(i),
            SplitKind::Fixed(k) => {
                let k = (k.max(1) as u64).min(bytes(p)) as usize;
                let uplinks = if remote { fixed_uplinks(k, s, env.rng).into_iter().map(Some).collect() } else { vec![None; k] };
                cuts[i] = Some(Pieces { uplinks, jitter_us: vec![0; k] });
            }
            // Rack-local (or unsplit): one whole piece, sent at once.
            _ => cuts[i] = Some(Pieces { uplinks: vec![None], jitter_us: vec![0] }),
        }
    }
    for (&key, members) in &flows {
        let first = members[0];
        let (m, rail) = (first / nr, (first % nr) as u16);
        let dst_leaf = env.topo.leaf_of(reqs[m].dst_host, rail).unwrap_or(0);
        let size: u64 = members.iter().map(|&i| bytes(&portions[i])).sum();
        groups.entry((rail, dst_leaf, size)).or_default().push((first, key));
    }
    for ((rail, _leaf, _size), mut members) in groups {
        members.sort_unstable();
        let my_leaf = env.topo.leaf_of(env.host, rail).unwrap_or(0);
        let s = env.topo.leaf(my_leaf).uplinks;
        let good = env.bad.good_uplinks(rail, s, env.now_us);
        let start = env.rng.gen_range(0..good.len());
        let assigned = assign_flows(members.len(), &good, start);
        for ((_, key), ups) in members.into_iter().zip(assigned) {
            for &i in &flows[&key] {
                let jitter_us = ups.iter().map(|_| env.rng.gen_range(0..=env.params.jitter_us)).collect();
                cuts[i] = Some(Pieces { uplinks: ups.iter().copied().map(Some).collect(), jitter_us });
            }
        }
    }

    // Emit: per message, one stream per (rail, piece); streams are interleaved chunk by chunk so the
    // transport serves its sub-flows round-robin (Ethereal's assumption A3), in a random stream order for
    // Ethereal (its random position in the active list).
    let mut flat: Vec<Chunk> = Vec::new();
    let mut streams: Vec<(usize, usize)> = Vec::new();
    for (m, plan) in plans.iter_mut().enumerate().take(reqs.len()) {
        flat.clear();
        streams.clear();
        for rail in 0..nr {
            let i = m * nr + rail;
            let Some(pc) = &cuts[i] else { continue };
            // Pieces are cut in order, so each piece's chunks are contiguous in `flat`.
            let mut current = usize::MAX;
            cut_portion(&portions[i], pc.uplinks.len(), |piece, offset, len| {
                if piece != current {
                    current = piece;
                    streams.push((flat.len(), flat.len()));
                }
                flat.push(Chunk {
                    rail: rail as u16,
                    uplink: pc.uplinks[piece],
                    subflow: piece as u16,
                    offset,
                    len,
                    start_after_us: pc.jitter_us[piece],
                });
                if let Some(s) = streams.last_mut() {
                    s.1 = flat.len();
                }
            });
        }
        if kind == SplitKind::Ethereal {
            streams.shuffle(env.rng);
        }
        interleave(&flat, &mut streams, &mut plan.chunks);
    }
}

/// Cut the ranges of one portion (total f bytes) into `pieces` pieces of ⌊f/pieces⌋ or ⌈f/pieces⌉ bytes,
/// in order, calling `emit(piece, offset, len)` for every non-empty segment. A piece that would be empty
/// (f < pieces) is skipped, so no chunk is ever empty.
fn cut_portion(ranges: &[(u64, u32)], pieces: usize, mut emit: impl FnMut(usize, u64, u32)) {
    let total: u64 = ranges.iter().map(|r| r.1 as u64).sum();
    let pieces = pieces.max(1) as u64;
    let (base, extra) = (total / pieces, total % pieces);
    let size = |p: u64| base + u64::from(p < extra);
    let mut piece = 0u64;
    let mut left = size(0);
    for &(mut off, len) in ranges {
        let mut len = len as u64;
        while len > 0 {
            while left == 0 {
                piece += 1;
                left = size(piece);
            }
            let take = len.min(left);
            emit(piece as usize, off, take as u32);
            off += take;
            len -= take;
            left -= take;
        }
    }
}

/// Round-robin over the streams (ranges of `flat`), one chunk at a time, appending to `out`.
fn interleave(flat: &[Chunk], streams: &mut [(usize, usize)], out: &mut Vec<Chunk>) {
    out.reserve(flat.len());
    let mut left = flat.len();
    while left > 0 {
        for s in streams.iter_mut() {
            if s.0 < s.1 {
                out.push(flat[s.0]);
                s.0 += 1;
                left -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_portion_is_cut_into_equal_pieces_across_chunk_boundaries() {
        let mut got = Vec::new();
        cut_portion(&[(0, 10), (30, 10)], 4, |p, o, l| got.push((p, o, l)));
        assert_eq!(got, vec![(0, 0, 5), (1, 5, 5), (2, 30, 5), (3, 35, 5)]);
        got.clear();
        cut_portion(&[(0, 7)], 3, |p, o, l| got.push((p, o, l)));
        assert_eq!(got, vec![(0, 0, 3), (1, 3, 2), (2, 5, 2)]);
    }

    #[test]
    fn a_portion_smaller_than_the_piece_count_yields_no_empty_piece() {
        let mut got = Vec::new();
        cut_portion(&[(0, 2)], 16, |p, o, l| got.push((p, o, l)));
        assert_eq!(got, vec![(0, 0, 1), (1, 1, 1)]);
    }
}
