"""A differential flame graph: what changed between two profiles.

Both profiles' stacks (process and thread roots left out: two recordings do
not share PIDs) are merged into one tree by frame label, each frame with
its time in A and in B.  The graph has B's shape (`shape="a"`: A's); each
frame is coloured by the change of its share of its profile's total,
B% - A%: red where it grew, blue where it shrank, white where it held, the
strongest colour for the largest change in the graph.  Shares, not times:
two recordings of different lengths compare.  The tooltip gives both times
and both shares.
"""
from __future__ import annotations

import gzip
import os
from typing import Dict, Iterator, List, Tuple

from ..profile.model import FrameKind, Profile, from_folded
from .svg import SEP, _Node, fmt_time, render_tree


class DiffNode(_Node):
    __slots__ = ("a", "b")

    def __init__(self, label: str, kind: FrameKind):
        super().__init__(label, kind)
        self.a = 0
        self.b = 0


def read_profile(path: str) -> Profile:
    """A profile from a file pyoffcpu writes and reads: folded text (.folded,
    .txt) or pprof (gzipped or not).  Raises ValueError for anything else."""
    from .pprof import max_input_bytes
    limit = max_input_bytes()
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: over {limit >> 20} MiB (PYOFFCPU_MAX_INPUT_MB)")
    name = os.path.basename(path).lower()
    if data[:2] == b"\x1f\x8b" or name.endswith((".pb.gz", ".pprof", ".pb")):
        from .pprof import from_pprof
        try:
            return from_pprof(data)
        except (ValueError, IndexError, EOFError, OSError, gzip.BadGzipFile, KeyError, TypeError,
                OverflowError, RecursionError) as e:
            raise ValueError(f"{path}: not a pprof profile ({e})") from None
    if name.endswith(".json") or data[:1] in (b"{", b"<"):
        raise ValueError(f"{path}: speedscope and SVG files cannot be read back; "
                         "compare folded (.folded) or pprof (.pb.gz) files")
    try:
        return from_folded(data.decode("utf-8", "surrogateescape"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _stacks(profile: Profile, full_paths: bool) -> Iterator[Tuple[List[Tuple[str, FrameKind]], int]]:
    for frames, ns, _on in profile.labelled_stacks(threads=False, full_paths=full_paths):
        yield frames[1:], ns                # without the process root


def diff_tree(a: Profile, b: Profile, shape: str = "b", full_paths: bool = False) -> DiffNode:
    """The merged tree: every node's a and b ns; `total` the shape's."""
    root = DiffNode("all", FrameKind.MARKER)
    for prof, side in ((a, "a"), (b, "b")):
        for frames, ns in _stacks(prof, full_paths):
            node = root
            setattr(node, side, getattr(node, side) + ns)
            for label, kind in frames:
                child = node.children.get(label)
                if child is None:
                    child = node.children[label] = DiffNode(label, kind)
                setattr(child, side, getattr(child, side) + ns)
                node = child
    todo = [root]
    while todo:
        node = todo.pop()
        node.total = node.b if shape == "b" else node.a
        todo.extend(node.children.values())
    return root


def changes(root: DiffNode) -> Dict[int, float]:
    """id(node) -> B share - A share (fractions of each side's total)."""
    ta, tb = root.a or 1, root.b or 1
    out = {}
    todo = [root]
    while todo:
        node = todo.pop()
        out[id(node)] = node.b / tb - node.a / ta
        todo.extend(node.children.values())
    return out


def diff_colour(change: float, largest: float) -> str:
    """Red for a share that grew, blue for one that shrank, white for none."""
    if largest <= 0 or change == 0:
        return "rgb(250,250,250)"
    v = min(1.0, abs(change) / largest)
    fade = int(250 - 200 * v)
    return f"rgb(250,{fade},{fade})" if change > 0 else f"rgb({fade},{fade},250)"


def render_diff(a: Profile, b: Profile, title: str, shape: str = "b", full_paths: bool = False) -> str:
    root = diff_tree(a, b, shape, full_paths)
    delta = changes(root)
    largest = max((abs(d) for d in delta.values()), default=0.0)
    ta, tb = root.a, root.b

    def pct(ns, total):
        return 100.0 * ns / total if total else 0.0

    def tip(node, _total):
        d = 100.0 * delta[id(node)]
        return (f"{node.label}{SEP}A {fmt_time(node.a)} ({pct(node.a, ta):.1f}%), "
                f"B {fmt_time(node.b)} ({pct(node.b, tb):.1f}%), {d:+.1f} points")
    sub = (f"A {fmt_time(ta)}, B {fmt_time(tb)}: the frames have {shape.upper()}'s widths; "
           "red: a larger share of B than of A, blue: a smaller one")
    return render_tree(root, title, sub, lambda node: diff_colour(delta[id(node)], largest), tip)


def largest_changes(a: Profile, b: Profile, n: int = 5, full_paths: bool = False
                    ) -> List[Tuple[float, str]]:
    """The frames whose share changed most, as (points, `frame` or
    `parent;frame` path shown from its innermost named frames)."""
    root = diff_tree(a, b, "b", full_paths)
    delta = changes(root)
    rows: List[Tuple[float, str]] = []
    todo: List[Tuple[DiffNode, Tuple[str, ...]]] = [(c, (c.label,)) for c in root.children.values()]
    while todo:
        node, path = todo.pop()
        # a frame's own change: its children's changes are theirs
        own = delta[id(node)] - sum(delta[id(c)] for c in node.children.values())
        if abs(own) >= 0.0005:          # 0.05 points: shown as 0.0 below that
            rows.append((100.0 * own, ";".join(path[-2:])))
        todo.extend((c, path + (c.label,)) for c in node.children.values())
    rows.sort(key=lambda r: -abs(r[0]))
    return rows[:n]
