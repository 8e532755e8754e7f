//! HELLO: the connection handshake message (connect → listener) and its reply, sent over the short-lived
//! TCP connection of the handshake (see `engine::handshake`), never over a rail.
//!
//! Layout (144 bytes, big-endian; its own magic and version, unrelated to the datagram [`super::VERSION`]):
//! ```text
//!   0..4    magic        "PRSM"
//!   4       version      HELLO_VERSION (5)
//!   5       status       0 = ok; a refusing reply carries 1
//!   6       rails        number of rails (1..=16)
//!   7       backend      0 = UDP, 1 = verbs
//!   8..16   nonce        the listen nonce of the handle
//!  16..24   token        the sender's connection token
//!  24..28   host         the sender's topology host id
//!  28..32   block_len    bytes of the block that follows the 144 bytes (0 on UDP, at most 1 MiB)
//!  32..40   echo         in a reply: the token of the HELLO it answers; 0 in a HELLO
//!  40       kind         1 = HELLO, 2 = reply
//!  41..44   zero
//!  44..48   max_dgram    the largest datagram the sender takes on its rails, header included
//!                        (version 5; the peer's DATA packets on UDP are cut to fit it)
//!  48..144  rails        16 × (IPv4 address, UDP port); entries past `rails` are zero
//! ```
//! Checked by [`HelloPacket::new_checked`]: length, magic, version. Checked by [`HelloRepr::parse`]:
//! rail count, backend, block length, kind. The verbs block that may follow is [`super::verbs_block`].

use std::net::{Ipv4Addr, SocketAddrV4};

use super::field::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use super::WireError;

/// Bytes of a HELLO (without the block that may follow it).
pub const HELLO_LEN: usize = 144;
/// Magic of a HELLO.
pub const HELLO_MAGIC: &[u8; 4] = b"PRSM";
/// Handshake version this build speaks.
pub const HELLO_VERSION: u8 = 5;
/// Most rails a HELLO lists.
pub const HELLO_MAX_RAILS: usize = 16;
/// Largest block after a HELLO.
pub const HELLO_MAX_BLOCK: usize = 1 << 20;

const VERSION: usize = 4;
const STATUS: usize = 5;
const RAILS_N: usize = 6;
const BACKEND: usize = 7;
const NONCE: usize = 8;
const TOKEN: usize = 16;
const HOST: usize = 24;
const BLOCK_LEN: usize = 28;
const ECHO: usize = 32;
const KIND: usize = 40;
const MAX_DGRAM: usize = 44;
const RAILS: usize = 48;
const RAIL_LEN: usize = 6;

const _: () = assert!(RAILS + HELLO_MAX_RAILS * RAIL_LEN == HELLO_LEN);

/// HELLO or reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelloKind {
    /// connect → listener.
    Hello = 1,
    /// listener → connect.
    Reply = 2,
}

/// The backend the sender runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelloBackend {
    /// UDP sockets.
    Udp = 0,
    /// RDMA verbs.
    Verbs = 1,
}

impl HelloBackend {
    /// The backend's name, as `PRISM_TRANSPORT` spells it.
    pub fn name(self) -> &'static str {
        match self {
            HelloBackend::Udp => "udp",
            HelloBackend::Verbs => "verbs",
        }
    }
}

/// A checked view of a HELLO: at least [`HELLO_LEN`] bytes (only those are read), magic and version right.
#[derive(Debug, Clone)]
pub struct HelloPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> HelloPacket<T> {
    /// A view without checks; accessors panic on a buffer shorter than [`HELLO_LEN`].
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// A view of a buffer that starts with a HELLO of this version.
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let b = buffer.as_ref();
        if b.len() < HELLO_LEN {
            return Err(WireError::Truncated { need: HELLO_LEN, have: b.len() });
        }
        if &b[..4] != HELLO_MAGIC {
            return Err(WireError::BadField { field: "hello magic", value: u64::from(u32_at(b, 0)) });
        }
        if b[VERSION] != HELLO_VERSION {
            return Err(WireError::BadField { field: "hello version", value: u64::from(b[VERSION]) });
        }
        Ok(Self { buffer })
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// Handshake version.
    pub fn version(&self) -> u8 {
        self.b()[VERSION]
    }
    /// Status (0 = ok).
    pub fn status(&self) -> u8 {
        self.b()[STATUS]
    }
    /// Number of rails listed.
    pub fn rail_count(&self) -> u8 {
        self.b()[RAILS_N]
    }
    /// Backend code.
    pub fn backend_code(&self) -> u8 {
        self.b()[BACKEND]
    }
    /// Listen nonce.
    pub fn nonce(&self) -> u64 {
        u64_at(self.b(), NONCE)
    }
    /// Sender's connection token.
    pub fn token(&self) -> u64 {
        u64_at(self.b(), TOKEN)
    }
    /// Sender's topology host id.
    pub fn host(&self) -> u32 {
        u32_at(self.b(), HOST)
    }
    /// Bytes of the block that follows.
    pub fn block_len(&self) -> u32 {
        u32_at(self.b(), BLOCK_LEN)
    }
    /// Token of the HELLO a reply answers.
    pub fn echo(&self) -> u64 {
        u64_at(self.b(), ECHO)
    }
    /// Kind code.
    pub fn kind_code(&self) -> u8 {
        self.b()[KIND]
    }
    /// The largest datagram the sender takes on its rails.
    pub fn max_dgram(&self) -> u32 {
        u32_at(self.b(), MAX_DGRAM)
    }
    /// Rail `i` (any of the 16 slots).
    pub fn rail(&self, i: usize) -> SocketAddrV4 {
        let o = RAILS + RAIL_LEN * i;
        let b = self.b();
        SocketAddrV4::new(Ipv4Addr::new(b[o], b[o + 1], b[o + 2], b[o + 3]), u16_at(b, o + 4))
    }
}

/// A HELLO's content. Rails pair by index (rail r talks to the peer's rail r).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloRepr {
    /// HELLO or reply.
    pub kind: HelloKind,
    /// 0 = ok.
    pub status: u8,
    /// The sender's backend.
    pub backend: HelloBackend,
    /// Listen nonce.
    pub nonce: u64,
    /// Sender's connection token.
    pub token: u64,
    /// Sender's topology host id.
    pub host: u32,
    /// Token of the HELLO a reply answers (0 in a HELLO).
    pub echo: u64,
    /// Bytes of the block that follows.
    pub block_len: u32,
    /// The largest datagram the sender takes on its rails, header included (0 until set with
    /// [`HelloRepr::with_max_dgram`]; the engine refuses a peer whose value is too small to use).
    pub max_dgram: u32,
    rails: [SocketAddrV4; HELLO_MAX_RAILS],
    nrails: u8,
}

impl HelloRepr {
    /// A HELLO listing `rails` (at most [`HELLO_MAX_RAILS`]; more is a `BadField`). `rails` may be empty
    /// here (a refusing reply of an engine without rails), although `parse` takes only 1 to 16.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: HelloKind,
        status: u8,
        backend: HelloBackend,
        nonce: u64,
        token: u64,
        host: u32,
        echo: u64,
        block_len: u32,
        rails: &[SocketAddrV4],
    ) -> Result<Self, WireError> {
        if rails.len() > HELLO_MAX_RAILS {
            return Err(WireError::BadField { field: "hello rails", value: rails.len() as u64 });
        }
        let mut r = [SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0); HELLO_MAX_RAILS];
        r[..rails.len()].copy_from_slice(rails);
        Ok(Self { kind, status, backend, nonce, token, host, echo, block_len, max_dgram: 0, rails: r, nrails: rails.len() as u8 })
    }

    /// The same HELLO saying that its sender takes datagrams of at most `max_dgram` bytes.
    pub fn with_max_dgram(self, max_dgram: u32) -> Self {
        Self { max_dgram, ..self }
    }

    /// The rails listed.
    pub fn rails(&self) -> &[SocketAddrV4] {
        &self.rails[..self.nrails as usize]
    }

    /// Parse a HELLO: 1 to 16 rails, a known backend and kind, a block of at most 1 MiB.
    pub fn parse<T: AsRef<[u8]>>(p: &HelloPacket<T>) -> Result<Self, WireError> {
        let n = p.rail_count() as usize;
        if n == 0 || n > HELLO_MAX_RAILS {
            return Err(WireError::BadField { field: "hello rails", value: n as u64 });
        }
        let block_len = p.block_len();
        if block_len as usize > HELLO_MAX_BLOCK {
            return Err(WireError::BadField { field: "hello block length", value: u64::from(block_len) });
        }
        let backend = match p.backend_code() {
            0 => HelloBackend::Udp,
            1 => HelloBackend::Verbs,
            b => return Err(WireError::BadField { field: "hello backend", value: u64::from(b) }),
        };
        let kind = match p.kind_code() {
            1 => HelloKind::Hello,
            2 => HelloKind::Reply,
            k => return Err(WireError::UnknownType { got: k }),
        };
        let mut rails = [SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0); HELLO_MAX_RAILS];
        for (i, r) in rails.iter_mut().enumerate().take(n) {
            *r = p.rail(i);
        }
        Ok(Self {
            kind,
            status: p.status(),
            backend,
            nonce: p.nonce(),
            token: p.token(),
            host: p.host(),
            echo: p.echo(),
            block_len,
            max_dgram: p.max_dgram(),
            rails,
            nrails: n as u8,
        })
    }

    /// Bytes of the HELLO (without its block).
    pub fn buffer_len(&self) -> usize {
        HELLO_LEN
    }

    /// Write the HELLO into the first [`HELLO_LEN`] bytes of the buffer (every byte of them is written).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut HelloPacket<T>) {
        let b = &mut p.buffer.as_mut()[..HELLO_LEN];
        b.fill(0);
        b[..4].copy_from_slice(HELLO_MAGIC);
        b[VERSION] = HELLO_VERSION;
        b[STATUS] = self.status;
        b[RAILS_N] = self.nrails;
        b[BACKEND] = self.backend as u8;
        put_u64(b, NONCE, self.nonce);
        put_u64(b, TOKEN, self.token);
        put_u32(b, HOST, self.host);
        put_u32(b, BLOCK_LEN, self.block_len);
        put_u64(b, ECHO, self.echo);
        b[KIND] = self.kind as u8;
        put_u32(b, MAX_DGRAM, self.max_dgram);
        for (i, r) in self.rails().iter().enumerate() {
            let o = RAILS + RAIL_LEN * i;
            b[o..o + 4].copy_from_slice(&r.ip().octets());
            put_u16(b, o + 4, r.port());
        }
    }

    /// The HELLO as a new vector of [`HELLO_LEN`] bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; HELLO_LEN];
        self.emit(&mut HelloPacket::new_unchecked(&mut v[..]));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> HelloRepr {
        let rails = [SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 0x1234), SocketAddrV4::new(Ipv4Addr::new(10, 1, 2, 3), 65535)];
        HelloRepr::new(
            HelloKind::Reply,
            0,
            HelloBackend::Verbs,
            0x0102_0304_0506_0708,
            0x1112_1314_1516_1718,
            0xa1a2_a3a4,
            0xb1b2_b3b4_b5b6_b7b8,
            0x54,
            &rails,
        )
        .unwrap()
        .with_max_dgram(9000)
    }

    /// Version 4's bytes for `sample()` (as the engine's hand-written encoder before the wire module
    /// produced them), with version 5's version byte and largest datagram (9000 at 44..48).
    #[test]
    fn emit_matches_the_version_5_golden_bytes() {
        let mut want = vec![0u8; HELLO_LEN];
        want[..48].copy_from_slice(&[
            b'P', b'R', b'S', b'M', 5, 0, 2, 1, 1, 2, 3, 4, 5, 6, 7, 8, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0xa1, 0xa2, 0xa3,
            0xa4, 0, 0, 0, 0x54, 0xb1, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6, 0xb7, 0xb8, 2, 0, 0, 0, 0, 0, 0x23, 0x28,
        ]);
        want[48..60].copy_from_slice(&[10, 0, 0, 1, 0x12, 0x34, 10, 1, 2, 3, 0xff, 0xff]);
        assert_eq!(sample().to_vec(), want);
    }

    #[test]
    fn a_refusing_reply_without_rails_emits_but_does_not_parse() {
        let r = HelloRepr::new(HelloKind::Reply, 1, HelloBackend::Udp, 0, 0, 7, 0, 0, &[]).unwrap();
        let v = r.to_vec();
        let p = HelloPacket::new_checked(&v[..]).unwrap();
        assert_eq!(p.status(), 1);
        assert_eq!(HelloRepr::parse(&p), Err(WireError::BadField { field: "hello rails", value: 0 }));
    }

    #[test]
    fn bad_magic_version_backend_kind_and_block_are_refused() {
        let good = sample().to_vec();
        let cases: [(usize, u8); 5] = [(0, b'X'), (VERSION, 3), (BACKEND, 2), (KIND, 3), (BLOCK_LEN, 1)];
        for (at, v) in cases {
            let mut b = good.clone();
            b[at] = v;
            let r = HelloPacket::new_checked(&b[..]).and_then(|p| HelloRepr::parse(&p));
            assert!(r.is_err(), "byte {at} = {v} accepted");
        }
        let mut b = good.clone();
        b[RAILS_N] = 17;
        assert!(HelloRepr::parse(&HelloPacket::new_checked(&b[..]).unwrap()).is_err());
    }
}
