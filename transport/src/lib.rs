//! Prism's transport: packet formats (`wire`), the sans-IO connection (`proto`), the UDP backend and the
//! engine that drives `proto` with a backend and a clock.
// Only the verbs backend (`backend::verbs`) opts back in to `unsafe`.
#![deny(unsafe_code)]

pub mod backend;
pub mod engine;
pub mod proto;
pub mod wire;
