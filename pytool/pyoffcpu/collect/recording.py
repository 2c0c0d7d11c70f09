"""What a recording hands on: the options it was made with, and the
Recording itself, the raw aggregated stacks (stack ids, Python stack
hashes), the Python stacks with their code objects, the targets' address
spaces, and each thread's exact times.  The session fills it (session.py,
accounting.py); the merger turns it into a Profile (profile/merge.py);
dump and the tests make one by hand."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from ..kernel import bpfdefs
from ..cpython import detect
from ..cpython.code import CodeInfo
from ..native import symbols
from ..targets.selection import Select

NATIVE_ID_BASE = 1 << 20            # rec.ustacks ids of .eh_frame-walked stacks (bcc's are smaller)
UNSAMPLED = bpfdefs.value("USTACK_UNSAMPLED")  # ustack id: on-CPU time no sample landed in
NO_STACK = bpfdefs.value("USTACK_NO_STACK")    # ustack id: time whose stack is not known
SHORT_WAITS = bpfdefs.value("USTACK_SHORT")    # ustack id: a KIND_SHORT total (profile/waits.py)
_NOT_IN_TOTALS = bpfdefs.value("KIND_SAMPLED") | bpfdefs.value("KIND_SHADOW")
LOST_PYTHON = "python stack lost"   # drop: the Python frames of a stack never reached user space


@dataclass
class Options:
    pids: List[int] = field(default_factory=list)
    command: List[str] = field(default_factory=list)
    system_wide: bool = False
    duration: Optional[float] = None
    frequency: int = 99
    mode: str = "wall"              # wall | cpu | off
    kernel: bool = False
    fold_threads: bool = True       # ended threads fold by entry function
    # -a: which processes (none given: every one, SYSTEM_WIDE in BPF)
    match: Optional[str] = None     # a regex searched in the command line
    uid: Optional[int] = None
    python_only: bool = False
    follow: bool = False            # --subprocesses: the targets' children too
    wakers: bool = False            # --wakers: who ended each wait
    async_tasks: bool = False       # --async: the time of each asyncio task (collect/tasks.py)
    async_hz: int = 0               # --async: snapshots of the tasks per second (0: default)
    # --off-cpu: where a wait's stack is taken.  sampled: by threshold sampling
    # at the period 1/frequency (docs/offcpu-sampling.md); exact: at every
    # switch-out.  PYOFFCPU_OFFCPU=shadow (tests): both, kept apart.
    offcpu: str = field(default_factory=lambda: os.environ.get("PYOFFCPU_OFFCPU") or "sampled")
    # --min-block-us / --max-block-us: waits shorter / longer are left out (ns; 0: no bound)
    min_block_ns: int = 0
    max_block_ns: int = 0
    # --timeline FILE: every wait of at least timeline_min_ns and every on-CPU
    # sample, each where it happened (collect/timeline.py), written to FILE
    timeline: Optional[str] = None
    timeline_min_ns: int = 100_000
    # --tables-first: every native table made before the recording starts
    # (default: made while it runs; stacks reaching one not ready stop there)
    tables_first: bool = field(default_factory=lambda: tables_first_env())

    @property
    def filtered(self) -> bool:
        """-a with a filter (targets.Select says what a filter is)."""
        return Select(self.match, self.uid, self.python_only).filtered

    @property
    def every_process(self) -> bool:
        """-a without filters: BPF takes every process (SYSTEM_WIDE)."""
        return self.system_wide and not self.filtered


def tables_first_env() -> bool:
    """PYOFFCPU_TABLES_FIRST=1: --tables-first for every command (the tests
    that check whole native stacks set it)."""
    return os.environ.get("PYOFFCPU_TABLES_FIRST") == "1"


@dataclass
class Batch:
    """What Session.batches() hands out after each drain: the Recording
    (session.rec) holds everything drained up to here."""
    elapsed_s: float                # since the start of the recording
    final: bool                     # the recording is over and complete


@dataclass
class PyStack:
    tgid: int
    flags: int
    frames: List[Tuple[int, int, int]]      # (code address, offset, flags), innermost first
    # the code objects, read when the stack arrived (the reader of the image it
    # was walked in); None: look them up in Recording.code
    infos: Optional[List[Optional[CodeInfo]]] = None
    # the interpreter of that image: a process that execs another Python
    # keeps its earlier stacks, in the earlier layouts and line tables
    python: Optional[detect.PythonProcess] = None
    # --async: the outermost generator-owned frame (the running task's coroutine), 0: none
    task_frame: int = 0


def code_infos(reader, frames, stamps=None) -> List[Optional[CodeInfo]]:
    """The code objects of a Python stack's frames, read by `reader` (a
    CodeReader); stamps: BPF's, one per frame (None: a stack read in user
    space, stamped as it is read).  None for a subinterpreter's mark
    (PYF_INTERP), which is an interpreter, not code."""
    stamps = stamps or [None] * len(frames)
    return [None if flags & bpfdefs.PYF_INTERP else reader.code(code, stamp)
            for (code, _, flags), stamp in zip(frames, stamps)]


@dataclass
class ThreadTimes:
    """One thread's exact times inside the recording (ns; first/last from the
    start), or, with threads > 1, of a group of ended threads folded together."""
    pid: int
    tid: int
    name: str
    on_ns: int = 0                  # wall mode: exact; cpu mode: samples x period
    samples: int = 0                # raw on-CPU samples
    first_ns: int = 0
    last_ns: int = 0
    exited: bool = False
    threads: int = 1
    entry: str = ""                 # a group: the function its threads started in
    first_tid: int = 0              # a group: its first thread


@dataclass
class Recording:
    options: Options
    start_time: float = 0.0                 # unix time
    duration_s: float = 0.0
    duration_ns: int = 0
    # (tgid, tid, ustack, kstack, pyhash, kind) -> [count, ns]; tid < 0: a group
    stacks: Dict[Tuple[int, int, int, int, int, int], List[int]] = field(default_factory=dict)
    ustacks: Dict[int, List[int]] = field(default_factory=dict)
    # ids in ustacks >= NATIVE_ID_BASE are .eh_frame-walked stacks: their NST_* flags
    native_flags: Dict[int, int] = field(default_factory=dict)
    kstacks: Dict[int, List[int]] = field(default_factory=dict)
    pystacks: Dict[int, PyStack] = field(default_factory=dict)
    code: Dict[Tuple[int, int], Optional[CodeInfo]] = field(default_factory=dict)
    pythons: Dict[int, detect.PythonProcess] = field(default_factory=dict)     # the latest image
    python_names: Dict[int, str] = field(default_factory=dict)    # tid -> threading's name
    python_images: List[detect.PythonProcess] = field(default_factory=list)   # every one, execs too
    spaces: Dict[int, symbols.AddressSpace] = field(default_factory=dict)
    threads: Dict[int, ThreadTimes] = field(default_factory=dict)   # tid (or group id) ->
    comms: Dict[int, str] = field(default_factory=dict)
    cmdlines: Dict[int, str] = field(default_factory=dict)
    # host pid/tid -> its id inside its PID namespace (containers), where they differ
    ns_ids: Dict[int, int] = field(default_factory=dict)
    drops: Dict[str, int] = field(default_factory=dict)
    drops_ns: Dict[str, int] = field(default_factory=dict)           # time the drops lost
    notices: List[str] = field(default_factory=list)
    exit_status: Optional[int] = None       # of a launched command
    gone_pids: Set[int] = field(default_factory=set)   # targets whose process ended (or lost its PID)
    exact_on_cpu: bool = False              # on-CPU per thread from switch timestamps
    tasks: Optional[object] = None          # --async: collect/tasks.py's TaskTimes
    # --wakers: (the wait's key in stacks, its waker) -> [waits, ns], the waker
    # (kind, tgid, tid, ustack, kstack, pystack, comm); its stacks are in
    # ustacks / kstacks / pystacks like the waits' own
    wakes: Dict[Tuple[tuple, tuple], List[int]] = field(default_factory=dict)
    # waits left out by --min-block-us / --max-block-us: [how many, ns]
    block_filtered: List[int] = field(default_factory=lambda: [0, 0])
    # how the waits' stacks were taken (Options.offcpu, or "exact" where
    # rseq_capture could not be attached): the keys of "sampled" and "shadow"
    # carry bpfdefs.KIND_SAMPLED / KIND_SHORT / KIND_SHADOW (profile/waits.py)
    offcpu: str = "exact"
    # PYOFFCPU_FOLD=shadow (tests): the kernel's folds of the threads user
    # space folded too, kept apart (stacks and threads as above, groups only)
    kernel_stacks: Dict[Tuple[int, int, int, int, int, int], List[int]] = field(default_factory=dict)
    kernel_threads: Dict[int, ThreadTimes] = field(default_factory=dict)
    kernel_folded: int = 0                  # threads the kernel folded (bpf: fold_exit)
    # how switch-outs found their native stack (bpf/memo.c memo_stats): hit_thread,
    # hit_shared, walked; with PYOFFCPU_MEMO_VERIFY=1 also checked and wrong
    memo_stats: Dict[str, int] = field(default_factory=dict)
    timeline: Optional[object] = None       # --timeline: collect/timeline.py's Timeline
    # the machine's (busy, stolen) CPU seconds over the recording, all CPUs
    # (/proc/stat): on-CPU times by the clock include the stolen part
    cpu_steal: Optional[Tuple[float, float]] = None

    @property
    def thread_names(self) -> Dict[int, str]:
        return {tid: t.name for tid, t in self.threads.items()}

    def add_drop(self, what: str, count: int, ns: int = 0):
        """count more of a drop, and the time they lost."""
        self.drops[what] = self.drops.get(what, 0) + count
        if ns:
            self.drops_ns[what] = self.drops_ns.get(what, 0) + ns

    def totals(self) -> Tuple[int, int]:
        """(on-CPU samples, off-CPU ns) so far: the exact off-CPU time, not
        the weights of sampled waits (a share of their KIND_SHORT totals) or
        of a shadow recording's second view."""
        samples = sum(v[0] for k, v in self.stacks.items() if bpfdefs.on_cpu(k[5]))
        blocked = sum(v[1] for k, v in self.stacks.items()
                      if not bpfdefs.on_cpu(k[5]) and not k[5] & _NOT_IN_TOTALS)
        return samples, blocked


def accumulate(table: Dict, key, count: int, ns: int) -> None:
    """table[key] += [count, ns], the entry made if there is none."""
    acc = table.get(key)
    if acc is None:
        table[key] = [count, ns]
    else:
        acc[0] += count
        acc[1] += ns
