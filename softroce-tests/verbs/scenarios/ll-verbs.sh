# ll-verbs: NCCL's LL reader over Prism's verbs backend. tests-c/ll_test.c (built on the host like
# proxy_test) forks rank 0 and rank 1 on a lone rxe0 (loop_setup, as proxy-verbs): rank 0 sends 64 KiB
# LL-formatted messages step after step into one receive buffer of rank 1, whose poller thread reads
# that buffer with aligned 16-byte loads the whole time and counts torn lines (both flags new, data
# old); every completed message is also checked in full. Once with PRISM_PATHS=1 and once with 16
# (PATHS_LIST), LL_SECONDS (10) each, default PRISM_IB_CHUNK.
# Claims per run: exit 0; the summary line shows torn=0 and wrong=0 with enough steps and lines checked
# (the program fails itself below 20 steps or 10^6 lines); both processes' PRISM_STATS name verbs.
. /prism/lib.sh
HCAS=rxe0
IFS_FOR_HCAS=${IFS_FOR_HCAS:-va}
PATHS_LIST=${PATHS_LIST:-"1 16"}
LL_SECONDS=${LL_SECONDS:-10}
LL_LIMIT=$((LL_SECONDS + 150))   # whole program: connect, the run, its own 30 s per-step limit

loop_setup; check loop_up $? "rxe0 on va (10.9.0.1), loopback path"
[ -x /opt/prism/ll_test ] && [ -f /opt/prism/libnccl-net-prism.so ]
check ll_test_and_plugin_present $? "/opt/prism: $(ls /opt/prism | tr '\n' ' ')"
metric_str transport "$TRANSPORT"
metric ll_seconds "$LL_SECONDS"

for paths in $PATHS_LIST; do
  label="paths$paths"
  sd="$OUT/stats-$label"; rm -rf "$sd"; mkdir -p "$sd"
  # shellcheck disable=SC2046
  env $(prism_env "$HCAS" "$IFS_FOR_HCAS") PRISM_PATHS="$paths" PRISM_STATS="$sd/prism-%p.json" \
    timeout "$LL_LIMIT" /opt/prism/ll_test /opt/prism/libnccl-net-prism.so "$LL_SECONDS" \
    >"$OUT/ll-$label.log" 2>"$OUT/ll-$label.err"
  rc=$?
  summary=$(grep -m1 '^ll: transport=' "$OUT/ll-$label.log")
  log "$label: ${summary:-no summary line} (exit $rc)"
  field() { printf '%s\n' "$summary" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
  steps=$(field steps); checked=$(field lines_checked); torn=$(field torn); wrong=$(field wrong)
  metric "${label}_steps" "${steps:-null}"
  metric "${label}_lines_checked" "${checked:-null}"
  metric "${label}_torn" "${torn:-null}"
  metric "${label}_wrong" "${wrong:-null}"
  metric "${label}_ahead" "$(field ahead)"   # next step's data under old flags: a line being written, harmless
  [ "$rc" -eq 0 ]; check "${label}_exit_0" $? "ll_test rc=$rc$([ "$rc" -eq 124 ] && echo " (killed after ${LL_LIMIT}s)")"
  [ -n "$summary" ] && [ "$torn" = 0 ] && [ "$wrong" = 0 ]
  check "${label}_no_torn_line_every_byte_right" $? "${summary:-no summary line}"
  is_pos "${steps:-0}" && [ "$steps" -ge 20 ]; check "${label}_enough_steps" $? "steps=${steps:-none} (at least 20)"
  # shellcheck disable=SC2046
  check_backend "$label" $(ls "$sd"/prism-*.json 2>/dev/null || echo "$sd/prism-none.json")
done
finish
