# shellcheck shell=bash
# Guest image for the Soft-RoCE test bed (sourced by run.sh, not run).
#
# The image is two files: the Debian kernel (vmlinuz, extracted from the distribution's kernel package,
# never installed) and base.cpio, an initramfs holding a minbase userland of the host's own Debian release
# (same glibc, so binaries built on the host run in the guest as they are) with rdma-core, perftest,
# iproute2, tcpdump and jq, plus the few kernel modules the scenarios load. It is cached under
# softroce-tests/.cache/ keyed by the kernel package version and a hash of this recipe, so a change to
# the package list rebuilds it and nothing else does.

# Guest packages on top of minbase. rdma-core/ibverbs-providers give librxe; iproute2 gives `rdma` and `tc`.
GUEST_PACKAGES="rdma-core,ibverbs-providers,ibverbs-utils,perftest,iproute2,kmod,tcpdump,procps,jq"

# Modules the scenarios load, closed over modules.dep at build time. crc32_generic is not optional:
# without it `rdma link add` fails with ENOENT because rxe allocates a crc32 shash.
GUEST_MODULES="crc32_generic crc32-pclmul veth rdma_rxe ib_uverbs rdma_ucm sch_netem sch_ingress
  cls_matchall act_gact cls_u32 sch_tbf virtio_pci virtio_net 9pnet_virtio 9p"

# The kernel package: the one the distribution's `linux-image-amd64` points at, unless
# PRISM_VM_KERNEL_PKG names one (e.g. linux-image-6.1.0-56-amd64).
resolve_kernel() {
  local meta=linux-image-amd64
  KPKG="${PRISM_VM_KERNEL_PKG:-}"
  if [ -z "$KPKG" ]; then
    KPKG=$(apt-cache depends "$meta" 2>/dev/null | awk '/Depends: linux-image-/ { print $2; exit }')
    [ -n "$KPKG" ] || die "cannot resolve the kernel package: 'apt-cache depends $meta' names no linux-image-* \
(is this a Debian host with a working apt configuration? set PRISM_VM_KERNEL_PKG to force one)"
  fi
  KPKG_VER=$(apt-cache policy "$KPKG" 2>/dev/null | awk '/Candidate:/ { print $2; exit }')
  if [ -z "$KPKG_VER" ] || [ "$KPKG_VER" = "(none)" ]; then
    die "kernel package $KPKG is not available from this machine's apt sources (apt-cache policy $KPKG)"
  fi
  KVER=${KPKG#linux-image-}
}

# The Debian mirror and suite, read from the machine's apt configuration (never written in the repo).
resolve_mirror() {
  # shellcheck disable=SC1091
  SUITE=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [ -n "$SUITE" ] || die "cannot read VERSION_CODENAME from /etc/os-release: the guest userland must match the host's release"
  MIRROR=$(apt-get indextargets --format '$(REPO_URI)' "Release: $SUITE" "Identifier: Packages" 2>/dev/null | head -n1)
  [ -n "$MIRROR" ] || die "no apt source for suite '$SUITE' in this machine's apt configuration (apt-get indextargets)"
}

recipe_hash() {
  { cat "$VERBS_DIR/lib/image.sh"; echo "$GUEST_PACKAGES $GUEST_MODULES"; } | sha256sum | cut -c1-10
}

# Sets IMAGE_DIR (vmlinuz + base.cpio), building the image when the cache has none for this key.
ensure_image() {
  resolve_kernel
  local key
  key="${KVER}_${KPKG_VER}_$(recipe_hash)"
  IMAGE_DIR="$CACHE_DIR/image-$key"
  if [ -f "$IMAGE_DIR/ok" ] && [ -f "$IMAGE_DIR/vmlinuz" ] && [ -f "$IMAGE_DIR/base.cpio" ]; then
    say "image: cached $IMAGE_DIR"
    IMAGE_CACHED=1
    return 0
  fi
  IMAGE_CACHED=0
  build_image "$key"
}

build_image() {
  local key="$1" t0 b
  t0=$(now_s)
  resolve_mirror
  need_debs debootstrap cpio
  say "image: building $key (kernel $KPKG $KPKG_VER, $SUITE minbase from the machine's apt mirror)"
  mkdir -p "$CACHE_DIR"
  b=$(mktemp -d "$CACHE_DIR/build.XXXXXX")
  BUILD_TMP="$b"   # removed by the EXIT trap if the build fails half way

  (cd "$b" && apt-get download "$KPKG=$KPKG_VER" >"$b/download.log" 2>&1) \
    || { cat "$b/download.log" >&2; die "apt-get download $KPKG=$KPKG_VER failed: no kernel, no Soft-RoCE"; }
  dpkg-deb -x "$b"/"$KPKG"_*.deb "$b/kimg" || die "dpkg-deb -x of $KPKG failed"
  [ -f "$b/kimg/boot/vmlinuz-$KVER" ] || die "$KPKG has no boot/vmlinuz-$KVER"
  [ -d "$b/kimg/lib/modules/$KVER" ] || die "$KPKG has no lib/modules/$KVER"
  find "$b/kimg/lib/modules/$KVER" -name 'rdma_rxe.ko*' | grep -q . \
    || die "$KPKG ships no rdma_rxe module: Soft-RoCE needs a kernel built with CONFIG_RDMA_RXE"

  say "image: debootstrap $SUITE (minbase + ${GUEST_PACKAGES//,/ })"
  debootstrap --variant=minbase --include="$GUEST_PACKAGES" "$SUITE" "$b/rootfs" "$MIRROR" \
    >"$b/debootstrap.log" 2>&1 \
    || { tail -n 30 "$b/debootstrap.log" >&2; die "debootstrap of $SUITE failed (log above)"; }

  # The package ships no modules.dep (its postinst makes one): run the guest's depmod over the whole
  # tree once, lent to the guest root for that, then copy only the closure we need.
  mkdir -p "$b/rootfs/lib/modules"
  mv "$b/kimg/lib/modules/$KVER" "$b/rootfs/lib/modules/$KVER"
  chroot "$b/rootfs" depmod "$KVER" || die "depmod $KVER (full tree) in the guest root failed"
  mv "$b/rootfs/lib/modules/$KVER" "$b/kimg/lib/modules/$KVER"
  install_modules "$b/kimg/lib/modules/$KVER" "$b/rootfs/lib/modules/$KVER" "$b/modules.txt"
  chroot "$b/rootfs" depmod "$KVER" || die "depmod $KVER in the guest root failed"
  prune_rootfs "$b/rootfs"
  chroot "$b/rootfs" dpkg-query -W -f='${Package} ${Version}\n' \
    libibverbs1 ibverbs-providers perftest iproute2 tcpdump libc6 >"$b/guest-packages.txt"

  (cd "$b/rootfs" && find . | cpio -o -H newc --quiet) >"$b/base.cpio" || die "packing base.cpio failed"
  cp "$b/kimg/boot/vmlinuz-$KVER" "$b/vmlinuz"
  rm -rf "$b/rootfs" "$b/kimg" "$b"/*.deb
  {
    echo "kernel_package=$KPKG"
    echo "kernel_package_version=$KPKG_VER"
    echo "kernel=$KVER"
    echo "suite=$SUITE"
    echo "base_cpio_bytes=$(stat -c %s "$b/base.cpio")"
    echo "modules=$(wc -l <"$b/modules.txt")"
    echo "build_seconds=$(elapsed "$t0")"
  } >"$b/manifest"
  touch "$b/ok"
  rm -rf "$CACHE_DIR/image-$key"
  mv "$b" "$CACHE_DIR/image-$key"
  BUILD_TMP=""
  # Older images are dead weight (hundreds of MB each): keep only the current one.
  for old in "$CACHE_DIR"/image-*; do
    [ "$old" = "$CACHE_DIR/image-$key" ] || rm -rf "$old"
  done
  IMAGE_DIR="$CACHE_DIR/image-$key"
  IMAGE_BUILD_SECONDS=$(elapsed "$t0")
  say "image: built in ${IMAGE_BUILD_SECONDS}s ($(du -h "$IMAGE_DIR/base.cpio" | cut -f1) base.cpio)"
}

# Copy GUEST_MODULES and everything they depend on (modules.dep closure) from the kernel package.
install_modules() {
  local src="$1" dst="$2" list="$3" todo=() seen=" " m rel dep
  mkdir -p "$dst"
  cp "$src"/modules.order "$src"/modules.builtin "$src"/modules.builtin.modinfo "$dst"/ 2>/dev/null || true
  # modules.dep lines: "kernel/x/y.ko: kernel/a.ko kernel/b.ko"; names match with - and _ folded.
  for m in $GUEST_MODULES; do
    rel=$(awk -F: -v want="${m//-/_}" '{
        n = $1; sub(/.*\//, "", n); sub(/\.ko(\.[a-z]+)?$/, "", n); gsub(/-/, "_", n)
        if (n == want) { print $1; exit } }' "$src/modules.dep")
    if [ -z "$rel" ]; then
      # Built into the kernel: nothing to copy, modprobe succeeds on its own.
      grep -q "/${m//-/[-_]}\.ko" "$src/modules.builtin" 2>/dev/null \
        || die "kernel module $m is neither in modules.dep nor built in ($KPKG)"
      continue
    fi
    todo+=("$rel")
  done
  : >"$list"
  while [ ${#todo[@]} -gt 0 ]; do
    rel="${todo[0]}"; todo=("${todo[@]:1}")
    case "$seen" in *" $rel "*) continue ;; esac
    seen="$seen$rel "
    mkdir -p "$dst/$(dirname "$rel")"
    cp "$src/$rel" "$dst/$rel"
    echo "$rel" >>"$list"
    for dep in $(awk -F: -v r="$rel" '$1 == r { print $2 }' "$src/modules.dep"); do
      todo+=("$dep")
    done
  done
}

# Drop what a test guest never reads; it shrinks the initramfs (and so the boot) several times over.
prune_rootfs() {
  local r="$1"
  rm -rf "$r"/usr/share/{doc,man,info,locale,zoneinfo,i18n,lintian,linda,common-licenses,bash-completion} \
    "$r"/var/cache/apt/* "$r"/var/lib/apt/lists/* "$r"/var/cache/debconf/*-old "$r"/var/log/* \
    "$r"/usr/lib/udev/hwdb.bin "$r"/usr/lib/x86_64-linux-gnu/gconv
}
