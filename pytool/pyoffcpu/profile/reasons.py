"""Why an off-CPU interval waited: one rules table.

BPF gives, per switch-out of a target thread, the scheduler's view (kind:
preempted while runnable, S, D, other) and the system call the thread was
blocked in, kept above the low byte of the key's kind (split_kind): the
call's number + 1, SYS_OUTSIDE when the thread was in no system call (its
user pc does not follow a `syscall` instruction: a page fault), 0 when it
has no user registers (a kernel thread).  The merger gives the interval's
frames.  `classify()` goes down RULES and the first rule that
matches names the reason.  Kernel frames are never looked at, so the
reason is the same with and without --kernel.

x86_64 system call numbers (arch/x86/entry/syscalls/syscall_64.tbl).
"""
from __future__ import annotations

import os
import re
from typing import Callable, List, NamedTuple, Optional, Sequence

from ..kernel import bpfdefs
from ..kernel.syscalls import SYS_GPU, SYS_IO, SYS_LOCK, SYS_POLL, SYS_SLEEP, split_kind
from .model import Frame, FrameKind

REASONS = ("runqueue", "sleep", "lock", "gil", "omp", "io", "poll", "disk", "page-fault", "gpu", "other")

# Native frames that say what a wait is, whatever the system call.
GIL_FUNCTIONS = frozenset({"take_gil", "drop_gil", "PyEval_RestoreThread", "PyEval_AcquireThread",
                           "PyEval_AcquireLock", "PyGILState_Ensure", "_PyEval_ReInitThreads"})
SLEEP_FUNCTIONS = frozenset({"pysleep", "time_sleep"})     # CPython's time.sleep
# NVIDIA's driver, runtime and collectives; the stand-in the tests build is named like them
GPU_LIBRARY = re.compile(r"^lib(cuda|cudart|nccl)(\.|_|-|$)")
GPU_SYNC = re.compile(r"^(cu|cuda)(Ctx|Device|Stream|Event)Synchronize")
GPU_SPIN = "[gpu-spin]"
# OpenMP runtimes: GNU libgomp (Debian's libgomp1; the copies wheels bundle,
# torch's libgomp.so.1, scikit-learn's libgomp-<hash>.so.1), LLVM's libomp,
# Intel's libiomp5
OMP_LIBRARY = re.compile(r"^lib(gomp|omp|iomp5)([.\-_]|$)")
# the C library's own frames under a wait (pthread_cond_wait, futex wrappers)
C_LIBRARY = re.compile(r"^(libc|libpthread|ld-linux[\w-]*)\.so")
OMP_SPIN = "[omp-spin]"


class Wait(NamedTuple):
    """What classify() looks at."""
    kind: int                       # bpfdefs.KIND_* of the switch-out
    sys: Optional[int]              # the system call's number, None: in none, UNKNOWN
    natives: List[Frame]            # the interval's native frames, innermost first


class Rule(NamedTuple):
    reason: str
    says: str                       # for the README and the tests' names
    matches: Callable[[Wait], bool]


def _blocked(w: Wait) -> bool:
    return w.kind in (bpfdefs.KIND_SLEEP, bpfdefs.KIND_UNINTERRUPTIBLE, bpfdefs.KIND_OTHER)


def _names(w: Wait):
    """The native frames' functions, without the suffixes of GCC's clones
    (take_gil.lto_priv.0, pysleep.isra.0, ....cold)."""
    return (f.name.split(".", 1)[0] for f in w.natives)


def gpu_library(module: Optional[str]) -> bool:
    return bool(module) and bool(GPU_LIBRARY.match(os.path.basename(module)))


def _under_gpu(w: Wait) -> bool:
    return any(gpu_library(f.module) for f in w.natives)


def omp_library(module: Optional[str]) -> bool:
    return bool(module) and bool(OMP_LIBRARY.match(os.path.basename(module)))


def c_library(module: Optional[str]) -> bool:
    return bool(module) and bool(C_LIBRARY.match(os.path.basename(module)))


def _in_omp(w: Wait) -> bool:
    """The innermost native frame outside the C library is an OpenMP
    runtime's: the runtime itself waits (libgomp's futex, libomp's
    pthread_cond_wait), not code it runs for the program."""
    for f in w.natives:
        if not c_library(f.module):
            return omp_library(f.module)
    return False


RULES: Sequence[Rule] = (
    Rule("runqueue", "preempted while runnable: waiting for a CPU",
         lambda w: w.kind == bpfdefs.KIND_RUNQUEUE),
    Rule("gpu", "blocked in ioctl, poll or read under libcuda, libcudart or libnccl frames",
         lambda w: _blocked(w) and w.sys in SYS_GPU and _under_gpu(w)),
    Rule("gil", "waiting under take_gil, PyEval_RestoreThread / AcquireThread or PyGILState_Ensure",
         lambda w: _blocked(w) and any(n in GIL_FUNCTIONS for n in _names(w))),
    Rule("sleep", "in CPython's time.sleep (which waits in select before 3.11)",
         lambda w: _blocked(w) and any(n in SLEEP_FUNCTIONS for n in _names(w))),
    Rule("sleep", "in nanosleep or clock_nanosleep",
         lambda w: _blocked(w) and w.sys in SYS_SLEEP),
    Rule("omp", "in futex or a System V semaphore where the innermost frame outside libc is an "
         "OpenMP runtime's (libgomp, libomp, libiomp5): waiting for work, at a barrier, on an OpenMP lock",
         lambda w: _blocked(w) and w.sys in SYS_LOCK and _in_omp(w)),
    Rule("lock", "in futex or a System V semaphore: a mutex, a condition variable, a lock",
         lambda w: _blocked(w) and w.sys in SYS_LOCK),
    Rule("poll", "in select, poll or epoll",
         lambda w: _blocked(w) and w.sys in SYS_POLL),
    Rule("io", "in a read, write, send, receive, accept, connect or sync of a descriptor",
         lambda w: _blocked(w) and w.sys in SYS_IO),
    Rule("page-fault", "asleep outside any system call: a page fault",
         lambda w: w.kind in (bpfdefs.KIND_SLEEP, bpfdefs.KIND_UNINTERRUPTIBLE) and w.sys is None),
    Rule("disk", "uninterruptible (D) in another system call: waiting for a device",
         lambda w: w.kind == bpfdefs.KIND_UNINTERRUPTIBLE),
    Rule("other", "anything else (another system call, a stop)", lambda w: True),
)


def classify(kind: int, sys: Optional[int], frames: Sequence[Frame]) -> str:
    """The reason of an off-CPU interval (kind != KIND_ONCPU)."""
    w = Wait(kind, sys, [f for f in frames if f.kind is FrameKind.NATIVE][::-1])
    for rule in RULES:
        if rule.matches(w):
            return rule.reason
    return "other"


def reason_of(kind: int, frames: Sequence[Frame]) -> Optional[str]:
    """A stack key's kind (GIL bits and all) and frames: None for on-CPU
    time, else the off-CPU reason."""
    kind = bpfdefs.without_gil(kind)
    if kind == bpfdefs.KIND_ONCPU:
        return None
    return classify(*split_kind(kind), frames)


MAX_SPIN_FUNCTION_BYTES = 1 << 20     # longer "functions" are not decoded (a symbol's size gone wrong)


def spin_code(code: bytes, address: int) -> bool:
    """Does this function's code hold a `pause` (x86's spin-wait hint)?  In
    an OpenMP runtime only its waits do (libgomp's do_spin, libomp's
    __kmp_wait_template and the yields after): the CPU time there is a
    thread waiting for work or at a barrier, not work."""
    if len(code) > MAX_SPIN_FUNCTION_BYTES:
        return False
    try:
        import capstone
    except ImportError:
        return False
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)     # lite decoding: text only
    return any(m == "pause" for _a, _s, m, _o in md.disasm_lite(code, address))


def gpu_spin(frames: Sequence[Frame]) -> bool:
    """An on-CPU sample inside a CUDA synchronize call: the driver spins
    waiting for the GPU (its default sync), which is waiting too."""
    return any(f.kind is FrameKind.NATIVE and GPU_SYNC.match(f.name) for f in frames)
