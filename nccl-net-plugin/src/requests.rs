//! Per-comm request pools.
//!
//! NCCL needs at least `NCCL_NET_MAX_REQUESTS` (32) requests outstanding per comm, and keeps up to
//! `maxRecvs` × 32 = 256 sends in flight on a send comm; a grouped receive is one request whatever its `n`. Each comm owns a fixed array of request tokens allocated with the comm,
//! and the pointer NCCL gets for a request is the address of a token. The token never moves and is never
//! freed before its comm, so `test` on a request that already completed finds a free slot and reports
//! it instead of touching freed memory. A full pool is not an error: `isend`/`irecv` then hand NCCL a
//! NULL request, which means "try again later".

use prism_transport::engine::{ReqId, MAX_RECV_REQUESTS, MAX_SEND_REQUESTS};

use crate::handle::Kind;

/// Requests per send comm: what the engine can hold, and never fewer than NCCL's 32.
pub const SEND_POOL_SIZE: usize = if MAX_SEND_REQUESTS > 32 { MAX_SEND_REQUESTS } else { 32 };

/// Requests per receive comm: what the engine can hold, and never fewer than NCCL's 32.
pub const RECV_POOL_SIZE: usize = if MAX_RECV_REQUESTS > 32 { MAX_RECV_REQUESTS } else { 32 };

// Request indices are u16.
const _: () = assert!(SEND_POOL_SIZE <= 1 << 16 && RECV_POOL_SIZE <= 1 << 16);
// NCCL's IB sender has 256 request slots; Prism takes as many.
const _: () = assert!(SEND_POOL_SIZE >= 256);

/// Which kind of comm a request belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommKind {
    /// A send comm.
    Send,
    /// A receive comm.
    Recv,
}

impl CommKind {
    /// Requests a comm of this kind holds.
    pub fn pool_size(self) -> usize {
        match self {
            Self::Send => SEND_POOL_SIZE,
            Self::Recv => RECV_POOL_SIZE,
        }
    }
}

/// What a request pointer points to: where its comm is and which slot of the comm's pool it is.
#[derive(Debug)]
pub struct RequestToken {
    /// The comm's own `Tagged` object.
    pub comm: *const std::ffi::c_void,
    /// Send or receive.
    pub kind: CommKind,
    /// Slot in the comm's pool.
    pub index: u16,
}

// SAFETY: a token is immutable after the comm is built; `comm` is only dereferenced through
// `Tagged::from_ptr`, which checks it, and the comm object it points to is itself `Sync`.
unsafe impl Send for RequestToken {}
// SAFETY: as above.
unsafe impl Sync for RequestToken {}

impl Kind for RequestToken {
    const MAGIC: u64 = 0x5052_4953_4D52_4551; // "PRISMREQ"
    const NAME: &'static str = "request";
}

/// The slots of one comm: which engine request each one stands for.
#[derive(Debug)]
pub struct RequestPool {
    slots: Vec<Option<ReqId>>,
    free: Vec<u16>,
}

impl RequestPool {
    /// A pool of `size` free slots (at most 65536).
    pub fn new(size: usize) -> Self {
        let size = size.min(usize::from(u16::MAX) + 1);
        // Popped from the back, so slot 0 is handed out first: easier to read in traces.
        let free = (0..size).rev().map(|i| i as u16).collect();
        Self { slots: vec![None; size], free }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Requests outstanding.
    pub fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Posts through `post` if a slot is free, and keeps the slot when the engine took the request.
    /// Returns `Ok(None)` without calling `post` when the pool is full, or when `post` says "later".
    pub fn post<E>(&mut self, post: impl FnOnce() -> Result<Option<ReqId>, E>) -> Result<Option<u16>, E> {
        let Some(&index) = self.free.last() else { return Ok(None) };
        match post()? {
            Some(id) => {
                self.free.pop();
                self.slots[usize::from(index)] = Some(id);
                Ok(Some(index))
            }
            None => Ok(None),
        }
    }

    /// The engine request in slot `index`, if one is outstanding there.
    pub fn get(&self, index: u16) -> Option<ReqId> {
        self.slots.get(usize::from(index)).copied().flatten()
    }

    /// Frees slot `index` (the request completed or failed). Freeing a free slot does nothing.
    pub fn release(&mut self, index: u16) {
        if let Some(slot) = self.slots.get_mut(usize::from(index)) {
            if slot.take().is_some() {
                self.free.push(index);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(id: u32) -> impl FnOnce() -> Result<Option<ReqId>, ()> {
        move || Ok(Some(ReqId(id)))
    }

    #[test]
    fn the_pools_hold_at_least_nccls_32_requests_and_256_sends() {
        assert!(RequestPool::new(CommKind::Recv.pool_size()).capacity() >= 32);
        assert!(RequestPool::new(CommKind::Send.pool_size()).capacity() >= 256);
    }

    #[test]
    fn a_full_pool_answers_later_without_asking_the_engine() {
        let mut pool = RequestPool::new(2);
        assert_eq!(pool.post(ok(1)), Ok(Some(0)));
        assert_eq!(pool.post(ok(2)), Ok(Some(1)));
        let mut asked = false;
        let r = pool.post(|| -> Result<Option<ReqId>, ()> {
            asked = true;
            Ok(Some(ReqId(3)))
        });
        assert_eq!(r, Ok(None));
        assert!(!asked);
    }

    #[test]
    fn an_engine_that_says_later_leaves_the_slot_free() {
        let mut pool = RequestPool::new(1);
        assert_eq!(pool.post(|| Ok::<_, ()>(None)), Ok(None));
        assert_eq!(pool.outstanding(), 0);
        assert_eq!(pool.post(ok(9)), Ok(Some(0)));
    }

    #[test]
    fn an_engine_error_leaves_the_slot_free() {
        let mut pool = RequestPool::new(1);
        assert_eq!(pool.post(|| Err::<Option<ReqId>, _>("boom")), Err("boom"));
        assert_eq!(pool.outstanding(), 0);
    }

    #[test]
    fn a_released_slot_is_reused_and_no_longer_maps_to_its_old_request() {
        let mut pool = RequestPool::new(1);
        let i = pool.post(ok(5)).unwrap().unwrap();
        assert_eq!(pool.get(i), Some(ReqId(5)));
        pool.release(i);
        assert_eq!(pool.get(i), None);
        assert_eq!(pool.post(ok(6)), Ok(Some(i)));
        assert_eq!(pool.get(i), Some(ReqId(6)));
    }

    #[test]
    fn releasing_twice_does_not_duplicate_a_free_slot() {
        let mut pool = RequestPool::new(2);
        let i = pool.post(ok(1)).unwrap().unwrap();
        pool.release(i);
        pool.release(i);
        assert_eq!(pool.outstanding(), 0);
        assert!(pool.post(ok(2)).unwrap().is_some());
        assert!(pool.post(ok(3)).unwrap().is_some());
        assert_eq!(pool.post(ok(4)).unwrap(), None);
    }

    #[test]
    fn an_index_out_of_range_has_no_request() {
        let pool = RequestPool::new(4);
        assert_eq!(pool.get(1000), None);
    }
}
