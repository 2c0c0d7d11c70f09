"""`pyoffcpu snapshot`: short wall-clock profiles of the processes that
matter, from cron or a systemd timer, kept for a week.

One run: take the lock, find the targets (--pid, --match, --gpu, or every
Python process), record them all at once in one session for -d seconds,
write one file per process and format under
`DIR/<host>/<YYYY-mm-dd>/<HHMMSS>-<pid>-<name>.<ext>`, add one entry per
process to `DIR/index.json`, apply the retention (which deletes only files
the index lists), and say nothing unless something failed.

The index is this tool's record of what it wrote: `pyoffcpu report DIR`
reads it, and retention never touches a file it does not list.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..collect.platform import ProfilerError
from ..kernel.procfs import cmdline, comm, read_text

INDEX = "index.json"
LOCK = ".lock"
INDEX_VERSION = 1
EXIT_LOCKED = 3                 # another snapshot holds DIR's lock
EXIT_PARTIAL = 2                # recorded, but some files or entries could not be written
DEFAULT_FORMATS = ("svg", "pprof")
SNAPSHOT_FORMATS = ("svg", "pprof", "folded", "speedscope")
EXTENSIONS = {"svg": ".svg", "pprof": ".pb.gz", "folded": ".folded", "speedscope": ".json"}
TOP_FUNCTIONS = 10
GPU_DEVICE = re.compile(r"^/dev/nvidia")
GPU_LIBRARY = re.compile(r"/libcuda\.so(\.\d+)*$")


class Locked(ProfilerError):
    """Another snapshot run holds the directory's lock."""


@dataclass
class SnapshotOptions:
    dir: str
    pids: List[int] = field(default_factory=list)
    match: Optional[str] = None
    gpu: bool = False
    duration: float = 10.0
    frequency: int = 99
    mode: str = "wall"
    formats: Tuple[str, ...] = DEFAULT_FORMATS
    keep_days: Optional[float] = 7.0
    max_total_mb: Optional[float] = None
    host: str = field(default_factory=socket.gethostname)


# -- which processes ----------------------------------------------------------------
def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _pids() -> List[int]:
    return sorted(int(d) for d in os.listdir("/proc") if d.isdigit())


def gpu_facts(pid: int) -> Dict[str, object]:
    """What ties a process to a GPU without NVML: the /dev/nvidia* devices it
    has open, and whether it maps libcuda.  {} when neither."""
    devices = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if GPU_DEVICE.match(target):
            devices.add(target)
    maps = read_text(f"/proc/{pid}/maps") or ""
    libcuda = sorted({ln.split()[-1] for ln in maps.splitlines()
                      if len(ln.split()) >= 6 and GPU_LIBRARY.search(ln.split()[-1])})
    out: Dict[str, object] = {}
    if devices:
        out["devices"] = sorted(devices)
    if libcuda:
        out["libcuda"] = libcuda
    return out


def nvml_facts() -> Tuple[Dict[int, List[dict]], str]:
    """Per host PID, the GPUs NVML says it runs on (index, name, memory it
    uses, the GPU's utilisation), and a note on why there are none (NVML
    absent, no driver, no GPU).  nvidia-ml-py is optional."""
    try:
        import pynvml                                   # nvidia-ml-py
    except Exception:                                   # noqa: BLE001 - absent or broken: no facts
        return {}, "NVML: nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:                              # noqa: BLE001 - no driver, no GPU
        return {}, f"NVML: {type(e).__name__}: {e}".strip()
    out: Dict[int, List[dict]] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            except Exception:                           # noqa: BLE001
                util = None
            procs = list(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
            try:
                procs += list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(h))
            except Exception:                           # noqa: BLE001
                pass
            for p in procs:                             # host PIDs, even from containers
                mem = getattr(p, "usedGpuMemory", None)
                out.setdefault(int(p.pid), []).append(
                    {"index": i, "name": name, "utilization_pct": util,
                     "memory_mib": round(mem / 2**20) if isinstance(mem, int) else None})
    except Exception as e:                              # noqa: BLE001
        return out, f"NVML: {type(e).__name__}: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:                               # noqa: BLE001
            pass
    return out, ""


@dataclass
class Candidate:
    pid: int
    name: str
    cmdline: str
    gpu: Dict[str, object] = field(default_factory=dict)


def find_targets(opts: SnapshotOptions, errors: List[str]) -> List[Candidate]:
    """The processes to record: --pid ones (checked), else those --match and
    --gpu select among the Python processes (all of them without either)."""
    from ..cpython import detect
    me = os.getpid()
    nvml: Dict[int, List[dict]] = {}
    if opts.gpu:
        nvml, _note = nvml_facts()
    rx = re.compile(opts.match) if opts.match else None
    out = []
    if opts.pids:
        for pid in opts.pids:
            if not os.path.isdir(f"/proc/{pid}"):
                errors.append(f"no such process: {pid}")
                continue
            out.append(Candidate(pid, comm(pid), cmdline(pid), _gpu_of(pid, nvml) if opts.gpu else {}))
        return out
    for pid in _pids():
        if pid == me:
            continue
        line = cmdline(pid)
        if not line or (rx is not None and not rx.search(line)):
            continue                                    # kernel threads have no command line
        gpu = _gpu_of(pid, nvml) if opts.gpu else {}
        if opts.gpu and not gpu:
            continue
        try:
            detect.find_python(pid)
        except Exception:                               # noqa: BLE001 - not Python, gone, unreadable
            continue
        out.append(Candidate(pid, comm(pid), line, gpu))
    return out


def _gpu_of(pid: int, nvml: Dict[int, List[dict]]) -> Dict[str, object]:
    facts = gpu_facts(pid)
    if pid in nvml:
        facts["nvml"] = nvml[pid]
    return facts


# -- the directory, the lock and the index ---------------------------------------------------
def _own_dir_fd(path: str, name: Optional[str] = None, dir_fd: Optional[int] = None,
                create: bool = True) -> int:
    """A directory root may write in: made if missing (0755), opened without
    following a symbolic link, and checked to be a directory owned by us and
    writable by no one else (else a user could put a symlink in it and have
    root write or delete through it).  Raises ProfilerError (one line)."""
    where = path if name is None else os.path.join(path, name)
    target = where if dir_fd is None else name
    if create:
        try:
            os.mkdir(target, 0o755, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except OSError as e:
            raise ProfilerError(f"cannot make {where}: {e.strerror}", "give another --dir") from None
    try:
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise ProfilerError(f"cannot use {where}: {why}",
                            "give a directory of root's that no one else can write (--dir)") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise ProfilerError(f"cannot use {where}: owned by uid {st.st_uid}, mode {st.st_mode & 0o7777:o} "
                            "(a directory root writes in must be its own and writable by no one else)",
                            "chown root and chmod go-w it, or give another --dir")
    return fd


def make_day_dirs(directory: str, day: str) -> None:
    """DIR/HOST/DAY (day: "HOST/DAY"), host then day each made and checked
    in its parent as _own_dir_fd does; raises ProfilerError."""
    dfd = _own_dir_fd(directory)
    try:
        for name in day.split(os.sep):
            sub = _own_dir_fd(directory, name, dir_fd=dfd)
            os.close(dfd)
            dfd = sub
    finally:
        os.close(dfd)


def check_dir(directory: str) -> None:
    """--dir, made if missing: one line and exit 1 where root cannot write in it safely."""
    os.close(_own_dir_fd(directory))


class DirLock:
    """flock on DIR/.lock, not waited for: an overlapping run is refused."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK)
        self.directory = directory
        self.fd = -1

    def __enter__(self):
        dfd = _own_dir_fd(self.directory)
        try:
            self.fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
            raise ProfilerError(f"cannot use {self.path}: {why}", "remove it; this run did nothing") from None
        finally:
            os.close(dfd)
        import stat as _stat
        if not _stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            self.fd = -1
            raise ProfilerError(f"cannot use {self.path}: not a regular file", "remove it; this run did nothing")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = (os.pread(self.fd, 32, 0).decode("ascii", "replace").strip() or "?")
            os.close(self.fd)
            self.fd = -1
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise Locked(f"another snapshot is running in {os.path.dirname(self.path)} "
                             f"(pid {holder} holds {self.path})", "this run did nothing") from None
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        return self

    def __exit__(self, *exc):
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = -1


def _read_index(path: str) -> Optional[bytes]:
    """The index's bytes (None: there is none).  It is a file in a directory
    someone may have handed over (report): a regular file, opened without
    blocking, read within PYOFFCPU_MAX_INPUT_MB; raises ValueError."""
    import stat as _stat
    from ..export.pprof import max_input_bytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        limit = max_input_bytes()
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"over {limit >> 20} MiB")
        return data
    finally:
        os.close(fd)


def load_index(directory: str) -> dict:
    path = os.path.join(directory, INDEX)
    try:
        data = _read_index(path)
    except ValueError as e:
        raise ProfilerError(f"{path} is not a pyoffcpu index ({e})", "move it away") from None
    if data is None:
        return {"version": INDEX_VERSION, "entries": [], "runs": []}
    try:
        index = json.loads(data)
    except (ValueError, RecursionError):
        raise ProfilerError(f"{os.path.join(directory, INDEX)} is not a pyoffcpu index (bad JSON)",
                            "move it away; files it listed are no longer managed") from None
    if not isinstance(index, dict) or not isinstance(index.get("entries"), list):
        raise ProfilerError(f"{os.path.join(directory, INDEX)} is not a pyoffcpu index")
    entries = [e for e in index["entries"] if valid_entry(e)]
    index["dropped"] = len(index["entries"]) - len(entries)     # read by report; not meant to be kept
    index["entries"] = entries
    runs = index.get("runs")
    index["runs"] = [r for r in runs if valid_run(r)] if isinstance(runs, list) else []
    return index


def valid_run(r) -> bool:
    """A run record as run() writes it (report reads these fields)."""
    return (isinstance(r, dict) and _time(r.get("time")) and _int(r.get("targets", 0))
            and isinstance(r.get("errors", []), list))


def _time(v) -> bool:
    """Seconds since the epoch that the local calendar can show (to 5138)."""
    return _num(v) and 0 <= v < 1e11


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) < 1e18


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def valid_entry(e) -> bool:
    """An index entry as run() writes it: the types report and retention
    read (anything else in it is ignored).  The index is a file: one that
    is damaged, or written by hand, gives a line, never a traceback."""
    if not isinstance(e, dict) or not _time(e.get("time")) or not _int(e.get("pid", 0)):
        return False
    for k in ("host", "name", "cmdline", "python", "mode"):
        if not isinstance(e.get(k, ""), str):
            return False
    for k in ("duration_s", "frequency_hz"):
        if not _num(e.get(k, 0)):
            return False
    for k in ("on_cpu_ns", "off_cpu_ns", "threads"):
        if not _int(e.get(k, 0)):
            return False
    reasons = e.get("off_cpu_by_reason_ns", {})
    if not isinstance(reasons, dict) or not all(isinstance(k, str) and _int(v) for k, v in reasons.items()):
        return False
    top = e.get("top", [])
    if not isinstance(top, list) or not all(
            isinstance(t, dict) and isinstance(t.get("where"), str) and _int(t.get("ns", 0))
            and _int(t.get("on_cpu_ns", 0)) for t in top):
        return False
    files = e.get("files", {})
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(f, dict) and isinstance(f.get("path"), str)
            and _int(f.get("bytes", 0)) for k, f in files.items()):
        return False
    notices = e.get("notices", [])
    return isinstance(notices, list) and all(isinstance(n, str) for n in notices)


def save_index(directory: str, index: dict) -> None:
    from ..export import write_bytes_atomic
    kept = {k: v for k, v in index.items() if k != "dropped"}
    write_bytes_atomic(os.path.join(directory, INDEX),
                       (json.dumps(kept, indent=1, sort_keys=True) + "\n").encode())


def entry_bytes(entry: dict) -> int:
    return sum(int(f.get("bytes", 0)) for f in entry.get("files", {}).values())


def apply_retention(directory: str, index: dict, keep_days: Optional[float],
                    max_total_mb: Optional[float], now: float) -> List[str]:
    """Drop the index's entries older than keep_days, then the oldest until
    the files it lists fit in max_total_mb; delete their files (only those)
    and the day directories left empty.  Returns the paths deleted."""
    entries = sorted(index["entries"], key=lambda e: e.get("time", 0))
    drop = []
    if keep_days is not None:
        cut = now - keep_days * 86400
        drop = [e for e in entries if e.get("time", 0) < cut]
        entries = [e for e in entries if e.get("time", 0) >= cut]
    if max_total_mb is not None:
        limit = max_total_mb * 2**20
        total = sum(entry_bytes(e) for e in entries)
        while entries and total > limit:
            e = entries.pop(0)
            total -= entry_bytes(e)
            drop.append(e)
    deleted = []
    for e in drop:
        for f in e.get("files", {}).values():
            if _delete_written(directory, f):
                deleted.append(os.path.join(directory, f["path"]))
    index["entries"] = entries
    runs = index.get("runs", [])
    if keep_days is not None:
        runs = [r for r in runs if r.get("time", 0) >= now - keep_days * 86400]
    index["runs"] = runs[-1000:]
    return deleted


def _delete_written(directory: str, f: dict) -> bool:
    """Delete one file the index says this tool wrote, only if it is that
    file: DIR/HOST/DAY/NAME (no other shape), reached without following a
    symbolic link (directory fds), a regular file whose size and inode are
    those recorded when it was written.  Then its day and host directories
    go if that left them empty.  Whatever the index says, nothing else."""
    import stat as _stat
    rel = f.get("path")
    parts = rel.split("/") if isinstance(rel, str) else []
    if (len(parts) != 3 or any(p in ("", ".", "..") for p in parts)
            or not isinstance(f.get("inode"), int) or not isinstance(f.get("bytes"), int)):
        return False
    fds = []
    try:
        fds.append(os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        for name in parts[:2]:
            fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                               dir_fd=fds[-1]))
        st = os.stat(parts[2], dir_fd=fds[-1], follow_symlinks=False)
        if not _stat.S_ISREG(st.st_mode) or st.st_ino != f["inode"] or st.st_size != f["bytes"]:
            return False
        os.unlink(parts[2], dir_fd=fds[-1])
        for i in (1, 0):                # the day, then the host: only if empty
            try:
                os.rmdir(parts[i], dir_fd=fds[i])
            except OSError:
                break
        return True
    except OSError:
        return False
    finally:
        for fd in fds:
            os.close(fd)


# -- one run ---------------------------------------------------------------------------------
def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:40] or "process"


def run(opts: SnapshotOptions, errors: List[str]) -> int:
    """One snapshot; errors (one line each) go to `errors`.  The exit code:
    0 everything written, EXIT_PARTIAL something could not be, 1 nothing
    recorded; Locked / ProfilerError are raised."""
    check_dir(opts.dir)
    with DirLock(opts.dir):
        index = load_index(opts.dir)
        started = time.time()
        targets = find_targets(opts, errors)
        written: List[dict] = []
        code = 0
        if targets:
            code = _record(opts, targets, index, written, errors)
        elif opts.pids:
            code = 1
        apply_retention(opts.dir, index, opts.keep_days, opts.max_total_mb, time.time())
        index["runs"].append({"time": started, "host": opts.host, "targets": len(targets),
                              "written": len(written), "errors": list(errors)[:20]})
        save_index(opts.dir, index)
        return code


def _record(opts: SnapshotOptions, targets: List[Candidate], index: dict, written: List[dict],
            errors: List[str]) -> int:
    from ..collect import platform as plat
    from ..native import symbols
    from ..export import _encode, render, write_bytes_atomic
    from ..profile.merge import build_profile
    from ..collect.recording import Options
    from ..collect.session import Session
    from ..profile.summary import recording_notes, top_functions

    session = Session(Options(pids=[t.pid for t in targets], duration=opts.duration,
                              frequency=opts.frequency, mode=opts.mode), plat.probe())

    def on_signal(signum, frame):
        session.request_stop(signal.Signals(signum).name)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rec = session.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    prof, stats = build_profile(rec, symbols.Symbolizer())
    # what the recording lost or could not do, as record says it (kept with every entry)
    notes = [n for n in recording_notes(rec, stats) if n != "drops: none"]
    stamp = time.localtime(rec.start_time or time.time())
    day = os.path.join(opts.host, time.strftime("%Y-%m-%d", stamp))
    make_day_dirs(opts.dir, day)
    code = 0
    pythons = {p.pid: p.version_str for p in rec.python_images}
    for t in targets:
        part = prof.of_process(t.pid)
        if not part.weights:
            errors.append(f"process {t.pid} ({t.name}) left no samples: it ended before the recording")
            code = EXIT_PARTIAL
            continue
        base = f"{time.strftime('%H%M%S', stamp)}-{t.pid}-{_safe(t.name)}"
        files = {}
        for fmt in opts.formats:
            rel = os.path.join(day, base + EXTENSIONS[fmt])
            title = (f"pyoffcpu snapshot: pid {t.pid} {t.name} on {opts.host} \u2014 {opts.mode} mode, "
                     f"{rec.duration_s:.1f} s, {opts.frequency} Hz")
            try:
                data = _encode(render(part, fmt, title=title))
                write_bytes_atomic(os.path.join(opts.dir, rel), data)
            except OSError as e:
                errors.append(f"cannot write {os.path.join(opts.dir, rel)}: {e.strerror or e}")
                code = EXIT_PARTIAL
                continue
            except Exception as e:                      # noqa: BLE001 - one process's, never the others'
                from ..failures import failure_text
                errors.append(f"process {t.pid} ({t.name}): its {fmt} could not be made ({failure_text(e)})")
                code = EXIT_PARTIAL
                continue
            try:
                inode = os.stat(os.path.join(opts.dir, rel), follow_symlinks=False).st_ino
            except OSError:
                inode = 0
            files[fmt] = {"path": rel, "bytes": len(data), "inode": inode}
        if not files:
            continue
        on = part.total_ns(on_cpu=True)
        off = part.total_ns(on_cpu=False)
        by_reason = part.off_cpu_totals()
        entry = {
            "time": rec.start_time, "host": opts.host, "pid": t.pid, "name": t.name,
            "cmdline": t.cmdline, "python": pythons.get(t.pid, ""), "mode": opts.mode,
            "frequency_hz": opts.frequency, "duration_s": round(rec.duration_s, 3),
            # it ended meanwhile: its exit seen or found (the targets' liveness
            # check), or every thread's last switch-out seen (BPF: TASK_DEAD)
            "gone_at_end": t.pid in rec.gone_pids or all(
                th.exited for th in rec.threads.values() if th.pid == t.pid),
            "on_cpu_ns": on, "off_cpu_ns": off,
            "off_cpu_by_reason_ns": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])),
            "threads": len({k.tid for k in part.weights}),
            "top": [{"where": w, "ns": ns, "on_cpu_ns": o} for w, ns, o in top_functions(part, TOP_FUNCTIONS)],
            "gpu": t.gpu, "files": files,
            "notices": ([n for n in rec.notices if f"process {t.pid}" in n] + notes)[:10],
        }
        index["entries"].append(entry)
        written.append(entry)
    return code


# -- cron and systemd ---------------------------------------------------------------------
def systemd_units(argv: List[str], every_min: int = 15) -> Dict[str, str]:
    """The service and timer that run this snapshot command (argv: the
    pyoffcpu executable and its snapshot arguments) every `every_min`
    minutes: {file name: text}; --print-cron's and the Debian package's."""
    import shlex
    cmd = " ".join(shlex.quote(a) for a in argv)
    return {
        "pyoffcpu-snapshot.service": f"""\
[Unit]
Description=pyoffcpu wall-clock snapshot of the Python processes
Documentation=man:pyoffcpu-snapshot(1)

[Service]
Type=oneshot
ExecStart={cmd}
Nice=10
""",
        "pyoffcpu-snapshot.timer": f"""\
[Unit]
Description=pyoffcpu snapshot every {every_min} minutes
Documentation=man:pyoffcpu-snapshot(1)

[Timer]
OnCalendar=*:0/{every_min}
RandomizedDelaySec=30
Persistent=true

[Install]
WantedBy=timers.target
""",
    }


def schedule_text(argv: List[str], every_min: int = 15) -> str:
    """A crontab line and a systemd service + timer that run this snapshot
    command (argv: the pyoffcpu executable and its snapshot arguments, without
    --print-cron) every `every_min` minutes."""
    import shlex
    cmd = " ".join(shlex.quote(a) for a in argv)
    units = "\n".join(f"# systemd: /etc/systemd/system/{name}\n{text}"
                      for name, text in systemd_units(argv, every_min).items())
    return f"""\
# crontab (root: `sudo crontab -e`), every {every_min} minutes; cron mails what it prints,
# and a snapshot prints only errors:
*/{every_min} * * * * {cmd}

{units}
# then: sudo systemctl daemon-reload && sudo systemctl enable --now pyoffcpu-snapshot.timer
"""
