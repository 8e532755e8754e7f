//! CTS (clear to send): the receiver posted a grouped receive of `n` buffers; the sender may now send
//! that many messages into them. Resent until the sender's `cts_ack` (common header) covers `cts_seq`.
//!
//! Layout (big-endian; the first 20 bytes are the common header of [`super::header`]):
//! ```text
//!  0..20   common header, type 2; flags: bit 0 KEYS (verbs backend: remote keys follow the entries)
//! 20..28   cts_seq      sequence number of this grouped receive (0, 1, 2, ... per connection)
//! 28       n            number of buffers, 1..=8
//! 29..32   reserved     sent as 0, ignored
//! 32..     n entries of 12 bytes: size (u64, bytes the buffer holds), tag (i32, NCCL's tag)
//! with KEYS only (the verbs backend), right after the entries:
//!   r      rails        number of rkeys per buffer, 1..=16 (one per rail: every rail has its own PD)
//!   3      reserved     sent as 0, ignored
//!   n times: addr (u64, the buffer's registered address), then r rkeys (u32 each, rail order)
//! ```
//! The datagram ends right after the last entry (or the last key). The UDP backend never sets KEYS.

use super::field::{put_u32, put_u64, u32_at, u64_at};
use super::header::{self, Header, PacketType, HEADER_LEN};
use super::{WireError, MAX_RECV_BUFS};

/// Bytes before the first buffer entry.
pub const CTS_FIXED_LEN: usize = 32;
/// Bytes of one buffer entry.
pub const CTS_ENTRY_LEN: usize = 12;
/// Bytes of the largest CTS without keys (eight buffers).
pub const CTS_MAX_LEN: usize = CTS_FIXED_LEN + MAX_RECV_BUFS * CTS_ENTRY_LEN;
/// Header flag: remote keys follow the entries.
pub const FLAG_KEYS: u16 = 1 << 0;
/// Most rails a keyed CTS describes.
pub const CTS_MAX_KEY_RAILS: usize = 16;
/// Bytes of the largest keyed CTS (eight buffers, sixteen rails).
pub const CTS_KEYED_MAX_LEN: usize = CTS_MAX_LEN + 4 + MAX_RECV_BUFS * (8 + 4 * CTS_MAX_KEY_RAILS);

/// Bytes of a keyed CTS's key block for `n` buffers and `rails` rails.
pub const fn keys_len(n: usize, rails: usize) -> usize {
    4 + n * (8 + 4 * rails)
}

const SEQ: usize = HEADER_LEN;
const N: usize = 28;

/// A checked view of a CTS packet.
#[derive(Debug, Clone)]
pub struct CtsPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> CtsPacket<T> {
    /// A view without checks; accessors panic on a buffer shorter than the fields they read.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer holding exactly one CTS of a supported version with 1..=8 entries.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        header::check(b, PacketType::Cts, CTS_FIXED_LEN)?;
        let n = b[N] as usize;
        if n == 0 || n > MAX_RECV_BUFS {
            return Err(WireError::BadField { field: "n", value: n as u64 });
        }
        let mut need = CTS_FIXED_LEN + n * CTS_ENTRY_LEN;
        if header::Header::new_unchecked(b).flags() & FLAG_KEYS != 0 {
            if b.len() < need + 4 {
                return Err(WireError::Truncated { need: need + 4, have: b.len() });
            }
            let rails = b[need] as usize;
            if rails == 0 || rails > CTS_MAX_KEY_RAILS {
                return Err(WireError::BadField { field: "rails", value: rails as u64 });
            }
            need += keys_len(n, rails);
        }
        if b.len() < need {
            return Err(WireError::Truncated { need, have: b.len() });
        }
        if b.len() > need {
            return Err(WireError::TrailingBytes { expected: need, actual: b.len() });
        }
        Ok(Self { buffer })
    }

    /// The common header.
    pub fn header(&self) -> Header<&[u8]> {
        Header::new_unchecked(self.buffer.as_ref())
    }

    /// Sequence number of the grouped receive.
    pub fn cts_seq(&self) -> u64 {
        u64_at(self.buffer.as_ref(), SEQ)
    }

    /// Number of buffers.
    pub fn n(&self) -> u8 {
        self.buffer.as_ref()[N]
    }

    /// Buffer entry `i` (size, tag).
    pub fn entry(&self, i: usize) -> CtsBuf {
        let at = CTS_FIXED_LEN + i * CTS_ENTRY_LEN;
        let b = self.buffer.as_ref();
        CtsBuf { size: u64_at(b, at), tag: u32_at(b, at + 8) as i32 }
    }

    /// The key block, when the KEYS flag is set (the view checked its length).
    pub fn keys(&self) -> Option<CtsKeys> {
        let b = self.buffer.as_ref();
        if self.header().flags() & FLAG_KEYS == 0 {
            return None;
        }
        let n = self.n() as usize;
        let at = CTS_FIXED_LEN + n * CTS_ENTRY_LEN;
        let rails = b[at] as usize;
        let mut k = CtsKeys { rails: rails as u8, ..CtsKeys::default() };
        for i in 0..n {
            let e = at + 4 + i * (8 + 4 * rails);
            k.addr[i] = u64_at(b, e);
            for r in 0..rails {
                k.rkey[i][r] = u32_at(b, e + 8 + 4 * r);
            }
        }
        Some(k)
    }
}

/// Where the buffers of a CTS live for RDMA WRITE (verbs backend): per buffer, its registered
/// address and one rkey per rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CtsKeys {
    /// Rails (rkeys per buffer), 1..=16.
    pub rails: u8,
    /// Registered address of each buffer.
    pub addr: [u64; MAX_RECV_BUFS],
    /// rkey of each buffer on each rail.
    pub rkey: [[u32; CTS_MAX_KEY_RAILS]; MAX_RECV_BUFS],
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CtsPacket<T> {
    /// The common header, writable.
    pub fn header_mut(&mut self) -> Header<&mut [u8]> {
        Header::new_unchecked(self.buffer.as_mut())
    }
}

/// One posted buffer as announced by a CTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CtsBuf {
    /// Bytes the buffer holds.
    pub size: u64,
    /// NCCL tag the matching send must carry.
    pub tag: i32,
}

/// A parsed CTS. The entries live in a fixed array so parsing never allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CtsRepr {
    /// Destination connection token.
    pub token: u64,
    /// CTS acknowledgement of the packet's sender.
    pub cts_ack: u64,
    /// Sequence number of this grouped receive.
    pub cts_seq: u64,
    /// Number of valid entries in `bufs` (1..=8).
    pub n: u8,
    /// The buffers; entries at and beyond `n` are unused (zero).
    pub bufs: [CtsBuf; MAX_RECV_BUFS],
    /// Remote keys (verbs backend only); `None` on the UDP backend.
    pub keys: Option<CtsKeys>,
}

impl CtsRepr {
    /// A CTS for the given buffers (at most [`MAX_RECV_BUFS`]; more are an error).
    pub fn new(token: u64, cts_ack: u64, cts_seq: u64, bufs: &[CtsBuf]) -> Result<Self, WireError> {
        if bufs.is_empty() || bufs.len() > MAX_RECV_BUFS {
            return Err(WireError::BadField { field: "n", value: bufs.len() as u64 });
        }
        let mut arr = [CtsBuf::default(); MAX_RECV_BUFS];
        arr[..bufs.len()].copy_from_slice(bufs);
        Ok(Self { token, cts_ack, cts_seq, n: bufs.len() as u8, bufs: arr, keys: None })
    }

    /// The valid entries.
    pub fn bufs(&self) -> &[CtsBuf] {
        &self.bufs[..self.n as usize]
    }

    /// Parse a CTS (the view already checked `n` and the length).
    pub fn parse<T: AsRef<[u8]>>(p: &CtsPacket<T>) -> Result<Self, WireError> {
        let n = p.n() as usize;
        if n == 0 || n > MAX_RECV_BUFS {
            return Err(WireError::BadField { field: "n", value: n as u64 });
        }
        let mut bufs = [CtsBuf::default(); MAX_RECV_BUFS];
        for (i, b) in bufs.iter_mut().enumerate().take(n) {
            *b = p.entry(i);
        }
        let keys = p.keys();
        Ok(Self { token: p.header().token(), cts_ack: p.header().cts_ack(), cts_seq: p.cts_seq(), n: n as u8, bufs, keys })
    }

    /// Bytes of the whole packet.
    pub fn buffer_len(&self) -> usize {
        let keys = self.keys.map_or(0, |k| keys_len(self.n as usize, k.rails as usize));
        CTS_FIXED_LEN + self.n as usize * CTS_ENTRY_LEN + keys
    }

    /// Write the packet; the buffer must hold at least `buffer_len()` bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut CtsPacket<T>) {
        let flags = if self.keys.is_some() { FLAG_KEYS } else { 0 };
        p.header_mut().emit(PacketType::Cts, flags, self.token, self.cts_ack);
        let b = p.buffer.as_mut();
        put_u64(b, SEQ, self.cts_seq);
        b[N] = self.n;
        b[N + 1..CTS_FIXED_LEN].fill(0);
        for (i, e) in self.bufs().iter().enumerate() {
            let at = CTS_FIXED_LEN + i * CTS_ENTRY_LEN;
            put_u64(b, at, e.size);
            put_u32(b, at + 8, e.tag as u32);
        }
        if let Some(k) = &self.keys {
            let n = self.n as usize;
            let rails = (k.rails as usize).clamp(1, CTS_MAX_KEY_RAILS);
            let at = CTS_FIXED_LEN + n * CTS_ENTRY_LEN;
            b[at] = rails as u8;
            b[at + 1..at + 4].fill(0);
            for i in 0..n {
                let e = at + 4 + i * (8 + 4 * rails);
                put_u64(b, e, k.addr[i]);
                for r in 0..rails {
                    put_u32(b, e + 8 + 4 * r, k.rkey[i][r]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CtsRepr {
        CtsRepr::new(9, 2, 41, &[CtsBuf { size: 1 << 33, tag: -5 }, CtsBuf { size: 0, tag: 7 }]).unwrap()
    }

    fn emit(r: &CtsRepr) -> Vec<u8> {
        let mut buf = vec![0u8; r.buffer_len()];
        r.emit(&mut CtsPacket::new_unchecked(&mut buf[..]));
        buf
    }

    #[test]
    fn cts_round_trips_with_negative_tags() {
        let buf = emit(&sample());
        assert_eq!(buf.len(), 56);
        assert_eq!(CtsRepr::parse(&CtsPacket::new_checked(&buf[..]).unwrap()).unwrap(), sample());
    }

    #[test]
    fn cts_length_must_match_its_entry_count() {
        let mut buf = emit(&sample());
        assert_eq!(CtsPacket::new_checked(&buf[..55]).err(), Some(WireError::Truncated { need: 56, have: 55 }));
        buf.push(0);
        assert_eq!(CtsPacket::new_checked(&buf[..]).err(), Some(WireError::TrailingBytes { expected: 56, actual: 57 }));
    }

    fn keyed() -> CtsRepr {
        let mut k = CtsKeys { rails: 2, ..CtsKeys::default() };
        k.addr[0] = 0x7f00_1234_5000;
        k.addr[1] = 0x7f00_1234_9000;
        k.rkey[0][..2].copy_from_slice(&[0x11, 0x21]);
        k.rkey[1][..2].copy_from_slice(&[0x12, 0x22]);
        CtsRepr { keys: Some(k), ..sample() }
    }

    #[test]
    fn keyed_cts_round_trips_addresses_and_per_rail_rkeys() {
        let buf = emit(&keyed());
        assert_eq!(buf.len(), 56 + keys_len(2, 2));
        assert_eq!(buf.len(), 56 + 4 + 2 * 16);
        let back = CtsRepr::parse(&CtsPacket::new_checked(&buf[..]).unwrap()).unwrap();
        assert_eq!(back, keyed());
        assert_eq!(back.keys.unwrap().rkey[1][1], 0x22);
    }

    #[test]
    fn keyed_cts_length_and_rail_count_are_checked() {
        let buf = emit(&keyed());
        let n = buf.len();
        assert_eq!(CtsPacket::new_checked(&buf[..n - 1]).err(), Some(WireError::Truncated { need: n, have: n - 1 }));
        assert_eq!(CtsPacket::new_checked(&buf[..57]).err(), Some(WireError::Truncated { need: 60, have: 57 }));
        let mut bad = buf.clone();
        bad[56] = 0;
        assert_eq!(CtsPacket::new_checked(&bad[..]).err(), Some(WireError::BadField { field: "rails", value: 0 }));
        bad[56] = 17;
        assert_eq!(CtsPacket::new_checked(&bad[..]).err(), Some(WireError::BadField { field: "rails", value: 17 }));
        // Without the flag the keys are trailing garbage.
        let mut unflagged = buf;
        Header::new_unchecked(&mut unflagged[..]).set_flags(0);
        assert_eq!(CtsPacket::new_checked(&unflagged[..]).err(), Some(WireError::TrailingBytes { expected: 56, actual: n }));
    }

    #[test]
    fn unkeyed_cts_has_no_keys() {
        let buf = emit(&sample());
        assert_eq!(CtsPacket::new_checked(&buf[..]).unwrap().keys(), None);
    }

    #[test]
    fn cts_entry_count_is_one_to_eight() {
        let mut buf = emit(&sample());
        buf[N] = 0;
        assert_eq!(CtsPacket::new_checked(&buf[..]).err(), Some(WireError::BadField { field: "n", value: 0 }));
        buf[N] = 9;
        assert_eq!(CtsPacket::new_checked(&buf[..]).err(), Some(WireError::BadField { field: "n", value: 9 }));
        assert!(CtsRepr::new(1, 0, 0, &[CtsBuf::default(); 9]).is_err());
    }
}
