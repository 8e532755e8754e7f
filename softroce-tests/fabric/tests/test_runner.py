"""What each rank is started with, and the fault commands."""

import os
import unittest
from pathlib import Path
from unittest import mock

from prismfab import faults, runner
from prismfab.scenario import Policy, Scenario, Workload

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


class RankEnvironment(unittest.TestCase):
    scn = Scenario.load(SCENARIOS / "ci.json")
    pol = Policy("spray", {"PRISM_PATH": "spray"})

    def test_stray_prism_variables_of_the_caller_are_dropped(self):
        with mock.patch.dict(os.environ, {"PRISM_PATHZ": "1", "NCCL_NET": "IB", "HOME": "/h"}):
            env = runner.rank_env(self.scn, self.pol, 0, Path("out"))
        self.assertNotIn("PRISM_PATHZ", env)
        self.assertNotIn("NCCL_NET", env)
        self.assertEqual(env["HOME"], "/h")

    def test_the_rank_rail_is_the_first_interface(self):
        self.assertEqual(runner.rank_env(self.scn, self.pol, 1, Path("o"))["PRISM_IFNAMES"], "h1-r1,h1-r0")
        self.assertEqual(runner.rank_env(self.scn, self.pol, 2, Path("o"))["PRISM_IFNAMES"], "h2-r0,h2-r1")

    def test_a_workload_can_place_ranks_by_halves(self):
        wl = Workload("ring", "sendrecv", 1 << 20, rank_rail="half")
        self.assertEqual(runner.rank_env(self.scn, self.pol, 1, Path("o"), wl)["PRISM_IFNAMES"], "h1-r0,h1-r1")
        self.assertEqual(runner.rank_env(self.scn, self.pol, 2, Path("o"), wl)["PRISM_IFNAMES"], "h2-r1,h2-r0")

    def test_workload_variables_apply_but_the_policy_wins(self):
        wl = Workload("ring", "sendrecv", 1 << 20, env={"PRISM_RAIL": "single", "PRISM_PATH": "ecmp"})
        env = runner.rank_env(self.scn, self.pol, 0, Path("o"), wl)
        self.assertEqual((env["PRISM_RAIL"], env["PRISM_PATH"]), ("single", "spray"))

    def test_single_rail_workloads_use_one_rail(self):
        wl = Workload("ring", "sendrecv", 1 << 20, env={"PRISM_RAIL": "single"})
        self.assertEqual(runner.rails_used(self.scn, wl, self.pol), 1)
        self.assertEqual(runner.rails_used(self.scn, Workload("a", "alltoall", 1 << 20), self.pol), 2)

    def test_policy_and_scenario_variables_are_set(self):
        env = runner.rank_env(self.scn, self.pol, 0, Path("o"))
        self.assertEqual(env["PRISM_PATH"], "spray")
        self.assertEqual(env["PRISM_PATHS"], str(self.scn.paths))
        self.assertEqual(env["PRISM_SEED"], "7")
        self.assertEqual(env["PRISM_STATS"], str(Path("o") / "stats-rank0.json"))

    def test_rank0_alone_writes_the_json_and_everyone_meets_on_the_management_network(self):
        bins = runner.Binaries(Path("b/prism-perf"), Path("b/libnccl-net-prism.so"))
        wl = self.scn.workloads[0]
        c0 = runner.perf_cmd(bins, self.scn, wl, 0, Path("o"))
        c3 = runner.perf_cmd(bins, self.scn, wl, 3, Path("o"))
        self.assertIn("--json", c0)
        self.assertNotIn("--json", c3)
        self.assertEqual(c3[c3.index("--rendezvous") + 1], "10.255.0.1:29500")
        self.assertEqual(c3[c3.index("-c") + 1], "1")


class FaultCommands(unittest.TestCase):
    def test_blackhole_rule_is_one_nft_command_hooking_the_named_port(self):
        t = faults._ingress_drop_table("lf0-sp1", "meta protocol ip counter drop")
        self.assertTrue(t.startswith("add table netdev prismfab_fault"))
        self.assertIn('device "lf0-sp1"', t)
        self.assertEqual(t.count("{"), t.count("}"))

    def test_nft_json_counters_are_summed(self):
        text = ('{"nftables":[{"metainfo":{}},{"rule":{"expr":[{"counter":{"packets":5,"bytes":10}},{"drop":null}]}},'
                '{"rule":{"expr":[{"counter":{"packets":7,"bytes":1}}]}}]}')
        self.assertEqual(faults._sum_counters(text), 12)


if __name__ == "__main__":
    unittest.main()


class SportRouting(unittest.TestCase):
    """leaf_routing "sport": each rank's source ports, its topology file and host name."""

    scn = Scenario.load(SCENARIOS / "ethereal.json")
    pol = Policy("ethereal", {"PRISM_PATH": "ecmp", "PRISM_SPLIT": "ethereal"})

    def test_each_rank_gets_its_own_port_range_its_host_name_and_the_topology(self):
        ranges = []
        for i in range(self.scn.topology.hosts):
            env = runner.rank_env(self.scn, self.pol, i, Path("o"), self.scn.workloads[0])
            base = int(env["PRISM_UDP_SPORT_BASE"])
            ranges.append(range(base, base + self.scn.topology.rails * self.scn.paths))
            self.assertEqual(env["PRISM_HOST"], f"h{i}")
            self.assertEqual(env["PRISM_TOPO"], str(Path("o") / runner.TOPO_FILE))
        ports = [p for r in ranges for p in r]
        self.assertEqual(len(ports), len(set(ports)), "two ranks share a source port")
        self.assertEqual(set(ports), set(self.scn.topology.sport_spines(self.scn.paths)))

    def test_the_hashed_fabric_gives_no_topology_and_no_fixed_ports(self):
        env = runner.rank_env(Scenario.load(SCENARIOS / "ci.json"), self.pol, 1, Path("o"))
        for k in ("PRISM_UDP_SPORT_BASE", "PRISM_TOPO", "PRISM_HOST"):
            self.assertNotIn(k, env)

    def test_entropy_e_of_every_rail_is_steered_to_spine_e_mod_spines(self):
        spec, paths = self.scn.topology, self.scn.paths
        m = spec.sport_spines(paths)
        for i in range(spec.hosts):
            for k in range(spec.rails):
                for e in (0, 1, 5, paths - 1):
                    self.assertEqual(m[spec.sport_base(i, paths) + k * paths + e], e % spec.spines)

    def test_the_topology_lists_each_hosts_leaves_in_its_interface_order(self):
        t = runner.prism_topology(self.scn.topology, "first")
        self.assertEqual((t["rails"], t["uplinks"]), (2, 4))
        self.assertEqual(t["hosts"][0], {"name": "h0", "leaves": [0, 1]})
        self.assertEqual(t["hosts"][3], {"name": "h3", "leaves": [1, 0]})
        env = runner.rank_env(self.scn, self.pol, 3, Path("o"), self.scn.workloads[0])
        self.assertEqual(env["PRISM_IFNAMES"], "h3-r1,h3-r0")
        self.assertEqual(len(t["leaves"]), 2)
        self.assertNotIn("entropy_uplink", t["leaves"][0])
