//! Prism's transport: packet formats (`wire`), the sans-IO connection (`proto`), the UDP backend and the
//! engine that drives `proto` with a backend and a clock.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod proto;
pub mod wire;
pub mod engine;
