import unittest

from prismfab import selftest
from prismfab.selftest import Check


class Timed(unittest.TestCase):
    def test_a_timing_check_is_retried_until_it_passes(self):
        results = iter([False, False, True])
        c = selftest.timed(lambda: Check("x", next(results), "d", {"v": 1}))
        self.assertTrue(c.ok)
        self.assertEqual([a["ok"] for a in c.data["attempts"]], [False, False, True])
        self.assertIn("attempt 3 of at most 3", c.detail)

    def test_a_check_that_always_fails_fails_after_every_attempt(self):
        calls = []
        c = selftest.timed(lambda: calls.append(1) or Check("x", False, "d"), attempts=3)
        self.assertFalse(c.ok)
        self.assertEqual(len(calls), 3)
        self.assertIn("every one failed", c.detail)

    def test_a_passing_check_runs_once(self):
        calls = []
        c = selftest.timed(lambda: calls.append(1) or Check("x", True, "d"))
        self.assertTrue(c.ok)
        self.assertEqual(len(calls), 1)
        self.assertEqual(c.detail, "d")


class HtbBucketsTest(unittest.TestCase):
    def test_reads_rate_and_both_buckets_of_an_htb_class(self):
        text = "class htb 5:1 root leaf 10: prio 0 rate 200Mbit ceil 200Mbit burst 50000b cburst 50000b \n"
        self.assertEqual(selftest.htb_buckets(text), (200.0, 50000, 50000))
        text = "class htb 5:1 root prio 0 rate 25Mbit ceil 25Mbit burst 15000b cburst 1600b"
        self.assertEqual(selftest.htb_buckets(text), (25.0, 15000, 1600))
        text = "class htb 5:1 root prio 0 rate 500Kbit ceil 500Kbit burst 15Kb cburst 1600b"
        self.assertEqual(selftest.htb_buckets(text), (0.5, 15360, 1600))
        self.assertIsNone(selftest.htb_buckets(""))

    def test_buckets_cover_two_milliseconds_and_never_fall_under_tclinks_15_kb(self):
        from prismfab.topo import htb_burst_bytes
        self.assertEqual(htb_burst_bytes(200), 50000)
        self.assertEqual(htb_burst_bytes(100), 25000)
        self.assertEqual(htb_burst_bytes(25), 15000)

    def test_tclinks_own_class_fails_the_check_and_the_set_buckets_pass(self):
        # What `tc -d class show` printed for TCLink's class at 200 Mbit/s: rate bucket 15 KB, ceil 1,600.
        self.assertFalse(selftest.buckets_ok((200.0, 15325, 1600), 9000))
        self.assertFalse(selftest.buckets_ok((200.0, 15000, 15000), 9000))  # under 2 ms at 200 Mbit/s
        self.assertTrue(selftest.buckets_ok((200.0, 50000, 50000), 9000))
        self.assertTrue(selftest.buckets_ok((25.0, 15000, 15000), 9000))
        self.assertFalse(selftest.buckets_ok((25.0, 15000, 15000), 16000))  # a frame does not fit
        self.assertFalse(selftest.buckets_ok(None, 9000))


if __name__ == "__main__":
    unittest.main()
