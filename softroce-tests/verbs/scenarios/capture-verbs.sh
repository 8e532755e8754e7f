# capture-verbs: tcpdump on the veth while prism-perf (2 ranks: rank 0 on rxe0/va, rank 1 on rxe1/vb)
# runs over Prism's verbs backend, once per PRISM_PATHS value in PATHS_LIST (default 4 and 8).
# Claims per run: both ranks exit 0 with #wrong = 0; both ranks' PRISM_STATS name the verbs backend;
# RoCEv2 (UDP 4791) crossed the wire; in each direction the number of distinct UDP source ports that
# carried Prism's data (packets of at least DATA_MIN_LEN UDP payload bytes: RDMA WRITE segments, not the
# small control SENDs) equals PRISM_PATHS, each in the RoCEv2 entropy range 0xC000-0xFFFF.
. /prism/lib.sh
PATHS_LIST=${PATHS_LIST:-"4 8"}
SIZES_FLAGS=${SIZES_FLAGS:-"-b 4M -e 4M"}
ITER_FLAGS=${ITER_FLAGS:-"-n 2 -w 1"}
DATA_MIN_LEN=${DATA_MIN_LEN:-512}

wire_setup; check wire_up $? "two rxe devices on the va/vb veth pair"
metric_str transport "$TRANSPORT"
if [ "$TRANSPORT" = verbs ]; then FILTER="udp dst port 4791"; else FILTER="udp and not port 4791"; fi

for paths in $PATHS_LIST; do
  l="paths$paths"
  tcpdump -i va -nn -s 96 -B 32768 -w "$OUT/$l.pcap" "$FILTER" 2>"$OUT/$l-tcpdump.log" &
  td=$!
  for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
    grep -q 'listening on' "$OUT/$l-tcpdump.log" && break
    sleep 0.2
  done
  # shellcheck disable=SC2086
  run_two_ranks "$l" "$(prism_env rxe0 va) PRISM_PATHS=$paths" "$(prism_env rxe1 vb) PRISM_PATHS=$paths" \
    all_reduce $SIZES_FLAGS $ITER_FLAGS -c 1 -T 120
  sleep 0.5
  kill "$td" 2>/dev/null; wait "$td"
  metric "${l}_capture_dropped_by_kernel" "$(awk '/dropped by kernel/ { print $1 }' "$OUT/$l-tcpdump.log")"
  [ "$RC0" -eq 0 ] && [ "$RC1" -eq 0 ]; check "${l}_prism_perf_exit_0" $? "rank 0 rc=$RC0, rank 1 rc=$RC1"
  check_perf "$l" "$OUT/$l.rank0.json" 1
  check_backend "$l" "$OUT/$l.rank0.json.rank0.stats.json" "$OUT/$l.rank1.json.rank1.stats.json"

  # "src-ip sport udp-payload-length" per packet -> per (src ip, sport): packets, data packets.
  tcpdump -r "$OUT/$l.pcap" -nn 2>/dev/null | awk '$2 == "IP" {
      n = split($3, a, "."); ip = a[1] "." a[2] "." a[3] "." a[4]; len = $NF
      c[ip " " a[n]]++; if (len + 0 >= '"$DATA_MIN_LEN"') d[ip " " a[n]]++ }
    END { for (k in c) print k, c[k], d[k] + 0 }' | sort >"$OUT/$l-ports.txt"
  log "$l: per source (ip port packets data_packets):"; cat "$OUT/$l-ports.txt" >&2
  total=$(awk '{ s += $3 } END { print s + 0 }' "$OUT/$l-ports.txt")
  metric "${l}_packets_captured" "$total"
  [ "$total" -gt 100 ]; check "${l}_prism_packets_on_the_wire" $? "$total packets ($FILTER) on va"
  for dir in "10.9.0.1 rank0_to_rank1" "10.9.0.2 rank1_to_rank0"; do
    set -- $dir
    ports=$(awk -v ip="$1" '$1 == ip && $4 > 0 { print $2 }' "$OUT/$l-ports.txt" | sort -n | tr '\n' ' ')
    n=$(echo $ports | wc -w)
    mn=$(awk -v ip="$1" '$1 == ip && $4 > 0 { print $4 }' "$OUT/$l-ports.txt" | sort -n | head -n1)
    mx=$(awk -v ip="$1" '$1 == ip && $4 > 0 { print $4 }' "$OUT/$l-ports.txt" | sort -n | tail -n1)
    metric "${l}_${2}_distinct_data_source_ports" "$n"
    metric "${l}_${2}_min_data_packets_per_port" "${mn:-0}"
    metric "${l}_${2}_max_data_packets_per_port" "${mx:-0}"
    [ "$n" -eq "$paths" ]; check "${l}_${2}_data_source_ports_equal_PRISM_PATHS" $? "$n distinct source ports carried data from $1 (PRISM_PATHS=$paths): $ports"
    if [ "$TRANSPORT" = verbs ]; then
      bad=$(for p in $ports; do [ "$p" -ge 49152 ] && [ "$p" -le 65535 ] || echo "$p"; done)
      [ -z "$bad" ]; check "${l}_${2}_ports_in_rocev2_entropy_range" $? "outside 0xC000-0xFFFF: ${bad:-none}"
    fi
  done
done
finish
