"""The cyclic collector's time as a `[gc]` frame (workloads/gc_cycles.py: a
thread that allocates cycles, about half of its time in the collector by
its own gc.callbacks clock), on every supported interpreter."""
import os
import subprocess

import pytest

from conftest import (CHROOT_LABELS, MATRIX_LABELS, chroot_cmd, chroot_workloads, env, pyoffcpu_cmd,
                      python_or_skip, source_line)

LABELS = MATRIX_LABELS + ["debian-3.14", "debian-3.15"]


@pytest.mark.parametrize("label", LABELS)
def test_gc_time_is_a_gc_frame_under_the_allocating_line(tmp_path, bpf, label):
    python = python_or_skip(label)
    if label in CHROOT_LABELS:
        argv = chroot_cmd(label, os.path.join(chroot_workloads(), "gc_cycles.py"), 4)
    else:
        argv = [python, os.path.join(os.path.dirname(__file__), "workloads", "gc_cycles.py"), "4"]
    out = tmp_path / "out.folded"
    # pyoffcpu runs the workload: the recording covers all of it, as its clock does
    res = subprocess.run(pyoffcpu_cmd("-F", "499", "-o", str(out), "--", *argv), env=env(),
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    gc_s, total_s = (float(x) for x in res.stdout.split("gc ", 1)[1].split(" of "))
    lines = [ln.rsplit(" ", 1) for ln in out.read_text().splitlines()]
    main = [(st.split(";"), int(us)) for st, us in lines if "allocate (" in st]
    in_gc = sum(us for st, us in main if "[gc]" in st) / 1e6
    everything = sum(us for st, us in main) / 1e6
    # the [gc] frame sits right under the frame that was running when the
    # collection began: at the allocation (3.7-3.11: of the Node or of its
    # __dict__ or list), or, from 3.12 on, at the next check of the eval
    # breaker (Node.__init__'s first line)
    where = {f"gc_cycles.py:{source_line('gc_cycles.py', m) + d})"
             for m, d in (("# ALLOC", 0), ("# DATA", 0), ("# DATA", -1), ("# DATA", -2))}
    # (native frames may sit between; where the collector's are not named, a
    # gc.callbacks function it runs is taken for that frame: the workload's
    # `measure`)
    for st, us in main:
        if "[gc]" in st:
            python = [f for f in st[:st.index("[gc]")] if "gc_cycles.py:" in f]
            assert any(python[-1].endswith(x) for x in where) or python[-1].startswith("measure ("), st
    # within 20% of what gc.callbacks measured, as a share of the loop's time
    want, got = gc_s / total_s, in_gc / everything
    assert abs(got - want) <= 0.2 * want, (got, want, res.stderr[-2000:])
    assert "the cyclic garbage collector ([gc] frames)" in res.stderr
