"""The acceptance checks, judged on hand-made runs."""

import unittest
from pathlib import Path

from prismfab import checks
from prismfab.scenario import Scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def run(wl, pol, fault=None, ok=True, cct=1.0, spine=(50, 50), uplinks=None, expect="complete", moment=0.05):
    uplinks = uplinks or {"0": [25, 25], "1": [25, 25]}
    from prismfab.metrics import imbalance

    return {
        "label": f"{wl}/{pol}" + (f"/{fault}" if fault else ""), "workload": {"name": wl}, "policy": {"name": pol},
        "fault": {"name": fault, "expect": expect} if fault else None, "ok": ok, "errors": [] if ok else ["rank 1 failed"],
        "cct_s": cct,
        "balance": {"spine_bytes": list(spine), "spine_imbalance": imbalance(list(spine)),
                    "leaf_uplink_bytes": uplinks,
                    "leaf_uplink_imbalance": {k: imbalance(v) for k, v in uplinks.items()},
                    "windowed_uplink": {"max": moment}},
        "flows": {"mean_imbalance": 0.0},
        "recovery": {"recovered": True, "ttr_s": 0.2, "reroute_s": 0.1} if fault else None,
    }


def good_runs():
    runs = []
    for p in ("ecmp", "spray", "pro", "reps"):
        runs.append(run("alltoall", p))
        runs.append(run("few_flows", p, moment=1.0 if p == "ecmp" else 0.05))
        runs.append(run("alltoall_f", p, cct=2.0))
    for p in ("reps", "pro", "spray"):
        runs.append(run("alltoall_f", p, fault="blackhole", cct=3.0))
    return runs


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

    def test_report_only_fault_runs_are_not_asserted(self):
        runs = good_runs() + [run("alltoall_f", "ecmp", fault="bh_ecmp", ok=False, expect="report")]
        self.assertNotIn("data.alltoall_f/ecmp/bh_ecmp", by_name(checks.evaluate(self.scn, runs)))


if __name__ == "__main__":
    unittest.main()
