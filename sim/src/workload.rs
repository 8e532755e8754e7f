//! Workloads as transfers with dependencies: a transfer (source host, destination host, bytes) starts
//! once every transfer it depends on has arrived, so a collective's step starts when its inputs are in.
//! Zero-byte transfers from a host to itself are gates (barriers) that keep dependency lists short.

use rand::{rngs::SmallRng, seq::SliceRandom, Rng};

use crate::scenario::{invalid, AllReduceAlgo, MoeDistribution, ScenarioError, SparsePlacement, WorkloadSpec};

/// One transfer.
#[derive(Debug, Clone, PartialEq)]
pub struct Transfer {
    /// Source host.
    pub src: u32,
    /// Destination host.
    pub dst: u32,
    /// Bytes.
    pub bytes: u64,
    /// Transfers that must have arrived first (indices into the workload).
    pub deps: Vec<u32>,
    /// Earliest start, µs.
    pub start_us: f64,
    /// The rail of the source GPU (the connection's own rail for `PRISM_RAIL=single`).
    pub home_rail: u16,
    /// The destination GPU's rail when the workload is GPU-to-GPU (MoE); `None`: rail-aligned.
    pub dst_rail: Option<u16>,
    /// The receive is posted when the workload starts, not when the send starts (a collective's
    /// receives posted as one group, as NCCL does for an all-to-all), so its CTS is waiting at the
    /// sender by the time the send is posted.
    pub recv_at_start: bool,
}

fn t(src: usize, dst: usize, bytes: u64, deps: Vec<u32>) -> Transfer {
    Transfer { src: src as u32, dst: dst as u32, bytes, deps, start_us: 0.0, home_rail: 0, dst_rail: None, recv_at_start: false }
}

/// A random cyclic permutation (Sattolo): `next[i]` is i's successor on one ring through all hosts.
fn random_cycle(n: usize, rng: &mut SmallRng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(rng);
    let mut next = vec![0; n];
    for i in 0..n {
        next[order[i]] = order[(i + 1) % n];
    }
    next
}

/// The transfers of a workload over `hosts` hosts with `rails` NICs each; `bytes` replaces the
/// workload's message size when given.
pub fn generate(
    spec: &WorkloadSpec,
    hosts: usize,
    rails: usize,
    bytes: Option<u64>,
    rng: &mut SmallRng,
) -> Result<Vec<Transfer>, ScenarioError> {
    let mut v = Vec::new();
    match spec {
        WorkloadSpec::AllToAll { bytes: b, parallel: None } => {
            let b = bytes.unwrap_or(*b);
            for s in 0..hosts {
                for d in 0..hosts {
                    if s != d {
                        v.push(t(s, d, b, vec![]));
                    }
                }
            }
        }
        WorkloadSpec::AllToAll { bytes: b, parallel: Some(k) } => {
            let k = *k as usize;
            if k == 0 || k >= hosts {
                return Err(invalid("workload.parallel", format!("{k}: between 1 and the number of hosts minus one ({})", hosts - 1)));
            }
            all_to_all_in_steps(&mut v, hosts, bytes.unwrap_or(*b), k, rng);
        }
        WorkloadSpec::Permutation { bytes: b } => {
            let b = bytes.unwrap_or(*b);
            // A derangement: shuffle until no host maps to itself (expected e ≈ 2.7 tries).
            let mut p: Vec<usize> = (0..hosts).collect();
            loop {
                p.shuffle(rng);
                if p.iter().enumerate().all(|(i, &x)| i != x) {
                    break;
                }
            }
            for (s, &d) in p.iter().enumerate() {
                v.push(t(s, d, b, vec![]));
            }
        }
        WorkloadSpec::RandomRing { bytes: b } => {
            let b = bytes.unwrap_or(*b);
            let next = random_cycle(hosts, rng);
            for (s, &d) in next.iter().enumerate() {
                v.push(t(s, d, b, vec![]));
            }
        }
        WorkloadSpec::RandomTree { bytes: b } => {
            let b = bytes.unwrap_or(*b);
            let mut order: Vec<usize> = (0..hosts).collect();
            order.shuffle(rng);
            for tree in 0..2 {
                // Tree 2 mirrors tree 1's positions, so tree 1's leaves are tree 2's inner nodes.
                let at = |i: usize| {
                    if tree == 0 {
                        order[i]
                    } else {
                        order[hosts - 1 - i]
                    }
                };
                for i in 1..hosts {
                    let (c, p) = (at(i), at((i - 1) / 2));
                    v.push(t(c, p, b, vec![]));
                    v.push(t(p, c, b, vec![]));
                }
            }
        }
        WorkloadSpec::AllReduce { bytes: b, algorithm, chunks } => {
            let b = bytes.unwrap_or(*b);
            let ranks: Vec<usize> = (0..hosts).collect();
            allreduce(&mut v, &ranks, b, *algorithm, *chunks)?;
        }
        WorkloadSpec::GroupAllReduce { bytes: b, group, algorithm } => {
            let b = bytes.unwrap_or(*b);
            if *group < 2 || !hosts.is_multiple_of(*group) {
                return Err(invalid("workload.group", format!("{group}: must be >= 2 and divide the {hosts} hosts")));
            }
            let stride = hosts / group;
            for g in 0..stride {
                let ranks: Vec<usize> = (0..*group).map(|i| g + i * stride).collect();
                allreduce(&mut v, &ranks, b, *algorithm, 8)?;
            }
        }
        WorkloadSpec::Moe { bytes: b, distribution } => {
            let b = bytes.unwrap_or(*b);
            moe(&mut v, hosts, rails, b, distribution, rng)?;
        }
        WorkloadSpec::Flows { flows, bytes: base } => {
            for f in flows {
                if f.src >= hosts || f.dst >= hosts {
                    return Err(invalid("workload.flows", "host index out of range"));
                }
                let bytes = match (bytes, *base) {
                    (Some(x), base) if base > 0 => f.bytes * x / base,
                    _ => f.bytes,
                };
                let mut tr = t(f.src, f.dst, bytes, vec![]);
                tr.start_us = f.start_us;
                v.push(tr);
            }
        }
    }
    Ok(v)
}

/// An all-to-all of `b` bytes per pair in steps of `k` destinations per host. Hosts are placed at
/// random positions 0..n; at step d (1..=(n-1)/k) position s sends to positions s + d + c·h (mod n),
/// c < k, h = (n-1)/k, so that each position also receives from exactly k per step; the (n-1) mod k
/// destinations left go in one last step. A host's step waits for the arrival of its previous step's
/// transfers (through a zero-byte gate), not for other hosts: the REPS artifact's windowed all-to-all.
/// Every receive is posted at the start, as NCCL posts a grouped all-to-all's receives at once (the
/// artifact's transport has no clear-to-send to wait for).
fn all_to_all_in_steps(v: &mut Vec<Transfer>, n: usize, b: u64, k: usize, rng: &mut SmallRng) {
    let mut host: Vec<usize> = (0..n).collect();
    host.shuffle(rng);
    let h = (n - 1) / k;
    let left = (n - 1) % k;
    for s in 0..n {
        let mut steps: Vec<Vec<usize>> = (1..=h).map(|d| (0..k).map(|c| (s + d + c * h) % n).collect()).collect();
        if left > 0 {
            steps.push((0..left).map(|c| (s + k * h + c + 1) % n).collect());
        }
        let mut gate: Option<u32> = None;
        for step in steps {
            let first = v.len() as u32;
            for d in step {
                v.push(Transfer { recv_at_start: true, ..t(host[s], host[d], b, gate.into_iter().collect()) });
            }
            let ids: Vec<u32> = (first..v.len() as u32).collect();
            v.push(t(host[s], host[s], 0, ids));
            gate = Some((v.len() - 1) as u32);
        }
    }
}

/// Append an all-reduce of `b` bytes among `ranks`.
fn allreduce(v: &mut Vec<Transfer>, ranks: &[usize], b: u64, algo: AllReduceAlgo, chunks: u32) -> Result<(), ScenarioError> {
    let n = ranks.len();
    let piece = b.div_ceil(n as u64);
    match algo {
        AllReduceAlgo::AllToAll => {
            let base = v.len();
            let mut into: Vec<Vec<u32>> = vec![Vec::new(); n];
            for s in 0..n {
                for d in 0..n {
                    if s != d {
                        into[d].push(v.len() as u32);
                        v.push(t(ranks[s], ranks[d], piece, vec![]));
                    }
                }
            }
            let _ = base;
            // One gate per rank: the all-gather starts once the reduce-scatter arrived.
            let gates: Vec<u32> = (0..n)
                .map(|r| {
                    v.push(t(ranks[r], ranks[r], 0, std::mem::take(&mut into[r])));
                    (v.len() - 1) as u32
                })
                .collect();
            for s in 0..n {
                for d in 0..n {
                    if s != d {
                        v.push(t(ranks[s], ranks[d], piece, vec![gates[s]]));
                    }
                }
            }
        }
        AllReduceAlgo::Ring => {
            // prev[r]: the transfer rank r received in the previous step.
            let mut prev: Vec<Option<u32>> = vec![None; n];
            for _step in 0..2 * (n - 1) {
                let mut now = vec![None; n];
                for r in 0..n {
                    let d = (r + 1) % n;
                    let deps = prev[r].into_iter().collect();
                    now[d] = Some(v.len() as u32);
                    v.push(t(ranks[r], ranks[d], piece, deps));
                }
                prev = now;
            }
        }
        AllReduceAlgo::RecursiveDoubling => {
            if !n.is_power_of_two() {
                return Err(invalid("workload.algorithm", format!("recursive_doubling needs a power-of-two number of ranks, not {n}")));
            }
            let steps = n.trailing_zeros() as usize;
            let mut prev: Vec<Option<u32>> = vec![None; n];
            // Reduce-scatter by recursive halving: partners at distance n/2, n/4, ...; sizes halve.
            // All-gather by recursive doubling: distances 1, 2, ...; sizes double.
            let mut sched = Vec::new();
            for k in 0..steps {
                sched.push((n >> (k + 1), b >> (k + 1)));
            }
            for k in (0..steps).rev() {
                sched.push((n >> (k + 1), b >> (k + 1)));
            }
            for (dist, bytes) in sched {
                let mut now = vec![None; n];
                for r in 0..n {
                    let d = r ^ dist;
                    now[d] = Some(v.len() as u32);
                    v.push(t(ranks[r], ranks[d], bytes.max(1), prev[r].into_iter().collect()));
                }
                prev = now;
            }
        }
        AllReduceAlgo::DoubleBinaryTree => {
            let c = chunks.max(1) as u64;
            let per_chunk = (b / 2).div_ceil(c).max(1);
            for tree in 0..2 {
                let rank_at = |i: usize| if tree == 0 { i } else { n - 1 - i };
                let children = |i: usize| [2 * i + 1, 2 * i + 2].into_iter().filter(move |&c| c < n);
                // Chunks pipeline: a node forwards chunk c as soon as its children's chunk c is in.
                for _chunk in 0..c {
                    // up[pos] = the up-transfer pos → parent of this chunk.
                    let mut up: Vec<Option<u32>> = vec![None; n];
                    // Children first (higher positions), so a parent's deps exist.
                    for i in (1..n).rev() {
                        let deps: Vec<u32> = children(i).filter_map(|ch| up[ch]).collect();
                        up[i] = Some(v.len() as u32);
                        v.push(t(ranks[rank_at(i)], ranks[rank_at((i - 1) / 2)], per_chunk, deps));
                    }
                    // Broadcast down: the root once its children's chunk arrived, others after their
                    // parent's chunk arrived.
                    let mut down: Vec<Option<u32>> = vec![None; n];
                    for i in 0..n {
                        for ch in children(i) {
                            let deps: Vec<u32> =
                                if i == 0 { children(0).filter_map(|x| up[x]).collect() } else { down[i].into_iter().collect() };
                            down[ch] = Some(v.len() as u32);
                            v.push(t(ranks[rank_at(i)], ranks[rank_at(ch)], per_chunk, deps));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn zipf_weights(n: usize, s: f64, rng: &mut SmallRng) -> Vec<f64> {
    let mut w: Vec<f64> = (1..=n).map(|r| 1.0 / (r as f64).powf(s)).collect();
    w.shuffle(rng);
    let sum: f64 = w.iter().sum();
    w.iter().map(|x| x * n as f64 / sum).collect()
}

/// Per-token top-k gating: GPU i has `tokens[i]` tokens, each sent to `k` distinct experts drawn with
/// probability proportional to `weight` (one expert per GPU); adds the copies' bytes to `b[i][j]`.
fn by_tokens(
    b: &mut [Vec<u64>],
    tokens: &[u64],
    weight: &[f64],
    k: usize,
    token_bytes: u64,
    rng: &mut SmallRng,
) -> Result<(), ScenarioError> {
    let g = weight.len();
    if k == 0 || weight.iter().filter(|&&w| w > 0.0).count() < k {
        return Err(invalid("workload.distribution.k", format!("{k}: needs at least k experts with tokens")));
    }
    let cum: Vec<f64> = weight
        .iter()
        .scan(0.0, |a, &w| {
            *a += w;
            Some(*a)
        })
        .collect();
    let total = cum[g - 1];
    let mut chosen = Vec::with_capacity(k);
    for (i, &n) in tokens.iter().enumerate() {
        for _ in 0..n {
            chosen.clear();
            while chosen.len() < k {
                let u = rng.gen::<f64>() * total;
                let j = cum.partition_point(|&c| c <= u).min(g - 1);
                if weight[j] > 0.0 && !chosen.contains(&j) {
                    chosen.push(j);
                }
            }
            for &j in &chosen {
                b[i][j] += token_bytes;
            }
        }
    }
    Ok(())
}

/// MoE all-to-all among `hosts · rails` GPUs (GPU g on host g / rails, rail g % rails); traffic between
/// GPUs of one host stays on NVLink and is left out.
fn moe(
    v: &mut Vec<Transfer>,
    hosts: usize,
    rails: usize,
    bytes: u64,
    dist: &MoeDistribution,
    rng: &mut SmallRng,
) -> Result<(), ScenarioError> {
    let g = hosts * rails;
    // b[i][j]: bytes GPU i sends to GPU j.
    let mut b = vec![vec![0u64; g]; g];
    let tokens_per_gpu = |k: usize, token_bytes: u64| (bytes / (k as u64 * token_bytes)).max(1);
    // m[i][j]: fraction of GPU i's `bytes` that goes to GPU j (fluid distributions).
    let mut m = vec![vec![0.0f64; g]; g];
    match dist {
        MoeDistribution::Uniform => {
            for (i, row) in m.iter_mut().enumerate() {
                for (j, x) in row.iter_mut().enumerate() {
                    if i != j {
                        *x = 1.0 / (g - 1) as f64;
                    }
                }
            }
        }
        MoeDistribution::Sparse { k, sparsity, placement, token_bytes } => {
            if !(0.0..1.0).contains(sparsity) {
                return Err(invalid("workload.distribution.sparsity", "must be in [0, 1)"));
            }
            let active: Vec<usize> = match placement {
                SparsePlacement::Random => {
                    let active_n = (((1.0 - sparsity) * g as f64).round() as usize).clamp((*k).max(1), g);
                    let mut all: Vec<usize> = (0..g).collect();
                    all.shuffle(rng);
                    all.truncate(active_n);
                    all
                }
                SparsePlacement::PerHost => {
                    let per = (((1.0 - sparsity) * rails as f64).round() as usize).clamp(1, rails);
                    let mut active = Vec::with_capacity(per * hosts);
                    for h in 0..hosts {
                        let mut pos: Vec<usize> = (0..rails).collect();
                        pos.shuffle(rng);
                        active.extend(pos[..per].iter().map(|&r| h * rails + r));
                    }
                    active
                }
            };
            if *token_bytes > 0 {
                let mut w = vec![0.0; g];
                active.iter().for_each(|&j| w[j] = 1.0);
                by_tokens(&mut b, &vec![tokens_per_gpu(*k, *token_bytes); g], &w, *k, *token_bytes, rng)?;
            } else {
                for (i, row) in m.iter_mut().enumerate() {
                    let targets: Vec<usize> = active.iter().copied().filter(|&j| j != i).collect();
                    for &j in &targets {
                        row[j] = 1.0 / targets.len() as f64;
                    }
                }
            }
        }
        MoeDistribution::SenderZipf { s, token_bytes, k } => {
            let w = zipf_weights(g, *s, rng);
            if *token_bytes > 0 {
                let n = tokens_per_gpu(*k, *token_bytes) as f64;
                let tokens: Vec<u64> = w.iter().map(|x| (x * n).round() as u64).collect();
                by_tokens(&mut b, &tokens, &vec![1.0; g], *k, *token_bytes, rng)?;
            } else {
                for (i, row) in m.iter_mut().enumerate() {
                    for (j, x) in row.iter_mut().enumerate() {
                        if i != j {
                            *x = w[i] / (g - 1) as f64;
                        }
                    }
                }
            }
        }
        MoeDistribution::ReceiverZipf { s, token_bytes, k } => {
            let w = zipf_weights(g, *s, rng);
            if *token_bytes > 0 {
                by_tokens(&mut b, &vec![tokens_per_gpu(*k, *token_bytes); g], &w, *k, *token_bytes, rng)?;
            } else {
                for (i, row) in m.iter_mut().enumerate() {
                    let sum: f64 = (0..g).filter(|&j| j != i).map(|j| w[j]).sum();
                    for (j, x) in row.iter_mut().enumerate() {
                        if i != j {
                            *x = w[j] / sum;
                        }
                    }
                }
            }
        }
    }
    for (i, row) in m.iter().enumerate() {
        for (j, &f) in row.iter().enumerate() {
            b[i][j] += (f * bytes as f64).round() as u64;
        }
    }
    for (i, row) in b.iter().enumerate() {
        for (j, &n) in row.iter().enumerate() {
            let (hi, hj) = (i / rails, j / rails);
            if hi == hj || n == 0 {
                continue;
            }
            let mut tr = t(hi, hj, n, vec![]);
            tr.home_rail = (i % rails) as u16;
            tr.dst_rail = Some((j % rails) as u16);
            v.push(tr);
        }
    }
    Ok(())
}

/// A lower bound on the completion time, µs: the larger of (a) the busiest host's bytes through its NICs
/// at line rate and (b) the dependency chain's length with every transfer alone at line rate on all of
/// its host's NICs, plus the propagation and one packet's serialisation per hop.
pub fn lower_bound_us(
    transfers: &[Transfer],
    hosts: usize,
    nic_bytes_per_us: f64,
    rails: usize,
    wire: impl Fn(u64) -> f64,
    latency_us: impl Fn(u32, u32) -> f64,
) -> f64 {
    let host_rate = nic_bytes_per_us * rails as f64;
    let mut sent = vec![0.0f64; hosts];
    let mut recv = vec![0.0f64; hosts];
    for tr in transfers.iter().filter(|t| t.src != t.dst) {
        sent[tr.src as usize] += wire(tr.bytes);
        recv[tr.dst as usize] += wire(tr.bytes);
    }
    let load = sent.iter().chain(recv.iter()).fold(0.0f64, |a, &b| a.max(b)) / host_rate;
    let min_lat = transfers.iter().filter(|t| t.src != t.dst).map(|t| latency_us(t.src, t.dst)).fold(f64::INFINITY, f64::min);
    let mut finish = vec![0.0f64; transfers.len()];
    let mut began = vec![0.0f64; transfers.len()];
    for (i, tr) in transfers.iter().enumerate() {
        // Dependencies always point to earlier transfers (generation order).
        let start = tr.deps.iter().map(|&d| finish[d as usize]).fold(tr.start_us, f64::max);
        began[i] = start;
        finish[i] = if tr.src == tr.dst {
            // A gate on transfers of its own host: they share that host's NIC, so the last of them
            // arrives no earlier than the first could start plus all their bytes at line rate plus
            // the shortest of their latencies (an all-to-all in steps waits for this per step).
            let own: Vec<u32> =
                tr.deps.iter().copied().filter(|&d| transfers[d as usize].src == tr.src && transfers[d as usize].dst != tr.src).collect();
            let shared = if own.is_empty() {
                0.0
            } else {
                let first = own.iter().map(|&d| began[d as usize]).fold(f64::INFINITY, f64::min);
                let bytes: f64 = own.iter().map(|&d| wire(transfers[d as usize].bytes)).sum();
                let lat = own.iter().map(|&d| latency_us(tr.src, transfers[d as usize].dst)).fold(f64::INFINITY, f64::min);
                first + bytes / host_rate + lat
            };
            start.max(shared)
        } else {
            start + wire(tr.bytes) / host_rate + latency_us(tr.src, tr.dst)
        };
    }
    let chain = finish.iter().fold(0.0f64, |a, &b| a.max(b));
    chain.max(load + if min_lat.is_finite() { min_lat } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    const SEED: u64 = 5;

    fn gen(spec: &str, hosts: usize, rails: usize) -> Vec<Transfer> {
        let spec: WorkloadSpec = serde_json::from_str(spec).expect("spec");
        let mut rng = SmallRng::seed_from_u64(SEED);
        generate(&spec, hosts, rails, None, &mut rng).unwrap_or_else(|e| panic!("seed {SEED}: {e}"))
    }

    fn sent_by(v: &[Transfer], h: u32) -> u64 {
        v.iter().filter(|t| t.src == h && t.dst != h).map(|t| t.bytes).sum()
    }

    #[test]
    fn every_allreduce_algorithm_sends_the_bandwidth_optimal_volume_per_rank() {
        let m = 1u64 << 20;
        for algo in ["all_to_all", "ring", "recursive_doubling"] {
            let v = gen(&format!(r#"{{"kind":"all_reduce","bytes":{m},"algorithm":"{algo}"}}"#), 8, 1);
            for h in 0..8 {
                // 2 (N-1)/N · M per rank.
                assert_eq!(sent_by(&v, h), 2 * 7 * m / 8, "{algo}, rank {h}");
            }
        }
    }

    #[test]
    fn dependencies_point_backwards_so_every_collective_can_finish() {
        for algo in ["all_to_all", "ring", "recursive_doubling", "double_binary_tree"] {
            let v = gen(&format!(r#"{{"kind":"all_reduce","bytes":1048576,"algorithm":"{algo}"}}"#), 16, 1);
            for (i, t) in v.iter().enumerate() {
                assert!(t.deps.iter().all(|&d| (d as usize) < i), "{algo}: transfer {i}");
                // A transfer waits for data that arrived at its own source.
                assert!(t.deps.iter().all(|&d| v[d as usize].dst == t.src), "{algo}: transfer {i}");
            }
        }
    }

    #[test]
    fn an_all_to_all_in_steps_sends_every_pair_once_k_at_a_time_and_receives_k_per_step() {
        for (n, k) in [(16usize, 4usize), (16, 5), (128, 8), (9, 8), (5, 1)] {
            let v = gen(&format!(r#"{{"kind":"all_to_all","bytes":7,"parallel":{k}}}"#), n, 1);
            let data: Vec<&Transfer> = v.iter().filter(|t| t.src != t.dst).collect();
            let mut pairs: Vec<(u32, u32)> = data.iter().map(|t| (t.src, t.dst)).collect();
            pairs.sort_unstable();
            pairs.dedup();
            assert_eq!(pairs.len(), n * (n - 1), "n {n} k {k}: every ordered pair once");
            assert_eq!(data.len(), n * (n - 1), "n {n} k {k}: no pair twice");
            assert!(data.iter().all(|t| t.bytes == 7));
            // Steps: a host's transfers with the same dependencies; a step's successor waits for it
            // (through a gate of the same host that depends on exactly that step).
            let mut by_step: std::collections::BTreeMap<(u32, Vec<u32>), Vec<u32>> = Default::default();
            for t in &data {
                by_step.entry((t.src, t.deps.clone())).or_default().push(t.dst);
            }
            for ((src, deps), dsts) in &by_step {
                assert!(dsts.len() <= k, "n {n} k {k}: host {src} sends to {} at once", dsts.len());
                for &g in deps {
                    let gate = &v[g as usize];
                    assert_eq!((gate.src, gate.dst, gate.bytes), (*src, *src, 0), "n {n} k {k}: a step waits for its own host's gate");
                    assert!(gate.deps.iter().all(|&d| v[d as usize].src == *src && v[d as usize].bytes == 7));
                }
            }
            let steps = (n - 1).div_ceil(k);
            assert_eq!(by_step.len(), n * steps, "n {n} k {k}: {steps} steps per host");
            // Step j of every host together: each host receives from k sources (fewer in the last,
            // partial step).
            let mut nth: std::collections::HashMap<(u32, Vec<u32>), usize> = Default::default();
            for src in 0..n as u32 {
                let mut chain: Vec<&(u32, Vec<u32>)> = by_step.keys().filter(|(s, _)| *s == src).collect();
                chain.sort_by_key(|(_, d)| d.first().copied().map_or(-1, i64::from));
                for (j, key) in chain.into_iter().enumerate() {
                    nth.insert(key.clone(), j);
                }
            }
            for j in 0..steps {
                let mut into = vec![0usize; n];
                for (key, dsts) in &by_step {
                    if nth[key] == j {
                        for &d in dsts {
                            into[d as usize] += 1;
                        }
                    }
                }
                let want = if j + 1 == steps && (n - 1) % k != 0 { (n - 1) % k } else { k };
                assert!(into.iter().all(|&c| c == want), "n {n} k {k} step {j}: receivers {into:?}");
            }
            assert!(v.iter().enumerate().all(|(i, t)| t.deps.iter().all(|&d| (d as usize) < i)));
        }
        let spec: WorkloadSpec = serde_json::from_str(r#"{"kind":"all_to_all","bytes":1,"parallel":16}"#).expect("spec");
        let err = generate(&spec, 16, 1, None, &mut SmallRng::seed_from_u64(SEED)).expect_err("k = n");
        assert!(err.to_string().contains("workload.parallel"), "{err}");
    }

    #[test]
    fn a_permutation_has_no_fixed_point_and_every_host_receives_once() {
        let v = gen(r#"{"kind":"permutation","bytes":100}"#, 64, 1);
        assert!(v.iter().all(|t| t.src != t.dst), "seed {SEED}");
        let mut seen = vec![0; 64];
        v.iter().for_each(|t| seen[t.dst as usize] += 1);
        assert!(seen.iter().all(|&c| c == 1), "seed {SEED}");
    }

    #[test]
    fn a_random_ring_is_one_cycle_through_every_host() {
        let v = gen(r#"{"kind":"random_ring","bytes":100}"#, 32, 1);
        let next: Vec<u32> = {
            let mut n = vec![0; 32];
            v.iter().for_each(|t| n[t.src as usize] = t.dst);
            n
        };
        let (mut h, mut steps) = (0u32, 0);
        loop {
            h = next[h as usize];
            steps += 1;
            if h == 0 {
                break;
            }
        }
        assert_eq!(steps, 32, "seed {SEED}");
    }

    #[test]
    fn uniform_moe_spreads_each_gpus_bytes_over_the_other_hosts_gpus() {
        let v = gen(r#"{"kind":"moe","bytes":1270000,"distribution":{"kind":"uniform"}}"#, 4, 4);
        // 16 GPUs; each sends 1/15 of its bytes to each other GPU; the 3 on its own host stay local.
        let from_gpu0: u64 = v.iter().filter(|t| t.src == 0 && t.home_rail == 0).map(|t| t.bytes).sum();
        assert_eq!(from_gpu0, 12 * (1_270_000f64 / 15.0).round() as u64);
        assert!(v.iter().all(|t| t.src != t.dst && t.dst_rail.is_some()));
    }

    #[test]
    fn per_host_sparse_top2_gives_every_host_the_same_active_experts_and_tokens_reach_k_of_them() {
        let spec = r#"{"kind":"moe","bytes":1048576,"distribution":{"kind":"sparse","k":2,"sparsity":0.6,"placement":"per_host","token_bytes":8192}}"#;
        let v = gen(spec, 8, 8);
        // 64 GPUs, round(0.4 · 8) = 3 active experts on every host.
        let mut recv = std::collections::BTreeMap::new();
        for tr in &v {
            *recv.entry((tr.dst, tr.dst_rail.unwrap())).or_insert(0u64) += tr.bytes;
        }
        for h in 0..8u32 {
            assert_eq!(recv.keys().filter(|(d, _)| *d == h).count(), 3, "seed {SEED}: host {h}: {recv:?}");
        }
        // 64 tokens per GPU, 2 copies each, 8 KiB: the copies to other hosts' experts are on the wire.
        let per_gpu: u64 = v.iter().filter(|t| t.src == 0 && t.home_rail == 0).map(|t| t.bytes).sum();
        assert!(per_gpu <= 1_048_576 && per_gpu.is_multiple_of(8192) && per_gpu > 1_048_576 / 2, "seed {SEED}: {per_gpu}");
        assert!(v.iter().all(|t| t.bytes.is_multiple_of(8192) && t.src != t.dst));
    }

    #[test]
    fn the_lower_bound_is_the_busiest_hosts_bytes_at_line_rate() {
        let v = vec![t(0, 1, 1000, vec![]), t(0, 2, 1000, vec![]), t(3, 1, 500, vec![])];
        let b = lower_bound_us(&v, 4, 100.0, 1, |x| x as f64, |_, _| 1.0);
        // Host 0 sends 2000 B at 100 B/µs: 20 µs, plus 1 µs of latency.
        assert!((b - 21.0).abs() < 1e-9, "{b}");
    }

    #[test]
    fn the_lower_bound_of_steps_counts_each_steps_bytes_through_its_hosts_nic() {
        // Host 0 sends 1000 B to 1 and 2 at once, then (after both arrived) 1000 B to 3: each step
        // is 2000 B resp. 1000 B through one NIC, plus the latency (1 µs) each: 21 + 11 = 32 µs. The
        // load alone says 30 + 1 µs, the per-transfer chain 11 + 11 µs.
        let v = vec![t(0, 1, 1000, vec![]), t(0, 2, 1000, vec![]), t(0, 0, 0, vec![0, 1]), t(0, 3, 1000, vec![2])];
        let b = lower_bound_us(&v, 4, 100.0, 1, |x| x as f64, |_, _| 1.0);
        assert!((b - 32.0).abs() < 1e-9, "{b}");
    }
}
