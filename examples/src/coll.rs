//! The collectives as schedules of point-to-point sends and receives, and the executor that drives a
//! schedule through a [`Transport`] the way NCCL's proxy does: post what the window allows, test every
//! outstanding request, repeat.
//!
//! Rings follow NCCL's ring algorithm (reduce-scatter then all-gather for all_reduce); each ring step
//! is cut into slices so that the next step's slice can leave as soon as it arrived, which keeps
//! several sends in flight per connection.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use prism_lb::splitmix64;
use serde::Serialize;

use crate::net::{BufId, NetError, Region, ReqId, Transport, MAX_REQUESTS_PER_COMM};

/// The collectives prism-perf runs (nccl-tests' names without `_perf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
pub enum Collective {
    /// Each rank sends to rank+1 and receives from rank-1.
    #[value(name = "sendrecv")]
    #[serde(rename = "sendrecv")]
    SendRecv,
    /// Sum over all ranks, result on every rank (ring reduce-scatter + ring all-gather).
    #[value(name = "all_reduce")]
    #[serde(rename = "all_reduce")]
    AllReduce,
    /// Every rank's block, concatenated in rank order, on every rank (ring).
    #[value(name = "all_gather")]
    #[serde(rename = "all_gather")]
    AllGather,
    /// Sum over all ranks; rank r keeps block r (ring).
    #[value(name = "reduce_scatter")]
    #[serde(rename = "reduce_scatter")]
    ReduceScatter,
    /// Block p of rank r goes to block r of rank p (every pair at once).
    #[value(name = "alltoall")]
    #[serde(rename = "alltoall")]
    AllToAll,
    /// Sparse, skewed alltoall (as in RailS): rank r sends to half of the other ranks (rounded up),
    /// chosen and ordered by a seeded hash, the k-th of them getting 1/(k+1) of a block (Zipf); the
    /// rest get nothing. See [`sparse_len`].
    #[value(name = "alltoall_sparse")]
    #[serde(rename = "alltoall_sparse")]
    AllToAllSparse,
}

/// Element counts of one run, as nccl-tests derives them from a size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Elements in each rank's send buffer.
    pub send: usize,
    /// Elements in each rank's receive buffer.
    pub recv: usize,
    /// The count passed to the collective (nccl-tests' "count" column).
    pub param: usize,
}

impl Counts {
    /// nccl-tests' "size (B)" column: the larger of the two buffers.
    pub fn size_bytes(&self) -> usize {
        self.send.max(self.recv) * crate::net::ELEM_BYTES
    }
}

impl Collective {
    /// Every collective, in the order `all` runs them.
    pub const ALL: [Collective; 6] = [
        Collective::SendRecv,
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::AllToAllSparse,
    ];

    /// nccl-tests' name (without `_perf`).
    pub fn name(self) -> &'static str {
        match self {
            Collective::SendRecv => "sendrecv",
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "alltoall",
            Collective::AllToAllSparse => "alltoall_sparse",
        }
    }

    /// Whether the collective adds (the table's redop column says "sum", else "none").
    pub fn is_reduction(self) -> bool {
        matches!(self, Collective::AllReduce | Collective::ReduceScatter)
    }

    /// Counts for a size of `bytes`, rounded down the way nccl-tests' `*GetCollByteCount` do.
    pub fn counts(self, bytes: usize, nranks: usize) -> Counts {
        let n = nranks.max(1);
        let count = bytes / crate::net::ELEM_BYTES;
        let per_rank = count / n;
        match self {
            Collective::SendRecv | Collective::AllReduce => Counts { send: count, recv: count, param: count },
            Collective::AllGather => Counts { send: per_rank, recv: per_rank * n, param: per_rank },
            Collective::ReduceScatter => Counts { send: per_rank * n, recv: per_rank, param: per_rank },
            Collective::AllToAll | Collective::AllToAllSparse => Counts { send: per_rank * n, recv: per_rank * n, param: per_rank },
        }
    }

    /// (peers this rank sends to, peers it receives from).
    pub fn peers(self, rank: usize, nranks: usize) -> (Vec<usize>, Vec<usize>) {
        if nranks <= 1 {
            return (Vec::new(), Vec::new());
        }
        match self {
            Collective::AllToAll | Collective::AllToAllSparse => {
                let others: Vec<usize> = (1..nranks).map(|d| (rank + d) % nranks).collect();
                (others.clone(), others)
            }
            _ => (vec![(rank + 1) % nranks], vec![(rank + nranks - 1) % nranks]),
        }
    }
}

/// The buffers one rank runs a collective on (allocated once for the largest size).
#[derive(Debug, Clone, Copy)]
pub struct Buffers {
    /// Input.
    pub send: BufId,
    /// Output (out-of-place).
    pub recv: BufId,
    /// Partial sums in flight (reduce_scatter only, whose output is too small to hold them).
    pub tmp: BufId,
}

impl Buffers {
    /// Allocates (and registers) buffers big enough for `max`.
    pub fn alloc(t: &mut dyn Transport, coll: Collective, max: Counts) -> Result<Self, NetError> {
        let send = t.alloc(max.send)?;
        let recv = t.alloc(max.recv)?;
        let tmp = t.alloc(if coll == Collective::ReduceScatter { max.send } else { 0 })?;
        Ok(Self { send, recv, tmp })
    }
}

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

/// How the executor posts and waits.
#[derive(Debug, Clone, Copy)]
pub struct ExecConfig {
    /// Requests in flight per comm (per direction and peer); NCCL keeps 8 (NCCL_STEPS).
    pub window: usize,
    /// Requests in flight on all comms together.
    pub max_inflight: usize,
    /// Fail when nothing completed or got posted for this long.
    pub timeout: Duration,
}

impl Default for ExecConfig {
    fn default() -> Self {
        Self { window: 8, max_inflight: 256, timeout: Duration::from_secs(60) }
    }
}

/// Errors of a collective run.
#[derive(Debug, thiserror::Error)]
pub enum CollError {
    /// The transport refused or failed an operation.
    #[error("rank {rank}: {op}: {error}")]
    Net {
        /// This rank.
        rank: usize,
        /// What was being done.
        op: String,
        /// The transport's error (in the message, so not also a `source`).
        error: NetError,
    },
    /// A receive completed with a size other than the one sent.
    #[error("rank {rank}: receive #{index} from rank {peer} completed with {got} bytes, expected {expected}")]
    SizeMismatch {
        /// This rank.
        rank: usize,
        /// Source rank.
        peer: usize,
        /// Receive index in the plan.
        index: usize,
        /// Bytes reported by test.
        got: usize,
        /// Bytes posted (and sent).
        expected: usize,
    },
    /// Nothing progressed for the configured timeout.
    #[error("rank {rank}: no progress for {secs:.1} s (-T); pending: {pending}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// Seconds without progress.
        secs: f64,
        /// What was posted and what could not be posted yet.
        pending: String,
    },
    /// A schedule refers to peers this transport has no rank for.
    #[error("rank {rank}: schedule names peer {peer} but the job has {nranks} ranks")]
    BadPeer {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// Ranks in the job.
        nranks: usize,
    },
}

/// Counters of one execution.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// isend/irecv calls answered "retry later".
    pub retries: u64,
    /// test calls made.
    pub tests: u64,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Send(usize),
    Recv(usize),
}

struct PeerQueues {
    peer: usize,
    sends: Vec<usize>,
    recvs: Vec<usize>,
    next_send: usize,
    next_recv: usize,
    sends_in_flight: usize,
    recvs_in_flight: usize,
    send_retries: u64,
    recv_retries: u64,
    recv_waits_for_send: bool,
}

/// Runs `plan` to completion on `t`.
pub fn execute(t: &mut dyn Transport, plan: &Plan, cfg: &ExecConfig) -> Result<ExecStats, CollError> {
    let rank = t.rank();
    let nranks = t.nranks();
    let net = |op: String| move |error: NetError| CollError::Net { rank, op, error };
    for (dst, src) in &plan.copies {
        t.pool_mut().copy(*dst, *src).map_err(net(format!("local copy {src:?} -> {dst:?}")))?;
    }
    let mut queues: Vec<PeerQueues> = Vec::new();
    let queue_of = |queues: &mut Vec<PeerQueues>, peer: usize| -> usize {
        if let Some(i) = queues.iter().position(|q| q.peer == peer) {
            return i;
        }
        queues.push(PeerQueues {
            peer,
            sends: Vec::new(),
            recvs: Vec::new(),
            next_send: 0,
            next_recv: 0,
            sends_in_flight: 0,
            recvs_in_flight: 0,
            send_retries: 0,
            recv_retries: 0,
            recv_waits_for_send: false,
        });
        queues.len() - 1
    };
    for (i, s) in plan.sends.iter().enumerate() {
        if s.peer >= nranks {
            return Err(CollError::BadPeer { rank, peer: s.peer, nranks });
        }
        let q = queue_of(&mut queues, s.peer);
        queues[q].sends.push(i);
    }
    for (i, r) in plan.recvs.iter().enumerate() {
        if r.peer >= nranks {
            return Err(CollError::BadPeer { rank, peer: r.peer, nranks });
        }
        let q = queue_of(&mut queues, r.peer);
        queues[q].recvs.push(i);
    }
    let window = cfg.window.clamp(1, MAX_REQUESTS_PER_COMM);
    let max_inflight = cfg.max_inflight.max(1);
    let mut recv_done = vec![false; plan.recvs.len()];
    let mut send_done = vec![false; plan.sends.len()];
    let mut done = 0usize;
    let total = plan.sends.len() + plan.recvs.len();
    let mut outstanding: Vec<(ReqId, Op)> = Vec::new();
    let mut stats = ExecStats::default();
    let mut last_progress = Instant::now();
    let mut round = 0usize;
    while done < total {
        let mut progress = false;
        let nq = queues.len();
        for k in 0..nq {
            // Rotate the starting peer so a full global window does not always starve the same one.
            let q = &mut queues[(k + round) % nq];
            // Receives first: posting them is what lets the peers' sends go (the receiver-driven CTS).
            while q.next_recv < q.recvs.len() && q.recvs_in_flight < window && outstanding.len() < max_inflight {
                let idx = q.recvs[q.next_recv];
                let op = plan.recvs[idx];
                // A ring receives a block again (all-gather) that it is maybe still forwarding from the
                // reduce-scatter: the new data may only land once that send has let go of the bytes.
                if op.after_send.is_some_and(|a| !send_done[a]) || !t.pool().is_idle(op.region) {
                    q.recv_waits_for_send = true;
                    break;
                }
                q.recv_waits_for_send = false;
                match t.irecv(op.peer, op.region).map_err(net(format!("irecv #{idx} from rank {}", op.peer)))? {
                    Some(id) => {
                        outstanding.push((id, Op::Recv(idx)));
                        q.next_recv += 1;
                        q.recvs_in_flight += 1;
                        progress = true;
                    }
                    None => {
                        q.recv_retries += 1;
                        stats.retries += 1;
                        break;
                    }
                }
            }
            while q.next_send < q.sends.len() && q.sends_in_flight < window && outstanding.len() < max_inflight {
                let idx = q.sends[q.next_send];
                let op = plan.sends[idx];
                if op.after.is_some_and(|a| !recv_done[a]) {
                    break;
                }
                match t.isend(op.peer, op.region).map_err(net(format!("isend #{idx} to rank {}", op.peer)))? {
                    Some(id) => {
                        outstanding.push((id, Op::Send(idx)));
                        q.next_send += 1;
                        q.sends_in_flight += 1;
                        progress = true;
                    }
                    None => {
                        q.send_retries += 1;
                        stats.retries += 1;
                        break;
                    }
                }
            }
        }
        round = round.wrapping_add(1);
        let mut i = 0;
        while i < outstanding.len() {
            let (id, op) = outstanding[i];
            stats.tests += 1;
            let what = match op {
                Op::Send(idx) => format!("test of isend #{idx} to rank {}", plan.sends[idx].peer),
                Op::Recv(idx) => format!("test of irecv #{idx} from rank {}", plan.recvs[idx].peer),
            };
            let Some(bytes) = t.test(id).map_err(net(what))? else {
                i += 1;
                continue;
            };
            outstanding.swap_remove(i);
            progress = true;
            done += 1;
            match op {
                Op::Send(idx) => {
                    let qi = queues.iter().position(|q| q.peer == plan.sends[idx].peer).expect("queue exists");
                    queues[qi].sends_in_flight -= 1;
                    send_done[idx] = true;
                }
                Op::Recv(idx) => {
                    let r = plan.recvs[idx];
                    let qi = queues.iter().position(|q| q.peer == r.peer).expect("queue exists");
                    queues[qi].recvs_in_flight -= 1;
                    if bytes != r.region.bytes() {
                        return Err(CollError::SizeMismatch { rank, peer: r.peer, index: idx, got: bytes, expected: r.region.bytes() });
                    }
                    if let Some(src) = r.add_from {
                        t.pool_mut().add_assign(r.region, src).map_err(net(format!("sum after irecv #{idx}")))?;
                    }
                    recv_done[idx] = true;
                }
            }
        }
        if progress {
            last_progress = Instant::now();
        } else if last_progress.elapsed() >= cfg.timeout {
            return Err(CollError::Timeout {
                rank,
                secs: last_progress.elapsed().as_secs_f64(),
                pending: describe_pending(plan, &queues, &outstanding, &recv_done, window),
            });
        } else {
            // Two cores are shared by every rank and the plugin's threads: give them the CPU.
            std::thread::yield_now();
        }
    }
    Ok(stats)
}

fn describe_pending(plan: &Plan, queues: &[PeerQueues], outstanding: &[(ReqId, Op)], recv_done: &[bool], window: usize) -> String {
    let mut parts: Vec<String> = outstanding
        .iter()
        .take(8)
        .map(|(_, op)| match *op {
            Op::Send(i) => format!("isend #{i} to rank {} ({} B) posted, not done", plan.sends[i].peer, plan.sends[i].region.bytes()),
            Op::Recv(i) => format!("irecv #{i} from rank {} ({} B) posted, not done", plan.recvs[i].peer, plan.recvs[i].region.bytes()),
        })
        .collect();
    if outstanding.len() > 8 {
        parts.push(format!("... {} posted requests in all", outstanding.len()));
    }
    for q in queues {
        if q.next_recv < q.recvs.len() {
            let reason = if q.recvs_in_flight >= window {
                "window full".to_string()
            } else if q.recv_waits_for_send {
                "next waits for a send from the same bytes".to_string()
            } else {
                format!("{} retry-later answers", q.recv_retries)
            };
            parts.push(format!("{} irecvs from rank {} not posted yet ({reason})", q.recvs.len() - q.next_recv, q.peer));
        }
        if q.next_send < q.sends.len() {
            let next = plan.sends[q.sends[q.next_send]];
            let reason = match next.after {
                Some(a) if !recv_done[a] => format!("next waits for irecv #{a}"),
                _ if q.sends_in_flight >= window => "window full".to_string(),
                _ => format!("{} retry-later answers", q.send_retries),
            };
            parts.push(format!("{} isends to rank {} not posted yet ({reason})", q.sends.len() - q.next_send, q.peer));
        }
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data;
    use crate::memnet::{self, MemNet, MemNetConfig};

    /// Runs `coll` once on `n` in-memory ranks; returns each rank's wrong-element count (or error text).
    fn run_job(
        coll: Collective,
        n: usize,
        bytes: usize,
        slice: usize,
        window: usize,
        cfg: MemNetConfig,
    ) -> (MemNet, Vec<Result<usize, String>>) {
        let (net, ranks) = memnet::mesh(n, cfg);
        let exec = ExecConfig { window, max_inflight: 64, timeout: Duration::from_secs(20) };
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|mut t| {
                std::thread::spawn(move || -> Result<usize, String> {
                    let counts = coll.counts(bytes, n);
                    let bufs = Buffers::alloc(&mut t, coll, counts).map_err(|e| e.to_string())?;
                    let p = plan(coll, t.rank(), n, counts, bufs, slice);
                    // Two passes: the second proves buffers and schedules are reusable.
                    for pass in 0..2 {
                        data::prepare(&mut t, bufs, counts, pass).map_err(|e| e.to_string())?;
                        execute(&mut t, &p, &exec).map_err(|e| e.to_string())?;
                    }
                    data::count_wrong(&t, coll, bufs, counts, 1).map_err(|e| e.to_string())
                })
            })
            .collect();
        let results = threads.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("rank thread panicked".into()))).collect();
        (net, results)
    }

    /// Byte sizes including ones whose element count is not divisible by 2, 3 or 4, and sizes smaller
    /// than the number of ranks.
    const SIZES: [usize; 8] = [0, 4, 12, 20, 4 * 97, 4 * 1000, 4 * 1003, 4 * 4099];

    fn exact_for_all(coll: Collective) {
        for n in [1, 2, 3, 4] {
            for (k, &bytes) in SIZES.iter().enumerate() {
                let seed = 1000 * n as u64 + k as u64;
                let (_, res) = run_job(coll, n, bytes, 64, 4, MemNetConfig::lossless(seed));
                for (r, w) in res.iter().enumerate() {
                    assert_eq!(w, &Ok(0), "{} n={n} bytes={bytes} rank {r} seed {seed}: {res:?}", coll.name());
                }
            }
        }
    }

    #[test]
    fn sendrecv_delivers_every_element_on_1_to_4_ranks() {
        exact_for_all(Collective::SendRecv);
    }

    #[test]
    fn all_reduce_sums_exactly_on_1_to_4_ranks_at_uneven_sizes() {
        exact_for_all(Collective::AllReduce);
    }

    #[test]
    fn all_gather_places_every_block_on_1_to_4_ranks() {
        exact_for_all(Collective::AllGather);
    }

    #[test]
    fn reduce_scatter_leaves_block_r_summed_on_rank_r() {
        exact_for_all(Collective::ReduceScatter);
    }

    #[test]
    fn alltoall_transposes_blocks_on_1_to_4_ranks() {
        exact_for_all(Collective::AllToAll);
    }

    #[test]
    fn sparse_alltoall_delivers_its_skewed_blocks_and_writes_nothing_else() {
        exact_for_all(Collective::AllToAllSparse);
    }

    #[test]
    fn sparse_alltoall_is_sparse_and_skewed() {
        for n in [2, 3, 4, 8] {
            let c = 840;
            for src in 0..n {
                let mut lens: Vec<usize> = (0..n).filter(|&d| d != src).map(|d| sparse_len(src, d, n, c)).collect();
                lens.sort_unstable_by(|a, b| b.cmp(a));
                let fan = (n - 1).div_ceil(2);
                let want: Vec<usize> = (0..n - 1).map(|k| if k < fan { c / (k + 1) } else { 0 }).collect();
                assert_eq!(lens, want, "n={n} src={src}");
            }
        }
        // The pattern on 4 ranks (metrics.py's port for the fabric's lower bound pins the same matrix).
        let m4: Vec<Vec<usize>> = (0..4).map(|s| (0..4).map(|d| sparse_len(s, d, 4, 840)).collect()).collect();
        assert_eq!(m4, vec![vec![840, 840, 420, 0], vec![840, 840, 0, 420], vec![840, 420, 840, 0], vec![0, 840, 420, 840]]);
        // Deterministic, and not the same subset on every rank.
        assert_eq!(sparse_len(1, 5, 8, 100), sparse_len(1, 5, 8, 100));
        let first: Vec<usize> = (0..8).map(|s| (0..8).filter(|&d| d != s).max_by_key(|&d| sparse_len(s, d, 8, 100)).unwrap()).collect();
        assert!(first.iter().any(|&d| d != first[0]), "{first:?}");
    }

    #[test]
    fn a_window_of_one_still_completes_every_collective() {
        for coll in Collective::ALL {
            let seed = 77;
            let (_, res) = run_job(coll, 3, 4 * 1003, 50, 1, MemNetConfig::lossless(seed));
            assert!(res.iter().all(|w| w == &Ok(0)), "{} seed {seed}: {res:?}", coll.name());
        }
    }

    #[test]
    fn executor_never_posts_more_than_the_window_on_one_comm() {
        // The network fails any comm that gets a 4th open request.
        let cfg = MemNetConfig { max_requests_per_comm: 3, ..MemNetConfig::lossless(5) };
        for coll in Collective::ALL {
            let (_, res) = run_job(coll, 3, 4 * 4099, 16, 3, cfg);
            assert!(res.iter().all(|w| w == &Ok(0)), "{}: {res:?}", coll.name());
        }
    }

    #[test]
    fn a_window_above_the_plugins_request_limit_is_caught_by_the_network() {
        // The counterpart of the test above: the limit check does bite.
        let cfg = MemNetConfig { max_requests_per_comm: 3, retry_later_pct: 0, delay_pct: 90, ..MemNetConfig::lossless(5) };
        let (_, res) = run_job(Collective::SendRecv, 2, 4 * 4099, 16, 8, cfg);
        assert!(res.iter().any(|w| w.as_ref().is_err_and(|e| e.contains("already open"))), "{res:?}");
    }

    #[test]
    fn ring_slices_keep_several_sends_in_flight_per_comm() {
        let cfg = MemNetConfig { retry_later_pct: 0, delay_pct: 80, ..MemNetConfig::lossless(9) };
        let (net, res) = run_job(Collective::AllReduce, 2, 4 * 8192, 256, 8, cfg);
        assert!(res.iter().all(|w| w == &Ok(0)), "{res:?}");
        assert!(net.max_open_sends() > 1, "max sends in flight: {}", net.max_open_sends());
    }

    #[test]
    fn verification_counts_every_corrupted_element_of_sendrecv_and_alltoall() {
        for coll in [Collective::SendRecv, Collective::AllToAll] {
            let cfg = MemNetConfig { corrupt_every: Some(101), ..MemNetConfig::lossless(3) };
            let (net, res) = run_job(coll, 3, 4 * 3000, 128, 4, cfg);
            let wrong: usize = res.iter().map(|w| *w.as_ref().unwrap()).sum();
            // Each element sent lands in exactly one place; both passes corrupt, the check sees the 2nd.
            assert!(
                wrong > 0 && wrong * 2 >= net.corrupted() - 3 && wrong * 2 <= net.corrupted() + 3,
                "{}: wrong {wrong}, corrupted {}",
                coll.name(),
                net.corrupted()
            );
        }
    }

    #[test]
    fn corruption_inside_a_ring_reduction_is_detected() {
        for coll in [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather] {
            let cfg = MemNetConfig { corrupt_every: Some(997), ..MemNetConfig::lossless(4) };
            let (_, res) = run_job(coll, 4, 4 * 4000, 128, 4, cfg);
            let wrong: usize = res.iter().map(|w| *w.as_ref().unwrap()).sum();
            assert!(wrong > 0, "{}", coll.name());
        }
    }

    #[test]
    fn a_silent_peer_makes_the_wait_fail_with_what_was_pending() {
        let (_net, mut ranks) = memnet::mesh(2, MemNetConfig::lossless(1));
        let mut t = ranks.remove(0);
        let coll = Collective::SendRecv;
        let counts = coll.counts(4096, 2);
        let bufs = Buffers::alloc(&mut t, coll, counts).unwrap();
        let p = plan(coll, 0, 2, counts, bufs, 256);
        let exec = ExecConfig { window: 2, max_inflight: 8, timeout: Duration::from_millis(200) };
        let err = execute(&mut t, &p, &exec).unwrap_err().to_string();
        assert!(err.contains("no progress") && err.contains("irecv #0 from rank 1"), "{err}");
        assert!(err.contains("isends to rank 1 not posted yet"), "{err}");
    }

    /// Per ordered pair (a -> b): the lengths of a's sends to b, and of b's receives from a, in order.
    fn matched_lengths(coll: Collective, n: usize, bytes: usize, slice: usize) {
        let counts = coll.counts(bytes, n);
        let plans: Vec<Plan> = (0..n)
            .map(|r| {
                let bufs = Buffers { send: BufIdFor::id(0), recv: BufIdFor::id(1), tmp: BufIdFor::id(2) };
                plan(coll, r, n, counts, bufs, slice)
            })
            .collect();
        for a in 0..n {
            for b in 0..n {
                let sends: Vec<usize> = plans[a].sends.iter().filter(|s| s.peer == b).map(|s| s.region.len).collect();
                let recvs: Vec<usize> = plans[b].recvs.iter().filter(|r| r.peer == a).map(|r| r.region.len).collect();
                assert_eq!(sends, recvs, "{} n={n} bytes={bytes}: {a} -> {b}", coll.name());
            }
        }
    }

    /// Buffer ids for pure plan tests (no pool needed).
    struct BufIdFor;
    impl BufIdFor {
        fn id(i: usize) -> BufId {
            let mut pool = crate::net::Pool::new();
            let mut last = pool.alloc(0).unwrap();
            for _ in 0..i {
                last = pool.alloc(0).unwrap();
            }
            last
        }
    }

    #[test]
    fn every_send_meets_a_receive_of_the_same_size_in_the_same_order() {
        for coll in Collective::ALL {
            for n in 1..=5 {
                for bytes in [0, 4, 4 * 7, 4 * 1001, 4 * 5000] {
                    matched_lengths(coll, n, bytes, 100);
                }
            }
        }
    }

    #[test]
    fn forwarding_sends_wait_only_for_earlier_receives_of_the_same_length() {
        for coll in [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter] {
            let counts = coll.counts(4 * 1003, 4);
            let bufs = Buffers { send: BufIdFor::id(0), recv: BufIdFor::id(1), tmp: BufIdFor::id(2) };
            let p = plan(coll, 1, 4, counts, bufs, 64);
            for s in &p.sends {
                if let Some(a) = s.after {
                    assert_eq!(p.recvs[a].region, s.region, "{}: a forward sends exactly what arrived", coll.name());
                }
            }
        }
    }

    /// Every operation `op` transitively waits for, as (is_send, index). Each op waits for at most one
    /// other, so the dependencies form a chain.
    fn chain(p: &Plan, mut op: Op) -> Vec<(bool, usize)> {
        let mut out = Vec::new();
        loop {
            let next = match op {
                Op::Send(j) => p.sends[j].after.map(Op::Recv),
                Op::Recv(i) => p.recvs[i].after_send.map(Op::Send),
            };
            match next {
                Some(Op::Send(j)) => out.push((true, j)),
                Some(Op::Recv(i)) => out.push((false, i)),
                None => return out,
            }
            op = next.expect("matched Some above");
        }
    }

    #[test]
    fn every_send_and_receive_sharing_bytes_are_ordered_by_a_dependency() {
        for coll in Collective::ALL {
            for n in 2..=5 {
                let counts = coll.counts(4 * 1003, n);
                let bufs = Buffers { send: BufIdFor::id(0), recv: BufIdFor::id(1), tmp: BufIdFor::id(2) };
                for rank in 0..n {
                    let p = plan(coll, rank, n, counts, bufs, 64);
                    for (i, r) in p.recvs.iter().enumerate() {
                        for (j, s) in p.sends.iter().enumerate() {
                            if r.region.overlaps(&s.region) {
                                assert!(
                                    chain(&p, Op::Send(j)).contains(&(false, i)) || chain(&p, Op::Recv(i)).contains(&(true, j)),
                                    "{} n={n} rank {rank}: irecv #{i} and isend #{j} share bytes unordered",
                                    coll.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn blocks_tile_the_count_exactly() {
        for count in [0, 1, 5, 97, 1003] {
            for n in 1..=7 {
                let mut next = 0;
                for c in 0..n {
                    let (start, len) = block(c, count, n);
                    assert_eq!(start, next);
                    next += len;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn slices_cover_a_region_without_gaps() {
        assert_eq!(slices(10, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(slices(8, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4)]);
        assert_eq!(slices(0, 4).count(), 0);
    }

    #[test]
    fn counts_round_down_per_rank_like_nccl_tests() {
        let c = Collective::AllGather.counts(1 << 20, 3);
        assert_eq!((c.send, c.recv, c.param), (87381, 262143, 87381));
        let c = Collective::ReduceScatter.counts(1 << 20, 3);
        assert_eq!((c.send, c.recv, c.param), (262143, 87381, 87381));
        let c = Collective::AllToAll.counts(1 << 20, 3);
        assert_eq!((c.send, c.recv, c.param, c.size_bytes()), (262143, 262143, 87381, 1048572));
        let c = Collective::AllReduce.counts(1 << 20, 3);
        assert_eq!((c.send, c.recv, c.param), (262144, 262144, 262144));
    }

    #[test]
    fn alltoall_talks_to_every_other_rank_and_rings_to_two_neighbours() {
        assert_eq!(Collective::AllToAll.peers(1, 4), (vec![2, 3, 0], vec![2, 3, 0]));
        assert_eq!(Collective::AllReduce.peers(0, 4), (vec![1], vec![3]));
        assert_eq!(Collective::SendRecv.peers(0, 1), (vec![], vec![]));
    }
}
