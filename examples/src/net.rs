//! The plugin's C ABI, reached through the C shim (`csrc/netshim.c`), and the host buffers it reads and
//! writes.
//!
//! This is the only module with `unsafe`. Everything above it sees the safe [`Transport`] trait: buffers
//! are named by [`Region`]s of a [`Pool`], and a region that a posted request still uses cannot be
//! borrowed, so the plugin's threads and our slices never touch the same bytes at the same time.

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Bytes of a connection handle (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_BYTES: usize = 128;
/// Requests NCCL may have outstanding on one comm (`NCCL_NET_MAX_REQUESTS`); the plugin must take this many.
pub const MAX_REQUESTS_PER_COMM: usize = 32;
/// Bytes of one element: prism-perf moves `float` only.
pub const ELEM_BYTES: usize = std::mem::size_of::<f32>();

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
        /// "send" or "recv".
        dir: &'static str,
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

/// A buffer of a [`Pool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufId(usize);

/// A contiguous range of `f32` elements of one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// The buffer.
    pub buf: BufId,
    /// First element.
    pub start: usize,
    /// Number of elements.
    pub len: usize,
}

impl Region {
    /// The whole of `len` elements from `start` of `buf`.
    pub fn new(buf: BufId, start: usize, len: usize) -> Self {
        Self { buf, start, len }
    }

    /// A sub-range, `start` relative to this region.
    pub fn sub(&self, start: usize, len: usize) -> Self {
        Self { buf: self.buf, start: self.start + start, len }
    }

    /// One past the last element.
    pub fn end(&self) -> usize {
        self.start + self.len
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * ELEM_BYTES
    }

    /// Whether the two regions share at least one element.
    pub fn overlaps(&self, other: &Region) -> bool {
        self.buf == other.buf && self.len > 0 && other.len > 0 && self.start < other.end() && other.start < self.end()
    }
}

/// A posted request of a [`Transport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReqId(pub u64);

/// Page-aligned host memory owned by a [`Pool`]; the plugin gets raw pointers into it.
struct HostBuf {
    ptr: NonNull<f32>,
    len: usize,
}

impl HostBuf {
    // Page alignment, like NCCL's own host buffers; some transports register whole pages.
    const ALIGN: usize = 4096;

    fn new(len: usize) -> Result<Self, NetError> {
        if len == 0 {
            return Ok(Self { ptr: NonNull::dangling(), len });
        }
        let bytes = len.checked_mul(ELEM_BYTES).ok_or(NetError::OutOfMemory { bytes: usize::MAX })?;
        let layout = Layout::from_size_align(bytes, Self::ALIGN).map_err(|_| NetError::OutOfMemory { bytes })?;
        // SAFETY: the layout has a non-zero size (len > 0); zeroed memory is a valid [f32].
        let raw = unsafe { alloc::alloc_zeroed(layout) }.cast::<f32>();
        NonNull::new(raw).map(|ptr| Self { ptr, len }).ok_or(NetError::OutOfMemory { bytes })
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            let layout = Layout::from_size_align(self.len * ELEM_BYTES, Self::ALIGN).expect("layout was valid at alloc");
            // SAFETY: allocated in `new` with this very layout and not freed since.
            unsafe { alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
        }
    }
}

// SAFETY: a HostBuf owns its allocation; the only other party holding its address is the plugin, whose
// accesses are confined to regions marked pending in the owning Pool.
unsafe impl Send for HostBuf {}

#[derive(Debug, Clone, Copy)]
struct PendingUse {
    req: ReqId,
    region: Region,
    /// A receive: the plugin writes the region, so nobody else may even read it.
    plugin_writes: bool,
}

/// The host buffers of one rank, and which of their regions posted requests still use.
#[derive(Default)]
pub struct Pool {
    bufs: Vec<HostBuf>,
    pending: Vec<PendingUse>,
}

impl Pool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allocates a zeroed buffer of `len` elements.
    pub fn alloc(&mut self, len: usize) -> Result<BufId, NetError> {
        self.bufs.push(HostBuf::new(len)?);
        Ok(BufId(self.bufs.len() - 1))
    }

    /// Elements in `buf` (0 for an unknown id).
    pub fn buf_len(&self, buf: BufId) -> usize {
        self.bufs.get(buf.0).map_or(0, |b| b.len)
    }

    /// The whole buffer as one region.
    pub fn whole(&self, buf: BufId) -> Region {
        Region::new(buf, 0, self.buf_len(buf))
    }

    /// Number of regions posted requests still use.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    fn check(&self, region: Region) -> Result<&HostBuf, NetError> {
        let buf_len = self.buf_len(region.buf);
        match self.bufs.get(region.buf.0) {
            Some(b) if region.start.checked_add(region.len).is_some_and(|end| end <= buf_len) => Ok(b),
            _ => Err(NetError::OutOfBounds { region, buf_len }),
        }
    }

    /// Marks `region` as used by `req`. A receive (`plugin_writes`) may not overlap any pending use; a
    /// send may share its bytes with other sends but not with a receive.
    pub fn claim(&mut self, req: ReqId, region: Region, plugin_writes: bool) -> Result<(), NetError> {
        self.check(region)?;
        if self.pending.iter().any(|p| p.region.overlaps(&region) && (plugin_writes || p.plugin_writes)) {
            return Err(NetError::Busy(region));
        }
        self.pending.push(PendingUse { req, region, plugin_writes });
        Ok(())
    }

    /// Ends the use of whatever `req` claimed.
    pub fn release(&mut self, req: ReqId) {
        self.pending.retain(|p| p.req != req);
    }

    /// The address of a checked region, for the plugin.
    fn raw(&self, region: Region) -> Result<*mut c_void, NetError> {
        let b = self.check(region)?;
        // SAFETY: start <= len was checked, so the offset stays inside (or one past) the allocation.
        Ok(unsafe { b.ptr.as_ptr().add(region.start) }.cast())
    }

    fn raw_whole(&self, buf: BufId) -> Result<(*mut c_void, usize), NetError> {
        let whole = self.whole(buf);
        Ok((self.raw(whole)?, whole.bytes()))
    }

    fn readable(&self, region: Region) -> Result<(), NetError> {
        if self.pending.iter().any(|p| p.plugin_writes && p.region.overlaps(&region)) {
            return Err(NetError::Busy(region));
        }
        Ok(())
    }

    fn writable(&self, region: Region) -> Result<(), NetError> {
        if self.pending.iter().any(|p| p.region.overlaps(&region)) {
            return Err(NetError::Busy(region));
        }
        Ok(())
    }

    /// Whether no posted request uses any element of `region` (so a receive may be posted into it).
    pub fn is_idle(&self, region: Region) -> bool {
        self.writable(region).is_ok()
    }

    /// Reads a region no pending receive is writing.
    pub fn read(&self, region: Region) -> Result<&[f32], NetError> {
        let b = self.check(region)?;
        self.readable(region)?;
        // SAFETY: in bounds (checked); no pending receive writes these elements and `&self` rules out a
        // Rust writer, so the slice is not mutated while it lives.
        Ok(unsafe { std::slice::from_raw_parts(b.ptr.as_ptr().add(region.start), region.len) })
    }

    /// Writes a region no pending request uses.
    pub fn write(&mut self, region: Region) -> Result<&mut [f32], NetError> {
        let b = self.check(region)?;
        self.writable(region)?;
        // SAFETY: in bounds; no pending request (hence no plugin thread) touches these elements and
        // `&mut self` rules out any other Rust borrow.
        Ok(unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr().add(region.start), region.len) })
    }

    /// Writes `dst` while reading `src`; the two must not overlap.
    pub fn write_read(&mut self, dst: Region, src: Region) -> Result<(&mut [f32], &[f32]), NetError> {
        if dst.overlaps(&src) {
            return Err(NetError::Overlap(dst, src));
        }
        let d = self.check(dst)?.ptr;
        let s = self.check(src)?.ptr;
        self.writable(dst)?;
        self.readable(src)?;
        // SAFETY: both in bounds and disjoint; dst has no pending use, src no pending writer; `&mut self`
        // rules out other Rust borrows for the lifetime of both slices.
        unsafe {
            Ok((
                std::slice::from_raw_parts_mut(d.as_ptr().add(dst.start), dst.len),
                std::slice::from_raw_parts(s.as_ptr().add(src.start), src.len),
            ))
        }
    }

    /// Copies `src` into `dst` (same length).
    pub fn copy(&mut self, dst: Region, src: Region) -> Result<(), NetError> {
        if dst.len != src.len {
            return Err(NetError::Protocol(format!("copy of {} elements into {}", src.len, dst.len)));
        }
        let (d, s) = self.write_read(dst, src)?;
        d.copy_from_slice(s);
        Ok(())
    }

    /// `dst[i] += src[i]` (same length).
    pub fn add_assign(&mut self, dst: Region, src: Region) -> Result<(), NetError> {
        if dst.len != src.len {
            return Err(NetError::Protocol(format!("sum of {} elements into {}", src.len, dst.len)));
        }
        let (d, s) = self.write_read(dst, src)?;
        for (a, b) in d.iter_mut().zip(s) {
            *a += *b;
        }
        Ok(())
    }
}

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

// ---------------------------------------------------------------------------------------------------
// The C shim.

#[repr(C)]
struct ShimRaw {
    _private: [u8; 0],
}

/// Mirror of `shim_props_t` in `csrc/netshim.h`.
#[repr(C)]
struct ShimProps {
    name: [c_char; 64],
    pci_path: [c_char; 256],
    guid: u64,
    ptr_support: c_int,
    reg_is_global: c_int,
    force_flush: c_int,
    speed_mbps: c_int,
    port: c_int,
    latency_us: f32,
    max_comms: c_int,
    max_recvs: c_int,
    net_device_type: c_int,
    net_device_version: c_int,
    vdev_count: c_int,
    max_p2p_bytes: usize,
    max_multi_request_size: c_int,
    rail_id: c_int,
    plane_id: c_int,
}

extern "C" {
    fn shim_set_verbosity(verbosity: c_int);
    fn shim_open(path: *const c_char, version: c_int, err: *mut c_char, err_len: usize) -> *mut ShimRaw;
    fn shim_name(s: *const ShimRaw) -> *const c_char;
    fn shim_init(s: *mut ShimRaw, comm_id: u64) -> c_int;
    fn shim_devices(s: *mut ShimRaw, ndev: *mut c_int) -> c_int;
    fn shim_get_props(s: *mut ShimRaw, dev: c_int, out: *mut ShimProps) -> c_int;
    fn shim_listen(s: *mut ShimRaw, dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> c_int;
    fn shim_connect(s: *mut ShimRaw, dev: c_int, handle: *mut c_void, send_comm: *mut *mut c_void) -> c_int;
    fn shim_accept(s: *mut ShimRaw, listen_comm: *mut c_void, recv_comm: *mut *mut c_void) -> c_int;
    fn shim_reg_mr(s: *mut ShimRaw, comm: *mut c_void, data: *mut c_void, size: usize, mh: *mut *mut c_void) -> c_int;
    fn shim_dereg_mr(s: *mut ShimRaw, comm: *mut c_void, mh: *mut c_void) -> c_int;
    fn shim_isend(
        s: *mut ShimRaw,
        send_comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        tag: c_int,
        mh: *mut c_void,
        request: *mut *mut c_void,
    ) -> c_int;
    fn shim_irecv(
        s: *mut ShimRaw,
        recv_comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        tag: c_int,
        mh: *mut c_void,
        request: *mut *mut c_void,
    ) -> c_int;
    fn shim_test(s: *mut ShimRaw, request: *mut c_void, done: *mut c_int, size: *mut c_int) -> c_int;
    fn shim_close_send(s: *mut ShimRaw, comm: *mut c_void) -> c_int;
    fn shim_close_recv(s: *mut ShimRaw, comm: *mut c_void) -> c_int;
    fn shim_close_listen(s: *mut ShimRaw, comm: *mut c_void) -> c_int;
    fn shim_finalize(s: *mut ShimRaw) -> c_int;
    fn shim_close(s: *mut ShimRaw);
}

fn check(call: &'static str, code: c_int) -> Result<(), NetError> {
    if code == 0 {
        Ok(())
    } else {
        Err(NetError::Plugin { call, code })
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// One device's properties as the plugin reported them.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceProps {
    /// Device index.
    pub dev: usize,
    /// `name`.
    pub name: String,
    /// `pciPath` (empty when NULL).
    pub pci_path: String,
    /// `guid`.
    pub guid: u64,
    /// `speed` in Mbps.
    pub speed_mbps: i32,
    /// `port`.
    pub port: i32,
    /// `ptrSupport` bits (1 = host).
    pub ptr_support: i32,
    /// `regIsGlobal`.
    pub reg_is_global: i32,
    /// `latency` in µs.
    pub latency_us: f32,
    /// `maxComms`.
    pub max_comms: i32,
    /// `maxRecvs`.
    pub max_recvs: i32,
    /// `maxP2pBytes`.
    pub max_p2p_bytes: usize,
    /// `railId` (v12; -1 before).
    pub rail_id: i32,
}

/// A loaded plugin: the dlopened `.so` and its `ncclNetPlugin_vN` table.
pub struct Plugin {
    shim: NonNull<ShimRaw>,
    path: PathBuf,
    version: u32,
    name: String,
    initialised: bool,
}

impl Plugin {
    /// Which plugin log lines reach stderr: 0 = WARN, 1 = +INFO, 2 = +TRACE. Call before `init`.
    pub fn set_verbosity(verbosity: u8) {
        // SAFETY: writes one int in the shim; no pointers involved.
        unsafe { shim_set_verbosity(c_int::from(verbosity)) }
    }

    /// dlopens `path` and looks up `ncclNetPlugin_v{version}` (9..=12).
    pub fn open(path: &Path, version: u32) -> Result<Self, NetError> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| NetError::Load(format!("{}: path contains a NUL byte", path.display())))?;
        let version_c = c_int::try_from(version).map_err(|_| NetError::Load(format!("ABI version {version}")))?;
        let mut err = [0 as c_char; 512];
        // SAFETY: c_path is NUL-terminated; err is a writable buffer of the length passed.
        let raw = unsafe { shim_open(c_path.as_ptr(), version_c, err.as_mut_ptr(), err.len()) };
        let shim = NonNull::new(raw).ok_or_else(|| NetError::Load(c_chars_to_string(&err)))?;
        // SAFETY: shim is open; shim_name returns a NUL-terminated string owned by the plugin (or "").
        let name = unsafe { CStr::from_ptr(shim_name(shim.as_ptr())) }.to_string_lossy().into_owned();
        Ok(Self { shim, path: path.to_path_buf(), version, name, initialised: false })
    }

    /// The table's `name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The path it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The ABI version in use.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// `init` (v11/v12 get `comm_id` as the communicator hash).
    pub fn init(&mut self, comm_id: u64) -> Result<(), NetError> {
        // SAFETY: the shim is open; the logger and config it passes are its own statics/stack.
        check("init", unsafe { shim_init(self.shim.as_ptr(), comm_id) })?;
        self.initialised = true;
        Ok(())
    }

    /// `devices`.
    pub fn devices(&self) -> Result<usize, NetError> {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer.
        check("devices", unsafe { shim_devices(self.shim.as_ptr(), &mut n) })?;
        usize::try_from(n).map_err(|_| NetError::Plugin { call: "devices", code: n })
    }

    /// `getProperties(dev)`.
    pub fn properties(&self, dev: usize) -> Result<DeviceProps, NetError> {
        let dev_c = c_int::try_from(dev).map_err(|_| NetError::Protocol(format!("device {dev}")))?;
        // SAFETY: ShimProps is plain old data; all-zero is a valid value.
        let mut p: ShimProps = unsafe { std::mem::zeroed() };
        // SAFETY: p is a valid, writable shim_props_t.
        check("getProperties", unsafe { shim_get_props(self.shim.as_ptr(), dev_c, &mut p) })?;
        Ok(DeviceProps {
            dev,
            name: c_chars_to_string(&p.name),
            pci_path: c_chars_to_string(&p.pci_path),
            guid: p.guid,
            speed_mbps: p.speed_mbps,
            port: p.port,
            ptr_support: p.ptr_support,
            reg_is_global: p.reg_is_global,
            latency_us: p.latency_us,
            max_comms: p.max_comms,
            max_recvs: p.max_recvs,
            max_p2p_bytes: p.max_p2p_bytes,
            rail_id: p.rail_id,
        })
    }

    /// `finalize` (v11/v12) after a successful `init`.
    pub fn finalize(&mut self) -> Result<(), NetError> {
        if !self.initialised {
            return Ok(());
        }
        self.initialised = false;
        // SAFETY: the shim is open and was initialised.
        check("finalize", unsafe { shim_finalize(self.shim.as_ptr()) })
    }

    fn raw(&self) -> *mut ShimRaw {
        self.shim.as_ptr()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        // Errors here have no one left to report to; `ShimTransport::close` reports them on the normal path.
        let _ = self.finalize();
        // SAFETY: the shim is open and nothing uses it after this point (all comms belong to a
        // ShimTransport that owns this Plugin and closes its comms first).
        unsafe { shim_close(self.shim.as_ptr()) };
    }
}

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

struct OpenReq {
    raw: *mut c_void,
}

/// A [`Transport`] over a real plugin: one send comm per peer this rank sends to, one recv comm per
/// peer it receives from.
pub struct ShimTransport {
    // Declared first so it drops first: finalize and dlclose before the pool's memory is freed.
    plugin: Plugin,
    rank: usize,
    nranks: usize,
    send_comms: Vec<(usize, *mut c_void)>,
    recv_comms: Vec<(usize, *mut c_void)>,
    /// Per buffer: the memory handle for each send comm, then for each recv comm (same order).
    mhandles: Vec<Vec<*mut c_void>>,
    open: HashMap<ReqId, OpenReq>,
    next_req: u64,
    closed: bool,
    pool: Pool,
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
        let shim = t.plugin.raw();
        // Listen comms, kept until their accept completes (and closed on every path).
        let mut listens: Vec<(usize, *mut c_void)> = Vec::new();
        let result = (|| {
            let mut mine = Vec::new();
            for &peer in recv_peers {
                let mut handle = [0u8; HANDLE_BYTES];
                let mut lc: *mut c_void = std::ptr::null_mut();
                // SAFETY: handle has HANDLE_BYTES writable bytes; lc is a valid out-pointer.
                check("listen", unsafe { shim_listen(shim, dev_c, handle.as_mut_ptr().cast(), &mut lc) })?;
                if lc.is_null() {
                    return Err(NetError::Protocol("listen succeeded with a NULL listenComm".into()));
                }
                listens.push((peer, lc));
                mine.push((peer, handle.to_vec()));
            }
            let theirs = exchange(mine).map_err(NetError::Exchange)?;
            let mut handles: Vec<(usize, [u8; HANDLE_BYTES])> = Vec::new();
            for &peer in send_peers {
                let h = theirs.iter().find(|(p, _)| *p == peer).ok_or_else(|| NetError::Exchange(format!("no handle from peer {peer}")))?;
                let h: [u8; HANDLE_BYTES] =
                    h.1.as_slice()
                        .try_into()
                        .map_err(|_| NetError::Exchange(format!("handle from peer {peer} has {} bytes, not {HANDLE_BYTES}", h.1.len())))?;
                handles.push((peer, h));
            }
            let start = Instant::now();
            let mut accepted: Vec<usize> = Vec::new();
            loop {
                let mut progress = false;
                for (peer, handle) in handles.iter_mut() {
                    if t.send_comms.iter().any(|(p, _)| p == peer) {
                        continue;
                    }
                    let mut sc: *mut c_void = std::ptr::null_mut();
                    // SAFETY: handle is the same HANDLE_BYTES buffer on every retry, as NCCL does.
                    check("connect", unsafe { shim_connect(shim, dev_c, handle.as_mut_ptr().cast(), &mut sc) })?;
                    if !sc.is_null() {
                        t.send_comms.push((*peer, sc));
                        progress = true;
                    }
                }
                for &(peer, lc) in &listens {
                    if accepted.contains(&peer) {
                        continue;
                    }
                    let mut rc: *mut c_void = std::ptr::null_mut();
                    // SAFETY: lc is a live listen comm from listen above.
                    check("accept", unsafe { shim_accept(shim, lc, &mut rc) })?;
                    if !rc.is_null() {
                        t.recv_comms.push((peer, rc));
                        accepted.push(peer);
                        progress = true;
                    }
                }
                if t.send_comms.len() == handles.len() && accepted.len() == listens.len() {
                    break;
                }
                if !progress {
                    if start.elapsed() > timeout {
                        let mut pending: Vec<String> = handles
                            .iter()
                            .filter(|(p, _)| !t.send_comms.iter().any(|(q, _)| q == p))
                            .map(|(p, _)| format!("connect to rank {p}"))
                            .collect();
                        pending.extend(listens.iter().filter(|(p, _)| !accepted.contains(p)).map(|(p, _)| format!("accept from rank {p}")));
                        return Err(NetError::ConnectTimeout { secs: start.elapsed().as_secs_f64(), pending: pending.join(", ") });
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
            Ok(())
        })();
        // NCCL closes a listen comm right after its accept; here all accepts are done (or failed).
        let mut close_err = Ok(());
        for (_, lc) in listens {
            // SAFETY: lc is a live listen comm, closed exactly once.
            let r = check("closeListen", unsafe { shim_close_listen(shim, lc) });
            if close_err.is_ok() {
                close_err = r;
            }
        }
        result?;
        close_err?;
        Ok(t)
    }

    /// The plugin this transport drives.
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    fn comm(&self, dir: &'static str, peer: usize) -> Result<(usize, *mut c_void), NetError> {
        let (list, offset) = match dir {
            "send" => (&self.send_comms, 0),
            _ => (&self.recv_comms, self.send_comms.len()),
        };
        list.iter().position(|(p, _)| *p == peer).map(|i| (offset + i, list[i].1)).ok_or(NetError::NoComm { dir, peer })
    }

    fn post(&mut self, dir: &'static str, peer: usize, region: Region) -> Result<Option<ReqId>, NetError> {
        let (mh_index, comm) = self.comm(dir, peer)?;
        let mh = *self
            .mhandles
            .get(region.buf.0)
            .and_then(|v| v.get(mh_index))
            .ok_or(NetError::OutOfBounds { region, buf_len: self.pool.buf_len(region.buf) })?;
        let data = self.pool.raw(region)?;
        let id = ReqId(self.next_req);
        let is_recv = dir == "recv";
        self.pool.claim(id, region, is_recv)?;
        // Tags as NCCL sets them: the sender's rank on both sides.
        let tag = c_int::try_from(if is_recv { peer } else { self.rank }).unwrap_or(c_int::MAX);
        let mut req: *mut c_void = std::ptr::null_mut();
        let shim = self.plugin.raw();
        // SAFETY: comm and mh are live handles from this plugin; data..data+bytes lies inside a pool
        // buffer registered as mh, and stays claimed (untouchable by Rust code) until the request completes.
        let code = unsafe {
            if is_recv {
                shim_irecv(shim, comm, data, region.bytes(), tag, mh, &mut req)
            } else {
                shim_isend(shim, comm, data, region.bytes(), tag, mh, &mut req)
            }
        };
        if code != 0 || req.is_null() {
            self.pool.release(id);
            check(if is_recv { "irecv" } else { "isend" }, code)?;
            return Ok(None);
        }
        self.next_req += 1;
        self.open.insert(id, OpenReq { raw: req });
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
        let shim = self.plugin.raw();
        let mut first: Result<(), NetError> = Ok(());
        let mut keep = |r: Result<(), NetError>| {
            if first.is_ok() {
                first = r;
            }
        };
        if !self.open.is_empty() {
            keep(Err(NetError::Protocol(format!("closing with {} requests still outstanding", self.open.len()))));
        }
        let comms: Vec<*mut c_void> = self.send_comms.iter().chain(self.recv_comms.iter()).map(|(_, c)| *c).collect();
        for per_buf in std::mem::take(&mut self.mhandles) {
            for (mh, comm) in per_buf.into_iter().zip(&comms) {
                if !mh.is_null() {
                    // SAFETY: mh was registered on comm and is deregistered once.
                    keep(check("deregMr", unsafe { shim_dereg_mr(shim, *comm, mh) }));
                }
            }
        }
        for (_, c) in std::mem::take(&mut self.send_comms) {
            // SAFETY: c is a live send comm, closed once.
            keep(check("closeSend", unsafe { shim_close_send(shim, c) }));
        }
        for (_, c) in std::mem::take(&mut self.recv_comms) {
            // SAFETY: c is a live recv comm, closed once.
            keep(check("closeRecv", unsafe { shim_close_recv(shim, c) }));
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
        let (data, bytes) = self.pool.raw_whole(id)?;
        let shim = self.plugin.raw();
        let mut per_comm = Vec::new();
        for &(_, comm) in self.send_comms.iter().chain(self.recv_comms.iter()) {
            let mut mh: *mut c_void = std::ptr::null_mut();
            if bytes > 0 {
                // SAFETY: data..data+bytes is the freshly allocated buffer; comm is live; mh is an out-pointer.
                let code = unsafe { shim_reg_mr(shim, comm, data, bytes, &mut mh) };
                if code != 0 {
                    // Keep what was registered so teardown deregisters it.
                    self.mhandles.push(per_comm);
                    return Err(NetError::Plugin { call: "regMr", code });
                }
            }
            per_comm.push(mh);
        }
        self.mhandles.push(per_comm);
        debug_assert_eq!(self.mhandles.len(), id.0 + 1);
        Ok(id)
    }

    fn isend(&mut self, peer: usize, region: Region) -> Result<Option<ReqId>, NetError> {
        self.post("send", peer, region)
    }

    fn irecv(&mut self, peer: usize, region: Region) -> Result<Option<ReqId>, NetError> {
        self.post("recv", peer, region)
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        let open = self.open.get(&req).ok_or(NetError::UnknownRequest(req))?;
        let mut done: c_int = 0;
        let mut size: c_int = 0;
        // SAFETY: open.raw is a request the plugin returned and has not reported done yet.
        let code = unsafe { shim_test(self.plugin.raw(), open.raw, &mut done, &mut size) };
        if code != 0 {
            return Err(NetError::Plugin { call: "test", code });
        }
        if done == 0 {
            return Ok(None);
        }
        self.open.remove(&req);
        self.pool.release(req);
        usize::try_from(size).map(Some).map_err(|_| NetError::Protocol(format!("test reported size {size}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coll::{self, Buffers, Collective, ExecConfig};
    use crate::data;
    use crate::rendezvous::Rendezvous;
    use serde_json::{json, Value};

    /// The reference plugin build.rs compiles from csrc/testnet.c.
    fn test_plugin() -> PathBuf {
        Path::new(env!("OUT_DIR")).join("libprism-testnet.so")
    }

    #[test]
    fn every_abi_version_loads_and_reports_its_own_properties_layout() {
        for abi in 9..=12 {
            let mut p = Plugin::open(&test_plugin(), abi).unwrap();
            assert_eq!((p.name(), p.version()), ("testnet", abi));
            p.init(42).unwrap();
            assert_eq!(p.devices().unwrap(), 2);
            let d1 = p.properties(1).unwrap();
            assert_eq!((d1.name.as_str(), d1.speed_mbps, d1.ptr_support, d1.max_recvs), ("testnet1", 100000, 1, 1));
            assert_eq!(d1.max_p2p_bytes, 1 << 40, "abi {abi}: maxP2pBytes read from the right offset");
            // railId exists only in v12's struct.
            assert_eq!(d1.rail_id, if abi == 12 { 1 } else { -1 }, "abi {abi}");
            p.finalize().unwrap();
        }
    }

    #[test]
    fn a_missing_library_is_a_load_error_naming_the_path() {
        let err = Plugin::open(Path::new("./no-such-plugin.so"), 12).err().unwrap().to_string();
        assert!(err.contains("no-such-plugin.so"), "{err}");
    }

    #[test]
    fn a_device_the_plugin_does_not_have_is_its_error_not_a_crash() {
        let mut p = Plugin::open(&test_plugin(), 12).unwrap();
        p.init(1).unwrap();
        let err = p.properties(7).unwrap_err().to_string();
        assert!(err.contains("getProperties") && err.contains("ncclInvalidArgument"), "{err}");
    }

    fn run_through_plugin(abi: u32, coll: Collective, n: usize, bytes: usize) -> Vec<usize> {
        let listener = Rendezvous::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let mut listener = Some(listener);
        let threads: Vec<_> = (0..n)
            .map(|rank| {
                let listener = listener.take();
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let timeout = Duration::from_secs(20);
                    let mut rv = match listener {
                        Some(l) => Rendezvous::serve(l, n, timeout).unwrap(),
                        None => Rendezvous::join(&addr, rank, n, timeout).unwrap(),
                    };
                    let mut plugin = Plugin::open(&test_plugin(), abi).unwrap();
                    plugin.init(7).unwrap();
                    let (send_peers, recv_peers) = coll.peers(rank, n);
                    let exchange = Box::new(|mine: Vec<(usize, Vec<u8>)>| {
                        let all = rv.allgather(json!(mine)).map_err(|e| e.to_string())?;
                        let mut theirs = Vec::new();
                        for &p in &send_peers {
                            let list: Vec<(usize, Vec<u8>)> = serde_json::from_value(all[p].clone()).map_err(|e| e.to_string())?;
                            let h = list.into_iter().find(|(q, _)| *q == rank).ok_or("no handle")?;
                            theirs.push((p, h.1));
                        }
                        Ok(theirs)
                    });
                    let place = Place { dev: 1, rank, nranks: n };
                    let mut t = ShimTransport::establish(plugin, place, &send_peers, &recv_peers, exchange, timeout).unwrap();
                    let counts = coll.counts(bytes, n);
                    let bufs = Buffers::alloc(&mut t, coll, counts).unwrap();
                    let p = coll::plan(coll, rank, n, counts, bufs, 100);
                    let exec = ExecConfig { window: 4, max_inflight: 32, timeout };
                    for pass in 0..2 {
                        data::prepare(&mut t, bufs, counts, pass).unwrap();
                        coll::execute(&mut t, &p, &exec).unwrap();
                    }
                    let wrong = data::count_wrong(&t, coll, bufs, counts, 1).unwrap();
                    rv.allgather(Value::Null).unwrap();
                    t.close().unwrap();
                    wrong
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("rank thread")).collect()
    }

    #[test]
    fn collectives_are_exact_through_the_shim_for_every_abi_version() {
        for abi in 9..=12 {
            for coll in [Collective::AllReduce, Collective::AllToAll] {
                assert_eq!(run_through_plugin(abi, coll, 3, 4 * 1003), vec![0, 0, 0], "abi {abi} {}", coll.name());
            }
        }
    }

    #[test]
    fn every_collective_is_exact_through_the_shim() {
        for coll in Collective::ALL {
            assert_eq!(run_through_plugin(12, coll, 2, 4 * 777), vec![0, 0], "{}", coll.name());
        }
    }

    fn pool_with(len: usize) -> (Pool, BufId) {
        let mut pool = Pool::new();
        let b = pool.alloc(len).unwrap();
        (pool, b)
    }

    #[test]
    fn a_region_a_posted_receive_uses_cannot_be_read_or_written() {
        let (mut pool, b) = pool_with(100);
        pool.claim(ReqId(1), Region::new(b, 10, 10), true).unwrap();
        assert!(matches!(pool.read(Region::new(b, 15, 10)), Err(NetError::Busy(_))));
        assert!(matches!(pool.write(Region::new(b, 0, 11)), Err(NetError::Busy(_))));
        assert!(pool.read(Region::new(b, 20, 10)).is_ok(), "the bytes next to it are free");
        pool.release(ReqId(1));
        assert!(pool.write(Region::new(b, 10, 10)).is_ok());
    }

    #[test]
    fn a_region_a_posted_send_uses_can_be_read_but_not_written_or_received_into() {
        let (mut pool, b) = pool_with(100);
        pool.claim(ReqId(1), Region::new(b, 0, 50), false).unwrap();
        assert!(pool.read(Region::new(b, 0, 50)).is_ok());
        pool.claim(ReqId(2), Region::new(b, 0, 50), false).unwrap();
        assert!(matches!(pool.write(Region::new(b, 49, 1)), Err(NetError::Busy(_))));
        assert!(matches!(pool.claim(ReqId(3), Region::new(b, 40, 20), true), Err(NetError::Busy(_))));
        assert!(!pool.is_idle(Region::new(b, 40, 20)));
    }

    #[test]
    fn regions_outside_their_buffer_are_refused() {
        let (mut pool, b) = pool_with(10);
        assert!(matches!(pool.read(Region::new(b, 5, 6)), Err(NetError::OutOfBounds { .. })));
        assert!(matches!(pool.claim(ReqId(1), Region::new(b, usize::MAX, 2), true), Err(NetError::OutOfBounds { .. })));
        assert!(pool.read(Region::new(b, 10, 0)).is_ok(), "an empty region at the end is in bounds");
    }

    #[test]
    fn a_sum_into_a_region_reads_a_disjoint_one() {
        let (mut pool, b) = pool_with(8);
        pool.write(Region::new(b, 0, 8)).unwrap().copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0]);
        pool.add_assign(Region::new(b, 0, 4), Region::new(b, 4, 4)).unwrap();
        assert_eq!(pool.read(Region::new(b, 0, 4)).unwrap(), &[11.0, 22.0, 33.0, 44.0]);
        assert!(matches!(pool.add_assign(Region::new(b, 0, 4), Region::new(b, 2, 4)), Err(NetError::Overlap(..))));
    }
}
