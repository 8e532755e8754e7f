# failure: an outage in the middle of an ib_write_bw RC run over the veth wire, three ways:
#   peer_down  - `ip link set vb down` (rxe1's netdev; rxe0's va loses carrier) for OUTAGE seconds
#   drop       - tc ingress drop-all on vb (silent loss, the link stays up) for OUTAGE seconds
#   local_down - `ip link set va down` (the sender's own netdev) for OUTAGE seconds
# Each run is ib_write_bw RC, 1 QP, ITERS writes of 64 KiB, perftest's default RC timeout (14: 67 ms,
# retry count 7, which rxe treats as infinite). A sampler reads rxe1's rcvd_pkts every
# ~50 ms; from it: whether delivery stopped during the outage,
# when it resumed after the link came back (recovery), and how the run ended.
# Reported per outage: packets before/during/after, longest delivery stall, recovery (restore -> first
# delivered packet) and the outcome of the run: completed, client error (status), or hung.
. /prism/lib.sh
OUTAGE=${OUTAGE:-3}
ITERS=${ITERS:-3000}   # 64 KiB writes: ~200 MB, 10-20 s at TCG speeds, so the outage falls mid-run
RUN_LIMIT=${RUN_LIMIT:-120}  # seconds one ib_write_bw run may take at all
STALL_LIMIT=${STALL_LIMIT:-10}  # seconds without delivery after the restore that count as a hang

wire_setup; check wire_up $? "two rxe devices on the va/vb veth pair"
gid=$(roce_v2_ipv4_gid_index rxe0) || gid=1
modprobe -a sch_ingress cls_matchall act_gact

RCVD=/sys/class/infiniband/rxe1/ports/1/hw_counters/rcvd_pkts
rcvd() { cat "$RCVD"; }
# now: NOW = guest uptime in seconds (10 ms resolution), read with shell builtins only, because a fork
# costs tens of milliseconds in TCG while perftest keeps the vCPUs busy.
now() { read -r NOW _ </proc/uptime; }

# outage LABEL PORT: one ib_write_bw run with an outage injected once traffic flows.
outage() {
  label=$1; port=$2
  start_sampler "$OUT/$label-timeline.txt" "$RCVD"
  ib_write_bw -d rxe1 -x "$gid" -F -n "$ITERS" -s 65536 -p "$port" >"$OUT/$label-server.log" 2>&1 &
  srv=$!
  wait_listen "$port" 10 || log "$label: server did not listen"
  now; start=$NOW
  timeout "$RUN_LIMIT" ib_write_bw -d rxe0 -x "$gid" -F -n "$ITERS" -s 65536 -p "$port" 10.9.0.2 \
    >"$OUT/$label-client.log" 2>&1 &
  cli=$!
  # Inject only once data flows: opening the device and connecting takes ~1-2 s in TCG.
  r0=$(rcvd); n=0
  while [ $(( $(rcvd) - r0 )) -lt 2000 ] && [ "$n" -lt 150 ]; do sleep 0.1; n=$((n + 1)); done
  sleep 1
  # The outage window is measured from after the injection took effect to before the restore starts,
  # so packets counted "during" really arrived while the link was out.
  case "$label" in
    peer_down) ip link set vb down ;;
    local_down) ip link set va down ;;
    drop) tc qdisc add dev vb ingress && tc filter add dev vb parent ffff: matchall action drop ;;
  esac
  now; down=$NOW
  read -r carrier </sys/class/net/va/carrier 2>/dev/null || carrier=0
  sleep "$OUTAGE"
  now; upt=$NOW
  running=0; kill -0 "$cli" 2>/dev/null && running=1
  case "$label" in
    peer_down) ip link set vb up ;;
    local_down) ip link set va up ;;
    drop) tc qdisc del dev vb ingress ;;
  esac
  # Wait for the client, but call it hung once nothing is delivered for STALL_LIMIT seconds after the
  # restore (rxe RC QPs can stay in RTS forever after a link flap, notes §6): then end it by PID.
  hung=0; last=$(rcvd); now; last_t=$NOW
  while kill -0 "$cli" 2>/dev/null; do
    sleep 0.5
    r=$(rcvd); now
    if [ "$r" -ne "$last" ]; then last=$r; last_t=$NOW
    elif awk -v a="$last_t" -v b="$NOW" -v l="$STALL_LIMIT" 'BEGIN { exit !(b - a > l) }'; then
      hung=1; log "$label: no delivery for ${STALL_LIMIT}s, ending the client (pid $cli)"
      kill "$cli" 2>/dev/null; break
    fi
  done
  wait "$cli"; crc=$?
  now; end=$NOW
  # The server may wait forever for a client that died; give it a moment, then end it by PID.
  n=0; while kill -0 "$srv" 2>/dev/null && [ "$n" -lt 50 ]; do sleep 0.2; n=$((n + 1)); done
  kill "$srv" 2>/dev/null; wait "$srv"; src=$?
  stop_sampler
  # Wait for rxe ports to be ACTIVE again before the next run.
  n=0; while ! rdma link show rxe0/1 | grep -q 'state ACTIVE' && [ "$n" -lt 50 ]; do sleep 0.2; n=$((n + 1)); done

  # From the timeline: packets before / during / after, the longest delivery stall, recovery after up.
  awk -v s="$start" -v d="$down" -v u="$upt" '
    NR == 1 { prev_r = $2; prev_t = $1; last_inc = $1 }
    {
      t = $1; r = $2
      if (r > prev_r) {
        if (t <= d) before += r - prev_r
        else if (t > d + 0.5 && t <= u) during += r - prev_r
        else if (t > u) { after += r - prev_r; if (first_after == "") first_after = t }
        if (t - last_inc > stall) stall = t - last_inc
        last_inc = t
      }
      prev_r = r; prev_t = t
    }
    END {
      printf "%d %d %d %d %s\n", before, during, after, stall * 1000, (first_after == "" ? "null" : int((first_after - u) * 1000))
    }' "$OUT/$label-timeline.txt" >/tmp/tl
  read -r before during after stall_ms recovery_ms </tmp/tl
  log "$label: before=$before during=$during after=$after stall_ms=$stall_ms recovery_ms=$recovery_ms client_rc=$crc server_rc=$src carrier_during=$carrier"
  metric "${label}_outage_seconds" "$(awk -v a="$down" -v b="$upt" 'BEGIN { printf "%.2f", b - a }')"
  metric "${label}_pkts_before" "$before"
  metric "${label}_pkts_during" "$during"
  metric "${label}_pkts_after" "$after"
  metric "${label}_longest_stall_ms" "$stall_ms"
  metric "${label}_recovery_ms" "$recovery_ms"
  metric "${label}_client_rc" "$crc"
  metric "${label}_run_seconds" "$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')"
  metric "${label}_client_still_running_at_restore" "$running"
  metric "${label}_va_carrier_during" "$carrier"
  err=$(grep -m1 -E 'Failed status' "$OUT/$label-client.log" | tr -s ' ')
  metric_str "${label}_client_error" "${err:-none}"
  if [ "$hung" -eq 1 ]; then outcome="hung (no delivery for ${STALL_LIMIT}s after the restore, client ended)"
  elif [ "$crc" -eq 0 ]; then outcome="completed all $ITERS writes"
  elif [ "$crc" -eq 124 ]; then outcome="still running after ${RUN_LIMIT}s (timeout)"
  else outcome="client failed (rc $crc): $(grep -m1 'Failed status' "$OUT/$label-client.log" | tr -s ' ')"
  fi
  metric_str "${label}_outcome" "$outcome"
  metric "${label}_hung" "$([ "$hung" -eq 1 ] && echo true || echo false)"
}

# The claims are about the test bed: the fault was injected while data flowed, it really stopped
# delivery, and delivery came back when the fault was removed. How perftest's QP ended (completed,
# error, hung) is rxe's behaviour and is reported as the outcome, not judged.
outage peer_down 18530
[ "$before" -gt 0 ]; check peer_down_traffic_flowed_before $? "$before packets before the link went down"
[ "$running" -eq 1 ]; check peer_down_outage_fell_mid_run $? "client still running when the link came back"
[ "$carrier" -eq 0 ]; check peer_down_va_lost_carrier $? "va carrier=$carrier during the outage"
[ $((during * 10)) -lt "$before" ]; check peer_down_delivery_stopped $? "$during packets delivered during the outage (vs $before before)"
[ "$after" -gt 0 ] && [ "$recovery_ms" != null ]
check peer_down_delivery_resumed $? "$after packets after the link came back, first after ${recovery_ms} ms; outcome: $outcome"

outage drop 18531
[ "$before" -gt 0 ]; check drop_traffic_flowed_before $? "$before packets before the drop began"
[ "$running" -eq 1 ]; check drop_outage_fell_mid_run $? "client still running when the drop ended"
[ $((during * 10)) -lt "$before" ]; check drop_delivery_stopped $? "$during packets delivered during the drop (vs $before before)"
[ "$after" -gt 0 ] && [ "$recovery_ms" != null ]
check drop_delivery_resumed $? "$after packets after the drop ended, first after ${recovery_ms} ms; outcome: $outcome"

outage local_down 18532
[ "$before" -gt 0 ]; check local_down_traffic_flowed_before $? "$before packets before va went down"
[ $((during * 10)) -lt "$before" ]; check local_down_delivery_stopped $? "$during packets delivered while va was down; outcome: $outcome"
finish
