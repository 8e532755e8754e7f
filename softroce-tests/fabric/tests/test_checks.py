"""The acceptance checks, judged on hand-made runs."""

import copy
import unittest
from pathlib import Path

from prismfab import checks, metrics
from prismfab.scenario import Scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def run(wl, pol, fault=None, ok=True, cct=1.0, spine=(50, 50), uplinks=None, expect="complete", moment=0.05,
        reroute_b=0.09, rtt_us=30_000, revived=None):
    uplinks = uplinks or {"0": [25, 25], "1": [25, 25]}
    from prismfab.metrics import imbalance

    heal = {"heal_at_s": 0.8, "revival": {"revived_s": revived, "share_after": 0.9, "traffic_after_heal_s": 1.5}} \
        if fault and fault.endswith("_heal") else {}
    return heal | {
        "label": f"{wl}/{pol}" + (f"/{fault}" if fault else ""), "workload": {"name": wl}, "policy": {"name": pol},
        "fault": ({"name": fault, "expect": expect} | ({"heal_after_s": 0.5} if heal else {})) if fault else None, "ok": ok, "errors": [] if ok else ["rank 1 failed"],
        "cct_s": cct,
        "balance": {"spine_bytes": list(spine), "spine_imbalance": imbalance(list(spine)),
                    "leaf_uplink_bytes": uplinks,
                    "leaf_uplink_imbalance": {k: imbalance(v) for k, v in uplinks.items()},
                    "windowed_uplink": {"max": moment}},
        "flows": {"mean_imbalance": 0.0},
        "recovery": {"recovered": True, "ttr_s": 0.2, "reroute_s": 0.1} if fault else None,
        "recovery_bytes": {"reroute_s": reroute_b, "resolution_s": 0.01, "residual_share": 0.0} if fault else None,
        "prism_stats": {"rtt_avg_us": rtt_us, "rtt_samples": 1000} if rtt_us else {},
    }


def good_runs():
    runs = []
    for p in ("ecmp", "spray", "pro", "reps", "dr"):
        runs.append(run("alltoall", p))
        runs.append(run("few_flows", p, moment=1.0 if p == "ecmp" else 0.05))
        runs.append(run("alltoall_f", p, cct=2.0))
        runs.append(run("alltoall_h", p, cct=4.0))
    for p in ("reps", "pro", "spray", "dr"):
        runs.append(run("alltoall_f", p, fault="blackhole", cct=3.0))
        runs.append(run("alltoall_h", p, fault="blackhole_heal", cct=5.0, revived=0.2))
    return runs


def with_k(scn, k):
    scn = copy.deepcopy(scn)
    scn.checks.recovery_rtts_max = k
    return scn


def by_name(cs):
    return {c.name: c for c in cs}


class Acceptance(unittest.TestCase):
    scn = Scenario.load(SCENARIOS / "ci.json")

    def test_all_good_runs_pass_every_check(self):
        cs = checks.evaluate(self.scn, good_runs())
        self.assertTrue(all(c.ok for c in cs), [c.name for c in cs if not c.ok])

    def test_a_wrong_element_on_any_run_fails_its_data_check(self):
        runs = good_runs()
        runs[0]["ok"] = False
        self.assertFalse(by_name(checks.evaluate(self.scn, runs))["data.alltoall/ecmp"].ok)

    def test_spray_eleven_percent_off_even_fails_the_balance_check(self):
        runs = [r for r in good_runs() if not (r["label"] == "alltoall/spray")] + [run("alltoall", "spray", spine=(111, 89))]
        self.assertFalse(by_name(checks.evaluate(self.scn, runs))["balance.spray"].ok)

    def test_ecmp_spreading_the_few_flows_evenly_at_every_moment_fails_the_pinned_check(self):
        runs = [r for r in good_runs() if r["label"] != "few_flows/ecmp"] + [run("few_flows", "ecmp", moment=0.05)]
        self.assertFalse(by_name(checks.evaluate(self.scn, runs))["balance.ecmp_few_flows"].ok)

    def test_black_hole_at_twice_the_fault_free_cct_fails(self):
        runs = [r for r in good_runs() if r["label"] != "alltoall_f/pro/blackhole"]
        runs.append(run("alltoall_f", "pro", fault="blackhole", cct=4.0))
        c = by_name(checks.evaluate(self.scn, runs))["fault.blackhole.pro"]
        self.assertFalse(c.ok)
        self.assertIn("x2.0", c.detail)
        self.assertIn("by packets (a probe or SACK counts as one DATA packet): bulk off the dead path after 100 ms", c.detail)

    def test_the_floor_the_fault_allows_is_reported_next_to_the_ratio(self):
        runs = [r for r in good_runs() if r["label"] != "alltoall_f/reps/blackhole"]
        r = run("alltoall_f", "reps", fault="blackhole", cct=3.0)
        r["lower_bound_fault"] = {"seconds": 3.1, "finishes": True}
        r["cct_over_fault_bound"] = 3.0 / 3.1
        runs.append(r)
        c = by_name(checks.evaluate(self.scn, runs))["fault.blackhole.reps"]
        self.assertAlmostEqual(c.data["fault_floor_ratio"], 1.55)
        self.assertIn("allows no better than x1.55", c.detail)
        self.assertEqual(metrics.fault_floor(r, None), None)
        self.assertEqual(metrics.fault_floor({"lower_bound_fault": {"seconds": None, "finishes": False}},
                                             {"cct_s": 2.0}), None)
        from prismfab.report import fault_bound_cell
        self.assertEqual(fault_bound_cell(r, {"cct_s": 2.0}), "3100.0 (x1.55; 0.97)")
        self.assertEqual(fault_bound_cell({"lower_bound_fault": {"seconds": None, "finishes": False}}, None),
                         "none: the broken fabric cannot finish it")
        self.assertEqual(fault_bound_cell(run("alltoall_f", "reps"), None), "-")

    def test_every_black_hole_policy_of_the_ci_scenario_is_checked_dr_included(self):
        names = by_name(checks.evaluate(self.scn, good_runs()))
        for p in ("reps", "pro", "spray", "dr"):
            self.assertIn(f"fault.blackhole.{p}", names)

    def test_ci_asserts_recovery_in_rtts_for_every_black_hole_policy(self):
        cs = by_name(checks.evaluate(self.scn, good_runs()))
        # Issue 12's 3 RTTs, above every measured run of the current build (docs/fabric.md).
        self.assertEqual(self.scn.checks.recovery_rtts_max, 3)
        for p in ("reps", "pro", "spray", "dr"):
            self.assertTrue(cs[f"recovery.blackhole.{p}"].ok, cs[f"recovery.blackhole.{p}"].detail)

    def test_recovery_is_reported_in_rtts_but_not_asserted_without_a_limit(self):
        cs = by_name(checks.evaluate(with_k(self.scn, None), good_runs()))
        self.assertFalse(any(n.startswith("recovery.") for n in cs))
        # 90 ms over the fault-free run's 30 ms mean RTT.
        self.assertIn("90 ms = 3.0 RTTs of 30.0 ms", cs["fault.blackhole.dr"].detail)

    def test_recovery_within_k_rtts_passes_and_beyond_fails(self):
        runs = [r for r in good_runs() if r["label"] != "alltoall_f/spray/blackhole"]
        runs.append(run("alltoall_f", "spray", fault="blackhole", cct=3.0, reroute_b=0.151))
        cs = by_name(checks.evaluate(with_k(self.scn, 5), runs))
        self.assertTrue(cs["recovery.blackhole.reps"].ok, cs["recovery.blackhole.reps"].detail)
        c = cs["recovery.blackhole.spray"]
        self.assertFalse(c.ok)
        self.assertAlmostEqual(c.data["rtts"], 0.151 / 0.030)
        self.assertIn("limit 5 RTTs", c.detail)

    def test_a_faults_own_recovery_limit_overrides_the_scenarios(self):
        runs = [r for r in good_runs() if r["label"] != "alltoall_f/spray/blackhole"]
        runs.append(run("alltoall_f", "spray", fault="blackhole", cct=3.0, reroute_b=0.151))
        scn = with_k(self.scn, 5)
        scn.faults[0].recovery_rtts_max = 6
        c = by_name(checks.evaluate(scn, runs))["recovery.blackhole.spray"]
        self.assertTrue(c.ok, c.detail)
        self.assertIn("limit 6 RTTs", c.detail)
        scn = with_k(self.scn, None)
        scn.faults[0].recovery_rtts_max = 4
        cs = by_name(checks.evaluate(scn, runs))
        self.assertFalse(cs["recovery.blackhole.spray"].ok, "the fault's limit applies without the scenario's")

    def test_the_rtt_is_the_fault_free_runs_not_the_fault_runs(self):
        # The fault run's own RTT (inflated by the loss) must not stretch the limit.
        runs = [r for r in good_runs() if r["label"] not in ("alltoall_f/pro", "alltoall_f/pro/blackhole")]
        runs += [run("alltoall_f", "pro", cct=2.0, rtt_us=10_000),
                 run("alltoall_f", "pro", fault="blackhole", cct=3.0, reroute_b=0.05, rtt_us=100_000)]
        c = by_name(checks.evaluate(with_k(self.scn, 3), runs))["recovery.blackhole.pro"]
        self.assertFalse(c.ok)
        self.assertAlmostEqual(c.data["rtts"], 5.0)

    def test_bulk_that_never_left_or_no_rtt_fails_the_recovery_check(self):
        runs = [r for r in good_runs() if r["label"] not in ("alltoall_f/reps/blackhole", "alltoall_f/dr")]
        runs += [run("alltoall_f", "reps", fault="blackhole", cct=3.0, reroute_b=None),
                 run("alltoall_f", "dr", cct=2.0, rtt_us=0)]
        cs = by_name(checks.evaluate(with_k(self.scn, 3), runs))
        self.assertFalse(cs["recovery.blackhole.reps"].ok)
        self.assertIn("never stayed off", cs["recovery.blackhole.reps"].detail)
        self.assertFalse(cs["recovery.blackhole.dr"].ok)
        self.assertIn("no RTT", cs["recovery.blackhole.dr"].detail)

    def test_a_faults_own_cct_ratio_limit_wins_over_the_scenarios(self):
        scn = copy.deepcopy(self.scn)
        scn.faults[0].cct_ratio_max = 1.3
        cs = by_name(checks.evaluate(scn, good_runs()))  # every fault run at 1.5x its baseline
        self.assertFalse(cs["fault.blackhole.pro"].ok)
        self.assertIn("limit x1.3", cs["fault.blackhole.pro"].detail)
        scn.faults[0].cct_ratio_max = None
        self.assertTrue(by_name(checks.evaluate(scn, good_runs()))["fault.blackhole.pro"].ok)

    def test_report_only_fault_runs_are_not_asserted(self):
        runs = good_runs() + [run("alltoall_f", "ecmp", fault="bh_ecmp", ok=False, expect="report")]
        self.assertNotIn("data.alltoall_f/ecmp/bh_ecmp", by_name(checks.evaluate(self.scn, runs)))


if __name__ == "__main__":
    unittest.main()


class Revival(unittest.TestCase):
    scn = Scenario.load(SCENARIOS / "ci.json")

    def test_ci_asserts_every_black_hole_policy_comes_back_to_the_healed_link_within_a_second(self):
        cs = by_name(checks.evaluate(self.scn, good_runs()))
        self.assertEqual(self.scn.checks.revive_s_max, 1.0)
        for p in ("reps", "pro", "spray", "dr"):
            c = cs[f"revival.blackhole_heal.{p}"]
            self.assertTrue(c.ok, c.detail)
            self.assertIn("half its earlier share again after 200 ms = 6.7 RTTs", c.detail)
            # The heal fault's runs get the CCT and recovery checks of any black hole as well.
            self.assertIn(f"fault.blackhole_heal.{p}", cs)
            self.assertIn(f"recovery.blackhole_heal.{p}", cs)
        self.assertFalse(any(n.startswith("revival.blackhole.") for n in cs))

    def replaced(self, **kw):
        runs = [r for r in good_runs() if r["label"] != "alltoall_h/pro/blackhole_heal"]
        return runs + [run("alltoall_h", "pro", fault="blackhole_heal", cct=5.0, **kw)]

    def test_too_late_or_never_fails_and_says_so(self):
        c = by_name(checks.evaluate(self.scn, self.replaced(revived=1.2)))["revival.blackhole_heal.pro"]
        self.assertFalse(c.ok)
        self.assertIn("limit 1000 ms", c.detail)
        c = by_name(checks.evaluate(self.scn, self.replaced(revived=None)))["revival.blackhole_heal.pro"]
        self.assertFalse(c.ok)
        self.assertIn("never carried half its earlier share again", c.detail)

    def test_wrong_data_fails_the_revival_too(self):
        c = by_name(checks.evaluate(self.scn, self.replaced(revived=0.1, ok=False)))["revival.blackhole_heal.pro"]
        self.assertFalse(c.ok)

    def test_a_fault_that_never_healed_fails(self):
        runs = self.replaced(revived=0.1)
        del runs[-1]["heal_at_s"]
        c = by_name(checks.evaluate(self.scn, runs))["revival.blackhole_heal.pro"]
        self.assertFalse(c.ok)
        self.assertIn("the fault never healed", c.detail)


class UplinkSpread(unittest.TestCase):
    scn = Scenario.load(SCENARIOS / "ethereal.json")
    even = {"0": [6_300_000, 6_310_000, 6_290_000, 6_300_000], "1": [1_300_000, 1_310_000, 1_300_000, 1_305_000]}

    def runs(self, ethereal_uplinks):
        return [run("five_flows", "ethereal", uplinks=ethereal_uplinks),
                run("five_flows", "ecmp", uplinks={"0": [9e6, 3e6, 6e6, 7e6], "1": [2e6, 1e6, 1e6, 1e6]})]

    def test_even_uplinks_pass_and_the_other_policies_are_shown(self):
        c = by_name(checks.evaluate(self.scn, self.runs(self.even)))["spread.ethereal"]
        self.assertTrue(c.ok, c.detail)
        self.assertIn("ecmp: lf0 [9.00, 3.00, 6.00, 7.00] MB = 200.0 %", c.detail)
        self.assertAlmostEqual(c.data["spread"]["0"], 6_310_000 / 6_290_000 - 1)

    def test_three_percent_on_one_leaf_fails(self):
        bad = dict(self.even, **{"1": [1_000_000, 1_030_000, 1_000_000, 1_010_000]})
        c = by_name(checks.evaluate(self.scn, self.runs(bad)))["spread.ethereal"]
        self.assertFalse(c.ok, c.detail)

    def test_an_idle_uplink_fails(self):
        c = by_name(checks.evaluate(self.scn, self.runs({"0": [4e6, 4e6, 0, 4e6], "1": [0, 0, 0, 0]})))["spread.ethereal"]
        self.assertFalse(c.ok, c.detail)

    def test_a_missing_run_fails(self):
        c = by_name(checks.evaluate(self.scn, self.runs(self.even)[1:]))["spread.ethereal"]
        self.assertFalse(c.ok)
