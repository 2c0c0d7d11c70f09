"""The drain of the `agg` map (session._take_agg): raw batches unpacked with
struct give exactly what one ctypes object per entry gives, the old
generation only, its keys deleted and no others; a kernel without batch
operations, or a batch that fails half-way, loses nothing.  A fake map with
the real key layout stands in for the kernel's (the real one is drained by
every recording test)."""
import ctypes
import struct

import pytest

from pyoffcpu.collect import maps, session
from pyoffcpu.collect.accounting import ThreadAccounts
from pyoffcpu.collect.recording import Options, PyStack, Recording, ThreadTimes


class Key(ctypes.Structure):
    _fields_ = [("tgid", ctypes.c_uint), ("tid", ctypes.c_uint), ("ustack", ctypes.c_int),
                ("kstack", ctypes.c_int), ("pystack", ctypes.c_ulonglong), ("kind", ctypes.c_uint),
                ("gen", ctypes.c_uint), ("nstack", ctypes.c_ulonglong)]


class Leaf(ctypes.Structure):
    _fields_ = [("count", ctypes.c_ulonglong), ("ns", ctypes.c_ulonglong)]


class FakeAgg:
    """A hash map's entries; batches of `chunk`; `fail_after` chunks, then OSError."""
    Key, Leaf = Key, Leaf

    def __init__(self, entries, chunk=3, fail_after=None, batch=True):
        self.entries = {bytes(k): (k, v) for k, v in entries}
        self.chunk, self.fail_after, self.batch = chunk, fail_after, batch
        self.deleted = []

    def raw_lookup_batch(self, delete=False):
        if not self.batch:
            raise Exception("BPF batch lookup failed: Invalid argument")
        items = list(self.entries.values())
        for n, i in enumerate(range(0, len(items), self.chunk)):
            if self.fail_after is not None and n >= self.fail_after:
                raise Exception("BPF batch lookup failed: Bad address")
            part = items[i:i + self.chunk]
            if delete:
                for k, _ in part:
                    del self.entries[bytes(k)]
                    self.deleted.append(bytes(k))
            yield b"".join(bytes(k) for k, _ in part), b"".join(bytes(v) for _, v in part), len(part)

    def items_delete_batch(self, ct_keys):
        assert isinstance(ct_keys, ctypes.Array)
        if not self.batch:
            raise Exception("BPF_MAP_DELETE_BATCH has failed: Invalid argument")
        for k in ct_keys:
            del self.entries[bytes(k)]
            self.deleted.append(bytes(k))

    def items(self):
        return list(self.entries.values())

    def __delitem__(self, k):
        del self.entries[bytes(k)]
        self.deleted.append(bytes(k))


def entries(n=10):
    out = []
    for i in range(n):
        k = Key(tgid=100, tid=200 + i, ustack=-14 if i % 3 else i, kstack=-1, pystack=(1 << 63) + i,
                kind=i % 5, gen=i % 2, nstack=(i * 7919) << 32)
        out.append((k, Leaf(count=i + 1, ns=(i + 1) * 1_000_003)))
    return out


def expected(items, gen=None):
    return sorted((k.tgid, k.tid, k.ustack, k.kstack, k.pystack, k.kind, k.nstack, v.count, v.ns)
                  for k, v in items if gen is None or k.gen == gen)


class Drainer(session.Session):
    """A session's drain over a stand-in map, without BPF."""

    def __init__(self, agg):
        self.bpf = {"agg": agg}
        self.unwinder = None
        self._gen = 0
        self.controls = []
        self.rec = Recording(Options())
        self.accounts = ThreadAccounts(self.rec, lambda ns: False)
        self.native_ids = {}

    def _write_control(self, **fields):
        self.controls.append(fields)


@pytest.fixture(autouse=True)
def no_grace(monkeypatch):
    monkeypatch.setattr(session, "GRACE_S", 0)


def test_the_format_unpacks_the_layout_and_refuses_any_other():
    assert maps.unpack_format(Key, maps.AGG_KEY_FIELDS) == "<IIiiQIIQ"
    assert maps.unpack_format(Leaf, maps.AGG_VALUE_FIELDS) == "<QQ"
    raw = bytes(entries(1)[0][0])
    assert struct.unpack(maps.unpack_format(Key, maps.AGG_KEY_FIELDS), raw) == \
        (100, 200, 0, -1, 1 << 63, 0, 0, 0)

    class Padded(ctypes.Structure):
        _fields_ = [("count", ctypes.c_uint8), ("ns", ctypes.c_ulonglong)]
    assert maps.unpack_format(Padded, maps.AGG_VALUE_FIELDS) == "<B" + "x" * 7 + "Q"

    class Renamed(ctypes.Structure):
        _fields_ = [("n", ctypes.c_ulonglong), ("ns", ctypes.c_ulonglong)]

    class Chars(ctypes.Structure):
        _fields_ = [("count", ctypes.c_char * 8), ("ns", ctypes.c_ulonglong)]
    assert maps.unpack_format(Renamed, maps.AGG_VALUE_FIELDS) is None
    assert maps.unpack_format(Chars, maps.AGG_VALUE_FIELDS) is None


@pytest.mark.parametrize("batch", [True, False], ids=["batches", "one-by-one"])
def test_a_drain_takes_the_old_generation_and_deletes_only_it(batch):
    items = entries()
    agg = FakeAgg(items, batch=batch)
    d = Drainer(agg)
    got = d._take_agg(final=False)
    assert sorted(got) == expected(items, gen=0)
    assert d.controls == [{"gen": 1}] and d._gen == 1
    assert sorted(agg.deleted) == sorted(bytes(k) for k, _ in items if k.gen == 0)
    assert sorted(agg.entries) == sorted(bytes(k) for k, _ in items if k.gen == 1)


@pytest.mark.parametrize("fail_after", [None, 0, 2])
def test_the_final_drain_takes_everything_even_when_a_batch_fails(fail_after):
    items = entries(11)
    agg = FakeAgg(items, fail_after=fail_after)
    got = Drainer(agg)._take_agg(final=True)
    assert sorted(got) == expected(items)       # each entry once: none lost, none twice
    assert agg.entries == {}


def test_a_threads_entry_skips_threading_and_the_312_entry_shim():
    """Ended threads fold by the function they started in: the outermost
    frame that is neither threading's nor 3.12+'s `<interpreter trampoline>`
    shim (the outermost frame of every 3.12+ thread: taking it would fold
    every ended thread of a process into one group)."""
    from pyoffcpu.cpython.code import CodeInfo

    def info(name, filename):
        return CodeInfo(name, filename, 1, b"", 0)
    d = Drainer(FakeAgg([]))
    # innermost first, as BPF sends them
    frames = [(1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0)]
    infos = [info("handle", "/srv/app.py"), info("Thread.run", "/usr/lib/python3.12/threading.py"),
             info("Thread._bootstrap", "/usr/lib/python3.12/threading.py"),
             info("<interpreter trampoline>", "<shim>")]
    d.rec.pystacks[7] = PyStack(1, 0, frames, infos)
    assert d.accounts.stack_entry(7) == "handle (app.py)"
    d.rec.pystacks[8] = PyStack(1, 0, frames[3:], infos[3:])
    assert d.accounts.stack_entry(8) is None


def test_an_ended_threads_wakers_fold_with_its_waits():
    """--wakers: when an ended thread folds into its group, the wakers of its
    waits go with them, so each wait's time is still split by its wakers
    (the chains add up to the wait) under the group's root."""
    from pyoffcpu.kernel import bpfdefs
    from pyoffcpu.profile.merge import build_profile
    d = Drainer(FakeAgg([]))
    pid, tid, waker_tid = 10, 11, 12
    d.rec.threads[tid] = ThreadTimes(pid, tid, "worker", exited=True, last_ns=5)
    wait = (pid, tid, -1, -1, 0, bpfdefs.KIND_SLEEP)
    d.accounts.add(wait, 4, 1000)
    task = (bpfdefs.value("WAKER_TASK"), pid, waker_tid, -1, -1, 0, "producer")
    timer = (bpfdefs.value("WAKER_TIMER"), 0, 0, -1, -1, 0, "")
    for waker, ns in ((task, 600), (timer, 300)):
        d._add_wake({"tgid": pid, "tid": tid, "ustack": -1, "kstack": -1, "pystack": 0,
                     "kind": bpfdefs.KIND_SLEEP, "nstack": 0, "waker_kind": waker[0],
                     "waker_tgid": waker[1], "waker_tid": waker[2], "waker_ustack": -1,
                     "waker_kstack": -1, "waker_pystack": 0, "waker_nstack": 0,
                     "waker_comm0": int.from_bytes(waker[6].encode().ljust(8, b"\0")[:8], "little"),
                     "waker_comm1": 0}, 2 if waker is task else 1, ns)
    d.accounts.fold(tid)
    gid = next(iter(d.accounts.groups.values()))
    assert gid < 0 and all(w[0][1] == gid for w in d.rec.wakes), d.rec.wakes
    prof, _ = build_profile(d.rec, symbolizer=None)
    chains = {tuple(f.name for f in k.waker): ns for k, ns in prof.weights.items()}
    assert chains == {(f"thread {waker_tid} producer",): 600, ("[woken by timer]",): 300, (): 100}
