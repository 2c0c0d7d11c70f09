"""speedscope JSON (https://www.speedscope.app/file-format-schema.json).

One "sampled" profile per thread (or per process with threads=False), weights
in nanoseconds.  The process/thread root frames of the folded contract become
the profile's name instead of frames; the `[off-cpu]` marker stays as the leaf
frame of off-CPU samples.
"""
from __future__ import annotations

import json
import re
from typing import Dict, List, Tuple

from ..profile.model import FrameKind, Profile

SCHEMA = "https://www.speedscope.app/file-format-schema.json"
EXPORTER = "pyoffcpu"

_PROC = re.compile(r"^process (\d+)(?: |$)")
_THREAD = re.compile(r"^thread (-?\d+)(?: |$)")
_PY = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*):(?P<line>\d+|\?)\)$")


def _frame_json(label: str, kind: FrameKind) -> dict:
    if kind is FrameKind.PYTHON:
        m = _PY.match(label)
        if m:
            fr = {"name": m.group("name"), "file": m.group("file")}
            if m.group("line") != "?":
                fr["line"] = int(m.group("line"))
            return fr
    return {"name": label}


def speedscope_document(profile: Profile, threads: bool = True,
                        full_paths: bool = False, name: str = "") -> dict:
    frame_index: Dict[Tuple[str, FrameKind], int] = {}
    frames: List[dict] = []
    # (pid, tid or None) -> {tuple of frame indexes: ns}
    groups: Dict[Tuple[int, object], Dict[Tuple[int, ...], int]] = {}

    n_roots = 2 if threads else 1
    for stack, ns, _on_cpu in profile.labelled_stacks(threads=threads, full_paths=full_paths):
        m = _PROC.match(stack[0][0])
        pid = int(m.group(1)) if m else 0
        tid = None
        if threads:
            m = _THREAD.match(stack[1][0])
            tid = int(m.group(1)) if m else _group_tid(profile, pid, stack[1][0])
        idx = []
        for fr in stack[n_roots:]:
            i = frame_index.get(fr)
            if i is None:
                i = frame_index[fr] = len(frames)
                frames.append(_frame_json(*fr))
            idx.append(i)
        samples = groups.setdefault((pid, tid), {})
        key = tuple(idx)
        samples[key] = samples.get(key, 0) + ns

    profiles = []
    for (pid, tid) in sorted(groups, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        comm = profile.processes.get(pid, "?")
        if tid is None:
            pname = f"{comm} (pid {pid})"
        elif tid < 0:
            pname = f"{profile.thread_root(tid)} in {comm} (pid {pid})"
        else:
            pname = f"{profile.threads.get(tid, '?')} (tid {tid}) in {comm} (pid {pid})"
        samples = groups[(pid, tid)]
        order = list(samples)      # insertion order follows labelled_stacks' sorted order
        weights = [samples[s] for s in order]
        profiles.append({
            "type": "sampled",
            "name": pname,
            "unit": "nanoseconds",
            "startValue": 0,
            "endValue": sum(weights),
            "samples": [list(s) for s in order],
            "weights": weights,
        })

    return {
        "$schema": SCHEMA,
        "version": "0.0.1",
        "exporter": EXPORTER,
        "name": name or _default_name(profile),
        "activeProfileIndex": 0,
        "shared": {"frames": frames},
        "profiles": profiles,
        "pyoffcpu": metadata(profile),
    }


def metadata(profile: Profile) -> dict:
    """What the graph cannot show, for scripts: the recording's exact length,
    and per thread its exact times and raw sample count (speedscope itself
    ignores keys it does not know)."""
    meta = profile.meta
    threads = []
    why = profile.off_cpu_by_reason()
    for tid in sorted(profile.thread_info, key=lambda t: (profile.thread_info[t].pid, t)):
        t = profile.thread_info[tid]
        threads.append({"pid": t.pid, "tid": t.tid, "name": t.name, "root": t.root_label(),
                        "on_cpu_ns": t.on_cpu_ns, "off_cpu_ns": t.off_cpu_ns,
                        "off_cpu_by_reason_ns": dict(sorted(why.get(tid, {}).items())),
                        "samples": t.samples, "first_ns": t.first_ns, "last_ns": t.last_ns,
                        "threads": t.threads, "entry": t.entry, "ns_tid": t.ns_tid})
        if tid in profile.gil:
            threads[-1]["gil_ns"] = profile.gil[tid].as_dict()
    return {"duration_ns": meta.duration_ns, "mode": meta.mode, "frequency_hz": meta.frequency_hz,
            "on_cpu_measure": "switch timestamps" if meta.exact_on_cpu else "samples",
            "python_version": meta.python_version, "target": meta.target,
            "drops": dict(meta.drops), "drops_ns": dict(meta.drops_ns), "threads": threads,
            "wakes": [dict(w.__dict__, ns=ns) for w, ns in
                      sorted(profile.wakes.items(), key=lambda kv: (-kv[1], kv[0].tid))],
            "ns_pids": {str(p): n for p, n in sorted(profile.ns_ids.items())
                        if p in profile.processes}}


def _group_tid(profile: Profile, pid: int, root: str) -> int:
    """The tid (< 0) of a group root (`threads N ended ...`)."""
    for tid, info in profile.thread_info.items():
        if info.pid == pid and info.root_label() == root:
            return tid
    return pid


def _default_name(profile: Profile) -> str:
    meta = profile.meta
    target = meta.target or ", ".join(f"pid {p} {c}" for p, c in sorted(profile.processes.items()))
    return f"pyoffcpu: {target} ({meta.mode} mode)" if target else f"pyoffcpu ({meta.mode} mode)"


def render_speedscope(profile: Profile, threads: bool = True, full_paths: bool = False) -> str:
    doc = speedscope_document(profile, threads=threads, full_paths=full_paths)
    return json.dumps(doc, ensure_ascii=True, separators=(",", ":")) + "\n"
