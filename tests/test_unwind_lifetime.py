"""Native unwind tables live as long as some process maps their file: one
BPF array per file, freed once no entry of unwind_procs refers to it
(unwind/loader.py, collect)."""
import os
import subprocess
import time

from conftest import python_or_skip
from pyoffcpu.native import symbols
from pyoffcpu.native.unwind import loader


# -- the bookkeeping, on maps that behave like the kernel's ---------------------------------------
class _Slots(dict):
    max_entries = 64


class _Procs(dict):
    """unwind_procs: entries written by user space, or copied by BPF."""

    def __init__(self, real):
        super().__init__()
        self.Key, self.Leaf = real.Key, real.Leaf

    def __setitem__(self, key, leaf):
        super().__setitem__(key.value, leaf)

    def __delitem__(self, key):
        super().__delitem__(key.value)

    readable = True

    def items(self):
        assert self.readable, "unwind_procs read without --subprocesses"
        return list(super().items())


def _unwinder(monkeypatch):
    from pyoffcpu.kernel.bpfdefs import struct_type
    real = type("T", (), {"Key": __import__("ctypes").c_uint32, "Leaf": struct_type("proc_unwind")})
    u = loader.NativeUnwinder(None)
    u._files, u._procs = _Slots(), _Procs(real)
    u._free_slots = list(range(_Slots.max_entries - 1, -1, -1))
    writes = []

    def write(t, lo):
        slot = u._free_slots.pop()
        u._files[slot] = lo.name
        writes.append(lo.name)
        return slot
    monkeypatch.setattr(u, "_write", write)
    clock = [1000.0]
    monkeypatch.setattr(loader.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(loader, "KEEP_UNUSED_S", 0.0)     # the two looks' rule alone (below: the keep)

    def look():
        clock[0] += loader.COLLECT_S
        return u.collect()
    return u, look, writes


def test_a_table_goes_only_after_two_looks_find_no_process_referring_to_it(monkeypatch):
    u, look, writes = _unwinder(monkeypatch)
    u.copies = True                     # --subprocesses: BPF copies entries
    maps = symbols.read_maps(os.getpid())
    assert u.update(1000, maps)
    files = set(u.loaded())
    assert files and len(writes) == len(files), (writes, files)
    rows = u.rows_loaded
    assert rows > 1000
    # a second process of the same files: no table is written again
    assert u.update(1001, maps) and len(writes) == len(files)
    # BPF copies 1001's entry to a child it follows; user space has not
    # registered that child yet, and both processes it knows go away
    u._procs[u._procs.Key(1002)] = u._procs[1001]
    u.forget(1000)
    u.forget(1001)
    for _ in range(4):
        assert look() == 0                      # the child's entry holds every table
    assert set(u.loaded()) == files and u.rows_loaded == rows
    # the child is gone too (registered meanwhile, then retired): one look
    # finds nothing referred to, the next frees
    u.forget(1002)
    assert look() == 0 and set(u.loaded()) == files
    assert look() == len(files)
    assert u.loaded() == [] and u.rows_loaded == 0 and u._files == {}
    assert len(u._free_slots) == _Slots.max_entries
    # a file mapped again afterwards gets its table again
    assert u.update(1003, maps) and set(u.loaded()) == files and u.rows_loaded == rows


def test_without_copies_the_counts_alone_free_and_the_kernel_map_is_not_read(monkeypatch):
    u, look, writes = _unwinder(monkeypatch)
    u._procs.readable = False
    maps = symbols.read_maps(os.getpid())
    u.update(1000, maps)
    u.update(1001, maps)
    files = set(u.loaded())
    u.forget(1000)
    assert look() == 0 and look() == 0 and set(u.loaded()) == files    # 1001 uses them
    # 1001's entry is gone from the kernel (BPF deleted it at an exec): the
    # count still holds the tables until user space forgets the process
    del u._procs[u._procs.Key(1001)]
    assert look() == 0 and look() == 0 and set(u.loaded()) == files
    u.forget(1001)
    assert look() == 0 and look() == len(files) and u.loaded() == []
    assert u.kernel_looks == 0


def test_a_table_referred_to_again_between_the_looks_stays(monkeypatch):
    u, look, writes = _unwinder(monkeypatch)
    maps = symbols.read_maps(os.getpid())
    u.update(1000, maps)
    n = len(writes)
    u.forget(1000)
    assert look() == 0                          # unreferenced once
    u.update(1001, maps)                        # a new process maps the same files
    assert look() == 0 and look() == 0
    assert len(writes) == n and len(u.loaded()) == n


def test_an_unused_table_is_kept_a_while_for_the_next_process_that_maps_it(monkeypatch):
    """Short jobs one after another: the tables of a job that exited stay
    KEEP_UNUSED_S (each free costs the kernel a grace period, and the next
    job loads them again), then go; with few slots left, at two looks."""
    u, look, writes = _unwinder(monkeypatch)
    monkeypatch.setattr(loader, "KEEP_UNUSED_S", 10.0)
    maps = symbols.read_maps(os.getpid())
    u.update(1000, maps)
    n = len(writes)
    u.forget(1000)
    for _ in range(int(10.0 / loader.COLLECT_S) - 1):
        assert look() == 0                      # unused for less than KEEP_UNUSED_S
    u.update(1001, maps)                        # the next job: nothing written again
    assert len(writes) == n and len(u.loaded()) == n
    u.forget(1001)
    looks = 0
    while u.loaded():
        looks += 1
        look()
    assert looks * loader.COLLECT_S >= 10.0, looks
    # few slots left: the two looks' rule alone
    u.update(1002, maps)
    u._free_slots = u._free_slots[:_Slots.max_entries // 20]
    u.forget(1002)
    assert look() == 0 and look() == n and u.loaded() == []


def test_slots_full_leaves_the_rest_to_frame_pointers_and_says_so(monkeypatch):
    u, look, writes = _unwinder(monkeypatch)
    u._free_slots = u._free_slots[-1:]          # room for one table
    u.update(1000, symbols.read_maps(os.getpid()))
    assert len(u.loaded()) == 1
    assert any("files at once" in n for n in u.notices), u.notices


# -- real BPF ----------------------------------------------------------------------------------------
def test_tables_of_an_exited_process_are_freed_and_the_others_kept(bpf, monkeypatch):
    """Two targets of different interpreters: once the 3.9 one exits, the
    tables only it mapped (its libpython) leave the kernel; those the 3.12
    one maps stay, libc among them.  (The tables are made while the
    recording runs: the 3.9 one exits once none is waiting.)"""
    from pyoffcpu.collect import platform as plat
    from pyoffcpu.collect.recording import Options
    from pyoffcpu.collect.session import Session
    monkeypatch.setattr(loader, "KEEP_UNUSED_S", 1.0)     # not 10 s, in an 8 s recording
    py39, py312 = python_or_skip("pyenv-3.9"), python_or_skip("pyenv-3.12")
    loop = "import time\nwhile True: time.sleep(0.01)"
    a = subprocess.Popen([py39, "-c", loop])
    b = subprocess.Popen([py312, "-c", loop])
    try:
        time.sleep(0.5)
        s = Session(Options(pids=[a.pid, b.pid], mode="wall", duration=8), plat.probe())
        seen = []
        for batch in s.batches():
            if a.poll() is None and not s.unwinder.tables_waiting:
                seen.append(("both", s.unwinder.loaded(), s.unwinder.rows_loaded))
                a.kill()
                a.wait()
            seen.append((batch.elapsed_s, s.unwinder.loaded(), s.unwinder.rows_loaded))
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
    _, first, rows_first = seen[0]
    _, last, rows_last = seen[-1]

    def has(files, part):
        return any(part in os.path.basename(f) for f in files)
    assert has(first, "libpython3.9") and has(first, "libpython3.12"), first
    assert not has(last, "libpython3.9") and has(last, "libpython3.12"), (last, seen)
    assert has(last, "libc.so"), last
    assert s.unwinder.tables_freed >= 1 and rows_last < rows_first, seen
    # retired at its exit, which BPF's life log reported (not found by a look at /proc)
    assert s.platform.exit_group_dead
    assert s.targets.exits_seen == 1 and s.targets.life_resyncs == 0
