//! The event queue: a monotone radix heap ordered by time, events at the same picosecond in the order
//! they were scheduled, so a run is deterministic for a seed.

/// Simulated time in picoseconds (a u64 spans 213 days, far beyond any run).
pub type Ps = u64;

/// Picoseconds per microsecond (the protocol core's clock unit).
pub const PS_PER_US: u64 = 1_000_000;

/// Picoseconds per nanosecond.
pub const PS_PER_NS: u64 = 1_000;

/// What happens at an instant. Indices refer to the simulator's tables (ports, endpoints, hosts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Packet `pkt` finished crossing port `port` and reaches the port's far end.
    Arrive {
        /// Packet pool index.
        pkt: u32,
        /// The port (directed link) it crossed.
        port: u32,
    },
    /// Port `port` finished serialising its current packet and may start the next.
    PortFree {
        /// The port.
        port: u32,
    },
    /// The protocol timer of endpoint `ep` was due at the event's time.
    Timer {
        /// Endpoint index.
        ep: u32,
    },
    /// Sends of connection pair `pair` whose start delay (Ethereal's jitter) expired may be posted.
    Pump {
        /// Connection pair index.
        pair: u32,
    },
    /// Transfers of host `host` whose dependencies completed start now (one batch per host per instant).
    StartBatch {
        /// Host index.
        host: u32,
    },
    /// Port `port` changes state (fails, recovers or changes speed) as scheduled by the scenario.
    LinkChange {
        /// Index into the simulator's list of scheduled link changes.
        change: u32,
    },
    /// Take one sample of every queue (for the queue-over-time series).
    Sample,
}

/// A monotone radix heap: keys (times) never go below the last one popped, so an item's bucket is the
/// highest bit in which its time differs from that last time. Pushes are O(1); a pop empties at most one
/// bucket into lower ones. Items with equal times come out in the order they were pushed (bucket 0 is
/// consumed front to back, and redistribution keeps insertion order), which keeps runs deterministic and
/// same-instant events in scheduling order.
#[derive(Debug)]
pub struct EventQueue {
    last: Ps,
    buckets: Vec<Vec<(Ps, Event)>>,
    head0: usize,
    /// Bit b set: bucket b (b ≥ 1) may hold items (a scan for the next bucket is one instruction).
    nonempty: u128,
    len: usize,
    popped: u64,
}

impl Default for EventQueue {
    fn default() -> Self {
        Self {
            last: 0,
            buckets: (0..65).map(|_| Vec::new()).collect(),
            head0: 0,
            nonempty: 0,
            len: 0,
            popped: 0,
        }
    }
}

#[inline]
fn bucket(a: Ps, b: Ps) -> usize {
    (64 - (a ^ b).leading_zeros()) as usize
}

impl EventQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Schedule `ev` at time `at` (never before the last event popped: it is moved up to it).
    #[inline]
    pub fn push(&mut self, at: Ps, ev: Event) {
        let at = at.max(self.last);
        let b = bucket(at, self.last);
        self.buckets[b].push((at, ev));
        self.nonempty |= 1 << b;
        self.len += 1;
    }

    /// The earliest event, removed from the queue.
    #[inline]
    pub fn pop(&mut self) -> Option<(Ps, Event)> {
        if self.head0 == self.buckets[0].len() {
            self.buckets[0].clear();
            self.head0 = 0;
            let i = (1..self.buckets.len()).find(|&i| !self.buckets[i].is_empty())?;
            let items = std::mem::take(&mut self.buckets[i]);
            self.last = items
                .iter()
                .map(|x| x.0)
                .min()
                .expect("bucket is not empty");
            for &(at, ev) in &items {
                self.buckets[bucket(at, self.last)].push((at, ev));
            }
            // Give the emptied bucket its allocation back for the next time.
            let mut items = items;
            items.clear();
            if self.buckets[i].is_empty() {
                self.buckets[i] = items;
            }
        }
        let e = self.buckets[0][self.head0];
        self.head0 += 1;
        self.len -= 1;
        self.popped += 1;
        Some(e)
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no event waits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Events popped so far (the simulator's work counter).
    pub fn processed(&self) -> u64 {
        self.popped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_pop_in_time_order_and_ties_in_scheduling_order() {
        let mut q = EventQueue::new();
        q.push(30, Event::PortFree { port: 3 });
        q.push(10, Event::PortFree { port: 1 });
        q.push(10, Event::PortFree { port: 2 });
        q.push(20, Event::Sample);
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            order,
            vec![
                (10, Event::PortFree { port: 1 }),
                (10, Event::PortFree { port: 2 }),
                (20, Event::Sample),
                (30, Event::PortFree { port: 3 }),
            ]
        );
        assert_eq!(q.processed(), 4);
    }

    #[test]
    fn a_random_schedule_pops_sorted_and_stable_against_a_reference() {
        use rand::{rngs::SmallRng, Rng, SeedableRng};
        let seed = 11;
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut q = EventQueue::new();
        let mut reference: Vec<(Ps, u32)> = Vec::new();
        let mut now = 0;
        let mut id = 0u32;
        let mut out = Vec::new();
        for _ in 0..20_000 {
            if rng.gen_bool(0.55) {
                let at = now + rng.gen_range(0..3) * rng.gen_range(0..1_000_000u64);
                q.push(at, Event::PortFree { port: id });
                reference.push((at, id));
                id += 1;
            } else if let Some((t, Event::PortFree { port })) = q.pop() {
                assert!(t >= now, "seed {seed}: time went backwards");
                now = t;
                out.push((t, port));
            }
        }
        while let Some((t, Event::PortFree { port })) = q.pop() {
            out.push((t, port));
        }
        // Same multiset, and within one instant the pushing order.
        reference.sort_by_key(|&(t, _)| t);
        let mut sorted_out = out.clone();
        sorted_out.sort_by_key(|&(t, _)| t);
        assert_eq!(sorted_out, reference, "seed {seed}");
        for w in out.windows(2) {
            if w[0].0 == w[1].0 {
                assert!(w[0].1 < w[1].1, "seed {seed}: ties out of pushing order");
            }
        }
    }
}
