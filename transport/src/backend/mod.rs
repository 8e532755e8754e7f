//! Backends move datagrams; `proto` decides what they carry: UDP sockets, or verbs QPs (RoCEv2).

pub mod udp;
pub mod verbs;
