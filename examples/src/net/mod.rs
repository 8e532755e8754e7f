//! The network prism-perf runs collectives on: the [`Transport`] trait the collectives see, the host
//! buffers behind it ([`Pool`]), and its implementation over a real plugin ([`ShimTransport`], through
//! the C shim `csrc/netshim.c`; every `unsafe` call is in [`crate::ffi`]).
//!
//! Buffers are named by [`Region`]s of a [`Pool`], and a region that a posted request still uses
//! cannot be borrowed, so the plugin's threads and our slices never touch the same bytes at the same
//! time.

mod plugin;
mod pool;
mod shim;
#[cfg(test)]
mod tests;

pub use crate::ffi::HANDLE_BYTES;
pub use plugin::{DeviceProps, Plugin};
pub use pool::{BufId, Pool, Region};
pub use shim::{HandleExchange, Place, ShimTransport};

/// Requests NCCL may have outstanding on one comm (`NCCL_NET_MAX_REQUESTS`); the plugin must take this many.
pub const MAX_REQUESTS_PER_COMM: usize = 32;
/// Bytes of one element: prism-perf moves `float` only.
pub const ELEM_BYTES: usize = std::mem::size_of::<f32>();

/// Which way a comm (or a request on it) carries data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// This rank sends.
    Send,
    /// This rank receives (the plugin writes our buffer).
    Recv,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Direction::Send => "send",
            Direction::Recv => "recv",
        })
    }
}

/// Errors of the transport layer: the plugin's own result codes, and misuse caught before a call.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The plugin could not be loaded (dlopen, dlsym, missing table slot).
    #[error("cannot load the plugin: {0}")]
    Load(String),
    /// A plugin call returned a non-success result.
    #[error("{call} returned {code} ({})", result_name(*.code))]
    Plugin {
        /// The ABI function, e.g. `isend`.
        call: &'static str,
        /// The `ncclResult_t` (or the shim's negative code).
        code: i32,
    },
    /// A region does not lie inside its buffer.
    #[error("region {region:?} is outside its buffer of {buf_len} elements")]
    OutOfBounds {
        /// The offending region.
        region: Region,
        /// Elements in the buffer.
        buf_len: usize,
    },
    /// A region overlaps one that a posted request still uses.
    #[error("region {0:?} overlaps a region that a posted request still uses")]
    Busy(Region),
    /// Two regions of one borrow overlap each other.
    #[error("regions {0:?} and {1:?} overlap")]
    Overlap(Region, Region),
    /// There is no comm towards (or from) that peer.
    #[error("no {dir} comm for peer {peer}")]
    NoComm {
        /// Which comm.
        dir: Direction,
        /// The peer rank.
        peer: usize,
    },
    /// `test` was called with a request that is not outstanding.
    #[error("request {0:?} is not outstanding")]
    UnknownRequest(ReqId),
    /// A buffer could not be allocated.
    #[error("cannot allocate {bytes} bytes of host memory")]
    OutOfMemory {
        /// Requested size.
        bytes: usize,
    },
    /// The out-of-band exchange of connection handles failed.
    #[error("handle exchange: {0}")]
    Exchange(String),
    /// Connections did not come up in time.
    #[error("connections not established after {secs:.1} s; still waiting for: {pending}")]
    ConnectTimeout {
        /// Seconds waited.
        secs: f64,
        /// Which connects/accepts were still open.
        pending: String,
    },
    /// The in-memory transport saw a protocol violation (used by tests and [`crate::memnet`]).
    #[error("{0}")]
    Protocol(String),
}

/// What an `ncclResult_t` (or a shim code) means, for error messages.
pub fn result_name(code: i32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        -1 => "refused by the shim (NULL argument or missing slot)",
        -2 => "getProperties wrote past the end of this ABI version's properties struct",
        _ => "unknown result code",
    }
}

/// A posted request of a [`Transport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReqId(pub u64);

/// What the collectives need from a network: a rank's buffers and non-blocking sends and receives to
/// peers, NCCL-style (a `None` request means "try again later").
pub trait Transport {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the job.
    fn nranks(&self) -> usize;
    /// The rank's buffers.
    fn pool(&self) -> &Pool;
    /// The rank's buffers, mutably (regions in use by posted requests stay locked).
    fn pool_mut(&mut self) -> &mut Pool;
    /// Allocates a zeroed buffer of `len` elements and registers it with every comm.
    fn alloc(&mut self, len: usize) -> Result<BufId, NetError>;
    /// Posts a send of `region` to `peer`; `Ok(None)` asks to retry later.
    fn isend(&mut self, peer: usize, region: Region) -> Result<Option<ReqId>, NetError>;
    /// Posts a receive into `region` from `peer`; `Ok(None)` asks to retry later.
    fn irecv(&mut self, peer: usize, region: Region) -> Result<Option<ReqId>, NetError>;
    /// Progresses and tests `req`: `Some(bytes)` once done (the request is then gone), `None` before.
    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError>;
}
