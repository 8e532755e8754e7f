# fabric-2vm (guest side): one of the two VMs of the host's leaf-spine fabric (lib/fabric.sh builds it and
# boots both). ROLE=a runs prism-perf rank 0, ROLE=b rank 1. Each VM has two NICs = two rails, eth0 and
# eth1 (taps in its leaf's namespace on the host), with rxe0 on eth0 and rxe1 on eth1.
#   VM A: eth0 10.1.0.2/24 (gw 10.1.0.1), eth1 10.1.1.2/24 (gw 10.1.1.1)    behind leaf A
#   VM B: eth0 10.2.0.2/24 (gw 10.2.0.1), eth1 10.2.1.2/24 (gw 10.2.1.1)    behind leaf B
# Source/oif policy routing keeps each rail's packets on its own NIC (rxe routes with oif = its netdev).
# Claims (this VM): NICs and rxe devices up, prism-perf exits 0
# with #wrong = 0 at every size (rank 0 judges the data), PRISM_STATS names the verbs backend.
# The spine counters (the spray claim) are read by the host.
. /prism/lib.sh
ROLE=${ROLE:-a}
SIZES_FLAGS=${SIZES_FLAGS:-"-b 1M -e 4M -f 2"}
NSIZES=${NSIZES:-3}
ITER_FLAGS=${ITER_FLAGS:-"-n 3 -w 1"}
PERF_LIMIT=${PERF_LIMIT:-400}
case "$ROLE" in a) me=1; peer=2; rank=0 ;; b) me=2; peer=1; rank=1 ;; *) me=0 ;; esac
metric_str role "$ROLE"
metric_str transport "$TRANSPORT"

modprobe -a virtio_net rdma_rxe
ip link set lo up
ok=0
for r in 0 1; do
  dev=eth$r
  ip link set "$dev" up || ok=1
  ip addr add "10.$me.$r.2/24" dev "$dev" || ok=1
  echo 0 >/proc/sys/net/ipv4/conf/$dev/rp_filter
  ip route add 10.0.0.0/8 via "10.$me.$r.1" dev "$dev" src "10.$me.$r.2" table $((10 + r))
  ip rule add pref $((10 + r)) from "10.$me.$r.2" lookup $((10 + r))
  ip rule add pref $((20 + r)) oif "$dev" lookup $((10 + r))
  rdma link add "rxe$r" type rxe netdev "$dev" || ok=1
done
echo 0 >/proc/sys/net/ipv4/conf/all/rp_filter
ip route add default via "10.$me.0.1" dev eth0
[ "$ok" -eq 0 ] && [ "$me" -ne 0 ]; check nics_and_rxe_up $? "role $ROLE: $(ip -br addr | tr '\n' ' ') $(rdma link show | tr '\n' ' ')"
PATHS=${PATHS:-64}  # 64 entropies per rail: 256 flows for the leaves to hash (16 gave spine shares 0.43-0.57)
t0=$(up)
# shellcheck disable=SC2046,SC2086
env $(prism_env rxe0,rxe1 eth0,eth1) PRISM_PATH=spray PRISM_PATHS="$PATHS" timeout "$PERF_LIMIT" \
  prism-perf all_reduce $SIZES_FLAGS $ITER_FLAGS -c 1 -T 180 --rank $rank --nranks 2 \
  --rendezvous 10.1.0.2:29800 --json "$OUT/perf.json" >"$OUT/perf.log" 2>&1
rc=$?
tail -n 12 "$OUT/perf.log" >&2
metric prism_perf_seconds "$(awk -v a="$t0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')"
metric paths "$PATHS"
[ "$rc" -eq 0 ]; check prism_perf_exit_0 $? "rank $rank rc=$rc"
[ "$rank" -eq 0 ] && check_perf prism "$OUT/perf.json" "$NSIZES"
check_backend prism "$OUT/perf.json.rank$rank.stats.json"
finish
