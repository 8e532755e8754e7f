//! The plugin's configuration: every `PRISM_*` environment variable, checked as a whole.
//!
//! The environment is read once per engine (at the first `init`) into a map; a `PRISM_*` name that
//! neither the transport, the load balancer nor the plugin knows is an error naming it, because a typo
//! silently ignored would make a measurement lie. The map then goes to
//! [`TransportConfig::from_vars`] and [`LbConfig::from_vars`], and the effective configuration is
//! echoed once through NCCL's logger.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use prism_lb::LbConfig;
use prism_transport::engine::TransportConfig;

use crate::error::PluginError;

/// Prefix of every variable Prism reads.
pub const PREFIX: &str = "PRISM_";

/// Variables the load balancer reads. `prism_lb::LbConfig` has no list of its own yet; this one is
/// every name its `from_vars` parses, and must follow it until `LbConfig::VARS` replaces it.
pub const LB_VARS: &[&str] = &[
    "PRISM_CC",
    "PRISM_CHUNK",
    "PRISM_ETHEREAL_BATCH_US",
    "PRISM_ETHEREAL_JITTER_US",
    "PRISM_ETHEREAL_RESET_US",
    "PRISM_LPT_TIE",
    "PRISM_MCC_AI",
    "PRISM_MCC_INIT_WINDOW",
    "PRISM_MCC_MAX_WINDOW",
    "PRISM_MCC_MD",
    "PRISM_MCC_MIN_WINDOW",
    "PRISM_MCC_TARGET_MSG_US",
    "PRISM_MCC_TARGET_PKT_US",
    "PRISM_PATH",
    "PRISM_PRO_START",
    "PRISM_RAIL",
    "PRISM_REPS_EXPLORE",
    "PRISM_REPS_FREEZE_RTT",
    "PRISM_REPS_FREEZE_US",
    "PRISM_SPLIT",
    "PRISM_TOPO",
];

/// `PRISM_STATS=FILE`: where the engine's statistics are written (JSON) when the last communicator is
/// finalized; `%p` in the name becomes the process id, so ranks of one job do not overwrite each other.
pub const STATS_VAR: &str = "PRISM_STATS";

/// Variables the plugin itself reads.
pub const PLUGIN_VARS: &[&str] = &[STATS_VAR];

/// Variables Prism's own scripts export for themselves (`scripts/lib.sh`, the test beds). They are not
/// configuration, so the plugin ignores them instead of refusing to start in a shell that ran a script.
pub const TOOLING_VARS: &[&str] =
    &["PRISM_ROOT", "PRISM_BIN_DIR", "PRISM_BINS", "PRISM_VM_KERNEL_PKG", "PRISM_VM_CACHE", "PRISM_SCENARIOS"];

/// Every configuration variable some part of Prism understands.
pub fn known_vars() -> BTreeSet<&'static str> {
    TransportConfig::VARS.iter().chain(LB_VARS).chain(PLUGIN_VARS).copied().collect()
}

/// The `PRISM_*` variables of the process environment. A non-UTF-8 name or value is an error.
pub fn env_vars() -> Result<BTreeMap<String, String>, PluginError> {
    let mut vars = BTreeMap::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str().map(str::to_owned) else {
            // Not UTF-8, so not one of ours (all of ours are ASCII).
            continue;
        };
        if !name.starts_with(PREFIX) {
            continue;
        }
        let value = value.into_string().map_err(|_| PluginError::NotUtf8(name.clone()))?;
        vars.insert(name, value);
    }
    Ok(vars)
}

/// The effective configuration of one engine.
#[derive(Debug)]
pub struct PluginConfig {
    /// The variables as read.
    pub vars: BTreeMap<String, String>,
    /// The transport's part.
    pub transport: TransportConfig,
    /// The load balancer's part.
    pub lb: LbConfig,
    /// `PRISM_STATS`, unexpanded.
    pub stats: Option<String>,
}

impl PluginConfig {
    /// Checks the names, then lets each part parse its values.
    pub fn from_vars(mut vars: BTreeMap<String, String>) -> Result<Self, PluginError> {
        vars.retain(|k, _| !TOOLING_VARS.contains(&k.as_str()));
        let known = known_vars();
        let unknown: Vec<&str> = vars.keys().map(String::as_str).filter(|k| !known.contains(k)).collect();
        if !unknown.is_empty() {
            return Err(PluginError::UnknownVars { names: unknown.join(", "), known: known.into_iter().collect::<Vec<_>>().join(", ") });
        }
        let transport = TransportConfig::from_vars(&vars)?;
        let lb = LbConfig::from_vars(&vars)?;
        // Set but empty is most likely `PRISM_STATS=$VAR` with VAR unset: an error, not "off" (which is
        // what leaving it unset says), so a run meant to be measured does not end without statistics.
        let stats = match vars.get(STATS_VAR) {
            Some(s) if s.trim().is_empty() => {
                return Err(PluginError::BadValue {
                    var: STATS_VAR,
                    value: s.clone(),
                    reason: "must name a file (or be unset for no statistics)",
                })
            }
            s => s.cloned(),
        };
        Ok(Self { vars, transport, lb, stats })
    }

    /// Reads and checks the process environment.
    pub fn from_env() -> Result<Self, PluginError> {
        Self::from_vars(env_vars()?)
    }

    /// One line for the init log: what was set, and what each part made of it.
    pub fn describe(&self) -> String {
        let set: Vec<String> = self.vars.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!(
            "config: set [{}]; transport: {}; lb: {}; stats: {}",
            set.join(" "),
            self.transport.describe(),
            self.lb.describe(),
            self.stats.as_deref().unwrap_or("off"),
        )
    }

    /// The statistics file for process `pid`, if `PRISM_STATS` is set.
    pub fn stats_file(&self, pid: u32) -> Option<PathBuf> {
        self.stats.as_ref().map(|s| PathBuf::from(s.replace("%p", &pid.to_string())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn an_unknown_prism_variable_is_an_error_that_names_it() {
        let err = PluginConfig::from_vars(vars(&[("PRISM_PAHT", "spray"), ("PRISM_ZZZ", "1")])).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("PRISM_PAHT, PRISM_ZZZ"), "{msg}");
        assert!(msg.contains("PRISM_PATH"), "the error lists the known names: {msg}");
        assert_eq!(err.code(), 4);
    }

    #[test]
    fn variables_of_prisms_own_scripts_are_ignored_not_refused() {
        let cfg = PluginConfig::from_vars(vars(&[
            ("PRISM_ROOT", "/src/prism"),
            ("PRISM_BIN_DIR", "target/release"),
            ("PRISM_VM_CACHE", "/var/cache/prism-vm"),
            ("PRISM_SCENARIOS", "perf-verbs"),
        ]))
        .expect("script variables are not configuration");
        assert!(cfg.vars.is_empty(), "{:?}", cfg.vars);
    }

    #[test]
    fn no_variables_gives_the_defaults() {
        let cfg = PluginConfig::from_vars(BTreeMap::new()).expect("defaults are valid");
        assert_eq!(cfg.lb, LbConfig::default());
        assert!(cfg.stats.is_none());
    }

    #[test]
    fn a_bad_lb_value_is_reported_with_its_variable() {
        let err = PluginConfig::from_vars(vars(&[("PRISM_PATH", "zigzag")])).unwrap_err();
        assert!(err.to_string().contains("PRISM_PATH=zigzag"), "{err}");
    }

    #[test]
    fn every_transport_and_lb_variable_is_known() {
        let known = known_vars();
        for v in TransportConfig::VARS.iter().chain(LB_VARS) {
            assert!(known.contains(v), "{v}");
            assert!(v.starts_with(PREFIX), "{v}");
        }
    }

    #[test]
    fn every_variable_has_a_row_with_its_default_in_the_readme() {
        let readme = include_str!("../../README.md");
        for v in known_vars() {
            let row = readme.lines().find(|l| l.starts_with(&format!("| `{v}` |")));
            let Some(row) = row else { panic!("README.md has no row for {v}") };
            let default = row.split('|').nth(2).map(str::trim).unwrap_or("");
            assert!(!default.is_empty(), "README.md gives no default for {v}: {row}");
        }
    }

    #[test]
    fn the_description_echoes_what_was_set() {
        let cfg = PluginConfig::from_vars(vars(&[("PRISM_PATH", "ecmp"), (STATS_VAR, "out/s-%p.json")])).unwrap();
        let d = cfg.describe();
        assert!(d.contains("PRISM_PATH=ecmp"), "{d}");
        assert!(d.contains("path=ecmp"), "{d}");
        assert!(d.contains("stats: out/s-%p.json"), "{d}");
    }

    #[test]
    fn an_empty_stats_file_name_is_an_error_naming_the_variable() {
        for v in ["", " ", "\t"] {
            let err = PluginConfig::from_vars(vars(&[(STATS_VAR, v)])).unwrap_err();
            assert!(err.to_string().starts_with("PRISM_STATS="), "{err}");
            assert_eq!(err.code(), 4, "{err}");
        }
    }

    #[test]
    fn the_stats_file_name_gets_the_pid() {
        let cfg = PluginConfig::from_vars(vars(&[(STATS_VAR, "out/prism-%p.json")])).unwrap();
        assert_eq!(cfg.stats_file(42), Some(PathBuf::from("out/prism-42.json")));
    }

    #[test]
    fn the_environment_is_filtered_to_prism_variables() {
        // The test process environment may hold anything; only the prefix matters.
        let vars = env_vars().expect("test environment is UTF-8");
        assert!(vars.keys().all(|k| k.starts_with(PREFIX)));
    }
}
