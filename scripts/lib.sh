# Shared helpers for Prism's scripts (sourced, not run).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export REPO_ROOT

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Install Debian packages that are missing (apt-get update only when something is missing).
need_debs() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  say "installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}

# A Rust toolchain new enough for the workspace (rustup's if present, else Debian's).
need_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
  fi
  if ! command -v cargo >/dev/null 2>&1; then
    need_debs cargo rustc
  fi
  # rustfmt and clippy gate the suite (scripts/test): rustup's component, else Debian's packages.
  if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
    if command -v rustup >/dev/null 2>&1; then
      rustup component add rustfmt clippy >/dev/null || die "rustup component add rustfmt clippy failed"
    else
      need_debs rustfmt rust-clippy
    fi
  fi
  local v
  v=$(rustc --version | awk '{print $2}')
  case "$v" in
    1.[0-7][0-9].*) die "rustc $v is too old: Prism needs 1.80 or newer (install it with rustup)";;
  esac
}

# What the rail-topology Mininet fabric (softroce-tests/run fabric) needs, and a check that Mininet
# can really run here: root, Debian's Mininet importable by /usr/bin/python3, and new net+pid
# namespaces (the fabric runs only inside `unshare --net --pid --fork --mount-proc`). Dies otherwise.
install_fabric() {
  [ "$(id -u)" -eq 0 ] || die "the fabric test needs root (network namespaces, tc, nft)"
  # Without recommends: Mininet recommends the Open vSwitch stack, which the fabric does not use.
  need_debs mininet iperf3 nftables iproute2 ethtool iputils-ping util-linux python3
  /usr/bin/python3 -c 'import mininet.net, mininet.link' \
    || die "Mininet is installed but /usr/bin/python3 cannot import it"
  unshare --net --pid --fork --mount-proc /bin/true \
    || die "cannot create network and PID namespaces (unshare --net --pid --fork --mount-proc)"
}

# Everything the build and the tests need on a fresh Debian machine.
install_all() {
  # cmake + libclang-dev: the verbs backend's sideway crate (bindgen over vendored rdma-core headers).
  need_debs build-essential pkg-config iproute2 ca-certificates cmake libclang-dev
  need_rust
}
