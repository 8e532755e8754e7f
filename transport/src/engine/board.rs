//! What the comms of one process know about the paths towards each peer address, shared.
//!
//! Entropy `e` of rail `r` is a 5-tuple: this host's rail-`r` address and source port `e`, the peer's
//! rail address and rail port. Every comm of this process that talks to the same peer rail uses the
//! same tuples, so what one of them learns holds for all. Only comms that send DATA learn anything (a
//! receive comm's paths carry only its SACKs and CTS, whose losses it never sees), so a receive comm
//! steers its control packets by what a send comm to the same peer published: a SACK echoing an
//! entropy whose way back is dead would otherwise go into the dead path for as long as data arrives
//! on that entropy's way out (the two directions of one entropy hash independently).

use std::collections::HashMap;
use std::net::SocketAddrV4;

use parking_lot::Mutex;

/// A publication older than this is ignored (its comm went quiet or closed).
const FRESH_US: u64 = 500_000;

#[derive(Debug)]
struct Entry {
    /// Per source socket: new packets from a sending comm would take it now.
    good: Vec<bool>,
    at_us: u64,
}

/// Entries kept before stale ones are first dropped (the bound then doubles with the live ones).
const PRUNE_AT: usize = 64;

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<SocketAddrV4, Entry>,
    /// Size at which stale entries are dropped next.
    prune_at: usize,
}

/// Per peer rail address: which of our sockets a sending comm currently trusts.
#[derive(Debug, Default)]
pub(crate) struct PathBoard {
    entries: Mutex<Entries>,
}

impl PathBoard {
    /// A sending comm's current view of its sockets towards `dest`. Publications gone stale (their
    /// comms closed: peers of a long job come and go) are dropped once the board has grown, so it
    /// holds about as many entries as there are peers being sent to.
    pub fn publish(&self, dest: SocketAddrV4, good: Vec<bool>, now_us: u64) {
        let mut e = self.entries.lock();
        e.map.insert(dest, Entry { good, at_us: now_us });
        if e.map.len() >= e.prune_at.max(PRUNE_AT) {
            e.map.retain(|_, x| now_us.saturating_sub(x.at_us) <= FRESH_US);
            e.prune_at = 2 * e.map.len();
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.lock().map.len()
    }

    /// Where a control packet for `dest` should leave from instead of `sock`: a fresh publication
    /// that trusts `sock` (or no fresh publication) keeps it; one that does not names the next trusted
    /// socket up (wrapping), or says that it trusts none of them (the whole rail towards `dest` is
    /// failing: the caller looks at the peer's other rails).
    pub fn steer(&self, dest: SocketAddrV4, sock: u16, now_us: u64) -> Steer {
        let entries = self.entries.lock();
        let Some(e) = entries.map.get(&dest) else {
            return Steer::Keep;
        };
        if now_us.saturating_sub(e.at_us) > FRESH_US || e.good.get(sock as usize).copied().unwrap_or(true) {
            return Steer::Keep;
        }
        let n = e.good.len();
        match (1..n).map(|k| (sock as usize + k) % n).find(|&i| e.good[i]) {
            Some(i) => Steer::To(i as u16),
            None => Steer::NoneTrusted,
        }
    }

    /// A socket towards `dest` that a fresh publication trusts, the first at or after `sock`
    /// (wrapping); `None` without a fresh publication or when it trusts none.
    pub fn trusted(&self, dest: SocketAddrV4, sock: u16, now_us: u64) -> Option<u16> {
        let entries = self.entries.lock();
        let e = entries.map.get(&dest)?;
        if now_us.saturating_sub(e.at_us) > FRESH_US {
            return None;
        }
        let n = e.good.len();
        (0..n).map(|k| (sock as usize + k) % n).find(|&i| e.good[i]).map(|i| i as u16)
    }
}

/// What [`PathBoard::steer`] says of a control packet's socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Steer {
    /// Leave from it (trusted, or nothing fresh is known).
    Keep,
    /// Leave from this socket of the same rail instead.
    To(u16),
    /// A fresh publication trusts no socket of this rail towards the peer.
    NoneTrusted,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dest() -> SocketAddrV4 {
        "10.0.0.2:4000".parse().unwrap()
    }

    #[test]
    fn untrusted_sockets_are_steered_to_the_next_trusted_one() {
        let b = PathBoard::default();
        assert_eq!(b.steer(dest(), 1, 0), Steer::Keep, "nothing published: keep the socket");
        b.publish(dest(), vec![true, false, false, true], 1_000);
        assert_eq!(b.steer(dest(), 0, 2_000), Steer::Keep);
        assert_eq!(b.steer(dest(), 1, 2_000), Steer::To(3));
        assert_eq!(b.steer(dest(), 2, 2_000), Steer::To(3));
        assert_eq!(b.steer("10.0.0.3:4000".parse().unwrap(), 1, 2_000), Steer::Keep, "another peer");
        assert_eq!(b.steer(dest(), 1, 1_000 + FRESH_US + 1), Steer::Keep, "stale");
        b.publish(dest(), vec![false; 4], 3_000);
        assert_eq!(b.steer(dest(), 1, 3_000), Steer::NoneTrusted, "the whole rail is failing");
        assert_eq!(b.steer(dest(), 1, 3_000 + FRESH_US + 1), Steer::Keep, "stale");
    }

    #[test]
    fn trusted_finds_a_socket_of_another_rail_only_from_a_fresh_publication() {
        let b = PathBoard::default();
        let other: SocketAddrV4 = "10.0.1.2:4000".parse().unwrap();
        assert_eq!(b.trusted(other, 2, 0), None, "nothing published");
        b.publish(other, vec![false, true, false, false], 1_000);
        assert_eq!(b.trusted(other, 1, 2_000), Some(1), "at the socket itself");
        assert_eq!(b.trusted(other, 2, 2_000), Some(1), "wrapping");
        assert_eq!(b.trusted(other, 2, 1_000 + FRESH_US + 1), None, "stale");
        b.publish(other, vec![false; 4], 3_000);
        assert_eq!(b.trusted(other, 0, 3_000), None, "none trusted");
    }

    #[test]
    fn publications_of_peers_long_gone_do_not_pile_up() {
        let b = PathBoard::default();
        for i in 0..10_000u32 {
            // One new peer every 100 ms: at most 6 are fresh at any time.
            let peer = SocketAddrV4::new(std::net::Ipv4Addr::from(0x0a00_0000 + i), 4000);
            b.publish(peer, vec![true; 1024], u64::from(i) * 100_000);
        }
        assert!(b.len() <= PRUNE_AT, "{} entries kept", b.len());
        let last = SocketAddrV4::new(std::net::Ipv4Addr::from(0x0a00_0000 + 9_999), 4000);
        b.publish(last, vec![false, true], 999_900_000);
        assert_eq!(b.steer(last, 0, 999_900_000), Steer::To(1), "the fresh ones are still there");
    }
}
