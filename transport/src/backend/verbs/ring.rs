//! A registered ring of fixed-size slots (send and receive slots of a QP).

use std::sync::Arc;

use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::AccessFlags;

use super::device::VerbsDevice;
use super::{VerbsError, SLOT_BYTES};

// ---------------------------------------------------------------------------------------------
// Rings and QPs.

/// A registered array of fixed-size slots.
pub(super) struct Ring {
    // The MR goes first: it must be deregistered before the memory is freed.
    pub(super) mr: Arc<MemoryRegion>,
    pub(super) buf: Box<[u8]>,
}

impl Ring {
    pub(super) fn new(dev: &VerbsDevice, slots: usize) -> Result<Self, VerbsError> {
        let mut buf = vec![0u8; slots * SLOT_BYTES].into_boxed_slice();
        let addr = buf.as_mut_ptr() as usize;
        let access = AccessFlags::LocalWrite;
        // SAFETY: `buf` is heap memory owned by this Ring and outlives `mr` (field order); the device
        // writes into it only through receive WQEs this backend posts, one slot each.
        let mr = unsafe { dev.pd.reg_mr(addr, buf.len(), access) };
        let mr = vtry!(mr, "ibv_reg_mr(ring)")?;
        Ok(Self { mr, buf })
    }

    pub(super) fn addr(&self, slot: usize) -> u64 {
        self.buf.as_ptr() as u64 + (slot * SLOT_BYTES) as u64
    }

    pub(super) fn slot(&self, slot: usize) -> &[u8] {
        &self.buf[slot * SLOT_BYTES..(slot + 1) * SLOT_BYTES]
    }

    pub(super) fn slot_mut(&mut self, slot: usize) -> &mut [u8] {
        &mut self.buf[slot * SLOT_BYTES..(slot + 1) * SLOT_BYTES]
    }
}
