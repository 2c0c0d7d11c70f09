"""The pure parts of the bench: statistics, folded-stack parsing, tables.

Nothing here needs root, BPF or a profiler; tests/test_bench_harness.py
exercises it in well under a second.
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple


# -- statistics ---------------------------------------------------------------
def median(values: Sequence[float]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


@dataclass
class Pairs:
    """A/B pairs of one measurement: A alone (baseline), B under a profiler.
    Each pair's ratio is B/A; the spread of the ratios is the noise."""
    a: List[float] = field(default_factory=list)
    b: List[float] = field(default_factory=list)
    # optional companions of each pair: CPU seconds of the target, seconds it waited for a CPU
    cpu_a: List[float] = field(default_factory=list)
    cpu_b: List[float] = field(default_factory=list)
    wait_a: List[float] = field(default_factory=list)
    wait_b: List[float] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)

    def add(self, a: float, b: float, cpu: Optional[Tuple[float, float]] = None,
            wait: Optional[Tuple[float, float]] = None) -> None:
        if a <= 0 or b <= 0:
            raise ValueError(f"times must be positive: a={a} b={b}")
        self.a.append(a)
        self.b.append(b)
        if cpu and cpu[0] > 0 and cpu[1] > 0:
            self.cpu_a.append(cpu[0])
            self.cpu_b.append(cpu[1])
        if wait:
            self.wait_a.append(wait[0] / a)
            self.wait_b.append(wait[1] / b)

    @property
    def ratios(self) -> List[float]:
        return [b / a for a, b in zip(self.a, self.b)]

    @property
    def cpu_ratios(self) -> List[float]:
        return [b / a for a, b in zip(self.cpu_a, self.cpu_b)]

    def summary(self) -> Dict[str, Optional[float]]:
        r, c = self.ratios, self.cpu_ratios
        return {
            "n": len(r),
            "a_median": median(self.a),
            "b_median": median(self.b),
            "ratio_median": median(r),
            "ratio_min": min(r) if r else None,
            "ratio_max": max(r) if r else None,
            "cpu_ratio_median": median(c),
            "cpu_ratio_min": min(c) if c else None,
            "cpu_ratio_max": max(c) if c else None,
            "wait_a": median(self.wait_a),       # share of the run spent waiting for a CPU
            "wait_b": median(self.wait_b),
        }


def spread(values: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
    """n, median, min and max of the values that are not None (None for each
    of the last three when there are none)."""
    vals = [v for v in values if v is not None]
    return {"n": len(vals), "median": median(vals), "min": min(vals) if vals else None,
            "max": max(vals) if vals else None}


def loss(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """The fraction of `base` that `value` falls short of it (1 - value/base;
    negative when value is larger); None without both or with base <= 0."""
    if value is None or base is None or base <= 0:
        return None
    return 1.0 - value / base


def per_round_losses(rounds: Sequence[Dict[str, float]], base: str, label: str) -> List[float]:
    """Of rounds ({configuration: value} each), the loss of `label` against
    `base` in every round that has both."""
    out = []
    for r in rounds:
        x = loss(r.get(label), r.get(base))
        if x is not None:
            out.append(x)
    return out


def rotated(items: Sequence, i: int) -> list:
    """items rotated left by i (round i of a rotating order)."""
    if not items:
        return []
    k = i % len(items)
    return list(items[k:]) + list(items[:k])


def verdict(value: Optional[float], limit: Optional[float]) -> str:
    """PASS/MISS of `value <= limit`; an em dash where there is no target, n/a without a value."""
    if limit is None:
        return "—"
    if value is None:
        return "n/a"
    return "PASS" if value <= limit else "MISS"


# -- number formatting ----------------------------------------------------------
def fmt_num(v: Optional[float], digits: int = 3) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}"


def fmt_ratio_range(lo: Optional[float], hi: Optional[float]) -> str:
    if lo is None or hi is None:
        return "n/a"
    return f"{lo:.3f}–{hi:.3f}"


def fmt_range(lo: Optional[float], hi: Optional[float], digits: int = 2) -> str:
    """lo–hi with `digits` decimals, n/a without both."""
    if lo is None or hi is None:
        return "n/a"
    return f"{lo:.{digits}f}–{hi:.{digits}f}"


def fmt_pct(frac: Optional[float], digits: int = 1) -> str:
    """A fraction as a signed percentage (0.031 -> +3.1%), n/a for None."""
    if frac is None:
        return "n/a"
    return f"{100 * frac:+.{digits}f}%"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    return f"{n / (1 << 20):.0f} MiB"


# -- Markdown tables ------------------------------------------------------------
def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]],
                   align: Optional[str] = None) -> str:
    """A Markdown table with padded columns. `align` has one letter per column,
    l or r (default: first column left, the others right)."""
    headers = [str(h) for h in headers]
    body = [["" if c is None else str(c) for c in row] for row in rows]
    ncol = len(headers)
    for row in body:
        if len(row) != ncol:
            raise ValueError(f"row has {len(row)} cells, table has {ncol} columns: {row}")
    if align is None:
        align = "l" + "r" * (ncol - 1)
    if len(align) != ncol:
        raise ValueError("align needs one letter per column")
    widths = [max([len(headers[i])] + [len(r[i]) for r in body] + [3]) for i in range(ncol)]

    def cell(text: str, i: int) -> str:
        return text.rjust(widths[i]) if align[i] == "r" else text.ljust(widths[i])

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell(c, i) for i, c in enumerate(cells)) + " |"

    sep = "|" + "|".join(("-" * (widths[i] + 1) + ":") if align[i] == "r" else ("-" * (widths[i] + 2))
                         for i in range(ncol)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in body])


# -- folded stacks ----------------------------------------------------------------
_FUNC = re.compile(r"^(?P<name>.*?) \((?P<loc>[^()]*)\)$")


def parse_folded(text: str) -> List[Tuple[List[str], int]]:
    """Folded lines `A;B;C WEIGHT` into (frames root first, weight). Works for
    pyoffcpu's folded output (weights in microseconds) and for py-spy's
    `-f raw` output (weights in samples; with --threads its root frame is
    `thread (TID): NAME`). Blank lines are skipped; any other malformed line
    raises ValueError."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        stack, sep, weight = line.rpartition(" ")
        if not sep or not stack or not weight.isdigit():
            raise ValueError(f"line {n}: not a folded stack: {line[:80]!r}")
        out.append((stack.split(";"), int(weight)))
    return out


def function_name(frame: str) -> str:
    """`qualname (file:line)` -> `qualname`; other frames as they are."""
    m = _FUNC.match(frame)
    return m.group("name") if m else frame


def function_shares(stacks: Sequence[Tuple[List[str], int]], scope: str,
                    functions: Sequence[str]) -> Tuple[Dict[str, float], int]:
    """Among the stacks that pass through the function `scope` (a thread's loop),
    each function's share of the weight (inclusive: a stack counts for a
    function if the function is anywhere on it). Returns (shares in [0, 1],
    total weight in scope)."""
    total = 0
    acc = {f: 0 for f in functions}
    for frames, w in stacks:
        names = {function_name(f) for f in frames}
        if scope not in names:
            continue
        total += w
        for f in functions:
            if f in names:
                acc[f] += w
    if total == 0:
        return {f: 0.0 for f in functions}, 0
    return {f: acc[f] / total for f in functions}, total


def max_error_pp(measured: Dict[str, float], truth: Dict[str, float]) -> float:
    """Largest absolute difference in percentage points over truth's functions."""
    return max(abs(measured.get(f, 0.0) - t) * 100 for f, t in truth.items())


# -- BPF run-time statistics --------------------------------------------------------
def maps_memlock(fdinfos: Iterable[str]) -> Tuple[int, int]:
    """(maps, bytes) over the /proc/PID/fdinfo texts of a process's bpf-map
    fds: the sum of their `memlock` (the kernel's memory of the map), each
    map counted once (by map_id) however many fds hold it."""
    seen = {}
    for text in fdinfos:
        d = parse_fdinfo(text)
        if "memlock" not in d:
            continue
        key = d.get("map_id") or f"fd{len(seen)}"
        try:
            seen[key] = int(d["memlock"])
        except ValueError:
            continue
    return len(seen), sum(seen.values())


def parse_fdinfo(text: str) -> Dict[str, str]:
    """/proc/PID/fdinfo/FD as a dict of its `key:\tvalue` lines."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def prog_delta(before: Dict[str, Tuple[int, int]], after: Dict[str, Tuple[int, int]]
               ) -> Dict[str, Tuple[int, int]]:
    """Per program name, (run_cnt, run_time_ns) gained between two readings."""
    out = {}
    for name, (cnt, ns) in after.items():
        c0, n0 = before.get(name, (0, 0))
        out[name] = (cnt - c0, ns - n0)
    return out


def prog_label(name: str) -> str:
    """A BPF program's name (the kernel keeps 15 characters) as the table shows it."""
    if name.startswith("sched__sched_sw"):
        return "sched_switch (tracepoint)"
    if name.startswith("raw_tracepoint") or name == "sched_switch":
        return "sched_switch (raw tracepoint)"
    if name == "on_cpu_sample":
        return "on_cpu_sample (perf_event)"
    if name.startswith("sched_proc_"):
        return f"sched_process_{name[len('sched_proc_'):]} (raw tracepoint)"
    return name


# -- long runs (case 9) ----------------------------------------------------------------
def proc_status_kib(text: str, key: str) -> Optional[int]:
    """A `Key:   1234 kB` field of /proc/PID/status in KiB (or the bare number, as
    for Threads), None if absent."""
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep and k == key:
            parts = v.split()
            if parts and parts[0].isdigit():
                return int(parts[0])
    return None


def proc_stat_cpu_ticks(text: str) -> int:
    """utime + stime (clock ticks) from /proc/PID/stat; the command name in
    parentheses may hold spaces and parentheses itself."""
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])        # fields 14 and 15 of the line


def proc_stat_tree_ticks(text: str) -> Tuple[int, int]:
    """(ppid, utime + stime + cutime + cstime) from /proc/PID/stat: a
    process's CPU with that of its children it has waited for."""
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), sum(int(f) for f in fields[11:15])   # fields 4, 14-17 of the line


def parse_stats_lines(text: str) -> List[dict]:
    """The JSON lines pyoffcpu appends to PYOFFCPU_STATS_FILE, oldest first.
    A line that is not a JSON object with a numeric `t` (the last one may be
    half written) is skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and isinstance(d.get("t"), (int, float)):
            out.append(d)
    return out


def latest_before(records: Sequence[dict], t: float) -> Optional[dict]:
    """The last record with record["t"] <= t, None if there is none."""
    best = None
    for r in records:
        if r["t"] <= t and (best is None or r["t"] >= best["t"]):
            best = r
    return best


def checkpoints(duration: float, first: float = 10.0, every: float = 60.0,
                margin: float = 2.0) -> List[float]:
    """Seconds into the recording at which a long run takes its full readings:
    at `first`, every `every` seconds, and once more `margin` seconds before the
    end (a reading at the very end would race the profiler's own stop). Every
    checkpoint is at least `margin` before the end."""
    end = duration - margin
    pts = [first] if first <= end else []
    t = every
    while t <= end:
        if t > first:
            pts.append(t)
        t += every
    if end > 0 and (not pts or end - pts[-1] >= margin):
        pts.append(round(end, 3))
    return pts


def rss_growth(samples: Sequence[Tuple[float, float]], after: float = 60.0,
               tolerance: float = 5.0) -> Optional[float]:
    """Growth after the first minute: the largest value at t >= `after` minus the
    value of the first sample at or after `after` (within `tolerance` s of it).
    None when the run has no such sample or nothing after it."""
    base = None
    for t, v in samples:
        if t >= after - 1e-9:
            base = (t, v)
            break
    if base is None or base[0] > after + tolerance:
        return None
    later = [v for t, v in samples if t > base[0]]
    if not later:
        return None
    return max(later) - base[1]


def linear_slope(points: Sequence[Tuple[float, float]]) -> Optional[float]:
    """Least-squares slope dy/dx of (x, y) points; None with fewer than two distinct x."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def folded_summary(lines: Iterable[str]) -> Dict[str, int]:
    """Lines of a folded file, and how many distinct thread roots (second frame
    `thread ...`) and process roots (first frame) they hold."""
    n = 0
    threads, procs = set(), set()
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        n += 1
        frames = line.rpartition(" ")[0].split(";", 2)
        procs.add(frames[0])
        if len(frames) > 1 and frames[1].startswith("thread "):
            threads.add((frames[0], frames[1]))
    return {"lines": n, "threads": len(threads), "processes": len(procs)}


def parse_drops_line(line: str) -> Optional[Dict[str, int]]:
    """pyoffcpu's last words on drops, `pyoffcpu: drops: NAME N, NAME N` or
    `pyoffcpu: drops: none`, as a dict; None if `line` is not that line."""
    prefix = "pyoffcpu: drops:"
    if not line.startswith(prefix):
        return None
    rest = line[len(prefix):].strip()
    if rest == "none" or not rest:
        return {}
    out = {}
    for part in rest.split(", "):
        name, _, n = part.rpartition(" ")
        if name and n.isdigit():
            out[name] = int(n)
    return out


_DROP_DEFINE = re.compile(r"^\s*#define\s+DROP_(\w+)\s+(\d+)\b(?:\s*/\*\s*(.*?)\s*\*/)?", re.M)


def parse_drop_defines(header: str) -> Dict[int, str]:
    """{index: name} of the `#define DROP_NAME index` lines of a BPF header
    (names lower-case, underscores as spaces: DROP_AGG_FULL -> "agg full")."""
    return {int(m.group(2)): m.group(1).lower().replace("_", " ") for m in _DROP_DEFINE.finditer(header)}


def fmt_clock(seconds: float) -> str:
    """Seconds as m:ss (a long run's checkpoints)."""
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}"


def counts_by_checkpoint(readings: Sequence[Dict[str, int]]) -> List[Tuple[str, List[Optional[int]]]]:
    """Readings (one {name: count} per checkpoint) as rows: each name seen in
    any reading, in first-seen order, with its count at each checkpoint (None
    where that reading lacks it)."""
    names: List[str] = []
    for r in readings:
        for k in r:
            if k not in names:
                names.append(k)
    return [(k, [r.get(k) for r in readings]) for k in names]
