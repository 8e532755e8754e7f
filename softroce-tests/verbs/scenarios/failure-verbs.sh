# failure-verbs: a fault on one of two rails in the middle of a prism-perf run over the verbs backend.
# Two veth pairs = two rails: rail 0 = rxe0/va <-> rxe1/vb (10.9.0.0/24), rail 1 = rxe2/vc <-> rxe3/vd
# (10.9.1.0/24). Rank 0 uses rxe0,rxe2, rank 1 rxe1,rxe3. prism-perf all_reduce runs a sweep of large
# messages (one timed collective and one checked collective per size: every size's check pass verifies
# every element); once data flows, rail 0 fails for OUTAGE seconds:
#   FAULT=drop  - tc ingress drop-all on both ends of rail 0 (va and vb): silent loss, carrier stays up
#   FAULT=down  - `ip link set vb down` (va loses carrier)
# then is restored. A sampler reads each rxe's rcvd_pkts every ~50 ms.
# Claims: rail 0 carried >= 10 % of the packets before the fault, and none during it; prism-perf (both ranks) exits 0
# within the hard limit (no hang) with #wrong = 0 at every size; the run was still going when the fault
# ended (the fault really fell mid-transfer); both ranks' PRISM_STATS name the verbs backend; data kept
# flowing during the fault on rail 1, or flowed again after it; with FAULT=down, rail 0 (whose QPs all died)
# carries data again after the fault (its QPs were re-created); the packets lost with rail 0 were resent
# as fragments (never as a second WRITE) and reassembled, and no receive gave up waiting for a FENCE.
# Numbers: packets per rail before/during/after, longest stall of all delivery, rail 0's recovery
# (fault end -> first packet delivered on rail 0 again), any-rail recovery (fault end -> first delivery on any rail),
# run time.
. /prism/lib.sh
FAULT=${FAULT:-drop}
OUTAGE=${OUTAGE:-3}
SIZES_FLAGS=${SIZES_FLAGS:-"-b 2M -e 16M -f 1 -i 2M"}
NSIZES=${NSIZES:-8}
ITER_FLAGS=${ITER_FLAGS:-"-n 1 -w 0"}
PERF_LIMIT=${PERF_LIMIT:-300}   # hard limit of the whole prism-perf run (seconds): more is a hang

wire_setup; check wire_up $? "rail 0: rxe0/va <-> rxe1/vb"
wire_pair vc vd 10.9.1 rxe2 rxe3 20; check wire_rail1_up $? "rail 1: rxe2/vc <-> rxe3/vd"
modprobe -a sch_ingress cls_matchall act_gact
metric_str transport "$TRANSPORT"
metric_str fault "$FAULT"

hw=/sys/class/infiniband
# Sampler: "uptime rxe0 rxe1 rxe2 rxe3" rcvd_pkts, builtins only (forks are slow in TCG).
rm -f /tmp/stop-sampler
(
  while [ ! -f /tmp/stop-sampler ]; do
    read -r t _ </proc/uptime
    read -r a <$hw/rxe0/ports/1/hw_counters/rcvd_pkts; read -r b <$hw/rxe1/ports/1/hw_counters/rcvd_pkts
    read -r c <$hw/rxe2/ports/1/hw_counters/rcvd_pkts; read -r d <$hw/rxe3/ports/1/hw_counters/rcvd_pkts
    echo "$t $a $b $c $d"
    sleep 0.05
  done
) >"$OUT/timeline.txt" &
sampler=$!
all_rails() {
  read -r a <$hw/rxe0/ports/1/hw_counters/rcvd_pkts; read -r b <$hw/rxe1/ports/1/hw_counters/rcvd_pkts
  read -r c <$hw/rxe2/ports/1/hw_counters/rcvd_pkts; read -r d <$hw/rxe3/ports/1/hw_counters/rcvd_pkts
  echo $((a + b + c + d))
}

t0=$(up)
# shellcheck disable=SC2086
run_two_ranks_bg() {
  env $(prism_env rxe0,rxe2 va,vc) timeout "$PERF_LIMIT" prism-perf all_reduce $SIZES_FLAGS $ITER_FLAGS -c 1 -T 120 \
    --rank 0 --nranks 2 --rendezvous 127.0.0.1:29700 --json "$OUT/perf.rank0.json" >"$OUT/perf.rank0.log" 2>&1 &
  P0=$!
  env $(prism_env rxe1,rxe3 vb,vd) timeout "$PERF_LIMIT" prism-perf all_reduce $SIZES_FLAGS $ITER_FLAGS -c 1 -T 120 \
    --rank 1 --nranks 2 --rendezvous 127.0.0.1:29700 --json "$OUT/perf.rank1.json" >"$OUT/perf.rank1.log" 2>&1 &
  P1=$!
}
run_two_ranks_bg
# Inject once data flows (opening devices and connecting takes seconds in TCG): 3000 packets delivered
# on either rail. Whether rail 0 itself carried data before the fault is a check below.
r0=$(all_rails); n=0
while [ $(( $(all_rails) - r0 )) -lt 3000 ] && [ "$n" -lt 600 ] && kill -0 "$P0" 2>/dev/null; do sleep 0.1; n=$((n + 1)); done
sleep 1
case "$FAULT" in
  drop) tc qdisc add dev va ingress && tc filter add dev va parent ffff: matchall action drop
        tc qdisc add dev vb ingress && tc filter add dev vb parent ffff: matchall action drop ;;
  down) ip link set vb down ;;
  *) log "unknown FAULT=$FAULT" ;;
esac
read -r down _ </proc/uptime
sleep "$OUTAGE"
running=0; kill -0 "$P0" 2>/dev/null && kill -0 "$P1" 2>/dev/null && running=1
read -r upt _ </proc/uptime
case "$FAULT" in
  drop) tc qdisc del dev va ingress; tc qdisc del dev vb ingress ;;
  down) ip link set vb up ;;
esac
log "fault $FAULT from $down to $upt"
wait "$P1"; RC1=$?
wait "$P0"; RC0=$?
t_end=$(up)
sleep 0.5
touch /tmp/stop-sampler; wait "$sampler"
log "rank0 rc=$RC0 rank1 rc=$RC1"; tail -n 16 "$OUT/perf.rank0.log" >&2
metric run_seconds "$(awk -v a="$t0" -v b="$t_end" 'BEGIN { printf "%.1f", b - a }')"
metric fault_seconds "$(awk -v a="$down" -v b="$upt" 'BEGIN { printf "%.2f", b - a }')"
metric fault_start_after_launch_seconds "$(awk -v a="$t0" -v b="$down" 'BEGIN { printf "%.2f", b - a }')"

# From the timeline: per rail packets before / during (from 0.3 s after the injection) / after.
awk -v d="$down" -v u="$upt" '
  NR == 1 { p0 = $2 + $3; p1 = $4 + $5; last_any = $1; next }
  {
    t = $1; r0 = $2 + $3; r1 = $4 + $5; d0 = r0 - p0; d1 = r1 - p1
    if (t <= d) { b0 += d0; b1 += d1 }
    else if (t > d + 0.3 && t <= u) { m0 += d0; m1 += d1 }
    else if (t > u) { a0 += d0; a1 += d1; if (d0 > 0 && rec0 == "") rec0 = t - u; if (d0 + d1 > 0 && rec_any == "") rec_any = t - u }
    if (d0 + d1 > 0) { if (t - last_any > stall) stall = t - last_any; last_any = t }
    p0 = r0; p1 = r1
  }
  END {
    printf "%d %d %d %d %d %d %d %s %s\n", b0, b1, m0, m1, a0, a1, stall * 1000,
      (rec0 == "" ? "null" : int(rec0 * 1000)), (rec_any == "" ? "null" : int(rec_any * 1000))
  }' "$OUT/timeline.txt" >/tmp/tl
read -r b0 b1 m0 m1 a0 a1 stall_ms rec0_ms rec_any_ms </tmp/tl
for k in b0:rail0_pkts_before b1:rail1_pkts_before m0:rail0_pkts_during m1:rail1_pkts_during \
         a0:rail0_pkts_after a1:rail1_pkts_after; do
  eval "v=\$${k%%:*}"; metric "${k#*:}" "$v"
done
metric longest_delivery_stall_ms "$stall_ms"
metric rail0_recovery_ms "$rec0_ms"
metric any_rail_delivery_after_fault_ms "$rec_any_ms"

# A fault on a rail that carries next to nothing tests no failover: rail 0 must have had >= 10 % of the
# packets delivered before the fault.
[ "$b0" -gt 0 ] && [ $((b0 * 10)) -ge $((b0 + b1)) ]
check rail0_carried_data_before_the_fault $? "$b0 of $((b0 + b1)) packets delivered before the fault were on rail 0 (>= 10 % required)"
[ $((m0 * 10)) -lt "$b0" ]; check rail0_delivery_stopped_during_the_fault $? "$m0 packets on rail 0 during the fault (vs $b0 before)"
[ "$running" -eq 1 ]; check fault_fell_mid_transfer $? "both ranks still running when the fault ended"
[ "$RC0" -ne 124 ] && [ "$RC1" -ne 124 ]; check no_hang $? "prism-perf ended within ${PERF_LIMIT}s (rank 0 rc=$RC0, rank 1 rc=$RC1)"
[ "$RC0" -eq 0 ] && [ "$RC1" -eq 0 ]; check prism_perf_exit_0 $? "rank 0 rc=$RC0, rank 1 rc=$RC1"
check_perf prism "$OUT/perf.rank0.json" "$NSIZES"
check_backend prism "$OUT/perf.rank0.json.rank0.stats.json" "$OUT/perf.rank1.json.rank1.stats.json"
{ [ "$m1" -gt 0 ] || [ "$rec_any_ms" != null ]; }
check delivery_continued_or_resumed $? "rail 1 delivered $m1 packets during the fault; first delivery after it: ${rec_any_ms} ms; rail 0 again after ${rec0_ms} ms"
# Packets lost with rail 0 are resent as fragments the receiver copies while the receive is posted, never
# as a second WRITE (a late one could land in a buffer NCCL has back): both ranks' comms summed.
cat "$OUT/perf.rank0.json.rank0.stats.json" "$OUT/perf.rank1.json.rank1.stats.json" 2>/dev/null | jq -rs '
  [.[] | .. | objects | select(has("verbs") and (.verbs | type) == "object" and (.verbs | has("bounce"))) | .verbs] as $v
  | [([$v[].bounce.retx_bounced] | add // 0), ([$v[].bounce.packets_reassembled] | add // 0),
     ([$v[].bounce.frags_stale] | add // 0), ([$v[].counters.fence_give_ups] | add // 0)] | @tsv' >/tmp/bounce
read -r bounced reassembled stale give_ups </tmp/bounce
metric retx_as_fragments "${bounced:-0}"
metric packets_reassembled "${reassembled:-0}"
metric frags_stale "${stale:-0}"
metric fence_give_ups "${give_ups:-0}"
[ "${bounced:-0}" -gt 0 ] && [ "${reassembled:-0}" -gt 0 ] && [ "${give_ups:-1}" -eq 0 ]
check retransmissions_went_as_fragments $? "$bounced retransmissions sent as fragments, $reassembled packets reassembled, $stale stale fragments dropped, $give_ups FENCE give-ups"
# A local link flap kills every QP of rail 0 (error completions); they are re-created in the background
# once the port is active again, so rail 0 must carry data again.
if [ "$FAULT" = down ]; then
  [ "$rec0_ms" != null ] && [ "$a0" -gt 0 ]
  check rail0_delivering_again_after_the_fault $? "rail 0 delivering again after ${rec0_ms} ms ($a0 packets after the fault)"
fi
finish
