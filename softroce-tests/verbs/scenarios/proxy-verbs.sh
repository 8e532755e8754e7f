# proxy-verbs: the C program that plays NCCL's proxy (tests-c/proxy_test.c, built on the host the way
# nccl-net-plugin/tests/c_proxy.rs builds it) against the host-built libnccl-net-prism.so, inside the
# guest, over Prism's verbs backend on rxe, for ABI v9, v10, v11 and v12. The program forks rank 0 and
# rank 1, runs every scenario in both directions and verifies every received byte, the untouched tail
# and a canary; it prints one "[vN] PASS|FAIL" summary and exits non-zero on any failure.
# Claims per version: exit 0, the "[vN] PASS" line, no FAIL line, and both processes' PRISM_STATS name
# the verbs backend (so a silent UDP fallback fails the scenario).
# Devices: both ranks on rxe0, alone on va with its own address (loop_setup), so the two processes talk
# through rxe's loopback path. (On the wire setup both ranks' rxe0 packets would leave through va and land
# on rxe1, which no rank listens on.)
. /prism/lib.sh
VERSIONS=${VERSIONS:-"v9 v10 v11 v12"}
HCAS=rxe0
IFS_FOR_HCAS=${IFS_FOR_HCAS:-va}
PROXY_LIMIT=${PROXY_LIMIT:-400}   # seconds per version, whole program (its own per-wait limit is 120 s)

loop_setup; check loop_up $? "rxe0 on va (10.9.0.1), loopback path"
[ -x /opt/prism/proxy_test ] && [ -f /opt/prism/libnccl-net-prism.so ]
check proxy_test_and_plugin_present $? "/opt/prism: $(ls /opt/prism | tr '\n' ' ')"
metric_str transport "$TRANSPORT"
metric_str hcas "$HCAS"

passed=0
for ver in $VERSIONS; do
  seed=$(case $ver in v9) echo 0x9009 ;; v10) echo 0x1010 ;; v11) echo 0x1111 ;; *) echo 0x1212 ;; esac)
  sd="$OUT/stats-$ver"; rm -rf "$sd"; mkdir -p "$sd"
  t0=$(up)
  # shellcheck disable=SC2046
  env $(prism_env "$HCAS" "$IFS_FOR_HCAS") PRISM_STATS="$sd/prism-%p.json" PROXY_TEST_TIMEOUT_S=120 \
    timeout "$PROXY_LIMIT" proxy_test "$ver" /opt/prism/libnccl-net-prism.so "$seed" \
    >"$OUT/proxy-$ver.log" 2>"$OUT/proxy-$ver.err"
  rc=$?
  metric "${ver}_seconds" "$(awk -v a="$t0" -v b="$(up)" 'BEGIN { printf "%.1f", b - a }')"
  grep -E '^\[v[0-9]+\] (PASS|FAIL)|bidir: ok|sizes: ok' "$OUT/proxy-$ver.log" >&2
  summary=$(grep -m1 -E "^\[$ver\] (PASS|FAIL)" "$OUT/proxy-$ver.log")
  nfail=$(grep -c 'FAIL' "$OUT/proxy-$ver.log")
  [ "$rc" -eq 0 ]; check "${ver}_exit_0" $? "proxy_test $ver rc=$rc$([ "$rc" -eq 124 ] && echo " (killed after ${PROXY_LIMIT}s)")"
  case "$summary" in "[$ver] PASS"*) ok=0 ;; *) ok=1 ;; esac
  [ "$ok" -eq 0 ] && [ "$nfail" -eq 0 ]
  check "${ver}_summary_pass_every_byte_verified" $? "${summary:-no summary line}; $nfail FAIL lines"
  # shellcheck disable=SC2046
  check_backend "$ver" $(ls "$sd"/prism-*.json 2>/dev/null || echo "$sd/prism-none.json")
  n=$(ls "$sd"/prism-*.json 2>/dev/null | wc -l)
  [ "$n" -eq 2 ]; check "${ver}_stats_from_both_processes" $? "$n PRISM_STATS files (one per rank expected)"
  bidir=$(awk '/bidir: ok/ { for (i = 1; i <= NF; i++) if ($i == "MiB/s") print $(i - 1) }' "$OUT/proxy-$ver.log" | head -n1)
  metric "${ver}_bidir_MiBps" "${bidir:-null}"
  [ "$rc" -eq 0 ] && [ "$ok" -eq 0 ] && passed=$((passed + 1))
done
metric versions_passed "$passed"
finish
