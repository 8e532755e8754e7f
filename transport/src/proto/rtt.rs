//! RTT estimation and retransmission timeout, RFC 6298 style (SRTT/RTTVAR, clamped, exponential backoff).

/// Smoothed RTT, its variation and the retransmission timeout derived from them.
#[derive(Debug, Clone)]
pub(crate) struct RttEstimator {
    srtt_us: Option<u64>,
    rttvar_us: u64,
    backoff: u32,
    rto_min_us: u64,
    rto_max_us: u64,
    rto_initial_us: u64,
}

/// Doublings of the RTO after consecutive timeouts; beyond this `rto_max` has long been reached.
const MAX_BACKOFF: u32 = 16;

impl RttEstimator {
    pub(crate) fn new(rto_min_us: u64, rto_max_us: u64, rto_initial_us: u64) -> Self {
        Self { srtt_us: None, rttvar_us: 0, backoff: 0, rto_min_us, rto_max_us, rto_initial_us }
    }

    /// Fold in one unambiguous RTT sample; a fresh sample also ends any backoff (the path answers).
    pub(crate) fn sample(&mut self, rtt_us: u64) {
        match self.srtt_us {
            None => {
                self.srtt_us = Some(rtt_us);
                self.rttvar_us = rtt_us / 2;
            }
            Some(srtt) => {
                self.rttvar_us = (3 * self.rttvar_us + srtt.abs_diff(rtt_us)) / 4;
                self.srtt_us = Some((7 * srtt + rtt_us) / 8);
            }
        }
        self.backoff = 0;
    }

    /// A timeout fired: double the RTO until the next sample.
    pub(crate) fn on_timeout(&mut self) {
        self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
    }

    /// The current retransmission timeout, backoff included, within `[rto_min, rto_max]`.
    pub(crate) fn rto_us(&self) -> u64 {
        self.base_rto_us().saturating_mul(1 << self.backoff).min(self.rto_max_us)
    }

    /// The retransmission timeout without backoff, within `[rto_min, rto_max]`.
    fn base_rto_us(&self) -> u64 {
        let base = match self.srtt_us {
            // The clock granularity G of RFC 6298 is 1 µs here.
            Some(srtt) => srtt + (4 * self.rttvar_us).max(1),
            None => self.rto_initial_us,
        };
        base.clamp(self.rto_min_us, self.rto_max_us)
    }

    /// Until its first sample, use `from`'s current RTO (clamped) instead of the configured initial
    /// one: a path nothing was measured on yet borrows what its connection measured on the others.
    pub(crate) fn inherit_initial(&mut self, from: &RttEstimator) {
        if self.srtt_us.is_none() {
            self.rto_initial_us = from.rto_us().clamp(self.rto_min_us, self.rto_max_us);
        }
    }

    /// Smoothed RTT, if any sample was taken.
    pub(crate) fn srtt_us(&self) -> Option<u64> {
        self.srtt_us
    }

    /// SRTT plus `k` RTT variations, if any sample was taken.
    pub(crate) fn srtt_plus_var_us(&self, k: u64) -> Option<u64> {
        self.srtt_us.map(|s| s + k * self.rttvar_us)
    }

    /// When a packet sent now should have arrived at the latest, by this estimate alone: SRTT plus
    /// four RTT variations (the RTO without floor, ceiling or backoff), if any sample was taken.
    pub(crate) fn expected_us(&self) -> Option<u64> {
        self.srtt_plus_var_us(4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rto_is_the_initial_value_before_any_sample() {
        assert_eq!(RttEstimator::new(2_000, 200_000, 10_000).rto_us(), 10_000);
    }

    #[test]
    fn first_sample_sets_srtt_and_half_rttvar() {
        let mut r = RttEstimator::new(1, 1_000_000, 10_000);
        r.sample(1_000);
        // RTO = SRTT + 4 * RTTVAR = 1000 + 4 * 500.
        assert_eq!((r.srtt_us(), r.rto_us()), (Some(1_000), 3_000));
    }

    #[test]
    fn later_samples_are_smoothed_with_gains_one_eighth_and_one_quarter() {
        let mut r = RttEstimator::new(1, 1_000_000, 10_000);
        r.sample(800);
        r.sample(1_600);
        // RTTVAR = (3*400 + |800-1600|)/4 = 500; SRTT = (7*800 + 1600)/8 = 900.
        assert_eq!((r.srtt_us(), r.rto_us()), (Some(900), 2_900));
    }

    #[test]
    fn rto_is_clamped_to_its_minimum_and_maximum() {
        let mut r = RttEstimator::new(2_000, 50_000, 10_000);
        r.sample(10);
        assert_eq!(r.rto_us(), 2_000);
        r.sample(1_000_000);
        assert_eq!(r.rto_us(), 50_000);
    }

    #[test]
    fn an_unsampled_estimator_takes_an_inherited_initial_rto_until_its_first_sample() {
        let rto_of = |us: u64| RttEstimator::new(1, 10_000_000, us);
        let mut r = RttEstimator::new(2_000, 200_000, 10_000);
        r.inherit_initial(&rto_of(45_000));
        assert_eq!(r.rto_us(), 45_000);
        r.on_timeout();
        assert_eq!(r.rto_us(), 90_000, "backoff applies to the inherited value");
        r.inherit_initial(&rto_of(1_000_000));
        assert_eq!(r.base_rto_us(), 200_000, "clamped to rto_max");
        r.sample(1_000);
        r.inherit_initial(&rto_of(45_000));
        assert_eq!(r.rto_us(), 3_000, "a sampled estimator keeps its own RTO");
    }

    #[test]
    fn timeouts_double_the_rto_until_a_sample_arrives() {
        let mut r = RttEstimator::new(2_000, 200_000, 10_000);
        r.on_timeout();
        r.on_timeout();
        assert_eq!(r.rto_us(), 40_000);
        for _ in 0..40 {
            r.on_timeout();
        }
        assert_eq!(r.rto_us(), 200_000);
        r.sample(1_000);
        assert_eq!(r.rto_us(), 3_000);
    }
}
