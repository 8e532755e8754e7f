//! DATA: a piece of one message, placed by the receiver at `offset` of the buffer the CTS named.
//!
//! Layout (big-endian; the first 20 bytes are the common header of [`super::header`]):
//! ```text
//!  0..20   common header, type 1; flags: bit 0 TRUNC, bit 1 CE, bit 2 RETX
//! 20..28   psn          packet sequence number (per connection, never wraps)
//! 28..36   cts_seq      sequence number of the CTS (grouped receive) this message matched
//! 36..44   offset       byte offset of the payload within the message
//! 44..52   total_len    length of the whole message (the send's size)
//! 52..56   len          payload bytes in this packet
//! 56..58   entropy      the path (entropy index) this copy was sent on
//! 58       sub          index of the buffer within the grouped receive (0..8)
//! 59       reserved     sent as 0, ignored
//! 60..64   ts_us        sender's clock in µs (low 32 bits) when this copy was sent, echoed by SACK
//! 64..     payload      exactly `len` bytes; the datagram ends there
//! ```
//! Invariants checked by [`DataRepr::parse`]: `sub < 8`, `offset + len <= total_len`, and a TRUNC
//! packet carries no payload and starts at offset 0. TRUNC marks a send larger than the matched buffer:
//! it ends that buffer (the receive fails `Truncated`) without writing anything. CE is set by the network
//! (or the driver, from an ECN mark); RETX marks a retransmitted copy.

use super::field::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use super::header::{self, Header, PacketType, HEADER_LEN};
use super::{WireError, MAX_RECV_BUFS};

/// Bytes before the payload.
pub const DATA_HEADER_LEN: usize = 64;

/// Flag: the send does not fit the matched buffer; this packet ends that buffer.
pub const FLAG_TRUNC: u16 = 1 << 0;
/// Flag: the network saw congestion on this packet's path (ECN CE or a simulated mark).
pub const FLAG_CE: u16 = 1 << 1;
/// Flag: this copy is a retransmission.
pub const FLAG_RETX: u16 = 1 << 2;

const PSN: usize = HEADER_LEN;
const CTS_SEQ: usize = 28;
const OFFSET: usize = 36;
const TOTAL_LEN: usize = 44;
const LEN: usize = 52;
const ENTROPY: usize = 56;
const SUB: usize = 58;
const RESERVED: usize = 59;
const TS: usize = 60;

/// A checked view of a DATA packet.
#[derive(Debug, Clone)]
pub struct DataPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> DataPacket<T> {
    /// A view without checks; accessors panic on a buffer shorter than the fields they read.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer holding exactly one DATA packet of a supported version: header present and
    /// the datagram exactly `DATA_HEADER_LEN + len` bytes long.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        header::check(b, PacketType::Data, DATA_HEADER_LEN)?;
        let len = u32_at(b, LEN) as usize;
        let need = DATA_HEADER_LEN + len;
        if b.len() < need {
            return Err(WireError::Truncated { need, have: b.len() });
        }
        if b.len() > need {
            return Err(WireError::TrailingBytes { expected: need, actual: b.len() });
        }
        Ok(Self { buffer })
    }

    /// A view of a DATA header sent without its payload (verbs backend: the payload went ahead as
    /// an RDMA WRITE): exactly `DATA_HEADER_LEN` bytes, whatever `len` says.
    pub fn new_checked_header(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        header::check(b, PacketType::Data, DATA_HEADER_LEN)?;
        if b.len() > DATA_HEADER_LEN {
            return Err(WireError::TrailingBytes { expected: DATA_HEADER_LEN, actual: b.len() });
        }
        Ok(Self { buffer })
    }

    /// The common header.
    pub fn header(&self) -> Header<&[u8]> {
        Header::new_unchecked(self.buffer.as_ref())
    }

    /// Packet sequence number.
    pub fn psn(&self) -> u64 {
        u64_at(self.buffer.as_ref(), PSN)
    }

    /// CTS sequence number of the grouped receive.
    pub fn cts_seq(&self) -> u64 {
        u64_at(self.buffer.as_ref(), CTS_SEQ)
    }

    /// Byte offset of the payload within the message.
    pub fn offset(&self) -> u64 {
        u64_at(self.buffer.as_ref(), OFFSET)
    }

    /// Length of the whole message.
    pub fn total_len(&self) -> u64 {
        u64_at(self.buffer.as_ref(), TOTAL_LEN)
    }

    /// Payload bytes.
    pub fn len(&self) -> u32 {
        u32_at(self.buffer.as_ref(), LEN)
    }

    /// True when the packet carries no payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entropy (path index) this copy was sent on.
    pub fn entropy(&self) -> u16 {
        u16_at(self.buffer.as_ref(), ENTROPY)
    }

    /// Index of the buffer within the grouped receive.
    pub fn sub(&self) -> u8 {
        self.buffer.as_ref()[SUB]
    }

    /// Sender's timestamp (µs, low 32 bits).
    pub fn ts_us(&self) -> u32 {
        u32_at(self.buffer.as_ref(), TS)
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        let end = (DATA_HEADER_LEN + self.len() as usize).min(b.len());
        &b[DATA_HEADER_LEN..end]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DataPacket<T> {
    /// The common header, writable.
    pub fn header_mut(&mut self) -> Header<&mut [u8]> {
        Header::new_unchecked(self.buffer.as_mut())
    }

    /// The payload area (everything after the header), writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[DATA_HEADER_LEN..]
    }
}

/// A parsed DATA header (the payload stays in the packet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataRepr {
    /// Destination connection token.
    pub token: u64,
    /// CTS acknowledgement of the packet's sender (see [`super::header`]).
    pub cts_ack: u64,
    /// Packet sequence number.
    pub psn: u64,
    /// CTS sequence number of the grouped receive the message matched.
    pub cts_seq: u64,
    /// Buffer index within the grouped receive.
    pub sub: u8,
    /// Byte offset of the payload within the message.
    pub offset: u64,
    /// Payload bytes.
    pub len: u32,
    /// Length of the whole message.
    pub total_len: u64,
    /// Entropy this copy was sent on.
    pub entropy: u16,
    /// Sender's timestamp, µs (low 32 bits).
    pub ts_us: u32,
    /// The send is larger than the matched buffer; this packet ends the buffer.
    pub trunc: bool,
    /// Congestion experienced on the way.
    pub ce: bool,
    /// This copy is a retransmission.
    pub retx: bool,
}

impl DataRepr {
    /// Parse and check a DATA header.
    pub fn parse<T: AsRef<[u8]>>(p: &DataPacket<T>) -> Result<Self, WireError> {
        let flags = p.header().flags();
        let repr = Self {
            token: p.header().token(),
            cts_ack: p.header().cts_ack(),
            psn: p.psn(),
            cts_seq: p.cts_seq(),
            sub: p.sub(),
            offset: p.offset(),
            len: p.len(),
            total_len: p.total_len(),
            entropy: p.entropy(),
            ts_us: p.ts_us(),
            trunc: flags & FLAG_TRUNC != 0,
            ce: flags & FLAG_CE != 0,
            retx: flags & FLAG_RETX != 0,
        };
        if repr.sub as usize >= MAX_RECV_BUFS {
            return Err(WireError::BadField { field: "sub", value: repr.sub.into() });
        }
        let in_range = repr.offset.checked_add(repr.len.into()).is_some_and(|end| end <= repr.total_len);
        if !in_range {
            return Err(WireError::BadRange { offset: repr.offset, len: repr.len.into(), limit: repr.total_len });
        }
        if repr.trunc && (repr.len != 0 || repr.offset != 0) {
            return Err(WireError::BadRange { offset: repr.offset, len: repr.len.into(), limit: 0 });
        }
        Ok(repr)
    }

    /// Bytes of the whole packet, payload included.
    pub fn buffer_len(&self) -> usize {
        DATA_HEADER_LEN + self.len as usize
    }

    /// Write the header fields; the caller writes the `len` payload bytes into `payload_mut()`.
    /// The buffer must hold at least [`DATA_HEADER_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut DataPacket<T>) {
        let flags =
            (if self.trunc { FLAG_TRUNC } else { 0 }) | (if self.ce { FLAG_CE } else { 0 }) | (if self.retx { FLAG_RETX } else { 0 });
        p.header_mut().emit(PacketType::Data, flags, self.token, self.cts_ack);
        let b = p.buffer.as_mut();
        put_u64(b, PSN, self.psn);
        put_u64(b, CTS_SEQ, self.cts_seq);
        put_u64(b, OFFSET, self.offset);
        put_u64(b, TOTAL_LEN, self.total_len);
        put_u32(b, LEN, self.len);
        put_u16(b, ENTROPY, self.entropy);
        b[SUB] = self.sub;
        b[RESERVED] = 0;
        put_u32(b, TS, self.ts_us);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_header_without_its_payload_parses_only_through_the_header_view() {
        let r = sample();
        assert!(r.len > 0);
        let mut buf = vec![0u8; r.buffer_len()];
        r.emit(&mut DataPacket::new_unchecked(&mut buf[..]));
        let head = &buf[..DATA_HEADER_LEN];
        assert!(DataPacket::new_checked(head).is_err());
        let p = DataPacket::new_checked_header(head).unwrap();
        assert_eq!(DataRepr::parse(&p).unwrap(), r);
        assert!(p.payload().is_empty());
        assert_eq!(
            DataPacket::new_checked_header(&buf[..DATA_HEADER_LEN + 1]).err(),
            Some(WireError::TrailingBytes { expected: DATA_HEADER_LEN, actual: DATA_HEADER_LEN + 1 })
        );
        assert!(DataPacket::new_checked_header(&buf[..DATA_HEADER_LEN - 1]).is_err());
    }

    pub(crate) fn sample() -> DataRepr {
        DataRepr {
            token: 0x0102_0304_0506_0708,
            cts_ack: 5,
            psn: 1 << 40,
            cts_seq: 4,
            sub: 7,
            offset: 4096,
            len: 3,
            total_len: 4099,
            entropy: 15,
            ts_us: 123_456,
            trunc: false,
            ce: false,
            retx: true,
        }
    }

    fn emit(repr: &DataRepr, payload: &[u8]) -> Vec<u8> {
        let mut buf = vec![0u8; repr.buffer_len()];
        let mut p = DataPacket::new_unchecked(&mut buf[..]);
        repr.emit(&mut p);
        p.payload_mut()[..payload.len()].copy_from_slice(payload);
        buf
    }

    #[test]
    fn data_round_trips_with_its_payload() {
        let buf = emit(&sample(), b"abc");
        let p = DataPacket::new_checked(&buf[..]).unwrap();
        assert_eq!(DataRepr::parse(&p).unwrap(), sample());
        assert_eq!(p.payload(), b"abc");
    }

    #[test]
    fn data_layout_is_big_endian_at_the_documented_offsets() {
        let buf = emit(&sample(), b"abc");
        assert_eq!(&buf[20..28], &(1u64 << 40).to_be_bytes());
        assert_eq!(&buf[52..56], &3u32.to_be_bytes());
        assert_eq!(&buf[56..58], &15u16.to_be_bytes());
        assert_eq!(buf[58], 7);
        assert_eq!(&buf[64..], b"abc");
    }

    #[test]
    fn datagram_length_must_match_the_payload_length() {
        let mut buf = emit(&sample(), b"abc");
        assert_eq!(DataPacket::new_checked(&buf[..buf.len() - 1]).err(), Some(WireError::Truncated { need: 67, have: 66 }));
        buf.push(0);
        assert_eq!(DataPacket::new_checked(&buf[..]).err(), Some(WireError::TrailingBytes { expected: 67, actual: 68 }));
    }

    #[test]
    fn payload_must_lie_inside_the_message() {
        let buf = emit(&DataRepr { offset: 4097, ..sample() }, b"abc");
        let p = DataPacket::new_checked(&buf[..]).unwrap();
        assert_eq!(DataRepr::parse(&p).err(), Some(WireError::BadRange { offset: 4097, len: 3, limit: 4099 }));
        let buf = emit(&DataRepr { offset: u64::MAX - 1, total_len: u64::MAX, ..sample() }, b"abc");
        assert!(matches!(DataRepr::parse(&DataPacket::new_checked(&buf[..]).unwrap()), Err(WireError::BadRange { .. })));
    }

    #[test]
    fn sub_index_must_name_one_of_eight_buffers() {
        let buf = emit(&DataRepr { sub: 8, ..sample() }, b"abc");
        let p = DataPacket::new_checked(&buf[..]).unwrap();
        assert_eq!(DataRepr::parse(&p).err(), Some(WireError::BadField { field: "sub", value: 8 }));
    }

    #[test]
    fn truncation_marker_carries_no_payload() {
        let ok = DataRepr { trunc: true, len: 0, offset: 0, total_len: 1 << 20, ..sample() };
        let buf = emit(&ok, b"");
        assert_eq!(DataRepr::parse(&DataPacket::new_checked(&buf[..]).unwrap()), Ok(ok));
        let bad = DataRepr { trunc: true, ..sample() };
        let buf = emit(&bad, b"abc");
        assert!(DataRepr::parse(&DataPacket::new_checked(&buf[..]).unwrap()).is_err());
    }
}
