#!/usr/bin/env bash
# Installs the guest kernel of dsec's microVM backend: the kernel of Debian's linux-image-cloud-amd64, unpacked (never
# installed as the host's kernel) into $GUEST_KERNEL_DIR/<release>/ (default /var/cache/dsec/guest-kernel):
#   vmlinux   the uncompressed ELF kernel (QEMU boots it directly through its PVH entry)
#   vmlinuz   the bzImage it came from
#   config    the kernel's build configuration
#   release   the release string, e.g. 6.1.0-57-cloud-amd64
#   modules/  the guest's modules and their dependencies, flat, named <module>.ko, uncompressed (dsecd orders them
#             by their depends= at run time); modules.builtin when the kernel has one
# and points $GUEST_KERNEL_DIR/current at it (a symlink, replaced atomically).
#
# Idempotent: when `current` is a complete directory it exits at once without touching apt or the network. With
# --update it asks apt (from its local lists) for the candidate kernel and installs it when it is not the current one.
# GUEST_KERNEL_DIR (or DSEC_GUEST_KERNEL_DIR, which dsecd reads too) overrides the directory. Needs root (or a writable
# GUEST_KERNEL_DIR). Prints one line of what it did.
set -euo pipefail

BASE=${GUEST_KERNEL_DIR:-${DSEC_GUEST_KERNEL_DIR:-/var/cache/dsec/guest-kernel}}
META=linux-image-cloud-amd64
# Keep in step with guest_modules() and optional_guest_modules() in libdsec/src/agent/backends/qemu/microvm/guest_kernel.cpp.
MODULES=(virtio_ring virtio virtio_mmio virtio_blk virtio_console virtio_balloon virtio_rng erofs libcrc32c overlay)

die() {
  echo "guest-kernel: $*" >&2
  exit 1
}

update=0
case "${1:-}" in
  "") ;;
  --update) update=1 ;;
  -h | --help)
    sed -n '2,15s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
    exit 0
    ;;
  *) die "unknown argument $1 (usage: guest-kernel.sh [--update])" ;;
esac

# Whether a <release>/ directory has everything dsecd needs.
is_complete() {
  local dir=$1 m magic
  [[ -f "$dir/vmlinux" && -f "$dir/vmlinuz" && -f "$dir/config" && -f "$dir/release" && -d "$dir/modules" ]] || return 1
  [[ "$(<"$dir/release")" == "$(basename "$(readlink -f "$dir")")" ]] || return 1
  magic=$(head -c 4 "$dir/vmlinux" | od -An -tx1 | tr -d ' \n')
  [[ "$magic" == 7f454c46 ]] || return 1
  for m in "${MODULES[@]}"; do
    [[ -f "$dir/modules/$m.ko" ]] || grep -q "/${m}.ko\$\|/${m//_/-}.ko\$" "$dir/modules/modules.builtin" 2>/dev/null ||
      return 1
  done
}

if [[ $update -eq 0 ]] && is_complete "$BASE/current"; then
  echo "guest-kernel: $(<"$BASE/current/release") is installed in $BASE/current"
  exit 0
fi

# Points `current` at <release> atomically (a new symlink renamed over the old one).
link_current() {
  local tmp_link="$BASE/.current.$$"
  ln -sfn "$1" "$tmp_link"
  mv -T "$tmp_link" "$BASE/current"
}

if ! mkdir -p "$BASE" 2>/dev/null || [[ ! -w "$BASE" ]]; then
  die "cannot write $BASE: run as root (sudo scripts/guest-kernel.sh) or set GUEST_KERNEL_DIR"
fi
if [[ -e "$BASE/current" && ! -L "$BASE/current" ]]; then
  die "$BASE/current is not a symlink; move it away so that it can point at the unpacked kernel"
fi

# The versioned package the metapackage depends on, from apt's local lists (apt-get update once if it has none).
candidate_package() {
  apt-cache depends "$META" 2>/dev/null | sed -n 's/^ *|\{0,1\}Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n 1
}
command -v apt-get >/dev/null || die "apt-get not found: the guest kernel comes from Debian's $META"
pkg=$(candidate_package)
if [[ -z "$pkg" ]]; then
  apt-get update -q >/dev/null || die "apt-get update failed"
  pkg=$(candidate_package)
fi
[[ -n "$pkg" ]] || die "apt knows no $META (is this Debian amd64 with main enabled?)"
release=${pkg#linux-image-}

if is_complete "$BASE/$release"; then
  if [[ "$(readlink "$BASE/current" 2>/dev/null || true)" == "$release" ]]; then
    echo "guest-kernel: $release is installed in $BASE/current"
  else
    link_current "$release"
    echo "guest-kernel: pointed $BASE/current at the already unpacked $release"
  fi
  exit 0
fi

for tool in dpkg-deb od; do
  command -v "$tool" >/dev/null || die "$tool not found"
done

work=$(mktemp -d)
stage=""
cleanup() {
  rm -rf "$work"
  [[ -z "$stage" ]] || rm -rf "$stage"
}
trap cleanup EXIT

# apt-get download drops privileges to _apt, which must be able to write the directory it downloads into.
chmod 0755 "$work"
mkdir "$work/deb"
if id _apt >/dev/null 2>&1 && [[ $(id -u) -eq 0 ]]; then chown _apt "$work/deb"; fi
(cd "$work/deb" && apt-get download -q "$pkg" >/dev/null) || die "apt-get download $pkg failed"
deb=$(find "$work/deb" -maxdepth 1 -name '*.deb' -print -quit)
[[ -n "$deb" ]] || die "apt-get download $pkg left no .deb"
dpkg-deb -x "$deb" "$work/root"

vmlinuz="$work/root/boot/vmlinuz-$release"
[[ -f "$vmlinuz" ]] || die "$pkg has no boot/vmlinuz-$release"
moddir="$work/root/lib/modules/$release"
[[ -d "$moddir" ]] || die "$pkg has no lib/modules/$release"

stage=$(mktemp -d "$BASE/.stage-$release.XXXXXX")
chmod 0755 "$stage"
cp "$vmlinuz" "$stage/vmlinuz"
cp "$work/root/boot/config-$release" "$stage/config"

# --- vmlinux: the compressed payload of the bzImage, decompressed ---
# Bytes of the file as a hex string.
hex_at() { od -An -tx1 -j "$2" -N "$3" "$1" | tr -d ' \n'; }
u32_at() { od -An -tu4 -j "$2" -N 4 "$1" | tr -d ' \n'; }
# The decompressor for a payload starting with these bytes (legacy lz4, gzip, xz, zstd), or "".
decompressor_for() {
  case "$1" in
    02214c18*) echo "lz4 -dc" ;;
    1f8b08*) echo "gzip -dc" ;;
    fd377a585a00*) echo "xz -dc --single-stream" ;;
    28b52ffd*) echo "zstd -dcq" ;;
    *) echo "" ;;
  esac
}
# Where the payload is: the boot protocol's header (2.08+: payload_offset, payload_length) says exactly; the compressed
# data is followed by 4 bytes holding the uncompressed size, which checks the result. Without a usable header, the
# first occurrence of any known magic.
payload_start=""
payload_len=""
expected_size=""
if [[ "$(hex_at "$vmlinuz" $((0x202)) 4)" == 48647253 ]]; then # "HdrS"
  setup_sects=$(od -An -tu1 -j $((0x1f1)) -N 1 "$vmlinuz" | tr -d ' ')
  ((setup_sects == 0)) && setup_sects=4
  start=$(((setup_sects + 1) * 512 + $(u32_at "$vmlinuz" $((0x248)))))
  len=$(u32_at "$vmlinuz" $((0x24c)))
  if [[ -n "$(decompressor_for "$(hex_at "$vmlinuz" "$start" 6)")" ]] && ((len > 4)); then
    payload_start=$start
    payload_len=$((len - 4))
    expected_size=$(u32_at "$vmlinuz" $((start + len - 4)))
  fi
fi
if [[ -z "$payload_start" ]]; then
  for magic in '\x02\x21\x4c\x18' '\x1f\x8b\x08' '\xfd\x37\x7a\x58\x5a\x00' '\x28\xb5\x2f\xfd'; do
    off=$(LC_ALL=C grep -obaUP -m 1 "$magic" "$vmlinuz" 2>/dev/null | head -n 1 | cut -d: -f1 || true)
    if [[ -n "$off" ]] && [[ -z "$payload_start" || "$off" -lt "$payload_start" ]]; then payload_start=$off; fi
  done
  [[ -n "$payload_start" ]] || die "no lz4, gzip, xz or zstd payload found in $vmlinuz"
fi
decompress=$(decompressor_for "$(hex_at "$vmlinuz" "$payload_start" 6)")
command -v "${decompress%% *}" >/dev/null || die "${decompress%% *} not found (install lz4, gzip, xz-utils or zstd)"
# Trailing bytes after the compressed stream make some decompressors exit non-zero after writing all of it (lz4's
# legacy frame has no end mark); the checks below judge the result.
if [[ -n "$payload_len" ]]; then
  tail -c "+$((payload_start + 1))" "$vmlinuz" | head -c "$payload_len" | $decompress >"$stage/vmlinux" 2>/dev/null || true
else
  tail -c "+$((payload_start + 1))" "$vmlinuz" | $decompress >"$stage/vmlinux" 2>/dev/null || true
fi
[[ "$(hex_at "$stage/vmlinux" 0 4)" == 7f454c46 ]] ||
  die "decompressing $vmlinuz (${decompress%% *} at offset $payload_start) gave no ELF"
if [[ -n "$expected_size" ]]; then
  size=$(stat -c %s "$stage/vmlinux")
  [[ "$size" == "$expected_size" ]] || die "vmlinux from $vmlinuz is $size bytes, its header says $expected_size"
fi

# --- modules: the wanted ones and everything their depends= names, flat and uncompressed ---
mkdir "$stage/modules"
[[ -f "$moddir/modules.builtin" ]] && cp "$moddir/modules.builtin" "$stage/modules/modules.builtin"
declare -A module_file=()
while IFS= read -r -d '' f; do
  n=$(basename "$f")
  n=${n%%.ko*}
  module_file["${n//-/_}"]=$f
done < <(find "$moddir" \( -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz' \) -print0 | sort -z)
# A module's .modinfo strings (NUL-separated key=value), from the ELF section when objcopy is there, else the file's
# NUL-separated strings.
modinfo_strings() {
  if command -v objcopy >/dev/null; then
    objcopy -O binary --only-section=.modinfo "$1" "$work/modinfo" && tr '\0' '\n' <"$work/modinfo"
  else
    tr '\0' '\n' <"$1"
  fi
}
is_builtin() { grep -q "/${1}.ko\$\|/${1//_/-}.ko\$" "$moddir/modules.builtin" 2>/dev/null; }
declare -A done_modules=()
queue=("${MODULES[@]}")
while ((${#queue[@]} > 0)); do
  m=${queue[0]//-/_}
  queue=("${queue[@]:1}")
  [[ -z "${done_modules[$m]:-}" ]] || continue
  done_modules[$m]=1
  src=${module_file[$m]:-}
  if [[ -z "$src" ]]; then
    is_builtin "$m" && continue
    die "$pkg has no module $m (neither a .ko nor built in)"
  fi
  out="$stage/modules/$m.ko"
  case "$src" in
    *.ko.xz) xz -dc "$src" >"$out" ;;
    *.ko.zst) zstd -dcq "$src" >"$out" ;;
    *.ko.gz) gzip -dc "$src" >"$out" ;;
    *) cp "$src" "$out" ;;
  esac
  deps=$(modinfo_strings "$out" | sed -n 's/^depends=//p' | head -n 1)
  IFS=, read -r -a dep_list <<<"$deps"
  for d in "${dep_list[@]}"; do [[ -z "$d" ]] || queue+=("$d"); done
done

echo "$release" >"$stage/release"
rm -rf "${BASE:?}/${release:?}"
mv -T "$stage" "$BASE/$release"
stage=""
is_complete "$BASE/$release" || die "$BASE/$release is incomplete after unpacking $pkg"
link_current "$release"
count=$(find "$BASE/$release/modules" -name '*.ko' | wc -l)
echo "guest-kernel: installed $release ($pkg) in $BASE/$release with $count modules; $BASE/current points at it"
