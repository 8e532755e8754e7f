"""Fault injection on a stand-in fabric that records the commands it is given: which ports each fault
part breaks, when the parts of a combined fault fire, and that clearing undoes all of them."""

import unittest

from prismfab.faults import Injector
from prismfab.scenario import Fault, TopologySpec


class Node:
    def __init__(self, name):
        self.name = name
        self.cmds = []

    def cmd(self, c):
        self.cmds.append(c)
        return ""


class FakeFabric:
    def __init__(self, spines=3, rails=2):
        self.spec = TopologySpec(hosts=4, rails=rails, spines=spines)
        self.leaves = [Node(f"lf{r}") for r in range(rails)]
        self.spines = [Node(f"sp{s}") for s in range(spines)]
        self.hosts = [Node(f"h{i}") for i in range(4)]
        self.log = []  # (node, command) in order
        self.bw = []
        self.routes_calls = 0

    def leaf(self, r):
        return self.leaves[r]

    def spine(self, s):
        return self.spines[s]

    def host(self, i):
        return self.hosts[i]

    def routers(self):
        return self.leaves + self.spines

    def sh(self, node, c):
        self.log.append((node.name, c))

    def set_link_bw(self, node, ifname, bw):
        self.bw.append((node.name, ifname, bw))

    def routes(self):
        self.routes_calls += 1


def loss_then_blackhole():
    f = Fault("lb", "blackhole", "w", ["spray"], spine=2, leaf=0, at_s=0.4)
    f.also = [Fault("lb.loss", "loss", "w", ["spray"], spine=1, loss_pct=1.0, at_s=0.1)]
    return f


class CombinedFault(unittest.TestCase):
    def test_parts_fire_when_their_time_has_come_and_only_once(self):
        fab = FakeFabric()
        inj = Injector(fab, loss_then_blackhole())
        self.assertEqual(inj.inject_due(0.05), [])
        self.assertEqual(fab.log, [])
        fired = inj.inject_due(0.1)
        self.assertEqual([p.kind for p in fired], ["loss"])
        # 1 % = 100 of 10000 on every port of spine 1 (one per rail), nothing on spine 2 yet.
        self.assertEqual([n for n, _ in fab.log], ["sp1", "sp1"])
        self.assertTrue(all("numgen random mod 10000 < 100" in c for _, c in fab.log))
        self.assertEqual(inj.inject_due(0.3), [])
        fired = inj.inject_due(0.45)
        self.assertEqual([p.kind for p in fired], ["blackhole"])
        self.assertIs(fired[0], inj.fault)
        bh = fab.log[2:]
        self.assertEqual([n for n, _ in bh], ["lf0", "sp2"])
        self.assertIn('device "lf0-sp2"', bh[0][1])
        self.assertIn('device "sp2-lf0"', bh[1][1])
        self.assertEqual(inj.inject_due(10.0), [])
        self.assertEqual(len(fab.log), 4)

    def test_inject_applies_every_pending_part_at_once(self):
        fab = FakeFabric()
        inj = Injector(fab, loss_then_blackhole())
        inj.inject()
        self.assertEqual(sorted({n for n, _ in fab.log}), ["lf0", "sp1", "sp2"])
        self.assertEqual(inj.pending, [])

    def test_clear_undoes_every_part(self):
        fab = FakeFabric()
        f = Fault("cut_slow", "link_down", "w", ["spray"], spine=0, leaf=1, at_s=0.2)
        f.also = [Fault("cut_slow.slow", "slow_spine", "w", ["spray"], spine=2, bw_mbit=10.0, at_s=0.2)]
        inj = Injector(fab, f)
        inj.inject()
        fab.log.clear()
        fab.bw.clear()
        inj.clear()
        self.assertIn(("lf1", "ip link set lf1-sp0 up"), fab.log)
        self.assertIn(("sp0", "ip link set sp0-lf1 up"), fab.log)
        # Spine 2's ports back at the scenario's spine rate, both ends of each of its links.
        self.assertEqual(sorted(fab.bw), sorted([("lf0", "lf0-sp2", fab.spec.spine_bw_mbit),
                                                 ("lf1", "lf1-sp2", fab.spec.spine_bw_mbit),
                                                 ("sp2", "sp2-lf0", fab.spec.spine_bw_mbit),
                                                 ("sp2", "sp2-lf1", fab.spec.spine_bw_mbit)]))
        self.assertEqual(fab.routes_calls, 1)
        self.assertTrue(all(any("nft delete table netdev" in c for c in n.cmds) for n in fab.routers()))

    def test_the_dead_path_is_the_primary_faults_link_counted_in_packets_and_bytes(self):
        inj = Injector(FakeFabric(), loss_then_blackhole())
        nd = {"lf0": {"lf0-sp2": {"tx_packets": 3, "tx_bytes": 300}, "lf0-sp1": {"tx_packets": 50, "tx_bytes": 5000}},
              "sp2": {"sp2-lf0": {"tx_packets": 4, "tx_bytes": 400}}}
        self.assertEqual(inj.dead_path_packets(nd, {}), 7)
        self.assertEqual(inj.link_bytes(nd), 700)
        cut = Injector(FakeFabric(), Fault("c", "link_down", "w", ["spray"], spine=2, leaf=0))
        self.assertEqual(cut.link_bytes(nd), 700)
        loss = Injector(FakeFabric(), Fault("l", "loss", "w", ["spray"], spine=1))
        self.assertIsNone(loss.link_bytes(nd))


class Heal(unittest.TestCase):
    def test_a_healed_black_hole_empties_its_own_chains_and_keeps_the_loss_part(self):
        fab = FakeFabric()
        inj = Injector(fab, loss_then_blackhole())
        inj.inject()
        n = len(fab.log)
        inj.heal()
        healed = fab.log[n:]
        self.assertEqual(healed, [("lf0", "nft flush chain netdev prismfab_fault in_lf0_sp2"),
                                  ("sp2", "nft flush chain netdev prismfab_fault in_sp2_lf0")])
        # Its counters were read from its own chains only, before they were flushed.
        self.assertIn("nft -j list chain netdev prismfab_fault in_lf0_sp2 2>/dev/null", fab.leaves[0].cmds)
        self.assertIn("nft -j list chain netdev prismfab_fault in_sp2_lf0 2>/dev/null", fab.spines[2].cmds)
        self.assertTrue(inj.healed)
        inj.heal()  # once only
        self.assertEqual(len(fab.log), n + 2)

    def test_a_healed_cut_link_comes_up_at_both_ends_with_its_routes(self):
        fab = FakeFabric()
        inj = Injector(fab, Fault("c", "link_down", "w", ["spray"], spine=1, leaf=1))
        inj.inject()
        n = len(fab.log)
        inj.heal()
        self.assertEqual(fab.log[n:], [("lf1", "ip link set lf1-sp1 up"), ("sp1", "ip link set sp1-lf1 up")])
        self.assertEqual(fab.routes_calls, 1)

    def test_faults_without_a_dead_link_do_not_heal(self):
        fab = FakeFabric()
        inj = Injector(fab, Fault("l", "loss", "w", ["spray"], spine=1))
        inj.inject()
        n = len(fab.log)
        inj.heal()
        self.assertEqual(len(fab.log), n)
        self.assertFalse(inj.healed)


if __name__ == "__main__":
    unittest.main()


class NicBlackHole(unittest.TestCase):
    def fault(self):
        return Fault("nic", "nic_blackhole", "w", ["spray"], host=2, leaf=1, at_s=0.3, heal_after_s=0.5)

    def test_both_ends_of_the_hosts_link_drop_and_only_they(self):
        fab = FakeFabric()
        inj = Injector(fab, self.fault())
        inj.inject()
        self.assertEqual([n for n, _ in fab.log], ["h2", "lf1"])
        self.assertIn('device "h2-r1"', fab.log[0][1])
        self.assertIn('device "lf1-h2"', fab.log[1][1])
        self.assertTrue(all("meta protocol ip counter drop" in c for _, c in fab.log))
        inj.heal()
        self.assertEqual(fab.log[2:], [("h2", "nft flush chain netdev prismfab_fault in_h2_r1"),
                                       ("lf1", "nft flush chain netdev prismfab_fault in_lf1_h2")])
        self.assertEqual(fab.routes_calls, 0, "a NIC's black hole takes no route with it")
        inj.clear()
        self.assertTrue(any("nft delete table netdev prismfab_fault" in c for c in fab.hosts[2].cmds),
                        "clear() must remove the table from the host too")

    def test_the_dead_path_is_the_hosts_link_both_ways(self):
        inj = Injector(FakeFabric(), self.fault())
        nd = {"h2": {"h2-r1": {"tx_packets": 5, "tx_bytes": 500}, "h2-r0": {"tx_packets": 99, "tx_bytes": 9900}},
              "lf1": {"lf1-h2": {"tx_packets": 7, "tx_bytes": 700}, "lf1-sp0": {"tx_packets": 50, "tx_bytes": 5000}}}
        self.assertEqual(inj.dead_path_packets(nd, {}), 12)
        self.assertEqual(inj.link_bytes(nd), 1200)
