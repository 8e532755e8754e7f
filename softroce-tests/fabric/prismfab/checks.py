"""The issue's acceptance, judged on the runs of a scenario.

* every run whose fault (if any) expects completion: every rank exited 0 and prism-perf found 0 wrong
  elements (every byte verified on every host);
* the balanced policies (spray, pro) spread the spine bytes within the tolerance of even;
* the pinned policy (ecmp), on a workload with one spine flow per leaf, leaves each leaf's uplinks
  uneven moment by moment (imbalance in 100 ms windows above the tolerance); the balanced policies'
  figures on the same flows, the whole-run figures, and ecmp's on the many-flows workload are shown;
* under each CCT fault (a black-holed spine path), every listed policy completes with CCT below
  ratio x the fault-free run (the fault's own ``cct_ratio_max`` if it has one, else the scenario's); the
  ratio and the time to recover are reported;
* if the scenario (or the fault itself) sets ``recovery_rtts_max`` (K), under each CCT fault with a dead link every listed
  policy moves the bulk of its bytes off the dead path within K round trips of the fault: the byte
  reroute time (``recovery_bytes``) over the RTT Prism measured in the fault-free run of the same
  workload and policy (``metrics.run_rtt_s``);
* if the scenario sets ``revive_s_max``, under each CCT fault that heals (``heal_after_s``) every listed
  policy puts at least half of the healed link's earlier share of the spine bytes back on it within that
  many seconds of the heal (``metrics.revival``).
"""

from __future__ import annotations

from . import metrics
from .report import baseline_of, fmt_pct, revival_text
from .scenario import Scenario
from .selftest import Check


def find(runs: list[dict], wl: str, pol: str, fault: str | None = None) -> dict | None:
    """The run of workload `wl` with policy `pol` (and fault `fault`)."""
    for r in runs:
        f = (r.get("fault") or {}).get("name")
        if r["workload"]["name"] == wl and r["policy"]["name"] == pol and f == fault:
            return r
    return None


def max_uplink_imbalance(r: dict) -> float | None:
    """The most uneven leaf's spread of its spine-bound bytes over its uplinks, over the whole run (leaves
    that sent next to nothing are left out)."""
    vals = [v for v in (r["balance"].get("leaf_uplink_imbalance") or {}).values() if v is not None]
    return max(vals) if vals else None


def moment_imbalance(r: dict) -> float | None:
    """The most uneven leaf's spread over its uplinks moment by moment (100 ms windows, byte-weighted)."""
    return (r["balance"].get("windowed_uplink") or {}).get("max")


def uplinks_text(r: dict) -> str:
    """Each leaf's uplink bytes in MB, e.g. ``lf0 [12.1, 0.0] lf1 [0.0, 11.9]``."""
    parts = []
    for leaf, v in sorted((r["balance"].get("leaf_uplink_bytes") or {}).items()):
        parts.append(f"lf{leaf} [" + ", ".join(f"{b / 1e6:.1f}" for b in v) + "] MB")
    return " ".join(parts)


def spread_text(r: dict) -> str:
    """Each busy leaf's uplink bytes and their spread, e.g. ``lf0 [6.29, 6.30, 6.29, 6.29] MB = 0.2 %``."""
    parts = []
    for leaf, v in sorted((r["balance"].get("leaf_uplink_bytes") or {}).items()):
        if sum(v) >= metrics.MIN_SPINE_BYTES:
            parts.append(f"lf{leaf} [" + ", ".join(f"{b / 1e6:.2f}" for b in v) + f"] MB = {fmt_pct(metrics.spread(v))}")
    return " ".join(parts) or "no leaf sent 1 MiB up"


def evaluate(scn: Scenario, runs: list[dict]) -> list[Check]:
    """Every check of the scenario over its runs."""
    checks: list[Check] = []
    c = scn.checks
    tol = c.balance_tolerance
    for r in runs:
        f = r.get("fault")
        if f and f.get("expect") == "report":
            continue
        detail = "every rank exited 0, 0 wrong elements" if r["ok"] else "; ".join(r["errors"])[:400]
        checks.append(Check(f"data.{r['label']}", bool(r["ok"]), detail))

    wl = c.balance_workload
    if wl and any(w.name == wl for w in scn.workloads):
        others = {p: find(runs, wl, p) for p in [c.pinned_policy] if p}
        ref = "; ".join(f"{p} on the same workload: {fmt_pct(r['balance']['spine_imbalance'])}"
                        for p, r in others.items() if r)
        for p in c.balanced_policies:
            r = find(runs, wl, p)
            if r is None:
                checks.append(Check(f"balance.{p}", False, f"no run of {wl} with {p}"))
                continue
            b = r["balance"]
            imb = b["spine_imbalance"]
            ok = r["ok"] and imb is not None and imb <= tol
            checks.append(Check(f"balance.{p}", ok,
                                f"{wl}: bytes per spine {b['spine_bytes']} -> imbalance {fmt_pct(imb)} "
                                f"(limit {fmt_pct(tol)})" + (f"; {ref}" if ref else ""),
                                {"spine_imbalance": imb, "flow_imbalance": r["flows"]["mean_imbalance"]}))
    p, fw = c.pinned_policy, c.pinned_workload
    if p and fw and any(w.name == fw for w in scn.workloads):
        r = find(runs, fw, p)
        if r is None:
            checks.append(Check(f"balance.{p}_few_flows", False, f"no run of {fw} with {p}"))
        else:
            imb = moment_imbalance(r)
            shown = "; ".join(f"{q}: {fmt_pct(moment_imbalance(x))} (whole run {fmt_pct(max_uplink_imbalance(x))})"
                              for q in c.balanced_policies if (x := find(runs, fw, q)))
            ok = r["ok"] and imb is not None and imb > tol
            checks.append(Check(f"balance.{p}_few_flows", ok,
                                f"{fw}: {p} leaves each leaf's uplinks uneven moment by moment: imbalance "
                                f"{fmt_pct(imb)} in 100 ms windows (must exceed {fmt_pct(tol)}); over the whole "
                                f"run {uplinks_text(r)} = {fmt_pct(max_uplink_imbalance(r))}"
                                + (f"; on the same flows {shown}" if shown else ""),
                                {"moment_imbalance": imb, "run_imbalance": max_uplink_imbalance(r)}))

    sw = c.spread_workload
    if c.spread_policies and sw and any(w.name == sw for w in scn.workloads):
        others = "; ".join(f"{q}: {spread_text(x)}" for x in runs
                           if x["workload"]["name"] == sw and not x.get("fault")
                           and (q := x["policy"]["name"]) not in c.spread_policies)
        for p in c.spread_policies:
            r = find(runs, sw, p)
            if r is None:
                checks.append(Check(f"spread.{p}", False, f"no run of {sw} with {p}"))
                continue
            busy = {leaf: v for leaf, v in (r["balance"].get("leaf_uplink_bytes") or {}).items()
                    if sum(v) >= metrics.MIN_SPINE_BYTES}
            spreads = {leaf: metrics.spread(v) for leaf, v in busy.items()}
            ok = bool(r["ok"]) and bool(busy) and all(x is not None and x <= c.spread_max for x in spreads.values())
            checks.append(Check(f"spread.{p}", ok,
                                f"{sw}: each busy leaf's bytes per uplink within {fmt_pct(c.spread_max)} of each other "
                                f"(max/min - 1): {spread_text(r)}" + ("" if busy else " (no leaf sent 1 MiB up)")
                                + (f"; other policies on the same workload: {others}" if others else ""),
                                {"spread": spreads, "uplink_bytes": busy}))

    for fname in c.cct_faults:
        fault = next((f for f in scn.faults if f.name == fname), None)
        if fault is None:
            continue
        for p in fault.policies:
            r = find(runs, fault.workload, p, fname)
            if r is None:
                checks.append(Check(f"fault.{fname}.{p}", False, "not run"))
                continue
            base = baseline_of(r, runs)
            ratio = (r["cct_s"] / base["cct_s"]) if (base and base.get("cct_s") and r.get("cct_s")) else None
            rec = r.get("recovery") or {}
            ttr = rec.get("ttr_s")
            limit = fault.cct_ratio_max if fault.cct_ratio_max is not None else c.cct_ratio_max
            ok = bool(r["ok"]) and ratio is not None and ratio < limit
            rr = rec.get("reroute_s")
            # By packets: a PING probing the dead path or a SACK weighs as much as a DATA packet (the
            # bytes-based figures follow).
            rec_txt = ("by packets (a probe or SACK counts as one DATA packet): "
                       + (f"bulk off the dead path after {1000 * rr:.0f} ms" if rr is not None
                          else "the bulk never left the dead path") + "; "
                       + (f"last packet into it {1000 * ttr:.0f} ms after the fault" if rec.get("recovered") and ttr is not None
                          else "packets entered it until the end")
                       + (f"; from 0.5 s after the fault it still got {100 * rec['residual_share']:.0f} % of its "
                          f"earlier packet rate" if rec.get("residual_share") is not None else "")) if rec else "no recovery data"
            x = recovery_in_rtts(r, base)
            floor = metrics.fault_floor(r, base)
            if floor is not None:
                rec_txt += (f"; the fault itself allows no better than x{floor:.2f} (its lower bound "
                            f"{r['lower_bound_fault']['seconds']:.3f} s over the fault-free CCT)")
            if x["reroute_s"] is not None:
                rec_txt += (f"; by bytes off the dead path after {1000 * x['reroute_s']:.0f} ms"
                            + (f" = {x['rtts']:.1f} RTTs of {1000 * x['rtt_s']:.1f} ms" if x["rtts"] is not None else ""))
            elif metrics.dead_path_recovery(r):
                rec_txt += "; by bytes the bulk never stayed off the dead path"
            if x["first_off_s"] is not None and x["first_off_s"] != x["reroute_s"]:
                rec_txt += (f" (it first left it for 200 ms after {1000 * x['first_off_s']:.0f} ms"
                            + (f" = {x['first_off_rtts']:.1f} RTTs" if x["first_off_rtts"] is not None else "") + ")")
            checks.append(Check(f"fault.{fname}.{p}", ok,
                                f"{fault.workload} with {fault.kind} at {r.get('fault_at_s') or 0:.2f} s: data "
                                f"{'verified' if r['ok'] else 'NOT verified'}, CCT {r.get('cct_s') or 0:.3f} s vs "
                                f"{(base or {}).get('cct_s') or 0:.3f} s without = x{ratio if ratio is None else round(ratio, 2)} "
                                f"(limit x{limit:g}); {rec_txt}",
                                {"ratio": ratio, "recovery": rec, "recovery_bytes": x, "data_ok": bool(r["ok"]),
                                 "fault_floor_ratio": floor}))
            k_max = fault.recovery_rtts_max if fault.recovery_rtts_max is not None else c.recovery_rtts_max
            if fault.kind in ("blackhole", "link_down", "nic_blackhole") and k_max is not None:
                checks.append(recovery_check(fname, p, r, base, k_max))
            if fault.heal_after_s is not None and c.revive_s_max is not None:
                checks.append(revival_check(fname, p, r, base, c.revive_s_max))
    return checks


def revival_check(fname: str, pol: str, r: dict, base: dict | None, s_max: float) -> Check:
    """`revival.<fault>.<policy>`: once the fault healed, the link carried at least half its share of the
    spine bytes from before the fault again within `s_max` seconds."""
    rv = r.get("revival") or {}
    got = rv.get("revived_s")
    ok = bool(r.get("ok")) and r.get("heal_at_s") is not None and got is not None and got <= s_max
    return Check(f"revival.{fname}.{pol}", ok, f"{revival_text(r, base)}; limit {1000 * s_max:.0f} ms",
                 {"revival": rv, "heal_at_s": r.get("heal_at_s")})


def recovery_in_rtts(r: dict, base: dict | None) -> dict:
    """The time the bulk of a fault run's bytes took to leave the dead path, in seconds and in round
    trips of the fault-free run (RTT as Prism measured it there, averaged over every sample)."""
    by = metrics.dead_path_recovery(r) or {}
    rtt = metrics.run_rtt_s(base)
    rr = by.get("reroute_s")
    fo = by.get("first_off_s")
    return {"reroute_s": rr, "rtt_s": rtt, "rtts": (rr / rtt) if (rr is not None and rtt) else None,
            "first_off_s": fo, "first_off_rtts": (fo / rtt) if (fo is not None and rtt) else None,
            "resolution_s": by.get("resolution_s"), "fault_gap_s": by.get("fault_gap_s"),
            "residual_share": by.get("residual_share")}


def recovery_check(fname: str, pol: str, r: dict, base: dict | None, k_max: float) -> Check:
    """`recovery.<fault>.<policy>`: the bulk of the bytes off the dead path within `k_max` RTTs."""
    x = recovery_in_rtts(r, base)
    name = f"recovery.{fname}.{pol}"
    if x["rtt_s"] is None:
        return Check(name, False, "no RTT: the fault-free run has no RTT samples in PRISM_STATS", x)
    if x["reroute_s"] is None:
        first = (f"; it first left it after {1000 * x['first_off_s']:.0f} ms = {x['first_off_rtts']:.1f} RTTs"
                 if x["first_off_s"] is not None else "")
        return Check(name, False, f"the bulk of the bytes never stayed off the dead path (limit {k_max:g} RTTs of "
                                  f"{1000 * x['rtt_s']:.1f} ms = {1000 * k_max * x['rtt_s']:.0f} ms){first}", x)
    ok = x["rtts"] <= k_max
    gap = x.get("fault_gap_s")
    late = (f"; the counters were sampled {1000 * gap:.0f} ms apart around the fault (nominal "
            f"{1000 * x['resolution_s']:.0f} ms): nothing finer could be seen"
            if gap is not None and x.get("resolution_s") and gap > 2 * x["resolution_s"] else "")
    return Check(name, ok, f"bulk of the bytes off the dead path {1000 * x['reroute_s']:.0f} ms after the fault = "
                           f"{x['rtts']:.1f} RTTs of {1000 * x['rtt_s']:.1f} ms (the fault-free run's mean RTT); "
                           f"limit {k_max:g} RTTs{late}", x)
