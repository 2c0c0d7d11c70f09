"""What the running machine offers, checked before anything is loaded: root or
CAP_BPF+CAP_PERFMON, BTF, tracefs, and the kernel/glibc offsets BPF needs."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

# Overridable for unusual systems (and for the tests of the error paths).
BTF_PATH = os.environ.get("PYOFFCPU_BTF", "/sys/kernel/btf/vmlinux")
TRACEFS = os.environ.get("PYOFFCPU_TRACEFS", "/sys/kernel/tracing")
CAP_PERFMON, CAP_BPF, CAP_SYS_ADMIN = 38, 39, 21


class ProfilerError(Exception):
    """An error the user can act on: printed as one line, exit 1."""

    def __init__(self, what: str, todo: str = ""):
        super().__init__(what)
        self.what = what
        self.todo = todo

    def line(self) -> str:
        return f"pyoffcpu: error: {self.what}" + (f" ({self.todo})" if self.todo else "")


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


# the errors about the machine point to the command that checks all of it
DOCTOR = "`sudo pyoffcpu doctor` checks everything a recording needs"


def check_privileges() -> None:
    caps = _effective_caps()
    if caps & (1 << CAP_SYS_ADMIN) or (caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON)):
        return
    if os.geteuid() == 0:
        raise ProfilerError("pyoffcpu runs as root but without CAP_SYS_ADMIN or CAP_BPF + CAP_PERFMON "
                            "(a container's capabilities?)", "give it CAP_BPF and CAP_PERFMON; " + DOCTOR)
    raise ProfilerError("pyoffcpu needs root (or CAP_BPF and CAP_PERFMON)",
                        "run it with sudo; " + DOCTOR)


def ensure_tracefs() -> None:
    if os.path.exists(os.path.join(TRACEFS, "events")):
        return
    try:
        subprocess.run(["mount", "-t", "tracefs", "tracefs", TRACEFS], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError):
        raise ProfilerError(f"tracefs is not mounted at {TRACEFS} and mounting it failed",
                            f"mount -t tracefs tracefs {TRACEFS}; {DOCTOR}") from None
    if not os.path.exists(os.path.join(TRACEFS, "events", "sched", "sched_switch")):
        raise ProfilerError("the sched_switch tracepoint is missing",
                            f"pyoffcpu needs a kernel with scheduler tracepoints; {DOCTOR}")


@dataclass
class Platform:
    task_fsbase_offset: int
    task_pid_offset: int = -1
    task_tgid_offset: int = -1
    task_exec_offset: int = -1      # se.sum_exec_runtime
    exit_group_dead: bool = False   # sched_process_exit says when a process's last thread exits
    pt_regs_offsets: tuple = ()     # (ip, cs, orig_ax, ax): the system call a thread blocks in
    task_rseq_offset: int = -1      # task_struct.rseq (-1: not known): which threads rseq_update sees
    # BTF type ids for direct reads of task_struct (bpf/loadconst.h task_u32), 0: none
    kfunc_rdonly_cast_id: int = 0
    btf_task_struct_id: int = 0


def probe() -> Platform:
    """Every check that needs no BPF load; raises ProfilerError."""
    check_privileges()
    if not os.path.exists("/sys/fs/bpf") and not os.path.exists("/proc/sys/kernel/bpf_stats_enabled"):
        raise ProfilerError("this kernel has no BPF support", f"pyoffcpu needs Linux >= 5.8 with BPF; {DOCTOR}")
    if not os.path.exists(BTF_PATH):
        raise ProfilerError(f"no kernel BTF at {BTF_PATH}",
                            f"pyoffcpu needs a kernel built with CONFIG_DEBUG_INFO_BTF; {DOCTOR}")
    from ..kernel.btf import TRACEPOINT_ARGS, TYPE_ID, BtfError, member_offsets
    try:
        offs = member_offsets(BTF_PATH, [("task_struct", f) for f in
                                         ("thread.fsbase", "pid", "tgid", "se.sum_exec_runtime")]
                              + [(TRACEPOINT_ARGS, "sched_process_exit")])
    except (BtfError, OSError) as e:
        raise ProfilerError(f"cannot read task_struct's fsbase, pid and tgid from BTF: {e}",
                            f"x86_64 kernels with BTF only; {DOCTOR}") from None
    try:
        regs = tuple(member_offsets(BTF_PATH, [("pt_regs", f) for f in ("ip", "cs", "orig_ax", "ax")]))
    except (BtfError, OSError):
        regs = ()                   # off-CPU reasons without the system call
    try:
        rseq = member_offsets(BTF_PATH, [("task_struct", "rseq")])[0]
    except (BtfError, OSError):
        rseq = -1                   # sampled waits: rseq_capture finds out per thread
    try:
        cast, task = member_offsets(BTF_PATH, [(TYPE_ID, "func bpf_rdonly_cast"), (TYPE_ID, "struct task_struct")])
    except (BtfError, OSError):
        cast = task = 0             # task_struct read by bpf_probe_read_kernel
    ensure_tracefs()
    return Platform(task_fsbase_offset=offs[0], task_pid_offset=offs[1], task_tgid_offset=offs[2],
                    task_exec_offset=offs[3], exit_group_dead=offs[4] >= 2,
                    pt_regs_offsets=regs, task_rseq_offset=rseq,
                    kfunc_rdonly_cast_id=cast, btf_task_struct_id=task)
