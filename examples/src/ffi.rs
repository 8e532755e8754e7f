//! Every `unsafe` line of prism-perf, behind safe wrappers.
//!
//! prism-perf drives a plugin through its C ABI (the C shim `csrc/netshim.c` dlopens the `.so` and
//! calls its `ncclNetPlugin_vN` table), and the plugin's threads read and write host buffers whose
//! addresses we hand it. Both need `unsafe`: the `extern "C"` calls into the shim, and host memory that
//! Rust code and the plugin share. ARCHITECTURE allows `unsafe` in prism-perf only here, so the rest of
//! the crate is safe code over:
//! - [`HostBuf`]: page-aligned, zeroed host memory with bounds-checked slices and addresses. Whether a
//!   slice may be taken while a posted request uses those bytes is decided by its only owner,
//!   [`crate::net::Pool`], which refuses any region a posted request still uses (the contract every
//!   slice method states);
//! - [`Shim`]: one loaded plugin; each method is one shim call returning the plugin's result code.
//!   Handles ([`Comm`], [`MemHandle`], [`Request`]) are opaque; the wrappers must be given handles this
//!   shim returned and not yet closed, which `crate::net::ShimTransport` keeps (each closed once,
//!   requests tested until done).

use std::alloc::{self, Layout};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;
use std::ptr::NonNull;

/// Bytes of a connection handle (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_BYTES: usize = 128;

/// Bytes of one `f32` element.
const ELEM: usize = std::mem::size_of::<f32>();

/// Page-aligned host memory of `f32` elements; the plugin gets addresses into it.
pub struct HostBuf {
    ptr: NonNull<f32>,
    len: usize,
}

impl HostBuf {
    // Page alignment, like NCCL's own host buffers; some transports register whole pages.
    const ALIGN: usize = 4096;

    /// `len` zeroed elements, or (as the error) the bytes that could not be allocated.
    pub fn new(len: usize) -> Result<Self, usize> {
        if len == 0 {
            return Ok(Self { ptr: NonNull::dangling(), len });
        }
        let bytes = len.checked_mul(ELEM).ok_or(usize::MAX)?;
        let layout = Layout::from_size_align(bytes, Self::ALIGN).map_err(|_| bytes)?;
        // SAFETY: the layout has a non-zero size (len > 0); zeroed memory is a valid [f32].
        let raw = unsafe { alloc::alloc_zeroed(layout) }.cast::<f32>();
        NonNull::new(raw).map(|ptr| Self { ptr, len }).ok_or(bytes)
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn in_bounds(&self, start: usize, len: usize) -> bool {
        start.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// The address of element `start` (`start <= len`), for the plugin.
    fn addr(&self, start: usize) -> *mut c_void {
        assert!(start <= self.len, "address {start} outside a buffer of {} elements", self.len);
        // SAFETY: start <= len, so the offset stays inside (or one past) the allocation.
        unsafe { self.ptr.as_ptr().add(start) }.cast()
    }

    /// Elements `start..start + len` (panics when out of bounds). Contract: no posted receive writes
    /// them while the slice lives (the owning `Pool` checks its claims before calling).
    pub fn slice(&self, start: usize, len: usize) -> &[f32] {
        assert!(self.in_bounds(start, len), "{start}+{len} outside a buffer of {} elements", self.len);
        // SAFETY: in bounds; the plugin writes only regions of posted receives, which the caller (the
        // owning Pool) has checked these elements are not; `&self` rules out a Rust writer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) }
    }

    /// Elements `start..start + len`, mutable (panics when out of bounds). Contract: no posted request
    /// uses them while the slice lives (checked by the owning `Pool`).
    pub fn slice_mut(&mut self, start: usize, len: usize) -> &mut [f32] {
        assert!(self.in_bounds(start, len), "{start}+{len} outside a buffer of {} elements", self.len);
        // SAFETY: in bounds; no posted request (hence no plugin thread) touches these elements (checked
        // by the owning Pool) and `&mut self` rules out any other Rust borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), len) }
    }

    /// `dst` elements mutable and `src` elements shared, of one buffer or of two (`other`); the two
    /// ranges must not overlap when in one buffer (panics otherwise, or when out of bounds). Contract:
    /// no posted request uses `dst`, no posted receive writes `src` (checked by the owning `Pool`).
    pub fn split_write_read<'a>(
        &'a mut self,
        dst: (usize, usize),
        other: Option<&'a HostBuf>,
        src: (usize, usize),
    ) -> (&'a mut [f32], &'a [f32]) {
        let (s, src_ok) = match other {
            Some(o) => (o.ptr, o.in_bounds(src.0, src.1)),
            None => (self.ptr, self.in_bounds(src.0, src.1)),
        };
        assert!(self.in_bounds(dst.0, dst.1) && src_ok, "range outside its buffer");
        if other.is_none() {
            assert!(dst.1 == 0 || src.1 == 0 || dst.0 + dst.1 <= src.0 || src.0 + src.1 <= dst.0, "overlapping ranges");
        }
        // SAFETY: both in bounds and disjoint (checked above, or in different allocations); dst has no
        // pending use and src no pending writer (the owning Pool's checks); `&mut self` and the shared
        // borrow of `other` rule out other Rust borrows for the lifetime of both slices.
        unsafe {
            (std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(dst.0), dst.1), std::slice::from_raw_parts(s.as_ptr().add(src.0), src.1))
        }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            let layout = Layout::from_size_align(self.len * ELEM, Self::ALIGN).expect("layout was valid at alloc");
            // SAFETY: allocated in `new` with this very layout and not freed since.
            unsafe { alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
        }
    }
}

// SAFETY: a HostBuf owns its allocation; the only other party holding its address is the plugin, whose
// accesses are confined to regions marked pending in the owning Pool.
unsafe impl Send for HostBuf {}

#[repr(C)]
struct ShimRaw {
    _private: [u8; 0],
}

/// Mirror of `shim_props_t` in `csrc/netshim.h`.
#[repr(C)]
pub struct ShimProps {
    /// `name`, NUL-terminated.
    pub name: [c_char; 64],
    /// `pciPath`, NUL-terminated.
    pub pci_path: [c_char; 256],
    /// `guid`.
    pub guid: u64,
    /// `ptrSupport`.
    pub ptr_support: c_int,
    /// `regIsGlobal`.
    pub reg_is_global: c_int,
    /// `forceFlush`.
    pub force_flush: c_int,
    /// `speed`, Mbps.
    pub speed_mbps: c_int,
    /// `port`.
    pub port: c_int,
    /// `latency`, µs.
    pub latency_us: f32,
    /// `maxComms`.
    pub max_comms: c_int,
    /// `maxRecvs`.
    pub max_recvs: c_int,
    /// `netDeviceType`.
    pub net_device_type: c_int,
    /// `netDeviceVersion`.
    pub net_device_version: c_int,
    /// `vProps.ndevs`.
    pub vdev_count: c_int,
    /// `maxP2pBytes`.
    pub max_p2p_bytes: usize,
    /// `maxMultiRequestSize`.
    pub max_multi_request_size: c_int,
    /// `railId` (v12).
    pub rail_id: c_int,
    /// `planeId` (v12).
    pub plane_id: c_int,
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

/// A listen, send or receive comm of the plugin (`NULL` until a connect or accept completes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Comm(*mut c_void);

/// A memory registration of the plugin (`NULL` for an empty buffer, never registered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemHandle(*mut c_void);

/// A posted request of the plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request(*mut c_void);

impl Comm {
    /// Whether the plugin returned no comm (yet).
    pub fn is_null(self) -> bool {
        self.0.is_null()
    }
}

impl MemHandle {
    /// No registration.
    pub const NONE: Self = Self(std::ptr::null_mut());

    /// Whether this is no registration.
    pub fn is_null(self) -> bool {
        self.0.is_null()
    }
}

/// A NUL-terminated C string in a fixed array, as text (lossy).
pub fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A plugin dlopened by the shim; closed (dlclose) on drop.
pub struct Shim {
    raw: NonNull<ShimRaw>,
}

/// Which plugin log lines reach stderr: 0 = WARN, 1 = +INFO, 2 = +TRACE.
pub fn set_verbosity(verbosity: u8) {
    // SAFETY: writes one int in the shim; no pointers involved.
    unsafe { shim_set_verbosity(c_int::from(verbosity)) }
}

impl Shim {
    /// dlopens `path` and looks up `ncclNetPlugin_v{version}`; the error is the shim's message.
    pub fn open(path: &Path, version: c_int) -> Result<Self, String> {
        let c_path =
            CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| format!("{}: path contains a NUL byte", path.display()))?;
        let mut err = [0 as c_char; 512];
        // SAFETY: c_path is NUL-terminated; err is a writable buffer of the length passed.
        let raw = unsafe { shim_open(c_path.as_ptr(), version, err.as_mut_ptr(), err.len()) };
        NonNull::new(raw).map(|raw| Self { raw }).ok_or_else(|| c_chars_to_string(&err))
    }

    /// The table's `name`.
    pub fn name(&self) -> String {
        // SAFETY: the shim is open; shim_name returns a NUL-terminated string owned by the plugin (or "").
        unsafe { CStr::from_ptr(shim_name(self.raw.as_ptr())) }.to_string_lossy().into_owned()
    }

    /// `init`.
    pub fn init(&self, comm_id: u64) -> c_int {
        // SAFETY: the shim is open; the logger and config it passes are its own statics/stack.
        unsafe { shim_init(self.raw.as_ptr(), comm_id) }
    }

    /// `devices`: (result, device count).
    pub fn devices(&self) -> (c_int, c_int) {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer.
        let code = unsafe { shim_devices(self.raw.as_ptr(), &mut n) };
        (code, n)
    }

    /// `getProperties(dev)`: (result, the properties; all zero on an error).
    pub fn properties(&self, dev: c_int) -> (c_int, ShimProps) {
        // SAFETY: ShimProps is plain old data; all-zero is a valid value.
        let mut p: ShimProps = unsafe { std::mem::zeroed() };
        // SAFETY: p is a valid, writable shim_props_t.
        let code = unsafe { shim_get_props(self.raw.as_ptr(), dev, &mut p) };
        (code, p)
    }

    /// `listen(dev)`: writes the connection handle into `handle`.
    pub fn listen(&self, dev: c_int, handle: &mut [u8; HANDLE_BYTES]) -> (c_int, Comm) {
        let mut lc: *mut c_void = std::ptr::null_mut();
        // SAFETY: handle has HANDLE_BYTES writable bytes; lc is a valid out-pointer.
        let code = unsafe { shim_listen(self.raw.as_ptr(), dev, handle.as_mut_ptr().cast(), &mut lc) };
        (code, Comm(lc))
    }

    /// `connect(dev, handle)`: a null comm means "call again" (with the same handle, as NCCL does).
    pub fn connect(&self, dev: c_int, handle: &mut [u8; HANDLE_BYTES]) -> (c_int, Comm) {
        let mut sc: *mut c_void = std::ptr::null_mut();
        // SAFETY: handle is a writable HANDLE_BYTES buffer, the same one on every retry; sc is an out-pointer.
        let code = unsafe { shim_connect(self.raw.as_ptr(), dev, handle.as_mut_ptr().cast(), &mut sc) };
        (code, Comm(sc))
    }

    /// `accept(listen)`: a null comm means "call again".
    pub fn accept(&self, listen: Comm) -> (c_int, Comm) {
        let mut rc: *mut c_void = std::ptr::null_mut();
        // SAFETY: listen is a live listen comm of this shim (the caller's contract); rc is an out-pointer.
        let code = unsafe { shim_accept(self.raw.as_ptr(), listen.0, &mut rc) };
        (code, Comm(rc))
    }

    /// `regMr` of the whole of `buf` on `comm` (not called for an empty buffer).
    pub fn reg_mr(&self, comm: Comm, buf: &HostBuf) -> (c_int, MemHandle) {
        let mut mh: *mut c_void = std::ptr::null_mut();
        // SAFETY: addr(0)..+len*ELEM is buf's allocation, which outlives the registration (the Pool owning
        // it is dropped after the transport deregisters); comm is live; mh is an out-pointer.
        let code = unsafe { shim_reg_mr(self.raw.as_ptr(), comm.0, buf.addr(0), buf.len() * ELEM, &mut mh) };
        (code, MemHandle(mh))
    }

    /// `deregMr` of a registration of `comm`.
    pub fn dereg_mr(&self, comm: Comm, mh: MemHandle) -> c_int {
        // SAFETY: mh was registered on comm and is deregistered once (the caller's contract).
        unsafe { shim_dereg_mr(self.raw.as_ptr(), comm.0, mh.0) }
    }

    /// `isend` (`recv == false`) or `irecv` of elements `start..start + len` of `buf`, registered as `mh`
    /// on `comm`: a null request means "try again later". Contract: the range stays claimed in the
    /// owning Pool (untouchable by Rust code) until `test` reports the request done.
    #[allow(clippy::too_many_arguments)]
    pub fn post(
        &self,
        recv: bool,
        comm: Comm,
        buf: &HostBuf,
        start: usize,
        len: usize,
        tag: c_int,
        mh: MemHandle,
    ) -> (c_int, Option<Request>) {
        assert!(buf.in_bounds(start, len), "{start}+{len} outside a buffer of {} elements", buf.len());
        let data = buf.addr(start);
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: comm and mh are live handles of this shim; data..data+len*ELEM lies inside buf (checked
        // above), registered as mh, and stays claimed until the request completes (the caller's contract).
        let code = unsafe {
            if recv {
                shim_irecv(self.raw.as_ptr(), comm.0, data, len * ELEM, tag, mh.0, &mut req)
            } else {
                shim_isend(self.raw.as_ptr(), comm.0, data, len * ELEM, tag, mh.0, &mut req)
            }
        };
        (code, (!req.is_null()).then_some(Request(req)))
    }

    /// `test(req)`: (result, done, size).
    pub fn test(&self, req: Request) -> (c_int, bool, c_int) {
        let mut done: c_int = 0;
        let mut size: c_int = 0;
        // SAFETY: req is a request this shim returned that has not reported done yet (the caller's contract).
        let code = unsafe { shim_test(self.raw.as_ptr(), req.0, &mut done, &mut size) };
        (code, done != 0, size)
    }

    /// `closeSend`.
    pub fn close_send(&self, comm: Comm) -> c_int {
        // SAFETY: comm is a live send comm, closed once (the caller's contract).
        unsafe { shim_close_send(self.raw.as_ptr(), comm.0) }
    }

    /// `closeRecv`.
    pub fn close_recv(&self, comm: Comm) -> c_int {
        // SAFETY: comm is a live recv comm, closed once (the caller's contract).
        unsafe { shim_close_recv(self.raw.as_ptr(), comm.0) }
    }

    /// `closeListen`.
    pub fn close_listen(&self, comm: Comm) -> c_int {
        // SAFETY: comm is a live listen comm, closed once (the caller's contract).
        unsafe { shim_close_listen(self.raw.as_ptr(), comm.0) }
    }

    /// `finalize`.
    pub fn finalize(&self) -> c_int {
        // SAFETY: the shim is open.
        unsafe { shim_finalize(self.raw.as_ptr()) }
    }
}

impl Drop for Shim {
    fn drop(&mut self) {
        // SAFETY: the shim is open and nothing uses it after this point (every comm belongs to a
        // ShimTransport that owns the Plugin owning this Shim, and closes its comms first).
        unsafe { shim_close(self.raw.as_ptr()) };
    }
}
