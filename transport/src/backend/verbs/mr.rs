//! The registration cache: NCCL registers the same buffer again and again; one MR per range,
//! reference-counted.

use std::collections::BTreeMap;

/// Registrations keyed by (address, length), reference-counted: NCCL registers the same buffer many
/// times; the memory is deregistered with the last release.
#[derive(Debug)]
pub struct MrCache<M> {
    entries: BTreeMap<(usize, usize), (M, u32)>,
}

impl<M> Default for MrCache<M> {
    fn default() -> Self {
        Self { entries: BTreeMap::new() }
    }
}

impl<M> MrCache<M> {
    /// Take a reference on the registration of exactly `(addr, len)`, registering it with `reg` if new.
    pub fn acquire<E>(&mut self, addr: usize, len: usize, reg: impl FnOnce() -> Result<M, E>) -> Result<&M, E> {
        use std::collections::btree_map::Entry;
        match self.entries.entry((addr, len)) {
            Entry::Occupied(o) => {
                let v = o.into_mut();
                v.1 += 1;
                Ok(&v.0)
            }
            Entry::Vacant(v) => Ok(&v.insert((reg()?, 1)).0),
        }
    }

    /// Drop a reference; returns the registration when it was the last one (the caller drops it,
    /// which deregisters). `None` also for a range that was never acquired.
    pub fn release(&mut self, addr: usize, len: usize) -> Option<M> {
        let e = self.entries.get_mut(&(addr, len))?;
        e.1 -= 1;
        if e.1 == 0 {
            self.entries.remove(&(addr, len)).map(|(m, _)| m)
        } else {
            None
        }
    }

    /// A registration that covers `addr..addr + len`, with its key.
    pub fn covering(&self, addr: usize, len: usize) -> Option<((usize, usize), &M)> {
        let end = addr.checked_add(len)?;
        // Entries start at or before addr; the covering one may be any of them (ranges may nest).
        self.entries
            .range(..=(addr, usize::MAX))
            .rev()
            .find(|((a, l), _)| *a <= addr && a.checked_add(*l).is_some_and(|e| e >= end))
            .map(|(k, (m, _))| (*k, m))
    }

    /// Number of distinct registrations.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// References held on `(addr, len)` (tests only).
    #[cfg(test)]
    pub fn refs(&self, addr: usize, len: usize) -> u32 {
        self.entries.get(&(addr, len)).map_or(0, |e| e.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mr_cache_counts_references_and_releases_on_the_last() {
        let mut c: MrCache<u32> = MrCache::default();
        let mut regs = 0;
        let mut reg = || -> Result<u32, ()> {
            regs += 1;
            Ok(regs)
        };
        assert_eq!(*c.acquire(0x1000, 0x100, &mut reg).unwrap(), 1);
        assert_eq!(*c.acquire(0x1000, 0x100, &mut reg).unwrap(), 1);
        assert_eq!(regs, 1, "same range registers once");
        assert_eq!(c.refs(0x1000, 0x100), 2);
        assert_eq!(c.release(0x1000, 0x100), None);
        assert_eq!(c.release(0x1000, 0x100), Some(1));
        assert!(c.is_empty());
        assert_eq!(c.release(0x1000, 0x100), None, "unknown ranges are ignored");
    }

    #[test]
    fn mr_cache_finds_a_covering_registration() {
        let mut c: MrCache<&str> = MrCache::default();
        c.acquire(0x1000, 0x1000, || Ok::<_, ()>("big")).unwrap();
        c.acquire(0x1800, 0x10, || Ok::<_, ()>("small")).unwrap();
        assert_eq!(c.covering(0x1000, 0x1000).map(|(_, m)| *m), Some("big"));
        assert_eq!(c.covering(0x1900, 0x100).map(|(_, m)| *m), Some("big"));
        assert_eq!(c.covering(0x1800, 0x8).map(|(_, m)| *m), Some("small"));
        assert_eq!(c.covering(0x1f00, 0x200), None, "crosses the end");
        assert_eq!(c.covering(0xf00, 0x200), None, "starts before");
        assert_eq!(c.covering(usize::MAX, 2), None);
    }

    #[test]
    fn deregistering_a_buffer_whose_request_is_in_flight_keeps_the_registration_until_the_request_ends() {
        // NCCL's regMr, then a request on a buffer inside it (takes its own reference on the covering
        // registration), then NCCL's deregMr with the request still in flight.
        let mut c: MrCache<&str> = MrCache::default();
        c.acquire(0x1000, 0x1000, || Ok::<_, ()>("nccl")).unwrap();
        let (key, _) = c.covering(0x1100, 0x100).unwrap();
        c.acquire(key.0, key.1, || Ok::<_, ()>("unused")).unwrap();
        assert_eq!(c.release(0x1000, 0x1000), None, "the request still holds the registration");
        assert_eq!(c.refs(0x1000, 0x1000), 1);
        assert_eq!(c.release(key.0, key.1), Some("nccl"), "the request's end deregisters");
        assert!(c.is_empty());
        assert_eq!(c.release(0x1000, 0x1000), None, "a second release is ignored");
    }

    #[test]
    fn a_failed_registration_leaves_nothing_behind() {
        let mut c: MrCache<u32> = MrCache::default();
        assert!(c.acquire(0x1000, 1, || Err::<u32, _>("EFAULT")).is_err());
        assert!(c.is_empty());
    }
}
