//! What the rail and split layers answer for a message: a plan of chunks (rail, uplink, sub-flow,
//! offset, length). The path layer then picks an entropy for every packet of every chunk.

use serde::Serialize;

/// One message the transport wants to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendReq {
    /// Destination host id (an index into the topology's hosts, or any stable id when hosts are not listed).
    pub dst_host: usize,
    /// Message length in bytes.
    pub len: u64,
    /// Stable id of the connection (hashed by `PRISM_RAIL=hash`).
    pub flow: u64,
    /// The rail the connection was opened on (used by `PRISM_RAIL=single`).
    pub home_rail: u16,
}

/// A contiguous byte range of one message and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Chunk {
    /// Rail (local NIC and, by rail alignment, remote NIC) carrying the chunk.
    pub rail: u16,
    /// The uplink the split layer pinned this chunk to, or `None` when the path layer may use any entropy.
    /// Pass it to [`crate::PathPolicy::pick_for`].
    pub uplink: Option<u16>,
    /// Sub-flow index within this message on this rail (0 when the message is not split).
    pub subflow: u16,
    /// Byte offset of the chunk in the message.
    pub offset: u64,
    /// Length in bytes, never 0 and never above the configured chunk size.
    pub len: u32,
    /// Ethereal's desynchronisation: wait this long (µs, from planning time) before the chunk's first
    /// packet. Zero for every other split policy.
    pub start_after_us: u32,
}

/// The chunks of one message, in the order the transport should send them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// Every byte of the message is in exactly one chunk.
    pub chunks: Vec<Chunk>,
}

impl Plan {
    /// Sum of the chunk lengths (equals the message length).
    pub fn total_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len as u64).sum()
    }

    /// Bytes per rail, indexed by rail, for `rails` rails.
    pub fn bytes_per_rail(&self, rails: u16) -> Vec<u64> {
        let mut v = vec![0u64; rails as usize];
        for c in &self.chunks {
            if let Some(b) = v.get_mut(c.rail as usize) {
                *b += c.len as u64;
            }
        }
        v
    }
}

/// A message that cannot be planned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// The destination (or this process's own) host id is not in the topology.
    #[error("host {host} is not in the topology (it lists {known} hosts); check PRISM_TOPO")]
    UnknownHost {
        /// The host id that was asked for.
        host: usize,
        /// How many hosts the topology lists.
        known: usize,
    },
}

/// The `(offset, len)` pieces of cutting `len` bytes into chunks of `chunk` bytes (the last may be shorter).
pub(crate) fn cut(len: u64, chunk: u32) -> impl Iterator<Item = (u64, u32)> {
    let chunk = chunk.max(1) as u64;
    (0..len.div_ceil(chunk)).map(move |i| {
        let off = i * chunk;
        (off, (len - off).min(chunk) as u32)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cutting_covers_the_message_with_one_short_tail() {
        let v: Vec<_> = cut(100, 32).collect();
        assert_eq!(v, vec![(0, 32), (32, 32), (64, 32), (96, 4)]);
        assert_eq!(cut(0, 32).count(), 0);
        assert_eq!(cut(64, 32).count(), 2);
    }
}
