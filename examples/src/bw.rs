//! nccl-tests' bandwidth formulas (`src/*.cu`, `*GetBw`; see doc/PERFORMANCE.md there).

use crate::coll::Collective;

/// Bytes that define algorithm bandwidth for a run whose count column is `param` elements.
pub fn alg_bytes(coll: Collective, param: usize, nranks: usize) -> f64 {
    let bytes = (param * crate::net::ELEM_BYTES) as f64;
    match coll {
        Collective::AllReduce | Collective::SendRecv | Collective::OneWay => bytes,
        // The sparse alltoall is reported at its nominal (dense) size, like nccl-tests' alltoallv.
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll | Collective::AllToAllSparse => bytes * nranks as f64,
    }
}

/// busbw / algbw: what each rank's link carries relative to the data size.
pub fn bus_factor(coll: Collective, nranks: usize) -> f64 {
    let n = nranks.max(1) as f64;
    match coll {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll | Collective::AllToAllSparse => (n - 1.0) / n,
        Collective::SendRecv | Collective::OneWay => 1.0,
    }
}

/// (algbw, busbw) in GB/s (1e9 bytes) for one operation taking `time_us`.
pub fn bandwidths(coll: Collective, param: usize, nranks: usize, time_us: f64) -> (f64, f64) {
    if time_us <= 0.0 {
        return (0.0, 0.0);
    }
    let alg = alg_bytes(coll, param, nranks) / 1.0e9 / (time_us / 1.0e6);
    (alg, alg * bus_factor(coll, nranks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_busbw_is_2_n_minus_1_over_n_of_algbw() {
        // 8 ranks, 1 GB in 1 s: algbw 1 GB/s, busbw 2*7/8.
        let (alg, bus) = bandwidths(Collective::AllReduce, 250_000_000, 8, 1.0e6);
        assert!((alg - 1.0).abs() < 1e-12, "{alg}");
        assert!((bus - 1.75).abs() < 1e-12, "{bus}");
    }

    #[test]
    fn all_gather_algbw_counts_every_ranks_block() {
        // count column = per-rank block; 4 ranks of 1e8 bytes in 2 s = 0.2 GB/s; busbw 3/4 of it.
        let (alg, bus) = bandwidths(Collective::AllGather, 25_000_000, 4, 2.0e6);
        assert!((alg - 0.2).abs() < 1e-12, "{alg}");
        assert!((bus - 0.15).abs() < 1e-12, "{bus}");
    }

    #[test]
    fn reduce_scatter_and_alltoall_share_all_gathers_factor() {
        for n in [2, 3, 4, 16] {
            let want = (n as f64 - 1.0) / n as f64;
            assert_eq!(bus_factor(Collective::ReduceScatter, n), want);
            assert_eq!(bus_factor(Collective::AllToAll, n), want);
            assert_eq!(alg_bytes(Collective::AllToAll, 10, n), (40 * n) as f64);
            assert_eq!(alg_bytes(Collective::ReduceScatter, 10, n), (40 * n) as f64);
        }
    }

    #[test]
    fn sendrecv_busbw_equals_algbw() {
        let (alg, bus) = bandwidths(Collective::SendRecv, 1 << 20, 2, 1000.0);
        assert_eq!(alg, bus);
        assert!((alg - 4.194304).abs() < 1e-9, "{alg}");
    }

    #[test]
    fn one_rank_has_zero_bus_traffic_for_all_reduce() {
        assert_eq!(bus_factor(Collective::AllReduce, 1), 0.0);
    }

    #[test]
    fn zero_time_gives_zero_bandwidth_not_infinity() {
        assert_eq!(bandwidths(Collective::AllReduce, 0, 2, 0.0), (0.0, 0.0));
    }
}
