"""`pyoffcpu doctor`: what a recording needs from this machine, checked one
line each, with what to do about what is missing.

Each check is the one a recording itself meets (platform.py, bpfload.py,
the caches), run on its own so that all are told at once instead of the
first failure only.  FAIL: a recording would not work; warn: it works, with
less (programs compiled at the first start, an optional tracepoint); ok.  The exit status is 0 when nothing FAILed.  The checks change nothing
on the machine, except tracefs: a recording mounts it when it is missing,
and so does doctor, saying so.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable, List

from ..collect import platform as P
from ..collect.progcache import one_line

OK, WARN, FAIL = "ok", "warn", "FAIL"

# what the programs attach to: (tracefs event, what it is for, needed)
TRACEPOINTS = [
    ("sched/sched_switch", "off-CPU time (--mode wall, off)", True),
    ("sched/sched_process_exec", "targets that exec", True),
    ("sched/sched_process_exit", "threads and processes that end", True),
    ("sched/sched_process_fork", "threads and --subprocesses", True),
    ("sched/sched_waking", "--wakers", False),
    ("irq/irq_handler_entry", "--wakers (interrupt context)", False),
    ("irq/softirq_entry", "--wakers (interrupt context)", False),
    ("timer/hrtimer_expire_entry", "--wakers (timers)", False),
    ("signal/signal_deliver", "pyoffcpu crashes", False),
]


@dataclass
class Check:
    status: str
    what: str
    detail: str
    todo: str = ""

    def line(self) -> str:
        return f"{self.status:<4}  {self.what}: {self.detail}" + (f" (to do: {self.todo})" if self.todo else "")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def check_privileges() -> Check:
    if os.geteuid() == 0:
        caps = P._effective_caps()
        if caps and not caps & (1 << P.CAP_SYS_ADMIN) and not (
                caps & (1 << P.CAP_BPF) and caps & (1 << P.CAP_PERFMON)):
            return Check(FAIL, "privileges", "root, but without CAP_SYS_ADMIN or CAP_BPF + CAP_PERFMON "
                         "(a container's bounding set?)", "give the container CAP_BPF and CAP_PERFMON")
        return Check(OK, "privileges", "root")
    try:
        P.check_privileges()
    except P.ProfilerError:
        return Check(FAIL, "privileges", f"uid {os.geteuid()} without CAP_BPF and CAP_PERFMON",
                     "run pyoffcpu with sudo")
    return Check(OK, "privileges", f"uid {os.geteuid()} with CAP_BPF and CAP_PERFMON")


def check_btf() -> Check:
    if not os.path.exists(P.BTF_PATH):
        return Check(FAIL, "kernel BTF", f"no {P.BTF_PATH}", "a kernel built with CONFIG_DEBUG_INFO_BTF=y")
    from ..kernel.btf import BtfError, member_offsets
    try:
        member_offsets(P.BTF_PATH, [("task_struct", f) for f in ("thread.fsbase", "pid", "tgid")])
    except (BtfError, OSError) as e:
        return Check(FAIL, "kernel BTF", f"{P.BTF_PATH} does not give task_struct's fields: {e}",
                     "x86_64 kernels with BTF only")
    return Check(OK, "kernel BTF", P.BTF_PATH)


def check_tracefs() -> Check:
    if os.path.exists(os.path.join(P.TRACEFS, "events")):
        return Check(OK, "tracefs", f"mounted at {P.TRACEFS}")
    if os.path.ismount(P.TRACEFS):
        return Check(FAIL, "tracefs", f"mounted at {P.TRACEFS}, but uid {os.geteuid()} cannot read it",
                     "run pyoffcpu with sudo")
    try:
        P.ensure_tracefs()
    except P.ProfilerError:
        return Check(FAIL, "tracefs", f"not mounted at {P.TRACEFS}, and mounting it failed",
                     f"mount -t tracefs tracefs {P.TRACEFS} (needs CAP_SYS_ADMIN)")
    return Check(OK, "tracefs", f"was not mounted: mounted it at {P.TRACEFS}, as a recording does")


def check_tracepoints() -> List[Check]:
    events = os.path.join(P.TRACEFS, "events")
    if not os.path.isdir(events):
        return [Check(FAIL, "tracepoints", f"cannot be listed: no {events}", "see tracefs above")]
    missing_needed = [(e, why) for e, why, need in TRACEPOINTS if need and not os.path.isdir(os.path.join(events, e))]
    missing_opt = [(e, why) for e, why, need in TRACEPOINTS if not need and not os.path.isdir(os.path.join(events, e))]
    out = []
    if missing_needed:
        out.append(Check(FAIL, "tracepoints", "missing: " + ", ".join(f"{e} ({w})" for e, w in missing_needed),
                         "a kernel with the scheduler tracepoints (CONFIG_TRACEPOINTS)"))
    else:
        out.append(Check(OK, "tracepoints", f"the {sum(1 for t in TRACEPOINTS if t[2])} a recording needs"))
    if missing_opt:
        out.append(Check(WARN, "tracepoints", "missing, so these are off: " +
                         ", ".join(f"{e} ({w})" for e, w in missing_opt)))
    return out


def check_lockdown() -> Check:
    text = _read("/sys/kernel/security/lockdown")
    if not text:
        if not os.path.isdir("/sys/kernel/security") or not os.listdir("/sys/kernel/security"):
            return Check(OK, "kernel lockdown", "not reported (securityfs not mounted): the BPF load below tells")
        return Check(OK, "kernel lockdown", "none")
    mode = text[text.find("[") + 1:text.find("]")] if "[" in text else text
    if mode == "confidentiality":
        return Check(FAIL, "kernel lockdown", "confidentiality: BPF may not read kernel memory",
                     "boot with lockdown=integrity or none (or without Secure Boot's lockdown)")
    return Check(OK, "kernel lockdown", mode)


# BPF_PROG_TYPE_RAW_TRACEPOINT, and `r0 = 0; exit`
_RAW_TP = 17
_RETURN_0 = struct.pack("<BBhi", 0xb7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)


def check_bpf_load() -> Check:
    """A program of two instructions loaded and attached to sched_switch,
    then closed: BPF itself, the program type and the attach a recording
    makes (what lockdown, seccomp or a container's capabilities forbid)."""
    from ..kernel import bpfsys
    try:
        fd, _ = bpfsys.prog_load(_RAW_TP, _RETURN_0, b"GPL", 0, "pyoffcpu_doctor")
    except OSError as e:
        return Check(FAIL, "BPF", f"a program does not load: {e.strerror or e}",
                     "root or CAP_BPF; a kernel with CONFIG_BPF_SYSCALL; no lockdown or seccomp forbidding bpf(2)")
    try:
        tp = bpfsys.raw_tracepoint_open("sched_switch", fd)
    except OSError as e:
        return Check(FAIL, "BPF", f"a program loads but does not attach to sched_switch: {e.strerror or e}",
                     "CAP_PERFMON (or root)")
    finally:
        os.close(fd)
    os.close(tp)
    return Check(OK, "BPF", "a program loads and attaches to sched_switch")


def check_perf_event() -> Check:
    from ..kernel import bpfsys
    paranoid = _read("/proc/sys/kernel/perf_event_paranoid") or "?"
    try:
        fd = bpfsys.perf_event_open(1, 0, 0, 99, -1, bpfsys.online_cpus()[0], -1)   # software cpu-clock
    except OSError as e:
        return Check(FAIL, "perf events", f"the cpu-clock event does not open: {e.strerror or e} "
                     f"(perf_event_paranoid {paranoid})",
                     "CAP_PERFMON (or root); a kernel with CONFIG_PERF_EVENTS")
    os.close(fd)
    return Check(OK, "perf events", f"cpu-clock opens (perf_event_paranoid {paranoid}: "
                 "no matter with CAP_PERFMON)")


MIN_KERNEL = (5, 15)     # bpf_task_pt_regs; BTF (bpf_get_current_task_btf, the offsets)


def check_kernel() -> Check:
    """The kernel's release against the oldest the programs' helpers exist
    in (docs/install.md#kernels); the load below is the proof."""
    release = os.uname().release
    try:
        version = tuple(int(x) for x in release.split("-")[0].split(".")[:2])
    except ValueError:
        return Check(WARN, "kernel", f"{release}: version not understood (the load below tells)")
    need = ".".join(map(str, MIN_KERNEL))
    if version < MIN_KERNEL:
        return Check(FAIL, "kernel", f"Linux {release}: the programs need {need} or newer "
                     "(bpf_task_pt_regs, BTF)", f"a kernel of {need} or newer")
    return Check(OK, "kernel", f"Linux {release} ({need} or newer needed)")


def _load_default_programs():
    """(origin, programs verified, optional ones refused, seconds, how they
    read task_struct) of the programs a default recording loads, loaded as
    it loads them (the verifier runs) without a compile, then closed;
    raises what it raises."""
    import time
    from ..collect import sessionsetup
    from ..collect.recording import Options
    o = Options()
    consts = sessionsetup.load_consts(o, P.probe())
    t0 = time.monotonic()
    # the unwinder's too, as --tables-first loads them (a default start
    # verifies them just after): all that a default recording verifies
    prog = sessionsetup.load_programs(o, consts, unwinder_now=True, may_compile=False)
    try:
        if not consts.get("KERNEL_CAST"):
            reads = "bpf_probe_read_kernel (no bpf_rdonly_cast kfunc in this kernel's BTF)"
        elif prog.cast_refused:
            reads = f"bpf_probe_read_kernel in {', '.join(prog.cast_refused)} (the verifier refused " \
                    "bpf_rdonly_cast there), plain loads elsewhere"
        else:
            reads = "plain loads (bpf_rdonly_cast)"
        return (prog.origin, len(prog.funcs), sorted(n.decode() for n in prog.load_errors),
                time.monotonic() - t0, reads)
    finally:
        prog.cleanup()


def check_programs() -> List[Check]:
    """Can a recording load its programs?  Tried: the package's (or this
    machine's cache's) loaded as a default recording loads them, the
    verifier included.  bcc and the kernel headers matter only where
    they do not load: then a recording compiles them."""
    try:
        origin, n, refused, took, reads = _load_default_programs()
        error = ""
    except Exception as e:                                  # noqa: BLE001 - the finding
        error = one_line(e)
    have_bcc, bcc_line = _check_bcc(needed=bool(error))
    have_headers, headers_line = _check_headers(needed=bool(error))
    out = [bcc_line, headers_line]
    todo = "apt install python3-bpfcc linux-headers-amd64 (tools/setup-system.sh)"
    if not error:
        where = ("the package's (compiled when it was built)" if origin == "package"
                 else "this machine's cache's (compiled by bcc before)")
        detail = (f"{where} load on this kernel: {n} passed the verifier in {took:.1f} s; "
                  f"task_struct read by {reads}")
        if refused:
            out.append(Check(WARN, "BPF programs", f"{detail}; refused: {', '.join(refused)} "
                             "(native unwinding or sampled waits off)"))
        else:
            out.append(Check(OK, "BPF programs", detail))
    elif have_bcc and have_headers:
        out.append(Check(WARN, "BPF programs", f"none compiled loads here ({error}): bcc compiles "
                         "them at a recording's first start (then cached)"))
    else:
        missing = " and ".join(w for w, ok in (("bcc", have_bcc), ("kernel headers", have_headers))
                               if not ok)
        out.append(Check(FAIL, "BPF programs", f"none can be loaded: {error}; no {missing} to "
                         "compile them for this kernel", todo))
    return out


def _check_bcc(needed: bool):
    try:
        import bcc  # noqa: F401
        return True, Check(OK, "bcc", f"importable ({os.path.dirname(bcc.__file__)})")
    except Exception as e:                                  # noqa: BLE001 - any import failure
        why = f"not importable ({type(e).__name__}: {e})"
        if not needed:
            return False, Check(OK, "bcc", f"{why}: not needed while compiled programs load")
        return False, Check(WARN, "bcc", f"{why}: nothing compiles programs for this kernel",
                            "apt install python3-bpfcc")


def _check_headers(needed: bool):
    build = f"/lib/modules/{os.uname().release}/build"
    if any(os.path.exists(os.path.join(build, p))
           for p in ("include/generated/autoconf.h", "include/linux/kconfig.h")):
        return True, Check(OK, "kernel headers", f"{os.path.realpath(build)}: what bcc compiles against")
    if not needed:
        return False, Check(OK, "kernel headers", f"none at {build}: not needed while compiled programs load")
    return False, Check(WARN, "kernel headers", f"none at {build}: bcc cannot compile",
                        "apt install linux-headers-amd64, then /usr/share/pyoffcpu/setup-kernel-headers "
                        "(or tools/setup-system.sh)")


def _cache_entries() -> int:
    from ..cachedir import cache_dir
    d = cache_dir("bpf")
    try:
        return len([n for n in os.listdir(d) if n.endswith(".bpf")]) if d else 0
    except OSError:
        return 0


def check_cache_dir() -> Check:
    from ..cachedir import cache_dir
    d = cache_dir("bpf")
    if d is None:
        return Check(OK, "cache directory", "off (PYOFFCPU_CACHE_DIR is empty): where the package's programs "
                     "do not load, every start compiles them")
    top = os.path.dirname(d)
    for path in (top, d):
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return Check(OK, "cache directory", f"{path} does not exist yet: made root-only at the first start")
        except OSError as e:
            return Check(FAIL, "cache directory", f"{path}: {e.strerror}", f"remove {path}")
        import stat as _stat
        if not _stat.S_ISDIR(st.st_mode):
            return Check(FAIL, "cache directory", f"{path} is not a directory", f"remove {path}")
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return Check(FAIL, "cache directory",
                         f"{path} is owned by uid {st.st_uid}, mode {st.st_mode & 0o7777:o}: not used "
                         "(what is read from it steers programs in the kernel)",
                         f"chown -R {os.geteuid()} {path} && chmod -R go-w {path}, or remove it")
    n = _cache_entries()
    return Check(OK, "cache directory", f"{d}: ours, not writable by others "
                 f"({n} compiled program set{'' if n == 1 else 's'})")


def check_bpf_stats() -> Check:
    v = _read("/proc/sys/kernel/bpf_stats_enabled")
    if v == "1":
        return Check(WARN, "kernel.bpf_stats_enabled", "1: every BPF program on the machine pays two clock "
                     "reads per run (make bench turns it on only while it measures)",
                     "sysctl kernel.bpf_stats_enabled=0")
    if v == "0":
        return Check(OK, "kernel.bpf_stats_enabled", "0 (make bench turns it on while it measures)")
    return Check(WARN, "kernel.bpf_stats_enabled", "not readable: make bench cannot measure BPF run time")


def check_helper() -> Check:
    """pyoffcpu-elf, the one builder of native unwind tables and function
    indexes, run on a small file (its prologue analysis loads capstone)."""
    from ..native import helper
    from ..native.unwind import table
    if not helper.available():
        return Check(WARN, "native helper", f"{helper.BINARY} is not built: native stacks are walked "
                     "by frame pointer and native frames have no names", "make install (builds it)")
    probe = os.path.realpath("/bin/true")
    try:
        helper.run(table.build_args(), probe, wall_limit_s=60.0)
    except (OSError, helper.HelperError) as e:
        return Check(WARN, "native helper", f"{helper.BINARY} fails on {probe}: {e}: native stacks are "
                     "walked by frame pointer and native frames have no names",
                     "make install (builds it again; it needs glibc 2.34 or newer)")
    if not table.prologue_enabled():
        why = "PYOFFCPU_PROLOGUE=0" if helper.capstone_lib() else "no capstone 5 library found"
        return Check(WARN, "native helper", f"pyoffcpu-elf builds unwind tables from .eh_frame alone ({why}): "
                     "code without CFI ends native stacks", "pip install 'capstone>=5'"
                     if not helper.capstone_lib() else "")
    return Check(OK, "native helper", "pyoffcpu-elf builds unwind tables (prologue analysis with capstone "
                 f"{helper.capstone_version() or 'of unknown version'}) and symbol indexes")


CHECKS: List[Callable] = [check_privileges, check_kernel, check_btf, check_tracefs, check_tracepoints,
                          check_lockdown, check_bpf_load, check_perf_event, check_programs, check_helper,
                          check_cache_dir, check_bpf_stats]


def run_checks() -> List[Check]:
    out: List[Check] = []
    for c in CHECKS:
        try:
            got = c()
        except Exception as e:                              # noqa: BLE001 - a check that breaks is a finding
            got = Check(FAIL, c.__name__[6:].replace("_", " "), f"{type(e).__name__}: {e}")
        out.extend(got if isinstance(got, list) else [got])
    return out
