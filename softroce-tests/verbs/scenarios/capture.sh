# capture: tcpdump on the veth while ib_write_bw runs 4 RC QPs from rxe0 to rxe1.
# Claims: RoCEv2 (UDP 4791) crosses the wire; the requester uses one distinct UDP source port per QP;
# the ports are the kernel's (flow label 0): fl = lqpn*rqpn folded (rdma_calc_flow_label),
# sport = 0xC000 | ((fl & 0x3FFF) ^ (fl >> 14)) — which is the entropy Prism's verbs backend will steer.
. /prism/lib.sh
NQP=${NQP:-4}
ITERS=${ITERS:-150}   # 64 KiB writes per QP: ~10 MB per QP, ~40k packets in all

wire_setup; check wire_up $? "two rxe devices on the va/vb veth pair"
gid=$(roce_v2_ipv4_gid_index rxe0) || gid=1

# A 32 MiB capture buffer: tcpdump gets little CPU while perftest runs, and kernel drops would skew
# the per-port counts (they are reported below).
tcpdump -i va -nn -s 96 -B 32768 -c 100000 -w "$OUT/capture.pcap" udp port 4791 2>"$OUT/tcpdump.log" &
td=$!
for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  grep -q 'listening on' "$OUT/tcpdump.log" && break
  sleep 0.2
done

ib_write_bw -d rxe1 -x "$gid" -F -n "$ITERS" -s 65536 -q "$NQP" -u 17 -p 18520 >"$OUT/server.log" 2>&1 &
srv=$!
wait_listen 18520 10 || log "server did not listen"
timeout 120 ib_write_bw -d rxe0 -x "$gid" -F -n "$ITERS" -s 65536 -q "$NQP" -u 17 -p 18520 10.9.0.2 \
  >"$OUT/client.log" 2>&1
crc=$?
wait "$srv"; src=$?
sleep 0.5
kill "$td" 2>/dev/null; wait "$td"
metric capture_dropped_by_kernel "$(awk '/dropped by kernel/ { print $1 }' "$OUT/tcpdump.log")"
[ "$crc" -eq 0 ] && [ "$src" -eq 0 ]; check "ib_write_bw_with_${NQP}_qps_ran" $? "client rc=$crc server rc=$src"

# Per (source address, source port): packet count, from the capture.
tcpdump -r "$OUT/capture.pcap" -nn 2>/dev/null \
  | awk '$2 == "IP" && $5 ~ /\.4791:$/ { n = split($3, a, "."); port = a[n]; ip = a[1] "." a[2] "." a[3] "." a[4]; c[ip " " port]++ }
         END { for (k in c) print k, c[k] }' | sort >"$OUT/ports.txt"
log "packets per source (ip port count):"; cat "$OUT/ports.txt" >&2
total=$(awk '{ s += $3 } END { print s + 0 }' "$OUT/ports.txt")
metric rocev2_packets_captured "$total"
[ "$total" -gt 100 ]; check rocev2_udp_4791_on_the_wire $? "$total packets to UDP 4791 on va"

awk '$1 == "10.9.0.1" { print $2 }' "$OUT/ports.txt" | sort -n >"$OUT/req_ports.txt"
nports=$(grep -c . "$OUT/req_ports.txt")
metric qps "$NQP"
metric distinct_requester_source_ports "$nports"
[ "$nports" -eq "$NQP" ]; check one_source_port_per_qp $? "$nports distinct source ports from rxe0 for $NQP QPs: $(tr '\n' ' ' <"$OUT/req_ports.txt")"

# The ports the kernel's formula predicts from the QPNs perftest printed (local[i] paired with remote[i]).
awk '/local address:/ { for (i = 1; i <= NF; i++) if ($i == "QPN") print $(i + 1) }' "$OUT/client.log" >/tmp/lq
awk '/remote address:/ { for (i = 1; i <= NF; i++) if ($i == "QPN") print $(i + 1) }' "$OUT/client.log" >/tmp/rq
paste /tmp/lq /tmp/rq | while read -r l r; do
  fl=$(( l * r ))
  fl=$(( fl ^ (fl >> 20) )); fl=$(( fl ^ (fl >> 40) )); fl=$(( fl & 0xFFFFF ))
  echo $(( 0xC000 | ((fl & 0x3FFF) ^ ((fl & 0xFC000) >> 14)) ))
done | sort -n >"$OUT/predicted_ports.txt"
log "predicted: $(tr '\n' ' ' <"$OUT/predicted_ports.txt")"
[ -s "$OUT/predicted_ports.txt" ] && cmp -s "$OUT/predicted_ports.txt" "$OUT/req_ports.txt"
check source_ports_follow_the_flow_label_formula $? "predicted $(tr '\n' ' ' <"$OUT/predicted_ports.txt")"
# The responder builds its own address vector with the same (symmetric) QPN product, so RC ACKs
# leave rxe1 on the same ports the data used: one 5-tuple pair per QP in both directions.
awk '$1 == "10.9.0.2" { print $2 }' "$OUT/ports.txt" | sort -n >"$OUT/resp_ports.txt"
same=false; cmp -s "$OUT/resp_ports.txt" "$OUT/req_ports.txt" && same=true
metric responder_ports_equal_requester_ports "$same"
awk '$2 < 49152 || $2 > 65535 { bad = 1 } END { exit bad }' "$OUT/ports.txt"
check ports_in_the_rocev2_entropy_range $? "every source port in 0xC000-0xFFFF"

# How evenly the QPs shared the wire (perftest round-robins posts, so roughly even is expected).
mn=$(awk '$1 == "10.9.0.1" { print $3 }' "$OUT/ports.txt" | sort -n | head -n1)
mx=$(awk '$1 == "10.9.0.1" { print $3 }' "$OUT/ports.txt" | sort -n | tail -n1)
metric min_packets_per_port "${mn:-0}"
metric max_packets_per_port "${mx:-0}"
finish
