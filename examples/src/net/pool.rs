//! A rank's host buffers and which of their regions posted requests still use.

use super::{NetError, ReqId, ELEM_BYTES};
use crate::ffi::HostBuf;

/// A buffer of a [`Pool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufId(pub(super) usize);

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
        self.bufs.push(HostBuf::new(len).map_err(|bytes| NetError::OutOfMemory { bytes })?);
        Ok(BufId(self.bufs.len() - 1))
    }

    /// Elements in `buf` (0 for an unknown id).
    pub fn buf_len(&self, buf: BufId) -> usize {
        self.bufs.get(buf.0).map_or(0, |b| b.len())
    }

    /// The buffer of `region` once the region is known to lie inside it.
    pub(super) fn check(&self, region: Region) -> Result<&HostBuf, NetError> {
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
        Ok(b.slice(region.start, region.len))
    }

    /// Writes a region no pending request uses.
    pub fn write(&mut self, region: Region) -> Result<&mut [f32], NetError> {
        self.check(region)?;
        self.writable(region)?;
        Ok(self.bufs[region.buf.0].slice_mut(region.start, region.len))
    }

    /// Writes `dst` while reading `src`; the two must not overlap.
    pub fn write_read(&mut self, dst: Region, src: Region) -> Result<(&mut [f32], &[f32]), NetError> {
        if dst.overlaps(&src) {
            return Err(NetError::Overlap(dst, src));
        }
        self.check(dst)?;
        self.check(src)?;
        self.writable(dst)?;
        self.readable(src)?;
        let (d, s) = ((dst.start, dst.len), (src.start, src.len));
        let (i, j) = (dst.buf.0, src.buf.0);
        if i == j {
            return Ok(self.bufs[i].split_write_read(d, None, s));
        }
        // Two different buffers: borrow one mutably and the other shared.
        let (dst_buf, src_buf) = if i < j {
            let (lo, hi) = self.bufs.split_at_mut(j);
            (&mut lo[i], &hi[0])
        } else {
            let (lo, hi) = self.bufs.split_at_mut(i);
            (&mut hi[0], &lo[j])
        };
        Ok(dst_buf.split_write_read(d, Some(src_buf), s))
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

    /// The buffer `buf`, for registering it or posting a region of it (checked by the caller).
    pub(super) fn host_buf(&self, buf: BufId) -> Option<&HostBuf> {
        self.bufs.get(buf.0)
    }
}
