//! Rate layer: how many bytes a flow may have in flight. The transport asks for the window, reports
//! packet feedback and message completions; the controller only does arithmetic on what it is told.

mod mcc;

pub use mcc::{Congestion, Mcc, MccParams};

use crate::feedback::Feedback;

/// Which rate controller to run (`PRISM_CC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CcKind {
    /// No window: the transport's own limits apply.
    None,
    /// Message-level congestion control (seed 003).
    Mcc,
}

impl CcKind {
    /// The name as written in `PRISM_CC`.
    pub fn name(self) -> &'static str {
        match self {
            CcKind::None => "none",
            CcKind::Mcc => "mcc",
        }
    }
}

/// One completed message (MCC's "message": one plan chunk, or whatever unit the transport reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageSample {
    /// Bytes in the message.
    pub bytes: u64,
    /// When its first packet was sent, µs.
    pub sent_us: u64,
    /// When its last byte was acknowledged, µs.
    pub done_us: u64,
    /// Bytes the flow had in flight when it completed, this message included (how much of the window
    /// was used: a window that was not the limit says nothing about whether it could grow).
    pub in_flight: u64,
}

/// A per-flow rate controller.
pub trait RateController: Send {
    /// Short name as in `PRISM_CC`.
    fn name(&self) -> &'static str;
    /// Bytes the flow may have in flight now.
    fn window_bytes(&self) -> u64;
    /// Packet-level feedback (RTT samples come with `Feedback::Ack`).
    fn feedback(&mut self, _fb: &Feedback) {}
    /// A message completed.
    fn message_done(&mut self, _m: &MessageSample) {}
    /// A small JSON picture of the state, for stats.
    fn describe_state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// No rate control: an unlimited window.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoRate;

impl RateController for NoRate {
    fn name(&self) -> &'static str {
        "none"
    }

    fn window_bytes(&self) -> u64 {
        u64::MAX
    }
}
