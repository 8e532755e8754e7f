//! [`ShimTransport`]: the [`Transport`] over a real plugin, one send comm per peer this rank sends to
//! and one recv comm per peer it receives from, every buffer registered with every comm.

use std::collections::HashMap;
use std::ffi::c_int;
use std::time::{Duration, Instant};

use super::plugin::check;
use super::{BufId, Direction, NetError, Plugin, Pool, Region, ReqId, Transport, HANDLE_BYTES};
use crate::ffi::{Comm, MemHandle, Request};

/// How a rank's connection handles reach its peers: given the handles this rank listens on (one per
/// peer it receives from, keyed by that peer), return the handles of the peers it sends to (keyed by
/// the sending target). Implemented on top of the rendezvous.
pub type HandleExchange<'a> = dyn FnOnce(Vec<(usize, Vec<u8>)>) -> Result<Vec<(usize, Vec<u8>)>, String> + 'a;

/// Where a rank's comms live: its net device and its place in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// Plugin device index every comm is opened on.
    pub dev: usize,
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub nranks: usize,
}

/// A [`Transport`] over a real plugin: one send comm per peer this rank sends to, one recv comm per
/// peer it receives from.
pub struct ShimTransport {
    // Declared first so it drops first: finalize and dlclose before the pool's memory is freed.
    plugin: Plugin,
    rank: usize,
    nranks: usize,
    send_comms: Vec<(usize, Comm)>,
    recv_comms: Vec<(usize, Comm)>,
    /// Per buffer: the memory handle for each send comm, then for each recv comm (same order).
    mhandles: Vec<Vec<MemHandle>>,
    open: HashMap<ReqId, Request>,
    next_req: u64,
    closed: bool,
    pool: Pool,
}

/// The handle of each peer in `send_peers`, from the handles `theirs` the exchange returned.
fn peer_handles(send_peers: &[usize], theirs: &[(usize, Vec<u8>)]) -> Result<Vec<(usize, [u8; HANDLE_BYTES])>, NetError> {
    let mut handles = Vec::new();
    for &peer in send_peers {
        let h = theirs.iter().find(|(p, _)| *p == peer).ok_or_else(|| NetError::Exchange(format!("no handle from peer {peer}")))?;
        let h: [u8; HANDLE_BYTES] =
            h.1.as_slice()
                .try_into()
                .map_err(|_| NetError::Exchange(format!("handle from peer {peer} has {} bytes, not {HANDLE_BYTES}", h.1.len())))?;
        handles.push((peer, h));
    }
    Ok(handles)
}

impl ShimTransport {
    /// Listens for every peer in `recv_peers`, swaps handles through `exchange`, then drives
    /// `connect` (to `send_peers`) and `accept` in one loop until every comm is up or `timeout` passes.
    pub fn establish(
        plugin: Plugin,
        place: Place,
        send_peers: &[usize],
        recv_peers: &[usize],
        exchange: Box<HandleExchange<'_>>,
        timeout: Duration,
    ) -> Result<Self, NetError> {
        let Place { dev, rank, nranks } = place;
        let dev_c = c_int::try_from(dev).map_err(|_| NetError::Protocol(format!("device {dev}")))?;
        let mut t = Self {
            plugin,
            rank,
            nranks,
            send_comms: Vec::new(),
            recv_comms: Vec::new(),
            mhandles: Vec::new(),
            open: HashMap::new(),
            next_req: 1,
            closed: false,
            pool: Pool::new(),
        };
        // Listen comms, kept until their accept completes (and closed on every path).
        let mut listens: Vec<(usize, Comm)> = Vec::new();
        let result = t.listen_all(dev_c, recv_peers, &mut listens).and_then(|mine| {
            let theirs = exchange(mine).map_err(NetError::Exchange)?;
            let mut handles = peer_handles(send_peers, &theirs)?;
            t.connect_and_accept(dev_c, &mut handles, &listens, timeout)
        });
        // NCCL closes a listen comm right after its accept; here all accepts are done (or failed).
        let mut close_err = Ok(());
        for (_, lc) in listens {
            let r = check("closeListen", t.plugin.shim().close_listen(lc));
            if close_err.is_ok() {
                close_err = r;
            }
        }
        result?;
        close_err?;
        Ok(t)
    }

    /// One listen comm per peer in `recv_peers` (pushed to `listens`); returns their handles.
    fn listen_all(&self, dev: c_int, recv_peers: &[usize], listens: &mut Vec<(usize, Comm)>) -> Result<Vec<(usize, Vec<u8>)>, NetError> {
        let mut mine = Vec::new();
        for &peer in recv_peers {
            let mut handle = [0u8; HANDLE_BYTES];
            let (code, lc) = self.plugin.shim().listen(dev, &mut handle);
            check("listen", code)?;
            if lc.is_null() {
                return Err(NetError::Protocol("listen succeeded with a NULL listenComm".into()));
            }
            listens.push((peer, lc));
            mine.push((peer, handle.to_vec()));
        }
        Ok(mine)
    }

    /// Calls `connect` for every peer's handle and `accept` on every listen comm, round after round,
    /// until every comm is up; fails after `timeout` without progress.
    fn connect_and_accept(
        &mut self,
        dev: c_int,
        handles: &mut [(usize, [u8; HANDLE_BYTES])],
        listens: &[(usize, Comm)],
        timeout: Duration,
    ) -> Result<(), NetError> {
        let start = Instant::now();
        let mut accepted: Vec<usize> = Vec::new();
        loop {
            let mut progress = false;
            for (peer, handle) in handles.iter_mut() {
                if self.send_comms.iter().any(|(p, _)| p == peer) {
                    continue;
                }
                let (code, sc) = self.plugin.shim().connect(dev, handle);
                check("connect", code)?;
                if !sc.is_null() {
                    self.send_comms.push((*peer, sc));
                    progress = true;
                }
            }
            for &(peer, lc) in listens {
                if accepted.contains(&peer) {
                    continue;
                }
                let (code, rc) = self.plugin.shim().accept(lc);
                check("accept", code)?;
                if !rc.is_null() {
                    self.recv_comms.push((peer, rc));
                    accepted.push(peer);
                    progress = true;
                }
            }
            if self.send_comms.len() == handles.len() && accepted.len() == listens.len() {
                return Ok(());
            }
            if !progress {
                if start.elapsed() > timeout {
                    let mut pending: Vec<String> = handles
                        .iter()
                        .filter(|(p, _)| !self.send_comms.iter().any(|(q, _)| q == p))
                        .map(|(p, _)| format!("connect to rank {p}"))
                        .collect();
                    pending.extend(listens.iter().filter(|(p, _)| !accepted.contains(p)).map(|(p, _)| format!("accept from rank {p}")));
                    return Err(NetError::ConnectTimeout { secs: start.elapsed().as_secs_f64(), pending: pending.join(", ") });
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// The plugin this transport drives.
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// The comm towards (or from) `peer` and its index in a buffer's memory handles.
    fn comm(&self, dir: Direction, peer: usize) -> Result<(usize, Comm), NetError> {
        let (list, offset) = match dir {
            Direction::Send => (&self.send_comms, 0),
            Direction::Recv => (&self.recv_comms, self.send_comms.len()),
        };
        list.iter().position(|(p, _)| *p == peer).map(|i| (offset + i, list[i].1)).ok_or(NetError::NoComm { dir, peer })
    }

    fn post(&mut self, dir: Direction, peer: usize, region: Region) -> Result<Option<ReqId>, NetError> {
        let (mh_index, comm) = self.comm(dir, peer)?;
        let mh = *self
            .mhandles
            .get(region.buf.0)
            .and_then(|v| v.get(mh_index))
            .ok_or(NetError::OutOfBounds { region, buf_len: self.pool.buf_len(region.buf) })?;
        self.pool.check(region)?;
        let id = ReqId(self.next_req);
        let is_recv = dir == Direction::Recv;
        self.pool.claim(id, region, is_recv)?;
        // Tags as NCCL sets them: the sender's rank on both sides.
        let tag = c_int::try_from(if is_recv { peer } else { self.rank }).unwrap_or(c_int::MAX);
        let buf = self.pool.host_buf(region.buf).ok_or(NetError::OutOfBounds { region, buf_len: 0 })?;
        let (code, req) = self.plugin.shim().post(is_recv, comm, buf, region.start, region.len, tag, mh);
        let Some(req) = req.filter(|_| code == 0) else {
            self.pool.release(id);
            check(if is_recv { "irecv" } else { "isend" }, code)?;
            return Ok(None);
        };
        self.next_req += 1;
        self.open.insert(id, req);
        Ok(Some(id))
    }

    /// Requests still outstanding, for diagnostics.
    pub fn outstanding(&self) -> usize {
        self.open.len()
    }

    /// Deregisters every buffer, closes every comm and finalizes the plugin, reporting the first error.
    pub fn close(mut self) -> Result<(), NetError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), NetError> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let mut first: Result<(), NetError> = Ok(());
        let mut keep = |r: Result<(), NetError>| {
            if first.is_ok() {
                first = r;
            }
        };
        if !self.open.is_empty() {
            keep(Err(NetError::Protocol(format!("closing with {} requests still outstanding", self.open.len()))));
        }
        let shim = self.plugin.shim();
        let comms: Vec<Comm> = self.send_comms.iter().chain(self.recv_comms.iter()).map(|(_, c)| *c).collect();
        for per_buf in std::mem::take(&mut self.mhandles) {
            for (mh, comm) in per_buf.into_iter().zip(&comms) {
                if !mh.is_null() {
                    keep(check("deregMr", shim.dereg_mr(*comm, mh)));
                }
            }
        }
        for (_, c) in std::mem::take(&mut self.send_comms) {
            keep(check("closeSend", shim.close_send(c)));
        }
        for (_, c) in std::mem::take(&mut self.recv_comms) {
            keep(check("closeRecv", shim.close_recv(c)));
        }
        keep(self.plugin.finalize());
        first
    }
}

impl Drop for ShimTransport {
    fn drop(&mut self) {
        // The error path: the caller already has an error to report; this one would only repeat it.
        let _ = self.teardown();
    }
}

impl Transport for ShimTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn nranks(&self) -> usize {
        self.nranks
    }

    fn pool(&self) -> &Pool {
        &self.pool
    }

    fn pool_mut(&mut self) -> &mut Pool {
        &mut self.pool
    }

    fn alloc(&mut self, len: usize) -> Result<BufId, NetError> {
        let id = self.pool.alloc(len)?;
        let buf = self.pool.host_buf(id).ok_or(NetError::OutOfMemory { bytes: len })?;
        let shim = self.plugin.shim();
        let mut per_comm = Vec::new();
        for &(_, comm) in self.send_comms.iter().chain(self.recv_comms.iter()) {
            let mut mh = MemHandle::NONE;
            if !buf.is_empty() {
                let (code, h) = shim.reg_mr(comm, buf);
                if code != 0 {
                    // Keep what was registered so teardown deregisters it.
                    self.mhandles.push(per_comm);
                    return Err(NetError::Plugin { call: "regMr", code });
                }
                mh = h;
            }
            per_comm.push(mh);
        }
        self.mhandles.push(per_comm);
        debug_assert_eq!(self.mhandles.len(), id.0 + 1);
        Ok(id)
    }

    fn isend(&mut self, peer: usize, region: Region) -> Result<Option<ReqId>, NetError> {
        self.post(Direction::Send, peer, region)
    }

    fn irecv(&mut self, peer: usize, region: Region) -> Result<Option<ReqId>, NetError> {
        self.post(Direction::Recv, peer, region)
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        let open = *self.open.get(&req).ok_or(NetError::UnknownRequest(req))?;
        let (code, done, size) = self.plugin.shim().test(open);
        if code != 0 {
            return Err(NetError::Plugin { call: "test", code });
        }
        if !done {
            return Ok(None);
        }
        self.open.remove(&req);
        self.pool.release(req);
        usize::try_from(size).map(Some).map_err(|_| NetError::Protocol(format!("test reported size {size}")))
    }
}
