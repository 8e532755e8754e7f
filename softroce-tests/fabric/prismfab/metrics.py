"""What a run's counters mean: bytes per rail and per spine, balance, the scenario's lower bound.

Pure functions over plain dicts, so they are unit-tested without a fabric.
"""

from __future__ import annotations

import math

from .scenario import TopologySpec
from .topo import downlink_if, host_if, host_name, leaf_down_if, leaf_name, spine_name, uplink_if

# Below this many bytes through the spines a balance figure means nothing (only stray packets crossed).
MIN_SPINE_BYTES = 1 << 20


def imbalance(values: list[float]) -> float | None:
    """How far the most uneven entry is from the mean, as a fraction of the mean (0 = perfectly even,
    1.0 = one of two spines idle). None when there is nothing to balance."""
    if not values:
        return None
    mean = sum(values) / len(values)
    if mean <= 0:
        return None
    return max(abs(v - mean) for v in values) / mean


def spread(values: list[float]) -> float | None:
    """max / min - 1 (0 = every entry equal; Ethereal's "within 2 %" is <= 0.02). None when there is
    nothing to compare, or when an entry is 0 (an idle uplink: no finite spread)."""
    if not values or min(values) <= 0:
        return None
    return max(values) / min(values) - 1


def rail_bytes(spec: TopologySpec, d: dict) -> list[dict]:
    """Per host and rail: bytes sent and received on that NIC (from the host's own counters)."""
    out = []
    for i in range(spec.hosts):
        for r in range(spec.rails):
            c = d.get(f"h{i}", {}).get(host_if(i, r), {})
            out.append({"host": i, "rail": r, "tx_bytes": c.get("tx_bytes", 0), "rx_bytes": c.get("rx_bytes", 0)})
    return out


def link_time(spec: TopologySpec, rails: list[dict], links: list[dict], passes: int) -> dict:
    """How long each link needed, per pass of the collective, for the bytes it really carried (frames
    as the interface counters count them: headers, acknowledgements, probes and retransmissions
    included), at its shaped rate; the busiest link of the run and the busiest of each kind. `passes`
    is how many times the collective ran while the counters counted (warm-up, timed and check
    iterations: the counters cover the whole run). The run's CCT over the busiest link's time is how
    much of the time that link stood idle (1.0: never); the busiest link's time over the lower bound
    is what the bytes the bound leaves out and uneven spreading cost."""
    n = max(1, passes)
    host_bps = spec.host_bw_mbit * 1e6 / 8
    spine_bps = spec.spine_bw_mbit * 1e6 / 8
    cands = []
    for x in rails:
        cands.append(("host_send", f"h{x['host']}-r{x['rail']} tx", x.get("tx_bytes", 0), host_bps))
        cands.append(("host_recv", f"h{x['host']}-r{x['rail']} rx", x.get("rx_bytes", 0), host_bps))
    for x in links:
        cands.append(("spine_up", f"{leaf_name(x['leaf'])}-{spine_name(x['spine'])} up", x.get("up_bytes", 0), spine_bps))
        cands.append(("spine_down", f"{spine_name(x['spine'])}-{leaf_name(x['leaf'])} down", x.get("down_bytes", 0), spine_bps))
    by_kind: dict[str, dict] = {}
    busiest = None
    for kind, name, total, bps in cands:
        if bps <= 0:
            continue
        e = {"link": name, "kind": kind, "bytes_per_pass": total / n, "seconds": total / n / bps}
        if kind not in by_kind or e["seconds"] > by_kind[kind]["seconds"]:
            by_kind[kind] = e
        if busiest is None or e["seconds"] > busiest["seconds"]:
            busiest = e
    return {"passes": n, "busiest": busiest, "by_kind": by_kind}


def spine_links(spec: TopologySpec, d: dict) -> list[dict]:
    """Per leaf-spine link: bytes up (leaf to spine, the leaf's transmit counter) and down (spine to leaf,
    the spine's transmit counter)."""
    out = []
    for r in range(spec.rails):
        for s in range(spec.spines):
            up = d.get(leaf_name(r), {}).get(uplink_if(r, s), {})
            down = d.get(spine_name(s), {}).get(downlink_if(s, r), {})
            out.append({"leaf": r, "spine": s, "up_bytes": up.get("tx_bytes", 0), "down_bytes": down.get("tx_bytes", 0),
                        "up_packets": up.get("tx_packets", 0), "down_packets": down.get("tx_packets", 0)})
    return out


def spine_balance(spec: TopologySpec, links: list[dict]) -> dict:
    """Bytes through each spine (both directions, all leaves), their imbalance, and each leaf's uplink
    imbalance (how evenly that leaf's outgoing bytes were spread over the spines)."""
    per_spine = [0] * spec.spines
    per_leaf: dict[int, list[int]] = {r: [0] * spec.spines for r in range(spec.rails)}
    for l in links:
        per_spine[l["spine"]] += l["up_bytes"] + l["down_bytes"]
        per_leaf[l["leaf"]][l["spine"]] += l["up_bytes"]
    total = sum(per_spine)
    leaf_imb = {}
    leaf_spread = {}
    for r, v in per_leaf.items():
        leaf_imb[r] = imbalance(v) if sum(v) >= MIN_SPINE_BYTES else None
        leaf_spread[r] = spread(v) if sum(v) >= MIN_SPINE_BYTES else None
    return {
        "spine_bytes": per_spine,
        "spine_share": [round(b / total, 4) if total else 0.0 for b in per_spine],
        "spine_imbalance": imbalance(per_spine) if total >= MIN_SPINE_BYTES else None,
        "leaf_uplink_bytes": {str(r): v for r, v in per_leaf.items()},
        "leaf_uplink_imbalance": {str(r): v for r, v in leaf_imb.items()},
        "leaf_uplink_spread": {str(r): v for r, v in leaf_spread.items()},
    }


def windowed_uplink_imbalance(spec: TopologySpec, t: list[float], netdev: list[dict], window_s: float = 0.1,
                              busy: float = 0.2) -> dict:
    """How unevenly each leaf spread its spine-bound bytes *at each moment*: the imbalance over its
    uplinks in every `window_s` window, averaged weighted by the window's bytes (windows carrying less than
    `busy` of the leaf's busiest window are left out). Queues build at the moment two flows share an
    uplink, so this is what congestion sees; totals over a run can look even while every instant was not
    (a policy that moves whole messages from spine to spine)."""
    idx = [0]
    for k in range(1, len(t)):
        if t[k] - t[idx[-1]] >= window_s - 1e-9:
            idx.append(k)
    out: dict[str, float | None] = {}
    for r in range(spec.rails):
        rows = []
        for a, b in zip(idx, idx[1:]):
            v = [netdev[b].get(leaf_name(r), {}).get(uplink_if(r, s), {}).get("tx_bytes", 0)
                 - netdev[a].get(leaf_name(r), {}).get(uplink_if(r, s), {}).get("tx_bytes", 0)
                 for s in range(spec.spines)]
            rows.append(v)
        peak = max((sum(v) for v in rows), default=0)
        num = den = 0.0
        for v in rows:
            tot = sum(v)
            if peak and tot >= busy * peak:
                num += (imbalance(v) or 0.0) * tot
                den += tot
        out[str(r)] = (num / den) if den and peak * len(rows) >= MIN_SPINE_BYTES / 8 else None
    vals = [v for v in out.values() if v is not None]
    return {"per_leaf": out, "max": max(vals) if vals else None, "window_s": window_s}


def flow_balance(spec: TopologySpec, flows: dict[int, dict[tuple[str, str], int]], addr_host: dict[str, int],
                 min_bytes: int = 256 << 10) -> dict:
    """Per host pair (source, destination): the bytes each spine forwarded, and how evenly each pair's
    bytes were spread over the spines. `flows` is {spine: {(saddr, daddr): bytes}} from the spines' nft
    sets; pairs below `min_bytes` in total (acknowledgements, probes) are left out of the averages."""
    pairs: dict[tuple[int, int], list[int]] = {}
    for s, per in flows.items():
        for (sa, da), b in per.items():
            if sa not in addr_host or da not in addr_host:
                continue
            key = (addr_host[sa], addr_host[da])
            pairs.setdefault(key, [0] * spec.spines)[s] += b
    rows = []
    weighted = 0.0
    weight = 0
    worst = None
    for (a, b), v in sorted(pairs.items()):
        tot = sum(v)
        imb = imbalance(v)
        rows.append({"src": a, "dst": b, "spine_bytes": v, "imbalance": imb})
        if tot >= min_bytes and imb is not None:
            weighted += imb * tot
            weight += tot
            worst = imb if worst is None else max(worst, imb)
    return {
        "pairs": rows,
        "pairs_counted": sum(1 for r in rows if sum(r["spine_bytes"]) >= min_bytes),
        "mean_imbalance": (weighted / weight) if weight else None,
        "max_imbalance": worst,
    }


_M64 = (1 << 64) - 1
# prism-perf's SPARSE_SEED (examples/src/coll/plan.rs): the sparse alltoall's pattern is fixed by it.
SPARSE_SEED = 0x5eed_2026_0005


def _mix64(x: int) -> int:
    """splitmix64's finalizer, as prism-perf computes it."""
    z = (x + 0x9e37_79b9_7f4a_7c15) & _M64
    z = ((z ^ (z >> 30)) * 0xbf58_476d_1ce4_e5b9) & _M64
    z = ((z ^ (z >> 27)) * 0x94d0_49bb_1331_11eb) & _M64
    return z ^ (z >> 31)


def sparse_len(src: int, dst: int, n: int, c: int) -> int:
    """Elements rank `src` sends to `dst` in prism-perf's alltoall_sparse (blocks of `c` elements): the
    other ranks ordered by a seeded hash, the k-th of the first ceil((n-1)/2) gets c // (k+1), the rest
    nothing (a port of `sparse_len` in examples/src/coll/plan.rs)."""
    if src == dst:
        return c
    key = lambda d: (_mix64(SPARSE_SEED ^ (src << 32) ^ d), d)  # noqa: E731
    mine = key(dst)
    k = sum(1 for d in range(n) if d not in (src, dst) and key(d) < mine)
    return c // (k + 1) if k < (n - 1 + 1) // 2 else 0


def traffic_matrix(coll: str, nranks: int, size: int) -> dict[tuple[int, int], float]:
    """Bytes each rank sends to each other rank in one iteration, as nccl-tests sizes the collective and
    prism-perf runs it (ring algorithms send to rank+1; alltoall sends one block to every peer)."""
    n = nranks
    m: dict[tuple[int, int], float] = {}
    nxt = lambda r: (r + 1) % n  # noqa: E731
    if coll == "alltoall":
        for a in range(n):
            for b in range(n):
                if a != b:
                    m[(a, b)] = size / n
    elif coll == "alltoall_sparse":
        c = size // 4 // n  # f32 elements per block, as nccl-tests sizes an alltoall
        for a in range(n):
            for b in range(n):
                if a != b and sparse_len(a, b, n, c):
                    m[(a, b)] = 4.0 * sparse_len(a, b, n, c)
    elif coll == "sendrecv":
        for a in range(n):
            m[(a, nxt(a))] = float(size)
    elif coll == "all_reduce":
        for a in range(n):
            m[(a, nxt(a))] = 2.0 * (n - 1) / n * size
    elif coll in ("all_gather", "reduce_scatter"):
        for a in range(n):
            m[(a, nxt(a))] = (n - 1) / n * size
    else:
        raise ValueError(f"no traffic model for {coll}")
    return m


def _loads(spec: TopologySpec, coll: str, size: int, rank_rail: str | None, rails_used: int | None):
    """The bytes one iteration puts on each host NIC (send, receive) and on each leaf's uplinks and
    downlinks together, with Prism's rail pairing (see ``lower_bound_s``)."""
    n = spec.hosts
    k_used = max(1, min(rails_used or spec.rails, spec.rails))
    m = traffic_matrix(coll, n, size)
    nic_send: dict[tuple[int, int], float] = {}
    nic_recv: dict[tuple[int, int], float] = {}
    leaf_up = [0.0] * spec.rails
    leaf_down = [0.0] * spec.rails
    for (a, b), v in m.items():
        oa, ob = spec.rail_order(a, rank_rail), spec.rail_order(b, rank_rail)
        for k in range(k_used):
            ra, rb, part = oa[k], ob[k], v / k_used
            nic_send[(a, ra)] = nic_send.get((a, ra), 0.0) + part
            nic_recv[(b, rb)] = nic_recv.get((b, rb), 0.0) + part
            if ra != rb:
                leaf_up[ra] += part
                leaf_down[rb] += part
    return m, k_used, nic_send, nic_recv, leaf_up, leaf_down


def lower_bound_s(spec: TopologySpec, coll: str, size: int, rank_rail: str | None = None,
                  rails_used: int | None = None) -> dict:
    """The fastest one iteration could possibly finish on this fabric. Each pair's bytes are spread evenly
    over the first `rails_used` rails of the sender (all of them by default, as Prism's rail layer does),
    the k-th rail of the sender talking to the k-th of the receiver (Prism's rail pairing, see
    ``TopologySpec.rail_order``); cross-rail bytes are spread perfectly over the spines. The busiest host
    NIC or the busiest leaf's uplinks (or downlinks), over its capacity, wins. Headers and acknowledgements
    are ignored, so real runs land above it."""
    m, k_used, nic_send, nic_recv, leaf_up, leaf_down = _loads(spec, coll, size, rank_rail, rails_used)
    host_bps = spec.host_bw_mbit * 1e6 / 8
    spine_bps = spec.spine_bw_mbit * 1e6 / 8
    cands = {
        "host_send": max(nic_send.values(), default=0.0) / host_bps,
        "host_recv": max(nic_recv.values(), default=0.0) / host_bps,
        "spine_up": max(leaf_up) / (spine_bps * spec.spines) if spec.spines else 0.0,
        "spine_down": max(leaf_down) / (spine_bps * spec.spines) if spec.spines else 0.0,
    }
    bottleneck = max(cands, key=cands.get)
    return {"seconds": cands[bottleneck], "bottleneck": bottleneck, "terms_s": cands, "rails_used": k_used,
            "cross_spine_bytes": sum(leaf_up), "total_bytes": sum(m.values())}


def _finish_s(work: float, steps: list[tuple[float, float]]) -> float:
    """When `work` bytes have passed a resource whose capacity (bytes/s) is `steps[i][1]` from
    `steps[i][0]` seconds on (the first step at 0, times rising). Infinite if the capacity ends at 0
    before the work is done."""
    done = 0.0
    for i, (t0, cap) in enumerate(steps):
        t1 = steps[i + 1][0] if i + 1 < len(steps) else math.inf
        if cap > 0 and done + cap * (t1 - t0) >= work:
            return t0 + (work - done) / cap
        done += cap * (t1 - t0) if math.isfinite(t1) else 0.0
    return math.inf if work > done else steps[-1][0]


def fault_lower_bound_s(spec: TopologySpec, coll: str, size: int, parts: list[dict],
                        rank_rail: str | None = None, rails_used: int | None = None) -> dict:
    """``lower_bound_s`` of an iteration during which the fabric breaks as `parts` say, each a fault part
    ``{kind, leaf, spine, at_s, bw_mbit, loss_pct}`` with `at_s` counted from the first data bytes (the
    moment the fault-free bound starts from too). From its time on, a ``blackhole`` or ``link_down`` takes
    the leaf-spine link out both ways, a ``slow_spine`` shapes every link of its spine to `bw_mbit`, and a
    ``loss`` on a spine leaves its links `1 - loss_pct/100` of their capacity for data that arrives (what
    is dropped was sent), a ``nic_blackhole`` leaves its host the other NICs (``host``), and a ``heal``
    gives a black-holed or cut link back (``of``: the kind it heals). Each leaf's uplinks (and downlinks) are one resource whose capacity is the sum of
    its links' at each moment, filled perfectly from the first byte: no policy, however it reroutes, can
    finish before this with Prism's rail pairing. Its ratio to the fault-free bound is the least CCT ratio
    (fault / no fault) the fault allows a run that was at the bound without it."""
    m, k_used, nic_send, nic_recv, leaf_up, leaf_down = _loads(spec, coll, size, rank_rail, rails_used)
    host_bps = spec.host_bw_mbit * 1e6 / 8
    spine_mbit = spec.spine_bw_mbit
    # Capacity of link (leaf r, spine s) in Mbit/s as a list of (from_s, mbit) steps per link.
    events = sorted(((float(p.get("at_s") or 0.0), p) for p in parts), key=lambda e: e[0])

    def link_steps(r: int, s: int) -> list[tuple[float, float]]:
        steps = [(0.0, spine_mbit)]
        dead, bw, good = False, spine_mbit, 1.0
        for t, p in events:
            kind = p.get("kind")
            if kind in ("blackhole", "link_down") and p.get("leaf") == r and p.get("spine") == s:
                dead = True
            elif kind == "heal" and p.get("of") != "nic_blackhole" and p.get("leaf") == r and p.get("spine") == s:
                dead = False
            elif kind == "slow_spine" and p.get("spine") == s:
                bw = min(bw, float(p.get("bw_mbit") or spine_mbit))
            elif kind == "loss" and p.get("spine") == s:
                good *= 1.0 - float(p.get("loss_pct") or 0.0) / 100.0
            else:
                continue
            steps.append((t, 0.0 if dead else bw * good))
        return steps

    def leaf_steps(r: int) -> list[tuple[float, float]]:
        per_link = [link_steps(r, s) for s in range(spec.spines)]
        times = sorted({t for st in per_link for t, _ in st})

        def at(st: list[tuple[float, float]], t: float) -> float:
            return [c for t0, c in st if t0 <= t][-1]
        return [(t, sum(at(st, t) for st in per_link) * 1e6 / 8) for t in times]

    caps = [leaf_steps(r) for r in range(spec.rails)]

    def host_steps(h: int) -> list[tuple[float, float]]:
        # A host whose NIC fails (``nic_blackhole``) has its other NICs left: its bytes, moved to
        # them perfectly from the first byte, pass its NICs as one resource of the live ones' rates.
        steps, dead = [(0.0, spec.rails * host_bps)], set()
        for t, p in events:
            fails = p.get("kind") == "nic_blackhole"
            heals = p.get("kind") == "heal" and p.get("of") == "nic_blackhole"
            if p.get("host") != h or not (fails or heals):
                continue
            (dead.add if fails else dead.discard)(p.get("leaf"))
            steps.append((t, (spec.rails - len(dead)) * host_bps))
        return steps

    nic_hosts = {p.get("host") for _, p in events if p.get("kind") == "nic_blackhole"}

    def host_term(per_nic: dict) -> float:
        worst = max(per_nic.values(), default=0.0) / host_bps
        for h in nic_hosts:
            total = sum(v for (a, _), v in per_nic.items() if a == h)
            if total > 0:
                worst = max(worst, _finish_s(total, host_steps(h)))
        return worst

    cands = {
        "host_send": host_term(nic_send),
        "host_recv": host_term(nic_recv),
        "spine_up": max((_finish_s(w, caps[r]) for r, w in enumerate(leaf_up) if w > 0), default=0.0),
        "spine_down": max((_finish_s(w, caps[r]) for r, w in enumerate(leaf_down) if w > 0), default=0.0),
    }
    bottleneck = max(cands, key=cands.get)
    free = lower_bound_s(spec, coll, size, rank_rail, rails_used)
    secs = cands[bottleneck]
    finite = math.isfinite(secs)
    # JSON has no infinity: a transfer the broken fabric cannot finish has no bound (`finishes` false).
    return {"seconds": secs if finite else None, "finishes": finite, "bottleneck": bottleneck,
            "terms_s": {k: (v if math.isfinite(v) else None) for k, v in cands.items()}, "rails_used": k_used,
            "parts": [{k: p.get(k) for k in ("kind", "leaf", "spine", "host", "at_s", "bw_mbit", "loss_pct")} for _, p in events],
            "over_fault_free_bound": (secs / free["seconds"]) if (finite and free["seconds"]) else None}


def fault_floor(r: dict, base: dict | None) -> float | None:
    """The least CCT ratio (fault / no fault) a fault run's fabric allowed: its lower bound with the links
    broken when they broke (``fault_lower_bound_s``), over the fault-free run's measured CCT. A limit below
    it cannot be met by any policy. None without either figure."""
    fb = (r.get("lower_bound_fault") or {}).get("seconds")
    b = (base or {}).get("cct_s")
    if not fb or not b:
        return None
    return fb / b


def spine_packets(spec: TopologySpec, netdev: dict) -> int:
    """Packets sent onto every leaf-spine link (both directions), from one sample of the counters."""
    return sum(netdev.get(leaf_name(r), {}).get(uplink_if(r, s), {}).get("tx_packets", 0)
               + netdev.get(spine_name(s), {}).get(downlink_if(s, r), {}).get("tx_packets", 0)
               for r in range(spec.rails) for s in range(spec.spines))


def spine_bytes_total(spec: TopologySpec, netdev: dict) -> int:
    """Bytes sent onto every leaf-spine link (both directions), from one sample of the counters."""
    return sum(netdev.get(leaf_name(r), {}).get(uplink_if(r, s), {}).get("tx_bytes", 0)
               + netdev.get(spine_name(s), {}).get(downlink_if(s, r), {}).get("tx_bytes", 0)
               for r in range(spec.rails) for s in range(spec.spines))


def nic_packets(spec: TopologySpec, netdev: dict) -> int:
    """Packets sent onto every host-leaf link (both directions: the hosts' and the leaves' transmit
    counters), from one sample of the counters."""
    return _nic_sum(spec, netdev, "tx_packets")


def nic_bytes_total(spec: TopologySpec, netdev: dict) -> int:
    """Bytes sent onto every host-leaf link (both directions), from one sample of the counters."""
    return _nic_sum(spec, netdev, "tx_bytes")


def _nic_sum(spec: TopologySpec, netdev: dict, key: str) -> int:
    return sum(netdev.get(host_name(i), {}).get(host_if(i, r), {}).get(key, 0)
               + netdev.get(leaf_name(r), {}).get(leaf_down_if(r, i), {}).get(key, 0)
               for i in range(spec.hosts) for r in range(spec.rails))


def _rate(t: list[float], v: list[int], k0: int, k1: int) -> float:
    return (v[k1] - v[k0]) / (t[k1] - t[k0]) if t[k1] > t[k0] else 0.0


def _before_fault(t: list[float], part: list[int], total: list[int], t_fault: float, before_s: float):
    """Where a fault run's series stand: the last sample at or before the fault (kf), when the traffic
    ended (the last sample at which `total` grew), and the rates of `part` and of `total` over the
    `before_s` before the fault (0 when there is no such span)."""
    n = len(t)
    kf = max((k for k in range(n) if t[k] <= t_fault), default=0)
    k0 = next((k for k in range(n) if t[k] >= t_fault - before_s), 0)
    t_end = max((t[k] for k in range(1, n) if total[k] > total[k - 1]), default=t[-1])
    pre_part = _rate(t, part, k0, kf) if kf > k0 else 0.0
    pre_total = _rate(t, total, k0, kf) if kf > k0 else 0.0
    return kf, t_end, pre_part, pre_total


def _windows(t: list[float], k0: int, t_end: float, window_s: float):
    """(k, j) of every window from sample `k0` on that ends before `t_end`: it starts at sample k and
    ends at j, the first sample at least `window_s` later (or the last one)."""
    n = len(t)
    j = k0
    for k in range(k0, n):
        if t[k] > t_end - window_s:
            break
        j = max(j, k)
        while j < n - 1 and t[j] < t[k] + window_s:
            j += 1
        yield k, j


def recovery(t: list[float], dead: list[int], total: list[int], t_fault: float, interval_s: float,
             window_s: float = 0.1, before_s: float = 0.3, residue: float = 0.05, busy: float = 0.2,
             min_tail: float = 0.1, settle_s: float = 0.5, hold_s: float = 0.2, until: float | None = None) -> dict:
    """How traffic left a dead path, from cumulative packet counts sampled at times `t`: `dead` entered the
    dead path, `total` crossed the spines (dead path included). With `until` (the moment a fault healed)
    only the samples up to it are judged: after it the path is no longer dead.

    * ``ttr_s``: from the fault to the last packet into the dead path, if that came while traffic still
      flowed elsewhere (else not recovered: the policy used the dead path until the run ended).
    * ``reroute_s``: from the fault to the first moment from which, in every 100 ms window where the
      spines were still busy (at least 20 % of their rate before the fault), the dead path got at most 5 %
      of its own rate before the fault: the bulk had moved, probes and stragglers aside. None when that
      never happened while traffic still flowed, or only for the last `min_tail` of the traffic.
    * ``residual_share``: the dead path's packet rate from `settle_s` after the fault on (busy windows),
      over its rate before the fault.
    * ``first_off_s``: from the fault to the first moment from which the dead path stayed at most 5 % of
      its earlier rate for `hold_s` (busy windows): when the bulk first left, even if a burst came back
      later (which ``reroute_s`` does not forgive).
    * ``fault_gap_s``: how far apart the samples on either side of the fault came (the nominal interval
      unless the sampler fell behind): ``reroute_s`` and ``first_off_s`` are no finer than it.
    """
    if until is not None:
        keep = sum(1 for x in t if x <= until)
        t, dead, total = t[:keep], dead[:keep], total[:keep]
    n = len(t)
    out: dict = {"resolution_s": interval_s, "recovered": False, "ttr_s": None, "reroute_s": None}
    if n < 2:
        return out
    # The end of the traffic, not of the processes: the last sample at which the spines carried anything.
    kf, t_end, pre_dead, pre_total = _before_fault(t, dead, total, t_fault, before_s)
    out["dead_path_packets"] = dead[-1] - dead[kf]
    # No measure here can be finer than the samples around the fault: the first window that can show the
    # dead path quiet starts at the first sample after it.
    out["fault_gap_s"] = (t[kf + 1] - t[kf]) if kf + 1 < n else None
    out["traffic_end_s"] = t_end - t_fault
    last = max((t[k] for k in range(kf + 1, n) if dead[k] > dead[k - 1]), default=None)
    if last is None:
        out.update(recovered=True, ttr_s=0.0)
    else:
        out["last_dead_packet_s"] = last - t_fault
        if last < t_end - 2 * interval_s:
            out.update(recovered=True, ttr_s=last - t_fault)
    out["dead_share_before"] = (pre_dead / pre_total) if pre_total else None
    if pre_dead <= 0 or pre_total <= 0:
        return out
    # (start, dead rate, total rate) of every window after the fault, while traffic lasted
    windows = [(t[k], _rate(t, dead, k, j), _rate(t, total, k, j)) for k, j in _windows(t, kf, t_end, window_s)]
    # How much the policy still fed the dead path once it had had time to react (from `settle_s` after
    # the fault on, busy windows only), relative to before the fault: 0 = left it, 1 = did not react.
    late = [(d, tot) for start, d, tot in windows if start >= t_fault + settle_s and tot >= busy * pre_total]
    if late:
        out["residual_share"] = (sum(d for d, _ in late) / len(late)) / pre_dead
    # When the bulk *first* left (even if some of it came back later): the first busy window from which
    # every busy window for `hold_s` stayed at most `residue` of the earlier rate.
    busy_w = [(start, d) for start, d, tot in windows if tot >= busy * pre_total]
    for i, (start, d) in enumerate(busy_w):
        held = [dd for ss, dd in busy_w[i:] if ss <= start + hold_s]
        if busy_w[-1][0] >= start + hold_s and all(dd <= residue * pre_dead for dd in held):
            out["first_off_s"] = max(0.0, start - t_fault)
            break
    ok_from = None
    for start, d, tot in reversed(windows):
        if tot < busy * pre_total:
            continue  # the spines were nearly idle here (between iterations): says nothing
        if d > residue * pre_dead:
            break
        ok_from = start
    if ok_from is not None:
        # Credible only if a real part of the traffic after the fault still came after it: a dead path
        # that falls quiet in the last moments of a run has not been left, the run just ended.
        k_ok = next(k for k in range(n) if t[k] >= ok_from)
        after_fault = total[-1] - total[kf]
        if after_fault > 0 and (total[-1] - total[k_ok]) >= min_tail * after_fault:
            out["reroute_s"] = max(0.0, ok_from - t_fault)
    return out


def revival(t: list[float], link: list[int], total: list[int], t_fault: float, t_heal: float, interval_s: float,
            window_s: float = 0.1, before_s: float = 0.3, share: float = 0.5, busy: float = 0.2,
            settle_s: float = 0.3) -> dict:
    """How traffic came back to a link after its fault healed, from cumulative byte counts sampled at times
    `t`: `link` went onto the healed link, `total` onto every leaf-spine link (the link included). The
    link's share of the spine bytes is compared with its share in the `before_s` before the fault, so
    that the traffic's own ups and downs (a tail, an idle gap) do not count.

    * ``revived_s``: from the heal to the start of the first `window_s` window (spines busy: at least
      `busy` of their rate before the fault) in which the link carried at least `share` of its share
      before the fault. None if that never happened while traffic still flowed.
    * ``share_after``: the link's share of the bytes from `settle_s` after the heal to the end of the
      traffic, over its share before the fault: 1 = all the way back.
    * ``traffic_after_heal_s``: how long the spines still carried traffic after the heal (the room the
      policy had to come back).
    """
    n = len(t)
    out: dict = {"resolution_s": interval_s, "revived_s": None, "share_after": None, "share_before": None,
                 "traffic_after_heal_s": None}
    if n < 2:
        return out
    kh = next((k for k in range(n) if t[k] >= t_heal), n - 1)
    _, t_end, pre_link, pre_total = _before_fault(t, link, total, t_fault, before_s)
    out["traffic_after_heal_s"] = max(0.0, t_end - t_heal)
    if pre_link <= 0 or pre_total <= 0:
        return out
    pre_share = pre_link / pre_total
    out["share_before"] = pre_share
    for k, j in _windows(t, kh, t_end, window_s):
        d, tot = link[j] - link[k], total[j] - total[k]
        if tot <= 0 or _rate(t, total, k, j) < busy * pre_total:
            continue
        if out["revived_s"] is None and d / tot >= share * pre_share:
            out["revived_s"] = max(0.0, t[k] - t_heal)
    ks = next((k for k in range(kh, n) if t[k] >= t_heal + settle_s), None)
    ke = max((k for k in range(n) if t[k] <= t_end), default=n - 1)
    if ks is not None and ke > ks:
        late_link, late_total = link[ke] - link[ks], total[ke] - total[ks]
        if late_total > 0:
            out["share_after"] = (late_link / late_total) / pre_share
    return out


def byte_recovery(tl: dict, until: float | None = None) -> dict | None:
    """`recovery` by bytes instead of packets, from a run's timeline (bytes per link per window): a probe
    or a SACK weighs what it weighs, not as much as a 9 KB DATA packet. For a black hole (whose link
    carries the bytes sent into it); None without a fault link. `until`: when the fault healed, on the
    timeline's clock (seconds from the first data), if it did."""
    link = tl.get("fault_link")
    if not link or link not in tl.get("links", {}) or not tl.get("t") or tl.get("fault_t") is None:
        return None
    step = tl.get("step_s", 0.05)
    t = [tl["t"][0] - step] + list(tl["t"])
    dead, total = [0], [0]
    for k in range(len(tl["t"])):
        dead.append(dead[-1] + tl["links"][link][k])
        total.append(total[-1] + sum(v[k] for v in tl["links"].values()))
    return recovery(t, dead, total, tl["fault_t"], step, until=until)


# Per-connection counters of PRISM_STATS that say how a run recovered (summed over every comm of every
# rank); rto_us and reorder_threshold are settings, not counters, and stay out.
CONN_COUNTERS = ("data_pkts_sent", "data_bytes_sent", "retransmissions", "spurious_retransmissions", "timeouts",
                 "timeout_losses", "time_losses", "reorder_losses", "episode_losses", "episode_losses_resent",
                 "tail_probes", "duplicates", "cts_retransmitted", "sacks_sent", "sacks_received", "keepalives_sent")


def summarize_stats(docs: list) -> dict:
    """Sums Prism's PRISM_STATS files over every rank: the connection counters that speak of recovery,
    the packets the connection dropped as bad, and over every path its state changes, probes and how many
    paths were not alive at the end. Unknown shapes are skipped, so a schema change shows as missing
    numbers, not as a crash."""
    sums: dict[str, float] = {}
    rtt = {"samples": 0, "sum_us": 0.0, "min_us": None, "max_us": None}

    def add_rtt(paths: dict) -> None:
        """Folds one closed-comm group's path RTT figures (sample-weighted) into `rtt`."""
        n, avg = paths.get("rtt_samples"), paths.get("rtt_avg_us")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (n, avg)) or n <= 0:
            return
        rtt["samples"] += n
        rtt["sum_us"] += n * avg
        lo, hi = paths.get("rtt_min_us"), paths.get("rtt_max_us")
        if isinstance(lo, (int, float)) and not isinstance(lo, bool):
            rtt["min_us"] = lo if rtt["min_us"] is None else min(rtt["min_us"], lo)
        if isinstance(hi, (int, float)) and not isinstance(hi, bool):
            rtt["max_us"] = hi if rtt["max_us"] is None else max(rtt["max_us"], hi)

    def add(k, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            sums[k] = sums.get(k, 0) + v

    def add_comm(c: dict) -> dict:
        """The counters a closed-comm summary and a listed comm share; returns its `conn` object."""
        add("wrong_peer_dropped", c.get("wrong_peer_dropped"))
        conn = c.get("conn") if isinstance(c.get("conn"), dict) else {}
        for k in CONN_COUNTERS:
            add(k, conn.get(k))
        dropped = conn.get("dropped") if isinstance(conn.get("dropped"), dict) else {}
        for v in dropped.values():
            add("bad_packets_dropped", v)
        return conn

    for d in docs:
        if not isinstance(d, dict):
            continue
        # Prism folds every closed comm into "closed_summary" (per rail, peer and role) and lists only the
        # first and last few in "comms", each with at most 64 paths: the summary is the complete count.
        groups = d.get("closed_summary")
        if isinstance(groups, list):
            for g in groups:
                if not isinstance(g, dict):
                    continue
                add_comm(g)
                paths = g.get("paths") if isinstance(g.get("paths"), dict) else {}
                add("path_state_changes", paths.get("state_changes"))
                add("path_probes_sent", paths.get("probes_sent"))
                add("paths_not_alive_at_close", paths.get("not_alive_at_close"))
                add_rtt(paths)
        comms = d.get("comms")
        if isinstance(groups, list) or not isinstance(comms, list):
            comms = []
        for c in comms:
            if not isinstance(c, dict):
                continue
            conn = add_comm(c)
            for p in conn.get("paths", []) if isinstance(conn.get("paths"), list) else []:
                if not isinstance(p, dict):
                    continue
                add("path_state_changes", p.get("state_changes"))
                add("path_probes_sent", p.get("probes_sent"))
                if p.get("state") not in (None, "alive"):
                    add("paths_not_alive_at_close", 1)
        for rail in d.get("rails", []) if isinstance(d.get("rails"), list) else []:
            if isinstance(rail, dict):
                add("unknown_token_dropped", rail.get("unknown_token_dropped"))
                add("runt_dropped", rail.get("runt_dropped"))
    if rtt["samples"]:
        # Every RTT sample Prism took on every path of every comm of every rank, averaged: the round trip
        # a packet of this run typically saw, queues included.
        sums["rtt_samples"] = rtt["samples"]
        sums["rtt_avg_us"] = round(rtt["sum_us"] / rtt["samples"], 1)
        for k in ("min_us", "max_us"):
            if rtt[k] is not None:
                sums[f"rtt_{k}"] = rtt[k]
    return dict(sorted(sums.items()))


def run_rtt_s(run: dict | None) -> float | None:
    """The RTT a run's packets saw, in seconds: Prism's own RTT samples over every path of every comm of
    every rank (PRISM_STATS), averaged; None without samples."""
    v = ((run or {}).get("prism_stats") or {}).get("rtt_avg_us")
    return v / 1e6 if isinstance(v, (int, float)) and v > 0 else None


def dead_path_recovery(run: dict) -> dict | None:
    """How the bulk of the bytes left a fault's dead path: the runner's 10 ms byte series
    (``recovery_bytes``) if present, else the 50 ms timeline (older runs)."""
    rb = run.get("recovery_bytes")
    if rb:
        return rb
    if (run.get("fault") or {}).get("kind") in ("blackhole", "link_down"):
        return byte_recovery(run.get("timeline") or {}, until=run.get("heal_at_s"))
    return None
