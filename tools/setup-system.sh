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

# bcc compiles BPF C against the running kernel's headers. When they are
# missing (a custom kernel), Debian's newest linux-headers-*-amd64 will do, as
# long as the BPF C never dereferences kernel structs (it does not). Debian
# splits them in two: both must be reachable as build/ and source/.
kdir="/lib/modules/$(uname -r)"
if [ ! -e "$kdir/build/include/generated/autoconf.h" ] && [ ! -e "$kdir/build/include/linux/kconfig.h" ]; then
    arch_dir=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$arch_dir" ]; then
        echo "setup-system: no /usr/src/linux-headers-*-amd64 after installing linux-headers-amd64" >&2
        exit 1
    fi
    common_dir="${arch_dir%-amd64}-common"
    mkdir -p "$kdir"
    # Only links we made ourselves are replaced; real headers are never touched.
    for pair in "build:$arch_dir" "source:$common_dir"; do
        name=${pair%%:*}; dest=${pair#*:}
        if [ -e "$kdir/$name" ] && [ ! -L "$kdir/$name" ]; then
            echo "setup-system: $kdir/$name exists and is not a link; leaving it" >&2
            continue
        fi
        ln -sfn "$dest" "$kdir/$name"
    done
    echo "setup-system: kernel headers for $(uname -r): $arch_dir (+ -common)"
fi

if [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing
    echo "setup-system: mounted tracefs at /sys/kernel/tracing"
fi
