"""Unwind tables made in the background while the recording runs.

A recording never waits for a table.  A mapping whose table is not ready
is registered in BPF as pending (`UNWIND_FILE_PENDING`): the walk goes as
far as the tables that are ready allow, stops there with NST_PENDING and
counts the stop in `unwind_pending`, by the file's id.  `Builds` makes the
tables: from the disk cache when it has them (an mmap of the cache file), else in helper processes (the compiled `pyoffcpu-elf table`,
helper/), several at once, the files that stacks stopped at first, then the
smaller ones (more stacks complete sooner).  Their memory leaves with them.

A build that fails, or takes longer than its limit, leaves the file
without a table (walked as if it had none), with a notice.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .. import helper
from . import table as T

NO_HELPER = f"no unwind tables ({helper.BINARY} is not built: make install)"
BUILD_LIMIT_S = 300.0       # a build that takes longer is killed: that file walks without
HELPER_PER_EH_FRAME = 9     # a build's peak RSS: helper.HELPER_BASE + this x its .eh_frame


def memory_estimate(eh_frame_size: int) -> int:
    return helper.HELPER_BASE + HELPER_PER_EH_FRAME * max(0, eh_frame_size)


@dataclass
class Pending:
    """A file whose table is wanted."""
    key: tuple                  # the unwinder's key of the file (build-id or identity)
    cache_key: str              # its TableCache key
    build_id: Optional[str]
    name: str                   # as a process maps it (for notices)
    paths: List[str]            # where it can be opened now (map_files, the root's path)
    size: int
    id: int                     # in BPF's unwind_pending
    memory: int = helper.HELPER_BASE   # its helper's peak RSS, estimated (memory_estimate)
    expect: Optional[tuple] = None      # table.file_identity the opened file must have
    hits: int = 0               # walks that stopped at it
    job: Optional[helper.Job] = None
    looked: bool = False        # in the disk cache (once)
    into: Optional[str] = None  # the cache file the helper writes (None: to its standard output)
    since: float = field(default_factory=time.monotonic)


class Builds:
    """The queue of wanted tables and the helpers making them."""

    def __init__(self, cache: T.TableCache, budget: Optional[helper.Budget] = None):
        self.cache = cache
        self.budget = budget or helper.BACKGROUND   # shared with the symbol indexes' helpers
        self.pending: Dict[tuple, Pending] = {}
        self.by_id: Dict[int, Pending] = {}
        self._next_id = 1
        self.notices: List[str] = []
        self.times: Dict[str, float] = {}       # file -> seconds its build took (bench)
        self.started = 0
        self.failed = 0

    def want(self, key: tuple, cache_key: str, build_id: Optional[str], name: str,
             paths: List[str], size: int, eh_frame_size: int = 0, expect: Optional[tuple] = None) -> int:
        """Queue a file (once); its id for unwind_map.npages."""
        p = self.pending.get(key)
        if p is None:
            p = Pending(key, cache_key, build_id, name, list(paths), size, self._next_id,
                        memory=memory_estimate(eh_frame_size), expect=expect)
            self._next_id = self._next_id % (1 << 31) + 1
            self.pending[key] = p
            self.by_id[p.id] = p
        else:
            p.paths = list(paths) + [q for q in p.paths if q not in paths]
        return p.id

    def drop(self, key: tuple) -> None:
        """No process maps it any more: not wanted (a build under way is stopped)."""
        p = self.pending.pop(key, None)
        if p is not None:
            self.by_id.pop(p.id, None)
            if p.job is not None:
                p.job.close()

    def hits(self, counts: Dict[int, int]) -> None:
        for i, n in counts.items():
            p = self.by_id.get(i)
            if p is not None:
                p.hits = n

    def _order(self) -> List[Pending]:
        return sorted((p for p in self.pending.values() if p.job is None),
                      key=lambda p: (-p.hits, p.size, p.id))

    def step(self, start: bool = True) -> List[Tuple[tuple, Optional[T.UnwindTable]]]:
        """One turn: finished builds collected, cached tables taken (an
        mmap of the cache file each), new builds started (start=False:
        none); the (key, table or None: it has none) now done."""
        done: List[Tuple[tuple, Optional[T.UnwindTable]]] = []
        for p in [p for p in self.pending.values() if p.job is not None]:
            ok = p.job.poll()
            if ok is None:
                continue
            t = None
            if ok:
                try:
                    if p.into is not None:      # it wrote the cache file itself
                        t = self.cache.cached(p.cache_key, p.build_id)
                        if t is None:
                            raise ValueError("its table is not in the cache")
                    else:
                        t = T.deserialize(p.job.output())
                except (ValueError, OSError, helper.HelperError) as e:
                    p.job.error = str(e)
                    ok = False
            if not ok:
                self.failed += 1
                self.notices.append(f"native unwind table of {p.name} not built ({p.job.error}): "
                                    "walked by frame pointer")
            self.times[p.name] = time.monotonic() - p.job.started
            p.job.close()
            p.job = None
            if p.into is None or t is None:
                t = self.cache.store(p.cache_key, t, p.build_id)
            else:
                self.cache.built += 1
            done.append((p.key, t))
        blocked = False                 # the first build that does not fit waits: none after it starts
        tmps = None
        for p in self._order():
            # the disk cache first: a miss is one failed open, a hit an mmap
            if self.cache.known(p.cache_key) or not p.looked:
                p.looked = True
                t = self.cache.cached(p.cache_key, p.build_id)
                if t is not None or self.cache.known(p.cache_key):
                    done.append((p.key, t))
                    continue
            if blocked or not start or not self.budget.fits(p.memory):
                blocked = blocked or start
                continue
            if tmps is None:
                tmps = self._others_tmp()
            if self._elsewhere(p, tmps):
                p.looked = False        # another session is making it: look in the cache again
                continue
            job = self._start(p)
            if job is None:
                done.append((p.key, self.cache.store(p.cache_key, None, p.build_id)))
                continue
            p.job = job
            self.budget.started(job, p.memory)
        self.budget.tables_waiting = blocked
        for key, _ in done:
            p = self.pending.pop(key, None)
            if p is not None:
                self.by_id.pop(p.id, None)
        return done

    def _others_tmp(self) -> set:
        """The cache files other sessions' helpers are writing now (one left
        to finish when its recording ended): they write PATH.<pid>.tmp."""
        out = set()
        d = self.cache.dir
        try:
            names = os.listdir(d) if d else []
        except OSError:
            return out
        for n in names:
            if n.endswith(".tmp"):
                base, _, pid = n[:-4].rpartition(".")
                if pid.isdigit() and int(pid) != os.getpid() and os.path.exists(f"/proc/{pid}"):
                    out.add(base)
        return out

    def _elsewhere(self, p: Pending, tmps: set) -> bool:
        """Is another session's helper making this table now?  Waited for
        BUILD_LIMIT_S at most."""
        into = self.cache.path_of(p.cache_key)
        return (into is not None and os.path.basename(into) in tmps
                and time.monotonic() - p.since < BUILD_LIMIT_S)

    def _start(self, p: Pending) -> Optional[helper.Job]:
        args = T.build_args()
        # with a disk cache the helper writes the table there itself: one the
        # session ends before is still made, for the next start
        p.into = self.cache.path_of(p.cache_key)
        if p.into is not None:
            args = args + ["--into", p.into]
        err = "cannot be opened"
        for path in p.paths:
            try:
                job = helper.Job(args, path, wall_limit_s=BUILD_LIMIT_S)
            except OSError as e:
                err = e.strerror or str(e)
                continue
            if p.expect is not None and T.file_identity(job.opened) != p.expect:
                job.close()             # another file at that path now: not the one its key names
                err = "the file changed"
                continue
            self.started += 1
            return job
        self.notices.append(f"native unwind table of {p.name} not built ({err}): walked by frame pointer")
        return None

    def busy(self) -> bool:
        return bool(self.pending)

    def close(self) -> None:
        """The end of the session: a helper writing into the disk cache is
        left to finish (the next start finds its table), the others stop."""
        for p in self.pending.values():
            if p.job is not None:
                if p.into is not None:
                    p.job.detach()
                else:
                    p.job.close()
                p.job = None
