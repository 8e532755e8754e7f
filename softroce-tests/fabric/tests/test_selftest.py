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


if __name__ == "__main__":
    unittest.main()
