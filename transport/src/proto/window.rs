//! The receiver's out-of-order window: which PSNs arrived, as a cumulative PSN plus a ring of bits
//! covering the next [`OOO_WINDOW_PKTS`] PSNs. Arrivals beyond the ring are refused (the sender never
//! sends that far ahead), so memory stays fixed whatever the peer sends.

use super::OOO_WINDOW_PKTS;
use crate::wire::SACK_BITMAP_PSNS;

const WORDS: usize = (OOO_WINDOW_PKTS / 64) as usize;
const _: () = assert!(OOO_WINDOW_PKTS & 63 == 0 && OOO_WINDOW_PKTS >= SACK_BITMAP_PSNS);

/// How an arriving PSN relates to the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// Not seen before and inside the window.
    New,
    /// Already arrived (below the cumulative PSN, or its bit is set).
    Duplicate,
    /// Too far above the cumulative PSN to be tracked.
    BeyondWindow,
}

#[derive(Debug, Clone)]
pub(crate) struct PsnWindow {
    /// Every PSN below this arrived.
    cum: u64,
    /// One past the highest PSN that arrived (at least `cum`).
    end: u64,
    /// Bit `p % 64` of word `(p / 64) % WORDS` is PSN `p`, for `p` in `cum .. cum + OOO_WINDOW_PKTS`.
    bits: [u64; WORDS],
}

impl PsnWindow {
    pub(crate) fn new() -> Self {
        Self { cum: 0, end: 0, bits: [0; WORDS] }
    }

    /// Every PSN below this arrived.
    pub(crate) fn cum(&self) -> u64 {
        self.cum
    }

    /// One past the highest PSN that arrived.
    pub(crate) fn end(&self) -> u64 {
        self.end
    }

    fn slot(psn: u64) -> (usize, u64) {
        (((psn / 64) % WORDS as u64) as usize, psn % 64)
    }

    pub(crate) fn classify(&self, psn: u64) -> Arrival {
        if psn < self.cum {
            return Arrival::Duplicate;
        }
        if psn - self.cum >= OOO_WINDOW_PKTS {
            return Arrival::BeyondWindow;
        }
        let (w, b) = Self::slot(psn);
        if self.bits[w] >> b & 1 == 1 {
            Arrival::Duplicate
        } else {
            Arrival::New
        }
    }

    /// Record the arrival of a PSN that `classify` called `New`.
    pub(crate) fn insert(&mut self, psn: u64) {
        debug_assert_eq!(self.classify(psn), Arrival::New);
        let (w, b) = Self::slot(psn);
        self.bits[w] |= 1 << b;
        self.end = self.end.max(psn + 1);
        if psn == self.cum {
            self.advance();
        }
    }

    /// Move `cum` over the run of arrived PSNs at its position, clearing their bits for reuse.
    fn advance(&mut self) {
        loop {
            let (w, b) = Self::slot(self.cum);
            let run = (!(self.bits[w] >> b)).trailing_zeros() as u64;
            if run == 0 {
                return;
            }
            let mask = if run == 64 { u64::MAX } else { ((1u64 << run) - 1) << b };
            self.bits[w] &= !mask;
            self.cum += run;
            if b + run < 64 {
                return;
            }
        }
    }

    /// 64 arrival bits starting at PSN `start` (bit k = PSN start + k), zero outside the window.
    fn word_at(&self, start: u64) -> u64 {
        let limit = self.cum + OOO_WINDOW_PKTS;
        if start < self.cum || start >= limit {
            return 0;
        }
        let (w, s) = Self::slot(start);
        let mut word = self.bits[w] >> s;
        if s != 0 {
            word |= self.bits[(w + 1) % WORDS] << (64 - s);
        }
        if limit - start < 64 {
            word &= (1u64 << (limit - start)) - 1;
        }
        word
    }

    /// The bitmap of a SACK triggered by PSN `trigger`: it ends at the highest arrival unless the
    /// trigger lies below that span, in which case it starts at the trigger, so the SACK always reports
    /// the packet whose timestamp it echoes. Returns (base, words).
    pub(crate) fn sack_bitmap(&self, trigger: u64) -> (u64, [u64; 4]) {
        let hi_base = self.end.saturating_sub(SACK_BITMAP_PSNS).max(self.cum);
        let base = if trigger >= hi_base { hi_base } else { trigger.max(self.cum) };
        let words = [self.word_at(base), self.word_at(base + 64), self.word_at(base + 128), self.word_at(base + 192)];
        (base, words)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrived(base: u64, words: &[u64; 4]) -> Vec<u64> {
        (0..256u64).filter(|i| words[(i / 64) as usize] >> (i % 64) & 1 == 1).map(|i| base + i).collect()
    }

    #[test]
    fn in_order_arrivals_advance_the_cumulative_psn() {
        let mut w = PsnWindow::new();
        for p in 0..200 {
            assert_eq!(w.classify(p), Arrival::New);
            w.insert(p);
        }
        assert_eq!((w.cum(), w.end()), (200, 200));
        assert_eq!(w.classify(10), Arrival::Duplicate);
    }

    #[test]
    fn a_hole_holds_the_cumulative_psn_until_it_is_filled() {
        let mut w = PsnWindow::new();
        for p in (0..300).filter(|&p| p != 5) {
            w.insert(p);
        }
        assert_eq!((w.cum(), w.end()), (5, 300));
        assert_eq!(w.classify(6), Arrival::Duplicate);
        w.insert(5);
        assert_eq!(w.cum(), 300);
    }

    #[test]
    fn arrivals_beyond_the_window_are_refused() {
        let w = PsnWindow::new();
        assert_eq!(w.classify(OOO_WINDOW_PKTS - 1), Arrival::New);
        assert_eq!(w.classify(OOO_WINDOW_PKTS), Arrival::BeyondWindow);
    }

    #[test]
    fn ring_bits_are_reused_after_the_window_slides() {
        let mut w = PsnWindow::new();
        for p in 0..3 * OOO_WINDOW_PKTS + 17 {
            w.insert(p);
        }
        // A PSN aliasing an old slot must look new, not like its predecessor.
        let p = w.cum() + OOO_WINDOW_PKTS - 1;
        assert_eq!(w.classify(p), Arrival::New);
        w.insert(p);
        let (base, words) = w.sack_bitmap(p);
        assert_eq!(arrived(base, &words), vec![p]);
    }

    #[test]
    fn sack_bitmap_reports_exactly_the_out_of_order_arrivals() {
        let mut w = PsnWindow::new();
        let got = [0u64, 1, 2, 70, 71, 130, 255];
        for &p in &got {
            w.insert(p);
        }
        let (base, words) = w.sack_bitmap(255);
        assert_eq!(base, 3);
        assert_eq!(arrived(base, &words), vec![70, 71, 130, 255]);
    }

    #[test]
    fn sack_bitmap_follows_the_highest_arrival_or_an_older_trigger() {
        let mut w = PsnWindow::new();
        w.insert(10);
        w.insert(1000);
        assert_eq!(w.sack_bitmap(1000).0, 1000 - 255);
        let (base, words) = w.sack_bitmap(10);
        assert_eq!(base, 10);
        assert_eq!(arrived(base, &words), vec![10]);
    }
}
