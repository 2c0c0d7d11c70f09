"""Sampled waits: from the keys BPF keeps to one weight per stack.

With `--off-cpu sampled` (the default) BPF times every wait exactly but
takes a wait's stack only as often as a wall-clock sampler with period
T = 1/F would see it (threshold sampling, bpf/pyoffcpu.bpf.c sampled_close):
- a wait of d >= T always, under its own key at its exact d;
- a shorter one with probability d/T, under a key marked KIND_SAMPLED at
  weight T; and its d, sampled or not, goes to its thread's KIND_SHORT key
  of that kind (state and system call): the exact total of the short waits.

resolve() splits each thread's exact short-wait total, kind by kind, over
the stacks sampled for it, in proportion to their weights (a ratio
estimator, as the on-CPU samples split a thread's exact on-CPU time), so
every thread's on-CPU, off-CPU and per-kind totals stay exact to the
nanosecond and only the split over stacks is an estimate.  A kind whose
short waits got no sample keeps its total without a stack
([short waits, none sampled]).  The error to expect: docs/offcpu-sampling.md.

`--off-cpu exact` keys carry no flag and pass as they are.  PYOFFCPU_OFFCPU=
shadow (tests) records both ways at once: the sampled path's keys carry
KIND_SHADOW, and `view` picks which of the two a profile is made from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from ..kernel import bpfdefs
from ..collect.recording import SHORT_WAITS, accumulate

KIND_SAMPLED = bpfdefs.value("KIND_SAMPLED")
KIND_SHORT = bpfdefs.value("KIND_SHORT")
KIND_SHADOW = bpfdefs.value("KIND_SHADOW")
KIND_FLAGS = bpfdefs.value("KIND_FLAGS")
_BASE = (1 << bpfdefs.GIL_SHIFT) - 1        # the state and the system call: a bucket


@dataclass
class WaitCounts:
    """How a profile's waits got their stacks (the summary's line)."""
    offcpu: str = "exact"           # "exact" or "sampled"
    period_ns: int = 0              # T of the sampling
    exact: int = 0                  # waits under their own stack at their exact duration
    short: int = 0                  # waits shorter than T (sampled)
    sampled: int = 0                # ... whose stack was taken


def resolve(stacks: Dict[tuple, List[int]], wakes: Dict[tuple, List[int]], offcpu: str,
            period_ns: int, view: str = "exact") -> Tuple[Dict[tuple, List[int]], Dict[tuple, List[int]],
                                                          WaitCounts]:
    """(stacks, wakes, counts) with every key's flags resolved (see the
    module's doc): the input dicts (rec.stacks, rec.wakes) are left as they
    are.  view ("exact" or "sampled") matters for a shadow recording only."""
    counts = WaitCounts("exact" if offcpu == "exact" or (offcpu == "shadow" and view == "exact")
                        else "sampled", period_ns)
    out: Dict[tuple, List[int]] = {}
    # (tgid, tid, state and system call) -> [short waits, their exact ns, sampled keys]
    buckets: Dict[tuple, list] = {}
    scale: Dict[tuple, Tuple[int, int]] = {}   # a sampled key -> (its share, its weight)
    for key, (count, ns) in stacks.items():
        kind = key[5]
        flags = kind & KIND_FLAGS
        on_cpu = bpfdefs.on_cpu(kind)
        if offcpu == "shadow" and not on_cpu and bool(flags & KIND_SHADOW) != (view == "sampled"):
            continue                    # the other view's
        if not flags & (KIND_SAMPLED | KIND_SHORT):
            accumulate(out, key[:5] + (kind & ~KIND_FLAGS,), count, ns)
            if not on_cpu:
                counts.exact += count
            continue
        b = buckets.get((key[0], key[1], kind & _BASE))
        if b is None:
            b = buckets[(key[0], key[1], kind & _BASE)] = [0, 0, []]
        if flags & KIND_SHORT:
            b[0] += count
            b[1] += ns
        else:
            b[2].append((key, count, ns))
    for (tgid, tid, base), (n_short, total, sampled) in buckets.items():
        counts.short += n_short
        counts.sampled += sum(c for _k, c, _ns in sampled)
        weight = sum(ns for _k, _c, ns in sampled)
        if weight <= 0:
            if total > 0:               # no stack was sampled: the total stays, stackless
                accumulate(out, (tgid, tid, SHORT_WAITS, -1, 0, base), n_short, total)
            continue
        left = total
        for i, (key, count, ns) in enumerate(sampled):
            share = left if i == len(sampled) - 1 else ns * total // weight
            left -= share
            scale[key] = (share, ns)
            accumulate(out, key[:5] + (key[5] & ~KIND_FLAGS,), count, share)
    out_wakes: Dict[tuple, List[int]] = {}
    for (wait, waker), (count, ns) in wakes.items():
        flags = wait[5] & KIND_FLAGS
        if offcpu == "shadow" and bool(flags & KIND_SHADOW) != (view == "sampled"):
            continue
        if flags & KIND_SAMPLED:
            share, weight = scale.get(wait, (0, 1))
            ns = ns * share // weight if weight else 0
        accumulate(out_wakes, (wait[:5] + (wait[5] & ~KIND_FLAGS,), waker), count, ns)
    return out, out_wakes, counts

