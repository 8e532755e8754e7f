#!/usr/bin/env bash
# The rail-topology fabric test bed: `softroce-tests/run fabric [--scenario FILE] [options]`.
#
#   softroce-tests/run fabric                       default scenario (8 hosts x 2 rails x 4 spines)
#   softroce-tests/run fabric --scenario softroce-tests/fabric/scenarios/ci.json
#   softroce-tests/run fabric unit                  the test bed's own unit tests only
#   softroce-tests/run fabric cleanup-test          interrupt runs on purpose; check nothing survives
#
# Options (anything else goes to `prismfab run`, see `--help`):
#   --scenario FILE      scenario JSON (default: scenarios/default.json)
#   --out DIR            results (default: target/fabric/<scenario name>)
#   --no-build           do not run cargo; use PRISM_BIN_DIR (default target/release)
#   --skip-cleanup-test  do not run the interrupted-run cleanup test after the scenario
#
# Environment: PRISM_BIN_DIR (where prism-perf and libnccl-net-prism.so are; setting it skips the build),
# CARGO_TARGET_DIR (honoured by the build).
#
# Safety: Mininet and every process of the run live in `unshare --net --pid --fork --mount-proc`; the
# namespaces, processes, routes, qdiscs and nft rules die with it. Every process of a run carries
# PRISMFAB_RUN=<id> in its environment, and after each run `prismfab.leftovers` checks that no process,
# namespace, nft table or interface of it survived (also after an interrupt: see the trap below).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY=/usr/bin/python3   # Debian's interpreter: Mininet is installed for it, not for other pythons
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1   # no __pycache__ in the source tree

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'fabric: error: %s\n' "$*" >&2; exit 1; }

need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, tc, nft); run it as root or through sudo"
}

install_debs() {
  local want=(mininet iperf3 nftables iproute2 ethtool iputils-ping util-linux python3)
  local missing=()
  for p in "${want[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing Debian packages: ${missing[*]}"
  apt-get update -qq || die "apt-get update failed"
  # Without recommends: Mininet recommends the Open vSwitch stack, which this test bed does not use.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}

bin_dir() {
  if [ -n "${PRISM_BIN_DIR:-}" ]; then
    (cd "$ROOT" && cd "$PRISM_BIN_DIR" && pwd)
  else
    local t="${CARGO_TARGET_DIR:-$ROOT/target}"
    case "$t" in /*) ;; *) t="$ROOT/$t";; esac
    echo "$t/release"
  fi
}

build() {
  if [ -n "${PRISM_BIN_DIR:-}" ] || [ "$NO_BUILD" = 1 ]; then return 0; fi
  if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; fi
  command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust (scripts/quickstart does) or set PRISM_BIN_DIR"
  say "cargo build --release -p prism-examples -p prism-nccl"
  (cd "$ROOT" && cargo build --release -p prism-examples -p prism-nccl) || die "the build failed"
}

unit_tests() {
  say "test bed unit tests"
  (cd "$HERE" && "$PY" -m unittest discover -s tests -t . -q) || die "the test bed's unit tests failed"
}

# --- one isolated run ----------------------------------------------------------------------------------
INNER_PID=""   # outer PID of the python that is PID 1 inside the run's namespaces
UNSHARE_PID=""

inner_of() {  # the child of unshare (PID 1 of the new PID namespace), by PID
  local c
  c=$(cat "/proc/$1/task/$1/children" 2>/dev/null || true)
  echo "${c%% *}"
}

on_signal() {
  local sig=$1
  say "caught SIG$sig: stopping the run (it tears its fabric down itself)"
  if [ -n "$UNSHARE_PID" ]; then
    [ -n "$INNER_PID" ] || INNER_PID=$(inner_of "$UNSHARE_PID")
    [ -n "$INNER_PID" ] && kill -TERM "$INNER_PID" 2>/dev/null || true
    for _ in $(seq 1 300); do kill -0 "$UNSHARE_PID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$UNSHARE_PID" 2>/dev/null; then
      # Still there after 30 s: SIGKILL to PID 1 of the namespace ends every process in it.
      say "the run did not stop in 30 s: killing its PID namespace"
      [ -n "$INNER_PID" ] && kill -KILL "$INNER_PID" 2>/dev/null || true
      wait "$UNSHARE_PID" 2>/dev/null || true
    fi
  fi
  INTERRUPTED=1
}

# isolated_run OUT MARKER ARGS...: runs `prismfab run` in fresh net+pid+mount namespaces; returns its status.
isolated_run() {
  local out=$1 marker=$2; shift 2
  mkdir -p "$out"
  rm -f "$out/ready" "$out/namespaces.json"
  # --kill-child: if this script dies, the kernel kills PID 1 of the namespace, hence all of it.
  PRISMFAB_RUN="$marker" unshare --net --pid --fork --mount-proc --kill-child \
    "$PY" -m prismfab run --out "$out" "$@" &
  UNSHARE_PID=$!
  local st=0
  wait "$UNSHARE_PID" || st=$?
  # A trapped signal interrupts `wait`; wait again for the real end.
  while kill -0 "$UNSHARE_PID" 2>/dev/null; do wait "$UNSHARE_PID" || st=$?; done
  UNSHARE_PID=""; INNER_PID=""
  return "$st"
}

leftover_check() {  # OUT MARKER
  "$PY" -m prismfab.leftovers --ns-file "$1/namespaces.json" --marker "$2" --json "$1/cleanup.json"
}

new_marker() { echo "pf-$(date +%s)-$$-$RANDOM"; }

# --- the interrupted-run cleanup test ----------------------------------------------------------------------
cleanup_test() {
  local base="$ROOT/target/fabric/cleanup-test" ci="$HERE/scenarios/ci.json" fails=0
  mkdir -p "$base"
  local how
  for how in INT KILL; do
    local out="$base/interrupt-$how" marker
    marker=$(new_marker)
    say "cleanup test: start a run, interrupt it with SIG$how while traffic flows, look for leftovers"
    rm -rf "$out"; mkdir -p "$out"
    PRISMFAB_RUN="$marker" unshare --net --pid --fork --mount-proc --kill-child \
      "$PY" -m prismfab run --out "$out" --scenario "$ci" --selftest-only >"$out/stdout" 2>"$out/stderr" &
    local up=$! inner=""
    for _ in $(seq 1 600); do [ -f "$out/ready" ] && break; kill -0 "$up" 2>/dev/null || break; sleep 0.1; done
    if [ ! -f "$out/ready" ]; then
      echo "cleanup test ($how): the fabric never came up; see $out/stderr" >&2; fails=$((fails + 1))
      wait "$up" 2>/dev/null || true; continue
    fi
    sleep 4   # into the self-test traffic (pings, iperf3, UDP probes are running)
    inner=$(inner_of "$up")
    if [ "$how" = INT ]; then
      kill -INT "$inner"            # what Ctrl-C delivers
    else
      kill -KILL "$up"              # the wrapper dies hard: --kill-child takes the namespace down
    fi
    for _ in $(seq 1 600); do kill -0 "$up" 2>/dev/null || break; sleep 0.1; done
    wait "$up" 2>/dev/null || true
    if [ -n "$inner" ]; then for _ in $(seq 1 100); do kill -0 "$inner" 2>/dev/null || break; sleep 0.1; done; fi
    if leftover_check "$out" "$marker"; then
      echo "cleanup test ($how): PASS" >&2
    else
      echo "cleanup test ($how): FAIL (see $out/cleanup.json)" >&2; fails=$((fails + 1))
    fi
  done
  [ "$fails" -eq 0 ]
}

# --- main --------------------------------------------------------------------------------------------------
SCENARIO="$HERE/scenarios/default.json"
OUT=""
NO_BUILD=0
SKIP_CLEANUP=0
INTERRUPTED=0
MODE=run
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    unit) MODE=unit ;;
    cleanup-test) MODE=cleanup ;;
    --scenario) SCENARIO="$2"; shift ;;
    --scenario=*) SCENARIO="${1#*=}" ;;
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#*=}" ;;
    --no-build) NO_BUILD=1 ;;
    --skip-cleanup-test) SKIP_CLEANUP=1 ;;
    -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) PASS+=("$1") ;;
  esac
  shift
done

case "$MODE" in
  unit) install_debs; unit_tests; exit 0 ;;
  cleanup) need_root; install_debs; cleanup_test; exit $? ;;
esac

need_root
[ -f "$SCENARIO" ] || die "no scenario file $SCENARIO"
SCENARIO="$(cd "$(dirname "$SCENARIO")" && pwd)/$(basename "$SCENARIO")"
NAME=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["name"])' "$SCENARIO") \
  || die "$SCENARIO: not a scenario (no name)"
OUT="${OUT:-$ROOT/target/fabric/$NAME}"
mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
START=$(date +%s)
install_debs
unit_tests
build
BIN="$(bin_dir)"
MARKER=$(new_marker)
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
trap 'on_signal HUP' HUP
say "scenario $NAME ($SCENARIO) -> $OUT"
STATUS=0
CMD="softroce-tests/run fabric --scenario ${SCENARIO#"$ROOT"/}${PASS[*]:+ ${PASS[*]}}"
if [ -n "${PRISM_BIN_DIR:-}" ]; then CMD="PRISM_BIN_DIR=$PRISM_BIN_DIR $CMD"
elif [ -n "${CARGO_TARGET_DIR:-}" ]; then CMD="CARGO_TARGET_DIR=$CARGO_TARGET_DIR $CMD"; fi
isolated_run "$OUT" "$MARKER" --scenario "$SCENARIO" --bin-dir "$BIN" --command "$CMD" ${PASS[@]+"${PASS[@]}"} || STATUS=$?
trap - INT TERM HUP
say "looking for leftovers of run $MARKER"
CLEAN=0
leftover_check "$OUT" "$MARKER" || CLEAN=$?
if [ "$INTERRUPTED" = 1 ]; then
  echo "fabric: interrupted; cleanup $([ "$CLEAN" = 0 ] && echo clean || echo NOT clean)" >&2
  exit 130
fi
CT=0
if [ "$SKIP_CLEANUP" = 0 ]; then cleanup_test || CT=$?; fi
END=$(date +%s)
echo "fabric: scenario $NAME: run status $STATUS, leftovers $([ "$CLEAN" = 0 ] && echo none || echo FOUND), cleanup test $([ "$SKIP_CLEANUP" = 1 ] && echo skipped || { [ "$CT" = 0 ] && echo passed || echo FAILED; }); $((END - START)) s; results in $OUT" >&2
[ "$STATUS" = 0 ] && [ "$CLEAN" = 0 ] && [ "$CT" = 0 ]
