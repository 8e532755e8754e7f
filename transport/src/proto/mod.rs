//! The sans-IO connection core.
