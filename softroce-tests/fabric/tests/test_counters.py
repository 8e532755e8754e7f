"""Parsers of /proc/net/dev, /proc/net/netstat and tc's JSON; the sampler process."""

import os
import subprocess
import time
import unittest

from prismfab.counters import Sampler, delta, parse_netdev, parse_netstat, parse_tc_json

NETDEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0          0
lf0-sp1: 1234567    890    0    2    0     0          0         0  7654321    1098    0    3    0     0       0          0
"""

NETSTAT = """TcpExt: SyncookiesSent SyncookiesRecv
TcpExt: 0 0
IpExt: InNoRoutes InTruncatedPkts
IpExt: 42 0
"""


class Parsers(unittest.TestCase):
    def test_netdev_columns_land_in_the_right_fields(self):
        d = parse_netdev(NETDEV)["lf0-sp1"]
        self.assertEqual((d["rx_bytes"], d["rx_packets"], d["rx_drop"]), (1234567, 890, 2))
        self.assertEqual((d["tx_bytes"], d["tx_packets"], d["tx_drop"]), (7654321, 1098, 3))

    def test_netstat_no_routes_is_read_from_ipext(self):
        self.assertEqual(parse_netstat(NETSTAT)["IpExt"]["InNoRoutes"], 42)

    def test_tc_json_without_dev_takes_the_named_device(self):
        text = ('[{"kind":"htb","handle":"5:","root":true,"bytes":132,"packets":2,"drops":0,"overlimits":0,'
                '"requeues":0,"backlog":0,"qlen":0},{"kind":"pfifo","handle":"10:","parent":"5:1","bytes":42,'
                '"packets":1,"drops":7,"overlimits":0,"requeues":0,"backlog":9000,"qlen":1}]')
        rows = parse_tc_json(text, "lf0-sp0")
        self.assertEqual([r["dev"] for r in rows], ["lf0-sp0", "lf0-sp0"])
        self.assertEqual((rows[1]["drops"], rows[1]["backlog"], rows[1]["qlen"]), (7, 9000, 1))

    def test_delta_subtracts_per_node_interface_and_counter(self):
        a = {"lf0": {"x": {"tx_bytes": 10}}}
        b = {"lf0": {"x": {"tx_bytes": 25}, "y": {"tx_bytes": 3}}}
        self.assertEqual(delta(a, b), {"lf0": {"x": {"tx_bytes": 15}, "y": {"tx_bytes": 3}}})


class SamplerProcess(unittest.TestCase):
    def test_the_child_samples_on_time_and_is_gone_after_stop(self):
        # This process's own namespace stands in for a node: /proc/<pid>/net/dev is readable anywhere.
        sp = Sampler({"me": os.getpid()}, 0.01).start()
        child = sp._proc.pid
        time.sleep(0.3)
        series = sp.stop()
        self.assertIsNone(sp.error)
        self.assertIsNotNone(sp.priority)
        self.assertGreaterEqual(len(series.t), 10)
        self.assertEqual(len(series.t), len(series.netdev))
        self.assertEqual(len(series.t), len(series.no_routes))
        self.assertEqual(series.t, sorted(series.t))
        self.assertIn("lo", series.netdev[-1]["me"])
        g = sp.gaps(since=series.t[1])
        self.assertEqual(g["interval_ms"], 10.0)
        self.assertLess(g["median_ms"], 50)
        self.assertEqual((g["exit"], g["error"]), (0, None))
        self.assertIsNotNone(sp._proc.returncode)
        self.assertFalse(os.path.exists(f"/proc/{child}/status"), "the sampler process outlived stop()")

    def test_a_node_that_goes_away_ends_sampling_with_an_error_not_a_hang(self):
        node = subprocess.Popen(["sleep", "30"])
        sp = Sampler({"node": node.pid}, 0.01).start()
        node.kill()
        node.wait()  # reaped: its /proc entry is gone
        deadline = time.monotonic() + 10
        while sp.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        sp.stop()
        self.assertIn("No such file", sp.error or "")
        self.assertIsNotNone(sp._proc.returncode)


if __name__ == "__main__":
    unittest.main()
