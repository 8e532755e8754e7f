//! Backends move datagrams; `proto` decides what they carry. UDP today; verbs joins later.

pub mod udp;
