#!/usr/bin/env bash
# Builds dsec's desktop image for full VMs (docs/vm.md): Debian bookworm with its kernel, systemd, Xorg, openbox, a
# panel, a terminal, a text editor and a browser (desktop-base, debootstrap, cached like the other debootstrap
# images), then the session on top of it as a layer of its own (images/desktop/session: the unit that starts X at
# boot, openbox's autostart, and /etc/dsec/ready-files naming what a create waits for), tagged NAME (default:
# desktop). Extra arguments go to the debootstrap build (e.g. --mirror URL).
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:-desktop}
shift || true
DSEC=${DSEC:-build/bin/dsec}
PACKAGES=systemd-sysv,linux-image-amd64,udev,xserver-xorg-core,xserver-xorg-input-libinput,xinit,openbox,tint2
PACKAGES+=,xterm,mousepad,dillo,dbus-x11,fonts-dejavu-core,x11-xserver-utils
"$DSEC" image build "$NAME-base" --from debootstrap:bookworm --include "$PACKAGES" "$@"
"$DSEC" image build "$NAME" --parent "$NAME-base" --from dir:images/desktop/session --role toolchain
