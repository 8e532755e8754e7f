//! CONTROL: small packets that carry no payload.
//!
//! - ACK: acknowledges CTS packets (through the common header's `cts_ack`) when no DATA is going out.
//! - PING: keepalive while requests are outstanding, or the probe of a dead path (`entropy` is the
//!   path it was sent on). PONG: the answer, echoing `entropy` and `ts_us`.
//! - CLOSE: the sender closed its end; outstanding requests at the peer fail.
//!
//! Every kind also carries `cum_psn`, the sender's cumulative receive PSN, so a peer learns which of its
//! DATA packets arrived even when SACKs were lost (in particular from the CLOSE that ends a connection).
//!
//! Layout (big-endian; the first 20 bytes are the common header of [`super::header`]):
//! ```text
//!  0..20   common header, type 4; no flags
//! 20       kind         1 ACK, 2 PING, 3 PONG, 4 CLOSE
//! 21       reserved     sent as 0, ignored
//! 22..24   entropy      PING: the path it was sent on; PONG: the PING's entropy
//! 24..28   ts_us        PING: sender's clock (µs, low 32 bits); PONG: the PING's ts_us
//! 28..36   cum_psn      every DATA PSN below this has reached the packet's sender
//! ```

use super::field::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use super::header::{self, Header, PacketType, HEADER_LEN};
use super::WireError;

/// Bytes of a CONTROL packet.
pub const CONTROL_LEN: usize = 36;

const KIND: usize = HEADER_LEN;
const RESERVED: usize = 21;
const ENTROPY: usize = 22;
const TS: usize = 24;
const CUM: usize = 28;

/// What a CONTROL packet says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ControlKind {
    /// CTS acknowledgement only.
    Ack = 1,
    /// Keepalive or path probe; answered by a PONG.
    Ping = 2,
    /// Answer to a PING.
    Pong = 3,
    /// The peer closed the connection.
    Close = 4,
}

impl ControlKind {
    /// The kind with wire code `v`, if any.
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Ack),
            2 => Some(Self::Ping),
            3 => Some(Self::Pong),
            4 => Some(Self::Close),
            _ => None,
        }
    }
}

/// A checked view of a CONTROL packet.
#[derive(Debug, Clone)]
pub struct ControlPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ControlPacket<T> {
    /// A view without checks; accessors panic on a buffer shorter than [`CONTROL_LEN`].
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer holding exactly one CONTROL packet of a supported version.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        header::check(b, PacketType::Control, CONTROL_LEN)?;
        if b.len() > CONTROL_LEN {
            return Err(WireError::TrailingBytes { expected: CONTROL_LEN, actual: b.len() });
        }
        Ok(Self { buffer })
    }

    /// The common header.
    pub fn header(&self) -> Header<&[u8]> {
        Header::new_unchecked(self.buffer.as_ref())
    }

    /// Raw kind byte.
    pub fn kind_code(&self) -> u8 {
        self.buffer.as_ref()[KIND]
    }

    /// Entropy field.
    pub fn entropy(&self) -> u16 {
        u16_at(self.buffer.as_ref(), ENTROPY)
    }

    /// Timestamp field.
    pub fn ts_us(&self) -> u32 {
        u32_at(self.buffer.as_ref(), TS)
    }

    /// Cumulative receive PSN of the packet's sender.
    pub fn cum_psn(&self) -> u64 {
        u64_at(self.buffer.as_ref(), CUM)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ControlPacket<T> {
    /// The common header, writable.
    pub fn header_mut(&mut self) -> Header<&mut [u8]> {
        Header::new_unchecked(self.buffer.as_mut())
    }
}

/// A parsed CONTROL packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlRepr {
    /// Destination connection token.
    pub token: u64,
    /// CTS acknowledgement of the packet's sender.
    pub cts_ack: u64,
    /// What the packet says.
    pub kind: ControlKind,
    /// PING: path it was sent on; PONG: echo of the PING's.
    pub entropy: u16,
    /// PING: send time (µs, low 32 bits); PONG: echo of the PING's.
    pub ts_us: u32,
    /// Every DATA PSN below this has reached the packet's sender.
    pub cum_psn: u64,
}

impl ControlRepr {
    /// Parse a CONTROL packet; an unknown kind is `UnknownType`.
    pub fn parse<T: AsRef<[u8]>>(p: &ControlPacket<T>) -> Result<Self, WireError> {
        let kind = ControlKind::from_u8(p.kind_code()).ok_or(WireError::UnknownType { got: p.kind_code() })?;
        Ok(Self {
            token: p.header().token(),
            cts_ack: p.header().cts_ack(),
            kind,
            entropy: p.entropy(),
            ts_us: p.ts_us(),
            cum_psn: p.cum_psn(),
        })
    }

    /// Bytes of the whole packet.
    pub fn buffer_len(&self) -> usize {
        CONTROL_LEN
    }

    /// Write the packet; the buffer must hold at least [`CONTROL_LEN`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut ControlPacket<T>) {
        p.header_mut().emit(PacketType::Control, 0, self.token, self.cts_ack);
        let b = p.buffer.as_mut();
        b[KIND] = self.kind as u8;
        b[RESERVED] = 0;
        put_u16(b, ENTROPY, self.entropy);
        put_u32(b, TS, self.ts_us);
        put_u64(b, CUM, self.cum_psn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_control_kind_round_trips() {
        for kind in [ControlKind::Ack, ControlKind::Ping, ControlKind::Pong, ControlKind::Close] {
            let r = ControlRepr { token: 5, cts_ack: 6, kind, entropy: 1023, ts_us: 77, cum_psn: 1 << 50 };
            let mut buf = [0u8; CONTROL_LEN];
            r.emit(&mut ControlPacket::new_unchecked(&mut buf[..]));
            assert_eq!(ControlRepr::parse(&ControlPacket::new_checked(&buf[..]).unwrap()), Ok(r));
        }
    }

    #[test]
    fn unknown_control_kind_is_an_unknown_type() {
        let r = ControlRepr { token: 5, cts_ack: 0, kind: ControlKind::Ack, entropy: 0, ts_us: 0, cum_psn: 0 };
        let mut buf = [0u8; CONTROL_LEN];
        r.emit(&mut ControlPacket::new_unchecked(&mut buf[..]));
        buf[KIND] = 9;
        let p = ControlPacket::new_checked(&buf[..]).unwrap();
        assert_eq!(ControlRepr::parse(&p), Err(WireError::UnknownType { got: 9 }));
    }
}
