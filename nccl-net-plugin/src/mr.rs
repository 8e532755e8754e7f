//! Memory registration (`regMr`, `regMrDmaBuf`, `deregMr`).
//!
//! The UDP engine copies through the CPU, so registering host memory only records the range; the
//! handle lets `isend`/`irecv` check that a buffer lies inside memory NCCL registered. On the verbs
//! backend the range is also registered with every RDMA device (through the engine's cache, shared
//! by repeated registrations of one buffer) and deregistered when the handle is dropped. GPU memory needs
//! GPUDirect RDMA, which this build does not have: such registrations fail with a clear reason (the
//! device properties do not announce `NCCL_PTR_CUDA`, so NCCL only asks during its GDR probe).

use crate::abi::{PTR_CUDA, PTR_DMABUF, PTR_HOST};
use crate::error::{invalid, PluginError};
use crate::handle::Kind;

/// A registered range of host memory.
#[derive(Debug)]
pub struct MemRegion {
    base: usize,
    len: usize,
    engine: Option<EngineMr>,
}

/// The engine that registered the range with its RDMA devices (verbs backend).
pub struct EngineMr(pub std::sync::Arc<crate::global::NetState>);

impl std::fmt::Debug for EngineMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineMr")
    }
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        if let Some(EngineMr(net)) = &self.engine {
            net.net.dereg_mr(self.base, self.len);
        }
    }
}

impl Kind for MemRegion {
    const MAGIC: u64 = 0x5052_4953_4D4D_5248; // "PRISMMRH"
    const NAME: &'static str = "memory handle";
}

/// The message NCCL gets for GPU memory.
pub const CUDA_UNSUPPORTED: &str = "CUDA buffers need GPUDirect support, not in this build";

impl MemRegion {
    /// Checks a `regMr` request: `kind` is the `NCCL_PTR_*` type, `data`/`len` the range.
    pub fn register(data: usize, len: usize, kind: i32) -> Result<Self, PluginError> {
        if kind & (PTR_CUDA | PTR_DMABUF) != 0 {
            return Err(PluginError::Unsupported(format!("regMr type {kind:#x}: {CUDA_UNSUPPORTED}")));
        }
        if kind != PTR_HOST {
            return Err(invalid(format!("regMr type {kind:#x} is not NCCL_PTR_HOST")));
        }
        if data == 0 && len > 0 {
            return Err(invalid(format!("regMr of {len} bytes at NULL")));
        }
        if data.checked_add(len).is_none() {
            return Err(invalid(format!("regMr range {data:#x} + {len} wraps around the address space")));
        }
        Ok(Self { base: data, len, engine: None })
    }

    /// Register the range with the engine's RDMA devices (verbs backend; nothing on UDP). The memory
    /// must stay mapped until this region is dropped, as NCCL's contract for `regMr` promises.
    pub fn register_with(&mut self, net: std::sync::Arc<crate::global::NetState>) -> Result<(), PluginError> {
        if net.net.backend() != "verbs" || self.len == 0 {
            return Ok(());
        }
        net.net.reg_mr(self.base, self.len)?;
        self.engine = Some(EngineMr(net));
        Ok(())
    }

    /// Checks that `data..data + len` lies inside the region. An empty range is always fine: nothing of
    /// it is ever read or written.
    pub fn check_covers(&self, data: usize, len: usize) -> Result<(), PluginError> {
        if len == 0 {
            return Ok(());
        }
        let inside = data >= self.base && data.checked_add(len).is_some_and(|end| end <= self.base + self.len);
        if inside {
            Ok(())
        } else {
            Err(invalid(format!("buffer {data:#x} + {len} lies outside its memory handle's range {:#x} + {}", self.base, self.len)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_registers() {
        assert!(MemRegion::register(0x1000, 4096, PTR_HOST).is_ok());
    }

    #[test]
    fn cuda_memory_is_refused_with_an_internal_error_that_says_why() {
        let err = MemRegion::register(0x1000, 4096, PTR_CUDA).unwrap_err();
        assert_eq!(err.code(), 3);
        assert!(err.to_string().contains(CUDA_UNSUPPORTED), "{err}");
    }

    #[test]
    fn an_unknown_memory_type_is_refused() {
        assert!(MemRegion::register(0x1000, 4096, 0x40).is_err());
    }

    #[test]
    fn null_with_a_size_is_refused_and_an_empty_null_range_is_fine() {
        assert!(MemRegion::register(0, 16, PTR_HOST).is_err());
        assert!(MemRegion::register(0, 0, PTR_HOST).is_ok());
    }

    #[test]
    fn a_wrapping_range_is_refused() {
        assert!(MemRegion::register(usize::MAX - 10, 100, PTR_HOST).is_err());
    }

    #[test]
    fn a_buffer_inside_the_region_passes_and_one_crossing_its_end_fails() {
        let mr = MemRegion::register(0x1000, 0x100, PTR_HOST).unwrap();
        assert!(mr.check_covers(0x1000, 0x100).is_ok());
        assert!(mr.check_covers(0x1080, 0x80).is_ok());
        assert!(mr.check_covers(0x1080, 0x81).is_err());
        assert!(mr.check_covers(0x0fff, 2).is_err());
        assert!(mr.check_covers(usize::MAX, 2).is_err());
    }

    #[test]
    fn an_empty_buffer_passes_anywhere() {
        let mr = MemRegion::register(0x1000, 0x100, PTR_HOST).unwrap();
        assert!(mr.check_covers(0, 0).is_ok());
    }
}
