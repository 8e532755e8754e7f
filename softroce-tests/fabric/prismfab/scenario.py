"""Scenario files: the fabric's shape, the workloads, the policy combinations, the faults and the checks.

A scenario is one JSON file (``scenarios/*.json``); command-line flags override its topology fields.
Every field is checked when the file is read, and an error names the field and says what is accepted, so
a typo fails before any namespace exists.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class ScenarioError(ValueError):
    """A scenario field that cannot be used; the message names the field."""


# Interface names are "h<i>-r<r>", "lf<r>-sp<s>", "sp<s>-lf<r>": 15 characters leave room for 3-digit
# indices. Addresses are 10.<100+r>.<i>.x and 10.<200+r>.<s>.x, which bounds the rest.
MAX_HOSTS = 250
MAX_RAILS = 27
MAX_SPINES = 250

RANK_RAIL_MODES = ("rotate", "aligned", "half", "first")
LEAF_ROUTING_MODES = ("hash", "sport")
# Under leaf_routing "sport", rank i's UDP sockets take ports SPORT_BASE + i * rails * paths onwards
# (PRISM_UDP_SPORT_BASE), clear of the self-test's probe ports (20000-31063). Each rank is alone in its
# host's namespace, so nothing else binds UDP ports there.
SPORT_BASE = 40000
FAULT_KINDS = ("link_down", "blackhole", "loss", "slow_spine", "nic_blackhole")
COLLECTIVES = ("sendrecv", "all_reduce", "all_gather", "reduce_scatter", "alltoall", "alltoall_sparse")


def parse_size(text: Any, where: str) -> int:
    """Bytes from ``4096``, ``64K``, ``8M``, ``1G`` (powers of 1024, as prism-perf and nccl-tests)."""
    if isinstance(text, int) and text >= 0:
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise ScenarioError(f"{where}={text!r}: expected a size such as 4096, 64K, 8M or 1G")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(m.group(1)) * mult


def _num(d: dict, key: str, where: str, lo: float, hi: float, default: Any = None, integer: bool = True):
    if key not in d:
        if default is None:
            raise ScenarioError(f"{where}.{key}: missing (a number between {lo} and {hi})")
        return default
    v = d[key]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not (lo <= v <= hi):
        kind = "an integer" if integer else "a number"
        raise ScenarioError(f"{where}.{key}={v!r}: must be {kind} between {lo} and {hi}")
    return v


def _only(d: dict, where: str, allowed: set[str]) -> None:
    if not isinstance(d, dict):
        raise ScenarioError(f"{where}: must be a JSON object")
    extra = sorted(set(d) - allowed)
    if extra:
        raise ScenarioError(f"{where}: unknown field(s) {', '.join(extra)}; known: {', '.join(sorted(allowed))}")


@dataclass
class TopologySpec:
    """H hosts x R rails x S spines; rail r of every host hangs from leaf r; every leaf reaches every spine."""

    hosts: int = 4
    rails: int = 2
    spines: int = 2
    host_bw_mbit: float = 200.0
    spine_bw_mbit: float = 100.0
    mtu: int = 9000
    queue_pkts: int = 100
    # A host's NIC queue: a NIC back-pressures its driver rather than dropping at once, so the hosts get
    # Linux's default txqueuelen, and the short switch buffers (queue_pkts) sit on the leaves and spines.
    host_queue_pkts: int = 1000
    hash_policy: int = 1
    hash_seed: int = 20251122
    # Which rail carries a rank's traffic (its NCCL device 0): "rotate" puts rank i on rail i mod R, so
    # neighbours sit on different leaves and talk through the spines; "aligned" keeps every rank on rail 0
    # (rail-local, the spines stay idle); "half" puts the first half of the ranks on rail 0 and the rest on
    # rail 1, so a ring crosses the spines exactly twice (few flows: the ECMP worst case).
    # "first" puts rank 0 alone on rail 0 and every other rank on rail 1: under PRISM_RAIL=single an
    # alltoall then sends n-1 equal flows from one process on leaf 0 to leaf 1 (Ethereal's many flows over
    # few uplinks, planned in one batch), and one flow from each of n-1 processes back.
    rank_rail: str = "rotate"
    # How a leaf picks the spine of a cross-leaf packet: "hash" = the kernel's ECMP hash of the 5-tuple
    # (Prism cannot know where an entropy goes); "sport" = by UDP source port: rank i binds its sockets
    # from SPORT_BASE + i * rails * paths (PRISM_UDP_SPORT_BASE), entropy e of any rail leaves on spine
    # e mod spines, exactly what Prism assumes without an entropy_uplink table; the runner then gives
    # every rank a PRISM_TOPO of the fabric and its PRISM_HOST. Other packets (TCP, probes) keep the hash.
    leaf_routing: str = "hash"

    FIELDS = {"hosts", "rails", "spines", "host_bw_mbit", "spine_bw_mbit", "mtu", "queue_pkts", "host_queue_pkts",
              "hash_policy",
              "hash_seed", "rank_rail", "leaf_routing"}

    @classmethod
    def from_json(cls, d: dict, where: str = "topology") -> "TopologySpec":
        """Reads and checks the `topology` object."""
        _only(d, where, cls.FIELDS)
        t = cls()
        t.hosts = _num(d, "hosts", where, 2, MAX_HOSTS, t.hosts)
        t.rails = _num(d, "rails", where, 1, MAX_RAILS, t.rails)
        t.spines = _num(d, "spines", where, 1, MAX_SPINES, t.spines)
        t.host_bw_mbit = float(_num(d, "host_bw_mbit", where, 1, 1000, t.host_bw_mbit, integer=False))
        t.spine_bw_mbit = float(_num(d, "spine_bw_mbit", where, 1, 1000, t.spine_bw_mbit, integer=False))
        t.mtu = _num(d, "mtu", where, 1280, 9000, t.mtu)
        t.queue_pkts = _num(d, "queue_pkts", where, 2, 10000, t.queue_pkts)
        t.host_queue_pkts = _num(d, "host_queue_pkts", where, 2, 100000, t.host_queue_pkts)
        t.hash_policy = _num(d, "hash_policy", where, 1, 1, t.hash_policy)
        t.hash_seed = _num(d, "hash_seed", where, 1, 2**32 - 1, t.hash_seed)
        t.rank_rail = d.get("rank_rail", t.rank_rail)
        t.leaf_routing = d.get("leaf_routing", t.leaf_routing)
        t.validate(where)
        return t

    def validate(self, where: str = "topology") -> None:
        """Checks what a single field cannot: combinations."""
        if self.rank_rail not in RANK_RAIL_MODES:
            raise ScenarioError(f"{where}.rank_rail={self.rank_rail!r}: one of {', '.join(RANK_RAIL_MODES)}")
        if self.rank_rail in ("rotate", "half", "first") and self.rails < 2:
            raise ScenarioError(f"{where}.rank_rail={self.rank_rail}: needs at least 2 rails (or use aligned)")
        if self.leaf_routing not in LEAF_ROUTING_MODES:
            raise ScenarioError(f"{where}.leaf_routing={self.leaf_routing!r}: one of {', '.join(LEAF_ROUTING_MODES)}")

    def rank_rail_of(self, host: int, mode: str | None = None) -> int:
        """The rail host `host`'s rank uses as its device 0 (under `mode`, default the topology's)."""
        mode = mode or self.rank_rail
        if mode == "rotate":
            return host % self.rails
        if mode == "half":
            return 0 if host < (self.hosts + 1) // 2 else 1
        if mode == "first":
            return 0 if host == 0 else 1
        return 0

    def sport_base(self, host: int, paths: int) -> int:
        """PRISM_UDP_SPORT_BASE of host `host`'s rank under leaf_routing "sport"."""
        return SPORT_BASE + host * self.rails * paths

    def sport_spines(self, paths: int) -> dict[int, int]:
        """{UDP source port: spine} of every Prism socket of every rank under leaf_routing "sport": entropy
        e (port base + k * paths + e on the rank's k-th rail) leaves on spine e mod spines."""
        out = {}
        for i in range(self.hosts):
            base = self.sport_base(i, paths)
            for k in range(self.rails):
                for e in range(paths):
                    out[base + k * paths + e] = e % self.spines
        return out

    def rail_order(self, host: int, mode: str | None = None) -> list[int]:
        """Host `host`'s rails in PRISM_IFNAMES order: its rank's rail first, then the others ascending.
        Prism pairs rails by this index (a chunk sent on a host's k-th rail lands on the peer's k-th), so
        two hosts whose orders differ at index k talk through the spines on that index."""
        first = self.rank_rail_of(host, mode)
        return [first] + [r for r in range(self.rails) if r != first]

    def label(self) -> str:
        """``8x2x4`` (hosts x rails x spines)."""
        return f"{self.hosts}x{self.rails}x{self.spines}"


@dataclass
class Workload:
    """One prism-perf collective run at one size."""

    name: str
    collective: str
    size_bytes: int
    iters: int = 1
    warmup: int = 1
    # Overrides the topology's rank_rail for this workload (e.g. "half" for a ring with few spine flows).
    rank_rail: str | None = None
    # PRISM_* variables this workload needs whatever the policy (e.g. PRISM_RAIL=single, so each comm is one
    # flow); the policy's own variables still win.
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict, where: str) -> "Workload":
        """Reads and checks one entry of `workloads`."""
        _only(d, where, {"name", "collective", "bytes", "iters", "warmup", "rank_rail", "env"})
        env = d.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and k.startswith("PRISM_") for k in env):
            raise ScenarioError(f"{where}.env: an object of PRISM_* variables")
        rr = d.get("rank_rail")
        if rr is not None and rr not in RANK_RAIL_MODES:
            raise ScenarioError(f"{where}.rank_rail={rr!r}: one of {', '.join(RANK_RAIL_MODES)}")
        coll = d.get("collective")
        if coll not in COLLECTIVES:
            raise ScenarioError(f"{where}.collective={coll!r}: one of {', '.join(COLLECTIVES)}")
        name = d.get("name", coll)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ScenarioError(f"{where}.name={name!r}: letters, digits, '_', '-', '.' only")
        size = parse_size(d.get("bytes", "8M"), f"{where}.bytes")
        if size < 4:
            raise ScenarioError(f"{where}.bytes: at least 4 (one float)")
        return cls(name, coll, size, _num(d, "iters", where, 1, 1000, 1), _num(d, "warmup", where, 0, 100, 1), rr,
                   {k: str(v) for k, v in env.items()})


@dataclass
class Policy:
    """A policy combination: a name and the PRISM_* variables that select it."""

    name: str
    env: dict[str, str]

    @classmethod
    def from_json(cls, d: dict, where: str) -> "Policy":
        """Reads and checks one entry of `policies`."""
        _only(d, where, {"name", "env"})
        name = d.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
            raise ScenarioError(f"{where}.name={name!r}: letters, digits, '_', '-', '+', '.' only")
        env = d.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and k.startswith("PRISM_") for k in env):
            raise ScenarioError(f"{where}.env: an object of PRISM_* variables")
        return cls(name, {k: str(v) for k, v in env.items()})


@dataclass
class Fault:
    """A fault injected into a running workload.

    kinds: ``link_down`` (the cable between leaf and spine is cut: both ends lose carrier), ``blackhole``
    (that link silently drops every IPv4 packet in both directions; links stay up, routers do not notice),
    ``loss`` (random loss of ``loss_pct`` percent on every port of the spine, nft numgen), ``slow_spine``
    (every link of the spine shaped down to ``bw_mbit``), ``nic_blackhole`` (the link between host ``host``
    and leaf ``leaf``, its rail-``leaf`` NIC's, silently drops every IPv4 packet in both directions: a NIC,
    cable or leaf port gone; ``spine`` is unused).

    ``heal_after_s`` (black hole or cut link only): the fault is undone that many seconds after it fired,
    while the workload still runs, and the run measures how soon the policy puts its bytes back on the
    healed link (``metrics.revival``).
    """

    name: str
    kind: str
    workload: str
    policies: list[str]
    spine: int = 0
    leaf: int = 0
    # nic_blackhole only: the host whose rail-`leaf` link fails.
    host: int = 0
    at_s: float = 0.5
    loss_pct: float = 1.0
    bw_mbit: float = 25.0
    # "complete": every run of this fault must finish with verified data (a check); "report": measured and
    # shown, not asserted (e.g. ecmp under a black hole, to show what the others avoid).
    expect: str = "complete"
    # Further faults injected in the same run, each at its own at_s (same or later: in sequence), e.g.
    # loss on one spine and a black hole on another. This fault stays the primary one: the recovery
    # figures are about its dead path and its injection time.
    also: list["Fault"] = field(default_factory=list)
    # Overrides checks.cct_ratio_max for this fault (None: the scenario's).
    cct_ratio_max: float | None = None
    # Overrides checks.recovery_rtts_max for this fault (None: the scenario's).
    recovery_rtts_max: float | None = None
    # Seconds after the fault fired at which it is undone (None: it lasts to the end of the run).
    heal_after_s: float | None = None

    PART_FIELDS = {"kind", "spine", "leaf", "host", "at_s", "loss_pct", "bw_mbit"}

    def parts(self) -> list["Fault"]:
        """This fault and the ones injected with it, in the order they fire."""
        return sorted([self] + list(self.also), key=lambda f: f.at_s)

    @classmethod
    def part_from_json(cls, d: dict, where: str, parent: "Fault") -> "Fault":
        """One entry of a fault's `also`: what breaks and when, in the parent's run."""
        _only(d, where, cls.PART_FIELDS)
        kind = d.get("kind")
        if kind not in FAULT_KINDS:
            raise ScenarioError(f"{where}.kind={kind!r}: one of {', '.join(FAULT_KINDS)}")
        return cls(
            name=f"{parent.name}.{kind}", kind=kind, workload=parent.workload, policies=list(parent.policies),
            spine=_num(d, "spine", where, 0, MAX_SPINES - 1, 0),
            leaf=_num(d, "leaf", where, 0, MAX_RAILS - 1, 0),
            host=_num(d, "host", where, 0, MAX_HOSTS - 1, 0),
            at_s=float(_num(d, "at_s", where, 0.0, 600.0, parent.at_s, integer=False)),
            loss_pct=float(_num(d, "loss_pct", where, 0.0, 100.0, 1.0, integer=False)),
            bw_mbit=float(_num(d, "bw_mbit", where, 0.1, 1000.0, 25.0, integer=False)),
            expect=parent.expect,
        )

    @classmethod
    def from_json(cls, d: dict, where: str) -> "Fault":
        """Reads and checks one entry of `faults`."""
        _only(d, where, {"name", "kind", "workload", "policies", "spine", "leaf", "host", "at_s", "loss_pct", "bw_mbit",
                         "expect", "also", "cct_ratio_max", "recovery_rtts_max", "heal_after_s"})
        expect = d.get("expect", "complete")
        if expect not in ("complete", "report"):
            raise ScenarioError(f"{where}.expect={expect!r}: complete or report")
        kind = d.get("kind")
        if kind not in FAULT_KINDS:
            raise ScenarioError(f"{where}.kind={kind!r}: one of {', '.join(FAULT_KINDS)}")
        name = d.get("name", kind)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ScenarioError(f"{where}.name={name!r}: letters, digits, '_', '-', '.' only")
        pols = d.get("policies")
        if not isinstance(pols, list) or not pols or not all(isinstance(p, str) for p in pols):
            raise ScenarioError(f"{where}.policies: a non-empty list of policy names")
        wl = d.get("workload")
        if not isinstance(wl, str):
            raise ScenarioError(f"{where}.workload: the name of a workload")
        f = cls(
            name=name, kind=kind, workload=wl, policies=pols,
            spine=_num(d, "spine", where, 0, MAX_SPINES - 1, 0),
            leaf=_num(d, "leaf", where, 0, MAX_RAILS - 1, 0),
            host=_num(d, "host", where, 0, MAX_HOSTS - 1, 0),
            at_s=float(_num(d, "at_s", where, 0.0, 600.0, 0.5, integer=False)),
            loss_pct=float(_num(d, "loss_pct", where, 0.0, 100.0, 1.0, integer=False)),
            bw_mbit=float(_num(d, "bw_mbit", where, 0.1, 1000.0, 25.0, integer=False)),
            expect=expect,
        )
        if "cct_ratio_max" in d:
            f.cct_ratio_max = float(_num(d, "cct_ratio_max", where, 1.0, 100.0, integer=False))
        if "recovery_rtts_max" in d:
            f.recovery_rtts_max = float(_num(d, "recovery_rtts_max", where, 0.1, 10000.0, integer=False))
        if d.get("heal_after_s") is not None:
            if kind not in ("blackhole", "link_down", "nic_blackhole"):
                raise ScenarioError(f"{where}.heal_after_s: only a blackhole, link_down or nic_blackhole heals (a dead link "
                                    f"whose return the run can measure), not {kind}")
            f.heal_after_s = float(_num(d, "heal_after_s", where, 0.01, 600.0, integer=False))
        also = d.get("also", [])
        if not isinstance(also, list):
            raise ScenarioError(f"{where}.also: a list of faults (kind, spine, leaf, at_s, loss_pct, bw_mbit)")
        f.also = [cls.part_from_json(x, f"{where}.also[{i}]", f) for i, x in enumerate(also)]
        # Two parts on the same port would share (and fight over) one nft chain or one shaper: loss and
        # slow_spine act on every port of their spine, a black hole or a cut on one leaf-spine link.
        parts = [f] + f.also
        for i, p in enumerate(parts):
            for j in range(i):
                q = parts[j]
                if "nic_blackhole" in (p.kind, q.kind):
                    # A host's link is no spine's: it clashes only with a black hole on the same one.
                    if p.kind == q.kind and (p.host, p.leaf) == (q.host, q.leaf):
                        raise ScenarioError(f"{where}: two nic_blackhole parts on host {p.host} rail {p.leaf}")
                    continue
                if p.spine == q.spine and (p.kind in ("loss", "slow_spine") or q.kind in ("loss", "slow_spine")
                                           or p.leaf == q.leaf):
                    name = lambda k: "the fault" if k == 0 else f"also[{k - 1}]"  # noqa: E731
                    raise ScenarioError(f"{where}: {name(i)} ({p.kind}) and {name(j)} ({q.kind}) both break spine "
                                        f"{p.spine}{'' if p.kind in ('loss', 'slow_spine') or q.kind in ('loss', 'slow_spine') else f' leaf {p.leaf}'}: "
                                        "put them on different spines (or links)")
        return f


@dataclass
class Checks:
    """What the run asserts (the issue's acceptance), with its thresholds."""

    # Nothing is asserted unless the scenario asks for it (only the tolerances have defaults).
    # Policies whose bytes must be spread over the spines within `balance_tolerance` of even, judged on
    # `balance_workload` (many flows).
    balanced_policies: list[str] = field(default_factory=list)
    balance_workload: str = ""
    # The single-path policy that must *not* spread a few flows evenly over the spines, judged on
    # `pinned_workload` (fewer spine flows per leaf than spines: each leaf's bytes over its uplinks).
    pinned_policy: str = ""
    pinned_workload: str = ""
    balance_tolerance: float = 0.10
    # Faults whose runs must complete with correct data and CCT below ratio x the fault-free run.
    cct_faults: list[str] = field(default_factory=list)
    cct_ratio_max: float = 2.0
    # Under those faults (with a dead link), the bulk of the bytes must leave the dead path within this
    # many round trips of the fault (None: reported, not asserted).
    recovery_rtts_max: float | None = None
    # Under those faults that heal (``heal_after_s``), the healed link must carry at least half its
    # share of the spine bytes from before the fault again within this many seconds of the heal (None:
    # reported, not asserted).
    revive_s_max: float | None = None
    # Policies whose every busy leaf must spread its uplink bytes within `spread_max` (max/min - 1) on
    # `spread_workload` (Ethereal's claim); every other policy's spread on that workload is reported next
    # to it.
    spread_policies: list[str] = field(default_factory=list)
    spread_workload: str = ""
    spread_max: float = 0.02

    @classmethod
    def from_json(cls, d: dict, where: str = "checks") -> "Checks":
        """Reads and checks the `checks` object."""
        _only(d, where, {"balanced_policies", "pinned_policy", "pinned_workload", "balance_workload",
                         "balance_tolerance", "cct_faults", "cct_ratio_max", "recovery_rtts_max", "revive_s_max",
                         "spread_policies", "spread_workload", "spread_max"})
        c = cls()
        for k in ("balanced_policies", "cct_faults", "spread_policies"):
            if k in d:
                v = d[k]
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    raise ScenarioError(f"{where}.{k}: a list of names")
                setattr(c, k, v)
        for k in ("pinned_policy", "pinned_workload", "balance_workload", "spread_workload"):
            if k in d:
                if not isinstance(d[k], str):
                    raise ScenarioError(f"{where}.{k}: a name")
                setattr(c, k, d[k])
        c.balance_tolerance = float(_num(d, "balance_tolerance", where, 0.0, 10.0, c.balance_tolerance, integer=False))
        c.cct_ratio_max = float(_num(d, "cct_ratio_max", where, 1.0, 100.0, c.cct_ratio_max, integer=False))
        c.spread_max = float(_num(d, "spread_max", where, 0.0, 10.0, c.spread_max, integer=False))
        if c.spread_policies and not c.spread_workload:
            raise ScenarioError(f"{where}.spread_workload: needed with spread_policies (the workload they are judged on)")
        if d.get("recovery_rtts_max") is not None:
            c.recovery_rtts_max = float(_num(d, "recovery_rtts_max", where, 0.1, 10000.0, integer=False))
        if d.get("revive_s_max") is not None:
            c.revive_s_max = float(_num(d, "revive_s_max", where, 0.01, 600.0, integer=False))
        return c


@dataclass
class Scenario:
    """A whole scenario file."""

    name: str
    description: str
    topology: TopologySpec
    paths: int
    prism_env: dict[str, str]
    timeout_s: int
    workloads: list[Workload]
    policies: list[Policy]
    faults: list[Fault]
    checks: Checks
    source: str = ""

    @classmethod
    def from_json(cls, d: dict, source: str = "") -> "Scenario":
        """Reads and checks a whole scenario (parsed JSON)."""
        _only(d, "scenario", {"name", "description", "topology", "prism", "workloads", "policies", "faults",
                              "checks"})
        name = d.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ScenarioError(f"name={name!r}: letters, digits, '_', '-', '.' only (it names the results folder)")
        topo = TopologySpec.from_json(d.get("topology", {}))
        prism = d.get("prism", {})
        _only(prism, "prism", {"paths", "env", "timeout_s"})
        paths = _num(prism, "paths", "prism", 1, 1024, 16)
        env = prism.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and k.startswith("PRISM_") for k in env):
            raise ScenarioError("prism.env: an object of PRISM_* variables")
        timeout_s = _num(prism, "timeout_s", "prism", 5, 3600, 120)
        wls = [Workload.from_json(w, f"workloads[{i}]") for i, w in enumerate(d.get("workloads", []))]
        pols = [Policy.from_json(p, f"policies[{i}]") for i, p in enumerate(d.get("policies", []))]
        faults = [Fault.from_json(f, f"faults[{i}]") for i, f in enumerate(d.get("faults", []))]
        checks = Checks.from_json(d.get("checks", {}))
        s = cls(name, str(d.get("description", "")), topo, paths, {k: str(v) for k, v in env.items()}, timeout_s,
                wls, pols, faults, checks, source)
        s.validate()
        return s

    @classmethod
    def load(cls, path: str | Path) -> "Scenario":
        """Reads and checks a scenario file."""
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except OSError as e:
            raise ScenarioError(f"{p}: cannot read: {e}") from e
        except json.JSONDecodeError as e:
            raise ScenarioError(f"{p}: not JSON: {e}") from e
        return cls.from_json(d, source=str(p))

    def validate(self) -> None:
        """Cross-references: names are unique and every name used is defined; indices fit the topology."""
        for what, items in (("workloads", self.workloads), ("policies", self.policies), ("faults", self.faults)):
            names = [x.name for x in items]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ScenarioError(f"{what}: duplicate name(s) {', '.join(dup)}")
        self.topology.validate()
        wl = {w.name for w in self.workloads}
        pol = {p.name for p in self.policies}
        for i, f in enumerate(self.faults):
            if f.workload not in wl:
                raise ScenarioError(f"faults[{i}].workload={f.workload!r}: not a workload ({', '.join(sorted(wl))})")
            for p in f.policies:
                if p not in pol:
                    raise ScenarioError(f"faults[{i}].policies: {p!r} is not a policy ({', '.join(sorted(pol))})")
            for j, part in enumerate([f] + f.also):
                w = f"faults[{i}]" + (f".also[{j - 1}]" if j else "")
                if part.spine >= self.topology.spines:
                    raise ScenarioError(f"{w}.spine={part.spine}: the topology has {self.topology.spines} spines")
                if part.leaf >= self.topology.rails:
                    raise ScenarioError(f"{w}.leaf={part.leaf}: the topology has {self.topology.rails} leaves")
                if part.host >= self.topology.hosts:
                    raise ScenarioError(f"{w}.host={part.host}: the topology has {self.topology.hosts} hosts")
        if self.topology.leaf_routing == "sport" and self.faults:
            raise ScenarioError("faults: not supported with topology.leaf_routing=sport (its per-spine routes do not "
                                "fail over as the hashed multipath route does); use a separate scenario")
        if self.topology.leaf_routing == "sport":
            last = self.topology.sport_base(self.topology.hosts, self.paths) - 1
            if last > 65535:
                raise ScenarioError(f"topology.leaf_routing=sport: {self.topology.hosts} hosts x {self.topology.rails} rails x "
                                    f"{self.paths} paths need source ports {SPORT_BASE}..{last}, past 65535")
        c = self.checks
        for p in c.balanced_policies + c.spread_policies + [c.pinned_policy]:
            if p and pol and p not in pol:
                raise ScenarioError(f"checks: policy {p!r} is not defined in policies")
        for k in ("balance_workload", "pinned_workload", "spread_workload"):
            v = getattr(c, k)
            if v and wl and v not in wl:
                raise ScenarioError(f"checks.{k}={v!r}: not a workload")
        for i, w in enumerate(self.workloads):
            if w.rank_rail in ("rotate", "half", "first") and self.topology.rails < 2:
                raise ScenarioError(f"workloads[{i}].rank_rail={w.rank_rail}: needs at least 2 rails")
        faults = {f.name for f in self.faults}
        for f in c.cct_faults:
            if faults and f not in faults:
                raise ScenarioError(f"checks.cct_faults: {f!r} is not a fault")

    def to_json(self) -> dict:
        """The effective scenario (after overrides), written next to the results."""
        d = asdict(self)
        d["topology"].pop("FIELDS", None)
        return d
