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

/// Ports an `Arrive` event can name: its port is packed in 29 bits (see [`Packed`]).
pub const MAX_PORTS: usize = 1 << 29;

/// Bits above an event's fields: its kind.
const TAG_SHIFT: u32 = 61;

/// An event in 8 bytes (kind in the top 3 bits; an `Arrive`'s port above its packet), so a queued item
/// with its time takes 16 bytes instead of 24: the queue moves each item two or three times.
#[derive(Debug, Clone, Copy)]
struct Packed(u64);

impl Packed {
    #[inline(always)]
    fn new(ev: Event) -> Self {
        let (tag, v): (u64, u64) = match ev {
            Event::Arrive { pkt, port } => {
                debug_assert!((port as usize) < MAX_PORTS);
                (0, (port as u64) << 32 | pkt as u64)
            }
            Event::PortFree { port } => (1, port as u64),
            Event::Timer { ep } => (2, ep as u64),
            Event::Pump { pair } => (3, pair as u64),
            Event::StartBatch { host } => (4, host as u64),
            Event::LinkChange { change } => (5, change as u64),
            Event::Sample => (6, 0),
        };
        Self(tag << TAG_SHIFT | v)
    }

    #[inline(always)]
    fn get(self) -> Event {
        let v = self.0 & ((1 << TAG_SHIFT) - 1);
        let lo = v as u32;
        match self.0 >> TAG_SHIFT {
            0 => Event::Arrive { pkt: lo, port: (v >> 32) as u32 },
            1 => Event::PortFree { port: lo },
            2 => Event::Timer { ep: lo },
            3 => Event::Pump { pair: lo },
            4 => Event::StartBatch { host: lo },
            5 => Event::LinkChange { change: lo },
            _ => Event::Sample,
        }
    }
}

/// Bits of time per digit of the radix heap: 256 slots per level, marked busy in four words. A packet's
/// next hop (0.5 µs ahead) lands two levels up and a protocol timer (50 µs and more) three, so an
/// item moves two or three times (with 6-bit digits, three or four).
const DIGIT_BITS: u32 = 8;
/// Slots per level (one per digit value).
const SLOTS: usize = 1 << DIGIT_BITS;
/// Words of a level's busy-slot bitmap.
const WORDS: usize = SLOTS / 64;
/// Levels: 64-bit times in 8-bit digits.
const LEVELS: usize = 8;

/// A monotone radix heap with 8-bit digits (a hierarchical timing wheel): keys (times) never go below
/// the last one popped (`last`), and an item sits in the slot (level `l` ≥ 1, digit `d`) where `l` is
/// the highest digit in which its time differs from `last` and `d` is its time's digit there. Items
/// that differ from `last` in the lowest digit only (the current window of 256 ps) are kept sorted in
/// `near` and consumed front to back; when `near` is exhausted, the lowest non-empty slot is emptied
/// around its earliest time: its items of the new window go to `near` (sorted, stably), the others
/// one level down or more. An item moves at most once per level (a packet's next hop, 0.5 µs ahead,
/// lands on level 2 and moves at most twice; a timer, 50 µs and more, on level 3),
/// pushes are O(1), and the next non-empty slot is found with bit masks. Items with equal times come
/// out in the order they were pushed (equal times always share a slot or `near`, redistribution keeps
/// insertion order, the sort is stable and a push into `near` goes after every item not later than
/// it), which keeps runs deterministic and same-instant events in scheduling order.
#[derive(Debug)]
pub struct EventQueue {
    last: Ps,
    /// `LEVELS × SLOTS` slots, level-major (a power of two: indices are masked, not bounds-checked);
    /// level 0's are unused (`near` holds that level).
    slots: Box<[Vec<(Ps, Packed)>; LEVELS * SLOTS]>,
    /// Per level, bit `d % 64` of word `d / 64` set: slot `d` holds items.
    bits: [[u64; WORDS]; LEVELS],
    /// Bit `l` set: level `l` may hold items.
    levels: u32,
    /// The items of `last`'s window, sorted by time (ties in pushing order); `near[..head]` are popped.
    near: Vec<(Ps, Packed)>,
    head: usize,
    len: usize,
    popped: u64,
}

impl Default for EventQueue {
    fn default() -> Self {
        Self {
            last: 0,
            slots: Box::new(std::array::from_fn(|_| Vec::new())),
            bits: [[0; WORDS]; LEVELS],
            levels: 0,
            near: Vec::new(),
            head: 0,
            len: 0,
            popped: 0,
        }
    }
}

/// The slot (level, digit) of time `at` relative to `last` (`at >= last`).
#[inline]
fn slot_of(at: Ps, last: Ps) -> (usize, usize) {
    let x = at ^ last;
    let level = if x == 0 { 0 } else { ((63 - x.leading_zeros()) / DIGIT_BITS) as usize };
    let digit = ((at >> (level as u32 * DIGIT_BITS)) as usize) & (SLOTS - 1);
    (level, digit)
}

impl EventQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Put an item of level `l` ≥ 1 in its slot.
    #[inline]
    fn put(&mut self, l: usize, d: usize, at: Ps, ev: Packed) {
        self.slots[(l * SLOTS + d) & (LEVELS * SLOTS - 1)].push((at, ev));
        self.bits[l & (LEVELS - 1)][(d / 64) & (WORDS - 1)] |= 1 << (d % 64);
        self.levels |= 1 << l;
    }

    /// The lowest set digit of level `l`, if any.
    #[inline]
    fn first_digit(&self, l: usize) -> Option<usize> {
        let words = &self.bits[l & (LEVELS - 1)];
        (0..WORDS).find(|&i| words[i] != 0).map(|i| i * 64 + words[i].trailing_zeros() as usize)
    }

    #[inline]
    fn clear_bit(&mut self, l: usize, d: usize) {
        let bits = &mut self.bits[l & (LEVELS - 1)];
        bits[(d / 64) & (WORDS - 1)] &= !(1 << (d % 64));
        if bits.iter().all(|&w| w == 0) {
            self.levels &= !(1 << l);
        }
    }

    /// Schedule `ev` at time `at` (never before the last event popped: it is moved up to it).
    #[inline(always)]
    pub fn push(&mut self, at: Ps, ev: Event) {
        let at = at.max(self.last);
        let (l, d) = slot_of(at, self.last);
        if l == 0 {
            self.push_near(at, Packed::new(ev));
        } else {
            self.put(l, d, at, Packed::new(ev));
        }
        self.len += 1;
    }

    /// Insert into `near` after every item not later than `at` (rare: events are seldom scheduled
    /// less than 256 ps ahead).
    #[cold]
    fn push_near(&mut self, at: Ps, ev: Packed) {
        let pos = self.head + self.near[self.head..].partition_point(|x| x.0 <= at);
        self.near.insert(pos, (at, ev));
    }

    /// The earliest event, removed from the queue.
    #[inline]
    pub fn pop(&mut self) -> Option<(Ps, Event)> {
        loop {
            if let Some(&(at, ev)) = self.near.get(self.head) {
                self.head += 1;
                self.last = at;
                self.len -= 1;
                self.popped += 1;
                return Some((at, ev.get()));
            }
            self.refill()?;
        }
    }

    /// `near` is exhausted: empty the lowest non-empty slot around its earliest time, which becomes
    /// `last`.
    #[cold]
    fn refill(&mut self) -> Option<()> {
        self.near.clear();
        self.head = 0;
        if self.levels == 0 {
            return None;
        }
        let l = self.levels.trailing_zeros() as usize;
        let d = self.first_digit(l).expect("level bit set");
        let idx = (l * SLOTS + d) & (LEVELS * SLOTS - 1);
        let mut items = std::mem::take(&mut self.slots[idx]);
        self.clear_bit(l, d);
        self.last = items.iter().map(|x| x.0).min().expect("slot bit set");
        // Every item lands below level `l` (it shares digits above `l` with the new `last`).
        for &(at, ev) in &items {
            match slot_of(at, self.last) {
                (0, _) => self.near.push((at, ev)),
                (ll, dd) => self.put(ll, dd, at, ev),
            }
        }
        items.clear();
        self.slots[idx] = items;
        if self.near.len() > 1 {
            // Stable: equal times keep their order.
            self.near.sort_by_key(|x| x.0);
        }
        Some(())
    }

    /// The event `pop` will return next, if it is already in the current window (the usual case).
    #[inline]
    pub fn peek_near(&self) -> Option<Event> {
        self.near.get(self.head).map(|e| e.1.get())
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
    use rand::Rng;

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
    fn every_event_survives_packing() {
        let events = [
            Event::Arrive { pkt: u32::MAX, port: (MAX_PORTS - 1) as u32 },
            Event::Arrive { pkt: 7, port: 0 },
            Event::PortFree { port: u32::MAX },
            Event::Timer { ep: 123_456 },
            Event::Pump { pair: u32::MAX - 1 },
            Event::StartBatch { host: 0 },
            Event::LinkChange { change: 9 },
            Event::Sample,
        ];
        for ev in events {
            assert_eq!(Packed::new(ev).get(), ev);
        }
    }

    #[test]
    fn pushes_into_the_current_window_go_after_equal_times_and_before_later_ones() {
        let mut q = EventQueue::new();
        let ev = |port| Event::PortFree { port };
        q.push(1_000, ev(1));
        q.push(1_000, ev(2));
        q.push(1_010, ev(3));
        q.push(5_000_000, ev(9));
        assert_eq!(q.pop(), Some((1_000, ev(1))));
        // Same instant as a waiting item, then a few ps later, then before `last` (moved up to it).
        q.push(1_000, ev(4));
        q.push(1_005, ev(5));
        q.push(10, ev(6));
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, vec![(1_000, ev(2)), (1_000, ev(4)), (1_000, ev(6)), (1_005, ev(5)), (1_010, ev(3)), (5_000_000, ev(9))]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_random_schedule_pops_sorted_and_stable_against_a_reference() {
        check_against_reference(11, |rng, now| now + rng.gen_range(0..3) * rng.gen_range(0..1_000_000u64));
    }

    #[test]
    fn times_spread_over_many_digits_pop_sorted_and_stable() {
        // Offsets of a few ps land in the window being consumed, among waiting items.
        check_against_reference(13, |rng, now| now + rng.gen_range(0..300u64));
        // Offsets from 0 to 2^44 ps, many of them equal, cross every level boundary of the heap.
        check_against_reference(12, |rng, now| {
            let shift = rng.gen_range(0..44);
            now + (rng.gen_range(0..4u64) << shift)
        });
    }

    fn check_against_reference(seed: u64, next: impl Fn(&mut rand::rngs::SmallRng, Ps) -> Ps) {
        use rand::{rngs::SmallRng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut q = EventQueue::new();
        let mut reference: Vec<(Ps, u32)> = Vec::new();
        let mut now = 0;
        let mut id = 0u32;
        let mut out = Vec::new();
        for _ in 0..20_000 {
            if rng.gen_bool(0.55) {
                let at = next(&mut rng, now);
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
            assert!(w[0].0 <= w[1].0, "seed {seed}: popped out of time order");
            if w[0].0 == w[1].0 {
                assert!(w[0].1 < w[1].1, "seed {seed}: ties out of pushing order");
            }
        }
    }
}
