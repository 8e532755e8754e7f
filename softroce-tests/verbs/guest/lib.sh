# Guest-side helpers, sourced by every scenario (POSIX sh: the guest has dash, no bash guarantees).
# A scenario records numbers with `metric`, checks with `check`, and ends with `finish`, which writes
# /out/result.json: {"scenario", "pass", "failed_checks", "metrics", "checks"}.

OUT=/out
mkdir -p "$OUT"
: >/tmp/metrics
: >/tmp/checks

# Guest uptime in seconds. Builtins only where it is called often: under TCG on a busy host a fork
# costs tens to hundreds of milliseconds.
up() { read -r _u _ </proc/uptime; echo "$_u"; }
# Logs go to stderr so that functions can return values on stdout.
log() { read -r _u _ </proc/uptime; echo "[$_u] $*" >&2; }
# is_pos VALUE: VALUE is a number greater than zero.
is_pos() { printf '%s' "$1" | grep -Eq '^[0-9]+(\.[0-9]+)?$' && awk -v v="$1" 'BEGIN { exit !(v > 0) }'; }

# metric NAME VALUE: a number (or true/false/null) for results.json; anything else is stored as null.
metric() {
  log "metric $1 = $2"
  _mv=$2
  case "$_mv" in
    true|false|null) ;;
    ''|*[!0-9.-]*|*.*.*|?*-*|.*|*.|-|-.*) _mv=null ;;
  esac
  printf '"%s": %s\n' "$1" "$_mv" >>/tmp/metrics
}
# metric_str NAME TEXT: a string metric (quotes and backslashes stripped, it is a label, not data).
metric_str() {
  log "metric $1 = $2"
  printf '"%s": "%s"\n' "$1" "$(printf '%s' "$2" | tr -d '"\\' | tr '\n' ' ')" >>/tmp/metrics
}

# check NAME CONDITION-STATUS DETAIL: one claim of the scenario; a false claim fails the scenario.
# Usage: [ "$x" -gt 0 ]; check traffic_crossed_the_veth $? "va tx_packets delta $x"
check() {
  if [ "$2" -eq 0 ]; then _cv=true; log "CHECK ok   $1: $3"; else _cv=false; log "CHECK FAIL $1: $3"; fi
  printf '{"name": "%s", "ok": %s, "detail": "%s"}\n' "$1" "$_cv" "$(printf '%s' "$3" | tr -d '"\\' | tr '\n' ' ')" >>/tmp/checks
}

finish() {
  nfail=$(grep -c '"ok": false' /tmp/checks)
  nchk=$(grep -c . /tmp/checks)
  pass=true
  { [ "$nfail" -eq 0 ] && [ "$nchk" -gt 0 ]; } || pass=false
  {
    printf '{\n  "scenario": "%s",\n  "pass": %s,\n  "failed_checks": %s,\n' "$SCENARIO" "$pass" "$nfail"
    printf '  "guest_seconds": %s,\n' "$(awk -v a="$T0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')"
    printf '  "metrics": {'
    sed 's/^/    /; $!s/$/,/' /tmp/metrics | sed '1s/^/\n/'
    printf '  },\n  "checks": [\n'
    sed 's/^/    /; $!s/$/,/' /tmp/checks
    printf '  ]\n}\n'
  } >"$OUT/result.json"
  log "scenario $SCENARIO: pass=$pass ($nfail of $nchk checks failed)"
  [ "$pass" = true ]
}

T0=$(up)
SCENARIO=$(basename "$0" .sh)

# Two rxe devices on the two ends of one veth pair, in one namespace, with policy routing keyed on the
# output interface: rxe (and ib_core's address resolution) set the flow's oif to its netdev, so RoCE
# packets leave through the wire while received packets (no oif) still hit the local table.
# va = 10.9.0.1 (rxe0), vb = 10.9.0.2 (rxe1). MTU from $MTU (1500: rxe path MTU 1024; 9000: 4096).
# The va/vb veth pair both setups start from (MTU from $MTU, default 1500).
veth_pair() {
  modprobe -a veth rdma_rxe || return 1
  ip link set lo up
  ip link add va type veth peer name vb || return 1
  ip link set va mtu "${MTU:-1500}"
  ip link set vb mtu "${MTU:-1500}"
}

wire_setup() {
  veth_pair || return 1
  ip addr add 10.9.0.1/24 dev va
  ip addr add 10.9.0.2/24 dev vb
  for i in all default va vb; do
    echo 1 >/proc/sys/net/ipv4/conf/$i/accept_local
    echo 0 >/proc/sys/net/ipv4/conf/$i/rp_filter
  done
  ip link set va up
  ip link set vb up
  ip rule add pref 10 oif va lookup 100
  ip rule add pref 11 oif vb lookup 101
  ip rule add pref 1000 lookup local
  ip rule del pref 0
  ip route add 10.9.0.0/24 dev va src 10.9.0.1 table 100
  ip route add 10.9.0.0/24 dev vb src 10.9.0.2 table 101
  rdma link add rxe0 type rxe netdev va || return 1
  rdma link add rxe1 type rxe netdev vb || return 1
  # Carrier comes up asynchronously on veth; rxe ports follow it.
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    if rdma link show rxe0/1 | grep -q 'state ACTIVE' && rdma link show rxe1/1 | grep -q 'state ACTIVE'; then
      log "wire up: $(rdma link show | tr '\n' ' ')"
      return 0
    fi
    sleep 0.5
  done
  log "rxe ports did not become ACTIVE: $(rdma link show | tr '\n' ' ')"
  return 1
}

# One rxe (rxe0) on one end of a veth pair with its own address and no policy routing: both ranks on
# rxe0 reach each other through rxe's loopback path (notes 2.1). The wire setup's rules would send rxe0's
# packets out of va to rxe1 instead, so two processes sharing rxe0 need this one.
loop_setup() {
  veth_pair || return 1
  ip addr add 10.9.0.1/24 dev va
  ip link set va up
  ip link set vb up
  rdma link add rxe0 type rxe netdev va || return 1
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    if rdma link show rxe0/1 | grep -q 'state ACTIVE'; then
      log "loop up: $(rdma link show | tr '\n' ' ')"
      return 0
    fi
    sleep 0.5
  done
  log "rxe0 did not become ACTIVE: $(rdma link show | tr '\n' ' ')"
  return 1
}

# The RoCEv2 GID index whose GID is IPv4-mapped (1 on this kernel's rxe; looked up, not assumed).
roce_v2_ipv4_gid_index() {
  dev=$1
  for g in /sys/class/infiniband/"$dev"/ports/1/gids/*; do
    i=${g##*/}
    case "$(cat "$g")" in
      0000:0000:0000:0000:0000:ffff:*)
        if [ "$(cat /sys/class/infiniband/"$dev"/ports/1/gid_attrs/types/"$i" 2>/dev/null)" = "RoCE v2" ]; then
          echo "$i"; return 0
        fi ;;
    esac
  done
  return 1
}

hw_counter() { cat "/sys/class/infiniband/$1/ports/1/hw_counters/$2" 2>/dev/null || echo 0; }
net_stat() { cat "/sys/class/net/$1/statistics/$2"; }

# Wait until something listens on TCP port $1 (perftest servers), at most $2 seconds.
wait_listen() {
  n=0
  while [ "$n" -lt $(( $2 * 10 )) ]; do
    ss -ltn 2>/dev/null | grep -q ":$1 " && return 0
    sleep 0.1; n=$((n + 1))
  done
  return 1
}

# ib_write_bw's result row "#bytes #iterations BWpeak BWaverage MsgRate" (tab- or space-separated)
# -> BW average in MB/s.
perftest_bw() { awk 'NF == 5 && $1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && $4 ~ /^[0-9.]+$/ { bw = $4 } END { if (bw != "") print bw }' "$1"; }

# The active path MTU of an rxe port in bytes (ibv_devinfo: "active_mtu: 4096 (5)").
active_mtu() { ibv_devinfo -d "$1" 2>/dev/null | awk '/active_mtu:/ { print $2; exit }'; }

# Counter sampler: one line "uptime value" every ~50 ms into FILE, with builtins plus one `sleep` fork
# per sample (a fork costs tens of milliseconds in TCG while perftest keeps the vCPUs busy).
# start_sampler FILE COUNTER_FILE; stop_sampler.
start_sampler() {
  rm -f /tmp/stop-sampler
  (
    while [ ! -f /tmp/stop-sampler ]; do
      read -r t _ </proc/uptime
      read -r v <"$2"
      echo "$t $v"
      sleep 0.05
    done
  ) >"$1" &
  SAMPLER=$!
}
stop_sampler() { touch /tmp/stop-sampler; wait "$SAMPLER"; }

# sampled_rate FILE BYTES: BYTES divided by the time between the first and the last change of the
# sampled counter, in MB/s (10^6 B/s). perftest's own figure relies on calibrating the TSC against
# gettimeofday, which fails under TCG on a busy host (it then prints "Correlation coefficient r^2 < 0.9"
# and reports 0), so the test bed measures delivery itself.
sampled_rate() {
  awk -v bytes="$2" 'NR == 1 { v0 = $2; prev = $2; next }
    $2 != prev { if (first == "") first = t_prev; last = $1 }
    { prev = $2; t_prev = $1 }
    END { if (first != "" && last > first) printf "%.2f\n", bytes / (last - first) / 1e6 }' "$1"
}

# --- Prism over the verbs backend ---------------------------------------------------------------------
# TRANSPORT selects Prism's backend in the Prism scenarios: unset = verbs (what they exist to prove);
# `udp` runs the same scenario over the UDP backend (PRISM_TRANSPORT=udp). The backend each rank really
# used is read back from its statistics (PRISM_STATS) and must equal TRANSPORT, so a silent fallback to
# UDP fails the scenario.
TRANSPORT=${TRANSPORT:-verbs}

# wire_pair A B NET RXEA RXEB TABLE: one more veth pair A<->B on NET.0/24 (A = .1, B = .2) with rxe devices
# and the same oif-keyed policy routing as wire_setup (tables TABLE and TABLE+1). Call after wire_setup.
wire_pair() {
  ip link add "$1" type veth peer name "$2" || return 1
  ip link set "$1" mtu "${MTU:-1500}"; ip link set "$2" mtu "${MTU:-1500}"
  ip addr add "$3.1/24" dev "$1"; ip addr add "$3.2/24" dev "$2"
  for i in "$1" "$2"; do
    echo 1 >/proc/sys/net/ipv4/conf/$i/accept_local
    echo 0 >/proc/sys/net/ipv4/conf/$i/rp_filter
  done
  ip link set "$1" up; ip link set "$2" up
  ip rule add pref "$6" oif "$1" lookup "$6"
  ip rule add pref $(($6 + 1)) oif "$2" lookup $(($6 + 1))
  ip route add "$3.0/24" dev "$1" src "$3.1" table "$6"
  ip route add "$3.0/24" dev "$2" src "$3.2" table $(($6 + 1))
  rdma link add "$4" type rxe netdev "$1" || return 1
  rdma link add "$5" type rxe netdev "$2" || return 1
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    if rdma link show "$4/1" | grep -q 'state ACTIVE' && rdma link show "$5/1" | grep -q 'state ACTIVE'; then
      log "wire pair up: $(rdma link show | tr '\n' ' ')"
      return 0
    fi
    sleep 0.5
  done
  log "rxe ports of $4/$5 did not become ACTIVE"
  return 1
}

# prism_env RANK_HCAS RANK_IFNAMES: the environment of one Prism rank (printed for `env`), the chosen
# backend plus its devices. Other PRISM_* knobs come from the scenario's environment (--guest-env).
# LEGACY_NO_TRANSPORT_VAR=1 (debugging only) leaves PRISM_TRANSPORT out, for plugin builds older than it.
prism_env() {
  if [ "$TRANSPORT" = verbs ]; then
    echo "PRISM_TRANSPORT=verbs PRISM_IB_HCA=$1 PRISM_IFNAMES=$2"
  elif [ "${LEGACY_NO_TRANSPORT_VAR:-0}" = 1 ]; then
    echo "PRISM_IFNAMES=$2"
  else
    echo "PRISM_TRANSPORT=$TRANSPORT PRISM_IFNAMES=$2"
  fi
}

# stats_backend FILE: the backend named in one PRISM_STATS file ("verbs", "udp"; empty if none).
# An explicit "backend" field first (top level, or per rail), else the engine's config description.
stats_backend() {
  jq -r '[.backend?, .transport?, (.rails // [] | .[] | .backend?), ((.config.transport // "") | tostring
          | capture("(backend|transport)=(?<b>[a-z]+)")? | .b)] | map(select(. != null and . != "")) | first // ""' \
    "$1" 2>/dev/null
}

# check_backend LABEL FILE...: every stats file exists and names $TRANSPORT as its backend.
check_backend() {
  _cb_label=$1; shift
  _cb_seen=""; _cb_ok=0
  for _cb_f in "$@"; do
    if [ -f "$_cb_f" ]; then _cb_b=$(stats_backend "$_cb_f"); else _cb_b="(no stats file)"; fi
    _cb_seen="$_cb_seen $(basename "$_cb_f")=${_cb_b:-none}"
    [ "$_cb_b" = "$TRANSPORT" ] || _cb_ok=1
  done
  [ $# -gt 0 ] || _cb_ok=1
  check "${_cb_label}_backend_is_$TRANSPORT" "$_cb_ok" "backend in PRISM_STATS:$_cb_seen"
}

# perf_rows JSON: "bytes algbw busbw wrong" per size from a prism-perf --json file (GB/s as printed).
perf_rows() { [ -f "$1" ] && jq -r '.results[] | "\(.bytes) \(.algbw) \(.busbw) \(.wrong)"' "$1"; }

# check_perf LABEL JSON NSIZES: every size reported and #wrong = 0 at each; busbw per size as metrics.
check_perf() {
  perf_rows "$2" >/tmp/rows || : >/tmp/rows
  _cp_n=$(grep -c . /tmp/rows)
  _cp_bad=$(awk '$4 != "0" { printf "%s(#wrong=%s) ", $1, $4 }' /tmp/rows)
  metric "$1_sizes_reported" "$_cp_n"
  [ "$_cp_n" -ge "$3" ]; check "$1_every_size_reported" $? "$_cp_n of $3 sizes in $(basename "$2")"
  [ "$_cp_n" -gt 0 ] && [ -z "$_cp_bad" ]; check "$1_wrong_0_at_every_size" $? "${_cp_bad:-#wrong = 0 at all $_cp_n sizes}"
  while read -r _cp_size _cp_alg _cp_bus _; do
    metric "$1_busbw_MBps_$_cp_size" "$(awk -v b="$_cp_bus" 'BEGIN { printf "%.2f", b * 1000 }')"
    metric "$1_algbw_MBps_$_cp_size" "$(awk -v b="$_cp_alg" 'BEGIN { printf "%.2f", b * 1000 }')"
  done </tmp/rows
}

# run_two_ranks LABEL RANK0_ENV RANK1_ENV PERF_ARGS...: prism-perf rank 0 and rank 1 in this guest, each
# with its own environment, rendezvous on 127.0.0.1; JSON (and PRISM_STATS) per rank in $OUT.
# Sets RC0 RC1. Both ranks are bounded by `timeout` (PERF_LIMIT seconds).
run_two_ranks() {
  label=$1; e0=$2; e1=$3; shift 3
  port=$((29600 + $(printf '%s' "$label" | cksum | cut -c1-3) % 300))
  # shellcheck disable=SC2086
  env $e0 timeout "${PERF_LIMIT:-300}" prism-perf "$@" --rank 0 --nranks 2 --rendezvous 127.0.0.1:$port \
    --json "$OUT/$label.rank0.json" >"$OUT/$label.rank0.log" 2>&1 &
  p0=$!
  # shellcheck disable=SC2086
  env $e1 timeout "${PERF_LIMIT:-300}" prism-perf "$@" --rank 1 --nranks 2 --rendezvous 127.0.0.1:$port \
    --json "$OUT/$label.rank1.json" >"$OUT/$label.rank1.log" 2>&1
  RC1=$?
  wait "$p0"; RC0=$?
  log "$label: rank0 rc=$RC0 rank1 rc=$RC1"
  tail -n 12 "$OUT/$label.rank0.log" >&2
}
