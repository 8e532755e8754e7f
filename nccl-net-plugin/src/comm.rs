//! The objects behind NCCL's opaque pointers, and the safe operations the entry points call.
//!
//! A comm is shared (`&`) between NCCL's proxy threads: the progress thread posts and tests, the
//! service thread may register memory on it at the same time. Its mutable state therefore sits behind a
//! mutex, which the one data-path thread takes uncontended.

use std::ffi::c_void;
use std::sync::Arc;

use parking_lot::Mutex;
use prism_transport::engine::{Listener, RecvBuf, RecvComm, SendBuf, SendComm};

use crate::error::PluginError;
use crate::global::NetState;
use crate::handle::{Kind, Tagged};
use crate::requests::{CommKind, RequestPool, RequestToken};

/// A v11/v12 per-communicator context.
pub struct Context {
    /// NCCL's communicator hash.
    pub comm_id: u64,
    /// Traffic class NCCL asked for (`-1` = none).
    pub traffic_class: i32,
    /// The engine (kept alive by this context).
    pub net: Arc<NetState>,
}

impl Kind for Context {
    const MAGIC: u64 = 0x5052_4953_4D43_5458; // "PRISMCTX"
    const NAME: &'static str = "context";
}

/// A listening comm.
pub struct ListenObj {
    /// Keeps the engine alive while the listener exists.
    pub net: Arc<NetState>,
    /// The engine's listener.
    pub listener: Mutex<Listener>,
}

impl Kind for ListenObj {
    const MAGIC: u64 = 0x5052_4953_4D4C_534E; // "PRISMLSN"
    const NAME: &'static str = "listen comm";
}

/// The engine side of a comm: what posting and testing do for one direction.
pub trait Engine: Send {
    /// What a completed request reports.
    type Done;
    /// Completes, fails, or leaves pending request `req`.
    fn test(&mut self, req: prism_transport::engine::ReqId) -> Result<Option<Self::Done>, PluginError>;
}

impl Engine for SendComm {
    type Done = usize;
    fn test(&mut self, req: prism_transport::engine::ReqId) -> Result<Option<usize>, PluginError> {
        Ok(SendComm::test(self, req)?)
    }
}

impl Engine for RecvComm {
    type Done = Vec<usize>;
    fn test(&mut self, req: prism_transport::engine::ReqId) -> Result<Option<Vec<usize>>, PluginError> {
        Ok(RecvComm::test(self, req)?)
    }
}

/// A send or receive comm.
pub struct CommObj<E: Engine> {
    /// Keeps the engine alive while the comm exists.
    pub net: Arc<NetState>,
    inner: Mutex<Inner<E>>,
    tokens: Box<[Tagged<RequestToken>]>,
}

struct Inner<E> {
    engine: E,
    pool: RequestPool,
}

/// A send comm.
pub type SendObj = CommObj<SendComm>;
/// A receive comm.
pub type RecvObj = CommObj<RecvComm>;

impl Kind for SendObj {
    const MAGIC: u64 = 0x5052_4953_4D53_4E44; // "PRISMSND"
    const NAME: &'static str = "send comm";
}

impl Kind for RecvObj {
    const MAGIC: u64 = 0x5052_4953_4D52_4356; // "PRISMRCV"
    const NAME: &'static str = "recv comm";
}

impl<E: Engine> CommObj<E>
where
    CommObj<E>: Kind,
{
    /// Moves a new comm to the heap and returns the pointer NCCL will hold. The request tokens point
    /// back at the comm, so they are made once its address is fixed.
    pub fn into_raw(net: Arc<NetState>, engine: E, kind: CommKind) -> *mut c_void {
        let obj = CommObj { net, inner: Mutex::new(Inner { engine, pool: RequestPool::new(kind.pool_size()) }), tokens: Box::new([]) };
        let raw = Tagged::into_raw(obj);
        let tokens: Box<[Tagged<RequestToken>]> =
            (0..kind.pool_size()).map(|i| Tagged::new(RequestToken { comm: raw.cast_const(), kind, index: i as u16 })).collect();
        // SAFETY: `raw` came from Box::into_raw just above and has not been shared yet, so this is the
        // only access; assigning through the raw pointer replaces the empty token slice.
        let obj = unsafe { &mut (*raw.cast::<Tagged<Self>>()).value };
        obj.tokens = tokens;
        // Request pointers are found through the registry from now on, until the comm is dropped.
        Tagged::register(&obj.tokens);
        raw
    }

    /// Posts a request through `post` if the pool has room; the pointer NCCL gets, or NULL for "later".
    pub fn post(
        &self,
        post: impl FnOnce(&mut E) -> Result<Option<prism_transport::engine::ReqId>, PluginError>,
    ) -> Result<*mut c_void, PluginError> {
        let mut inner = self.inner.lock();
        let Inner { engine, pool } = &mut *inner;
        match pool.post(|| post(engine))? {
            Some(index) => Ok(std::ptr::from_ref(&self.tokens[usize::from(index)]).cast_mut().cast()),
            None => Ok(std::ptr::null_mut()),
        }
    }

    /// Tests the request in slot `index`; a completed or failed request frees its slot.
    pub fn test(&self, index: u16) -> Result<Option<E::Done>, PluginError> {
        let mut inner = self.inner.lock();
        let Some(id) = inner.pool.get(index) else {
            return Err(crate::error::invalid(format!(
                "request {index} of this {} is not outstanding (already completed, or never posted)",
                <Self as Kind>::NAME
            )));
        };
        let r = inner.engine.test(id);
        if !matches!(r, Ok(None)) {
            inner.pool.release(index);
        }
        r
    }

    /// Requests outstanding (for tests and logs).
    pub fn outstanding(&self) -> usize {
        self.inner.lock().pool.outstanding()
    }
}

impl<E: Engine> Drop for CommObj<E> {
    /// The requests of a closed comm are refused from now on, before their memory goes with the comm.
    fn drop(&mut self) {
        Tagged::unregister(&self.tokens);
    }
}

impl SendObj {
    /// Posts a send of `buf` with `tag`.
    pub fn isend(&self, buf: Box<dyn SendBuf>, tag: i32) -> Result<*mut c_void, PluginError> {
        self.post(|e| Ok(e.isend(buf, tag)?))
    }
}

impl RecvObj {
    /// Posts one (grouped) receive.
    pub fn irecv(&self, bufs: Vec<(Box<dyn RecvBuf>, i32)>) -> Result<*mut c_void, PluginError> {
        self.post(|e| Ok(e.irecv(bufs)?))
    }
}

// NCCL calls into one object from several threads (the service thread registers memory while the
// progress thread tests); every object behind a pointer NCCL holds must therefore be Send + Sync.
const _: fn() = || {
    fn shared_across_threads<T: Send + Sync>() {}
    shared_across_threads::<Context>();
    shared_across_threads::<ListenObj>();
    shared_across_threads::<SendObj>();
    shared_across_threads::<RecvObj>();
    shared_across_threads::<crate::mr::MemRegion>();
    shared_across_threads::<Tagged<RequestToken>>();
};
