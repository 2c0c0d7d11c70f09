"""The switch memo shared by the threads of a process (bpf/memo.c, xmemo):
a thread blocking where another blocked before reuses that walk only when
every word the walk used holds, moved with the stack.  PYOFFCPU_MEMO_VERIFY=1
walks every hit all the same and compares: none may differ, on a C program
built to break it (four threads whose stacks differ in one return address)
and on a thread-per-request server."""
import os
import subprocess


from conftest import WORKLOADS, Workload, python_or_skip


def record_verified(w, monkeypatch, checked, shared):
    """3 s of workload w in wall mode, every memo hit walked and compared:
    the recording, once at least `checked` hits were checked, `shared` of
    them another thread's walk, and none differed."""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    monkeypatch.setenv("PYOFFCPU_MEMO_VERIFY", "1")
    try:
        rec = Session(Options(pids=[w.pid], duration=3.0, mode="wall"), plat.probe()).run()
    finally:
        w.stop()
    st = rec.memo_stats
    assert st["checked"] > checked and st["hit_shared"] > shared, st
    assert st["wrong"] == 0, st
    return rec


def test_a_walk_is_shared_only_where_every_word_holds(tmp_path, bpf, monkeypatch):
    from pyoffcpu.native import symbols
    from pyoffcpu.profile.merge import build_profile
    exe = tmp_path / "shared_memo"
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-o", str(exe),
                    os.path.join(WORKLOADS, "shared_memo.c"), "-lpthread"], check=True)
    w = Workload(None, None, argv=[str(exe), "60"])
    caller = {int(line.split()[1]): line.split()[2] for line in w.lines if line.startswith("tid ")}
    rec = record_verified(w, monkeypatch, checked=200, shared=100)
    # and the profile names each thread's own caller, never the other's
    prof, _ = build_profile(rec, symbols.Symbolizer(), None)
    seen = {tid: 0 for tid in caller}
    for key, ns in prof.weights.items():
        if key.tid not in caller or key.off_cpu is None:
            continue
        names = [f.name for f in key.frames]
        if "block_here" not in names or "[native table not ready]" in names:
            continue                    # (a fresh binary: its table is made while it records)
        mine, other = ("via_a", "via_b") if caller[key.tid] == "a" else ("via_b", "via_a")
        assert mine in names and other not in names, (caller[key.tid], names)
        seen[key.tid] += ns
    assert all(ns > 0.3e9 for ns in seen.values()), seen


def test_threads_of_a_server_share_walks_exactly(bpf, monkeypatch):
    record_verified(Workload(python_or_skip("pyenv-3.12"), "thread_server.py", 60, 0.5), monkeypatch,
                    checked=500, shared=200)
