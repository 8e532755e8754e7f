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

/// Per peer rail address: which of our sockets a sending comm currently trusts.
#[derive(Debug, Default)]
pub(crate) struct PathBoard {
    entries: Mutex<HashMap<SocketAddrV4, Entry>>,
}

impl PathBoard {
    /// A sending comm's current view of its sockets towards `dest`.
    pub fn publish(&self, dest: SocketAddrV4, good: Vec<bool>, now_us: u64) {
        self.entries.lock().insert(dest, Entry { good, at_us: now_us });
    }

    /// The socket a control packet for `dest` should leave from instead of `sock`, if a fresh
    /// publication says `sock` is not trusted and names one that is (the next one up, wrapping).
    pub fn steer(&self, dest: SocketAddrV4, sock: u16, now_us: u64) -> Option<u16> {
        let entries = self.entries.lock();
        let e = entries.get(&dest)?;
        if now_us.saturating_sub(e.at_us) > FRESH_US || e.good.get(sock as usize).copied().unwrap_or(true) {
            return None;
        }
        let n = e.good.len();
        (1..n).map(|k| (sock as usize + k) % n).find(|&i| e.good[i]).map(|i| i as u16)
    }
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
        assert_eq!(b.steer(dest(), 1, 0), None, "nothing published: keep the socket");
        b.publish(dest(), vec![true, false, false, true], 1_000);
        assert_eq!(b.steer(dest(), 0, 2_000), None);
        assert_eq!(b.steer(dest(), 1, 2_000), Some(3));
        assert_eq!(b.steer(dest(), 2, 2_000), Some(3));
        assert_eq!(b.steer("10.0.0.3:4000".parse().unwrap(), 1, 2_000), None, "another peer");
        assert_eq!(b.steer(dest(), 1, 1_000 + FRESH_US + 1), None, "stale");
        b.publish(dest(), vec![false; 4], 3_000);
        assert_eq!(b.steer(dest(), 1, 3_000), None, "nothing trusted: keep the socket");
    }
}
