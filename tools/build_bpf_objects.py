#!/usr/bin/env python3
"""Compiles pyoffcpu's BPF programs for the package (`make bpf-objects`).

    sudo .venv/bin/python tools/build_bpf_objects.py           # write pytool/pyoffcpu/bpfobj/
    sudo .venv/bin/python tools/build_bpf_objects.py --check   # exit 1 where they differ from a rebuild

Each program set (the recording's, bpf/pyoffcpu.bpf.c; the crash
watcher's, bpf/crashes.bpf.c) is compiled by bcc once, with the flags
every recording uses: what a recording turns on and what it needs of the
kernel are load-time constants (bpf/loadconst.h).  The result is the entry
the program cache holds (collect/progcache.py), named by the sha256 of its
source (progcache.source_key), so that a package whose bpf/ changed after
the build compiles on the target instead of loading a stale object.  bcc
is needed here, not where the package runs.  Other files in the directory
are removed: it holds this build's objects only.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "pytool"))


def sources():
    """(name, text, flags) of each program set the package ships."""
    os.environ.pop("PYOFFCPU_MEMO_VERIFY", None)     # the tests' build, never shipped
    from pyoffcpu.collect import crashcapture, sessionsetup
    return [("recording", *sessionsetup.program_source()), ("crashes", *crashcapture.program_source())]


def build():
    """{file name: entry bytes} of a fresh compile of every set."""
    from pyoffcpu.collect import progcache
    out = {}
    for name, text, cflags in sources():
        key = progcache.source_key(text, cflags)
        entry = progcache.compile_in_child(text, cflags)
        entry["key"] = key
        progcache.check_entry(entry, key)
        out[key + ".bpf"] = progcache.serialize(entry)
        print(f"build_bpf_objects: {name}: {len(entry['programs'])} programs, {len(entry['maps'])} maps "
              f"-> {key[:16]}….bpf", file=sys.stderr)
    return out


def differences(built, directory: str):
    """What differs between a fresh build and the shipped files, in words."""
    from pyoffcpu.collect import progcache
    have = {n for n in os.listdir(directory) if n.endswith(".bpf")} if os.path.isdir(directory) else set()
    out = [f"{n}: not shipped (bpf/ changed since `make bpf-objects`?)" for n in sorted(set(built) - have)]
    out += [f"{n}: shipped, but no source makes it now" for n in sorted(have - set(built))]
    for n in sorted(set(built) & have):
        with open(os.path.join(directory, n), "rb") as f:
            data = f.read()
        if data != built[n]:
            new, old = progcache.parse(built[n]), progcache.parse(data)
            what = [p["name"] for p in new["programs"] if p not in old["programs"]]
            what += [m["name"] for m in new["maps"] if m not in old["maps"]]
            out.append(f"{n}: differs from a rebuild ({', '.join(what[:6]) or 'its header'})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with a rebuild; write nothing")
    ap.add_argument("--dir", default=None, help="the objects' directory (default: the package's bpfobj/)")
    args = ap.parse_args()
    from pyoffcpu.collect import progcache
    directory = args.dir or progcache.SHIPPED_DIR
    built = build()
    if args.check:
        diff = differences(built, directory)
        for line in diff:
            print(f"build_bpf_objects: {line}", file=sys.stderr)
        if diff:
            print("build_bpf_objects: run `make bpf-objects` and commit pytool/pyoffcpu/bpfobj/",
                  file=sys.stderr)
        return 1 if diff else 0
    os.makedirs(directory, exist_ok=True)
    for n in os.listdir(directory):
        if n.endswith(".bpf") and n not in built:
            os.unlink(os.path.join(directory, n))
    for n, data in built.items():
        tmp = os.path.join(directory, f".{n}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(directory, n))
    with open(os.path.join(directory, "README"), "w") as f:
        f.write("Made by `make bpf-objects` (tools/build_bpf_objects.py) from bpf/: do not edit.\n"
                "Each file is one program set's compile, named by the sha256 of its source.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
