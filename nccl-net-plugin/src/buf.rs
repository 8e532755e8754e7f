//! The engine's view of NCCL's buffers: [`SendBuf`] and [`RecvBuf`] over a raw pointer and a length.
//!
//! These are the only places that read or write NCCL's memory. Both re-check every range against the
//! posted length before touching memory, whatever the engine promised, and panic (caught at the C
//! boundary) rather than read or write outside it.

use prism_transport::engine::{RecvBuf, SendBuf};

/// A message NCCL posted with `isend`.
#[derive(Debug)]
pub struct HostSendBuf {
    ptr: *const u8,
    len: usize,
}

/// A buffer NCCL posted with `irecv`.
#[derive(Debug)]
pub struct HostRecvBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer belongs to NCCL, which keeps it alive and leaves it alone until `test` reports the
// request done (or the comm is closed, which drops the engine's copy of this object first). Nothing in
// it is tied to the posting thread, so the engine may touch it from whichever thread calls `test`.
unsafe impl Send for HostSendBuf {}
// SAFETY: as for HostSendBuf; the receive buffer is written only through `&mut self`.
unsafe impl Send for HostRecvBuf {}

impl HostSendBuf {
    /// Wraps `len` bytes at `ptr`.
    ///
    /// # Safety
    /// If `len > 0`, `ptr` must be valid for reads of `len` bytes until the request completes or its
    /// comm is closed, and nobody may write those bytes meanwhile. `ptr` may be null only if `len == 0`.
    pub unsafe fn new(ptr: *const u8, len: usize) -> Self {
        debug_assert!(len == 0 || !ptr.is_null());
        Self { ptr, len }
    }
}

impl HostRecvBuf {
    /// Wraps `len` writable bytes at `ptr`.
    ///
    /// # Safety
    /// If `len > 0`, `ptr` must be valid for writes of `len` bytes until the request completes or its
    /// comm is closed, and nobody else may access those bytes meanwhile. `ptr` may be null only if
    /// `len == 0`.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        debug_assert!(len == 0 || !ptr.is_null());
        Self { ptr, len }
    }
}

/// Panics unless `offset..offset + n` lies within `0..len`.
fn check_range(what: &str, offset: usize, n: usize, len: usize) {
    let end = offset.checked_add(n);
    assert!(
        matches!(end, Some(e) if e <= len),
        "engine asked to {what} {n} bytes at offset {offset} of a {len}-byte buffer"
    );
}

impl SendBuf for HostSendBuf {
    fn len(&self) -> usize {
        self.len
    }

    fn addr(&self) -> Option<usize> {
        Some(self.ptr as usize)
    }

    fn read(&self, offset: usize, out: &mut [u8]) {
        check_range("read", offset, out.len(), self.len);
        if out.is_empty() {
            return;
        }
        // SAFETY: the range is inside the posted buffer (checked above, and non-empty so len > 0 and ptr
        // is non-null), which `new`'s contract keeps valid for reads; `out` is Rust memory and cannot
        // overlap NCCL's read-only message.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), out.len()) };
    }
}

impl RecvBuf for HostRecvBuf {
    fn len(&self) -> usize {
        self.len
    }

    fn addr(&self) -> Option<usize> {
        Some(self.ptr as usize)
    }

    fn write(&mut self, offset: usize, data: &[u8]) {
        check_range("write", offset, data.len(), self.len);
        if data.is_empty() {
            return;
        }
        // SAFETY: the range is inside the posted buffer (checked above, and non-empty so len > 0 and ptr
        // is non-null), which `new`'s contract keeps valid and exclusive for writes; `data` is the
        // engine's packet memory, never NCCL's receive buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_buffer_reads_the_requested_window() {
        let src: Vec<u8> = (0..100u8).collect();
        // SAFETY: `src` outlives `buf` and is not written meanwhile.
        let buf = unsafe { HostSendBuf::new(src.as_ptr(), src.len()) };
        let mut out = [0u8; 10];
        buf.read(90, &mut out);
        assert_eq!(out.to_vec(), (90..100u8).collect::<Vec<_>>());
    }

    #[test]
    fn a_receive_buffer_writes_only_the_requested_window() {
        let mut dst = vec![0xEEu8; 16];
        // SAFETY: `dst` outlives `buf` and is only accessed through it meanwhile.
        let mut buf = unsafe { HostRecvBuf::new(dst.as_mut_ptr(), 8) };
        buf.write(4, &[1, 2, 3, 4]);
        assert_eq!(dst, [0xEE, 0xEE, 0xEE, 0xEE, 1, 2, 3, 4, 0xEE, 0xEE, 0xEE, 0xEE, 0xEE, 0xEE, 0xEE, 0xEE]);
    }

    #[test]
    fn a_write_past_the_posted_length_panics_before_touching_memory() {
        let mut dst = vec![0xEEu8; 16];
        // SAFETY: `dst` outlives `buf` and is only accessed through it meanwhile.
        let mut buf = unsafe { HostRecvBuf::new(dst.as_mut_ptr(), 8) };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| buf.write(6, &[1, 2, 3])));
        assert!(r.is_err());
        assert!(dst.iter().all(|&b| b == 0xEE), "{dst:?}");
    }

    #[test]
    fn an_offset_that_overflows_panics() {
        let src = [0u8; 4];
        // SAFETY: `src` outlives `buf`.
        let buf = unsafe { HostSendBuf::new(src.as_ptr(), 4) };
        let r = std::panic::catch_unwind(|| buf.read(usize::MAX, &mut [0u8; 2]));
        assert!(r.is_err());
    }

    #[test]
    fn an_empty_buffer_may_be_null() {
        // SAFETY: len 0 allows a null pointer.
        let mut buf = unsafe { HostRecvBuf::new(std::ptr::null_mut(), 0) };
        buf.write(0, &[]);
        assert_eq!(RecvBuf::len(&buf), 0);
    }
}
