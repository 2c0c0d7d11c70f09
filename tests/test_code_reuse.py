"""A code object's address reused by the next one (cpython/code.py: stamps).

tests/workloads/code_reuse.py compiles GENERATIONS functions spin_00,
spin_01, ... one after another from their own sources; each spins for
SECONDS of CPU, then it and everything that refers to it are dropped, so the
next one's code object takes the freed memory (the workload prints each
code object's id: the test checks that addresses were reused, else it could
not fail), and on 3.11 and before its name and line table take their
predecessors' too.  Named by address alone, every generation after the
first at an address was shown as that first one (spin_00..02 with all the
time on debian-3.11).  Known truth: each generation's on-CPU time, under
its own name.
"""
import subprocess

import pytest

from conftest import CHROOT_INTERPRETERS, WORKLOADS, chroot_cmd, chroot_workloads, env, pyoffcpu_cmd, \
    python_or_skip
from pyoffcpu.cpython.code import FREED
from pyoffcpu.profile.model import FrameKind, from_folded

LABELS = ["debian-3.11", "pyenv-3.9", "pyenv-3.12", "debian-3.14"]
GENERATIONS = 12
SECONDS = 0.2


def workload_argv(label):
    args = [str(GENERATIONS), str(SECONDS)]
    interp = CHROOT_INTERPRETERS.get(label)
    if interp is None:
        return [python_or_skip(label), f"{WORKLOADS}/code_reuse.py", *args]
    python_or_skip(label)
    return chroot_cmd(label, chroot_workloads(interp.chroot) + "/code_reuse.py", *args)


@pytest.mark.parametrize("label", LABELS)
def test_each_generation_has_its_own_name(tmp_path, bpf, label):
    out = tmp_path / "reuse.folded"
    run = subprocess.run(pyoffcpu_cmd("-o", str(out), "--", *workload_argv(label)), env=env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    ids = [int(line) for line in lines if not line.startswith("took ")]
    took = [float(line.split()[1]) for line in lines if line.startswith("took ")]
    assert len(ids) == GENERATIONS, run.stdout
    assert len(set(ids)) < GENERATIONS, "no code object took a freed one's address: the test proves nothing"
    prof = from_folded(out.read_text())
    by_name, freed = {}, 0
    for k, ns in prof.weights.items():
        if k.off_cpu is not None:
            continue
        names = [f.name for f in k.frames if f.kind is FrameKind.PYTHON]
        spins = [n for n in names if n.startswith("spin_")]
        if spins:
            by_name[spins[-1]] = by_name.get(spins[-1], 0) + ns
        freed += ns if FREED.name in names else 0
    print("\n%s: %s; freed before read %.3f s" % (
        label, " ".join("%s=%.3f" % (n, t / 1e9) for n, t in sorted(by_name.items())), freed / 1e9))
    assert sorted(by_name) == ["spin_%02d" % i for i in range(GENERATIONS)], by_name
    # spin_00 runs while the interpreter is being found (its first samples
    # may have no Python frames); every later one within the sampling error
    # of its time on a CPU: SECONDS of CPU as the process counts it, up to
    # its wall time where the hypervisor stole some (CI's run on 70d6eff:
    # spin_02 0.263 s of on-CPU time, all under its own name)
    for i in range(1, GENERATIONS):
        got = by_name["spin_%02d" % i] / 1e9
        assert 0.7 * SECONDS <= got <= 1.3 * took[i], ("spin_%02d" % i, got, took[i], by_name)


def test_every_known_layout_is_stamped_in_full():
    """Every layout of the offsets tables mixes all it can: the first line,
    the 3 (<= 3.10) or 4 pointers, and the qualified name's text; a table
    change that left part of it out would weaken every stamp silently."""
    from pyoffcpu.cpython.code import StampLayout
    from pyoffcpu.cpython.offsets_table import OFFSETS, OFFSETS_FROM_SOURCE
    for minor, o in {**OFFSETS, **OFFSETS_FROM_SOURCE}.items():
        lay = StampLayout.of(o)
        assert lay.words == (0b1111 if minor >= (3, 11) else 0b111), (minor, lay)
        assert lay.name_on == 1 and lay.name == (o["code_qualname"] if minor >= (3, 11)
                                                 else o["code_name"]) - lay.code_lo, (minor, lay)


def test_a_reader_never_names_a_new_code_object_by_a_freed_ones_stamp():
    """CodeReader on this process's own memory: the code object of a
    function made by exec, then freed and another made (same name length)
    until one takes its address.  By the first one's stamp: its name where
    it was read while it lived (a stack sampled then), FREED where it was
    not; by the new one's own stamp (or none): the new name."""
    import gc
    import os
    from pyoffcpu.cpython import detect
    from pyoffcpu.cpython.code import CodeReader
    from pyoffcpu.kernel.memory import ProcessMemory
    try:
        pp = detect.find_python(os.getpid())
    except (detect.NotPython, detect.Unsupported) as e:
        pytest.skip(f"the test interpreter cannot be profiled: {e}")
    reader = CodeReader(ProcessMemory(os.getpid()), pp.minor, pp.offsets, pp.code_type)

    def make(i):
        ns = {}
        exec(compile("def f_%03d():\n    pass\n" % i, "<made>", "exec"), ns)
        return ns["f_%03d" % i]

    fn = make(0)
    addr = id(fn.__code__)
    first = reader.stamp(addr)
    assert first and reader.code(addr, first).name == "f_000"
    del fn
    gc.collect()
    for i in range(1, 500):
        fn = make(i)
        if id(fn.__code__) == addr:
            break
        del fn
    else:
        pytest.skip("no code object took the freed one's address")
    now = reader.stamp(addr)
    assert now and now != first
    assert reader.code(addr, first).name == "f_000"
    late = CodeReader(reader.mem, pp.minor, pp.offsets, pp.code_type)
    assert late.code(addr, first) is FREED
    assert reader.code(addr, now).name == late.code(addr).name == "f_%03d" % i
