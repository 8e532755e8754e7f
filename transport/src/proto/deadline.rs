//! The earliest per-path retransmission deadline, kept up to date incrementally so that
//! [`Connection::poll_timeout`](super::Connection::poll_timeout) does not scan every path.
//!
//! A path's deadline (`Path::rto_deadline`: its oldest transmission's send time plus its RTO) changes
//! only when its queue of transmissions or its RTT estimator changes. Every place that changes them
//! calls [`RtoDeadlines::touch`]; the next query recomputes only the touched paths, and rescans the
//! cached values (one slot per path, held inline for up to 16 paths) only when the path holding the
//! minimum moved later.

use smallvec::SmallVec;

use super::path::Path;
use super::Micros;

/// No deadline (the path has nothing in flight).
const NONE: Micros = Micros::MAX;

/// Paths whose cached deadlines are held inside the connection (no pointer to follow): every fat
/// tree up to k = 8 has at most 16 paths between two leaves.
const INLINE_PATHS: usize = 16;

/// One path's cached deadline and whether it changed since the last query (read together).
#[derive(Debug, Clone, Copy)]
struct Slot {
    at: Micros,
    touched: bool,
}

#[derive(Debug)]
pub(crate) struct RtoDeadlines {
    /// Per path: its deadline as of the last query (`NONE` if it had nothing in flight), and whether it
    /// changed since.
    slots: SmallVec<[Slot; INLINE_PATHS]>,
    /// Paths changed since the last query, each once.
    touched: SmallVec<[u16; INLINE_PATHS]>,
    /// The smallest of the deadlines and a path holding it.
    min: Micros,
    argmin: u16,
}

impl RtoDeadlines {
    pub(crate) fn new(n_paths: u16) -> Self {
        Self {
            slots: smallvec::smallvec![Slot { at: NONE, touched: false }; n_paths as usize],
            touched: SmallVec::new(),
            min: NONE,
            argmin: 0,
        }
    }

    /// Path `e`'s transmissions or RTT changed.
    #[inline]
    pub(crate) fn touch(&mut self, e: u16) {
        if let Some(s) = self.slots.get_mut(e as usize) {
            if !s.touched {
                s.touched = true;
                self.touched.push(e);
            }
        }
    }

    /// Every path changed.
    pub(crate) fn touch_all(&mut self) {
        for e in 0..self.slots.len() as u16 {
            self.touch(e);
        }
    }

    /// The earliest deadline of any path: the same as scanning `paths`.
    pub(crate) fn earliest(&mut self, paths: &[Path]) -> Option<Micros> {
        let mut rescan = false;
        for e in self.touched.drain(..) {
            let new = paths[e as usize].rto_deadline().unwrap_or(NONE);
            self.slots[e as usize] = Slot { at: new, touched: false };
            if new <= self.min {
                self.min = new;
                self.argmin = e;
            } else if e == self.argmin {
                rescan = true;
            }
        }
        if rescan {
            self.min = NONE;
            for (e, s) in self.slots.iter().enumerate() {
                if s.at < self.min {
                    self.min = s.at;
                    self.argmin = e as u16;
                }
            }
        }
        (self.min != NONE).then_some(self.min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::path::TxEntry;
    use crate::proto::rtt::RttEstimator;

    /// Random sends, acknowledgements, RTT samples and timeouts on 8 paths: after each step the cache
    /// gives the minimum a full scan gives, whichever path held it before.
    #[test]
    fn cached_minimum_follows_a_full_scan() {
        let mut paths: Vec<Path> = (0..8).map(|_| Path::new(RttEstimator::new(50, 10_000, 200))).collect();
        let mut cache = RtoDeadlines::new(8);
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rand = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut now = 0;
        let mut rescans_needed = 0;
        for step in 0..20_000u64 {
            now += rand(5);
            let e = rand(8) as u16;
            let p = &mut paths[e as usize];
            match rand(4) {
                0 | 1 => p.queue.push_back(TxEntry { tx_seq: step, psn: step, sent_at: now }),
                2 => {
                    p.queue.pop_front();
                }
                _ => {
                    if rand(2) == 0 {
                        p.rtt.sample(rand(400));
                    } else {
                        p.rtt.on_timeout();
                    }
                }
            }
            let before = cache.argmin;
            cache.touch(e);
            let scanned = paths.iter().filter_map(|p| p.rto_deadline()).min();
            assert_eq!(cache.earliest(&paths), scanned, "step {step}");
            rescans_needed += u32::from(e == before);
        }
        // The minimum's own path changed often enough to exercise the rescan.
        assert!(rescans_needed > 1_000, "{rescans_needed}");
    }
}
