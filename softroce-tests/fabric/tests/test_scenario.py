"""Scenario files: the shipped ones load, and each kind of mistake is an error that names its field."""

import copy
import json
import unittest
from pathlib import Path

from prismfab.scenario import Scenario, ScenarioError, TopologySpec, parse_size

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def ci() -> dict:
    return json.loads((SCENARIOS / "ci.json").read_text())


class ScenarioFiles(unittest.TestCase):
    def test_every_shipped_scenario_loads(self):
        files = sorted(SCENARIOS.glob("*.json"))
        self.assertGreaterEqual(len(files), 2)
        for f in files:
            with self.subTest(f=f.name):
                Scenario.load(f)

    def test_ci_scenario_is_four_hosts_two_rails_two_spines(self):
        self.assertEqual(Scenario.load(SCENARIOS / "ci.json").topology.label(), "4x2x2")

    def test_default_scenario_is_eight_hosts_two_rails_four_spines_at_100_to_200_mbit(self):
        t = Scenario.load(SCENARIOS / "default.json").topology
        self.assertEqual(t.label(), "8x2x4")
        self.assertTrue(100 <= t.spine_bw_mbit <= t.host_bw_mbit <= 200)


class CombinedFaults(unittest.TestCase):
    def test_spines3_has_three_spines_and_loss_then_a_black_hole_on_another_spine(self):
        scn = Scenario.load(SCENARIOS / "spines3.json")
        self.assertEqual(scn.topology.spines, 3)
        f = scn.faults[0]
        self.assertEqual([(p.kind, p.spine) for p in f.parts()], [("loss", 1), ("blackhole", 2)])
        self.assertLess(f.also[0].at_s, f.at_s)
        self.assertEqual(f.policies, ["reps", "pro", "spray", "dr"])

    def fault(self, also, **kw):
        d = ci()
        d["faults"][0].update({"also": also, **kw})
        return d

    def test_parts_fire_in_time_order_and_default_to_the_faults_time(self):
        scn = Scenario.from_json(self.fault([{"kind": "loss", "spine": 1, "loss_pct": 2.5, "at_s": 0.1}], spine=0,
                                            at_s=0.3))
        parts = scn.faults[0].parts()
        self.assertEqual([(p.kind, p.at_s, p.loss_pct) for p in parts], [("loss", 0.1, 2.5), ("blackhole", 0.3, 1.0)])
        d = self.fault([{"kind": "loss", "spine": 1}])
        self.assertEqual(Scenario.from_json(d).faults[0].also[0].at_s, d["faults"][0]["at_s"])

    def test_a_part_on_the_black_holed_spine_is_rejected(self):
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(self.fault([{"kind": "loss", "spine": 0}], spine=0))
        self.assertIn("both break spine 0", str(cm.exception))

    def test_two_black_holes_on_different_links_of_one_spine_are_allowed(self):
        scn = Scenario.from_json(self.fault([{"kind": "blackhole", "spine": 0, "leaf": 1}], spine=0, leaf=0))
        self.assertEqual(len(scn.faults[0].parts()), 2)

    def test_a_part_on_a_missing_spine_or_with_an_unknown_field_is_named(self):
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(self.fault([{"kind": "loss", "spine": 2}]))
        self.assertIn("faults[0].also[0].spine=2", str(cm.exception))
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(self.fault([{"kind": "loss", "spine": 1, "name": "x"}]))
        self.assertIn("faults[0].also[0]: unknown field(s) name", str(cm.exception))

    def test_a_black_hole_or_a_cut_link_may_heal_and_nothing_else(self):
        d = self.fault([], heal_after_s=0.5)
        d["checks"]["revive_s_max"] = 0.75
        scn = Scenario.from_json(d)
        self.assertEqual((scn.faults[0].heal_after_s, scn.checks.revive_s_max), (0.5, 0.75))
        self.assertIsNone(Scenario.from_json(self.fault([])).faults[0].heal_after_s)
        self.assertEqual(Scenario.from_json(self.fault([], kind="link_down", heal_after_s=1)).faults[0].heal_after_s, 1.0)
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(self.fault([], kind="loss", heal_after_s=0.5))
        self.assertIn("faults[0].heal_after_s: only a blackhole, link_down or nic_blackhole heals", str(cm.exception))
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(self.fault([], heal_after_s=0))
        self.assertIn("faults[0].heal_after_s", str(cm.exception))
        d["checks"]["revive_s_max"] = "soon"
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(d)
        self.assertIn("checks.revive_s_max", str(cm.exception))

    def test_a_nic_black_hole_names_its_host_and_rail_and_clashes_only_with_its_own_link(self):
        scn = Scenario.from_json(self.fault([{"kind": "loss", "spine": 0}], kind="nic_blackhole", host=3, leaf=1,
                                            spine=0, heal_after_s=0.4))
        f = scn.faults[0]
        self.assertEqual((f.kind, f.host, f.leaf, f.heal_after_s), ("nic_blackhole", 3, 1, 0.4))
        both = self.fault([{"kind": "nic_blackhole", "host": 1, "leaf": 0}], kind="nic_blackhole", host=1, leaf=1)
        self.assertEqual([p.host for p in Scenario.from_json(both).faults[0].parts()], [1, 1])
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(self.fault([{"kind": "nic_blackhole", "host": 1, "leaf": 1}], kind="nic_blackhole",
                                          host=1, leaf=1))
        self.assertIn("two nic_blackhole parts on host 1 rail 1", str(cm.exception))
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(self.fault([], kind="nic_blackhole", host=4))
        self.assertIn("faults[0].host=4: the topology has 4 hosts", str(cm.exception))

    def test_recovery_limit_and_a_faults_own_ratio_are_read(self):
        d = self.fault([], cct_ratio_max=1.3)
        d["checks"]["recovery_rtts_max"] = 6
        scn = Scenario.from_json(d)
        self.assertEqual((scn.faults[0].cct_ratio_max, scn.checks.recovery_rtts_max), (1.3, 6.0))
        self.assertIsNone(Scenario.from_json(ci()).faults[0].cct_ratio_max)
        own = Scenario.from_json(self.fault([], recovery_rtts_max=25))
        self.assertEqual(own.faults[0].recovery_rtts_max, 25.0)
        self.assertIsNone(Scenario.from_json(ci()).faults[0].recovery_rtts_max)
        d["checks"]["recovery_rtts_max"] = -1
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(d)
        self.assertIn("checks.recovery_rtts_max", str(cm.exception))


class ScenarioErrors(unittest.TestCase):
    def assert_error_names(self, d: dict, needle: str):
        with self.assertRaises(ScenarioError) as cm:
            Scenario.from_json(d)
        self.assertIn(needle, str(cm.exception))

    def test_unknown_topology_field_is_named(self):
        d = ci()
        d["topology"]["spinez"] = 3
        self.assert_error_names(d, "spinez")

    def test_fault_on_a_spine_that_does_not_exist_is_rejected(self):
        d = ci()
        d["faults"][0]["spine"] = 7
        self.assert_error_names(d, "faults[0].spine=7")

    def test_fault_naming_an_undefined_policy_is_rejected(self):
        d = ci()
        d["faults"][0]["policies"] = ["zigzag"]
        self.assert_error_names(d, "zigzag")

    def test_unknown_collective_is_rejected(self):
        d = ci()
        d["workloads"][0]["collective"] = "broadcastish"
        self.assert_error_names(d, "workloads[0].collective")

    def test_unknown_workload_rank_rail_is_rejected(self):
        d = ci()
        d["workloads"][0]["rank_rail"] = "diagonal"
        self.assert_error_names(d, "workloads[0].rank_rail")

    def test_checks_naming_a_missing_workload_are_rejected(self):
        d = ci()
        d["checks"]["pinned_workload"] = "nope"
        self.assert_error_names(d, "checks.pinned_workload")

    def test_policy_env_must_be_prism_variables(self):
        d = ci()
        d["policies"][0]["env"] = {"PATH": "/bin"}
        self.assert_error_names(d, "policies[0].env")

    def test_duplicate_policy_names_are_rejected(self):
        d = ci()
        d["policies"].append(copy.deepcopy(d["policies"][0]))
        self.assert_error_names(d, "duplicate")

    def test_rotated_rank_rails_need_two_rails(self):
        d = ci()
        d["topology"]["rails"] = 1
        d["faults"] = []
        self.assert_error_names(d, "rank_rail")


class Sizes(unittest.TestCase):
    def test_suffixes_are_powers_of_1024(self):
        self.assertEqual(parse_size("8M", "x"), 8 << 20)
        self.assertEqual(parse_size("64k", "x"), 64 << 10)
        self.assertEqual(parse_size(4096, "x"), 4096)

    def test_garbage_size_names_the_field(self):
        with self.assertRaises(ScenarioError) as cm:
            parse_size("lots", "workloads[1].bytes")
        self.assertIn("workloads[1].bytes", str(cm.exception))


class RankRails(unittest.TestCase):
    def test_rotate_alternates_rails_so_ring_neighbours_cross_the_spines(self):
        t = TopologySpec(hosts=4, rails=2, spines=2, rank_rail="rotate")
        self.assertEqual([t.rank_rail_of(i) for i in range(4)], [0, 1, 0, 1])

    def test_half_puts_first_half_on_rail0(self):
        t = TopologySpec(hosts=4, rails=2, spines=2, rank_rail="half")
        self.assertEqual([t.rank_rail_of(i) for i in range(4)], [0, 0, 1, 1])

    def test_aligned_keeps_every_rank_on_rail0(self):
        t = TopologySpec(hosts=4, rails=2, spines=2, rank_rail="aligned")
        self.assertEqual({t.rank_rail_of(i) for i in range(4)}, {0})


if __name__ == "__main__":
    unittest.main()


class SportScenario(unittest.TestCase):
    def load(self, **topo):
        d = json.loads((SCENARIOS / "ethereal.json").read_text())
        d["topology"].update(topo)
        return Scenario.from_json(d)

    def test_the_ethereal_scenario_routes_by_source_port_with_rank0_alone_on_rail0(self):
        s = Scenario.load(SCENARIOS / "ethereal.json")
        self.assertEqual(s.topology.leaf_routing, "sport")
        self.assertEqual([s.topology.rank_rail_of(i) for i in range(6)], [0, 1, 1, 1, 1, 1])
        self.assertEqual((s.checks.spread_policies, s.checks.spread_max), (["ethereal"], 0.02))

    def test_the_shipped_hashed_scenarios_keep_the_hash(self):
        for name in ("ci.json", "default.json", "spines3.json"):
            self.assertEqual(Scenario.load(SCENARIOS / name).topology.leaf_routing, "hash", name)

    def test_an_unknown_routing_is_named(self):
        with self.assertRaises(ScenarioError) as e:
            self.load(leaf_routing="ospf")
        self.assertIn("topology.leaf_routing", str(e.exception))

    def test_ports_past_65535_are_rejected(self):
        with self.assertRaises(ScenarioError) as e:
            self.load(hosts=200)
        self.assertIn("past 65535", str(e.exception))

    def test_faults_are_refused_under_source_port_routing(self):
        d = json.loads((SCENARIOS / "ethereal.json").read_text())
        d["faults"] = [{"name": "bh", "kind": "blackhole", "workload": "five_flows", "policies": ["spray"]}]
        with self.assertRaises(ScenarioError) as e:
            Scenario.from_json(d)
        self.assertIn("leaf_routing=sport", str(e.exception))

    def test_spread_policies_need_a_workload(self):
        d = json.loads((SCENARIOS / "ethereal.json").read_text())
        del d["checks"]["spread_workload"]
        with self.assertRaises(ScenarioError) as e:
            Scenario.from_json(d)
        self.assertIn("spread_workload", str(e.exception))
