"""A self-contained interactive flame graph (SVG + inline JavaScript).

Root at the bottom.  Stacks are merged into a tree by frame label; a frame's
width is proportional to its weight (wall time).  Frames narrower than
MIN_FRACTION of the whole are not drawn, but their weight stays in their
parent.  Each drawn frame is a <g class="f" data-o=OFFSET data-w=WEIGHT> with
a <title> tooltip, a <rect> and a <text>; OFFSET and WEIGHT are integers in
nanoseconds, which the script uses to zoom and to add up search matches
exactly.

Click a frame to zoom into it; "Reset zoom" (or Escape) zooms out.  "Search"
(or Ctrl-F) asks for a regular expression, paints matching frames magenta and
shows the share of all time they cover; the root <svg> gets
data-matched="NN.N".  Opening the file with `#search=<urlencoded regex>`
runs that search on load.
"""
from __future__ import annotations

import gc
import re
import zlib
from typing import Callable, Dict, List, Optional, Tuple

from ..profile.model import FrameKind, Profile, is_task_wait

WIDTH = 1200
XPAD = 10
FRAME_H = 16
FONT_SIZE = 12
CHAR_W = FONT_SIZE * 0.59          # average Verdana glyph width at FONT_SIZE
TOP = 70                           # title, subtitle, controls
BOTTOM = 34                        # details line
MIN_FRACTION = 0.001               # frames below 0.1% of the total are not drawn
MATCH_FILL = "rgb(230,0,230)"
SEP = " \u2014 "                  # between label and numbers in tooltips

_INVALID_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_PY_LINE = re.compile(r":(?:\d+|\?)\)$")


def xml_escape(s: str) -> str:
    """Escape for XML text and attribute values; characters XML cannot carry
    at all (control characters, lone surrogates) become U+FFFD."""
    s = _INVALID_XML.sub("\ufffd", s)
    return (s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;"))


# -- the frame tree -----------------------------------------------------------
class _Node:
    __slots__ = ("label", "kind", "total", "on", "off", "children")

    def __init__(self, label: str, kind: FrameKind):
        self.label = label
        self.kind = kind
        self.total = 0
        self.on = 0
        self.off = 0
        self.children: Dict[str, "_Node"] = {}


def build_tree(profile: Profile, threads: bool = True, full_paths: bool = False) -> _Node:
    """Merge the profile's stacks into a tree of frames by label, under "all"."""
    # Hundreds of thousands of small objects, none cyclic: the cyclic GC would
    # only rescan them again and again.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_tree(profile, threads, full_paths)
    finally:
        if was_enabled:
            gc.enable()


def _build_tree(profile: Profile, threads: bool, full_paths: bool) -> _Node:
    root = _Node("all", FrameKind.MARKER)
    for frames, ns, on_cpu in profile.labelled_stacks(threads=threads, full_paths=full_paths):
        node = root
        node.total += ns
        if on_cpu:
            node.on += ns
        else:
            node.off += ns
        for label, kind in frames:
            children = node.children
            child = children.get(label)
            if child is None:
                child = children[label] = _Node(label, kind)
            child.total += ns
            if on_cpu:
                child.on += ns
            else:
                child.off += ns
            node = child
    return root


# -- colours ------------------------------------------------------------------
def _hash3(name: str) -> Tuple[float, float, float]:
    h = zlib.crc32(name.encode("utf-8", "surrogatepass"))
    # mix so that similar names still spread
    h = (h * 2654435761) & 0xFFFFFFFF
    return ((h & 0xFF) / 255.0, ((h >> 8) & 0xFF) / 255.0, ((h >> 16) & 0xFF) / 255.0)


def _rgb(r: float, g: float, b: float) -> str:
    return f"rgb({int(r)},{int(g)},{int(b)})"


def is_off_cpu_marker(label: str, kind: FrameKind) -> bool:
    """[off-cpu: REASON], and --async's [await: KIND] / [ready] / [suspended]."""
    return kind is FrameKind.MARKER and label.startswith("[") and (
        label.startswith("[off-cpu") or is_task_wait(label[1:-1]))


def frame_colour(label: str, kind: FrameKind, on_ns: int, off_ns: int) -> str:
    """Deterministic colour for a frame: warm hues by kind for on-CPU time,
    blues when all of the frame's time is off-CPU, greys for roots, violets
    for --wakers' waker part (after `--`)."""
    name = _PY_LINE.sub(")", label) if kind is FrameKind.PYTHON else label
    a, b, c = _hash3(name)
    if kind is FrameKind.WAKER:                 # --wakers: `--` and the waker's frames
        return _rgb(150 + 45 * a, 110 + 40 * b, 205 + 45 * c)          # violets
    if is_off_cpu_marker(label, kind) or (on_ns == 0 and off_ns > 0 and kind is not FrameKind.MARKER):
        return _rgb(40 + 60 * a, 110 + 70 * b, 205 + 50 * c)          # blues
    if kind is FrameKind.MARKER:
        v = 175 + 35 * a
        return _rgb(v, v, v + 5 * b)                                   # greys
    if kind is FrameKind.PYTHON:
        return _rgb(235 + 20 * a, 155 + 75 * b, 20 + 50 * c)           # yellow / orange
    if kind is FrameKind.KERNEL:
        return _rgb(165 + 40 * a, 95 + 45 * b, 35 + 35 * c)            # orange-brown
    return _rgb(205 + 50 * a, 45 + 65 * b, 35 + 40 * c)                # native: red / orange-red


# -- text ---------------------------------------------------------------------
def fmt_time(ns: int) -> str:
    if ns >= 1_000_000_000:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    if ns >= 1_000:
        return f"{ns / 1e3:.0f} \u00b5s"
    return f"{ns} ns"


def fit_text(label: str, width: float) -> str:
    """The label as it fits in a frame `width` px wide (same rule as the script)."""
    n = int((width - 6) / CHAR_W)
    if n < 3:
        return ""
    if len(label) <= n:
        return label
    return label[:n - 2] + ".."


def default_title(profile: Profile) -> str:
    meta = profile.meta
    target = meta.target
    if not target:
        target = ", ".join(f"pid {p} {c}" for p, c in sorted(profile.processes.items()))
    elif len(profile.processes) == 1:
        (pid, comm), = profile.processes.items()
        if target == f"pid {pid}" and comm:
            target = f"{target} {comm}"
    parts = [f"{meta.mode} mode"]
    if meta.duration_s and meta.duration_s > 0:
        parts.append(f"{meta.duration_s:.1f} s")
    if meta.frequency_hz:
        parts.append(f"{meta.frequency_hz} Hz")
    head = f"pyoffcpu: {target}" if target else "pyoffcpu"
    return f"{head} \u2014 {', '.join(parts)}"


def _subtitle(profile: Profile) -> str:
    meta = profile.meta
    bits = []
    if meta.python_version:
        bits.append(f"Python {meta.python_version}")
    dropped = sum(v for v in meta.drops.values() if v)
    if dropped:
        bits.append(f"{dropped} events dropped")
    bits.extend(meta.notices[:2])
    return " \u00b7 ".join(bits)


# -- rendering ----------------------------------------------------------------
def render_svg(profile: Profile, threads: bool = True, full_paths: bool = False,
               title: Optional[str] = None) -> str:
    root = build_tree(profile, threads=threads, full_paths=full_paths)
    if title is None:
        title = default_title(profile)

    def tip(node, total):
        pct = 100.0 * node.total / total
        return (f"{node.label}{SEP}{fmt_time(node.total)} ({pct:.1f}%), "
                f"on-CPU {fmt_time(node.on)} / off-CPU {fmt_time(node.off)}")
    return render_tree(root, title, _subtitle(profile),
                       lambda node: frame_colour(node.label, node.kind, node.on, node.off), tip)


def render_tree(root: _Node, title: str, sub: str, fill: Callable[[_Node], str],
                tip: Callable[[_Node, int], str]) -> str:
    """The SVG of a frame tree: each frame `fill(node)`, with the tooltip
    `tip(node, total)` (render_svg's, and the differential graph's)."""
    total = root.total

    # Lay the tree out: (node, depth, offset ns), parents before children.
    laid: List[Tuple[_Node, int, int]] = []
    max_depth = 0
    if total > 0:
        threshold = total * MIN_FRACTION
        stack = [(root, 0, 0)]
        while stack:
            node, depth, off = stack.pop()
            laid.append((node, depth, off))
            if depth > max_depth:
                max_depth = depth
            cur = off
            children = node.children
            for label in sorted(children):
                ch = children[label]
                if ch.total >= threshold:
                    stack.append((ch, depth + 1, cur))
                cur += ch.total

    height = TOP + (max_depth + 1) * FRAME_H + BOTTOM
    scale = (WIDTH - 2 * XPAD) / total if total else 0.0
    out: List[str] = []
    w = out.append
    w('<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n')
    w(f'<svg version="1.1" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
      f'viewBox="0 0 {WIDTH} {height}" data-total="{total}">\n')
    w('<defs><linearGradient id="bg" x1="0" y1="0" x2="0" y2="1">'
      '<stop offset="5%" stop-color="#eeeeee"/><stop offset="95%" stop-color="#e8e8f4"/>'
      '</linearGradient></defs>\n')
    w('<style type="text/css"><![CDATA[\n'
      f'text {{ font-family: Verdana, "DejaVu Sans", sans-serif; font-size: {FONT_SIZE}px; fill: #000; }}\n'
      '#title { font-size: 17px; text-anchor: middle; }\n'
      '#subtitle { font-size: 12px; text-anchor: middle; fill: #555; }\n'
      '.ctl { cursor: pointer; fill: #0645ad; }\n'
      '.ctl.off { opacity: 0.35; }\n'
      '#matched { text-anchor: end; }\n'
      '.f { cursor: pointer; }\n'
      '.f text { pointer-events: none; }\n'
      '.f:hover rect { stroke: #000; stroke-width: 0.6; }\n'
      '.f.parent { opacity: 0.55; }\n'
      ']]></style>\n')
    w(f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="url(#bg)"/>\n')
    w(f'<text id="title" x="{WIDTH / 2:.0f}" y="24">{xml_escape(title)}</text>\n')
    w(f'<text id="subtitle" x="{WIDTH / 2:.0f}" y="44">{xml_escape(sub)}</text>\n')
    w(f'<text id="unzoom" class="ctl off" x="{XPAD}" y="24">Reset zoom</text>\n')
    w(f'<text id="search" class="ctl" x="{WIDTH - XPAD}" y="24" style="text-anchor:end">Search</text>\n')
    w(f'<text id="details" x="{XPAD}" y="{height - 12}"> </text>\n')
    w(f'<text id="matched" x="{WIDTH - XPAD}" y="{height - 12}"> </text>\n')
    if total == 0:
        w(f'<text x="{WIDTH / 2:.0f}" y="{TOP + 12}" style="text-anchor:middle">No samples</text>\n')

    w('<g id="frames">\n')
    base_y = TOP + max_depth * FRAME_H
    for node, depth, off in laid:
        x = XPAD + off * scale
        fw = node.total * scale
        y = base_y - depth * FRAME_H
        w(f'<g class="f" data-o="{off}" data-w="{node.total}"><title>{xml_escape(tip(node, total))}</title>'
          f'<rect x="{x:.2f}" y="{y}" width="{fw:.2f}" height="{FRAME_H - 1}" fill="{fill(node)}" rx="2" ry="2"/>'
          f'<text x="{x + 3:.2f}" y="{y + FRAME_H - 4.5:.1f}">{xml_escape(fit_text(node.label, fw))}</text></g>\n')
    w('</g>\n')
    w('<script type="text/ecmascript"><![CDATA[\n')
    w(_SCRIPT.replace("@WIDTH@", str(WIDTH)).replace("@XPAD@", str(XPAD))
      .replace("@CHARW@", repr(CHAR_W)).replace("@TOTAL@", str(total))
      .replace("@MATCH@", MATCH_FILL).replace("@SEP@", SEP))
    w(']]></script>\n')
    w('</svg>\n')
    return "".join(out)


_SCRIPT = r"""
(function () {
"use strict";
var WIDTH = @WIDTH@, XPAD = @XPAD@, CHARW = @CHARW@, TOTAL = @TOTAL@;
var MATCH = "@MATCH@", SEP = "@SEP@";
var svg = document.documentElement;
var frames = [];
var details = document.getElementById("details");
var matchedEl = document.getElementById("matched");
var unzoomEl = document.getElementById("unzoom");
var searchEl = document.getElementById("search");
var zoomed = null, term = null;

function fit(label, w) {
  var n = Math.floor((w - 6) / CHARW);
  if (n < 3) return "";
  if (label.length <= n) return label;
  return label.substring(0, n - 2) + "..";
}

function place(f, x, w) {
  f.rect.setAttribute("x", x.toFixed(2));
  f.rect.setAttribute("width", w.toFixed(2));
  f.text.setAttribute("x", (x + 3).toFixed(2));
  f.text.textContent = fit(f.label, w);
}

function frameOf(el) {
  while (el && el !== svg) {
    if (el.__frame !== undefined) return frames[el.__frame];
    el = el.parentNode;
  }
  return null;
}

function zoom(z) {
  zoomed = z;
  var scale = (WIDTH - 2 * XPAD) / z.w, zend = z.o + z.w;
  for (var i = 0; i < frames.length; i++) {
    var f = frames[i], show = false;
    if (f.y > z.y) {               /* rows below: ancestors of z span it */
      if (f.o <= z.o && f.o + f.w >= zend) {
        place(f, XPAD, WIDTH - 2 * XPAD);
        f.g.classList.add("parent");
        show = true;
      }
    } else if (f.o >= z.o && f.o + f.w <= zend) {
      place(f, XPAD + (f.o - z.o) * scale, f.w * scale);
      f.g.classList.remove("parent");
      show = true;
    }
    f.g.style.display = show ? "" : "none";
  }
  unzoomEl.setAttribute("class", "ctl");
}

function unzoom() {
  zoomed = null;
  var scale = TOTAL ? (WIDTH - 2 * XPAD) / TOTAL : 0;
  for (var i = 0; i < frames.length; i++) {
    var f = frames[i];
    place(f, XPAD + f.o * scale, f.w * scale);
    f.g.classList.remove("parent");
    f.g.style.display = "";
  }
  unzoomEl.setAttribute("class", "ctl off");
}

function clearSearch() {
  term = null;
  for (var i = 0; i < frames.length; i++) frames[i].rect.setAttribute("fill", frames[i].fill);
  svg.removeAttribute("data-matched");
  matchedEl.textContent = " ";
  searchEl.textContent = "Search";
}

function search(t) {
  if (t === null || t === undefined || t === "") { clearSearch(); return; }
  var re;
  try { re = new RegExp(t); } catch (e) {
    if (window.alert) window.alert("Invalid regular expression: " + e.message);
    return;
  }
  term = t;
  var hits = [];
  for (var i = 0; i < frames.length; i++) {
    var f = frames[i];
    if (re.test(f.label)) { f.rect.setAttribute("fill", MATCH); hits.push(f); }
    else f.rect.setAttribute("fill", f.fill);
  }
  /* Frames form a laminar family of intervals: sort by start, outermost
     (lowest row, largest y) first, and count a hit only when it starts past
     the end of the last counted one, so nested hits are not counted twice. */
  hits.sort(function (a, b) { return (a.o - b.o) || (b.y - a.y); });
  var sum = 0, end = -1;
  for (var j = 0; j < hits.length; j++) {
    if (hits[j].o >= end) { sum += hits[j].w; end = hits[j].o + hits[j].w; }
  }
  var pct = TOTAL ? (100 * sum / TOTAL).toFixed(1) : "0.0";
  svg.setAttribute("data-matched", pct);
  matchedEl.textContent = "Matched: " + pct + "%";
  searchEl.textContent = "Clear search";
}

function askSearch() {
  if (term !== null) { clearSearch(); return; }
  var t = window.prompt("Search for (regular expression):", "");
  if (t !== null) search(t);
}

function init() {
  var gs = document.getElementById("frames").getElementsByTagName("g");
  for (var i = 0; i < gs.length; i++) {
    var g = gs[i];
    var rect = g.getElementsByTagName("rect")[0];
    var tip = g.getElementsByTagName("title")[0].textContent;
    var k = tip.lastIndexOf(SEP);
    frames.push({
      g: g, rect: rect, text: g.getElementsByTagName("text")[0], tip: tip,
      label: k >= 0 ? tip.substring(0, k) : tip,
      o: Number(g.getAttribute("data-o")), w: Number(g.getAttribute("data-w")),
      y: Number(rect.getAttribute("y")), fill: rect.getAttribute("fill")
    });
    g.__frame = i;
  }
  svg.addEventListener("click", function (e) {
    var f = frameOf(e.target);
    if (f) zoom(f);
  });
  svg.addEventListener("mouseover", function (e) {
    var f = frameOf(e.target);
    details.textContent = f ? f.tip : " ";
  });
  unzoomEl.addEventListener("click", function (e) { e.stopPropagation(); unzoom(); });
  searchEl.addEventListener("click", function (e) { e.stopPropagation(); askSearch(); });
  window.addEventListener("keydown", function (e) {
    if ((e.ctrlKey || e.metaKey) && (e.key === "f" || e.key === "F")) { e.preventDefault(); askSearch(); }
    else if (e.key === "Escape") { if (zoomed) unzoom(); else clearSearch(); }
  });
  var h = window.location.hash || "";
  if (h.indexOf("#search=") === 0) {
    var t;
    try { t = decodeURIComponent(h.substring(8)); } catch (e) { t = h.substring(8); }
    search(t);
  }
}

init();
})();
"""
