//! The plugin's errors and the NCCL result code each one becomes.
//!
//! Codes follow NCCL's guidance for plugins: `ncclSystemError` (2) when the system or network failed,
//! `ncclInternalError` (3) when NCCL called the plugin in a way it cannot serve, `ncclInvalidArgument` (4)
//! for a configuration value that cannot be used, `ncclInvalidUsage` (5) for a send larger than the
//! posted receive, `ncclRemoteError` (6) for a request the peer or the path failed.

use prism_transport::engine::TransportError;

use crate::abi::{NcclResult, NCCL_INTERNAL_ERROR, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_REMOTE_ERROR, NCCL_SYSTEM_ERROR};

/// Everything an entry point can fail with. Each message says what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The transport refused or failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A load-balancing variable has an unusable value.
    #[error("{0}")]
    LbConfig(#[from] prism_lb::ConfigError),
    /// `PRISM_*` variables nobody understands (most likely typos).
    #[error("unknown configuration variable(s) {names}; known: {known}")]
    UnknownVars {
        /// The unknown names, comma-separated.
        names: String,
        /// The names Prism understands, comma-separated.
        known: String,
    },
    /// A plugin variable (not the transport's or the load balancer's) with an unusable value.
    #[error("{var}={value}: {reason}")]
    BadValue {
        /// The variable.
        var: &'static str,
        /// Its value as set.
        value: String,
        /// What it accepts.
        reason: &'static str,
    },
    /// A `PRISM_*` variable whose value is not UTF-8.
    #[error("{0}: value is not valid UTF-8")]
    NotUtf8(String),
    /// NCCL passed an argument the plugin cannot use (NULL pointer, foreign object, count out of range).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A call that needs `init` came first, or after the last `finalize`.
    #[error("{0} called before init (or after the last finalize)")]
    NotInitialized(&'static str),
    /// A memory type this build cannot register.
    #[error("{0}")]
    Unsupported(String),
    /// A completed size does not fit the `int` NCCL's `test` reports it in.
    #[error("completed size {0} bytes does not fit in an int; NCCL must not post messages above 2 GiB - 1")]
    SizeTooLarge(usize),
    /// Prism's own code panicked; the panic was stopped at the C boundary.
    #[error("internal error (panic: {0})")]
    Panic(String),
}

impl PluginError {
    /// The `ncclResult_t` NCCL gets for this error.
    pub fn code(&self) -> NcclResult {
        match self {
            PluginError::Transport(e) => match e {
                TransportError::Config(_) => NCCL_INVALID_ARGUMENT,
                TransportError::InvalidArgument(_)
                | TransportError::BadHandle(_)
                | TransportError::BadDevice { .. }
                | TransportError::UnknownRequest(_) => NCCL_INTERNAL_ERROR,
                TransportError::Io { .. }
                | TransportError::NoDevice(_)
                | TransportError::HandshakeTimeout { .. }
                | TransportError::ConnectionFailed(_) => NCCL_SYSTEM_ERROR,
                TransportError::Truncated(_) => NCCL_INVALID_USAGE,
                TransportError::RequestFailed(_) => NCCL_REMOTE_ERROR,
            },
            PluginError::LbConfig(_) | PluginError::UnknownVars { .. } | PluginError::BadValue { .. } | PluginError::NotUtf8(_) => {
                NCCL_INVALID_ARGUMENT
            }
            PluginError::InvalidArgument(_)
            | PluginError::NotInitialized(_)
            | PluginError::Unsupported(_)
            | PluginError::SizeTooLarge(_)
            | PluginError::Panic(_) => NCCL_INTERNAL_ERROR,
        }
    }
}

/// Shorthand for an [`PluginError::InvalidArgument`].
pub fn invalid(msg: impl Into<String>) -> PluginError {
    PluginError::InvalidArgument(msg.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_truncated_request_is_invalid_usage() {
        let e = PluginError::from(TransportError::Truncated("10000 > 4096".into()));
        assert_eq!(e.code(), 5);
    }

    #[test]
    fn any_other_failed_request_is_a_remote_error() {
        let e = PluginError::from(TransportError::RequestFailed("peer closed".into()));
        assert_eq!(e.code(), 6);
    }

    #[test]
    fn network_and_system_failures_are_system_errors() {
        let io = TransportError::Io { what: "bind".into(), source: std::io::Error::other("x") };
        for e in [
            io,
            TransportError::NoDevice("none".into()),
            TransportError::HandshakeTimeout { peer: "p".into(), ms: 1 },
            TransportError::ConnectionFailed("gone".into()),
        ] {
            assert_eq!(PluginError::from(e).code(), 2);
        }
    }

    #[test]
    fn nccl_misuse_is_an_internal_error() {
        for e in [
            TransportError::InvalidArgument("x".into()),
            TransportError::BadHandle("x".into()),
            TransportError::BadDevice { dev: 9, ndev: 1 },
            TransportError::UnknownRequest(4),
        ] {
            assert_eq!(PluginError::from(e).code(), 3);
        }
        assert_eq!(invalid("n = 0").code(), 3);
        assert_eq!(PluginError::SizeTooLarge(1 << 31).code(), 3);
    }

    #[test]
    fn bad_configuration_is_an_invalid_argument() {
        assert_eq!(PluginError::from(TransportError::Config("PRISM_X=0".into())).code(), 4);
        assert_eq!(PluginError::UnknownVars { names: "PRISM_Y".into(), known: String::new() }.code(), 4);
    }
}
