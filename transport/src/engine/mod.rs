//! The engine: drives one `proto::Connection` per NCCL comm with a backend and a clock.
//!
//! This is the safe API the plugin's C entry points call. Nothing here blocks: `connect` and `accept`
//! return `Ok(None)` until the handshake is done, `isend`/`irecv` return `Ok(None)` when the request
//! cannot be posted yet (NCCL retries), and `test` makes progress on the whole comm. A post on a comm
//! whose peer closed or died is accepted like any other; its `test` reports the failure.

use std::net::IpAddr;

/// Size of the NCCL connection handle (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_LEN: usize = 128;

/// Most sends outstanding per send comm (NCCL keeps up to `maxRecvs` × 32 = 256 in flight); one more
/// is "retry later".
pub const MAX_SEND_REQUESTS: usize = crate::proto::MAX_OUTSTANDING_SENDS;

/// Most grouped receives outstanding per receive comm (NCCL posts up to 32); one more is "retry later".
pub const MAX_RECV_REQUESTS: usize = crate::proto::MAX_OUTSTANDING_RECVS;

/// Most buffers in one grouped receive (`maxRecvs`).
pub const MAX_RECVS: usize = 8;

/// Errors of the engine's calls. Each says what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A configuration variable has an unusable value.
    #[error("{0}")]
    Config(String),
    /// No usable network device.
    #[error("no usable network device: {0}")]
    NoDevice(String),
    /// A device index out of range.
    #[error("device {dev} does not exist (have {ndev})")]
    BadDevice { dev: usize, ndev: usize },
    /// The connection handle is not one Prism made.
    #[error("bad connection handle: {0}")]
    BadHandle(String),
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The peer did not answer the handshake within the configured time.
    #[error("connection handshake with {peer} timed out after {ms} ms")]
    HandshakeTimeout { peer: String, ms: u64 },
    /// An argument the caller passed cannot be served.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The request id is not outstanding on this comm.
    #[error("unknown request {0}")]
    UnknownRequest(u32),
    /// A send was larger than the receive it matched; both requests fail. The text says so whole.
    #[error("{0}")]
    Truncated(String),
    /// A request failed (peer gone, closed, ...). Its reason is in the message.
    #[error("request failed: {0}")]
    RequestFailed(String),
    /// The connection is dead (peer timed out or closed).
    #[error("connection failed: {0}")]
    ConnectionFailed(String),
}

/// One network device (rail) as NCCL sees it.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Unique device name, e.g. `prism:eth0`.
    pub name: String,
    /// Linux interface name.
    pub ifname: String,
    /// The address Prism binds on this interface.
    pub addr: IpAddr,
    /// Link speed in Mbit/s (sysfs, or a default for virtual interfaces).
    pub speed_mbps: u32,
    /// Interface MTU in bytes.
    pub mtu: u32,
    /// Real path of the PCI function in sysfs, `None` for virtual interfaces (see [`sysfs`]).
    pub pci_path: Option<String>,
    /// GUID NCCL tells devices apart by: the RDMA node GUID, or MAC and rail index (see [`sysfs`]).
    pub guid: u64,
}

/// Bytes the engine reads from when it sends. The plugin implements it over the caller's buffer.
pub trait SendBuf: Send {
    /// Length of the message in bytes.
    fn len(&self) -> usize;
    /// True for a zero-byte message.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy `out.len()` bytes starting at `offset`; the engine guarantees `offset + out.len() <= len()`.
    fn read(&self, offset: usize, out: &mut [u8]);
    /// Address of the first byte in this process, for RDMA (the verbs backend sends straight from
    /// it); `None` when the bytes have no stable address, which the verbs backend refuses.
    fn addr(&self) -> Option<usize> {
        None
    }
    /// The message's bytes in place, for a backend that sends them without copying them first (UDP
    /// hands the kernel the engine's header and a slice of these bytes); `None`: the engine copies
    /// them with `read`.
    fn bytes(&self) -> Option<&[u8]> {
        None
    }
}

/// Bytes the engine writes into when it receives. The plugin implements it over the caller's buffer.
pub trait RecvBuf: Send {
    /// Length of the posted buffer in bytes.
    fn len(&self) -> usize;
    /// True for a zero-byte buffer.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Write `data` at `offset`; the engine guarantees `offset + data.len() <= len()`.
    fn write(&mut self, offset: usize, data: &[u8]);
    /// Address of the first byte in this process, for RDMA (the verbs backend's peer writes straight
    /// into it); `None` when the buffer has no stable address, which the verbs backend refuses.
    fn addr(&self) -> Option<usize> {
        None
    }
}

/// An outstanding request on one comm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReqId(pub u32);

mod batch;
mod board;
mod closed;
mod comm;
mod config;
pub mod device;
mod handshake;
mod listener;
mod net;
mod planned;
mod progress;
mod rail;
mod revive;
mod shared;
pub mod sysfs;
mod vcomm;

pub use comm::{RecvComm, SendComm};
pub use config::{QpType, Transport, TransportConfig};
pub use listener::Listener;
pub use net::Net;
