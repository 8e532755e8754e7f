//! Test data and its check. Every value is a small integer, so sums over any number of ranks and in any
//! order are exact in `f32` and the expected result can be computed independently of the schedule.

use crate::coll::{Buffers, Collective, Counts};
use crate::net::{NetError, Region, Transport};

/// Element `i` of rank `rank`'s send buffer in pass `pass`: an integer in 0..97.
pub fn value(rank: usize, i: usize, pass: usize) -> f32 {
    let v = (rank as u64).wrapping_mul(131).wrapping_add((i as u64).wrapping_mul(7)).wrapping_add(pass as u64) % 97;
    v as f32
}

/// Fills this rank's send buffer for `pass` and poisons the receive buffer with NaN, so an element the
/// collective never writes is counted wrong.
pub fn prepare(t: &mut dyn Transport, bufs: Buffers, counts: Counts, pass: usize) -> Result<(), NetError> {
    let rank = t.rank();
    let send = t.pool_mut().write(Region::new(bufs.send, 0, counts.send))?;
    for (i, x) in send.iter_mut().enumerate() {
        *x = value(rank, i, pass);
    }
    t.pool_mut().write(Region::new(bufs.recv, 0, counts.recv))?.fill(f32::NAN);
    Ok(())
}

/// What element `i` of `rank`'s receive buffer must hold after `coll` on data of `pass`.
pub fn expected(coll: Collective, rank: usize, nranks: usize, counts: Counts, pass: usize, i: usize) -> f32 {
    let n = nranks.max(1);
    let c = counts.param;
    if c == 0 {
        // Empty buffers: no element exists to expect anything of.
        return f32::NAN;
    }
    match coll {
        Collective::SendRecv => value((rank + n - 1) % n, i, pass),
        Collective::OneWay if n == 1 => value(rank, i, pass),
        // Senders (and an idle last rank) receive nothing: their buffers keep the NaN poison.
        Collective::OneWay if rank % 2 == 1 => value(rank - 1, i, pass),
        Collective::OneWay => f32::NAN,
        Collective::AllReduce => (0..n).map(|p| value(p, i, pass)).sum(),
        Collective::AllGather => value(i / c, i % c, pass),
        Collective::ReduceScatter => (0..n).map(|p| value(p, rank * c + i, pass)).sum(),
        Collective::AllToAll => value(i / c, rank * c + i % c, pass),
        // Elements no rank sends keep the receive buffer's NaN poison.
        Collective::AllToAllSparse if i % c >= crate::coll::sparse_len(i / c, rank, n, c) => f32::NAN,
        Collective::AllToAllSparse => value(i / c, rank * c + i % c, pass),
    }
}

/// Counts the elements of this rank's receive buffer that differ from [`expected`].
pub fn count_wrong(t: &dyn Transport, coll: Collective, bufs: Buffers, counts: Counts, pass: usize) -> Result<usize, NetError> {
    let (rank, n) = (t.rank(), t.nranks());
    let got = t.pool().read(Region::new(bufs.recv, 0, counts.recv))?;
    // NaN != anything, so unwritten (poisoned) elements count as wrong, except where nothing is to be
    // written (the sparse alltoall's unsent elements): there the poison must still be there.
    Ok(got
        .iter()
        .enumerate()
        .filter(|&(i, &x)| {
            let want = expected(coll, rank, n, counts, pass, i);
            x != want && !(x.is_nan() && want.is_nan() && counts.param > 0)
        })
        .count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_small_integers_so_sums_of_many_ranks_are_exact() {
        for rank in 0..64 {
            for i in 0..1000 {
                let v = value(rank, i, 3);
                assert!((0.0..97.0).contains(&v) && v.fract() == 0.0, "value({rank}, {i}) = {v}");
            }
        }
        // 1024 ranks of 96 stay far below 2^24, the end of exact integers in f32.
        let total: f32 = (0..1024).map(|_| 96.0f32).sum();
        assert_eq!(total, 98304.0);
    }

    #[test]
    fn passes_differ_so_a_stale_buffer_is_caught() {
        let same = (0..1000).filter(|&i| value(1, i, 0) == value(1, i, 1)).count();
        assert_eq!(same, 0);
    }

    #[test]
    fn alltoall_expects_block_r_of_each_peer() {
        let counts = Collective::AllToAll.counts(3 * 4 * 5, 3); // 5 elements per block
        assert_eq!(counts.param, 5);
        // rank 2, block from peer 1, element 4: peer 1's send element 2*5+4.
        assert_eq!(expected(Collective::AllToAll, 2, 3, counts, 0, 5 + 4), value(1, 14, 0));
    }
}
