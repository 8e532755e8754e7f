# perf-verbs: prism-perf all_reduce with 2 ranks over rxe on the veth wire (rank 0 on rxe0/va, rank 1 on
# rxe1/vb: every packet crosses the link), then, in the same boot and on the same two devices,
# ib_write_bw rxe0 -> rxe1 (RC, 1 QP, 64 KiB) as the reference, one way and both ways at once (-b).
# Claims: both ranks exit 0; every size reported with #wrong = 0; both ranks' PRISM_STATS name the
# verbs backend; the bytes crossed the veth; ib_write_bw ran and moved data; on verbs,
# rank 0's getProperties of rxe0 match the guest's sysfs (name, pciPath, speed = ports/1/rate, guid = node_guid).
# Numbers: prism-perf busbw and algbw per size (MB/s = 10^6 B/s; with 2 ranks all_reduce's busbw =
# algbw = bytes each rank sends per second, i.e. one direction of the link), ib_write_bw MB/s (timed by
# the bed from rxe1's packet counter, as in `perftest`), and prism/ib_write_bw ratios (largest size, and
# best size). Note: all_reduce moves the bytes in both directions at once; plain ib_write_bw in one,
# `ib_write_bw -b` in both like all_reduce (ratio_busbw_best_vs_ib_write_bw_bidir: per direction each).
# Last, prism-perf `oneway` (rank 0 -> rank 1 only, the same sizes) against plain ib_write_bw
# (ratio_oneway_best_vs_ib_write_bw: one direction each) and against ib_write_bw over as many QPs as
# Prism uses (-q 16: ratio_oneway_best_vs_ib_write_bw_16qp, like for like). Then ONEWAY_ROUNDS (3)
# alternating rounds of ib_write_bw and oneway at the largest size: per-round ratios and their median
# (ratio_oneway_vs_ib_write_bw_median), each round's run checked (exit 0, #wrong = 0).
. /prism/lib.sh
SIZES_FLAGS=${SIZES_FLAGS:-"-b 1M -e 16M -f 4"}
NSIZES=${NSIZES:-3}
ITER_FLAGS=${ITER_FLAGS:-"-n 4 -w 1"}
IB_ITERS=${IB_ITERS:-600}

# pci_function_of LINK: the nearest directory at or above LINK's real path whose subsystem is the PCI bus
# (a PCI function, what Prism reports as pciPath); empty when LINK is missing or on no PCI function.
pci_function_of() {
  [ -e "$1" ] || return 0
  _pf=$(readlink -f "$1")
  while [ -n "$_pf" ] && [ "$_pf" != / ]; do
    if [ "$(basename "$(readlink -f "$_pf/subsystem" 2>/dev/null)")" = pci ]; then echo "$_pf"; return 0; fi
    _pf=$(dirname "$_pf")
  done
}

# ib_run LABEL PORT BYTES FLAGS...: ib_write_bw rxe0 -> rxe1 with FLAGS (server on rxe1), timed by the bed
# from rxe1's packet counter over BYTES bytes; sets IB_RATE (MB/s, empty when it failed) and IB_RCS.
ib_run() {
  _ib_label=$1; _ib_port=$2; _ib_bytes=$3; shift 3
  start_sampler "$OUT/$_ib_label-rcvd.txt" /sys/class/infiniband/rxe1/ports/1/hw_counters/rcvd_pkts
  ib_write_bw -d rxe1 -x "$gid" -F "$@" -s 65536 -u 17 -p "$_ib_port" >"$OUT/$_ib_label-server.log" 2>&1 &
  _ib_srv=$!
  wait_listen "$_ib_port" 10 || log "ib_write_bw server ($_ib_label) did not listen"
  timeout 120 ib_write_bw -d rxe0 -x "$gid" -F "$@" -s 65536 -u 17 -p "$_ib_port" 10.9.0.2 >"$OUT/$_ib_label-client.log" 2>&1
  _ib_crc=$?
  wait "$_ib_srv"; _ib_src=$?
  stop_sampler
  IB_RATE=""; [ "$_ib_crc" -eq 0 ] && [ "$_ib_src" -eq 0 ] && IB_RATE=$(sampled_rate "$OUT/$_ib_label-rcvd.txt" "$_ib_bytes")
  IB_RCS="client rc=$_ib_crc server rc=$_ib_src"
}

# verbs_work PREFIX STATS0 STATS1: verbs work per MiB of data, both ranks' comms summed (each comm's
# `verbs.totals` in PRISM_STATS): send WQEs, send doorbells and send completions per MiB written, receive
# completions and receive doorbells per MiB placed; control packets included. Reported as
# PREFIX_wqes_per_MiB etc.; VERBS_WORK holds "wqes doorbells send_cqes recv_cqes recv_doorbells writes
# write_bytes".
verbs_work() {
  VERBS_WORK=$(cat "$2" "$3" 2>/dev/null | jq -rs '
    [.[] | .. | objects | select(has("verbs")) | .verbs.totals? | select(. != null)] as $t
    | def s(k): $t | map(.[k] // 0) | add // 0;
      def per(n; b): if b > 0 then n * 1048576 / b * 100 | round / 100 else "null" end;
      "\(per(s("wqes"); s("write_bytes"))) \(per(s("doorbells"); s("write_bytes"))) \(per(s("send_cqes"); s("write_bytes"))) \(per(s("recv_cqes"); s("recv_write_bytes"))) \(per(s("recv_doorbells"); s("recv_write_bytes"))) \(s("writes")) \(s("write_bytes"))"')
  _vw_prefix=$1
  # shellcheck disable=SC2086
  set -- $VERBS_WORK
  metric "${_vw_prefix}_wqes_per_MiB" "${1:-null}"; metric "${_vw_prefix}_doorbells_per_MiB" "${2:-null}"
  metric "${_vw_prefix}_send_cqes_per_MiB" "${3:-null}"; metric "${_vw_prefix}_recv_cqes_per_MiB" "${4:-null}"
  metric "${_vw_prefix}_recv_doorbells_per_MiB" "${5:-null}"
}

# rxe_counters: every hw counter of rxe0 and rxe1 and the veth pair's drop counters, one "name value" per
# line (for the deltas around a run: where packets were lost, if any were).
rxe_counters() {
  for d in rxe0 rxe1; do
    for f in /sys/class/infiniband/$d/ports/1/hw_counters/*; do
      [ -r "$f" ] && printf '%s.%s %s\n' "$d" "$(basename "$f")" "$(cat "$f")"
    done
  done
  for n in va vb; do
    for k in rx_dropped tx_dropped; do printf '%s.%s %s\n' "$n" "$k" "$(net_stat "$n" "$k")"; done
  done
}

# counter_deltas BEFORE AFTER: "name +delta" for every counter that moved, on one line.
counter_deltas() {
  awk 'NR == FNR { b[$1] = $2; next } ($1 in b) && $2 != b[$1] { printf "%s +%d ", $1, $2 - b[$1] }' "$1" "$2"
}

wire_setup; check wire_up $? "two rxe devices on the va/vb veth pair (va = 10.9.0.1)"
gid=$(roce_v2_ipv4_gid_index rxe0) || gid=1
metric_str transport "$TRANSPORT"
metric rxe_active_mtu "$(active_mtu rxe0)"
tx0=$(net_stat va tx_bytes); rx0=$(net_stat va rx_bytes)
rxe_counters >/tmp/counters-before
t0=$(up)
# shellcheck disable=SC2086
run_two_ranks perf "$(prism_env rxe0 va)" "$(prism_env rxe1 vb)" all_reduce $SIZES_FLAGS $ITER_FLAGS -c 1 -T 120
metric prism_perf_seconds "$(awk -v a="$t0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')"
rxe_counters >/tmp/counters-after
# Informational: which rxe and veth counters moved during the all_reduce (retries, sequence errors,
# drops: where the losses proto recovered from were made).
metric_str rxe_counters_all_reduce "$(counter_deltas /tmp/counters-before /tmp/counters-after)"
[ "$RC0" -eq 0 ] && [ "$RC1" -eq 0 ]; check prism_perf_exit_0 $? "rank 0 rc=$RC0, rank 1 rc=$RC1"
check_perf prism "$OUT/perf.rank0.json" "$NSIZES"
check_backend prism "$OUT/perf.rank0.json.rank0.stats.json" "$OUT/perf.rank1.json.rank1.stats.json"
if [ "$TRANSPORT" = verbs ]; then
  verbs_work verbs "$OUT/perf.rank0.json.rank0.stats.json" "$OUT/perf.rank1.json.rank1.stats.json"
  # shellcheck disable=SC2086
  set -- $VERBS_WORK
  # Consumed receive slots go back in chains of 16 (REPOST_BATCH): one receive doorbell per 16
  # receive completions, however slowly they come (one per completion before: 17.7-23.5 per MiB).
  awk -v d="${5:-null}" -v c="${4:-null}" 'BEGIN { exit !(d != "null" && c != "null" && d <= c / 16 + 0.5) }'
  check recv_doorbells_batched $? "${5:-null} receive doorbells per MiB for ${4:-null} receive completions (at most one per 16, +0.5)"
  metric verbs_writes "${6:-null}"
  metric verbs_bytes_per_write "$(awk -v w="${6:-0}" -v b="${7:-0}" 'BEGIN { if (w > 0) printf "%.0f", b / w; else print "null" }')"
  # getProperties of rxe0 as rank 0 reported it, against the guest's sysfs (issue 11 item 6). rxe has no
  # `device` link, so Prism places it on its netdev's PCI function; the veth va has none: pciPath NULL.
  ibd=/sys/class/infiniband/rxe0
  log "rxe0 sysfs: $(ls "$ibd" | tr '\n' ' ')"
  metric_str rxe0_device_link "$(readlink -f "$ibd/device" 2>/dev/null || echo none)"
  metric_str va_device_link "$(readlink -f /sys/class/net/va/device 2>/dev/null || echo none)"
  rate=$(cat "$ibd/ports/1/rate" 2>/dev/null); ng=$(cat "$ibd/node_guid" 2>/dev/null)
  metric_str rxe0_rate "$rate"; metric_str rxe0_node_guid "$ng"
  want_pci=$(pci_function_of "$ibd/device"); [ -n "$want_pci" ] || want_pci=$(pci_function_of /sys/class/net/va/device)
  want_speed=$(printf '%s' "$rate" | awk '$2 == "Gb/sec" { printf "%d", $1 * 1000 + 0.5 }')
  want_guid=$(printf '0x%s' "$(printf '%s' "$ng" | tr -d :)")
  got=$(grep -m1 '^#  dev 0:' "$OUT/perf.rank0.log")
  got_pci=$(jq -r '.plugin.devices[0].pci_path' "$OUT/perf.rank0.json" 2>/dev/null)
  got_speed=$(jq -r '.plugin.devices[0].speed_mbps' "$OUT/perf.rank0.json" 2>/dev/null)
  got_guid=$(printf '%s' "$got" | sed -n 's/.* guid \(0x[0-9a-f]*\).*/\1/p')
  metric_str prism_dev0 "$got"
  printf '%s' "$got" | grep -q '"prism:rxe0"'; check props_name_is_prism_rxe0 $? "$got"
  [ "$got_pci" = "$want_pci" ]; check props_pci_path_from_sysfs $? "pciPath '${got_pci}', sysfs '${want_pci}' (empty = NULL)"
  [ -n "$want_speed" ] && [ "$got_speed" = "$want_speed" ]; check props_speed_is_rate $? "speed ${got_speed} Mbps, ports/1/rate '$rate'"
  [ -n "$ng" ] && [ "$got_guid" = "$want_guid" ]; check props_guid_is_node_guid $? "guid ${got_guid}, node_guid '$ng'"
fi
tx=$(( $(net_stat va tx_bytes) - tx0 )); rx=$(( $(net_stat va rx_bytes) - rx0 ))
metric prism_va_tx_bytes "$tx"; metric prism_va_rx_bytes "$rx"
[ "$tx" -gt 10000000 ] && [ "$rx" -gt 10000000 ]; check prism_bytes_crossed_the_veth $? "va tx +$tx B, rx +$rx B"

# ib_write_bw on the same devices, same boot.
ib_run ib 18600 $((IB_ITERS * 65536)) -n "$IB_ITERS"
ib=$IB_RATE
metric ib_write_bw_MBps "${ib:-null}"
metric ib_write_bw_perftest_reported_MBps "$(perftest_bw "$OUT/ib-client.log")"
is_pos "$ib"; check ib_write_bw_moves_data $? "ib_write_bw RC 1 QP 64 KiB rxe0 -> rxe1: ${ib:-failed} MB/s ($IB_RCS)"

# The same in both directions at once (-b), as all_reduce moves its bytes: the rate rxe0 -> rxe1 while
# rxe1 -> rxe0 runs too (from rxe1's packet counter, like the one-way figure). Both rxe devices and
# both ranks share the guest's vCPUs, so whether one direction slows the other is the guest's to tell.
ib_run ib-bidir 18601 $((IB_ITERS * 65536)) -b -n "$IB_ITERS"
ibb=$IB_RATE
metric ib_write_bw_bidir_per_direction_MBps "${ibb:-null}"
metric ib_write_bw_bidir_perftest_reported_MBps "$(perftest_bw "$OUT/ib-bidir-client.log")"
is_pos "$ibb"; check ib_write_bw_bidir_moves_data $? "ib_write_bw -b RC 1 QP 64 KiB rxe0 <-> rxe1: ${ibb:-failed} MB/s one way ($IB_RCS)"

if is_pos "$ib" && is_pos "$ibb" && [ -s /tmp/rows ]; then
  best=$(awk 'BEGIN { m = 0 } $3 > m { m = $3 } END { print m }' /tmp/rows)
  metric ratio_busbw_best_vs_ib_write_bw_bidir "$(awk -v b="$best" -v i="$ibb" 'BEGIN { printf "%.3f", b * 1000 / i }')"
fi

if is_pos "$ib" && [ -s /tmp/rows ]; then
  last=$(tail -n1 /tmp/rows)
  best=$(awk 'BEGIN { m = 0 } $3 > m { m = $3 } END { print m }' /tmp/rows)
  set -- $last
  metric prism_busbw_MBps_largest "$(awk -v b="$3" 'BEGIN { printf "%.2f", b * 1000 }')"
  metric prism_busbw_MBps_best "$(awk -v b="$best" 'BEGIN { printf "%.2f", b * 1000 }')"
  metric ratio_busbw_largest_vs_ib_write_bw "$(awk -v b="$3" -v i="$ib" 'BEGIN { printf "%.3f", b * 1000 / i }')"
  metric ratio_busbw_best_vs_ib_write_bw "$(awk -v b="$best" -v i="$ib" 'BEGIN { printf "%.3f", b * 1000 / i }')"
  metric ratio_algbw_largest_vs_ib_write_bw "$(awk -v b="$2" -v i="$ib" 'BEGIN { printf "%.3f", b * 1000 / i }')"
fi

# Like for like with ib_write_bw: prism-perf's `oneway`, rank 0 -> rank 1 only, same sizes (its
# busbw = algbw = bytes delivered per second in the one direction). Last, so the all_reduce rows above
# are not overwritten before their ratios are taken. Prism spreads over PRISM_PATHS (16) QPs, and rxe
# works on QPs in parallel, so ib_write_bw with as many QPs (-q 16, one way) is measured too.
# shellcheck disable=SC2086
run_two_ranks oneway "$(prism_env rxe0 va)" "$(prism_env rxe1 vb)" oneway $SIZES_FLAGS $ITER_FLAGS -c 1 -T 120
[ "$RC0" -eq 0 ] && [ "$RC1" -eq 0 ]; check prism_oneway_exit_0 $? "rank 0 rc=$RC0, rank 1 rc=$RC1"
check_perf prism_oneway "$OUT/oneway.rank0.json" "$NSIZES"
cp /tmp/rows /tmp/rows-oneway
# The same work figures for one-way traffic (all sizes): no reverse data, so every control packet in
# it is protocol overhead on the data (CTS and descriptors per message, SACKs).
[ "$TRANSPORT" = verbs ] && verbs_work verbs_oneway "$OUT/oneway.rank0.json.rank0.stats.json" "$OUT/oneway.rank1.json.rank1.stats.json"
# -n counts per QP: the same bytes in all as the one-QP run.
nq=$((IB_ITERS / 16))
ib_run ib-q16 18602 $((16 * nq * 65536)) -q 16 -n "$nq"
ibq=$IB_RATE
metric ib_write_bw_16qp_MBps "${ibq:-null}"
is_pos "$ibq"; check ib_write_bw_16qp_moves_data $? "ib_write_bw RC 16 QPs 64 KiB rxe0 -> rxe1: ${ibq:-failed} MB/s ($IB_RCS)"
if [ -s /tmp/rows-oneway ]; then
  best=$(awk 'BEGIN { m = 0 } $3 > m { m = $3 } END { print m }' /tmp/rows-oneway)
  metric prism_oneway_busbw_MBps_best "$(awk -v b="$best" 'BEGIN { printf "%.2f", b * 1000 }')"
  is_pos "$ib" && metric ratio_oneway_best_vs_ib_write_bw "$(awk -v b="$best" -v i="$ib" 'BEGIN { printf "%.3f", b * 1000 / i }')"
  is_pos "$ibq" && metric ratio_oneway_best_vs_ib_write_bw_16qp "$(awk -v b="$best" -v i="$ibq" 'BEGIN { printf "%.3f", b * 1000 / i }')"
fi

# Alternating rounds, one way, at the largest size: ib_write_bw (1 QP) then prism-perf oneway, ROUNDS
# times (default 3). A single pair of runs in this emulated guest has given Prism 0.8x to 2.2x of
# ib_write_bw from one boot to the next: each round's ratio compares runs seconds apart, and the median
# over the rounds (ratio_oneway_vs_ib_write_bw_median) is the figure to read.
ROUNDS=${ONEWAY_ROUNDS:-3}
largest=$(printf '%s\n' "$SIZES_FLAGS" | sed -n 's/.*-e \([^ ]*\).*/\1/p')
: >/tmp/round-ratios
for r in $(seq 1 "$ROUNDS"); do
  ib_run "ib-round$r" $((18610 + r)) $((IB_ITERS * 65536)) -n "$IB_ITERS"
  ibr=$IB_RATE
  metric "ib_write_bw_MBps_round$r" "${ibr:-null}"
  # shellcheck disable=SC2086
  run_two_ranks "oneway-round$r" "$(prism_env rxe0 va)" "$(prism_env rxe1 vb)" oneway -b "$largest" -e "$largest" $ITER_FLAGS -c 1 -T 120
  rows=$(perf_rows "$OUT/oneway-round$r.rank0.json" 2>/dev/null)
  set -- $rows
  [ "$RC0" -eq 0 ] && [ "$RC1" -eq 0 ] && [ "${4:-x}" = 0 ]
  check "prism_oneway_round${r}_ok" $? "rank 0 rc=$RC0, rank 1 rc=$RC1, $largest: ${rows:-no row}"
  pb=$(awk -v b="${3:-0}" 'BEGIN { printf "%.2f", b * 1000 }')
  metric "prism_oneway_busbw_MBps_round$r" "$pb"
  [ "$TRANSPORT" = verbs ] && verbs_work "verbs_oneway_round$r" "$OUT/oneway-round$r.rank0.json.rank0.stats.json" "$OUT/oneway-round$r.rank1.json.rank1.stats.json"
  if is_pos "$ibr" && is_pos "$pb"; then
    rr=$(awk -v b="$pb" -v i="$ibr" 'BEGIN { printf "%.3f", b / i }')
    metric "ratio_oneway_vs_ib_write_bw_round$r" "$rr"
    echo "$rr" >>/tmp/round-ratios
  fi
done
nr=$(grep -c . /tmp/round-ratios)
[ "$nr" -eq "$ROUNDS" ]; check oneway_rounds_measured $? "$nr of $ROUNDS rounds with both rates"
if [ "$nr" -gt 0 ]; then
  metric ratio_oneway_vs_ib_write_bw_median "$(sort -g /tmp/round-ratios | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f", (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
fi
finish
