#!/usr/bin/env python3
"""Builds dist/pyoffcpu_<version>_amd64.deb (`make deb`): pyoffcpu as a system
tool that depends only on Debian 12's packages.

    python3 tools/build_deb.py [OUTDIR]

What it installs:
  /usr/bin/pyoffcpu
  /usr/lib/python3/dist-packages/pyoffcpu/      the package, with its BPF C (bpf/)
  /usr/share/pyoffcpu/setup-kernel-headers      tools/kernel-headers.sh
  /usr/share/doc/pyoffcpu/                      README.md, docs/, copyright, changelog
  /usr/share/man/man1/pyoffcpu*.1.gz            tools/manpages.py (from --help itself)
  /usr/share/bash-completion/completions/pyoffcpu   click's own completion
  /lib/systemd/system/pyoffcpu-snapshot.{service,timer}, pyoffcpu-crashes.service
                                                shipped disabled
Its scripts: postinst byte-compiles the package (py3compile), makes
/var/cache/pyoffcpu root-only and, where bcc is installed (suggested: the
BPF programs ship compiled), links kernel headers for it where the running
kernel has none (the links it makes are listed, to go at purge);
prerm removes the byte-code; postrm purge removes /var/cache/pyoffcpu and
those links, and leaves /var/lib/pyoffcpu (snapshots and crash reports).

The compiled helper (pyoffcpu-elf, `make helper`) goes in: it is the one
builder of unwind tables and symbol indexes, so the package is amd64.  Its
prologue analysis decodes with capstone 5 (the wheel's libcapstone.so that
it is built against); Debian 12's libcapstone4 has another ABI, so that
library goes in beside it (native/helper/lib/, with its VERSION and
license).
"""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "pytool"))
sys.path.insert(0, HERE)

# Debian 12's versions are the floors the code is tested on (pyproject.toml's too)
# (the BPF programs ship compiled, pyoffcpu/bpfobj/: bcc and the kernel headers
# only compile them again for a kernel that refuses those: suggested)
DEPENDS = ["python3 (>= 3.9)", "python3-pyelftools (>= 0.29)", "python3-click (>= 8.0)",
           "python3-capstone (>= 4.0.2)"]
SUGGESTS = ["python3-bpfcc", "linux-headers-amd64"]
RECOMMENDS = ["zstd", "lz4"]        # dump --core of systemd-coredump's compressed cores
UNITS = ("pyoffcpu-snapshot.service", "pyoffcpu-snapshot.timer", "pyoffcpu-crashes.service")

POSTINST = """#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if command -v py3compile >/dev/null 2>&1; then
        py3compile -p pyoffcpu
    fi
    # the program and unwind-table caches steer BPF programs: root's alone
    mkdir -p /var/cache/pyoffcpu
    chown root:root /var/cache/pyoffcpu
    chmod 0700 /var/cache/pyoffcpu
    # headers bcc can compile against, when the running kernel has none: only
    # where bcc is installed (suggested: the programs ship compiled, and bcc
    # compiles them only for a kernel that refuses those)
    if [ -d /usr/lib/python3/dist-packages/bcc ]; then
        /usr/share/pyoffcpu/setup-kernel-headers /var/cache/pyoffcpu/kernel-header-links ||
            echo "pyoffcpu: no kernel headers for bcc yet: \\`pyoffcpu doctor\\` says whether they are needed" >&2
    fi
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload >/dev/null 2>&1 || true
    fi
fi
exit 0
"""

PRERM = """#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    for u in pyoffcpu-snapshot.timer pyoffcpu-snapshot.service pyoffcpu-crashes.service; do
        systemctl stop "$u" >/dev/null 2>&1 || true
    done
fi
if command -v py3clean >/dev/null 2>&1; then
    py3clean -p pyoffcpu
else
    find /usr/lib/python3/dist-packages/pyoffcpu -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true
fi
exit 0
"""

POSTRM = """#!/bin/sh
set -e
if [ "$1" = purge ]; then
    # the kernel-header links postinst made (only links, only to Debian's headers)
    if [ -f /var/cache/pyoffcpu/kernel-header-links ]; then
        while read -r link; do
            case $(readlink "$link" 2>/dev/null) in
                /usr/src/linux-headers-*) rm -f "$link"; rmdir "$(dirname "$link")" 2>/dev/null || true ;;
            esac
        done </var/cache/pyoffcpu/kernel-header-links
    fi
    rm -rf /var/cache/pyoffcpu
    # /var/lib/pyoffcpu (snapshots, crash reports) is the user's: left
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
exit 0
"""

LAUNCHER = """#!/usr/bin/python3
import sys

from pyoffcpu.cli import main

sys.exit(main())
"""

COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: pyoffcpu

Files: *
Copyright: the pyoffcpu authors
License: Apache-2.0
 On Debian systems the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.

Files: usr/lib/python3/dist-packages/pyoffcpu/native/helper/lib/libcapstone.so
Copyright: Nguyen Anh Quynh and the Capstone contributors
License: BSD-3-clause
 The Capstone disassembly framework (https://www.capstone-engine.org), as
 its Python wheel ships it. Redistribution and use in source and binary
 forms, with or without modification, are permitted under the conditions
 of the 3-clause BSD license; on Debian systems its text is in
 /usr/share/common-licenses/BSD.
"""


class BuildError(Exception):
    """What is missing to build the package (one line)."""


def _copy_package(dest: str) -> None:
    src = os.path.join(ROOT, "pytool", "pyoffcpu")
    from pyoffcpu.native import helper as H
    if not H.available():
        raise BuildError(f"{H.BINARY} is not built: run `make helper` (make deb does)")
    lib = H.capstone_lib()
    version = H.capstone_version()
    if lib is None or lib == H.BUNDLED_CAPSTONE or not version:
        raise BuildError("no capstone wheel in this Python (pip install capstone>=5): "
                         "its libcapstone.so goes into the package")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.c.o", "lib")
    # bpf/ is a link to the tree's bpf/: its files go in (copytree follows it)
    shutil.copytree(src, dest, ignore=ignore, symlinks=False)
    helper = os.path.join(dest, "native", "helper")
    for name in os.listdir(helper):
        if name.endswith((".c", ".h")):
            os.unlink(os.path.join(helper, name))
    bundled = os.path.join(helper, "lib")
    os.makedirs(bundled)
    shutil.copy(os.path.join(lib, "libcapstone.so"), bundled)
    subprocess.run(["strip", "--strip-unneeded", os.path.join(bundled, "libcapstone.so")], check=True)
    os.chmod(os.path.join(bundled, "libcapstone.so"), 0o644)
    _write(os.path.join(bundled, "VERSION"), version + "\n")
    subprocess.run(["strip", "--strip-debug", os.path.join(helper, "pyoffcpu-elf")], check=True)


def _write(path: str, text: str, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _gzip(src: str, dest: str) -> None:
    with open(src, "rb") as f, gzip.GzipFile(dest, "wb", compresslevel=9, mtime=0) as g:
        g.write(f.read())
    os.chmod(dest, 0o644)


def _completion() -> str:
    """click's bash completion script for pyoffcpu (click 8's bash_source)."""
    from click.shell_completion import BashComplete
    from pyoffcpu.cli import main
    return BashComplete(main, {}, "pyoffcpu", "_PYOFFCPU_COMPLETE").source()


def _units() -> dict:
    from pyoffcpu.commands import crashes, snapshot
    units = snapshot.systemd_units(["/usr/bin/pyoffcpu", "snapshot", "--dir", "/var/lib/pyoffcpu/snapshots"])
    units["pyoffcpu-crashes.service"] = crashes.systemd_unit(
        ["/usr/bin/pyoffcpu", "crashes", "--dir", "/var/lib/pyoffcpu/crashes"])
    return units


def build(outdir: str) -> str:
    from pyoffcpu import __version__
    import manpages
    stage = tempfile.mkdtemp(prefix="pyoffcpu-deb-")
    try:
        os.chmod(stage, 0o755)
        _copy_package(os.path.join(stage, "usr/lib/python3/dist-packages/pyoffcpu"))
        _write(os.path.join(stage, "usr/bin/pyoffcpu"), LAUNCHER, 0o755)
        with open(os.path.join(HERE, "kernel-headers.sh")) as f:
            _write(os.path.join(stage, "usr/share/pyoffcpu/setup-kernel-headers"), f.read(), 0o755)
        doc = os.path.join(stage, "usr/share/doc/pyoffcpu")
        os.makedirs(os.path.join(doc, "docs"), exist_ok=True)
        shutil.copy(os.path.join(ROOT, "README.md"), doc)
        for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
            if name.endswith(".md"):
                shutil.copy(os.path.join(ROOT, "docs", name), os.path.join(doc, "docs"))
        _write(os.path.join(doc, "copyright"), COPYRIGHT)
        changelog = os.path.join(stage, "changelog")
        _write(changelog, f"pyoffcpu ({__version__}) unstable; urgency=medium\n\n"
                          "  * Built from the source tree by tools/build_deb.py.\n\n"
                          " -- pyoffcpu <pyoffcpu@localhost>  Thu, 01 Jan 1970 00:00:00 +0000\n")
        _gzip(changelog, os.path.join(doc, "changelog.gz"))
        os.unlink(changelog)
        mandir = os.path.join(stage, "usr/share/man/man1")
        raw = tempfile.mkdtemp(prefix="pyoffcpu-man-")
        try:
            os.makedirs(mandir, exist_ok=True)
            for p in manpages.write_pages(raw):
                _gzip(p, os.path.join(mandir, os.path.basename(p) + ".gz"))
        finally:
            shutil.rmtree(raw, ignore_errors=True)
        _write(os.path.join(stage, "usr/share/bash-completion/completions/pyoffcpu"), _completion())
        for name, text in _units().items():
            _write(os.path.join(stage, "lib/systemd/system", name), text)
        size_kib = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(stage) for f in fs) // 1024
        control = "\n".join([
            "Package: pyoffcpu", f"Version: {__version__}", "Architecture: amd64",
            "Maintainer: pyoffcpu <pyoffcpu@localhost>", f"Installed-Size: {size_kib}",
            "Depends: " + ", ".join(DEPENDS), "Recommends: " + ", ".join(RECOMMENDS),
            "Suggests: " + ", ".join(SUGGESTS),
            "Section: devel", "Priority: optional",
            "Description: wall-clock profiler for Python programs and their native code (eBPF)",
            " pyoffcpu profiles running Python processes without stopping them: on-CPU",
            " time by perf-event sampling, off-CPU time exactly at every context switch,",
            " Python frames walked in BPF and interleaved with native and kernel frames.",
            " Also: dump (every thread's stack now, or from a core file), top, snapshot",
            " for cron, crashes (a watcher of crashing processes) and doctor.", ""])
        debian = os.path.join(stage, "DEBIAN")
        _write(os.path.join(debian, "control"), control)
        _write(os.path.join(debian, "postinst"), POSTINST, 0o755)
        _write(os.path.join(debian, "prerm"), PRERM, 0o755)
        _write(os.path.join(debian, "postrm"), POSTRM, 0o755)
        for d, dirs, files in os.walk(stage):
            for x in dirs:
                os.chmod(os.path.join(d, x), 0o755)
        os.makedirs(outdir, exist_ok=True)
        out = os.path.join(outdir, f"pyoffcpu_{__version__}_amd64.deb")
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", stage, out], check=True,
                       stdout=subprocess.DEVNULL)
        return out
    finally:
        shutil.rmtree(stage, ignore_errors=True)


if __name__ == "__main__":
    try:
        print(build(os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "dist"))))
    except BuildError as e:
        print(f"build_deb.py: {e}", file=sys.stderr)
        sys.exit(1)
