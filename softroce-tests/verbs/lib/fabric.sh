# shellcheck shell=bash
# fabric-2vm, host side (sourced by run.sh, not run): two TCG guests, each with two NICs (two rails),
# joined by a leaf-spine fabric of network namespaces on the host, with Prism's prism-perf rank 0 in
# VM A and rank 1 in VM B (guest side: scenarios/fabric-2vm.sh).
#
#   VM A eth0/eth1 = taps ta0/ta1 in leaf A (10.1.0.1/24, 10.1.1.1/24)
#   VM B eth0/eth1 = taps tb0/tb1 in leaf B (10.2.0.1/24, 10.2.1.1/24)
#   leaf A <-> spine 1, spine 2 <-> leaf B (routed /30 links); the leaves hold one 2-way multipath route
#   to the other side with the L4 hash (fib_multipath_hash_policy=1), so each RoCEv2 flow (UDP source
#   port = one QP's flow label) takes one spine, and different flows spread over both.
# Each VM is one rack: both its rails hang from its leaf. (With one leaf per rail and both VMs on it,
# rail r's traffic would turn around in leaf r and never reach a spine: nothing to spray across.)
#
# Host checks: both guests finished; per-spine forwarded bytes (interface counters read from the spine
# namespaces before the VMs boot and after they power off) show both spines carried Prism's traffic,
# each within 20 % of an even split (share in [0.4, 0.6]); every namespace and tap is gone afterwards
# (`ip netns list` equal before and after). Namespaces, taps and qemu processes are removed by exact
# name / PID on every exit path (run.sh's EXIT trap calls fabric_cleanup).

FAB_NS=""      # namespaces this run created (exact names)
FAB_PIDS=""    # qemu PIDs this run started

fab_x() { ip netns exec "$1" "${@:2}"; }
# ok_if CMD...: 0 if CMD succeeds, else 1, printed (run.sh runs under `set -e`).
ok_if() { if "$@"; then echo 0; else echo 1; fi; }

fabric_cleanup() {
  local p n
  for p in $FAB_PIDS; do
    kill "$p" 2>/dev/null || true
  done
  [ -n "$FAB_PIDS" ] && sleep 1
  for p in $FAB_PIDS; do
    kill -9 "$p" 2>/dev/null || true
  done
  FAB_PIDS=""
  for n in $FAB_NS; do
    ip netns del "$n" 2>/dev/null || true
  done
  FAB_NS=""
}

# fabric_up PREFIX: leaf/spine namespaces PREFIX-{la,lb,s1,s2}, links, routes, taps.
fabric_up() {
  local P="$1" n
  for n in la lb s1 s2; do
    ip netns add "$P-$n" || return 1
    FAB_NS="$FAB_NS $P-$n"
    fab_x "$P-$n" ip link set lo up
    fab_x "$P-$n" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 \
      net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0 || return 1
  done
  # leaf <-> spine links: leaf X's port "sK" <-> spine K's port "lX"
  local leaf spine i=0
  for leaf in a b; do
    for spine in 1 2; do
      ip link add "s$spine" netns "$P-l$leaf" type veth peer name "l$leaf" netns "$P-s$spine" || return 1
      local net="10.100.$([ $leaf = a ] && echo 1 || echo 2)$spine"
      fab_x "$P-l$leaf" ip addr add "$net.1/30" dev "s$spine"
      fab_x "$P-s$spine" ip addr add "$net.2/30" dev "l$leaf"
      fab_x "$P-l$leaf" ip link set "s$spine" up
      fab_x "$P-s$spine" ip link set "l$leaf" up
      i=$((i + 1))
    done
  done
  for leaf in a b; do
    local me other
    me=$([ $leaf = a ] && echo 1 || echo 2); other=$([ $leaf = a ] && echo 2 || echo 1)
    fab_x "$P-l$leaf" sysctl -qw net.ipv4.fib_multipath_hash_policy=1 net.ipv4.conf.all.ignore_routes_with_linkdown=1 || return 1
    # A fixed hash seed (kernel >= 6.11) makes the port -> spine mapping the same on every run.
    fab_x "$P-l$leaf" sysctl -qw net.ipv4.fib_multipath_hash_seed="${FABRIC_HASH_SEED:-4791}" 2>/dev/null || true
    fab_x "$P-l$leaf" ip route add "10.$other.0.0/16" \
      nexthop via "10.100.${me}1.2" dev s1 nexthop via "10.100.${me}2.2" dev s2 || return 1
    for r in 0 1; do
      fab_x "$P-l$leaf" ip tuntap add dev "t$leaf$r" mode tap || return 1
      fab_x "$P-l$leaf" ip addr add "10.$me.$r.1/24" dev "t$leaf$r"
      fab_x "$P-l$leaf" ip link set "t$leaf$r" up
    done
  done
  for spine in 1 2; do
    fab_x "$P-s$spine" ip route add 10.1.0.0/16 via "10.100.1$spine.1" || return 1
    fab_x "$P-s$spine" ip route add 10.2.0.0/16 via "10.100.2$spine.1" || return 1
  done
}

# spine_bytes PREFIX: "s1 s2" = bytes each spine received from both leaves (each forwarded packet once).
spine_bytes() {
  local P="$1" s t out=""
  for s in 1 2; do
    t=0
    for l in la lb; do
      t=$((t + $(fab_x "$P-s$s" cat "/sys/class/net/$l/statistics/rx_bytes")))
    done
    out="$out $t"
  done
  echo "${out# }"
}

# fabric_2vm: the whole scenario; appends its entry to $ENTRIES like boot_scenario.
fabric_2vm() {
  local name=fabric-2vm dir="$OUT_DIR/fabric-2vm" t0 P ns_before ns_after hchecks="$RUN_TMP/fabric-checks.jsonl"
  local hmetrics="$RUN_TMP/fabric-metrics.jsonl" error="" verdict=false
  rm -rf "$dir"; mkdir -p "$dir/a" "$dir/b"
  : >"$hchecks"; : >"$hmetrics"
  hcheck() { jq -cn --arg n "$1" --argjson ok "$([ "$2" -eq 0 ] && echo true || echo false)" --arg d "$3" \
      '{name: $n, ok: $ok, detail: $d}' >>"$hchecks"; say "  check $([ "$2" -eq 0 ] && echo ok || echo FAIL) $1: $3"; }
  hmetric() { jq -cn --arg n "$1" --argjson v "$2" '{($n): $v}' >>"$hmetrics"; }
  t0=$(now_s)
  say "scenario $name: building the fabric, booting two guests"
  ns_before=$(ip netns list | awk '{ print $1 }' | sort | tr '\n' ' ')
  P="pvf$$"
  local up_rc=0
  fabric_up "$P" >"$dir/fabric-setup.log" 2>&1 || up_rc=$?
  hcheck fabric_built "$up_rc" "namespaces $P-{la,lb,s1,s2}, 4 leaf-spine links, 4 taps, L4-hash multipath on the leaves"
  fab_x "$P-la" ip route show >"$dir/leaf-a-routes.txt" 2>&1 || true
  local before after
  before=$(spine_bytes "$P" 2>/dev/null || echo "0 0")

  local role leaf mac_base pids="" deadline timed_out=false
  if [ "$up_rc" -eq 0 ]; then
    for role in a b; do
      leaf=$role
      ip netns exec "$P-l$leaf" qemu-system-x86_64 -accel tcg,thread=multi -smp 1 -m 1536M -cpu max \
        -kernel "$IMAGE_DIR/vmlinuz" -initrd "$RUN_TMP/initrd.cpio" \
        -append "console=ttyS0 rdinit=/init panic=-1 quiet prism.scenario=fabric-2vm prism.env=ROLE=$role$GUEST_ENV" \
        -display none -monitor none -serial "file:$dir/$role/console.log" -no-reboot \
        -netdev "tap,id=n0,ifname=t${leaf}0,script=no,downscript=no" -device "virtio-net-pci,netdev=n0,mac=52:54:00:0$([ $role = a ] && echo 1 || echo 2):00:00" \
        -netdev "tap,id=n1,ifname=t${leaf}1,script=no,downscript=no" -device "virtio-net-pci,netdev=n1,mac=52:54:00:0$([ $role = a ] && echo 1 || echo 2):00:01" \
        -fsdev "local,id=out,path=$dir/$role,security_model=none" -device virtio-9p-pci,fsdev=out,mount_tag=out \
        </dev/null >"$dir/$role/qemu.log" 2>&1 &
      FAB_PIDS="$FAB_PIDS $!"
    done
    deadline=$(( $(date +%s) + BOOT_TIMEOUT ))
    local p alive
    while :; do
      alive=0
      for p in $FAB_PIDS; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ "$alive" -eq 1 ] || break
      if [ "$(date +%s)" -ge "$deadline" ]; then
        warn "fabric-2vm: guests still running after ${BOOT_TIMEOUT}s: killing them"
        timed_out=true; break
      fi
      sleep 0.5
    done
    for p in $FAB_PIDS; do
      if [ "$timed_out" = true ]; then kill "$p" 2>/dev/null || true; fi
    done
    for p in $FAB_PIDS; do wait "$p" 2>/dev/null || true; done
  fi
  after=$(spine_bytes "$P" 2>/dev/null || echo "0 0")
  fab_x "$P-la" ip -s link show >"$dir/leaf-a-links.txt" 2>&1 || true
  fabric_cleanup
  # ip netns del returns before the kernel has finished; the names are gone at once.
  ns_after=$(ip netns list | awk '{ print $1 }' | sort | tr '\n' ' ')

  local s1 s2 total share
  s1=$(( ${after% *} - ${before% *} )); s2=$(( ${after#* } - ${before#* } )); total=$((s1 + s2))
  share=$(awk -v a="$s1" -v t="$total" 'BEGIN { if (t > 0) printf "%.3f", a / t; else print "null" }')
  hmetric spine1_bytes "$s1"; hmetric spine2_bytes "$s2"; hmetric spine1_share "$share"
  hcheck no_guest_timeout "$([ "$timed_out" = false ] && echo 0 || echo 1)" "both guests powered off within ${BOOT_TIMEOUT}s"
  for role in a b; do
    local ok=1 d
    if grep -q "@@PRISM-END scenario=fabric-2vm rc=0 " "$dir/$role/console.log" 2>/dev/null \
       && jq -e '.pass == true' "$dir/$role/result.json" >/dev/null 2>&1; then ok=0; fi
    d=$(jq -r '[.checks[] | select(.ok == false) | .name + ": " + .detail] | join("; ")' "$dir/$role/result.json" 2>/dev/null)
    hcheck "vm_${role}_scenario_passed" "$ok" "${d:-see $name/$role/console.log}"
  done
  hcheck spines_carried_prism_traffic "$(ok_if [ "$total" -gt 20000000 ])" "spine 1 +$s1 B, spine 2 +$s2 B"
  hcheck spines_within_20pct_of_even "$(ok_if awk -v s="$share" 'BEGIN { exit !(s != "null" && s >= 0.4 && s <= 0.6) }')" \
    "spine 1 share $share of $total B (even = 0.5, allowed 0.4-0.6)"
  hcheck namespaces_removed "$(ok_if [ "$ns_before" = "$ns_after" ])" "ip netns list before: [${ns_before% }] after: [${ns_after% }]"

  # One entry: the host's checks, then each VM's checks prefixed with its role; metrics likewise.
  local wall
  wall=$(elapsed "$t0")
  jq -c -n --arg name "$name" --argjson wall "$wall" \
    --slurpfile hc "$hchecks" --slurpfile hm "$hmetrics" \
    --slurpfile ra <(jq -c . "$dir/a/result.json" 2>/dev/null || echo '{}') \
    --slurpfile rb <(jq -c . "$dir/b/result.json" 2>/dev/null || echo '{}') \
    '($hc + [($ra[0].checks // [])[] | .name = "a_" + .name] + [($rb[0].checks // [])[] | .name = "b_" + .name]) as $checks
     | {scenario: $name, pass: (($checks | length) > 0 and ($checks | all(.ok))),
        error: ([$checks[] | select(.ok | not) | .name + ": " + .detail] | if length == 0 then null else join("; ") end),
        host_wall_seconds: $wall, guest_boot_seconds: null, guest_seconds: ($ra[0].guest_seconds // null),
        metrics: (($hm | add // {}) + (($ra[0].metrics // {}) | with_entries(.key = "a_" + .key))
                  + (($rb[0].metrics // {}) | with_entries(.key = "b_" + .key))),
        checks: $checks}' >>"$ENTRIES"
  if jq -e '.pass' <(tail -n1 "$ENTRIES") >/dev/null; then
    say "scenario $name: PASS (${wall}s host wall)"
  else
    printf '[verbs] scenario %s: FAIL (%ss): %s\n' "$name" "$wall" "$(tail -n1 "$ENTRIES" | jq -r .error)" >&2
    for role in a b; do tail -n 15 "$dir/$role/console.log" >&2 2>/dev/null || true; done
  fi
}
