"""Balance, lower bound, recovery time and stats summing, on hand-made counters."""

import json
import unittest

from prismfab import metrics
from prismfab.scenario import TopologySpec


class Imbalance(unittest.TestCase):
    def test_even_split_is_zero(self):
        self.assertEqual(metrics.imbalance([5, 5, 5, 5]), 0.0)

    def test_one_of_two_spines_idle_is_one(self):
        self.assertEqual(metrics.imbalance([10, 0]), 1.0)

    def test_55_45_split_is_ten_percent(self):
        self.assertAlmostEqual(metrics.imbalance([55, 45]), 0.10)

    def test_nothing_to_balance_is_none(self):
        self.assertIsNone(metrics.imbalance([0, 0]))


def links(spec, up, down):
    return [{"leaf": r, "spine": s, "up_bytes": up[r][s], "down_bytes": down[r][s]}
            for r in range(spec.rails) for s in range(spec.spines)]


class SpineBalance(unittest.TestCase):
    spec = TopologySpec(hosts=4, rails=2, spines=2)

    def test_spine_bytes_sum_both_directions_of_every_leaf(self):
        up = [[4 << 20, 4 << 20], [3 << 20, 5 << 20]]
        down = [[1 << 20, 1 << 20], [0, 0]]
        b = metrics.spine_balance(self.spec, links(self.spec, up, down))
        self.assertEqual(b["spine_bytes"], [8 << 20, 10 << 20])
        self.assertAlmostEqual(b["spine_imbalance"], 1 / 9)
        self.assertEqual(b["leaf_uplink_imbalance"]["0"], 0.0)
        self.assertAlmostEqual(b["leaf_uplink_imbalance"]["1"], 0.25)

    def test_a_few_stray_bytes_are_not_judged(self):
        b = metrics.spine_balance(self.spec, links(self.spec, [[100, 0], [0, 0]], [[0, 0], [0, 0]]))
        self.assertIsNone(b["spine_imbalance"])
        self.assertIsNone(b["leaf_uplink_spread"]["0"])

    def test_the_uplink_spread_is_max_over_min_minus_one(self):
        b = metrics.spine_balance(self.spec, links(self.spec, [[4 << 20, 4 << 20], [4 << 20, 5 << 20]], [[0, 0], [0, 0]]))
        self.assertEqual(b["leaf_uplink_spread"]["0"], 0.0)
        self.assertAlmostEqual(b["leaf_uplink_spread"]["1"], 0.25)


class Spread(unittest.TestCase):
    def test_equal_is_zero_and_an_idle_uplink_has_no_finite_spread(self):
        self.assertEqual(metrics.spread([5, 5, 5, 5]), 0.0)
        self.assertAlmostEqual(metrics.spread([100, 101, 102, 100]), 0.02)
        self.assertIsNone(metrics.spread([3, 0, 3, 3]))
        self.assertIsNone(metrics.spread([]))


class FlowBalance(unittest.TestCase):
    spec = TopologySpec(hosts=4, rails=2, spines=2)
    addr = {"10.100.0.2": 0, "10.101.1.2": 1}

    def test_a_flow_pinned_to_one_spine_has_imbalance_one(self):
        flows = {0: {("10.100.0.2", "10.101.1.2"): 4 << 20}, 1: {}}
        fb = metrics.flow_balance(self.spec, flows, self.addr)
        self.assertEqual(fb["mean_imbalance"], 1.0)
        self.assertEqual(fb["pairs_counted"], 1)

    def test_a_sprayed_flow_split_evenly_has_imbalance_zero(self):
        flows = {0: {("10.100.0.2", "10.101.1.2"): 2 << 20}, 1: {("10.100.0.2", "10.101.1.2"): 2 << 20}}
        self.assertEqual(metrics.flow_balance(self.spec, flows, self.addr)["mean_imbalance"], 0.0)

    def test_small_pairs_such_as_acks_do_not_count(self):
        flows = {0: {("10.101.1.2", "10.100.0.2"): 1000}, 1: {}}
        fb = metrics.flow_balance(self.spec, flows, self.addr)
        self.assertIsNone(fb["mean_imbalance"])
        self.assertEqual(fb["pairs_counted"], 0)


class MomentImbalance(unittest.TestCase):
    spec = TopologySpec(hosts=4, rails=2, spines=2)

    def samples(self, per_window):
        """Cumulative uplink counters of leaf 0, one sample per 100 ms, from per-window byte pairs."""
        t, nd, a, b = [0.0], [{"lf0": {"lf0-sp0": {"tx_bytes": 0}, "lf0-sp1": {"tx_bytes": 0}}}], 0, 0
        for k, (x, y) in enumerate(per_window, 1):
            a, b = a + x, b + y
            t.append(0.1 * k)
            nd.append({"lf0": {"lf0-sp0": {"tx_bytes": a}, "lf0-sp1": {"tx_bytes": b}}})
        return t, nd

    def test_whole_messages_alternating_between_spines_are_uneven_at_every_moment(self):
        # Over the run the two spines got the same bytes; at every moment one of them got everything.
        t, nd = self.samples([(1 << 20, 0), (0, 1 << 20)] * 5)
        w = metrics.windowed_uplink_imbalance(self.spec, t, nd)
        self.assertAlmostEqual(w["per_leaf"]["0"], 1.0)

    def test_sprayed_bytes_are_even_at_every_moment(self):
        t, nd = self.samples([(1 << 19, 1 << 19)] * 10)
        self.assertEqual(metrics.windowed_uplink_imbalance(self.spec, t, nd)["per_leaf"]["0"], 0.0)

    def test_idle_windows_do_not_count(self):
        t, nd = self.samples([(1 << 19, 1 << 19)] * 10 + [(100, 0)] * 10)
        self.assertEqual(metrics.windowed_uplink_imbalance(self.spec, t, nd)["per_leaf"]["0"], 0.0)


class TrafficAndBound(unittest.TestCase):
    def test_alltoall_sends_one_block_to_every_peer(self):
        m = metrics.traffic_matrix("alltoall", 4, 8 << 20)
        self.assertEqual(len(m), 12)
        self.assertEqual(set(m.values()), {2 << 20})

    def test_sparse_alltoall_matches_prism_perfs_pattern(self):
        # The same matrix as prism-perf's unit test `sparse_alltoall_is_sparse_and_skewed` (840 elements a block).
        want = [[840, 840, 420, 0], [840, 840, 0, 420], [840, 420, 840, 0], [0, 840, 420, 840]]
        self.assertEqual([[metrics.sparse_len(s, d, 4, 840) for d in range(4)] for s in range(4)], want)
        m = metrics.traffic_matrix("alltoall_sparse", 4, 4 * 4 * 840)
        self.assertEqual(m, {(s, d): 4.0 * want[s][d] for s in range(4) for d in range(4) if s != d and want[s][d]})

    def test_ring_all_reduce_sends_2_n_minus_1_over_n_to_the_next_rank(self):
        m = metrics.traffic_matrix("all_reduce", 4, 8 << 20)
        self.assertEqual(m, {(0, 1): 12 << 20, (1, 2): 12 << 20, (2, 3): 12 << 20, (3, 0): 12 << 20})

    def test_bound_of_ci_alltoall_on_one_rail_is_the_host_link(self):
        # 4 ranks on rails 0,1,0,1, one rail each: a rank sends 3/4 of 8 MiB through one 100 Mbit/s NIC
        # (0.50 s); each leaf sends 8 MiB up over 2 x 100 Mbit/s (0.34 s), which is faster.
        spec = TopologySpec(hosts=4, rails=2, spines=2, host_bw_mbit=100, spine_bw_mbit=100)
        lb = metrics.lower_bound_s(spec, "alltoall", 8 << 20, rails_used=1)
        self.assertEqual(lb["bottleneck"], "host_send")
        self.assertAlmostEqual(lb["seconds"], 0.75 * (8 << 20) / 12.5e6)
        self.assertEqual(lb["cross_spine_bytes"], 2 * (8 << 20))

    def test_bound_of_ci_alltoall_on_both_rails_is_the_spines(self):
        # Both NICs halve the host term; every cross pair crosses the spines on both rails (the rail orders
        # differ at each index), so each leaf sends 8 MiB up over 2 x 100 Mbit/s.
        spec = TopologySpec(hosts=4, rails=2, spines=2, host_bw_mbit=100, spine_bw_mbit=100)
        lb = metrics.lower_bound_s(spec, "alltoall", 8 << 20)
        self.assertEqual(lb["bottleneck"], "spine_up")
        self.assertAlmostEqual(lb["seconds"], (8 << 20) / 25e6)
        self.assertAlmostEqual(lb["terms_s"]["host_send"], 0.375 * (8 << 20) / 12.5e6)

    def test_ring_on_half_placed_ranks_crosses_the_spines_at_the_two_seams_only(self):
        spec = TopologySpec(hosts=4, rails=2, spines=2)
        lb = metrics.lower_bound_s(spec, "sendrecv", 8 << 20, rank_rail="half", rails_used=1)
        self.assertEqual(lb["cross_spine_bytes"], 2 * (8 << 20))

    def test_bound_moves_to_the_spines_when_they_are_oversubscribed(self):
        spec = TopologySpec(hosts=8, rails=2, spines=4, host_bw_mbit=200, spine_bw_mbit=100)
        lb = metrics.lower_bound_s(spec, "alltoall", 16 << 20)
        self.assertIn(lb["bottleneck"], ("spine_up", "spine_down"))

    def test_aligned_ranks_put_nothing_on_the_spines(self):
        spec = TopologySpec(hosts=4, rails=2, spines=2, rank_rail="aligned")
        self.assertEqual(metrics.lower_bound_s(spec, "alltoall", 8 << 20)["cross_spine_bytes"], 0)

    def test_a_fault_that_never_comes_leaves_the_bound_as_it_was(self):
        spec = TopologySpec(hosts=4, rails=2, spines=2, host_bw_mbit=100, spine_bw_mbit=100)
        free = metrics.lower_bound_s(spec, "alltoall", 16 << 20)
        fb = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, [])
        self.assertAlmostEqual(fb["seconds"], free["seconds"])
        self.assertAlmostEqual(fb["over_fault_free_bound"], 1.0)
        late = [{"kind": "blackhole", "leaf": 0, "spine": 0, "at_s": 10.0}]
        self.assertAlmostEqual(metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, late)["seconds"], free["seconds"])

    def test_ci_black_hole_leaves_leaf_0_half_its_uplinks_for_the_rest_of_the_transfer(self):
        # ci.json's fault: 16 MiB alltoall, each leaf sends 16 MiB up over 2 x 12.5 MB/s (0.671 s); the
        # leaf 0 - spine 0 link dies 0.3 s in, when 7.5 MB are up: the other 9.27 MB need 0.742 s on one
        # spine. 1.042 s = 1.55 x the fault-free bound, whatever any policy does.
        spec = TopologySpec(hosts=4, rails=2, spines=2, host_bw_mbit=100, spine_bw_mbit=100)
        parts = [{"kind": "blackhole", "leaf": 0, "spine": 0, "at_s": 0.3}]
        fb = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, parts)
        self.assertIn(fb["bottleneck"], ("spine_up", "spine_down"))
        self.assertAlmostEqual(fb["seconds"], 0.3 + ((16 << 20) - 0.3 * 25e6) / 12.5e6)
        self.assertAlmostEqual(fb["over_fault_free_bound"], fb["seconds"] / ((16 << 20) / 25e6))
        self.assertGreater(fb["over_fault_free_bound"], 1.5)

    def test_link_down_and_slow_spine_and_loss_take_what_they_take(self):
        spec = TopologySpec(hosts=4, rails=2, spines=4, host_bw_mbit=100, spine_bw_mbit=100)
        free = metrics.lower_bound_s(spec, "alltoall", 16 << 20)
        w = free["cross_spine_bytes"] / 2  # what each leaf sends up (and receives down)
        self.assertEqual(w, 16 << 20)
        self.assertEqual(free["bottleneck"], "host_send")  # 4 spines: the NICs are the bottleneck
        down = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20,
                                           [{"kind": "link_down", "leaf": 1, "spine": 3, "at_s": 0.0}])
        self.assertAlmostEqual(down["terms_s"]["spine_up"], w / 37.5e6)
        slow = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20,
                                           [{"kind": "slow_spine", "spine": 2, "bw_mbit": 25, "at_s": 0.0}])
        self.assertAlmostEqual(slow["terms_s"]["spine_up"], w / ((3 * 100 + 25) * 1e6 / 8))
        lossy = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20,
                                            [{"kind": "loss", "spine": 1, "loss_pct": 10.0, "at_s": 0.0}])
        self.assertAlmostEqual(lossy["terms_s"]["spine_up"], w / ((3 * 100 + 90) * 1e6 / 8))
        self.assertAlmostEqual(lossy["terms_s"]["host_send"], free["terms_s"]["host_send"])

    def test_a_leaf_cut_off_from_every_spine_never_finishes(self):
        spec = TopologySpec(hosts=4, rails=2, spines=2)
        parts = [{"kind": "blackhole", "leaf": 0, "spine": s, "at_s": 0.01} for s in range(2)]
        fb = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, parts)
        self.assertEqual((fb["seconds"], fb["finishes"], fb["over_fault_free_bound"]), (None, False, None))
        self.assertIsNone(fb["terms_s"]["spine_up"])
        json.dumps(fb, allow_nan=False)  # what run.json can hold

    def test_combined_parts_apply_each_from_its_own_time(self):
        # spines3.json's shape: 1 % loss on spine 1 from 0.1 s, a black hole on leaf 0 - spine 2 from 0.4 s.
        spec = TopologySpec(hosts=4, rails=2, spines=3, host_bw_mbit=100, spine_bw_mbit=100)
        parts = [{"kind": "blackhole", "leaf": 0, "spine": 2, "at_s": 0.4},
                 {"kind": "loss", "spine": 1, "loss_pct": 1.0, "at_s": 0.1}]
        fb = metrics.fault_lower_bound_s(spec, "alltoall", 32 << 20, parts)
        w = metrics.lower_bound_s(spec, "alltoall", 32 << 20)["cross_spine_bytes"] / 2
        c0, c1, c2 = 3 * 12.5e6, (2 + 0.99) * 12.5e6, (1 + 0.99) * 12.5e6
        done = 0.1 * c0 + 0.3 * c1
        self.assertAlmostEqual(fb["terms_s"]["spine_up"], 0.4 + (w - done) / c2)
        self.assertEqual([p["kind"] for p in fb["parts"]], ["loss", "blackhole"])

    def test_a_healed_link_counts_again_from_the_heal(self):
        # ci.json's black hole healed 0.2 s later: 25 MB/s until 0.3 s, 12.5 until 0.5 s, 25 again.
        spec = TopologySpec(hosts=4, rails=2, spines=2, host_bw_mbit=100, spine_bw_mbit=100)
        parts = [{"kind": "blackhole", "leaf": 0, "spine": 0, "at_s": 0.3},
                 {"kind": "heal", "leaf": 0, "spine": 0, "at_s": 0.5}]
        fb = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, parts)
        self.assertAlmostEqual(fb["seconds"], 0.5 + ((16 << 20) - 0.3 * 25e6 - 0.2 * 12.5e6) / 25e6)
        # A heal of another link gives nothing back.
        other = parts[:1] + [{"kind": "heal", "leaf": 1, "spine": 0, "at_s": 0.5}]
        self.assertAlmostEqual(metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, other)["seconds"],
                               metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, parts[:1])["seconds"])

    def test_a_dead_nic_leaves_its_host_the_other_nics_from_its_time_on(self):
        # 4 hosts x 2 rails x 4 spines at 100 Mbit/s: the NICs are the bottleneck (each host sends three
        # 4 MiB blocks, 12 MiB over two NICs). Host 1's rail-0 NIC dies 0.2 s in: its 12 MiB pass at
        # 25 MB/s until then and 12.5 MB/s after; the other hosts keep the fault-free bound.
        spec = TopologySpec(hosts=4, rails=2, spines=4, host_bw_mbit=100, spine_bw_mbit=100)
        free = metrics.lower_bound_s(spec, "alltoall", 16 << 20)
        self.assertEqual(free["bottleneck"], "host_send")
        total = 3 * (4 << 20)
        self.assertAlmostEqual(free["terms_s"]["host_send"], total / 25e6)
        parts = [{"kind": "nic_blackhole", "host": 1, "leaf": 0, "at_s": 0.2}]
        fb = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, parts)
        self.assertAlmostEqual(fb["terms_s"]["host_send"], 0.2 + (total - 0.2 * 25e6) / 12.5e6)
        self.assertAlmostEqual(fb["terms_s"]["host_recv"], fb["terms_s"]["host_send"])
        self.assertAlmostEqual(fb["terms_s"]["spine_up"], free["terms_s"]["spine_up"], msg="no spine lost anything")
        self.assertEqual(fb["parts"][0]["host"], 1)
        # Healed 0.1 s later: both NICs again from then on; a spine link's heal gives the NIC nothing.
        healed = parts + [{"kind": "heal", "of": "nic_blackhole", "host": 1, "leaf": 0, "at_s": 0.3}]
        hb = metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, healed)
        self.assertAlmostEqual(hb["terms_s"]["host_send"], 0.3 + (total - 0.2 * 25e6 - 0.1 * 12.5e6) / 25e6)
        other = parts + [{"kind": "heal", "of": "blackhole", "host": 1, "leaf": 0, "spine": 0, "at_s": 0.3}]
        self.assertAlmostEqual(metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, other)["terms_s"]["host_send"],
                               fb["terms_s"]["host_send"])
        # A NIC heal does not revive a black-holed spine link of the same leaf.
        both = [{"kind": "blackhole", "leaf": 0, "spine": 0, "at_s": 0.2},
                {"kind": "heal", "of": "nic_blackhole", "host": 0, "leaf": 0, "spine": 0, "at_s": 0.3}]
        self.assertAlmostEqual(metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, both)["terms_s"]["spine_up"],
                               metrics.fault_lower_bound_s(spec, "alltoall", 16 << 20, both[:1])["terms_s"]["spine_up"])

    def test_nic_counters_sum_both_ends_of_every_host_link(self):
        spec = TopologySpec(hosts=2, rails=2, spines=1)
        nd = {"h0": {"h0-r0": {"tx_packets": 1, "tx_bytes": 10}, "h0-r1": {"tx_packets": 2, "tx_bytes": 20}},
              "h1": {"h1-r0": {"tx_packets": 4, "tx_bytes": 40}},
              "lf0": {"lf0-h1": {"tx_packets": 8, "tx_bytes": 80}, "lf0-sp0": {"tx_packets": 100, "tx_bytes": 1000}}}
        self.assertEqual(metrics.nic_packets(spec, nd), 15)
        self.assertEqual(metrics.nic_bytes_total(spec, nd), 150)


def series(rate_dead, rate_other, n=200, dt=0.01):
    """Cumulative counts from per-sample increments given as functions of time."""
    t, dead, total, d, o = [], [], [], 0, 0
    for k in range(n):
        tk = k * dt
        if k:
            d += rate_dead(tk)
            o += rate_other(tk)
        t.append(tk)
        dead.append(d)
        total.append(d + o)
    return t, dead, total


class LinkTime(unittest.TestCase):
    def test_busiest_link_per_pass_at_its_rate(self):
        spec = TopologySpec(hosts=2, rails=1, spines=2, host_bw_mbit=200, spine_bw_mbit=100)
        rails = [{"host": 0, "rail": 0, "tx_bytes": 4 * 25_000_000, "rx_bytes": 0},
                 {"host": 1, "rail": 0, "tx_bytes": 0, "rx_bytes": 4 * 20_000_000}]
        links = [{"leaf": 0, "spine": 0, "up_bytes": 4 * 15_000_000, "down_bytes": 0},
                 {"leaf": 0, "spine": 1, "up_bytes": 4 * 10_000_000, "down_bytes": 4 * 1_000_000}]
        lt = metrics.link_time(spec, rails, links, 4)
        # 25 MB per pass at 25 MB/s (200 Mbit/s) against 15 MB at 12.5 MB/s: the spine link is busier.
        self.assertEqual(lt["busiest"]["kind"], "spine_up")
        self.assertAlmostEqual(lt["busiest"]["seconds"], 1.2)
        self.assertAlmostEqual(lt["by_kind"]["host_send"]["seconds"], 1.0)
        self.assertAlmostEqual(lt["by_kind"]["host_recv"]["seconds"], 0.8)
        self.assertAlmostEqual(lt["by_kind"]["spine_down"]["bytes_per_pass"], 1_000_000)
        self.assertEqual(lt["passes"], 4)

    def test_no_traffic_and_zero_passes(self):
        spec = TopologySpec(hosts=1, rails=1, spines=1, host_bw_mbit=100, spine_bw_mbit=100)
        lt = metrics.link_time(spec, [{"host": 0, "rail": 0, "tx_bytes": 0, "rx_bytes": 0}], [], 0)
        self.assertEqual(lt["passes"], 1)
        self.assertEqual(lt["busiest"]["seconds"], 0.0)


class Recovery(unittest.TestCase):
    def test_policy_that_leaves_the_dead_path_recovers_after_the_time_it_took(self):
        # 10 packets per 10 ms into the dead path until 0.8 s; fault at 0.5 s; the rest runs to 1.99 s.
        t, dead, total = series(lambda x: 10 if x <= 0.8 else 0, lambda x: 10)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertTrue(r["recovered"])
        self.assertAlmostEqual(r["ttr_s"], 0.3, delta=0.011)
        self.assertAlmostEqual(r["reroute_s"], 0.3, delta=0.011)
        self.assertEqual(r["dead_path_packets"], 300)

    def test_policy_that_keeps_using_the_dead_path_until_the_end_never_recovers(self):
        t, dead, total = series(lambda x: 5, lambda x: 10)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertFalse(r["recovered"])
        self.assertIsNone(r["ttr_s"])
        self.assertIsNone(r["reroute_s"])

    def test_dead_path_draining_only_because_everything_stopped_is_no_reroute(self):
        t, dead, total = series(lambda x: 5 if x <= 1.5 else 0, lambda x: 10 if x <= 1.5 else 0)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertIsNone(r["reroute_s"])
        self.assertFalse(r["recovered"])

    def test_probes_into_the_dead_path_do_not_hide_the_reroute(self):
        # The bulk leaves at 0.8 s; afterwards one probe every 0.5 s.
        t, dead, total = series(lambda x: 10 if x <= 0.8 else (1 if round(x * 100) % 50 == 0 else 0), lambda x: 10)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertAlmostEqual(r["reroute_s"], 0.3, delta=0.011)
        self.assertGreater(r["last_dead_packet_s"], 0.9)

    def test_a_late_burst_into_the_dead_path_delays_the_reroute_but_not_the_first_departure(self):
        # The bulk leaves 0.2 s after the fault at 0.5 s; at 1.5 s a 50 ms burst at the full rate comes back.
        t, dead, total = series(lambda x: 10 if x <= 0.7 or 1.5 < x <= 1.55 else 0, lambda x: 10)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertAlmostEqual(r["reroute_s"], 1.05, delta=0.011)  # stays off only after the burst
        self.assertAlmostEqual(r["first_off_s"], 0.2, delta=0.011)
        # Without the burst both say 0.2 s.
        t, dead, total = series(lambda x: 10 if x <= 0.7 else 0, lambda x: 10)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertAlmostEqual(r["first_off_s"], r["reroute_s"], delta=1e-9)

    def test_a_dip_shorter_than_the_hold_time_is_not_a_departure(self):
        # The dead path falls quiet for 0.1 s only (0.6 to 0.7 s), then is used again until 1.0 s.
        t, dead, total = series(lambda x: 0 if 0.6 < x <= 0.7 or x > 1.0 else 10, lambda x: 10)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertAlmostEqual(r["first_off_s"], 0.5, delta=0.011)

    def test_idle_gap_between_iterations_is_not_judged(self):
        # Traffic pauses from 1.0 to 1.3 s; the dead path was left at 0.7 s.
        busy = lambda x: not (1.0 < x <= 1.3)  # noqa: E731
        t, dead, total = series(lambda x: 10 if x <= 0.7 else 0, lambda x: 10 if busy(x) else 0)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertAlmostEqual(r["reroute_s"], 0.2, delta=0.011)

    def test_residual_share_is_the_late_dead_rate_over_the_early_one(self):
        # 10 per sample before the fault at 0.5 s, 2 per sample after: a policy that cut the dead path to 20 %.
        t, dead, total = series(lambda x: 10 if x <= 0.5 else 2, lambda x: 10)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertAlmostEqual(r["residual_share"], 0.2, delta=0.01)
        self.assertIsNone(r["reroute_s"])

    def test_a_path_idle_before_the_fault_has_no_reroute_time(self):
        t, dead, total = series(lambda x: 0, lambda x: 10)
        r = metrics.recovery(t, dead, total, 0.5, 0.01)
        self.assertIsNone(r["reroute_s"])
        self.assertEqual(r["ttr_s"], 0.0)


    def test_with_a_heal_only_the_time_before_it_is_judged(self):
        # Left 0.2 s after the fault at 0.5 s; the fault heals at 1.2 s and the path is used again.
        t, dead, total = series(lambda x: 10 if x <= 0.7 or x > 1.25 else 0, lambda x: 10)
        self.assertIsNone(metrics.recovery(t, dead, total, 0.5, 0.01)["reroute_s"])
        r = metrics.recovery(t, dead, total, 0.5, 0.01, until=1.2)
        self.assertAlmostEqual(r["reroute_s"], 0.2, delta=0.011)
        self.assertTrue(r["recovered"])


class Revival(unittest.TestCase):
    # Before the fault (0.5 s) the link carries 10 of every 40 bytes (a quarter); the fault heals at 1.0 s.
    def test_the_link_back_at_its_share_after_the_time_it_took(self):
        t, link, total = series(lambda x: 10 if x <= 0.5 or x > 1.15 else 0, lambda x: 30)
        r = metrics.revival(t, link, total, 0.5, 1.0, 0.01)
        self.assertAlmostEqual(r["share_before"], 0.25)
        # The first 100 ms window with at least half the earlier share (a window is a tenth of a second:
        # 5 of its 10 samples on the link) starts about 50 ms before the link is fully back, i.e. about
        # 0.10 s after the heal (to a sample or two: 10 ms sampling).
        self.assertAlmostEqual(r["revived_s"], 0.10, delta=0.025)
        self.assertAlmostEqual(r["share_after"], 1.0, delta=0.01)
        self.assertAlmostEqual(r["traffic_after_heal_s"], 0.99, delta=0.011)

    def test_a_link_left_alone_after_the_heal_never_revives(self):
        t, link, total = series(lambda x: 10 if x <= 0.5 else (1 if round(x * 100) % 10 == 0 else 0),
                                lambda x: 30)
        r = metrics.revival(t, link, total, 0.5, 1.0, 0.01)
        self.assertIsNone(r["revived_s"])
        self.assertLess(r["share_after"], 0.5)

    def test_traffic_that_ends_at_the_heal_leaves_nothing_to_judge(self):
        t, link, total = series(lambda x: 10 if x <= 0.5 else 0, lambda x: 30 if x <= 1.0 else 0)
        r = metrics.revival(t, link, total, 0.5, 1.0, 0.01)
        self.assertIsNone(r["revived_s"])
        self.assertEqual(r["traffic_after_heal_s"], 0.0)

    def test_a_smaller_total_after_the_heal_is_judged_by_share_not_by_rate(self):
        # After the heal everything runs at a third of the rate (a tail): the link's share is what counts.
        t, link, total = series(lambda x: 10 if x <= 0.5 else (2 if x > 1.0 else 0),
                                lambda x: 30 if x <= 1.0 else 4)
        r = metrics.revival(t, link, total, 0.5, 1.0, 0.01)
        self.assertIsNone(r["revived_s"])  # under 20 % of the earlier spine rate: not busy, not judged
        t, link, total = series(lambda x: 10 if x <= 0.5 else (4 if x > 1.0 else 0),
                                lambda x: 30 if x <= 1.0 else 20)
        r = metrics.revival(t, link, total, 0.5, 1.0, 0.01)
        self.assertAlmostEqual(r["revived_s"], 0.0, delta=0.011)
        self.assertAlmostEqual(r["share_after"], (4 / 24) / 0.25, delta=0.01)


class Stats(unittest.TestCase):
    def doc(self, retrans, states):
        return {"comms": [{"wrong_peer_dropped": 1,
                           "conn": {"retransmissions": retrans, "rto_us": 5000, "dropped": {"bad_token": 2, "malformed": 1},
                                    "paths": [{"retransmissions": 99, "state_changes": s, "state": st}
                                              for s, st in states]}}],
                "rails": [{"unknown_token_dropped": 3, "runt_dropped": 0}]}

    def test_connection_counters_are_summed_over_ranks_and_path_counters_are_not_double_counted(self):
        s = metrics.summarize_stats([self.doc(6, [(1, "alive")]), self.doc(4, [(2, "dead"), (0, "alive")])])
        self.assertEqual(s["retransmissions"], 10)
        self.assertEqual(s["path_state_changes"], 3)
        self.assertEqual(s["paths_not_alive_at_close"], 1)

    def test_settings_are_not_summed_as_counters(self):
        self.assertNotIn("rto_us", metrics.summarize_stats([self.doc(1, [])]))

    def test_bad_packets_of_every_kind_are_counted(self):
        s = metrics.summarize_stats([self.doc(1, [])])
        self.assertEqual((s["bad_packets_dropped"], s["unknown_token_dropped"], s["wrong_peer_dropped"]), (3, 3, 1))

    def test_the_closed_summary_counts_every_comm_even_those_not_listed(self):
        # Prism lists only some comms (with at most 64 paths each) and folds all of them into
        # closed_summary: the totals come from the summary, the listed comms are not counted twice.
        d = self.doc(6, [(1, "dead")])
        d["closed_summary"] = [
            {"rail": "r0", "peer": "a", "role": "send", "comms": 90, "wrong_peer_dropped": 5,
             "conn": {"retransmissions": 70, "dropped": {"bad_token": 4}},
             "paths": {"state_changes": 12, "probes_sent": 3, "not_alive_at_close": 2}},
            {"rail": "r0", "peer": "a", "role": "recv", "comms": 90, "conn": {"duplicates": 1}, "paths": {}},
        ]
        s = metrics.summarize_stats([d])
        self.assertEqual((s["retransmissions"], s["duplicates"], s["wrong_peer_dropped"]), (70, 1, 5))
        self.assertEqual((s["path_state_changes"], s["path_probes_sent"], s["paths_not_alive_at_close"]), (12, 3, 2))
        self.assertEqual((s["bad_packets_dropped"], s["unknown_token_dropped"]), (4, 3))

    def test_an_unknown_shape_gives_no_numbers_rather_than_a_crash(self):
        self.assertEqual(metrics.summarize_stats([{"something": [1, 2]}, [], "x"]), {})

    def test_the_rtt_is_the_mean_of_every_sample_of_every_rank(self):
        # Two ranks: 100 samples averaging 10 ms and 300 averaging 30 ms -> 25 ms, not (10 + 30) / 2;
        # a group without samples (a receive comm) does not pull the mean to 0.
        def doc(n, avg, lo, hi):
            return {"closed_summary": [
                {"conn": {}, "paths": {"rtt_samples": n, "rtt_avg_us": avg, "rtt_min_us": lo, "rtt_max_us": hi}},
                {"conn": {}, "paths": {"rtt_samples": 0, "rtt_avg_us": 0, "rtt_min_us": 0, "rtt_max_us": 0}}]}
        s = metrics.summarize_stats([doc(100, 10_000, 2_000, 40_000), doc(300, 30_000, 5_000, 70_000)])
        self.assertEqual((s["rtt_samples"], s["rtt_avg_us"]), (400, 25_000))
        self.assertEqual((s["rtt_min_us"], s["rtt_max_us"]), (2_000, 70_000))
        self.assertAlmostEqual(metrics.run_rtt_s({"prism_stats": s}), 0.025)

    def test_a_run_without_rtt_samples_has_no_rtt(self):
        self.assertNotIn("rtt_avg_us", metrics.summarize_stats([{"closed_summary": [{"conn": {}, "paths": {}}]}]))
        self.assertIsNone(metrics.run_rtt_s({"prism_stats": {}}))
        self.assertIsNone(metrics.run_rtt_s(None))


if __name__ == "__main__":
    unittest.main()


class ByteRecovery(unittest.TestCase):
    def test_probes_weigh_their_bytes_not_a_data_packets(self):
        # 50 ms windows: the dead link carries 100 kB per window before the fault (at 1.0 s) and 200 bytes
        # (probes) from 1.2 s on, while the spines stay busy: by bytes it was left after 0.2 s, rate ~0 %.
        t = [round(0.05 * (k + 1), 2) for k in range(60)]
        dead = [100_000 if x <= 1.0 else (50_000 if x <= 1.2 else 200) for x in t]
        live = [100_000 if x <= 1.0 else 200_000 for x in t]
        tl = {"t": t, "step_s": 0.05, "fault_t": 1.0, "fault_link": "a", "links": {"a": dead, "b": live}}
        rec = metrics.byte_recovery(tl)
        self.assertAlmostEqual(rec["reroute_s"], 0.2, places=2)
        self.assertLess(rec["residual_share"], 0.01)

    def test_no_fault_link_no_byte_recovery(self):
        self.assertIsNone(metrics.byte_recovery({"t": [0.05], "links": {"a": [1]}}))


class DeadPathRecovery(unittest.TestCase):
    def test_the_10ms_byte_series_is_preferred_over_the_timeline(self):
        r = {"fault": {"kind": "blackhole"}, "recovery_bytes": {"reroute_s": 0.07},
             "timeline": {"t": [0.05], "links": {"a": [1]}, "fault_link": "a", "fault_t": 0.0, "step_s": 0.05}}
        self.assertEqual(metrics.dead_path_recovery(r)["reroute_s"], 0.07)

    def test_older_runs_fall_back_to_the_timeline_and_faults_without_a_dead_link_have_none(self):
        t = [round(0.05 * (k + 1), 2) for k in range(60)]
        tl = {"t": t, "step_s": 0.05, "fault_t": 1.0, "fault_link": "a",
              "links": {"a": [100_000 if x <= 1.0 else 0 for x in t], "b": [100_000 if x <= 1.0 else 200_000 for x in t]}}
        self.assertAlmostEqual(metrics.dead_path_recovery({"fault": {"kind": "blackhole"}, "timeline": tl})["reroute_s"],
                               0.0, places=2)
        self.assertIsNone(metrics.dead_path_recovery({"fault": {"kind": "loss"}, "timeline": tl}))
        # A cut link that healed at 2.0 s and carries traffic again: judged up to the heal only.
        tl["links"]["a"] = [100_000 if x <= 1.0 or x > 2.0 else 0 for x in t]
        cut = {"fault": {"kind": "link_down"}, "timeline": tl}
        self.assertIsNone(metrics.dead_path_recovery(cut)["reroute_s"])
        self.assertAlmostEqual(metrics.dead_path_recovery({**cut, "heal_at_s": 2.0})["reroute_s"], 0.0, places=2)

    def test_spine_bytes_total_counts_both_ends_of_every_link(self):
        spec = TopologySpec(hosts=2, rails=2, spines=3)
        nd = {}
        for r in range(2):
            for sp in range(3):
                nd.setdefault(f"lf{r}", {})[f"lf{r}-sp{sp}"] = {"tx_bytes": 10, "tx_packets": 1}
                nd.setdefault(f"sp{sp}", {})[f"sp{sp}-lf{r}"] = {"tx_bytes": 5, "tx_packets": 1}
        self.assertEqual(metrics.spine_bytes_total(spec, nd), 6 * 15)
        self.assertEqual(metrics.spine_packets(spec, nd), 12)
