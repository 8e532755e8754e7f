//! The collectives as schedules of point-to-point sends and receives, and the executor that drives a
//! schedule through a [`Transport`] the way NCCL's proxy does: post what the window allows, test every
//! outstanding request, repeat.
//!
//! Rings follow NCCL's ring algorithm (reduce-scatter then all-gather for all_reduce); each ring step
//! is cut into slices so that the next step's slice can leave as soon as it arrived, which keeps
//! several sends in flight per connection.
//!
//! - [`plan`](mod@plan): the schedules ([`Plan`]), ring slicing and the sparse alltoall's pattern;
//! - `exec`: the executor ([`execute`]).

mod exec;
mod plan;
#[cfg(test)]
mod tests;

use serde::Serialize;

use crate::net::{BufId, NetError, Transport};

pub use exec::{execute, CollError, ExecConfig, ExecStats};
pub use plan::{block, plan, slices, sparse_len, Plan, RecvOp, SendOp, SPARSE_SEED};

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
    /// One direction only, as `ib_write_bw` and `prism-udp-pump` measure: ranks pair up, each even
    /// rank sends to the next one (rank 0 -> 1, 2 -> 3, ...; with an odd count the last rank idles).
    #[value(name = "oneway")]
    #[serde(rename = "oneway")]
    OneWay,
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
    pub const ALL: [Collective; 7] = [
        Collective::SendRecv,
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::AllToAllSparse,
        Collective::OneWay,
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
            Collective::OneWay => "oneway",
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
            Collective::SendRecv | Collective::AllReduce | Collective::OneWay => Counts { send: count, recv: count, param: count },
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
            Collective::OneWay if rank.is_multiple_of(2) && rank + 1 < nranks => (vec![rank + 1], Vec::new()),
            Collective::OneWay if rank % 2 == 1 => (Vec::new(), vec![rank - 1]),
            Collective::OneWay => (Vec::new(), Vec::new()),
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
