"""The kernel's fold of ended threads (bpf: fold_exit), on a thread-per-request
HTTP server (tests/workloads/thread_server.py): the same groups, to the
nanosecond, as user space's fold of the same threads (PYOFFCPU_FOLD=shadow:
both, from one recording), and --keep-tids still one root per thread."""
import collections
import re

import pytest

from conftest import Workload, python_or_skip, record_folded
from pyoffcpu.kernel import bpfdefs

SECONDS = 4.0
# the server's load starts this long after it is ready: after the start,
# the first thread born (a second in: pyoffcpu then loads the fold program)
# and that program's verification in the background (~1 s of CPU here), so
# that nearly every thread is born with the kernel's fold on
DELAY = 4.0


def group_sums(stacks):
    """Per group (tid < 0): [events, on-CPU ns, off-CPU ns]."""
    out = collections.defaultdict(lambda: [0, 0, 0])
    for key, (count, ns) in stacks.items():
        if key[1] < 0:
            o = out[key[1]]
            o[0] += count
            o[1 if bpfdefs.on_cpu(key[5]) else 2] += ns
    return dict(out)


@pytest.mark.parametrize("label", ["pyenv-3.12", "debian-3.11"])
def test_kernel_fold_gives_user_spaces_groups_exactly(label, bpf, monkeypatch):
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    monkeypatch.setenv("PYOFFCPU_FOLD", "shadow")
    w = Workload(python_or_skip(label), "thread_server.py", SECONDS + 30, DELAY)
    try:
        rec = Session(Options(pids=[w.pid], duration=DELAY + SECONDS, mode="wall"), plat.probe()).run()
    finally:
        w.stop()
    user = {gid: t for gid, t in rec.threads.items() if gid < 0}
    entries = {t.entry for t in user.values()}
    assert {"ThreadingMixIn.process_request_thread (socketserver.py)",
            "short_job (thread_server.py)"} <= entries, entries
    ended = sum(t.threads for t in user.values())
    # most threads folded in the kernel (the first ones with a stack user
    # space had not seen yet are left to it, and folded here in both views)
    assert ended > 500 and rec.kernel_folded > 0.8 * ended, (ended, rec.kernel_folded)
    # each group: the same threads, times, samples and span
    for gid, t in user.items():
        k = rec.kernel_threads.get(gid)
        assert k is not None, t
        assert (k.threads, k.on_ns, k.samples, k.first_ns, k.last_ns, k.entry) == \
            (t.threads, t.on_ns, t.samples, t.first_ns, t.last_ns, t.entry), gid
    assert set(rec.kernel_threads) == set(user)
    # ... the same events and on- and off-CPU time
    assert group_sums(rec.kernel_stacks) == group_sums(rec.stacks)
    # ... every wait under the same stack, to the nanosecond; the on-CPU
    # keys the same (the rest of each thread's scaling can land on another
    # of its keys: the order of its keys is the kernel's, or the drain's)
    user_keys = {k: v for k, v in rec.stacks.items() if k[1] < 0}
    assert {k: v for k, v in rec.kernel_stacks.items() if not bpfdefs.on_cpu(k[5])} == \
        {k: v for k, v in user_keys.items() if not bpfdefs.on_cpu(k[5])}
    assert set(rec.kernel_stacks) == set(user_keys)


ROOT = re.compile(r"^process \d+ [^;]*;(thread \d+|threads (\d+) ended)")


def roots(prof_text):
    singles, groups = set(), {}
    for line in prof_text.splitlines():
        m = ROOT.match(line)
        if not m:
            continue
        if m.group(2):
            groups[line.split(";")[1]] = int(m.group(2))
        else:
            singles.add(m.group(1))
    return singles, groups


def test_default_folds_in_the_kernel_and_keep_tids_keeps_each_thread(tmp_path, bpf):
    python = python_or_skip("pyenv-3.12")
    found = {}
    for mode in ("default", "--keep-tids"):
        w = Workload(python, "thread_server.py", SECONDS + 30, DELAY)
        try:
            args = ["-p", str(w.pid), "-d", str(DELAY + SECONDS)] + ([mode] if mode != "default" else [])
            res, _ = record_folded(tmp_path, *args, name=f"{mode.strip('-')}.folded")
        finally:
            w.stop()
        found[mode] = roots((tmp_path / f"{mode.strip('-')}.folded").read_text())
    singles, groups = found["default"]
    assert any("in ThreadingMixIn.process_request_thread (socketserver.py)" in g for g in groups), groups
    assert sum(groups.values()) > 500
    assert len(singles) < 20                   # the server, its clients, the ticker, the main thread
    singles, groups = found["--keep-tids"]
    assert not groups and len(singles) > 500, (len(singles), groups)


@pytest.mark.parametrize("keys", [24, 40])
def test_threads_with_many_keys_fold_exactly(keys, bpf, monkeypatch):
    """A thread's keys are held in its held_keys entry, found through a
    small index by their hash: 24 keys a thread (three quarters of
    MAX_HELD, many sharing index runs) fold in the kernel, each to the
    nanosecond as user space folds them; 40 (more than MAX_HELD) are left
    to user space, and are exact all the same."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    monkeypatch.setenv("PYOFFCPU_FOLD", "shadow")
    w = Workload(python_or_skip("pyenv-3.12"), "thread_keys.py", keys, SECONDS, DELAY)
    try:
        rec = Session(Options(pids=[w.pid], duration=DELAY + SECONDS, mode="wall"), plat.probe()).run()
    finally:
        w.stop()
    user = {gid: t for gid, t in rec.threads.items() if gid < 0}
    ended = sum(t.threads for t in user.values() if t.entry.startswith("many_keys"))
    assert ended >= 20, user
    if keys <= bpfdefs.value("MAX_HELD"):
        assert rec.kernel_folded > 0.8 * ended, (ended, rec.kernel_folded)
    else:
        assert rec.kernel_folded <= 1, (ended, rec.kernel_folded)     # (the thread that ends at once)
    waits = collections.Counter()
    for k, (count, ns) in rec.stacks.items():
        if k[1] < 0 and not bpfdefs.on_cpu(k[5]) and k[4]:
            waits[k[4]] += count
    # every waiter's 12 ms under its own stack, once a thread
    assert len([h for h, n in waits.items() if n >= ended]) >= keys, (keys, ended, waits)
    assert set(rec.kernel_threads) == set(user)
    for gid, t in user.items():
        k = rec.kernel_threads[gid]
        assert (k.threads, k.on_ns, k.samples, k.first_ns, k.last_ns, k.entry) == \
            (t.threads, t.on_ns, t.samples, t.first_ns, t.last_ns, t.entry), gid
    assert {k: v for k, v in rec.kernel_stacks.items() if not bpfdefs.on_cpu(k[5])} == \
        {k: v for k, v in rec.stacks.items() if k[1] < 0 and not bpfdefs.on_cpu(k[5])}
