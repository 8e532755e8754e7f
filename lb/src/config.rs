//! Policy configuration from `PRISM_*` variables. The caller passes the variables in (this crate never
//! reads the environment), so the plugin, tests and the simulator configure policies the same way.
//! `lb/CONFIG.md` lists every variable with its default.

use std::collections::BTreeMap;

use rand::{rngs::SmallRng, Rng, SeedableRng};

use crate::path::{Dr, DrShared, Ecmp, PathPolicy, Pro, ProShared, Reps, RepsParams, Spray};
use crate::rail::{RailKind, TieBreak};
use crate::rate::{CcKind, MccParams};
use crate::split::{EtherealParams, SplitKind};

/// A configuration value that cannot be used; the message names the variable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// The variable has a value that is not one of the accepted ones.
    #[error("{var}={value}: {reason}")]
    Invalid {
        /// The variable's name.
        var: &'static str,
        /// The value given.
        value: String,
        /// What is accepted.
        reason: String,
    },
}

/// Which path policy to run (`PRISM_PATH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    /// Uniform random entropy per packet.
    Spray,
    /// One entropy per message.
    Ecmp,
    /// PRO's orchestrated round robin per destination leaf.
    Pro,
    /// REPS's recycled entropies.
    Reps,
    /// Destination rotation: one shared pointer per destination leaf.
    Dr,
}

impl PathKind {
    /// The name as written in `PRISM_PATH`.
    pub fn name(self) -> &'static str {
        match self {
            PathKind::Spray => "spray",
            PathKind::Ecmp => "ecmp",
            PathKind::Pro => "pro",
            PathKind::Reps => "reps",
            PathKind::Dr => "dr",
        }
    }
}

/// Where PRO's per-destination-leaf counter C starts (`PRISM_PRO_START`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProStart {
    /// The host's position among the hosts of its leaf, plus a shift every host of the leaf derives
    /// alike from (rail, source leaf, destination leaf): the hosts of one rack start on consecutive
    /// paths, so in-phase senders never meet on a ToR uplink (the staggering the paper's ideal round
    /// robin at the ToR has), and racks are independent of each other. Hosts the topology does not
    /// list fall back to `random`.
    #[default]
    Rack,
    /// Random per (host, rail, destination leaf): the paper's proof assumes uniform independent starts
    /// (Lemma 4), but hosts of one rack then collide on an uplink whenever two draw the same offset.
    Random,
}

impl ProStart {
    /// The name as written in `PRISM_PRO_START`.
    pub fn name(self) -> &'static str {
        match self {
            ProStart::Rack => "rack",
            ProStart::Random => "random",
        }
    }
}

/// Smallest and largest `PRISM_CHUNK`.
pub const CHUNK_RANGE: (u32, u32) = (256, 16 << 20);
/// `PRISM_CHUNK` is a multiple of this: a transport that sizes its packets by the chunk keeps packet
/// boundaries on NCCL's 128-byte LL128 lines.
pub const CHUNK_ALIGN: u32 = 128;
/// Largest k of `PRISM_SPLIT=fixed:k`.
pub const MAX_FIXED_SPLIT: u16 = 64;

/// The load-balancing configuration of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LbConfig {
    /// `PRISM_RAIL`.
    pub rail: RailKind,
    /// `PRISM_LPT_TIE`.
    pub lpt_tie: TieBreak,
    /// `PRISM_CHUNK`: bytes per atomic chunk (RailS's unit; also the largest plan chunk).
    pub chunk_bytes: u32,
    /// `PRISM_SPLIT`.
    pub split: SplitKind,
    /// `PRISM_ETHEREAL_*`.
    pub ethereal: EtherealParams,
    /// `PRISM_PATH`.
    pub path: PathKind,
    /// `PRISM_PRO_START`.
    pub pro_start: ProStart,
    /// `PRISM_REPS_*`.
    pub reps: RepsParams,
    /// `PRISM_CC`.
    pub cc: CcKind,
    /// `PRISM_MCC_*`.
    pub mcc: MccParams,
    /// `PRISM_TOPO`: the topology file the caller should read and pass to [`crate::Topology::from_json`].
    pub topo_path: Option<String>,
}

impl Default for LbConfig {
    fn default() -> Self {
        Self {
            rail: RailKind::Lpt,
            lpt_tie: TieBreak::Rotated,
            chunk_bytes: 32 << 10,
            split: SplitKind::None,
            ethereal: EtherealParams::default(),
            path: PathKind::Spray,
            pro_start: ProStart::default(),
            reps: RepsParams::default(),
            cc: CcKind::None,
            mcc: MccParams::default(),
            topo_path: None,
        }
    }
}

fn bad(var: &'static str, value: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { var, value: value.to_string(), reason: reason.into() }
}

fn choice<T: Copy>(var: &'static str, value: &str, options: &[(&str, T)]) -> Result<T, ConfigError> {
    let v = value.trim();
    options.iter().find(|(name, _)| *name == v).map(|(_, t)| *t).ok_or_else(|| {
        let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
        bad(var, v, format!("must be one of {}", names.join(", ")))
    })
}

fn integer(var: &'static str, value: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    let v = value.trim();
    match v.parse::<u64>() {
        Ok(x) if (min..=max).contains(&x) => Ok(x),
        _ => Err(bad(var, v, format!("must be an integer between {min} and {max}"))),
    }
}

/// A decimal in `[min, max]` (or `(min, max)` when `open`), returned in thousandths.
fn decimal_permille(var: &'static str, value: &str, min: f64, max: f64, open: bool) -> Result<u32, ConfigError> {
    let v = value.trim();
    let (lo, hi) = if open { ("(", ")") } else { ("[", "]") };
    let reason = || format!("must be a decimal number in {lo}{min}, {max}{hi}");
    let x: f64 = v.parse().map_err(|_| bad(var, v, reason()))?;
    // The bounds hold for the value as it is used, in thousandths: 0.9996 in (0, 1) would otherwise
    // be accepted and become 1.000.
    let pm = (x * 1000.0).round();
    let (lo_pm, hi_pm) = ((min * 1000.0).round(), (max * 1000.0).round());
    let inside = x.is_finite() && if open { pm > lo_pm && pm < hi_pm } else { pm >= lo_pm && pm <= hi_pm };
    if !inside || pm < 1.0 {
        return Err(bad(var, v, reason()));
    }
    Ok(pm as u32)
}

impl LbConfig {
    /// Read the configuration from a map of variables (e.g. the process environment filtered to
    /// `PRISM_*`). Absent variables take their defaults; bad values are errors naming the variable and
    /// what it accepts. Variables this crate does not know are left for others.
    pub fn from_vars(vars: &BTreeMap<String, String>) -> Result<Self, ConfigError> {
        let mut c = Self::default();
        let get = |k: &str| vars.get(k).map(String::as_str);
        if let Some(v) = get("PRISM_RAIL") {
            c.rail = choice(
                "PRISM_RAIL",
                v,
                &[("lpt", RailKind::Lpt), ("rr", RailKind::Rr), ("hash", RailKind::Hash), ("single", RailKind::Single)],
            )?;
        }
        if let Some(v) = get("PRISM_LPT_TIE") {
            c.lpt_tie = choice("PRISM_LPT_TIE", v, &[("rotated", TieBreak::Rotated), ("lowest", TieBreak::Lowest)])?;
        }
        if let Some(v) = get("PRISM_CHUNK") {
            c.chunk_bytes = integer("PRISM_CHUNK", v, CHUNK_RANGE.0 as u64, CHUNK_RANGE.1 as u64)? as u32;
            if c.chunk_bytes % CHUNK_ALIGN != 0 {
                return Err(bad("PRISM_CHUNK", v.trim(), format!("must be a multiple of {CHUNK_ALIGN} (NCCL's LL128 line)")));
            }
        }
        if let Some(v) = get("PRISM_SPLIT") {
            let t = v.trim();
            c.split = match t {
                "none" => SplitKind::None,
                "ethereal" => SplitKind::Ethereal,
                _ => match t.strip_prefix("fixed:").map(|k| k.parse::<u16>()) {
                    Some(Ok(k)) if (1..=MAX_FIXED_SPLIT).contains(&k) => SplitKind::Fixed(k),
                    Some(_) => return Err(bad("PRISM_SPLIT", t, format!("fixed:k needs k between 1 and {MAX_FIXED_SPLIT}"))),
                    None => return Err(bad("PRISM_SPLIT", t, "must be one of ethereal, none, fixed:k")),
                },
            };
        }
        if let Some(v) = get("PRISM_ETHEREAL_BATCH_US") {
            c.ethereal.batch_us = integer("PRISM_ETHEREAL_BATCH_US", v, 0, 1_000_000)?;
        }
        if let Some(v) = get("PRISM_ETHEREAL_JITTER_US") {
            c.ethereal.jitter_us = integer("PRISM_ETHEREAL_JITTER_US", v, 0, 1_000_000)? as u32;
        }
        if let Some(v) = get("PRISM_ETHEREAL_RESET_US") {
            c.ethereal.reset_us = integer("PRISM_ETHEREAL_RESET_US", v, 1, 60_000_000)?;
        }
        if let Some(v) = get("PRISM_PATH") {
            c.path = choice(
                "PRISM_PATH",
                v,
                &[
                    ("spray", PathKind::Spray),
                    ("ecmp", PathKind::Ecmp),
                    ("pro", PathKind::Pro),
                    ("reps", PathKind::Reps),
                    ("dr", PathKind::Dr),
                ],
            )?;
        }
        if let Some(v) = get("PRISM_PRO_START") {
            c.pro_start = choice("PRISM_PRO_START", v, &[("rack", ProStart::Rack), ("random", ProStart::Random)])?;
        }
        if let Some(v) = get("PRISM_REPS_FREEZE_US") {
            c.reps.freeze_us = integer("PRISM_REPS_FREEZE_US", v, 0, 10_000_000)?;
        }
        if let Some(v) = get("PRISM_REPS_EXPLORE") {
            c.reps.explore = integer("PRISM_REPS_EXPLORE", v, 0, 65_535)? as u32;
        }
        if let Some(v) = get("PRISM_REPS_FREEZE_RTT") {
            c.reps.freeze_rtt_permille = decimal_permille("PRISM_REPS_FREEZE_RTT", v, 1.0, 100.0, false)?;
        }
        if let Some(v) = get("PRISM_CC") {
            c.cc = choice("PRISM_CC", v, &[("none", CcKind::None), ("mcc", CcKind::Mcc)])?;
        }
        if let Some(v) = get("PRISM_MCC_TARGET_MSG_US") {
            c.mcc.target_msg_us = integer("PRISM_MCC_TARGET_MSG_US", v, 1, 10_000_000)?;
        }
        if let Some(v) = get("PRISM_MCC_TARGET_PKT_US") {
            c.mcc.target_pkt_us = integer("PRISM_MCC_TARGET_PKT_US", v, 1, 10_000_000)?;
        }
        const WIN: (u64, u64) = (1 << 10, 1 << 30);
        if let Some(v) = get("PRISM_MCC_INIT_WINDOW") {
            c.mcc.init_window = integer("PRISM_MCC_INIT_WINDOW", v, WIN.0, WIN.1)?;
        }
        if let Some(v) = get("PRISM_MCC_MIN_WINDOW") {
            c.mcc.min_window = integer("PRISM_MCC_MIN_WINDOW", v, WIN.0, WIN.1)?;
        }
        if let Some(v) = get("PRISM_MCC_MAX_WINDOW") {
            c.mcc.max_window = integer("PRISM_MCC_MAX_WINDOW", v, WIN.0, WIN.1)?;
        }
        if let Some(v) = get("PRISM_MCC_AI") {
            c.mcc.ai_bytes = integer("PRISM_MCC_AI", v, 1, WIN.1)?;
        }
        if let Some(v) = get("PRISM_MCC_MD") {
            c.mcc.md_permille = decimal_permille("PRISM_MCC_MD", v, 0.0, 1.0, true)?;
        }
        let m = &c.mcc;
        if !(m.min_window <= m.init_window && m.init_window <= m.max_window) {
            let (var, value) = if vars.contains_key("PRISM_MCC_INIT_WINDOW") {
                ("PRISM_MCC_INIT_WINDOW", m.init_window)
            } else if vars.contains_key("PRISM_MCC_MIN_WINDOW") {
                ("PRISM_MCC_MIN_WINDOW", m.min_window)
            } else {
                ("PRISM_MCC_MAX_WINDOW", m.max_window)
            };
            return Err(bad(
                var,
                &value.to_string(),
                format!(
                    "needs PRISM_MCC_MIN_WINDOW ({}) <= PRISM_MCC_INIT_WINDOW ({}) <= PRISM_MCC_MAX_WINDOW ({})",
                    m.min_window, m.init_window, m.max_window
                ),
            ));
        }
        if let Some(v) = get("PRISM_TOPO") {
            let t = v.trim();
            if t.is_empty() {
                return Err(bad("PRISM_TOPO", t, "must name a topology JSON file (or be unset for one leaf)"));
            }
            c.topo_path = Some(t.to_string());
        }
        Ok(c)
    }

    /// One line describing the configuration, for the init log.
    pub fn describe(&self) -> String {
        let rail = match self.rail {
            RailKind::Lpt => format!("lpt(tie={})", self.lpt_tie.name()),
            k => k.name().to_string(),
        };
        let e = &self.ethereal;
        let split = match self.split {
            SplitKind::Ethereal => {
                format!("ethereal(batch_us={},jitter_us={},reset_us={})", e.batch_us, e.jitter_us, e.reset_us)
            }
            k => k.describe(),
        };
        let r = &self.reps;
        let path = match self.path {
            PathKind::Reps => {
                format!("reps(freeze_us={},explore={},freeze_rtt={})", r.freeze_us, r.explore, r.freeze_rtt_permille as f64 / 1000.0)
            }
            PathKind::Pro => format!("pro(start={})", self.pro_start.name()),
            k => k.name().to_string(),
        };
        let m = &self.mcc;
        let cc = match self.cc {
            CcKind::Mcc => format!(
                "mcc(target_msg_us={},target_pkt_us={},window={}..{}..{},ai={},md={})",
                m.target_msg_us,
                m.target_pkt_us,
                m.min_window,
                m.init_window,
                m.max_window,
                m.ai_bytes,
                m.md_permille as f64 / 1000.0
            ),
            k => k.name().to_string(),
        };
        let topo = self.topo_path.as_deref().unwrap_or("single-leaf");
        format!("rail={rail} chunk={} split={split} path={path} cc={cc} topo={topo}", self.chunk_bytes)
    }

    /// A path policy for one new flow on the default topology (one leaf, no pinning); `seed` makes its
    /// random choices reproducible. Flows that share PRO/DR state come from [`LbConfig::runtime`].
    pub fn path_policy(&self, seed: u64) -> Box<dyn PathPolicy> {
        match self.path {
            PathKind::Spray => Box::new(Spray::new(seed)),
            PathKind::Ecmp => Box::new(Ecmp::new(seed)),
            PathKind::Reps => Box::new(Reps::new(self.reps, seed)),
            PathKind::Pro => Box::new(Pro::new(ProShared::shared(SmallRng::seed_from_u64(seed).gen()))),
            PathKind::Dr => Box::new(Dr::new(DrShared::shared(seed))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn err(kv: &[(&str, &str)]) -> String {
        LbConfig::from_vars(&vars(kv)).unwrap_err().to_string()
    }

    #[test]
    fn unknown_path_names_the_variable() {
        let e = err(&[("PRISM_PATH", "zigzag")]);
        assert!(e.starts_with("PRISM_PATH=zigzag"), "{e}");
        assert!(e.contains("spray, ecmp, pro, reps, dr"), "{e}");
    }

    #[test]
    fn defaults_are_lpt_none_spray_none_and_32_kib_chunks() {
        let c = LbConfig::from_vars(&BTreeMap::new()).unwrap();
        assert_eq!((c.rail, c.split, c.path, c.cc, c.chunk_bytes), (RailKind::Lpt, SplitKind::None, PathKind::Spray, CcKind::None, 32768));
        assert_eq!(c.describe(), "rail=lpt(tie=rotated) chunk=32768 split=none path=spray cc=none topo=single-leaf");
    }

    #[test]
    fn every_documented_value_parses() {
        let c = LbConfig::from_vars(&vars(&[
            ("PRISM_RAIL", "hash"),
            ("PRISM_LPT_TIE", "lowest"),
            ("PRISM_CHUNK", "65536"),
            ("PRISM_SPLIT", "fixed:8"),
            ("PRISM_ETHEREAL_BATCH_US", "5"),
            ("PRISM_ETHEREAL_JITTER_US", "0"),
            ("PRISM_ETHEREAL_RESET_US", "500"),
            ("PRISM_PATH", "reps"),
            ("PRISM_REPS_FREEZE_US", "100"),
            ("PRISM_REPS_EXPLORE", "32"),
            ("PRISM_REPS_FREEZE_RTT", "2.5"),
            ("PRISM_CC", "mcc"),
            ("PRISM_MCC_TARGET_MSG_US", "300"),
            ("PRISM_MCC_TARGET_PKT_US", "50"),
            ("PRISM_MCC_INIT_WINDOW", "2097152"),
            ("PRISM_MCC_MIN_WINDOW", "65536"),
            ("PRISM_MCC_MAX_WINDOW", "8388608"),
            ("PRISM_MCC_AI", "4096"),
            ("PRISM_MCC_MD", "0.7"),
            ("PRISM_TOPO", "topo.json"),
        ]))
        .unwrap();
        assert_eq!(c.rail, RailKind::Hash);
        assert_eq!(c.lpt_tie, TieBreak::Lowest);
        assert_eq!(c.chunk_bytes, 65536);
        assert_eq!(c.split, SplitKind::Fixed(8));
        assert_eq!(c.ethereal, EtherealParams { batch_us: 5, jitter_us: 0, reset_us: 500 });
        assert_eq!(c.reps, RepsParams { freeze_us: 100, explore: 32, freeze_rtt_permille: 2500 });
        assert_eq!(c.cc, CcKind::Mcc);
        assert_eq!(c.mcc.md_permille, 700);
        assert_eq!(c.mcc.init_window, 2 << 20);
        assert_eq!(c.topo_path.as_deref(), Some("topo.json"));
        for p in ["spray", "ecmp", "pro", "reps", "dr"] {
            let c = LbConfig::from_vars(&vars(&[("PRISM_PATH", p)])).unwrap();
            assert_eq!(c.path.name(), p);
            assert_eq!(c.path_policy(1).name(), p);
        }
        for r in ["lpt", "rr", "hash", "single"] {
            assert_eq!(LbConfig::from_vars(&vars(&[("PRISM_RAIL", r)])).unwrap().rail.name(), r);
        }
        assert_eq!(LbConfig::from_vars(&vars(&[("PRISM_SPLIT", "ethereal")])).unwrap().split, SplitKind::Ethereal);
        assert_eq!(LbConfig::default().pro_start, ProStart::Rack);
        for p in ["rack", "random"] {
            let c = LbConfig::from_vars(&vars(&[("PRISM_PATH", "pro"), ("PRISM_PRO_START", p)])).unwrap();
            assert_eq!(c.pro_start.name(), p);
            assert!(c.describe().contains(&format!("path=pro(start={p})")), "{}", c.describe());
        }
    }

    #[test]
    fn every_bad_value_is_an_error_naming_its_variable_and_what_is_accepted() {
        let cases: &[(&str, &str, &str)] = &[
            ("PRISM_RAIL", "fastest", "lpt, rr, hash, single"),
            ("PRISM_LPT_TIE", "random", "rotated, lowest"),
            ("PRISM_CHUNK", "100", "between 256 and 16777216"),
            ("PRISM_CHUNK", "32k", "between 256 and 16777216"),
            ("PRISM_CHUNK", "1000", "multiple of 128"),
            ("PRISM_SPLIT", "fixed:0", "between 1 and 64"),
            ("PRISM_SPLIT", "fixed:x", "between 1 and 64"),
            ("PRISM_SPLIT", "half", "ethereal, none, fixed:k"),
            ("PRISM_ETHEREAL_RESET_US", "0", "between 1 and"),
            ("PRISM_ETHEREAL_JITTER_US", "-1", "between 0 and"),
            ("PRISM_PRO_START", "zero", "must be one of rack, random"),
            ("PRISM_REPS_FREEZE_US", "abc", "between 0 and"),
            ("PRISM_REPS_EXPLORE", "70000", "between 0 and 65535"),
            ("PRISM_REPS_FREEZE_RTT", "0.5", "[1, 100]"),
            ("PRISM_CC", "dcqcn", "none, mcc"),
            ("PRISM_MCC_MD", "1.0", "(0, 1)"),
            ("PRISM_MCC_MD", "nan", "(0, 1)"),
            // Inside (0, 1), but a thousandth from 1 it would round to 1.0 and never cut the window.
            ("PRISM_MCC_MD", "0.9996", "(0, 1)"),
            ("PRISM_MCC_MD", "0.0004", "(0, 1)"),
            ("PRISM_MCC_TARGET_MSG_US", "0", "between 1 and"),
            ("PRISM_MCC_INIT_WINDOW", "1024", "PRISM_MCC_MIN_WINDOW"),
            ("PRISM_TOPO", " ", "topology JSON file"),
        ];
        for (var, value, accepted) in cases {
            let e = err(&[(var, value)]);
            assert!(e.starts_with(&format!("{var}=")), "{var}={value}: {e}");
            assert!(e.contains(accepted), "{var}={value}: {e}");
        }
    }

    #[test]
    fn other_components_variables_are_left_alone() {
        assert!(LbConfig::from_vars(&vars(&[("PRISM_PATHS", "64"), ("PRISM_STATS", "/x")])).is_ok());
    }

    #[test]
    fn describe_shows_the_chosen_policies_parameters() {
        let c = LbConfig::from_vars(&vars(&[("PRISM_PATH", "reps"), ("PRISM_SPLIT", "ethereal"), ("PRISM_CC", "mcc")])).unwrap();
        let d = c.describe();
        assert!(d.contains("path=reps(freeze_us=10000,explore=16,freeze_rtt=1.65)"), "{d}");
        assert!(d.contains("split=ethereal(batch_us=0,jitter_us=2,reset_us=10000)"), "{d}");
        assert!(d.contains("cc=mcc(target_msg_us=100"), "{d}");
    }
}
