"""Counters of the fabric: interface bytes and packets, IP no-route drops, qdisc backlog and drops.

Interface counters are read from ``/proc/<pid>/net/dev`` of a process inside each node (a node's shell):
that file shows the network namespace of the process, so one thread can sample every node every few
milliseconds without starting a process or entering a namespace. Qdisc statistics need ``tc``; they are
read far less often.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

# /proc/net/dev columns after "iface:".
_RX = ("rx_bytes", "rx_packets", "rx_errs", "rx_drop")
_TX = ("tx_bytes", "tx_packets", "tx_errs", "tx_drop")


def parse_netdev(text: str) -> dict[str, dict[str, int]]:
    """``/proc/net/dev`` as {interface: {rx_bytes, rx_packets, rx_errs, rx_drop, tx_bytes, ...}}."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines()[2:]:
        if ":" not in line:
            continue
        name, rest = line.split(":", 1)
        f = rest.split()
        if len(f) < 16:
            continue
        v = [int(x) for x in f[:16]]
        d = dict(zip(_RX, v[0:4]))
        d.update(zip(_TX, v[8:12]))
        out[name.strip()] = d
    return out


def parse_netstat(text: str) -> dict[str, dict[str, int]]:
    """``/proc/net/netstat`` or ``/proc/net/snmp`` (pairs of header/value lines) as {group: {name: value}}."""
    out: dict[str, dict[str, int]] = {}
    lines = text.splitlines()
    for head, vals in zip(lines[0::2], lines[1::2]):
        g, names = head.split(":", 1)
        g2, values = vals.split(":", 1)
        if g != g2:
            continue
        try:
            out[g] = dict(zip(names.split(), (int(x) for x in values.split())))
        except ValueError:
            continue
    return out


def read_netdev(pid: int) -> dict[str, dict[str, int]]:
    """Interface counters of the network namespace of process `pid`."""
    with open(f"/proc/{pid}/net/dev", encoding="ascii") as f:
        return parse_netdev(f.read())


def read_no_routes(pid: int) -> int:
    """Packets the namespace of `pid` dropped for want of a route (IpExt InNoRoutes)."""
    with open(f"/proc/{pid}/net/netstat", encoding="ascii") as f:
        return parse_netstat(f.read()).get("IpExt", {}).get("InNoRoutes", 0)


def read_udp(pid: int) -> dict[str, int]:
    """UDP counters (InDatagrams, NoPorts, InErrors, RcvbufErrors, SndbufErrors ...) of the namespace of
    `pid`: where datagrams die inside a host (a full socket buffer, a closed port) rather than on a wire."""
    with open(f"/proc/{pid}/net/snmp", encoding="ascii") as f:
        return parse_netstat(f.read()).get("Udp", {})


def parse_tc_json(text: str, dev: str | None = None) -> list[dict]:
    """``tc -s -j qdisc show`` as a list of {dev, kind, handle, parent, bytes, packets, drops, overlimits,
    backlog, qlen}. tc leaves the device out when one was named (``show dev X``): pass it as `dev`."""
    text = text.strip()
    if not text:
        return []
    rows = []
    for q in json.loads(text):
        rows.append({
            "dev": q.get("dev", dev), "kind": q.get("kind"), "handle": q.get("handle"), "parent": q.get("parent", "root"),
            "bytes": int(q.get("bytes", 0)), "packets": int(q.get("packets", 0)), "drops": int(q.get("drops", 0)),
            "overlimits": int(q.get("overlimits", 0)), "backlog": int(q.get("backlog", 0)),
            "qlen": int(q.get("qlen", 0)),
        })
    return rows


@dataclass
class Series:
    """Samples of every node's interface counters: times (monotonic seconds) and one dict per sample."""

    t: list[float] = field(default_factory=list)
    netdev: list[dict[str, dict[str, dict[str, int]]]] = field(default_factory=list)
    no_routes: list[dict[str, int]] = field(default_factory=list)

    def counter(self, node: str, ifname: str, key: str) -> list[int]:
        """One counter of one interface over time (a missing interface reads 0)."""
        return [s.get(node, {}).get(ifname, {}).get(key, 0) for s in self.netdev]


class Sampler:
    """A thread that samples /proc of every node every `interval_s` seconds until stopped."""

    def __init__(self, nodes: dict[str, int], interval_s: float = 0.01):
        self.nodes = dict(nodes)
        self.interval_s = interval_s
        self.series = Series()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prismfab-sampler", daemon=True)
        self.error: str | None = None

    def sample(self) -> tuple[float, dict, dict]:
        """One sample now: (time, netdev per node, InNoRoutes per node)."""
        t = time.monotonic()
        nd = {n: read_netdev(pid) for n, pid in self.nodes.items()}
        nr = {n: read_no_routes(pid) for n, pid in self.nodes.items()}
        return t, nd, nr

    def _run(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            try:
                t, nd, nr = self.sample()
            except OSError as e:  # a node went away: the run is being torn down
                self.error = str(e)
                return
            s = self.series
            s.t.append(t)
            s.netdev.append(nd)
            s.no_routes.append(nr)
            nxt += self.interval_s
            delay = nxt - time.monotonic()
            if delay < 0:  # fell behind (busy machine): do not try to catch up in a burst
                nxt = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def start(self) -> "Sampler":
        """Starts sampling (takes one sample first, so the series is never empty)."""
        t, nd, nr = self.sample()
        self.series.t.append(t)
        self.series.netdev.append(nd)
        self.series.no_routes.append(nr)
        self._thread.start()
        return self

    def stop(self) -> Series:
        """Stops, takes a last sample, and returns the series."""
        self._stop.set()
        self._thread.join()
        try:
            t, nd, nr = self.sample()
            self.series.t.append(t)
            self.series.netdev.append(nd)
            self.series.no_routes.append(nr)
        except OSError:
            pass
        return self.series


def delta(a: dict[str, dict[str, dict[str, int]]], b: dict[str, dict[str, dict[str, int]]]) -> dict:
    """b - a for every node, interface and counter present in b."""
    out: dict = {}
    for node, ifs in b.items():
        for ifn, ctr in ifs.items():
            base = a.get(node, {}).get(ifn, {})
            out.setdefault(node, {})[ifn] = {k: v - base.get(k, 0) for k, v in ctr.items()}
    return out


class BacklogPoller:
    """A thread that runs ``tc -s -j qdisc show`` in every router every `interval_s` seconds and keeps,
    per port, the largest backlog seen (bytes and packets). A queue's backlog only exists while it is
    building, so it has to be sampled during the run; drops are cumulative and read once at the end."""

    def __init__(self, nodes: dict[str, int], interval_s: float = 0.25):
        self.nodes = dict(nodes)
        self.interval_s = interval_s
        self.peak: dict[str, dict[str, int]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prismfab-backlog", daemon=True)

    def poll(self) -> None:
        """One round over every router."""
        import subprocess

        for name, pid in self.nodes.items():
            try:
                r = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "tc", "-s", "-j", "qdisc", "show"],
                                   capture_output=True, text=True, timeout=5, check=False)
                rows = parse_tc_json(r.stdout)
            except (subprocess.SubprocessError, ValueError, OSError):
                continue
            for q in rows:
                if q["kind"] != "pfifo":
                    continue
                key = f"{name}:{q['dev']}"
                p = self.peak.setdefault(key, {"bytes": 0, "packets": 0})
                p["bytes"] = max(p["bytes"], q["backlog"])
                p["packets"] = max(p["packets"], q["qlen"])
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def start(self) -> "BacklogPoller":
        """Starts polling."""
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stops and returns {"samples", "max_bytes", "max_port", "ports": {node:dev: peak}} (ports with a
        backlog only)."""
        self._stop.set()
        self._thread.join()
        ports = {k: v for k, v in self.peak.items() if v["bytes"] > 0}
        top = max(ports.items(), key=lambda kv: kv[1]["bytes"], default=(None, {"bytes": 0}))
        return {"samples": self.samples, "max_bytes": top[1]["bytes"], "max_port": top[0], "ports": ports}
