#!/usr/bin/env bash
# Every system step pyoffcpu needs on a fresh Debian 12 machine, idempotent:
# Debian packages, kernel headers bcc can compile against, tracefs.
# Usage: tools/setup-system.sh [extra Debian packages...]   (as root)
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "setup-system: must run as root (sudo make install)" >&2
    exit 1
fi

packages=(python3-bpfcc python3-venv python3-pip linux-headers-amd64 gcc make binutils "$@")
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup-system: installing ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# bcc compiles BPF C against the running kernel's headers: Debian's stand in
# where they are missing (kernel-headers.sh says how).
"$(dirname "$0")/kernel-headers.sh"

if [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing
    echo "setup-system: mounted tracefs at /sys/kernel/tracing"
fi
