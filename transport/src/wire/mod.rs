//! Packet formats: parse/emit with checked lengths.
