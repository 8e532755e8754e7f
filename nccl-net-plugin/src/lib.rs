//! libnccl-net-prism.so: the NCCL net plugin ABI (v9 to v12) over Prism's transport.
//!
//! NCCL finds the tables in [`exports`] with `dlsym`; every function in them lives in [`entry`] and is
//! a thin, panic-proof shell around a safe API: [`global`] (the process-wide engine and its lifetime),
//! [`comm`] (the objects NCCL holds), [`requests`], [`mr`], [`buf`] (the only reads and writes of
//! NCCL's memory), [`config`] and [`log`]. All of Prism's FFI `unsafe` is in this crate.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod abi;
pub mod buf;
pub mod comm;
pub mod config;
pub mod entry;
pub mod error;
pub mod exports;
pub mod global;
pub mod handle;
pub mod log;
pub mod mr;
pub mod requests;
