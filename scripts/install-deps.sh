#!/usr/bin/env bash
# Installs every Debian package dsec needs to build, test and run on Debian 12 (bookworm), then the microVM backend's
# guest kernel (scripts/guest-kernel.sh). Idempotent: when all are present it only checks (well under a second) and
# never touches the network; otherwise it runs apt-get update once and installs what is missing. Needs root.
set -euo pipefail

PACKAGES=(
  # build tools
  build-essential cmake ninja-build g++ pkg-config git
  # libdsec and dsecd
  libboost-dev libboost-system-dev libfmt-dev libcurl4-openssl-dev libssl-dev libzstd-dev nlohmann-json3-dev
  libseccomp-dev libarchive-dev
  # sandbox networks: the agent's nftables table through libnftables, libnetfilter-conntrack to drop the connection
  # tracking entries of connections the rules no longer allow (nftables and conntrack: the commands, for people)
  libnftables-dev libnetfilter-conntrack-dev nftables conntrack
  # the agent's DNS resolver for sandboxes parses queries and builds answers with ldns (NLnet Labs) rather than by
  # hand: the packets come from code inside sandboxes; the network tests' DNS stand-in is python3-dnslib
  libldns-dev python3-dnslib
  # layered images: FUSE for streaming layers on demand, mkfs.erofs/fsck.erofs for making and extracting them
  libfuse3-dev fuse3 erofs-utils
  # unit tests
  libgtest-dev libgmock-dev
  # fuzzing (scripts/fuzz.sh, and the fuzz step of scripts/test.sh): clang 14 and its runtimes (libFuzzer, ASan, UBSan)
  clang libclang-rt-14-dev
  # the tree's habits (scripts/format.sh, scripts/tidy.py): clang-format and clang-tidy, 14 as clang is
  clang-format clang-tidy
  # the Python binding and the integration tests (for Debian's /usr/bin/python3); flake8 and mypy lint them
  # (scripts/lint-python.sh)
  python3 python3-dev python3-setuptools python3-pytest pybind11-dev python3-pybind11 flake8 mypy
  # images: busybox-static for the tiny image, debootstrap (with the archive keys and gpgv) for Debian images
  busybox-static debootstrap debian-archive-keyring gpgv ca-certificates
  # sandbox runtime helpers and the reference runtimes benchmarks compare against
  crun bubblewrap iproute2 util-linux curl
  # the access tests make a certificate authority of their own with the openssl command (docs/security.md); the
  # full-VM test answers VNC authentication's DES challenge with python3-cryptography
  openssl python3-cryptography
  # the HTTP image store the tests start (nginx with its WebDAV module for PUT and DELETE)
  nginx-light
  # registry images (docs/images.md): the tests start their own OCI registry (Debian's docker-registry, the CNCF
  # distribution server; the packaged service is stopped and disabled below), push images into it with skopeo, sign
  # its bearer tokens with python3-jwt and write zstd layers with zstd; the registry benchmark compares with
  # skopeo copy + umoci unpack and with Debian's Docker engine's pull (a dockerd of its own, no firewall rules; the
  # packaged service never starts)
  docker-registry skopeo umoci python3-jwt zstd docker.io
  # discovery: agents register in etcd and clients watch it; the tests start their own etcd (/usr/bin/etcd) on
  # free loopback ports, so the packaged service is stopped and disabled below
  etcd-server
  # the microVM backend: QEMU (microvm machine, direct kernel boot), qemu-img for its disk images, and lz4 to unpack
  # the guest kernel's bzImage into the vmlinux QEMU boots (scripts/guest-kernel.sh; the kernel is Debian's
  # linux-image-cloud-amd64, unpacked into /var/cache/dsec/guest-kernel, never installed as the host's kernel)
  qemu-system-x86 qemu-utils lz4
)

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# One dpkg query for all of them; a package dpkg has never heard of is simply absent from its answer.
declare -A installed=()
while read -r name status; do
  [[ "$status" == "installed" ]] && installed["${name%%:*}"]=1
done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${PACKAGES[@]}" 2>/dev/null || true)
missing=()
for p in "${PACKAGES[@]}"; do
  [[ -n "${installed[$p]:-}" ]] || missing+=("$p")
done

install_missing() {
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing packages: ${missing[*]}" >&2
    echo "install-deps: run as root (sudo scripts/install-deps.sh) to install them" >&2
    exit 1
  fi

  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # No service of a package starts while it is installed (Debian's policy-rc.d convention): a system-wide dockerd
  # would rewrite the host's firewall rules, an etcd or a registry would take their default ports.
  local policy=/usr/sbin/policy-rc.d own_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
  fi
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null || {
    [[ $own_policy -eq 1 ]] && rm -f "$policy"
    exit 1
  }
  [[ $own_policy -eq 1 ]] && rm -f "$policy"

  # The etcd, docker-registry and docker.io packages come with system-wide services; dsec needs only the binaries
  # (its tests and benchmarks start their own), so none is left enabled either.
  for pair in etcd-server:etcd docker-registry:docker-registry docker.io:docker; do
    package=${pair%%:*}
    service=${pair#*:}
    [[ " ${missing[*]} " == *" $package "* ]] || continue
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null 2>&1; then
      systemctl disable --now "$service.service" >/dev/null 2>&1 || true
    elif [[ -x /etc/init.d/$service ]]; then
      "/etc/init.d/$service" stop >/dev/null 2>&1 || true
      update-rc.d "$service" disable >/dev/null 2>&1 || true
    fi
  done
}

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages are installed"
else
  install_missing
fi

# The guest kernel, after the packages either way (it needs apt-get download, dpkg-deb and lz4). When it is already
# unpacked this is one check of a directory, so the fast path stays fast.
"$SCRIPT_DIR/guest-kernel.sh"
