//! Policy configuration from `PRISM_*` variables. The caller passes the variables in (this crate never
//! reads the environment), so the plugin, tests and the simulator configure policies the same way.

use std::collections::BTreeMap;

use crate::path::{Ecmp, PathPolicy, Spray};

/// A configuration value that cannot be used; the message names the variable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// The variable has a value that is not one of the accepted ones.
    #[error("{var}={value}: {reason}")]
    Invalid { var: &'static str, value: String, reason: String },
}

/// Which path policy to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    /// Uniform random entropy per packet.
    Spray,
    /// One entropy per message.
    Ecmp,
}

/// The load-balancing configuration of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LbConfig {
    /// `PRISM_PATH`.
    pub path: PathKind,
}

impl Default for LbConfig {
    fn default() -> Self {
        Self { path: PathKind::Spray }
    }
}

impl LbConfig {
    /// Read the configuration from a map of variables (e.g. the process environment filtered to
    /// `PRISM_*`). Absent variables take their defaults; bad values are errors naming the variable.
    pub fn from_vars(vars: &BTreeMap<String, String>) -> Result<Self, ConfigError> {
        let mut cfg = Self::default();
        if let Some(v) = vars.get("PRISM_PATH") {
            cfg.path = match v.trim() {
                "spray" => PathKind::Spray,
                "ecmp" => PathKind::Ecmp,
                other => {
                    return Err(ConfigError::Invalid {
                        var: "PRISM_PATH",
                        value: other.to_string(),
                        reason: "must be one of spray, ecmp".into(),
                    })
                }
            };
        }
        Ok(cfg)
    }

    /// One line describing the configuration, for the init log.
    pub fn describe(&self) -> String {
        format!("path={:?}", self.path).to_lowercase()
    }

    /// A path policy for one new flow; `seed` makes its random choices reproducible.
    pub fn path_policy(&self, seed: u64) -> Box<dyn PathPolicy> {
        match self.path {
            PathKind::Spray => Box::new(Spray::new(seed)),
            PathKind::Ecmp => Box::new(Ecmp::new(seed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_path_names_the_variable() {
        let mut vars = BTreeMap::new();
        vars.insert("PRISM_PATH".to_string(), "zigzag".to_string());
        let err = LbConfig::from_vars(&vars).unwrap_err();
        assert!(err.to_string().starts_with("PRISM_PATH=zigzag"), "{err}");
    }
}
