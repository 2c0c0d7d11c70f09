"""pyoffcpu-elf, the compiled helper (main.c): the heavy work on a target's
ELF files in a process of its own.

A job gives the helper one file, opened here (a regular file, without
blocking: a FIFO planted at a mapped path never hangs pyoffcpu) as its
standard input, and takes its standard output from an unnamed temporary
file, so the helper never waits for pyoffcpu to read.  Its limits bound what
a file built to exhaust it can take: CPU seconds, address space, and the
wall time `Job.poll` allows before it kills it.  Its memory leaves with it.

`make install` builds the binary (the .deb and `make wheel` ship it); it is
the one implementation of both in the product.  Without it (`available()`
False: a source tree nobody built) native stacks go by frame pointers and
native frames have no names, and `pyoffcpu doctor` says so.  The Python
code that computes the same bytes is the tests' reference (tests/reference/).
"""
from __future__ import annotations

import contextlib
import functools
import mmap
import os
import subprocess
import tempfile
import time
from typing import List, Optional, Sequence

BINARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyoffcpu-elf")
CPU_LIMIT_S = 300                   # a helper that computes longer is looping
MEMORY_LIMIT = 4 << 30              # address space (the file itself is mapped)
WALL_LIMIT_S = 600.0


# The .deb ships the libcapstone.so of the wheel the helper was built
# against here, with its version in VERSION (tools/build_deb.py): Debian 12's
# own capstone is 4.0, whose ABI is another.
BUNDLED_CAPSTONE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


@functools.lru_cache(maxsize=None)
def capstone_lib() -> Optional[str]:
    """The directory of the libcapstone.so the helper decodes with: the one
    bundled beside it (the .deb), else the one this Python's capstone
    package carries (pip's wheel has it in capstone/lib); None: neither, and
    the helper makes tables without prologue analysis."""
    if os.path.isfile(os.path.join(BUNDLED_CAPSTONE, "libcapstone.so")):
        return BUNDLED_CAPSTONE
    import importlib.util
    try:
        spec = importlib.util.find_spec("capstone")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(d, "lib")
        if os.path.isfile(os.path.join(lib, "libcapstone.so")):
            return lib
    return None


@functools.lru_cache(maxsize=None)
def capstone_version() -> Optional[str]:
    """The version of the capstone in capstone_lib(): the bundled one's
    VERSION file, else the binding's distribution metadata beside the
    package (capstone-5.0.7.dist-info): a directory listing, where
    importing capstone or importlib.metadata costs 0.1-0.2 s of a start."""
    lib = capstone_lib()
    if lib is None:
        return None
    if lib == BUNDLED_CAPSTONE:
        try:
            with open(os.path.join(lib, "VERSION"), encoding="ascii") as f:
                return f.read(64).strip() or None
        except (OSError, ValueError):
            return None
    parent = os.path.dirname(os.path.dirname(lib))
    try:
        names = os.listdir(parent)
    except OSError:
        names = []
    for n in sorted(names):
        if n.lower().startswith("capstone-") and n.endswith(".dist-info"):
            return n[len("capstone-"):-len(".dist-info")]
    return None


# what a helper's environment holds besides limits_env
_BASE_ENV = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL")}


class Budget:
    """What the helpers started in the background (unwind tables, symbol
    indexes) may take at once: how many, and their memory (each job's peak
    RSS, estimated by its starter).  One that does not fit alone runs
    alone.  Unwind tables come first: while one waits for room
    (tables_waiting), no symbol index starts."""

    def __init__(self, jobs: int, memory: int):
        self.jobs = jobs
        self.memory = memory
        self._running: dict = {}            # id(job) -> its estimate
        self.tables_waiting = False

    def fits(self, estimate: int) -> bool:
        if not self._running:
            return True
        return len(self._running) < self.jobs and sum(self._running.values()) + estimate <= self.memory

    def started(self, job: "Job", estimate: int) -> None:
        self._running[id(job)] = estimate
        job._budget = self

    def ended(self, job: "Job") -> None:
        self._running.pop(id(job), None)

    @property
    def running(self) -> int:
        return len(self._running)


def background_jobs() -> int:
    """Helpers at once: one per CPU, at most four (the target runs too)."""
    return max(1, min(4, os.cpu_count() or 1))


# Measured on torch's libraries: a table build's peak RSS is about 15 MB +
# 9x the file's .eh_frame (libtorch_cpu.so's 17 MB: 142 MB), an index's
# about 15 MB + 8x its symbol tables (libtorch_cpu.so's 12.5 MB: 106 MB).
# With pyoffcpu's ~90 MB, 160 MB of helpers keeps a torch target's start
# near 250 MB in all.
HELPER_BASE = 15 << 20
BACKGROUND = Budget(background_jobs(), 160 << 20)


class HelperError(Exception):
    """The helper could not do the job: its one-line reason."""


def available() -> bool:
    """The binary is built."""
    return os.access(BINARY, os.X_OK)


@contextlib.contextmanager
def memory_file(name: str, data: bytes):
    """An unnamed in-memory file holding data (a memfd: the vDSO's image,
    which is no file on disk), open while the block runs: its path for a
    Job (/proc/self/fd/N).  Raises OSError."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at path (elffile's
    open_regular_file: a FIFO or a device there is refused before it is
    opened for reading).  Raises OSError."""
    from ..elfcache import open_regular_file
    f = open_regular_file(path)
    try:
        return os.dup(f.fileno())
    finally:
        f.close()


# The limits go to the helper in its environment, and it sets them itself
# first thing (main.c): a start with no code of ours between fork and exec
# lets the kernel vfork, ~1 ms instead of ~10 ms for a pyoffcpu that maps
# 100 MB (a torch target has ~90 files).
LIMITS_ENV = "PYOFFCPU_HELPER_LIMITS"


def limits_env() -> dict:
    """What every helper's environment holds: its limits, and where its
    capstone is (capstone_lib(): its dlopen looks in LD_LIBRARY_PATH first,
    then in its RUNPATH, the wheel's layout)."""
    env = {LIMITS_ENV: f"{CPU_LIMIT_S} {MEMORY_LIMIT}"}
    lib = capstone_lib()
    if lib:
        env["LD_LIBRARY_PATH"] = lib
    return env


class Job:
    """One run of the helper on one file (started at once)."""

    def __init__(self, args: Sequence[str], path: str, extra_paths: Sequence[str] = (),
                 wall_limit_s: float = WALL_LIMIT_S):
        """args: the helper's command and options; path: the file it reads
        (opened here, its standard input); extra_paths: more files, their
        descriptor numbers after args."""
        self.args = list(args)
        self.path = path
        self._budget: Optional[Budget] = None
        self.started = time.monotonic()
        self.wall_limit_s = wall_limit_s
        self.error: Optional[str] = None
        self._out = tempfile.TemporaryFile()
        self._err = tempfile.TemporaryFile()
        fds: List[int] = []
        try:
            fds.append(open_regular(path))
            self.opened = os.fstat(fds[0])      # the file the helper reads (its identity: the caller's check)
            for p in extra_paths:
                fds.append(open_regular(p))
            # extra files: the helper gets their descriptor numbers as arguments
            # a session of its own: the terminal's Ctrl-C and hang-up are pyoffcpu's
            self._proc = subprocess.Popen(
                [BINARY] + self.args + [str(fd) for fd in fds[1:]],
                stdin=fds[0], stdout=self._out, stderr=self._err, close_fds=True,
                pass_fds=fds[1:], start_new_session=True,
                env=dict(_BASE_ENV, **limits_env()))
        finally:
            for fd in fds:
                os.close(fd)
        self.pid = self._proc.pid

    def poll(self) -> Optional[bool]:
        """None while it runs; True when it finished well, False when it
        failed (self.error says why) or ran past its wall limit."""
        rc = self._proc.poll()
        if rc is None:
            if time.monotonic() - self.started > self.wall_limit_s:
                self.kill()
                self.error = f"took over {self.wall_limit_s:.0f} s"
                return False
            return None
        if rc != 0:
            self._err.seek(0)
            msg = self._err.read(400).decode("utf-8", "replace").strip().splitlines()
            self.error = msg[-1] if msg else (f"killed by signal {-rc}" if rc < 0 else f"exit {rc}")
            return False
        return True

    def wait(self) -> bool:
        """Block until it ends (within its wall limit)."""
        left = self.wall_limit_s - (time.monotonic() - self.started)
        try:
            self._proc.wait(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:
            pass
        ok = self.poll()
        if ok is None:
            self.kill()
            self.error = f"took over {self.wall_limit_s:.0f} s"
            return False
        return ok

    def output(self) -> mmap.mmap:
        """What it wrote (after poll() or wait() said True), mapped read-only."""
        size = os.fstat(self._out.fileno()).st_size
        if size == 0:
            raise HelperError("no output")
        return mmap.mmap(self._out.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)

    def output_bytes(self) -> bytes:
        self._out.seek(0)
        return self._out.read()

    def kill(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.kill()
            except OSError:
                pass
            self._proc.wait()

    def close(self) -> None:
        self.kill()
        self._out.close()
        self._err.close()
        self._release()

    def detach(self) -> None:
        """Leave it running on its own (it writes its result itself); its
        exit is not waited for (the kernel reaps it once we exit)."""
        self._out.close()
        self._err.close()
        self._release()

    def _release(self) -> None:
        if self._budget is not None:
            self._budget.ended(self)
            self._budget = None


def run(args: Sequence[str], path: str, extra_paths: Sequence[str] = (),
        wall_limit_s: float = WALL_LIMIT_S) -> bytes:
    """Run one job to its end; its output.  Raises HelperError, OSError."""
    job = Job(args, path, extra_paths, wall_limit_s)
    try:
        if not job.wait():
            raise HelperError(job.error or "failed")
        return job.output_bytes()
    finally:
        job.close()
