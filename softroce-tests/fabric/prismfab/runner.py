"""One run: one prism-perf rank per host, one workload, one policy combination, optionally one fault.

The ranks meet over the management network (rank 0 listens on its management address), move their data
over the fabric (each rank's device 0 is its rail ``rank_rail_of(i)``; its other rails follow in
PRISM_IFNAMES), check every element (-c 1), and rank 0 writes prism-perf's JSON. Meanwhile the sampler
records every node's interface counters; a fault, if any, fires ``at_s`` seconds after the first data
bytes appear on the rails.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import metrics
from .counters import BacklogPoller, Sampler, delta, parse_tc_json, read_udp
from .faults import Injector
from .scenario import Fault, Policy, Scenario, Workload
from .topo import Fabric, downlink_if, host_addr, host_if, host_name, leaf_name, mgmt_addr, spine_name, uplink_if

log = logging.getLogger("prismfab.runner")

RENDEZVOUS_PORT = 29500
FLOW_TABLE = "prismfab_flows"
# Data has started once the ranks' rails carried this much (the TCP handshakes are far smaller).
START_BYTES = 256 << 10


@dataclass
class Binaries:
    """Where prism-perf and the plugin are."""

    perf: Path
    plugin: Path

    def check(self) -> str | None:
        """Why these binaries cannot be used, or None."""
        for p in (self.perf, self.plugin):
            if not p.exists():
                return f"{p} does not exist (build with `cargo build --release`, or set PRISM_BIN_DIR)"
        if not os.access(self.perf, os.X_OK):
            return f"{self.perf} is not executable"
        return None


def install_flow_counters(fab: Fabric) -> None:
    """An nft set per spine that counts forwarded bytes per (source, destination) address pair."""
    for s in range(fab.spec.spines):
        fab.sh(fab.spine(s),
               f"nft 'add table ip {FLOW_TABLE} {{ set flows {{ type ipv4_addr . ipv4_addr; size 65535; "
               f"flags dynamic; counter; }}; chain fw {{ type filter hook forward priority 0; policy accept; "
               f"update @flows {{ ip saddr . ip daddr }}; }}; }}'")


def reset_flow_counters(fab: Fabric) -> None:
    """Empties every spine's flow set."""
    for s in range(fab.spec.spines):
        fab.sh(fab.spine(s), f"nft flush set ip {FLOW_TABLE} flows")


def read_flow_counters(fab: Fabric) -> dict[int, dict[tuple[str, str], int]]:
    """{spine: {(saddr, daddr): bytes}}."""
    out: dict[int, dict[tuple[str, str], int]] = {}
    for s in range(fab.spec.spines):
        text = fab.spine(s).cmd(f"nft -j list set ip {FLOW_TABLE} flows")
        per: dict[tuple[str, str], int] = {}
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = {}
        for item in doc.get("nftables", []):
            for e in (item.get("set") or {}).get("elem", []):
                el = e.get("elem", {})
                key = el.get("val", {}).get("concat")
                ctr = el.get("counter") or {}
                if isinstance(key, list) and len(key) == 2:
                    per[(key[0], key[1])] = int(ctr.get("bytes", 0))
        out[s] = per
    return out


def tc_snapshot(fab: Fabric) -> dict[str, list[dict]]:
    """``tc -s qdisc`` of every node (a host's qdisc is its NIC's queue), parsed."""
    return {n.name: parse_tc_json(n.cmd("tc -s -j qdisc show")) for n in fab.routers() + fab.hosts()}


def tc_drops(before: dict, after: dict) -> list[dict]:
    """Per port: packets its qdisc dropped during the run (only ports that dropped)."""
    out = []
    for node, rows in after.items():
        base = {(r["dev"], r["handle"]): r for r in before.get(node, [])}
        for r in rows:
            if r["kind"] != "pfifo":
                continue
            b = base.get((r["dev"], r["handle"]), {})
            d = r["drops"] - b.get("drops", 0)
            if d > 0:
                out.append({"node": node, "dev": r["dev"], "drops": d})
    return out


TOPO_FILE = "prism-topo.json"


def prism_topology(spec, rank_rail: str | None = None) -> dict:
    """The PRISM_TOPO of a run under leaf_routing "sport": leaf r is rail r's, with one uplink per spine
    (entropy e on uplink e mod spines: no entropy_uplink table, which is what the leaves' port map does);
    host i is named h<i> and lists the leaf of each of its rails in its PRISM_IFNAMES order (Prism's rail
    index), which depends on the workload's rank_rail."""
    return {
        "rails": spec.rails, "uplinks": spec.spines, "spines": spec.spines,
        "leaves": [{"uplinks": spec.spines} for _ in range(spec.rails)],
        "hosts": [{"name": host_name(i), "leaves": spec.rail_order(i, rank_rail)} for i in range(spec.hosts)],
    }


def rank_env(scn: Scenario, pol: Policy, i: int, out: Path, wl: Workload | None = None) -> dict[str, str]:
    """The environment of rank i: the caller's, minus any PRISM_* (the plugin rejects names it does not
    know, and a stray setting would skew the run), plus this run's: the scenario's variables, then the
    workload's, then the policy's (the later win). Under leaf_routing "sport" also its source port base,
    the run's topology file (`out/prism-topo.json`, written by `run_one`) and its host name there."""
    spec = scn.topology
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_") and not k.startswith("NCCL_")}
    rails = spec.rail_order(i, wl.rank_rail if wl else None)
    env.update({
        "PRISM_IFNAMES": ",".join(host_if(i, r) for r in rails),
        "PRISM_PATHS": str(scn.paths),
        # /sys inside a node shows the outer namespace's interfaces, so the plugin cannot read the MTU.
        "PRISM_MTU": str(spec.mtu),
        "PRISM_STATS": str(out / f"stats-rank{i}.json"),
    })
    if spec.leaf_routing == "sport":
        env.update({
            "PRISM_UDP_SPORT_BASE": str(spec.sport_base(i, scn.paths)),
            "PRISM_TOPO": str(out / TOPO_FILE),
            "PRISM_HOST": host_name(i),
        })
    env.update(scn.prism_env)
    if wl:
        env.update(wl.env)
    env.update(pol.env)
    return env


def rails_used(scn: Scenario, wl: Workload, pol: Policy) -> int:
    """How many rails a rank's traffic may use: one under PRISM_RAIL=single, else all of them."""
    env = {**scn.prism_env, **wl.env, **pol.env}
    return 1 if env.get("PRISM_RAIL", "").strip() == "single" else scn.topology.rails


def perf_cmd(bins: Binaries, scn: Scenario, wl: Workload, i: int, out: Path) -> list[str]:
    """The prism-perf command line of rank i."""
    cmd = [str(bins.perf), wl.collective, "--rank", str(i), "--nranks", str(scn.topology.hosts),
           "--rendezvous", f"{mgmt_addr(0)}:{RENDEZVOUS_PORT}", "--plugin", str(bins.plugin),
           "-b", str(wl.size_bytes), "-e", str(wl.size_bytes), "-n", str(wl.iters), "-w", str(wl.warmup),
           "-c", "1", "-T", str(scn.timeout_s)]
    if i == 0:
        cmd += ["--json", str(out / "perf.json")]
    return cmd


def run_one(fab: Fabric, scn: Scenario, bins: Binaries, wl: Workload, pol: Policy, fault: Fault | None,
            out: Path, sample_interval_s: float = 0.01) -> dict:
    """Runs one collective across the fabric and returns everything measured (also written to
    ``out/run.json``)."""
    spec = scn.topology
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        if old.is_file():
            old.unlink()
    label = f"{wl.name}/{pol.name}" + (f"/{fault.name}" if fault else "")
    log.info("run %s", label)
    if spec.leaf_routing == "sport":
        (out / TOPO_FILE).write_text(json.dumps(prism_topology(spec, wl.rank_rail), indent=1))
    reset_flow_counters(fab)
    tc0 = tc_snapshot(fab)
    udp0 = {h.name: read_udp(h.pid) for h in fab.hosts()}
    nodes = {n.name: n.pid for n in fab.routers()}
    nodes.update({h.name: h.pid for h in fab.hosts()})
    sampler = Sampler(nodes, sample_interval_s).start()
    backlog = BacklogPoller({n.name: n.pid for n in fab.routers()}).start()
    injector = Injector(fab, fault) if fault else None
    procs = []
    files = []
    exit_at: dict[int, float] = {}
    t_start = time.monotonic()
    try:
        for i in range(spec.hosts):
            o = open(out / f"rank{i}.out", "w")
            e = open(out / f"rank{i}.err", "w")
            files += [o, e]
            p = fab.host(i).popen(perf_cmd(bins, scn, wl, i, out), stdout=o, stderr=e,
                                  env=rank_env(scn, pol, i, out, wl))
            procs.append(p)
        t_data = None
        t_fault = None
        t_heal = None
        parts_at: list[dict] = []
        drops_at_fault = 0
        deadline = t_start + scn.timeout_s + 30
        rails0 = None
        exit_at: dict[int, float] = {}
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i not in exit_at and p.poll() is not None:
                    exit_at[i] = now
            if now > deadline:
                log.error("run %s: ranks still running after %d s: stopping them", label, scn.timeout_s + 30)
                break
            if t_data is None:
                s = sampler.series
                n = len(s.t)  # samples whose counters are all there (the sampler appends the time last)
                if n:
                    if rails0 is None:
                        rails0 = s.netdev[0]
                    cur = s.netdev[n - 1]
                    sent = sum(cur.get(f"h{i}", {}).get(host_if(i, r), {}).get("tx_bytes", 0)
                               - rails0.get(f"h{i}", {}).get(host_if(i, r), {}).get("tx_bytes", 0)
                               for i in range(spec.hosts) for r in range(spec.rails))
                    if sent >= START_BYTES:
                        t_data = s.t[n - 1]
            if injector and injector.pending and t_data is not None:
                for part in injector.inject_due(now - t_data):
                    t_part = time.monotonic()
                    parts_at.append({"kind": part.kind, "spine": part.spine, "leaf": part.leaf, "host": part.host,
                                     "at_s": round(t_part - t_data, 4), "bw_mbit": part.bw_mbit,
                                     "loss_pct": part.loss_pct})
                    if part is fault:
                        t_fault = t_part
            heal_due = bool(injector and fault.heal_after_s is not None and not injector.healed)
            if heal_due and t_fault is not None and now - t_fault >= fault.heal_after_s:
                # Timed from the start: a cut link carries traffic again as soon as it is up, while
                # reinstalling every router's routes takes a few hundred milliseconds more.
                t_heal = time.monotonic()
                injector.heal()
                # The fabric's bound under the fault gets its link back from here on.
                parts_at.append({"kind": "heal", "of": fault.kind, "spine": fault.spine, "leaf": fault.leaf, "host": fault.host,
                                 "at_s": round(t_heal - t_data, 4)})
            time.sleep(0.005 if (injector and (injector.pending or heal_due)) else 0.05)
        t_end = time.monotonic()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in files:
            f.close()
        series = sampler.stop()
        peaks = backlog.stop()
        if injector:
            drops_at_fault = injector.nft_drops()
            injector.clear()
    tc1 = tc_snapshot(fab)
    udp1 = {h.name: read_udp(h.pid) for h in fab.hosts()}
    flows = read_flow_counters(fab)
    d = delta(series.netdev[0], series.netdev[-1])
    res: dict = {
        "label": label, "workload": wl.__dict__, "policy": pol.__dict__, "fault": asdict(fault) if fault else None,
        "topology": spec.label(), "paths": scn.paths, "wall_s": round(t_end - t_start, 3),
        "ranks": [], "ok": True, "errors": [],
    }
    for i, p in enumerate(procs):
        rc = p.returncode
        err_tail = (out / f"rank{i}.err").read_text(errors="replace")[-2000:]
        # prism-perf reports the slowest rank's time only; each rank's exit (connect + every pass + check,
        # 50 ms resolution) shows which rank was last.
        ex = exit_at.get(i, t_end)
        res["ranks"].append({"rank": i, "host": f"h{i}", "rail": spec.rank_rail_of(i, wl.rank_rail), "rc": rc,
                             "exit_s": round(ex - t_start, 3)})
        if rc != 0:
            res["ok"] = False
            res["errors"].append(f"rank {i} exited with {rc}: {err_tail.strip()[-600:]}")
    perf = None
    try:
        perf = json.loads((out / "perf.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        res["ok"] = False
        res["errors"].append(f"rank 0 wrote no usable perf.json: {e}")
    if perf:
        rows = perf.get("results", [])
        row = rows[-1] if rows else {}
        res["perf"] = {"time_us": row.get("time_us"), "algbw": row.get("algbw"), "busbw": row.get("busbw"),
                       "wrong": row.get("wrong"), "out_of_bounds": perf.get("out_of_bounds")}
        res["cct_s"] = row.get("time_us") / 1e6 if row.get("time_us") is not None else None
        if row.get("wrong") is None or row.get("wrong") != 0 or perf.get("out_of_bounds", 1) != 0:
            res["ok"] = False
            res["errors"].append(f"data check: wrong={row.get('wrong')} out_of_bounds={perf.get('out_of_bounds')}")
    stats_docs = []
    for i in range(spec.hosts):
        f = out / f"stats-rank{i}.json"
        if f.exists():
            try:
                stats_docs.append(json.loads(f.read_text()))
            except json.JSONDecodeError:
                res["errors"].append(f"{f.name}: not JSON")
    res["prism_stats"] = metrics.summarize_stats(stats_docs)
    res["prism_stats_files"] = len(stats_docs)
    res["rails"] = metrics.rail_bytes(spec, d)
    links = metrics.spine_links(spec, d)
    res["spine_links"] = links
    res["balance"] = metrics.spine_balance(spec, links)
    res["balance"]["windowed_uplink"] = metrics.windowed_uplink_imbalance(spec, series.t, series.netdev)
    addr_host = {host_addr(i, r): i for i in range(spec.hosts) for r in range(spec.rails)}
    res["flows"] = metrics.flow_balance(spec, flows, addr_host)
    res["qdisc_drops"] = tc_drops(tc0, tc1)
    # Drops in the fabric (leaf and spine ports) and in the hosts' own NIC queues, kept apart: the first
    # are the network's congestion, the second a sender outrunning its own link.
    res["qdisc_drops_total"] = sum(x["drops"] for x in res["qdisc_drops"] if not x["node"].startswith("h"))
    res["host_qdisc_drops_total"] = sum(x["drops"] for x in res["qdisc_drops"] if x["node"].startswith("h"))
    # Datagrams lost inside the hosts (socket buffers full, closed ports): not the fabric's doing.
    res["host_udp"] = {n: {k: udp1[n].get(k, 0) - udp0[n].get(k, 0)
                           for k in ("InDatagrams", "OutDatagrams", "NoPorts", "InErrors", "RcvbufErrors", "SndbufErrors")}
                       for n in udp1}
    res["host_udp_drops"] = sum(v["RcvbufErrors"] + v["NoPorts"] + v["SndbufErrors"] for v in res["host_udp"].values())
    res["backlog_peak"] = peaks
    lb = metrics.lower_bound_s(spec, wl.collective, wl.size_bytes, wl.rank_rail, rails_used(scn, wl, pol))
    res["lower_bound"] = lb
    if res.get("cct_s"):
        res["cct_over_bound"] = res["cct_s"] / lb["seconds"] if lb["seconds"] else None
    # What the links really carried (warm-up, timed and check passes: prism-perf runs `-c 1`). Split
    # against the fault-free bound only without a fault: a fault shifts bytes between links for the
    # rest of the run, the check pass included.
    lt = metrics.link_time(spec, res["rails"], links, wl.warmup + wl.iters + 1)
    res["link_time"] = lt
    if not injector and res.get("cct_s") and lt["busiest"] and lt["busiest"]["seconds"]:
        res["cct_over_link_time"] = res["cct_s"] / lt["busiest"]["seconds"]
        res["link_time_over_bound"] = lt["busiest"]["seconds"] / lb["seconds"] if lb["seconds"] else None
    if injector:
        res["fault_injected"] = t_fault is not None
        res["fault_at_s"] = (t_fault - t_data) if (t_fault and t_data) else None
        res["fault_nft_drops"] = drops_at_fault
        if fault.also:
            res["fault_parts"] = parts_at
        if parts_at:
            # The fabric as it broke, at the moments it broke: no policy could finish before this.
            fb = metrics.fault_lower_bound_s(spec, wl.collective, wl.size_bytes, parts_at, wl.rank_rail,
                                             rails_used(scn, wl, pol))
            res["lower_bound_fault"] = fb
            if res.get("cct_s") and fb["seconds"]:
                res["cct_over_fault_bound"] = res["cct_s"] / fb["seconds"]
        if t_fault is None:
            res["ok"] = False
            res["errors"].append("the fault never fired (the run ended before data flowed for at_s seconds)")
        else:
            if fault.heal_after_s is not None:
                res["heal_at_s"] = (t_heal - t_data) if t_heal is not None else None
                if t_heal is None:
                    res["ok"] = False
                    res["errors"].append("the fault never healed (the run ended before heal_after_s)")
            # How traffic left the dead path is judged while it was dead (until the heal, if any).
            dead = [injector.dead_path_packets(nd, nr) for nd, nr in zip(series.netdev, series.no_routes)]
            # A spine fault's dead path is measured against the spines' traffic, a NIC fault's against
            # every host NIC's.
            nic = fault.kind == "nic_blackhole"
            if dead and dead[0] is not None:
                total = [(metrics.nic_packets if nic else metrics.spine_packets)(spec, nd) for nd in series.netdev]
                res["recovery"] = metrics.recovery(series.t, dead, total, t_fault, sample_interval_s, until=t_heal)
            dead_b = [injector.link_bytes(nd) for nd in series.netdev]
            if dead_b and dead_b[0] is not None:
                # The same measure by bytes, at the sampling resolution (10 ms): when the bulk of the
                # data left the dead path; probes and control packets weigh what they weigh.
                total_b = [(metrics.nic_bytes_total if nic else metrics.spine_bytes_total)(spec, nd) for nd in series.netdev]
                if fault.kind in ("blackhole", "nic_blackhole"):
                    res["recovery_bytes"] = metrics.recovery(series.t, dead_b, total_b, t_fault, sample_interval_s,
                                                             until=t_heal)
                if t_heal is not None:
                    res["revival"] = metrics.revival(series.t, dead_b, total_b, t_fault, t_heal, sample_interval_s)
    # How regular the samples came: every time measured from the counters is no finer than their gaps.
    res["sampler"] = sampler.gaps()
    if t_fault is not None:
        res["sampler"]["around_fault"] = sampler.gaps(since=t_fault - 0.1, until=t_fault + 0.5)
    # The per-link byte series (10 ms) are kept for the charts of the report, thinned to 50 ms.
    res["timeline"] = timeline(spec, series, t_data or t_start, step_s=0.05)
    if t_fault is not None and t_data is not None:
        res["timeline"]["fault_t"] = t_fault - t_data
        if fault.kind in ("blackhole", "link_down"):
            res["timeline"]["fault_link"] = uplink_if(fault.leaf, fault.spine)
    (out / "run.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def timeline(spec, series, t0: float, step_s: float) -> dict:
    """Per leaf-spine link: bytes sent onto it (both directions, from both ends' transmit counters) per
    `step_s`, for the recovery chart. Bytes a black hole drops are in it (they were sent onto the link)."""
    if not series.t:
        return {"t": [], "step_s": step_s, "links": {}}
    idx = [0]
    for k in range(1, len(series.t)):
        if series.t[k] - series.t[idx[-1]] >= step_s:
            idx.append(k)
    if idx[-1] != len(series.t) - 1:
        idx.append(len(series.t) - 1)

    def link_total(k: int, r: int, s: int) -> int:
        nd = series.netdev[k]
        return (nd.get(leaf_name(r), {}).get(uplink_if(r, s), {}).get("tx_bytes", 0)
                + nd.get(spine_name(s), {}).get(downlink_if(s, r), {}).get("tx_bytes", 0))

    tl: dict = {"t": [round(series.t[k] - t0, 3) for k in idx[1:]], "step_s": step_s, "links": {}}
    for r in range(spec.rails):
        for s in range(spec.spines):
            vals = [link_total(k, r, s) for k in idx]
            tl["links"][uplink_if(r, s)] = [b - a for a, b in zip(vals, vals[1:])]
    return tl
