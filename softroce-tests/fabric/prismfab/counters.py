"""Counters of the fabric: interface bytes and packets, IP no-route drops, qdisc backlog and drops.

Interface counters are read from ``/proc/<pid>/net/dev`` of a process inside each node (a node's shell):
that file shows the network namespace of the process, so one process (``Sampler``'s) can sample every
node every few milliseconds without entering a namespace. Qdisc statistics need ``tc``; they are read
far less often.

  python3 -m prismfab.counters --sample INTERVAL_S NODES_JSON   (the sampler process; stops when stdin closes)
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

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
    """Samples /proc of every node every `interval_s` seconds until stopped, from a process of its own.

    The sampling runs in a child process (``python3 -m prismfab.counters --sample``) at real-time priority
    (``SCHED_FIFO`` 1, else nice -10), not in a thread of the runner: under load a thread of the runner
    waits for the CPU and for the interpreter lock like everything else, and its samples then come 50-110
    ms apart instead of 10 (measured with four busy loops beside a run), which quantises every time
    measured from the counters: a black hole whose traffic left its link within 20 ms (a capture of the
    link says so) was reported as 88 ms, the first sample after the fault. The child timestamps each
    sample itself (``CLOCK_MONOTONIC``, the runner's clock too) and streams it to a reader thread here;
    ``gaps()`` tells how regular the samples really were.
    """

    def __init__(self, nodes: dict[str, int], interval_s: float = 0.01):
        self.nodes = dict(nodes)
        self.interval_s = interval_s
        self.series = Series()
        self.error: str | None = None
        self.priority: str | None = None
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._read, name="prismfab-sampler", daemon=True)

    def sample(self) -> tuple[float, dict, dict]:
        """One sample now: (time, netdev per node, InNoRoutes per node)."""
        return sample_nodes(self.nodes)

    def _append(self, t: float, nd: dict, nr: dict) -> None:
        # The time last: a reader that takes len(series.t) samples finds their counters there.
        self.series.netdev.append(nd)
        self.series.no_routes.append(nr)
        self.series.t.append(t)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                self.error = f"sampler: unreadable line {line[:80]!r}"
                continue
            if isinstance(msg, dict):
                if "priority" in msg:
                    self.priority = msg["priority"]
                if "error" in msg:  # a node went away: the run is being torn down
                    self.error = msg["error"]
                continue
            try:
                t, nd, nr = msg
            except (TypeError, ValueError):
                self.error = f"sampler: unexpected line {line[:80]!r}"
                continue
            self._append(t, nd, nr)

    def start(self) -> "Sampler":
        """Starts sampling (takes one sample first, so the series is never empty)."""
        self._append(*self.sample())
        cmd = [sys.executable, "-m", "prismfab.counters", "--sample", str(self.interval_s), json.dumps(self.nodes)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      cwd=Path(__file__).resolve().parent.parent)
        self._thread.start()
        # The run starts once the child samples (starting an interpreter on a busy machine took up to
        # 0.9 s): a run whose first bytes fell in that gap would find its data start late.
        deadline = time.monotonic() + 30
        while len(self.series.t) < 2 and self.error is None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if len(self.series.t) < 2:
            self.stop()
            raise RuntimeError(f"the sampler process did not start sampling: {self.error or 'no sample in 30 s'}")
        return self

    def stop(self) -> Series:
        """Stops, takes a last sample, and returns the series."""
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # the child's cue to finish
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._thread.join(timeout=5)
        try:
            self._append(*self.sample())
        except OSError:
            pass
        return self.series

    def gaps(self, since: float | None = None, until: float | None = None) -> dict:
        """How far apart the samples came (ms): median, 99th percentile and largest gap, over the whole
        series or the samples between `since` and `until`; and the scheduling the sampler got."""
        t = [x for x in self.series.t if (since is None or x >= since) and (until is None or x <= until)]
        d = sorted(b - a for a, b in zip(t, t[1:]))
        out: dict = {"samples": len(t), "interval_ms": round(self.interval_s * 1000, 3), "priority": self.priority,
                     "error": self.error, "exit": self._proc.returncode if self._proc is not None else None}
        if d:
            out.update(median_ms=round(1000 * d[len(d) // 2], 2), p99_ms=round(1000 * d[min(len(d) - 1, int(0.99 * len(d)))], 2),
                       max_ms=round(1000 * d[-1], 2))
        return out


def sample_nodes(nodes: dict[str, int]) -> tuple[float, dict, dict]:
    """One sample of every node now: (time, netdev per node, InNoRoutes per node)."""
    t = time.monotonic()
    nd = {n: read_netdev(pid) for n, pid in nodes.items()}
    nr = {n: read_no_routes(pid) for n, pid in nodes.items()}
    return t, nd, nr


def _raise_priority() -> str:
    """Real-time priority 1 if the kernel grants it (root), else nice -10, else none; says which."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "SCHED_FIFO 1"
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice -10"
    except OSError:
        return "normal"


def _sample_loop(interval_s: float, nodes: dict[str, int]) -> int:
    """The sampler process: one JSON line per sample on stdout until stdin closes (or a node is gone)."""
    out = sys.stdout
    out.write(json.dumps({"priority": _raise_priority()}) + "\n")
    nxt = time.monotonic()
    while True:
        try:
            t, nd, nr = sample_nodes(nodes)
        except OSError as e:
            out.write(json.dumps({"error": str(e)}) + "\n")
            out.flush()
            return 0
        try:
            out.write(json.dumps([t, nd, nr], separators=(",", ":")) + "\n")
            out.flush()
        except BrokenPipeError:
            return 0
        nxt += interval_s
        delay = nxt - time.monotonic()
        if delay < 0:
            # Fell behind: do not try to catch up in a burst, and never run back to back (this process
            # has real-time priority: a loop without sleep would take a core from the ranks).
            nxt = time.monotonic()
            delay = interval_s / 5
        if select.select([sys.stdin], [], [], delay)[0]:
            return 0  # stdin readable: closed by the runner


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


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--sample":
        sys.exit(_sample_loop(float(sys.argv[2]), {k: int(v) for k, v in json.loads(sys.argv[3]).items()}))
    print("usage: python3 -m prismfab.counters --sample INTERVAL_S NODES_JSON", file=sys.stderr)
    sys.exit(2)
