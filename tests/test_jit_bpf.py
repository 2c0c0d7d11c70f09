"""Code made at run time (oneDNN's kernels in PyTorch, a JIT compiler's
output) has no file, no table and no trustworthy frame pointer: the native
walk ends there, the frame is `[jit]`, the Python frames that called it
stay, and no frame is guessed (issue 23).

workloads/jit_spin.c spins in a loop copied into anonymous executable
memory, called from jit_caller (built with frame pointers), called from
jit_outer.  The loop leaves rbp alone, so a frame-pointer step out of it
lands in jit_outer and skips jit_caller: the edge `jit_outer;[jit]` (or
`jit_outer;[unknown]`) would be a false frame, and this test fails on it."""
import os
import subprocess

import pytest

from conftest import WORKLOADS, Workload, python_or_skip, record_folded


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    so = tmp_path_factory.mktemp("jit") / "libjit_spin.so"
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-shared", "-fPIC", "-o", str(so),
                    os.path.join(WORKLOADS, "jit_spin.c")], check=True)
    return str(so)


@pytest.mark.parametrize("label", ["pyenv-3.11", "debian-3.11"])
def test_jit_code_ends_the_walk_and_guesses_no_frame(tmp_path, bpf, library, label):
    w = Workload(python_or_skip(label), "jit_spin.py", library, 60)
    try:
        res, prof = record_folded(tmp_path, "-p", str(w.pid), "-d", "3", "-F", "499")
    finally:
        w.stop()
    spin = {k: ns for k, ns in prof.weights.items()
            if k.off_cpu is None and any(f.name == "spin_jit" for f in k.frames)}
    total = sum(spin.values())
    in_jit = {k: ns for k, ns in spin.items() if k.frames[-1].name == "[jit]"}
    assert total > 1e9, res.stderr
    # nearly all of it is in the made code (the rest: clock_gettime, the loop in C)
    assert sum(in_jit.values()) >= 0.8 * total, (sum(in_jit.values()), total)
    for k in in_jit:
        names = [f.name for f in k.frames]
        # under the Python frame that called it: nothing, or the true chain
        below = names[names.index("spin_jit") + 1:-1]
        below = [n for n in below if n in ("jit_outer", "jit_caller")]
        assert below in ([], ["jit_outer", "jit_caller"]), names
    assert not any(f.name.startswith("[unknown]") for k in in_jit for f in k.frames)
    assert "code made at run time ([jit])" in res.stderr, res.stderr
