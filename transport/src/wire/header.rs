//! The common header that opens every Prism packet.
//!
//! Layout (big-endian, 20 bytes):
//! ```text
//!  0        1        2                 4                                12                               20
//! +--------+--------+-----------------+--------------------------------+--------------------------------+
//! | version|  type  |   flags (u16)   |  destination token (u64)       |  cts_ack (u64)                 |
//! +--------+--------+-----------------+--------------------------------+--------------------------------+
//! ```
//! - `version`: [`VERSION`]; packets of another version are dropped.
//! - `type`: 1 DATA, 2 CTS, 3 SACK, 4 CONTROL.
//! - `flags`: meaning depends on the type (see each packet's file); unknown bits are ignored.
//! - `destination token`: the receiving connection's token; the demux key, and a packet whose token is
//!   not the local connection's is dropped.
//! - `cts_ack`: every CTS whose sequence number is below this value has reached the packet's sender.
//!   Every packet carries it, so the CTS a receiver sends is acknowledged by whatever the sender sends.

use super::field::{put_u16, put_u64, u16_at, u64_at};
use super::{WireError, VERSION};

/// Length of the common header in bytes.
pub const HEADER_LEN: usize = 20;

const VERSION_AT: usize = 0;
const TYPE_AT: usize = 1;
const FLAGS_AT: usize = 2;
const TOKEN_AT: usize = 4;
const CTS_ACK_AT: usize = 12;

/// The packet types of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PacketType {
    /// Payload of one message.
    Data = 1,
    /// Clear-to-send: a grouped receive was posted.
    Cts = 2,
    /// Selective acknowledgement of DATA packets.
    Sack = 3,
    /// Small control packets (ACK, PING, PONG, CLOSE).
    Control = 4,
}

impl PacketType {
    /// The type with wire code `v`, if any.
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Data),
            2 => Some(Self::Cts),
            3 => Some(Self::Sack),
            4 => Some(Self::Control),
            _ => None,
        }
    }
}

/// A view of the common header over any byte buffer.
#[derive(Debug, Clone)]
pub struct Header<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Header<T> {
    /// A view without any check; accessors panic if the buffer is shorter than [`HEADER_LEN`].
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer that holds a full common header of a supported version.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let have = buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(WireError::Truncated { need: HEADER_LEN, have });
        }
        let h = Self::new_unchecked(buffer);
        if h.version() != VERSION {
            return Err(WireError::BadVersion { got: h.version() });
        }
        Ok(h)
    }

    /// Protocol version byte.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[VERSION_AT]
    }

    /// Raw packet type byte.
    pub fn type_code(&self) -> u8 {
        self.buffer.as_ref()[TYPE_AT]
    }

    /// The packet type, or `UnknownType`.
    pub fn packet_type(&self) -> Result<PacketType, WireError> {
        PacketType::from_u8(self.type_code()).ok_or(WireError::UnknownType { got: self.type_code() })
    }

    /// Type-specific flag bits.
    pub fn flags(&self) -> u16 {
        u16_at(self.buffer.as_ref(), FLAGS_AT)
    }

    /// Destination connection token.
    pub fn token(&self) -> u64 {
        u64_at(self.buffer.as_ref(), TOKEN_AT)
    }

    /// Every CTS below this sequence number has reached the packet's sender.
    pub fn cts_ack(&self) -> u64 {
        u64_at(self.buffer.as_ref(), CTS_ACK_AT)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Header<T> {
    /// Write version, type, flags, token and CTS acknowledgement at once.
    pub fn emit(&mut self, ptype: PacketType, flags: u16, token: u64, cts_ack: u64) {
        let b = self.buffer.as_mut();
        b[VERSION_AT] = VERSION;
        b[TYPE_AT] = ptype as u8;
        put_u16(b, FLAGS_AT, flags);
        put_u64(b, TOKEN_AT, token);
        put_u64(b, CTS_ACK_AT, cts_ack);
    }

    /// Overwrite the flag bits.
    pub fn set_flags(&mut self, flags: u16) {
        put_u16(self.buffer.as_mut(), FLAGS_AT, flags);
    }
}

/// Check the common header of `buf` for a packet of type `expected` that is at least `min_len` bytes.
pub(crate) fn check(buf: &[u8], expected: PacketType, min_len: usize) -> Result<(), WireError> {
    let h = Header::new_checked(buf)?;
    let got = h.type_code();
    if got != expected as u8 {
        return Err(match PacketType::from_u8(got) {
            Some(_) => WireError::WrongType { expected: expected as u8, got },
            None => WireError::UnknownType { got },
        });
    }
    if buf.len() < min_len {
        return Err(WireError::Truncated { need: min_len, have: buf.len() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_fields_round_trip() {
        let mut buf = [0u8; HEADER_LEN];
        Header::new_unchecked(&mut buf[..]).emit(PacketType::Sack, 0xa5a5, u64::MAX - 1, 77);
        let h = Header::new_checked(&buf[..]).unwrap();
        assert_eq!(h.packet_type(), Ok(PacketType::Sack));
        assert_eq!((h.flags(), h.token(), h.cts_ack()), (0xa5a5, u64::MAX - 1, 77));
    }

    #[test]
    fn short_or_foreign_version_headers_are_rejected() {
        let mut buf = [0u8; HEADER_LEN];
        Header::new_unchecked(&mut buf[..]).emit(PacketType::Data, 0, 1, 0);
        assert_eq!(Header::new_checked(&buf[..HEADER_LEN - 1]).err(), Some(WireError::Truncated { need: 20, have: 19 }));
        buf[0] = VERSION + 1;
        assert_eq!(Header::new_checked(&buf[..]).err(), Some(WireError::BadVersion { got: VERSION + 1 }));
    }

    #[test]
    fn check_tells_unknown_types_from_wrong_types() {
        let mut buf = [0u8; HEADER_LEN];
        Header::new_unchecked(&mut buf[..]).emit(PacketType::Cts, 0, 1, 0);
        assert_eq!(check(&buf, PacketType::Data, HEADER_LEN), Err(WireError::WrongType { expected: 1, got: 2 }));
        buf[1] = 200;
        assert_eq!(check(&buf, PacketType::Data, HEADER_LEN), Err(WireError::UnknownType { got: 200 }));
    }
}
