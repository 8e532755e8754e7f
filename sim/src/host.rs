//! What runs on a simulated host besides the protocol core: the path policy wrapper that hands a
//! connection's pinned uplink to `prism-lb` and taps its feedback for the rate controllers, and the
//! per-packet AIMD window used as the seed-003 baseline.

use std::sync::{Arc, Mutex};

use prism_lb::{Feedback, FlowPaths, PathCtx, PathPolicy, RateController};

/// The per-packet congestion window of the seed-003 baseline (DCQCN-like: it starts at the full window,
/// i.e. line rate): halve on a congested acknowledgement
/// (ECN echo or the transport's delay verdict) at most once per smoothed RTT, grow by one packet per
/// window of clean acknowledgements. Every path of the flow shares it, which is exactly the overreaction
/// MCC addresses: one congested path cuts the rate of all.
///
/// With `per_mark` it is instead the MPRDMA-style window of the REPS artifact (htsim's
/// `updateCwndOnAck_MPRDMA`): every congested acknowledgement takes a quarter of the acknowledged
/// packet off the window (no once-per-RTT gate), a clean one adds 1/cwnd, a loss or timeout one packet.
#[derive(Debug, Clone)]
pub struct PacketAimd {
    cwnd: f64,
    max: f64,
    srtt_us: f64,
    last_cut_us: Option<u64>,
    per_mark: bool,
    /// Cuts taken.
    pub cuts: u64,
}

impl PacketAimd {
    /// A window of `init` packets that never exceeds `max`.
    pub fn new(init: u32, max: u32) -> Self {
        Self { cwnd: init.max(1) as f64, max: max.max(1) as f64, srtt_us: 0.0, last_cut_us: None, per_mark: false, cuts: 0 }
    }

    /// The MPRDMA-style window (see the type's description).
    pub fn per_mark(init: u32, max: u32) -> Self {
        Self { per_mark: true, ..Self::new(init, max) }
    }

    /// Packets the flow may have in flight.
    pub fn window_pkts(&self) -> u32 {
        self.cwnd as u32
    }

    fn cut(&mut self, now_us: u64) {
        if self.per_mark {
            self.cwnd = (self.cwnd - 1.0).max(1.0);
            self.cuts += 1;
            return;
        }
        let gap = self.srtt_us.max(1.0) as u64;
        if self.last_cut_us.is_none_or(|t| now_us >= t + gap) {
            self.cwnd = (self.cwnd / 2.0).max(1.0);
            self.last_cut_us = Some(now_us);
            self.cuts += 1;
        }
    }

    /// Apply one feedback event.
    pub fn on_feedback(&mut self, fb: &Feedback) {
        match *fb {
            Feedback::Ack { rtt_us, congested, now_us, .. } => {
                let r = rtt_us as f64;
                self.srtt_us = if self.srtt_us == 0.0 { r } else { 0.875 * self.srtt_us + 0.125 * r };
                if congested && self.per_mark {
                    self.cwnd = (self.cwnd - 0.25).max(1.0);
                    self.cuts += 1;
                } else if congested {
                    self.cut(now_us);
                } else {
                    self.cwnd = (self.cwnd + 1.0 / self.cwnd).min(self.max);
                }
            }
            Feedback::Nack { now_us, .. } | Feedback::Timeout { now_us, .. } => self.cut(now_us),
            Feedback::PathState { .. } => {}
        }
    }
}

/// A rate controller shared by a connection's policy wrapper (which feeds it packet feedback) and the
/// host (which asks it for the window and reports message completions).
pub type SharedRate = Arc<Mutex<Box<dyn RateController>>>;

/// The per-packet window shared the same way.
pub type SharedAimd = Arc<Mutex<PacketAimd>>;

/// The policy a simulated connection runs: `prism-lb`'s flow policy, asked with the connection's
/// pinned uplink (one connection per Ethereal sub-flow), whose feedback is also tapped for the rate
/// controllers. The flow policy is held by value (not boxed): the connection reaches it through one
/// pointer, not two, on every pick and acknowledgement.
pub struct SimPolicy {
    inner: FlowPaths,
    pin: Option<u16>,
    rate: Option<SharedRate>,
    aimd: Option<SharedAimd>,
}

impl SimPolicy {
    /// Wrap `inner`, pinned to `pin`, tapping feedback into `rate` and `aimd`.
    pub fn new(inner: FlowPaths, pin: Option<u16>, rate: Option<SharedRate>, aimd: Option<SharedAimd>) -> Self {
        Self { inner, pin, rate, aimd }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PathPolicy for SimPolicy {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn pick(&mut self, ctx: &PathCtx) -> u16 {
        self.inner.pick_for(ctx, self.pin)
    }

    fn pick_for(&mut self, ctx: &PathCtx, uplink: Option<u16>) -> u16 {
        self.inner.pick_for(ctx, uplink.or(self.pin))
    }

    fn pick_fit(&mut self, ctx: &PathCtx, uplink: Option<u16>, fit: &mut dyn FnMut(u16) -> bool) -> Option<u16> {
        self.inner.pick_fit(ctx, uplink.or(self.pin), fit)
    }

    fn allows(&mut self, ctx: &PathCtx, uplink: Option<u16>, e: u16) -> bool {
        self.inner.allows(ctx, uplink.or(self.pin), e)
    }

    fn feedback(&mut self, fb: &Feedback) {
        self.inner.feedback(fb);
        if let Some(r) = &self.rate {
            lock(r).feedback(fb);
        }
        if let Some(a) = &self.aimd {
            lock(a).on_feedback(fb);
        }
    }

    fn describe_state(&self) -> serde_json::Value {
        self.inner.describe_state()
    }
}

/// Lock a shared controller (poisoning cannot happen in the single-threaded simulator, but is tolerated).
pub fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    lock(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(congested: bool, now_us: u64) -> Feedback {
        Feedback::Ack { entropy: 0, rtt_us: 10, congested, bytes: 4096, now_us }
    }

    #[test]
    fn aimd_halves_once_per_rtt_on_congestion() {
        let mut a = PacketAimd::new(64, 512);
        a.on_feedback(&ack(true, 100));
        a.on_feedback(&ack(true, 101));
        assert_eq!(a.window_pkts(), 32);
        a.on_feedback(&ack(true, 120));
        assert_eq!(a.window_pkts(), 16);
        assert_eq!(a.cuts, 2);
    }

    #[test]
    fn the_mprdma_window_loses_a_quarter_packet_per_mark_without_a_per_rtt_gate() {
        let mut a = PacketAimd::per_mark(64, 512);
        for i in 0..8 {
            a.on_feedback(&ack(true, 100 + i));
        }
        assert_eq!(a.window_pkts(), 62);
        a.on_feedback(&Feedback::Nack { entropy: 0, own_path: true, now_us: 110 });
        assert_eq!(a.window_pkts(), 61);
        for i in 0..1000 {
            a.on_feedback(&ack(true, 200 + i));
        }
        assert_eq!(a.window_pkts(), 1);
    }

    #[test]
    fn aimd_grows_by_one_packet_per_window_of_clean_acks() {
        let mut a = PacketAimd::new(10, 512);
        for i in 0..10 {
            a.on_feedback(&ack(false, i));
        }
        assert_eq!(a.window_pkts(), 10);
        for i in 0..12 {
            a.on_feedback(&ack(false, 20 + i));
        }
        assert!(a.window_pkts() >= 11, "{}", a.window_pkts());
    }
}
