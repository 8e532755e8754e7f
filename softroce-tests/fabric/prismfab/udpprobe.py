#!/usr/bin/env python3
"""Small UDP probe run inside a fabric host: many source ports (= many ECMP entropies) or a receiver.

  udpprobe.py send --src IP --dst IP --dport N --ports A-B[,C,...] [--count K] [--size BYTES] [--pps R]
      one bound socket per source port; K datagrams per port, round-robin over the ports, at R packets/s.
      Prints {"sent": n, "ports": [...]} as JSON.
  udpprobe.py recv --bind IP --port N --duration S [--idle S]
      counts datagrams per source port until S seconds pass or nothing arrived for --idle seconds after
      the first one. Prints {"received": n, "per_port": {port: n}} as JSON.

The payload is "<seq> <sport>", padded to --size, so a receiver can tell which port a datagram used.
"""

import argparse
import json
import select
import socket
import sys
import time


def port_range(text: str) -> list[int]:
    """``20000-20255``, ``40000``, or a comma-separated list of both."""
    ports: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            lo, hi = 0, -1
        if not (1 <= lo <= hi <= 65535):
            raise argparse.ArgumentTypeError(f"{part}: a port or a range A-B within 1..65535")
        ports.extend(range(lo, hi + 1))
    return ports


def send(o) -> dict:
    """Sends the datagrams; returns what was sent."""
    socks = []
    for p in o.ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((o.src, p))
        socks.append((p, s))
    n = 0
    gap = 1.0 / o.pps if o.pps > 0 else 0.0
    t0 = time.monotonic()
    for k in range(o.count):
        for p, s in socks:
            s.sendto(f"{n} {p} ".encode().ljust(o.size, b"x"), (o.dst, o.dport))
            n += 1
            if gap:
                wait = t0 + n * gap - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
    return {"sent": n, "ports": [p for p, _ in socks], "seconds": round(time.monotonic() - t0, 4)}


def recv(o) -> dict:
    """Counts datagrams per source port until the deadline or the idle timeout."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    s.bind((o.bind, o.port))
    per_port: dict[int, int] = {}
    n = 0
    end = time.monotonic() + o.duration
    last = None
    # Tell the caller the socket is bound, so it can start the sender without racing.
    print("ready", file=sys.stderr, flush=True)
    while True:
        now = time.monotonic()
        if now >= end or (last is not None and now - last >= o.idle):
            break
        r, _, _ = select.select([s], [], [], min(0.05, end - now))
        if not r:
            continue
        data, addr = s.recvfrom(65535)
        last = time.monotonic()
        n += 1
        per_port[addr[1]] = per_port.get(addr[1], 0) + 1
    return {"received": n, "per_port": per_port}


def main() -> int:
    """Parses the command line, runs send or recv, prints the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("send")
    a.add_argument("--src", required=True)
    a.add_argument("--dst", required=True)
    a.add_argument("--dport", type=int, default=9000)
    a.add_argument("--ports", type=port_range, required=True)
    a.add_argument("--count", type=int, default=1)
    a.add_argument("--size", type=int, default=64)
    a.add_argument("--pps", type=float, default=0.0)
    b = sub.add_parser("recv")
    b.add_argument("--bind", required=True)
    b.add_argument("--port", type=int, default=9000)
    b.add_argument("--duration", type=float, default=10.0)
    b.add_argument("--idle", type=float, default=0.5)
    o = ap.parse_args()
    res = send(o) if o.cmd == "send" else recv(o)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
