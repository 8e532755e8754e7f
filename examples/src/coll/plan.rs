//! The collectives as schedules: local copies plus ordered sends and receives per peer, rings cut
//! into slices, and the sparse alltoall's seeded pattern.

use std::collections::HashMap;

use prism_lb::splitmix64;

use super::{Buffers, Collective, Counts};
use crate::net::{BufId, Region};

/// One send of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendOp {
    /// Destination rank.
    pub peer: usize,
    /// What to send.
    pub region: Region,
    /// Index (in [`Plan::recvs`]) of the receive that must complete before this send may be posted.
    pub after: Option<usize>,
}

/// One receive of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvOp {
    /// Source rank.
    pub peer: usize,
    /// Where the data lands.
    pub region: Region,
    /// On completion, `region += add_from` (this rank's contribution to a partial sum).
    pub add_from: Option<Region>,
    /// Index (in [`Plan::sends`]) of an earlier send of these same bytes that must complete before
    /// new data may land here.
    pub after_send: Option<usize>,
}

/// A collective as local copies plus ordered sends and receives. Per peer, sends (and receives) are
/// posted in list order; the peer's plan lists the matching operations in the same order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// `(dst, src)` copies done before any communication.
    pub copies: Vec<(Region, Region)>,
    /// Sends, in posting order per peer.
    pub sends: Vec<SendOp>,
    /// Receives, in posting order per peer.
    pub recvs: Vec<RecvOp>,
}

/// `[start, start+len)` of block `c` when `count` elements are cut into `n` nearly equal blocks.
pub fn block(c: usize, count: usize, n: usize) -> (usize, usize) {
    let base = count / n;
    let rem = count % n;
    (c * base + c.min(rem), base + usize::from(c < rem))
}

/// `(offset, len)` of the slices a region of `len` elements is sent in: `slice` elements each, the
/// last one shorter; none for an empty region.
pub fn slices(len: usize, slice: usize) -> impl Iterator<Item = (usize, usize)> {
    let slice = slice.max(1);
    (0..len.div_ceil(slice)).map(move |j| (j * slice, slice.min(len - j * slice)))
}

/// One step of a ring: send one block to the right, receive one from the left.
struct RingStep {
    send: Region,
    recv: Region,
    add_from: Option<Region>,
    /// The send forwards what the previous step received (slice by slice).
    forwards: bool,
}

fn ring(plan: &mut Plan, right: usize, left: usize, steps: &[RingStep], slice: usize) {
    // recvs index of (previous step, slice j), to chain forwarding sends.
    let mut prev: Vec<usize> = Vec::new();
    // The last send of each slice's bytes: all_reduce receives its blocks again in the all-gather after
    // forwarding them in the reduce-scatter. Slices of a block are cut the same way at every step, so
    // equal regions are the only overlaps.
    let mut last_send: HashMap<(BufId, usize, usize), usize> = HashMap::new();
    for st in steps {
        let mut cur = Vec::new();
        for (off, len) in slices(st.recv.len, slice) {
            let region = st.recv.sub(off, len);
            cur.push(plan.recvs.len());
            plan.recvs.push(RecvOp {
                peer: left,
                region,
                add_from: st.add_from.map(|a| a.sub(off, len)),
                after_send: last_send.get(&(region.buf, region.start, region.len)).copied(),
            });
        }
        for (j, (off, len)) in slices(st.send.len, slice).enumerate() {
            let after = if st.forwards { prev.get(j).copied() } else { None };
            let region = st.send.sub(off, len);
            last_send.insert((region.buf, region.start, region.len), plan.sends.len());
            plan.sends.push(SendOp { peer: right, region, after });
        }
        prev = cur;
    }
}

/// The schedule of `coll` for `rank` of `nranks` on `bufs`, with messages of at most `slice` elements.
pub fn plan(coll: Collective, rank: usize, nranks: usize, counts: Counts, bufs: Buffers, slice: usize) -> Plan {
    let n = nranks.max(1);
    let r = rank;
    let mut p = Plan::default();
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    let send = |start: usize, len: usize| Region::new(bufs.send, start, len);
    let recv = |start: usize, len: usize| Region::new(bufs.recv, start, len);
    let tmp = |start: usize, len: usize| Region::new(bufs.tmp, start, len);
    // Ring block index arithmetic modulo n, with `r - k` written as `r + n*k' - k` to stay unsigned.
    let m = |x: usize, minus: usize| (x + n * (minus / n + 1) - minus) % n;
    match coll {
        Collective::SendRecv => {
            if n == 1 {
                p.copies.push((recv(0, counts.recv), send(0, counts.send)));
            } else {
                for (off, len) in slices(counts.send, slice) {
                    p.sends.push(SendOp { peer: right, region: send(off, len), after: None });
                }
                for (off, len) in slices(counts.recv, slice) {
                    p.recvs.push(RecvOp { peer: left, region: recv(off, len), add_from: None, after_send: None });
                }
            }
        }
        Collective::OneWay => {
            if n == 1 {
                p.copies.push((recv(0, counts.recv), send(0, counts.send)));
            } else if r.is_multiple_of(2) && r + 1 < n {
                for (off, len) in slices(counts.send, slice) {
                    p.sends.push(SendOp { peer: right, region: send(off, len), after: None });
                }
            } else if r % 2 == 1 {
                for (off, len) in slices(counts.recv, slice) {
                    p.recvs.push(RecvOp { peer: left, region: recv(off, len), add_from: None, after_send: None });
                }
            }
        }
        Collective::AllReduce => {
            let count = counts.param;
            if n == 1 {
                p.copies.push((recv(0, count), send(0, count)));
                return p;
            }
            let blk = |c: usize| block(c, count, n);
            let mut steps = Vec::new();
            // Reduce-scatter: after step n-2, rank r holds the full sum of block r+1. Each block is
            // received once, straight into the output, and this rank's input is added in place.
            for s in 0..n - 1 {
                let (ss, sl) = blk(m(r, s));
                let (rs, rl) = blk(m(r, s + 1));
                steps.push(RingStep {
                    send: if s == 0 { send(ss, sl) } else { recv(ss, sl) },
                    recv: recv(rs, rl),
                    add_from: Some(send(rs, rl)),
                    forwards: s > 0,
                });
            }
            // All-gather of the reduced blocks.
            for s in n - 1..2 * (n - 1) {
                let (ss, sl) = blk(m(r, s));
                let (rs, rl) = blk(m(r, s + 1));
                steps.push(RingStep { send: recv(ss, sl), recv: recv(rs, rl), add_from: None, forwards: true });
            }
            ring(&mut p, right, left, &steps, slice);
        }
        Collective::AllGather => {
            let c = counts.param;
            p.copies.push((recv(r * c, c), send(0, c)));
            let steps: Vec<RingStep> = (0..n - 1)
                .map(|s| {
                    let sb = m(r, s);
                    let rb = m(r, s + 1);
                    RingStep {
                        send: if s == 0 { send(0, c) } else { recv(sb * c, c) },
                        recv: recv(rb * c, c),
                        add_from: None,
                        forwards: s > 0,
                    }
                })
                .collect();
            ring(&mut p, right, left, &steps, slice);
        }
        Collective::ReduceScatter => {
            let c = counts.param;
            if n == 1 {
                p.copies.push((recv(0, c), send(0, c)));
                return p;
            }
            // Shifted by one against all_reduce's reduce-scatter so that block r ends on rank r; partial
            // sums wait in tmp, the last step lands in the output.
            let steps: Vec<RingStep> = (0..n - 1)
                .map(|s| {
                    let sb = m(r, s + 1);
                    let rb = m(r, s + 2);
                    let last = s == n - 2;
                    RingStep {
                        send: if s == 0 { send(sb * c, c) } else { tmp(sb * c, c) },
                        recv: if last { recv(0, c) } else { tmp(rb * c, c) },
                        add_from: Some(send(rb * c, c)),
                        forwards: s > 0,
                    }
                })
                .collect();
            ring(&mut p, right, left, &steps, slice);
        }
        Collective::AllToAllSparse => {
            let c = counts.param;
            p.copies.push((recv(r * c, c), send(r * c, c)));
            let others: Vec<usize> = (1..n).map(|d| (r + d) % n).collect();
            let out: Vec<usize> = others.iter().map(|&q| sparse_len(r, q, n, c)).collect();
            let inc: Vec<usize> = others.iter().map(|&q| sparse_len(q, r, n, c)).collect();
            for (off, _) in slices(c, slice) {
                for (k, &q) in others.iter().enumerate() {
                    if off < out[k] {
                        let len = slice.max(1).min(out[k] - off);
                        p.sends.push(SendOp { peer: q, region: send(q * c + off, len), after: None });
                    }
                    if off < inc[k] {
                        let len = slice.max(1).min(inc[k] - off);
                        p.recvs.push(RecvOp { peer: q, region: recv(q * c + off, len), add_from: None, after_send: None });
                    }
                }
            }
        }
        Collective::AllToAll => {
            let c = counts.param;
            p.copies.push((recv(r * c, c), send(r * c, c)));
            // Slices interleaved over peers so every connection has work from the start.
            let others: Vec<usize> = (1..n).map(|d| (r + d) % n).collect();
            for (off, len) in slices(c, slice) {
                for &q in &others {
                    p.sends.push(SendOp { peer: q, region: send(q * c + off, len), after: None });
                    p.recvs.push(RecvOp { peer: q, region: recv(q * c + off, len), add_from: None, after_send: None });
                }
            }
        }
    }
    p
}

/// Seed of the sparse alltoall's pattern. Fixed, because every rank must derive the same pattern;
/// `softroce-tests/fabric/prismfab/metrics.py` repeats the computation for its lower bound.
pub const SPARSE_SEED: u64 = 0x5eed_2026_0005;

/// Elements rank `src` sends to rank `dst` in `alltoall_sparse` with blocks of `c` elements on `n`
/// ranks: `src` orders the other ranks by `splitmix64(SPARSE_SEED ^ src << 32 ^ dst)`, sends `c / (k + 1)`
/// elements to the k-th of the first `ceil((n - 1) / 2)` and nothing to the rest; its own block is
/// copied whole. The same on every rank, so receivers know what arrives.
pub fn sparse_len(src: usize, dst: usize, n: usize, c: usize) -> usize {
    if src == dst {
        return c;
    }
    let key = |d: usize| (splitmix64(SPARSE_SEED ^ ((src as u64) << 32) ^ d as u64), d);
    let mine = key(dst);
    let k = (0..n).filter(|&d| d != src && d != dst && key(d) < mine).count();
    if k < (n - 1).div_ceil(2) {
        c / (k + 1)
    } else {
        0
    }
}
