#!/bin/sh
# bcc compiles BPF C against the running kernel's headers, at
# /lib/modules/$(uname -r)/build (and source/). When they are missing (a
# custom kernel), Debian's newest linux-headers-*-amd64 will do, as long as
# the BPF C never dereferences kernel structs (pyoffcpu's does not). Debian
# splits them in two: both are linked, as build/ and source/.
# Only links this makes are ever replaced; real headers are never touched.
# Usage: kernel-headers.sh [LIST]   (as root; LIST: a file the links made are
# appended to, for the Debian package's purge to remove them again)
# Used by tools/setup-system.sh and, as /usr/share/pyoffcpu/setup-kernel-headers,
# by the Debian package.
set -eu
list=${1:-}
kdir="/lib/modules/$(uname -r)"
if [ -e "$kdir/build/include/generated/autoconf.h" ] || [ -e "$kdir/build/include/linux/kconfig.h" ]; then
    exit 0
fi
arch_dir=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1)
if [ -z "$arch_dir" ]; then
    echo "pyoffcpu: no kernel headers for $(uname -r) and no /usr/src/linux-headers-*-amd64 (apt install linux-headers-amd64)" >&2
    exit 1
fi
common_dir="${arch_dir%-amd64}-common"
mkdir -p "$kdir"
for pair in "build:$arch_dir" "source:$common_dir"; do
    name=${pair%%:*}; dest=${pair#*:}
    if [ -e "$kdir/$name" ] && [ ! -L "$kdir/$name" ]; then
        echo "pyoffcpu: $kdir/$name exists and is not a link; leaving it" >&2
        continue
    fi
    ln -sfn "$dest" "$kdir/$name"
    [ -z "$list" ] || echo "$kdir/$name" >>"$list"
done
echo "pyoffcpu: kernel headers for $(uname -r): $arch_dir (+ -common)"
