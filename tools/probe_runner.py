"""Runs a layout probe (a script that prints one JSON object of offsets
measured on live objects) under every interpreter this machine has, and
writes the table a generator renders from them.  Shared by
tools/gen_asyncio_offsets.py and tools/gen_object_layouts.py.

The interpreters: pyenv's (plain ``3.X.Y`` names, from `first_minor` on),
Debian's /usr/bin/python3.11, and the chroot's python3.14, python3.14d,
python3.15 and python3.15d (``$PYOFFCPU_CHROOT``, default
/var/cache/pyoffcpu/chroot/forky; needs root).  Builds of one minor version
(patch releases, debug builds) must agree, or the run fails and prints the
difference.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

CHROOT = os.path.realpath(os.environ.get("PYOFFCPU_CHROOT", "/var/cache/pyoffcpu/chroot/forky"))
# What differs between builds of one minor version and is not a layout.
NOT_LAYOUT = ("version", "debug")


def interpreters(probe, first_minor):
    """(label, argv prefix, probe path as the interpreter sees it)."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    inside = "/tmp/" + os.path.basename(probe)
    out = []
    for d in sorted(glob.glob(os.path.join(root, "versions", "3.*")),
                    key=lambda p: [int(x) for x in re.findall(r"\d+", os.path.basename(p))]):
        m = re.fullmatch(r"3\.(\d+)\.\d+", os.path.basename(d))
        if m and int(m.group(1)) >= first_minor:
            out.append((os.path.basename(d), [os.path.join(d, "bin", "python")], probe))
    if os.path.exists("/usr/bin/python3.11") and first_minor <= 11:
        out.append(("debian-3.11", ["/usr/bin/python3.11"], probe))
    if os.geteuid() == 0 and os.path.isdir(CHROOT):
        for name in ("python3.14", "python3.14d", "python3.15", "python3.15d"):
            if os.path.exists(os.path.join(CHROOT, "usr", "bin", name)):
                out.append(("chroot-" + name, ["chroot", CHROOT, name], inside))
    return out


def probe_all(probe, first_minor):
    """({minor: layout}, {minor: [sources]})."""
    if os.geteuid() == 0 and os.path.isdir(CHROOT):
        shutil.copy(probe, os.path.join(CHROOT, "tmp", os.path.basename(probe)))
    by_minor, sources = {}, {}
    for label, argv, path in interpreters(probe, first_minor):
        r = subprocess.run(argv + ["-W", "ignore", path], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            sys.exit("%s: probe failed: %s" % (label, (r.stderr or r.stdout).strip()[-400:]))
        data = json.loads(r.stdout.strip().splitlines()[-1])
        minor = tuple(data["version"][:2])
        layout = {k: v for k, v in data.items() if k not in NOT_LAYOUT}
        if minor in by_minor and by_minor[minor] != layout:
            diff = {k: (by_minor[minor].get(k), layout.get(k))
                    for k in set(layout) | set(by_minor[minor])
                    if by_minor[minor].get(k) != layout.get(k)}
            sys.exit("%s disagrees with %s: %r" % (label, sources[minor][0], diff))
        by_minor.setdefault(minor, layout)
        sources.setdefault(minor, []).append("%s (%s)" % (label, ".".join(map(str, data["version"]))))
    return by_minor, sources


def render_tables(header_lines, by_minor, sources):
    """The generated module: its header (a comment and docstring), then
    SOURCES and LAYOUTS."""
    lines = list(header_lines) + ["", "SOURCES = {"]
    for minor in sorted(sources):
        lines.append("    %r: %r," % (minor, tuple(sources[minor])))
    lines += ["}", "", "LAYOUTS = {"]
    for minor in sorted(by_minor):
        lines.append("    %r: {" % (minor,))
        for k in sorted(by_minor[minor]):
            lines.append("        %r: %r," % (k, by_minor[minor][k]))
        lines.append("    },")
    lines += ["}", ""]
    return "\n".join(lines)


def main(doc, out_path, probe, first_minor, header_lines, generator):
    """A generator's command line: write the table, or --check it."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = render_tables(header_lines, *probe_all(probe, first_minor))
    write_or_check(out_path, text, args.check, generator)


def write_or_check(out_path, text, check, generator):
    name = os.path.basename(out_path)
    if check:
        with open(out_path) as f:
            if f.read() != text:
                sys.exit("%s is out of date: run tools/%s" % (name, generator))
        print("%s is up to date" % name)
        return
    with open(out_path, "w") as f:
        f.write(text)
    print("wrote", os.path.relpath(out_path))
