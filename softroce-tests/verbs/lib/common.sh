# shellcheck shell=bash
# Host-side helpers for the Soft-RoCE test bed (sourced by run.sh, not run).
# Everything here runs on the host; the guest side lives in ../guest/.

say() { printf '\033[1m[verbs] %s\033[0m\n' "$*" >&2; }
warn() { printf '[verbs] warning: %s\n' "$*" >&2; }
# Fail loudly: the test bed never skips a scenario because a tool is missing.
die() { printf '\n[verbs] FATAL: %s\n' "$*" >&2; exit 1; }

# Seconds since the epoch with milliseconds, for the timing table.
now_s() { date +%s.%N | cut -c1-14; }
elapsed() { awk -v a="$1" -v b="$(now_s)" 'BEGIN { printf "%.1f", b - a }'; }

# Install missing Debian packages with the machine's own apt configuration.
# `apt-get update` runs first (once per run), so a fresh machine with stale lists works.
APT_UPDATED=0
need_debs() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "host packages missing (${missing[*]}) and not root: install them with apt-get"
  say "installing host packages: ${missing[*]}"
  if [ "$APT_UPDATED" -eq 0 ]; then
    apt-get update -qq || die "apt-get update failed: cannot install ${missing[*]}"
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    || die "apt-get install ${missing[*]} failed: the Soft-RoCE test bed cannot run without them"
}
