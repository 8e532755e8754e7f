//! An in-memory [`Transport`] for tests: one `MemTransport` per rank (each driven by its own thread),
//! connections as shared queues with NCCL's matching rules (per connection, sends and receives match
//! in posting order; a send only goes once its receive is posted), plus seeded "retry later" answers,
//! completion delays and optional data corruption, so schedules are exercised the way a real plugin
//! would exercise them.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use prism_lb::hash::{splitmix64, SPLITMIX64_GAMMA};

use crate::net::{BufId, Direction, NetError, Pool, Region, ReqId, Transport, MAX_REQUESTS_PER_COMM};

/// Behaviour of the in-memory network.
#[derive(Debug, Clone, Copy)]
pub struct MemNetConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Percent of isend/irecv calls answered "retry later" even when they could proceed.
    pub retry_later_pct: u64,
    /// Percent of tests of a completable request that still answer "not done".
    pub delay_pct: u64,
    /// Add 1000 to every `k`-th element a rank sends (counted in [`MemNet::corrupted`]).
    pub corrupt_every: Option<usize>,
    /// Requests a comm accepts before failing, like a plugin's request pool.
    pub max_requests_per_comm: usize,
}

impl MemNetConfig {
    /// A network that misbehaves in the allowed ways (retries, delays) but never corrupts data.
    pub fn lossless(seed: u64) -> Self {
        Self { seed, retry_later_pct: 20, delay_pct: 30, corrupt_every: None, max_requests_per_comm: MAX_REQUESTS_PER_COMM }
    }
}

#[derive(Default)]
struct Conn {
    /// Receives posted and not yet matched by a send: (sequence number, capacity in elements).
    cts: VecDeque<(u64, usize)>,
    /// Data sent and not yet taken by its receive.
    inbox: Vec<(u64, Vec<f32>)>,
    next_recv_seq: u64,
}

struct Shared {
    n: usize,
    /// `conns[src * n + dst]`.
    conns: Vec<Mutex<Conn>>,
    corrupted: AtomicUsize,
    max_open_sends: AtomicUsize,
}

impl Shared {
    fn conn(&self, src: usize, dst: usize) -> Result<std::sync::MutexGuard<'_, Conn>, NetError> {
        self.conns[src * self.n + dst].lock().map_err(|_| NetError::Protocol("a rank thread panicked while holding a connection".into()))
    }
}

/// Handle on the whole in-memory network (for the tests' bookkeeping).
#[derive(Clone)]
pub struct MemNet {
    shared: Arc<Shared>,
}

impl MemNet {
    /// Elements corrupted so far (see [`MemNetConfig::corrupt_every`]).
    pub fn corrupted(&self) -> usize {
        self.shared.corrupted.load(Ordering::SeqCst)
    }

    /// The most sends any rank had posted and not yet completed on one comm.
    pub fn max_open_sends(&self) -> usize {
        self.shared.max_open_sends.load(Ordering::SeqCst)
    }
}

enum MemReq {
    Send { peer: usize },
    Recv { peer: usize, seq: u64, region: Region },
}

/// One rank of the in-memory network.
pub struct MemTransport {
    rank: usize,
    shared: Arc<Shared>,
    cfg: MemNetConfig,
    rng: u64,
    open: HashMap<ReqId, MemReq>,
    next_req: u64,
    sends_open: Vec<usize>,
    recvs_open: Vec<usize>,
    sent_elems: usize,
    pool: Pool,
}

/// `n` connected ranks.
pub fn mesh(n: usize, cfg: MemNetConfig) -> (MemNet, Vec<MemTransport>) {
    let shared = Arc::new(Shared {
        n,
        conns: (0..n * n).map(|_| Mutex::new(Conn::default())).collect(),
        corrupted: AtomicUsize::new(0),
        max_open_sends: AtomicUsize::new(0),
    });
    let ranks = (0..n)
        .map(|rank| MemTransport {
            rank,
            shared: shared.clone(),
            cfg,
            rng: cfg.seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03,
            open: HashMap::new(),
            next_req: 1,
            sends_open: vec![0; n],
            recvs_open: vec![0; n],
            sent_elems: 0,
            pool: Pool::new(),
        })
        .collect();
    (MemNet { shared }, ranks)
}

impl MemTransport {
    /// splitmix64: deterministic per rank and seed.
    fn next_random(&mut self) -> u64 {
        let out = splitmix64(self.rng);
        self.rng = self.rng.wrapping_add(SPLITMIX64_GAMMA);
        out
    }

    fn chance(&mut self, pct: u64) -> bool {
        pct > 0 && self.next_random() % 100 < pct
    }

    fn check_peer(&self, peer: usize, dir: Direction) -> Result<(), NetError> {
        if peer >= self.shared.n || peer == self.rank {
            return Err(NetError::NoComm { dir, peer });
        }
        Ok(())
    }

    fn new_id(&mut self) -> ReqId {
        let id = ReqId(self.next_req);
        self.next_req += 1;
        id
    }
}

impl Transport for MemTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn nranks(&self) -> usize {
        self.shared.n
    }

    fn pool(&self) -> &Pool {
        &self.pool
    }

    fn pool_mut(&mut self) -> &mut Pool {
        &mut self.pool
    }

    fn alloc(&mut self, len: usize) -> Result<BufId, NetError> {
        self.pool.alloc(len)
    }

    fn isend(&mut self, peer: usize, region: Region) -> Result<Option<ReqId>, NetError> {
        self.check_peer(peer, Direction::Send)?;
        if self.sends_open[peer] >= self.cfg.max_requests_per_comm {
            return Err(NetError::Protocol(format!(
                "rank {}: isend to {peer} with {} requests already open on the comm",
                self.rank, self.sends_open[peer]
            )));
        }
        if self.chance(self.cfg.retry_later_pct) {
            return Ok(None);
        }
        let mut data = self.pool.read(region)?.to_vec();
        let id = self.new_id();
        {
            let shared = self.shared.clone();
            let mut conn = shared.conn(self.rank, peer)?;
            // Receiver-driven: no posted receive, no send (NCCL's IB and Prism's CTS both work this way).
            let Some(&(seq, capacity)) = conn.cts.front() else {
                return Ok(None);
            };
            if data.len() > capacity {
                return Err(NetError::Protocol(format!(
                    "rank {}: send of {} elements to rank {peer} matched a receive of {capacity}",
                    self.rank,
                    data.len()
                )));
            }
            conn.cts.pop_front();
            if let Some(every) = self.cfg.corrupt_every {
                for (i, x) in data.iter_mut().enumerate() {
                    if (self.sent_elems + i) % every == every - 1 {
                        *x += 1000.0;
                        self.shared.corrupted.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            self.sent_elems += data.len();
            conn.inbox.push((seq, data));
        }
        self.pool.claim(id, region, false)?;
        self.sends_open[peer] += 1;
        self.shared.max_open_sends.fetch_max(self.sends_open[peer], Ordering::SeqCst);
        self.open.insert(id, MemReq::Send { peer });
        Ok(Some(id))
    }

    fn irecv(&mut self, peer: usize, region: Region) -> Result<Option<ReqId>, NetError> {
        self.check_peer(peer, Direction::Recv)?;
        if self.recvs_open[peer] >= self.cfg.max_requests_per_comm {
            return Err(NetError::Protocol(format!(
                "rank {}: irecv from {peer} with {} requests already open on the comm",
                self.rank, self.recvs_open[peer]
            )));
        }
        if self.chance(self.cfg.retry_later_pct) {
            return Ok(None);
        }
        let id = self.new_id();
        self.pool.claim(id, region, true)?;
        let seq = {
            let mut conn = self.shared.conn(peer, self.rank)?;
            let seq = conn.next_recv_seq;
            conn.next_recv_seq += 1;
            conn.cts.push_back((seq, region.len));
            seq
        };
        self.recvs_open[peer] += 1;
        self.open.insert(id, MemReq::Recv { peer, seq, region });
        Ok(Some(id))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        let delayed = self.chance(self.cfg.delay_pct);
        match self.open.get(&req) {
            None => Err(NetError::UnknownRequest(req)),
            Some(&MemReq::Send { peer }) => {
                if delayed {
                    return Ok(None);
                }
                self.open.remove(&req);
                self.pool.release(req);
                self.sends_open[peer] -= 1;
                Ok(Some(0))
            }
            Some(&MemReq::Recv { peer, seq, region }) => {
                if delayed {
                    return Ok(None);
                }
                let data = {
                    let mut conn = self.shared.conn(peer, self.rank)?;
                    let Some(pos) = conn.inbox.iter().position(|(s, _)| *s == seq) else {
                        return Ok(None);
                    };
                    conn.inbox.swap_remove(pos).1
                };
                self.open.remove(&req);
                self.pool.release(req);
                self.recvs_open[peer] -= 1;
                self.pool.write(region.sub(0, data.len()))?.copy_from_slice(&data);
                Ok(Some(data.len() * crate::net::ELEM_BYTES))
            }
        }
    }
}
