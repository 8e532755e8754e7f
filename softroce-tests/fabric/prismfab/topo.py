"""The rail-optimised leaf-spine fabric, built with Mininet's Python API.

Shape: H hosts x R rails x S spines. NIC r of every host hangs from leaf r; every leaf has one link to every
spine. Leaves and spines are Linux routers (Mininet ``Host`` nodes with forwarding on, no switches, no
controller): each leaf reaches the other rails' prefixes over an equal-cost multipath route through all
spines, hashed on the UDP/TCP 5-tuple (``fib_multipath_hash_policy=1``) with a fixed seed so a source port
takes the same spine on every run. Hosts route by source address, so a packet sent from the rail-r address
leaves on rail r. Every link is shaped with htb (TCLink ``bw``) and a short pfifo, so the fabric, not the
CPU, is the bottleneck and queues build where a switch's would.

Addresses (i = host index from 0, r = rail, s = spine):
  host i, rail r        10.<100+r>.<i>.2/30   (gateway: leaf r, 10.<100+r>.<i>.1)
  leaf r - spine s      10.<200+r>.<s>.1/30 - .2
  management (unshaped, off-fabric, for the rendezvous only)  10.255.0.<i+1>/24 on a bridge in the
  outer namespace, which itself holds 10.255.0.254.

This module must run inside a throw-away network + PID namespace (``unshare --net --pid --fork``): Mininet
itself only ever sees that namespace.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from dataclasses import dataclass

from mininet.link import TCLink
from mininet.net import Mininet
from mininet.node import Host
from mininet.topo import Topo

from .scenario import TopologySpec

log = logging.getLogger("prismfab.topo")

MGMT_BRIDGE = "pfmgmt0"
# leaf_routing "sport": nft table on every leaf, and the routing table (and fwmark) of spine s.
SPORT_TABLE = "prismfab_sport"
SPORT_RT_BASE = 1000
MGMT_OUTER_ADDR = "10.255.0.254"


class FabricError(RuntimeError):
    """The fabric could not be built or configured; the message says which command failed."""


def host_name(i: int) -> str:
    """Mininet name of host i."""
    return f"h{i}"


def leaf_name(r: int) -> str:
    """Mininet name of the leaf of rail r."""
    return f"lf{r}"


def spine_name(s: int) -> str:
    """Mininet name of spine s."""
    return f"sp{s}"


def host_if(i: int, r: int) -> str:
    """Host i's NIC on rail r."""
    return f"h{i}-r{r}"


def leaf_down_if(r: int, i: int) -> str:
    """Leaf r's port towards host i."""
    return f"lf{r}-h{i}"


def uplink_if(r: int, s: int) -> str:
    """Leaf r's port towards spine s."""
    return f"lf{r}-sp{s}"


def downlink_if(s: int, r: int) -> str:
    """Spine s's port towards leaf r."""
    return f"sp{s}-lf{r}"


def htb_burst_bytes(bw_mbit: float) -> int:
    """Both token buckets (rate and ceil) of a shaped port at `bw_mbit`: 2 ms of the rate, at least 15 KB
    (TCLink's rate bucket, more than one 9,000-byte frame). A bucket is what a dequeue that runs late
    can catch up on; on a 2-core machine running eight ranks the kernel's htb watchdog runs late."""
    return max(15000, int(bw_mbit * 1e6 / 8 * 0.002))


def host_addr(i: int, r: int) -> str:
    """Host i's address on rail r."""
    return f"10.{100 + r}.{i}.2"


def gw_addr(i: int, r: int) -> str:
    """Leaf r's address on its link to host i (host i's gateway on rail r)."""
    return f"10.{100 + r}.{i}.1"


def rail_prefix(r: int) -> str:
    """Every address of rail r."""
    return f"10.{100 + r}.0.0/16"


def leaf_spine_addrs(r: int, s: int) -> tuple[str, str]:
    """(leaf side, spine side) of the leaf r - spine s link."""
    return f"10.{200 + r}.{s}.1", f"10.{200 + r}.{s}.2"


def mgmt_addr(i: int) -> str:
    """Host i's management address (rendezvous only, never on the fabric)."""
    return f"10.255.0.{i + 1}"


class Router(Host):
    """A Linux router: forwarding on, L4 multipath hash with a fixed seed, no IPv6 (clean counters)."""

    def config(self, hash_policy: int = 1, hash_seed: int = 1, **params):
        """Mininet calls this once the node exists: the router sysctls."""
        r = super().config(**params)
        self.cmd(
            "sysctl -qw net.ipv4.ip_forward=1"
            f" net.ipv4.fib_multipath_hash_policy={hash_policy}"
            f" net.ipv4.fib_multipath_hash_seed={hash_seed}"
            # A port whose far end lost carrier must stop being a nexthop at once (the default keeps
            # hashing onto it: half the traffic lost for the whole outage).
            " net.ipv4.conf.all.ignore_routes_with_linkdown=1"
            " net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0"
            " net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1"
        )
        return r


class FabricHost(Host):
    """A multi-homed host: source-routed rails, ARP answered only on the owning NIC, no IPv6."""

    def config(self, **params):
        """Mininet calls this once the node exists: the host sysctls."""
        r = super().config(**params)
        self.cmd(
            "sysctl -qw net.ipv4.conf.all.arp_ignore=1 net.ipv4.conf.all.arp_announce=2"
            " net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0"
            " net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1"
        )
        return r


class RailFabricTopo(Topo):
    """Mininet topology: hosts, leaves (one per rail), spines, shaped links with fixed interface names."""

    def build(self, spec: TopologySpec):  # pylint: disable=arguments-differ
        """Adds every node and shaped link of `spec`."""
        rp = {"hash_policy": spec.hash_policy, "hash_seed": spec.hash_seed}
        for r in range(spec.rails):
            self.addNode(leaf_name(r), cls=Router, ip=None, **rp)
        for s in range(spec.spines):
            self.addNode(spine_name(s), cls=Router, ip=None, **rp)
        for i in range(spec.hosts):
            self.addHost(host_name(i), cls=FabricHost, ip=None)
            for r in range(spec.rails):
                self.addLink(host_name(i), leaf_name(r), intfName1=host_if(i, r), intfName2=leaf_down_if(r, i),
                             cls=TCLink, bw=spec.host_bw_mbit)
        for r in range(spec.rails):
            for s in range(spec.spines):
                self.addLink(leaf_name(r), spine_name(s), intfName1=uplink_if(r, s), intfName2=downlink_if(s, r),
                             cls=TCLink, bw=spec.spine_bw_mbit)


@dataclass
class PathProbe:
    """Where the fabric sends one 5-tuple: the spine index, or None for a rail-local path."""

    sport: int
    spine: int | None


class Fabric:
    """A built and configured fabric: nodes, addresses, routes, the ECMP path oracle, teardown."""

    def __init__(self, spec: TopologySpec):
        self.spec = spec
        self.net: Mininet | None = None
        self._macs: dict[str, str] = {}
        # leaf_routing "sport": {UDP source port: spine}, set by `sport_routing`.
        self._sport: dict[int, int] | None = None

    # --- build -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Creates every node and link, then addresses, routes, MTU, queues and the management network."""
        t0 = time.monotonic()
        # Mininet.init() would raise machine-wide limits (fs.file-max ...); nothing here needs them, and a
        # test must not change global state, so it is marked as done.
        Mininet.inited = True
        self.net = Mininet(topo=RailFabricTopo(spec=self.spec), controller=None, autoSetMacs=False,
                           waitConnected=False, build=True)
        self.net.start()
        self._configure()
        self._mgmt()
        log.info("fabric %s up in %.2f s", self.spec.label(), time.monotonic() - t0)

    def stop(self) -> None:
        """Tears every node down (their namespaces go with their processes)."""
        if self.net is not None:
            net, self.net = self.net, None
            # A node interrupted in the middle of a command refuses the next one (Mininet asserts it is
            # not waiting); its shell is then simply killed: its links and rules die with its namespace.
            for node in net.hosts:
                if node.waiting:
                    node.waiting = False
                    node.terminate()
            try:
                net.stop()
            except Exception as e:  # noqa: BLE001 - finish the teardown whatever Mininet tripped on
                log.warning("mininet stop: %s: %s; killing the node shells", type(e).__name__, e)
                for node in net.hosts:
                    node.terminate()
        subprocess.run(["ip", "link", "del", MGMT_BRIDGE], stderr=subprocess.DEVNULL, check=False)

    def node(self, name: str):
        """The Mininet node called `name`."""
        assert self.net is not None, "fabric not started"
        return self.net[name]

    def host(self, i: int):
        """Host i."""
        return self.node(host_name(i))

    def leaf(self, r: int):
        """Leaf r."""
        return self.node(leaf_name(r))

    def spine(self, s: int):
        """Spine s."""
        return self.node(spine_name(s))

    def hosts(self):
        """Every host, in index order."""
        return [self.host(i) for i in range(self.spec.hosts)]

    def routers(self):
        """Every leaf, then every spine."""
        return [self.leaf(r) for r in range(self.spec.rails)] + [self.spine(s) for s in range(self.spec.spines)]

    def sh(self, node, cmd: str) -> str:
        """Runs `cmd` in `node`'s shell; raises with the output when it fails."""
        out = node.cmd(f"{cmd}; echo __rc=$?")
        m = re.search(r"__rc=(\d+)\s*$", out)
        rc = int(m.group(1)) if m else -1
        body = out[: m.start()] if m else out
        if rc != 0:
            raise FabricError(f"{node.name}: `{cmd}` failed (rc={rc}): {body.strip()}")
        return body

    def _configure(self) -> None:
        spec = self.spec
        for i in range(spec.hosts):
            h = self.host(i)
            for r in range(spec.rails):
                ifn, addr, gw = host_if(i, r), host_addr(i, r), gw_addr(i, r)
                self.sh(h, f"ip addr add {addr}/30 dev {ifn} && ip link set {ifn} mtu {spec.mtu} up")
                table = 100 + r
                # Source routing: whatever is sent from the rail-r address leaves on rail r, even towards
                # another rail's prefix (the connected route of the other NIC would short-circuit it).
                self.sh(h, f"ip route add {gw}/32 dev {ifn} src {addr} table {table}")
                self.sh(h, f"ip route add default via {gw} dev {ifn} src {addr} table {table}")
                self.sh(h, f"ip rule add from {addr} lookup {table} priority {table}")
                # Sockets that do not bind an address reach rail r's prefix through rail r.
                self.sh(h, f"ip route add {rail_prefix(r)} via {gw} dev {ifn} src {addr}")
        for r in range(spec.rails):
            lf = self.leaf(r)
            for i in range(spec.hosts):
                ifn = leaf_down_if(r, i)
                self.sh(lf, f"ip addr add {gw_addr(i, r)}/30 dev {ifn} && ip link set {ifn} mtu {spec.mtu} up")
            for s in range(spec.spines):
                la, sa = leaf_spine_addrs(r, s)
                self.sh(lf, f"ip addr add {la}/30 dev {uplink_if(r, s)} && ip link set {uplink_if(r, s)} mtu {spec.mtu} up")
                self.sh(self.spine(s), f"ip addr add {sa}/30 dev {downlink_if(s, r)} && "
                                       f"ip link set {downlink_if(s, r)} mtu {spec.mtu} up")
        self._macs = self._read_macs()
        self.routes()
        self._queues()

    def _read_macs(self) -> dict[str, str]:
        """{interface: MAC} of every fabric port (names are unique across the fabric)."""
        import json as _json

        macs = {}
        for node in self.hosts() + self.routers():
            for link in _json.loads(self.sh(node, "ip -j link show") or "[]"):
                if link.get("address") and link.get("ifname"):
                    macs[link["ifname"]] = link["address"]
        return macs

    def links(self):
        """Every fabric link as (node A, port A, address A, node B, port B, address B)."""
        spec = self.spec
        for i in range(spec.hosts):
            for r in range(spec.rails):
                yield (self.host(i), host_if(i, r), host_addr(i, r), self.leaf(r), leaf_down_if(r, i), gw_addr(i, r))
        for r in range(spec.rails):
            for s in range(spec.spines):
                la, sa = leaf_spine_addrs(r, s)
                yield (self.leaf(r), uplink_if(r, s), la, self.spine(s), downlink_if(s, r), sa)

    def neighbors(self) -> None:
        """Static ARP entries on every fabric link: no ARP ever crosses the fabric, so a link's packet
        counters count IP packets only (a black-holed link's counter is then exactly what was sent into
        it). A port that went down lost its entries; this puts them back."""
        per_node: dict = {}
        for a, ia, aa, b, ib, ab in self.links():
            per_node.setdefault(a, []).append(f"ip neigh replace {ab} lladdr {self._macs[ib]} dev {ia} nud permanent")
            per_node.setdefault(b, []).append(f"ip neigh replace {aa} lladdr {self._macs[ia]} dev {ib} nud permanent")
        for node, cmds in per_node.items():
            self.sh(node, " && ".join(cmds))

    def routes(self) -> None:
        """(Re)installs every static neighbour and fabric route; idempotent. Run again after a link comes
        back up: the kernel deletes a single-path route for good when its device goes down."""
        spec = self.spec
        self.neighbors()
        for r in range(spec.rails):
            lf = self.leaf(r)
            # Unknown addresses of the leaf's own rail must not bounce between leaf and spine.
            self.sh(lf, f"ip route replace blackhole {rail_prefix(r)}")
            if spec.rails > 1:
                hops = " ".join(f"nexthop via {leaf_spine_addrs(r, s)[1]} dev {uplink_if(r, s)}"
                                for s in range(spec.spines))
                for o in range(spec.rails):
                    if o != r:
                        self.sh(lf, f"ip route replace {rail_prefix(o)} {hops}")
        if self._sport is not None:
            self._sport_routes()
        for s in range(spec.spines):
            for r in range(spec.rails):
                sp = self.spine(s)
                out = sp.cmd(f"ip -o link show {downlink_if(s, r)}")
                if "state UP" not in out and "LOWER_UP" not in out:
                    continue  # the link is down on purpose (a fault); its route comes back with it
                self.sh(sp, f"ip route replace {rail_prefix(r)} via {leaf_spine_addrs(r, s)[0]} dev {downlink_if(s, r)}")

    def sport_routing(self, ports: dict[int, int], workdir) -> None:
        """leaf_routing "sport": every leaf sends a UDP packet whose source port is in `ports` ({port:
        spine}) to another rail through that spine; everything else keeps the hashed multipath route.
        An nft map in prerouting marks the packet (mark = spine + 1), `ip rule fwmark` sends it to the
        spine's table, which routes the other rails' prefixes through that spine only (a rail-local
        destination is not in it, so the lookup falls through to the main table). The nft script goes
        through a file in `workdir` (a node's shell takes lines of at most 4 KiB)."""
        from pathlib import Path

        self._sport = dict(ports)
        elems = ", ".join(f"{p} : {s + 1}" for p, s in sorted(self._sport.items()))
        script = Path(workdir) / "sport-routing.nft"
        script.write_text(
            f"table ip {SPORT_TABLE} {{\n"
            f"  map spine {{ type inet_service : mark; elements = {{ {elems} }} }}\n"
            f"  chain pre {{ type filter hook prerouting priority mangle; policy accept;\n"
            f"    meta l4proto udp meta mark set udp sport map @spine\n"
            f"  }}\n"
            f"}}\n")
        for r in range(self.spec.rails):
            self.sh(self.leaf(r), f"nft -f {script}")
        self._sport_routes()

    def _sport_routes(self) -> None:
        """(Re)installs the per-spine tables and fwmark rules of leaf_routing "sport"; idempotent."""
        spec = self.spec
        for r in range(spec.rails):
            lf = self.leaf(r)
            for s in range(spec.spines):
                table = SPORT_RT_BASE + s
                for o in range(spec.rails):
                    if o != r:
                        self.sh(lf, f"ip route replace {rail_prefix(o)} via {leaf_spine_addrs(r, s)[1]} "
                                    f"dev {uplink_if(r, s)} table {table}")
                if f"lookup {table}" not in lf.cmd(f"ip rule show fwmark {s + 1}"):
                    self.sh(lf, f"ip rule add fwmark {s + 1} lookup {table} priority {table}")

    def sport_ports(self) -> dict[int, int]:
        """{UDP source port: spine} of leaf_routing "sport" (empty under the hash)."""
        return dict(self._sport or {})

    def _queues(self) -> None:
        # Under TCLink's htb class sits the device's default queue; a switch port has a short buffer, so
        # each router port gets a pfifo of queue_pkts packets, and each host NIC one of host_queue_pkts.
        for node, ifn in self.fabric_ports():
            self.set_link_bw(node, ifn, self.port_mbit(ifn))
            limit = self.spec.host_queue_pkts if ifn.startswith("h") else self.spec.queue_pkts
            self.sh(node, f"tc qdisc replace dev {ifn} parent 5:1 handle 10: pfifo limit {limit}")
        # A NIC puts a GSO train (UDP_SEGMENT) on the wire as separate packets; a veth hands it to the
        # peer namespace whole, and every queue and nft rule of the fabric would count and drop it as
        # one packet. With UDP segmentation off, a host's NIC splits it as it leaves (after its own
        # queue, as a NIC's ring holds one descriptor per train).
        for i in range(self.spec.hosts):
            for r in range(self.spec.rails):
                self.sh(self.host(i), f"ethtool -K {host_if(i, r)} tx-udp-segmentation off")

    def port_mbit(self, ifn: str) -> float:
        """The configured rate of fabric port `ifn`: a host NIC and the leaf port facing it run at the host
        rate, leaf-spine links at the spine rate."""
        return self.spec.spine_bw_mbit if "-sp" in ifn or ifn.startswith("sp") else self.spec.host_bw_mbit

    def fabric_ports(self):
        """(node, interface) of every shaped fabric port, hosts included."""
        spec = self.spec
        for i in range(spec.hosts):
            for r in range(spec.rails):
                yield self.host(i), host_if(i, r)
                yield self.leaf(r), leaf_down_if(r, i)
        for r in range(spec.rails):
            for s in range(spec.spines):
                yield self.leaf(r), uplink_if(r, s)
                yield self.spine(s), downlink_if(s, r)

    def set_link_bw(self, node, ifn: str, bw_mbit: float) -> None:
        """Sets the htb rate of one port (the class TCLink made) with both token buckets at
        ``htb_burst_bytes``: TCLink gives the rate bucket 15 KB but leaves the ceil bucket at tc's
        default of 1,600 bytes, less than one 9,000-byte packet, so on a busy machine a dequeue
        later than 64 us (at 200 Mbit/s) lost link time for good."""
        b = htb_burst_bytes(bw_mbit)
        self.sh(node, f"tc class change dev {ifn} parent 5:0 classid 5:1 htb rate {bw_mbit}Mbit burst {b} cburst {b}")

    def _mgmt(self) -> None:
        # The rendezvous must not ride on the fabric: a fault would cut it, and its bytes would blur the
        # counters. One unshaped bridge in the outer namespace, one veth per host.
        run = lambda *a: subprocess.run(list(a), check=True, capture_output=True, text=True)  # noqa: E731
        try:
            run("ip", "link", "add", MGMT_BRIDGE, "type", "bridge")
            run("ip", "addr", "add", f"{MGMT_OUTER_ADDR}/24", "dev", MGMT_BRIDGE)
            run("ip", "link", "set", MGMT_BRIDGE, "up")
            for i in range(self.spec.hosts):
                h = self.host(i)
                inner, outer = f"h{i}-m", f"pfm{i}"
                run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
                run("ip", "link", "set", inner, "netns", str(h.pid))
                run("ip", "link", "set", outer, "master", MGMT_BRIDGE, "up")
                self.sh(h, f"ip addr add {mgmt_addr(i)}/24 dev {inner} && ip link set {inner} up && ip link set lo up")
        except subprocess.CalledProcessError as e:
            raise FabricError(f"management network: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from e

    # --- path oracle -------------------------------------------------------------------------------------

    def spine_of(self, src: int, src_rail: int, dst: int, dst_rail: int, sport: int, dport: int,
                 proto: str = "udp") -> int | None:
        """The spine the fabric's hash picks for this 5-tuple (None when the path stays in the leaf)."""
        if src_rail == dst_rail:
            return None
        out = self.sh(self.leaf(src_rail),
                      f"ip route get {host_addr(dst, dst_rail)} from {host_addr(src, src_rail)} "
                      f"iif {leaf_down_if(src_rail, src)} ipproto {proto} sport {sport} dport {dport}")
        m = re.search(r"dev lf\d+-sp(\d+)", out)
        if not m:
            raise FabricError(f"path oracle: no spine port in `{out.strip()}`")
        return int(m.group(1))

    def describe(self) -> dict:
        """The fabric as built, for the results files."""
        spec = self.spec
        return {
            "label": spec.label(),
            "hosts": [{"name": host_name(i), "rank_rail": spec.rank_rail_of(i),
                       "rails": {host_if(i, r): host_addr(i, r) for r in range(spec.rails)},
                       "mgmt": mgmt_addr(i)} for i in range(spec.hosts)],
            "leaves": [{"name": leaf_name(r), "uplinks": [uplink_if(r, s) for s in range(spec.spines)]}
                       for r in range(spec.rails)],
            "spines": [spine_name(s) for s in range(spec.spines)],
            "host_bw_mbit": spec.host_bw_mbit,
            "spine_bw_mbit": spec.spine_bw_mbit,
            "mtu": spec.mtu,
            "queue_pkts": spec.queue_pkts,
            "host_queue_pkts": spec.host_queue_pkts,
            "hash": {"policy": spec.hash_policy, "seed": spec.hash_seed},
            "leaf_routing": spec.leaf_routing,
        }
