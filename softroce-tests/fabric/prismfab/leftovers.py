"""Did a fabric run leave anything behind? Run in the machine's own namespaces after the run ended.

  python3 -m prismfab.leftovers --ns-file OUT/namespaces.json --marker ID [--json FILE]

What survives a run can only be: a process (found by the marker every process of the run inherits in its
environment, or by living in the run's PID namespace), a network namespace of the run kept alive by a
process, an open file or a bind mount, an nft table or an interface of ours in the machine's own network
namespace. Each is looked for; the exit status is 1 when anything is found.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

OUR_IFNAME = re.compile(r"^(h\d+-(r\d+|m)|lf\d+-(h|sp)\d+|sp\d+-lf\d+|pfm\d+|pfmgmt\d+)$")


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _read(path: str, binary: bool = False):
    try:
        with open(path, "rb" if binary else "r") as f:
            return f.read()
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    raw = _read(f"/proc/{pid}/cmdline", binary=True) or b""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def find(ns: dict, marker: str) -> dict:
    """Everything of the run that still exists: {"processes", "net_namespaces", "nft_tables", "interfaces"}."""
    me = os.getpid()
    want_net = {ns.get("outer_net_ns")} | set((ns.get("node_net_ns") or {}).values())
    want_net.discard(None)
    pid_ns = ns.get("pid_ns")
    procs, nets = [], []
    tag = f"PRISMFAB_RUN={marker}".encode() if marker else None
    for pid in _pids():
        if pid == me:
            continue
        env = _read(f"/proc/{pid}/environ", binary=True) or b""
        why = []
        if tag and tag in env.split(b"\0"):
            why.append("carries the run's marker")
        try:
            if pid_ns and os.stat(f"/proc/{pid}/ns/pid").st_ino == pid_ns:
                why.append("lives in the run's PID namespace")
            net = os.stat(f"/proc/{pid}/ns/net").st_ino
            if net in want_net:
                nets.append({"inode": net, "held_by": f"process {pid} ({_cmdline(pid)[:120]})"})
        except OSError:
            pass
        if why:
            procs.append({"pid": pid, "cmdline": _cmdline(pid)[:200], "why": why})
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                m = re.fullmatch(r"net:\[(\d+)\]", link)
                if m and int(m.group(1)) in want_net:
                    nets.append({"inode": int(m.group(1)), "held_by": f"fd {fd} of process {pid}"})
        except OSError:
            pass
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        m = re.search(r" net:\[(\d+)\] ", line)
        if m and int(m.group(1)) in want_net:
            nets.append({"inode": int(m.group(1)), "held_by": f"bind mount: {line.split()[4]}"})
    tables = []
    r = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False)
    for line in r.stdout.splitlines():
        if "prismfab" in line:
            tables.append(line.strip())
    ifs = []
    r = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False)
    for line in r.stdout.splitlines():
        m = re.match(r"\d+:\s+([^:@]+)", line)
        if m and OUR_IFNAME.match(m.group(1)):
            ifs.append(m.group(1))
    return {"processes": procs, "net_namespaces": nets, "nft_tables": tables, "interfaces": ifs}


def main(argv=None) -> int:
    """Looks for leftovers of one run; exit status 1 when something survived."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns-file", required=True, help="namespaces.json written by the run")
    ap.add_argument("--marker", required=True, help="the PRISMFAB_RUN value the run was started with")
    ap.add_argument("--json", help="write the findings here")
    a = ap.parse_args(argv)
    p = Path(a.ns_file)
    if p.exists():
        ns = json.loads(p.read_text())
    else:
        # The run died before the fabric was up: only the marker and the names can be checked.
        ns = {}
    if ns.get("marker") and ns["marker"] != a.marker:
        print(f"leftovers: {p} belongs to run {ns['marker']}, not {a.marker}", file=sys.stderr)
        return 2
    found = find(ns, a.marker)
    left = {k: v for k, v in found.items() if v}
    doc = {"marker": a.marker, "namespaces_recorded": bool(ns), "clean": not left, "found": found,
           "looked_for": {"net_namespaces": 1 + len(ns.get("node_net_ns") or {}) if ns else 0}}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    if left:
        print(f"leftovers: the run left things behind: {json.dumps(left)}", file=sys.stderr)
        return 1
    print(f"leftovers: clean (run {a.marker}: no process, none of its "
          f"{doc['looked_for']['net_namespaces']} network namespaces, no nft table, no interface survived)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
