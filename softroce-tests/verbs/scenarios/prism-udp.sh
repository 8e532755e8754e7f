# prism-udp: the project's host-built prism-perf (and libnccl-net-prism.so beside it) run in the guest,
# all_reduce 1 MiB to 16 MiB over Prism's UDP backend, twice:
#   local - 2 local ranks (-N 2) on the guest's va interface (PRISM_IFNAMES=va; IFNAME=lo to compare);
#           both ranks share va's address, so the kernel keeps the datagrams on lo;
#   wire  - rank 1 in a network namespace holding vb, rank 0 on va (--rank/--rendezvous), so every
#           datagram crosses the veth.
# Claims: host binaries run unchanged in the guest; every size completes with #wrong = 0 both times;
# the wire run's bytes crossed the veth. busbw is reported per size.
. /prism/lib.sh
# This scenario is about the UDP backend: with rxe devices present the plugin's default (auto) would pick
# verbs, so the backend is named, and read back from PRISM_STATS.
TRANSPORT=udp
SIZES_FLAGS=${SIZES_FLAGS:-"-b 1M -e 16M -f 2"}
ITER_FLAGS=${ITER_FLAGS:-"-n 3 -w 1"}   # correctness, not speed, is what TCG can show

wire_setup; check wire_up $? "two rxe devices on the va/vb veth pair (va = 10.9.0.1)"
[ -x /opt/prism/prism-perf ] && [ -f /opt/prism/libnccl-net-prism.so ]
check prism_binaries_present $? "/opt/prism: $(ls /opt/prism | tr '\n' ' ')"
missing=$(ldd /opt/prism/prism-perf /opt/prism/libnccl-net-prism.so 2>&1 | grep -c 'not found')
[ "$missing" -eq 0 ]; check host_binaries_link_in_the_guest $? "$missing unresolved libraries (ldd)"

# udp_snmp FIELD: a counter from the Udp: lines of /proc/net/snmp.
udp_snmp() { awk -v f="$1" '/^Udp:/ { if (!h) { for (i = 1; i <= NF; i++) if ($i == f) c = i; h = 1 } else print $c }' /proc/net/snmp; }
tx0=$(net_stat va tx_packets); rx0=$(net_stat lo rx_packets)
rcvbuf0=$(udp_snmp RcvbufErrors); inerr0=$(udp_snmp InErrors)
now0=$(up)
# PRISM_* knobs given to run.sh with --guest-env reach prism-perf through the environment.
IFNAME=${IFNAME:-va}
metric_str ifname "$IFNAME"
# shellcheck disable=SC2086
PRISM_TRANSPORT=udp PRISM_IFNAMES=$IFNAME timeout 600 prism-perf all_reduce -N 2 $SIZES_FLAGS $ITER_FLAGS -c 1 -T 120 \
  --json "$OUT/prism-perf.json" >"$OUT/prism-perf.log" 2>&1
rc=$?
metric local_seconds "$(awk -v a="$now0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')"
tail -n 12 "$OUT/prism-perf.log" >&2
[ "$rc" -eq 0 ]; check local_prism_perf_exit_0 $? "prism-perf -N 2 rc=$rc"

# perf_results LABEL JSON: metrics and checks from rank 0's JSON (one entry per size: busbw in GB/s,
# #wrong); the text table interleaves with the ranks' stderr, so it is not parsed.
perf_results() {
  if [ -f "$2" ]; then jq -r '.results[] | "\(.bytes) \(.busbw) \(.wrong)"' "$2" >/tmp/rows; else : >/tmp/rows; fi
  nsizes=$(grep -c . /tmp/rows)
  wrong=$(awk '{ s += $3 } END { print s + 0 }' /tmp/rows)
  metric "$1_sizes_reported" "$nsizes"
  metric "$1_wrong_total" "$wrong"
  [ "$nsizes" -ge 5 ]; check "$1_every_size_reported" $? "$nsizes of 5 sizes (1 MiB .. 16 MiB by 2x) in $(basename "$2")"
  [ "$nsizes" -gt 0 ] && [ "$wrong" -eq 0 ]; check "$1_no_wrong_elements" $? "#wrong total $wrong"
  while read -r size busbw _; do
    metric "$1_busbw_MBps_${size}" "$(awk -v b="$busbw" 'BEGIN { printf "%.2f", b * 1000 }')"
  done </tmp/rows
}
perf_results local "$OUT/prism-perf.json"
check_backend local "$OUT/prism-perf.json.rank0.stats.json" "$OUT/prism-perf.json.rank1.stats.json"

# Both ranks share va's address, so the kernel keeps their datagrams on lo; recorded so the reader
# sees which path the bytes took, with the kernel's UDP drop counters (receive buffer overflows).
udp_snmp RcvbufErrors >/tmp/rcvbuf1; udp_snmp InErrors >/tmp/inerr1
metric udp_rcvbuf_errors "$(( $(cat /tmp/rcvbuf1) - rcvbuf0 ))"
metric udp_in_errors "$(( $(cat /tmp/inerr1) - inerr0 ))"
metric local_va_tx_packets "$(( $(net_stat va tx_packets) - tx0 ))"
metric local_lo_rx_packets "$(( $(net_stat lo rx_packets) - rx0 ))"

# --- wire: rank 1 behind vb in its own namespace ---------------------------------------------------
rdma link delete rxe1
ip netns add peer
ip link set vb netns peer
ip -n peer link set lo up
ip -n peer addr add 10.9.0.2/24 dev vb
ip -n peer link set vb up
n=0; while [ "$(cat /sys/class/net/va/carrier 2>/dev/null)" != 1 ] && [ "$n" -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
tx0=$(net_stat va tx_bytes); rx0=$(net_stat va rx_bytes)
now0=$(up)
# shellcheck disable=SC2086
PRISM_TRANSPORT=udp PRISM_IFNAMES=va timeout 600 prism-perf all_reduce --rank 0 --nranks 2 --rendezvous 10.9.0.1:29517 \
  $SIZES_FLAGS $ITER_FLAGS -c 1 -T 120 --json "$OUT/prism-perf-wire.json" >"$OUT/prism-perf-wire-rank0.log" 2>&1 &
r0=$!
# shellcheck disable=SC2086
ip netns exec peer env PRISM_TRANSPORT=udp PRISM_IFNAMES=vb timeout 600 prism-perf all_reduce --rank 1 --nranks 2 \
  --rendezvous 10.9.0.1:29517 $SIZES_FLAGS $ITER_FLAGS -c 1 -T 120 >"$OUT/prism-perf-wire-rank1.log" 2>&1
rc1=$?
wait "$r0"; rc0=$?
metric wire_seconds "$(awk -v a="$now0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')"
tail -n 8 "$OUT/prism-perf-wire-rank0.log" >&2
[ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ]; check wire_prism_perf_exit_0 $? "rank 0 rc=$rc0, rank 1 rc=$rc1"
perf_results wire "$OUT/prism-perf-wire.json"
check_backend wire "$OUT/prism-perf-wire.json.rank0.stats.json"
tx=$(( $(net_stat va tx_bytes) - tx0 )); rx=$(( $(net_stat va rx_bytes) - rx0 ))
metric wire_va_tx_bytes "$tx"
metric wire_va_rx_bytes "$rx"
# A 2-rank all_reduce sends about one message size per rank per iteration: 5 iterations (warm-up,
# 3 timed, check) over 1+2+4+8+16 MiB is ~160 MB each way.
[ "$tx" -gt 100000000 ] && [ "$rx" -gt 100000000 ]
check wire_bytes_crossed_the_veth $? "va tx +$tx B, rx +$rx B"
finish
