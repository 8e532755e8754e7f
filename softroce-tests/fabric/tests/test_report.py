"""The markdown table and the SVG charts the tool draws itself."""

import unittest
import xml.etree.ElementTree as ET

from prismfab import report


def run(pol, cct, fault=None, shares=(0.5, 0.5), ok=True, ttr=None):
    r = {"label": f"alltoall/{pol}", "workload": {"name": "alltoall"}, "policy": {"name": pol},
         "fault": {"name": fault} if fault else None, "ok": ok, "cct_s": cct,
         "lower_bound": {"seconds": 0.5}, "cct_over_bound": cct / 0.5,
         "balance": {"spine_imbalance": 0.02, "spine_share": list(shares), "spine_bytes": [1, 1],
                     "windowed_uplink": {"max": 0.3}},
         "flows": {"mean_imbalance": 0.05}, "qdisc_drops_total": 3, "backlog_peak": {"max_bytes": 4096},
         "prism_stats": {"retransmissions": 12},
         "timeline": {"t": [0.05, 0.1, 0.15], "step_s": 0.05, "links": {"lf0-sp0": [10, 20, 30], "lf0-sp1": [30, 20, 0]},
                      "fault_t": 0.1, "fault_link": "lf0-sp1"}}
    if fault:
        r["recovery"] = {"recovered": ttr is not None, "ttr_s": ttr, "reroute_s": 0.02 if ttr is not None else None}
    return r


class Table(unittest.TestCase):
    def test_every_row_has_every_column(self):
        runs = [run("spray", 1.0), run("spray", 1.5, fault="blackhole", ttr=0.05)]
        lines = report.markdown_table(runs).splitlines()
        ncol = len(report.COLUMNS)
        for line in lines:
            self.assertEqual(line.count("|"), ncol + 1, line)

    def test_fault_row_shows_ratio_to_its_fault_free_run_and_recovery(self):
        runs = [run("spray", 1.0), run("spray", 1.5, fault="blackhole", ttr=0.05)]
        row = report.run_row(runs[1], report.baseline_of(runs[1], runs))
        self.assertEqual(row["vs_no_fault"], "1.50")
        self.assertEqual(row["ttr_ms"], "20.0 / 50.0")

    def test_link_split_shows_bytes_and_idle_parts_of_cct_over_bound(self):
        r = run("spray", 0.55)
        self.assertEqual(report.run_row(r, None)["link_split"], "-", "runs from before link_time")
        r.update({"link_time": {"busiest": {"link": "lf0-sp1 up", "seconds": 0.525}},
                  "link_time_over_bound": 1.05, "cct_over_link_time": 0.55 / 0.525})
        self.assertEqual(report.run_row(r, None)["link_split"], "1.05 x 1.05 (lf0-sp1 up)")

    def test_never_drained_says_so(self):
        runs = [run("spray", 1.0), run("spray", 1.5, fault="blackhole", ttr=None)]
        self.assertEqual(report.run_row(runs[1], runs[0])["ttr_ms"], "never / never")


class Charts(unittest.TestCase):
    def test_summary_chart_is_well_formed_svg_with_a_bar_per_run(self):
        runs = [run("ecmp", 2.0, shares=(1.0, 0.0)), run("spray", 1.0), run("spray", 1.4, fault="blackhole", ttr=0.1)]
        svg = report.chart(runs, "alltoall", "t")
        root = ET.fromstring(svg)
        titles = [e.text for e in root.iter("{http://www.w3.org/2000/svg}title")]
        self.assertTrue(any(t.startswith("alltoall ecmp") for t in titles), titles)
        self.assertTrue(any(t.startswith("blackhole spray") for t in titles), titles)

    def test_timeline_chart_is_well_formed_svg_with_a_line_per_link_and_the_broken_one_marked(self):
        svg = report.timeline_chart(run("spray", 1.4, fault="blackhole", ttr=0.1))
        root = ET.fromstring(svg)
        self.assertEqual(len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))), 2)
        self.assertIn("lf0-sp1 (broken)", svg)
        self.assertNotIn("healed", svg)

    def test_a_healed_fault_is_marked_on_the_timeline_and_in_the_table(self):
        r = run("spray", 1.4, fault="blackhole_heal", ttr=0.1)
        r["fault"]["heal_after_s"] = 0.05
        r.update(heal_at_s=0.15, revival={"revived_s": 0.012, "share_after": 0.97, "traffic_after_heal_s": 1.0})
        svg = report.timeline_chart(r)
        ET.fromstring(svg)
        self.assertIn(">healed<", svg)
        row = report.run_row(r, run("spray", 1.0))
        self.assertIn("healed at 0.15 s; the link carried half its earlier share again after 12 ms", row["ttr_ms"])
        self.assertIn("97 % of its earlier share", row["ttr_ms"])


if __name__ == "__main__":
    unittest.main()
