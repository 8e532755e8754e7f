"""Faults injected into a running fabric, and where each one's victims can be counted.

* ``link_down``: the cable between leaf L and spine S is cut (both ports down, carrier lost). Leaf L stops
  using S at once (its nexthop is marked dead); the other leaves cannot know, keep hashing traffic for
  rail L onto S, and S drops it for want of a route (the kernel deleted S's route to L with the port).
  Victims: spine S's ``InNoRoutes``.
* ``blackhole``: the L-S link silently drops every IPv4 packet in both directions (nft netdev ingress drop
  at both ends); carrier and ARP stay up, so no router notices. Victims: what L sends to S plus what S
  sends to L (transmit counters of both ends).
* ``loss``: every port of spine S drops ``loss_pct`` percent of IPv4 packets at random (nft numgen).
* ``slow_spine``: every link of spine S is shaped down to ``bw_mbit`` (both directions).
* ``nic_blackhole``: the link between host H and leaf L (H's rail-L NIC) silently drops every IPv4 packet
  in both directions (nft netdev ingress drop on the host's interface and on the leaf's port): the NIC,
  its cable or its leaf port gone, carrier up. Victims: what H sends on rail L plus what leaf L sends to
  H (transmit counters of both ends).

A fault may carry further faults (``also``) injected in the same run, each at its own ``at_s`` (e.g. loss
on one spine from the start and a black hole on another later): ``inject_due`` fires each part when its
time has come; the dead path is the primary fault's.

A fault with ``heal_after_s`` is undone by ``heal()`` while the workload still runs (its ``also`` parts
stay): a black hole's chains are flushed at both ends, a cut link is brought up and its routes
reinstalled. Each fault is undone by ``clear()``, which is idempotent and also runs on teardown.
"""

from __future__ import annotations

import logging

from .scenario import Fault
from .topo import Fabric, downlink_if, host_if, host_name, leaf_down_if, leaf_name, spine_name, uplink_if

log = logging.getLogger("prismfab.faults")

NFT_TABLE = "prismfab_fault"


def _ingress_drop_table(ifname: str, stmt: str) -> str:
    # One netdev table per port (a netdev chain hooks exactly one device).
    return (f"add table netdev {NFT_TABLE} {{ chain in_{ifname.replace('-', '_')} {{ "
            f"type filter hook ingress device \"{ifname}\" priority 0; policy accept; {stmt}; }}; }}")


class Injector:
    """Applies one fault to a fabric and knows how to count what the fault hits."""

    def __init__(self, fabric: Fabric, fault: Fault):
        self.fabric = fabric
        self.fault = fault
        self.active = False
        # The parts not injected yet (the fault itself and its `also`), in firing order.
        self.pending: list[Fault] = fault.parts()
        # The primary fault was undone (``heal``), and what its rules had dropped by then.
        self.healed = False
        self.healed_drops = 0

    # --- apply / clear ----------------------------------------------------------------------------------

    def inject(self) -> None:
        """Applies the fault (every part not injected yet) now."""
        while self.pending:
            self._inject_part(self.pending.pop(0))

    def inject_due(self, elapsed_s: float) -> list[Fault]:
        """Injects every part whose ``at_s`` is at most `elapsed_s` (seconds since data started); returns
        those it injected, in order."""
        done = []
        while self.pending and self.pending[0].at_s <= elapsed_s:
            part = self.pending.pop(0)
            self._inject_part(part)
            done.append(part)
        return done

    def _inject_part(self, f: Fault) -> None:
        fab = self.fabric
        lf, sp = fab.leaf(f.leaf), fab.spine(f.spine)
        self.active = True
        if f.kind == "link_down":
            fab.sh(lf, f"ip link set {uplink_if(f.leaf, f.spine)} down")
            fab.sh(sp, f"ip link set {downlink_if(f.spine, f.leaf)} down")
        elif f.kind == "blackhole":
            stmt = "meta protocol ip counter drop"
            self._nft(lf, _ingress_drop_table(uplink_if(f.leaf, f.spine), stmt))
            self._nft(sp, _ingress_drop_table(downlink_if(f.spine, f.leaf), stmt))
        elif f.kind == "loss":
            # numgen draws from [0, 10000): the threshold is the loss in hundredths of a percent.
            thr = int(round(f.loss_pct * 100))
            stmt = f"meta protocol ip numgen random mod 10000 < {thr} counter drop"
            for r in range(fab.spec.rails):
                self._nft(sp, _ingress_drop_table(downlink_if(f.spine, r), stmt))
        elif f.kind == "slow_spine":
            for r in range(fab.spec.rails):
                fab.set_link_bw(lf if r == f.leaf else fab.leaf(r), uplink_if(r, f.spine), f.bw_mbit)
                fab.set_link_bw(sp, downlink_if(f.spine, r), f.bw_mbit)
        elif f.kind == "nic_blackhole":
            stmt = "meta protocol ip counter drop"
            self._nft(fab.host(f.host), _ingress_drop_table(host_if(f.host, f.leaf), stmt))
            self._nft(lf, _ingress_drop_table(leaf_down_if(f.leaf, f.host), stmt))
            log.info("fault %s (%s) injected: host %s rail %d", f.name, f.kind, host_name(f.host), f.leaf)
            return
        else:
            raise ValueError(f"unknown fault kind {f.kind}")
        log.info("fault %s (%s) injected: leaf %s spine %s", f.name, f.kind, leaf_name(f.leaf), spine_name(f.spine))

    def heal(self) -> None:
        """Undoes the primary fault alone (a black hole or a cut link), leaving its ``also`` parts in place:
        the link carries traffic again and the routers' routes are as before the fault."""
        f, fab = self.fault, self.fabric
        if self.healed or f.kind not in ("blackhole", "link_down", "nic_blackhole"):
            return
        if f.kind in ("blackhole", "nic_blackhole"):
            for node, ifname in self._black_hole_ports(f):
                chain = f"netdev {NFT_TABLE} in_{ifname.replace('-', '_')}"
                # Its drops so far are kept (flushing the chain takes its counter with it); another
                # part's chain on the same router is not this fault's.
                self.healed_drops += _sum_counters(node.cmd(f"nft -j list chain {chain} 2>/dev/null"))
                fab.sh(node, f"nft flush chain {chain}")
        else:
            fab.sh(fab.leaf(f.leaf), f"ip link set {uplink_if(f.leaf, f.spine)} up")
            fab.sh(fab.spine(f.spine), f"ip link set {downlink_if(f.spine, f.leaf)} up")
            fab.routes()
        self.healed = True
        where = (f"host {host_name(f.host)} rail {f.leaf}" if f.kind == "nic_blackhole"
                 else f"leaf {leaf_name(f.leaf)} spine {spine_name(f.spine)}")
        log.info("fault %s (%s) healed: %s", f.name, f.kind, where)

    def _black_hole_ports(self, f: Fault) -> list:
        """(node, interface) of both ends of a black hole's link."""
        fab = self.fabric
        if f.kind == "nic_blackhole":
            return [(fab.host(f.host), host_if(f.host, f.leaf)), (fab.leaf(f.leaf), leaf_down_if(f.leaf, f.host))]
        return [(fab.leaf(f.leaf), uplink_if(f.leaf, f.spine)), (fab.spine(f.spine), downlink_if(f.spine, f.leaf))]

    def _nft_nodes(self) -> list:
        """Every node that may hold this fault's nft table: the routers, and the hosts of NIC faults."""
        fab = self.fabric
        hosts = sorted({f.host for f in self.fault.parts() if f.kind == "nic_blackhole"})
        return list(fab.routers()) + [fab.host(h) for h in hosts]

    def _nft(self, node, ruleset: str) -> None:
        # One nft command line adds the table and its chain atomically.
        self.fabric.sh(node, f"nft '{ruleset}'")

    def clear(self) -> None:
        """Undoes the fault and its parts (idempotent) and reinstalls the routes a downed port took with
        it."""
        fab = self.fabric
        spec = fab.spec
        for node in self._nft_nodes():
            node.cmd(f"nft delete table netdev {NFT_TABLE} 2>/dev/null")
        for f in self.fault.parts():
            if f.kind == "link_down":
                fab.sh(fab.leaf(f.leaf), f"ip link set {uplink_if(f.leaf, f.spine)} up")
                fab.sh(fab.spine(f.spine), f"ip link set {downlink_if(f.spine, f.leaf)} up")
            if f.kind == "slow_spine":
                for r in range(spec.rails):
                    fab.set_link_bw(fab.leaf(r), uplink_if(r, f.spine), spec.spine_bw_mbit)
                    fab.set_link_bw(fab.spine(f.spine), downlink_if(f.spine, r), spec.spine_bw_mbit)
        fab.routes()
        self.pending = []
        self.active = False

    # --- what the fault hits ----------------------------------------------------------------------------

    def nft_drops(self) -> int:
        """Packets the nft rules of the fault and its parts dropped so far (0 for faults without rules)."""
        names = []
        for f in self.fault.parts():
            if f.kind == "blackhole":
                names += [leaf_name(f.leaf), spine_name(f.spine)]
            elif f.kind == "loss":
                names += [spine_name(f.spine)]
            elif f.kind == "nic_blackhole":
                names += [host_name(f.host), leaf_name(f.leaf)]
        # After a heal the black hole's chains are empty; what they dropped before is counted once.
        return self._drops_at(names) + self.healed_drops

    def _drops_at(self, names: list[str]) -> int:
        """Packets dropped so far by every rule of the fault table on the named routers."""
        total = 0
        for node in (n for n in self._nft_nodes() if n.name in set(names)):
            out = node.cmd(f"nft -j list table netdev {NFT_TABLE} 2>/dev/null")
            total += _sum_counters(out)
        return total

    def dead_path_packets(self, netdev: dict, no_routes: dict) -> int | None:
        """Packets sent into the dead path, from one sample of the counters (None: the fault has no dead
        path)."""
        f = self.fault
        lf, sp = leaf_name(f.leaf), spine_name(f.spine)
        if f.kind == "blackhole":
            up = netdev.get(lf, {}).get(uplink_if(f.leaf, f.spine), {}).get("tx_packets", 0)
            down = netdev.get(sp, {}).get(downlink_if(f.spine, f.leaf), {}).get("tx_packets", 0)
            return up + down
        if f.kind == "link_down":
            up = netdev.get(lf, {}).get(uplink_if(f.leaf, f.spine), {}).get("tx_packets", 0)
            return up + no_routes.get(sp, 0)
        if f.kind == "nic_blackhole":
            return self._nic_counter(netdev, "tx_packets")
        return None

    def _nic_counter(self, netdev: dict, key: str) -> int:
        """A NIC fault's link: `key` of the host's interface plus the leaf's port towards it."""
        return sum(netdev.get(node.name, {}).get(ifn, {}).get(key, 0) for node, ifn in self._black_hole_ports(self.fault))

    def link_bytes(self, netdev: dict) -> int | None:
        """Bytes sent onto the faulty leaf-spine link (both ends' transmit counters) for a black hole or a
        cut link, from one sample of the counters; None for faults without such a link. While a black
        hole lasts they are what it swallowed; once a fault healed, what the link carries again."""
        f = self.fault
        if f.kind == "nic_blackhole":
            return self._nic_counter(netdev, "tx_bytes")
        if f.kind not in ("blackhole", "link_down"):
            return None
        lf, sp = leaf_name(f.leaf), spine_name(f.spine)
        return (netdev.get(lf, {}).get(uplink_if(f.leaf, f.spine), {}).get("tx_bytes", 0)
                + netdev.get(sp, {}).get(downlink_if(f.spine, f.leaf), {}).get("tx_bytes", 0))


def _sum_counters(text: str) -> int:
    """Sum of every rule counter's packets in ``nft -j`` output."""
    import json

    if not text.strip():
        return 0
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return 0
    total = 0
    for item in doc.get("nftables", []):
        rule = item.get("rule")
        if not rule:
            continue
        for expr in rule.get("expr", []):
            c = expr.get("counter")
            if isinstance(c, dict):
                total += int(c.get("packets", 0))
    return total
