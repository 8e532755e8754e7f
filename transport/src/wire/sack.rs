//! SACK: the receiver's view of which DATA packets arrived: a cumulative PSN, a 256-PSN bitmap that
//! may start anywhere at or above it, and the echo of the packet that triggered the SACK (its entropy
//! and send timestamp, for per-path RTT samples and REPS-style entropy recycling) plus a congestion hint.
//!
//! Layout (big-endian; the first 20 bytes are the common header of [`super::header`]):
//! ```text
//!  0..20   common header, type 3; flags: bit 0 CONGESTED, bit 1 ECHO (echo fields are valid),
//!          bit 2 SPURIOUS (the triggering packet was a retransmission of a packet that had arrived),
//!          bit 3 ECHO_PSN (echo_ts_us holds the low 32 bits of the triggering packet's PSN, not a
//!          timestamp: a verbs WRITE whose header the receiver rebuilt; the sender looks the send
//!          time up itself)
//! 20..28   cum_psn        every PSN below this has arrived (the next PSN the receiver expects)
//! 28..36   base_psn       PSN of bitmap bit 0; base_psn >= cum_psn
//! 36..68   bitmap         four u64 words; bit k (least significant = 0) of word j is set when
//!                         PSN base_psn + 64*j + k has arrived
//! 68..70   echo_entropy   entropy of the triggering DATA packet
//! 70..72   reserved       sent as 0, ignored
//! 72..76   echo_ts_us     send timestamp of the triggering DATA packet
//! ```

use super::field::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use super::header::{self, Header, PacketType, HEADER_LEN};
use super::WireError;

/// Bytes of a SACK packet.
pub const SACK_LEN: usize = 76;
/// PSNs one SACK bitmap covers.
pub const SACK_BITMAP_PSNS: u64 = 256;

/// Flag: the receiver saw congestion (CE) on a packet since its last SACK.
pub const FLAG_CONGESTED: u16 = 1 << 0;
/// Flag: the echo fields describe the packet that triggered this SACK.
pub const FLAG_ECHO: u16 = 1 << 1;
/// Flag: the triggering packet was a retransmission of a packet that had already arrived.
pub const FLAG_SPURIOUS: u16 = 1 << 2;
/// Flag: the echo carries the triggering packet's PSN (low 32 bits) instead of its send timestamp.
pub const FLAG_ECHO_PSN: u16 = 1 << 3;
/// In [`SackRepr::echo`]'s entropy: set when the echo carries a PSN ([`FLAG_ECHO_PSN`] on the wire;
/// entropies are below 2^15).
pub const ECHO_BY_PSN: u16 = 1 << 15;

const CUM: usize = HEADER_LEN;
const BASE: usize = 28;
const BITMAP: usize = 36;
const ECHO_ENTROPY: usize = 68;
const RESERVED: usize = 70;
const ECHO_TS: usize = 72;

/// A checked view of a SACK packet.
#[derive(Debug, Clone)]
pub struct SackPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> SackPacket<T> {
    /// A view without checks; accessors panic on a buffer shorter than [`SACK_LEN`].
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer holding exactly one SACK of a supported version.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        header::check(b, PacketType::Sack, SACK_LEN)?;
        if b.len() > SACK_LEN {
            return Err(WireError::TrailingBytes { expected: SACK_LEN, actual: b.len() });
        }
        Ok(Self { buffer })
    }

    /// The common header.
    pub fn header(&self) -> Header<&[u8]> {
        Header::new_unchecked(self.buffer.as_ref())
    }

    /// Every PSN below this has arrived.
    pub fn cum_psn(&self) -> u64 {
        u64_at(self.buffer.as_ref(), CUM)
    }

    /// PSN of bitmap bit 0.
    pub fn base_psn(&self) -> u64 {
        u64_at(self.buffer.as_ref(), BASE)
    }

    /// Bitmap word `j` (0..4).
    pub fn bitmap_word(&self, j: usize) -> u64 {
        u64_at(self.buffer.as_ref(), BITMAP + 8 * j)
    }

    /// Entropy of the triggering packet.
    pub fn echo_entropy(&self) -> u16 {
        u16_at(self.buffer.as_ref(), ECHO_ENTROPY)
    }

    /// Send timestamp of the triggering packet.
    pub fn echo_ts_us(&self) -> u32 {
        u32_at(self.buffer.as_ref(), ECHO_TS)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> SackPacket<T> {
    /// The common header, writable.
    pub fn header_mut(&mut self) -> Header<&mut [u8]> {
        Header::new_unchecked(self.buffer.as_mut())
    }
}

/// A parsed SACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SackRepr {
    /// Destination connection token.
    pub token: u64,
    /// CTS acknowledgement of the packet's sender.
    pub cts_ack: u64,
    /// Every PSN below this has arrived.
    pub cum_psn: u64,
    /// PSN of bitmap bit 0 (at or above `cum_psn`).
    pub base_psn: u64,
    /// Arrival bits of PSNs `base_psn .. base_psn + 256`.
    pub bitmap: [u64; 4],
    /// Echo of the triggering packet (entropy, send timestamp), if there was one.
    pub echo: Option<(u16, u32)>,
    /// The receiver saw congestion since its last SACK.
    pub congested: bool,
    /// The triggering packet was a needless retransmission (it had arrived before).
    pub spurious: bool,
}

impl SackRepr {
    /// Parse and check a SACK: the bitmap must start at or above the cumulative PSN and must not run
    /// past the end of the PSN space.
    pub fn parse<T: AsRef<[u8]>>(p: &SackPacket<T>) -> Result<Self, WireError> {
        let flags = p.header().flags();
        let repr = Self {
            token: p.header().token(),
            cts_ack: p.header().cts_ack(),
            cum_psn: p.cum_psn(),
            base_psn: p.base_psn(),
            bitmap: [p.bitmap_word(0), p.bitmap_word(1), p.bitmap_word(2), p.bitmap_word(3)],
            echo: (flags & FLAG_ECHO != 0).then(|| {
                let by_psn = if flags & FLAG_ECHO_PSN != 0 { ECHO_BY_PSN } else { 0 };
                ((p.echo_entropy() & !ECHO_BY_PSN) | by_psn, p.echo_ts_us())
            }),
            congested: flags & FLAG_CONGESTED != 0,
            spurious: flags & FLAG_SPURIOUS != 0,
        };
        if repr.base_psn < repr.cum_psn {
            return Err(WireError::BadField { field: "base_psn", value: repr.base_psn });
        }
        if repr.base_psn.checked_add(SACK_BITMAP_PSNS).is_none() {
            return Err(WireError::BadRange { offset: repr.base_psn, len: SACK_BITMAP_PSNS, limit: u64::MAX });
        }
        Ok(repr)
    }

    /// True when PSN `base_psn + i` is marked as arrived (`i < 256`).
    pub fn bit(&self, i: u64) -> bool {
        i < SACK_BITMAP_PSNS && self.bitmap[(i / 64) as usize] >> (i % 64) & 1 == 1
    }

    /// Bytes of the whole packet.
    pub fn buffer_len(&self) -> usize {
        SACK_LEN
    }

    /// Write the packet; the buffer must hold at least [`SACK_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut SackPacket<T>) {
        let flags = (if self.congested { FLAG_CONGESTED } else { 0 })
            | (if self.echo.is_some() { FLAG_ECHO } else { 0 })
            | (if self.spurious { FLAG_SPURIOUS } else { 0 })
            | (if self.echo.is_some_and(|(e, _)| e & ECHO_BY_PSN != 0) { FLAG_ECHO_PSN } else { 0 });
        p.header_mut().emit(PacketType::Sack, flags, self.token, self.cts_ack);
        let b = p.buffer.as_mut();
        put_u64(b, CUM, self.cum_psn);
        put_u64(b, BASE, self.base_psn);
        for (j, w) in self.bitmap.iter().enumerate() {
            put_u64(b, BITMAP + 8 * j, *w);
        }
        let (entropy, ts) = self.echo.unwrap_or((0, 0));
        put_u16(b, ECHO_ENTROPY, entropy & !ECHO_BY_PSN);
        put_u16(b, RESERVED, 0);
        put_u32(b, ECHO_TS, ts);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SackRepr {
        SackRepr {
            token: 3,
            cts_ack: 0,
            cum_psn: 1000,
            base_psn: 1001,
            bitmap: [1, 0, 1 << 63, 0xdead_beef],
            echo: Some((11, 0xffff_fff0)),
            congested: true,
            spurious: true,
        }
    }

    fn emit(r: &SackRepr) -> Vec<u8> {
        let mut buf = vec![0u8; SACK_LEN];
        r.emit(&mut SackPacket::new_unchecked(&mut buf[..]));
        buf
    }

    #[test]
    fn sack_round_trips() {
        let buf = emit(&sample());
        assert_eq!(SackRepr::parse(&SackPacket::new_checked(&buf[..]).unwrap()).unwrap(), sample());
        let quiet = SackRepr { echo: None, congested: false, spurious: false, ..sample() };
        assert_eq!(SackRepr::parse(&SackPacket::new_checked(&emit(&quiet)[..]).unwrap()).unwrap(), quiet);
    }

    #[test]
    fn an_echo_by_psn_travels_as_its_flag_with_the_plain_entropy() {
        let r = SackRepr { echo: Some((11 | ECHO_BY_PSN, 0x1234)), ..sample() };
        let buf = emit(&r);
        let p = SackPacket::new_checked(&buf[..]).unwrap();
        assert_ne!(p.header().flags() & FLAG_ECHO_PSN, 0);
        assert_eq!(p.echo_entropy(), 11);
        assert_eq!(SackRepr::parse(&p).unwrap(), r);
        let p = SackPacket::new_checked(&emit(&sample())[..]).unwrap().header().flags();
        assert_eq!(p & FLAG_ECHO_PSN, 0, "a timestamp echo does not carry the flag");
    }

    #[test]
    fn bitmap_bit_i_is_psn_base_plus_i() {
        let r = sample();
        assert!(r.bit(0) && !r.bit(1) && r.bit(191) && !r.bit(190) && !r.bit(256));
        let buf = emit(&r);
        assert_eq!(&buf[BITMAP + 16..BITMAP + 24], &(1u64 << 63).to_be_bytes());
    }

    #[test]
    fn bitmap_may_not_start_below_the_cumulative_psn() {
        let buf = emit(&SackRepr { base_psn: 999, ..sample() });
        let p = SackPacket::new_checked(&buf[..]).unwrap();
        assert_eq!(SackRepr::parse(&p).err(), Some(WireError::BadField { field: "base_psn", value: 999 }));
    }

    #[test]
    fn bitmap_may_not_run_past_the_psn_space() {
        let buf = emit(&SackRepr { base_psn: u64::MAX - 10, ..sample() });
        let p = SackPacket::new_checked(&buf[..]).unwrap();
        assert!(matches!(SackRepr::parse(&p), Err(WireError::BadRange { .. })));
    }
}
