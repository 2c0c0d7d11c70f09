"""`pyoffcpu report DIR`: one self-contained HTML page over the snapshots
that `pyoffcpu snapshot` wrote there (its index.json).

Per host and process (by name), a timeline of its snapshots (one bar each:
on-CPU warm, off-CPU blue, its height the share) and a table: when, the
PID, the split, the main off-CPU reasons, the top functions and a link to
each file.  Filters by process and by day (select boxes, or the URL
fragment `#process=NAME&day=YYYY-mm-dd`) hide the other rows; without
JavaScript every row shows.  Everything is in the page (no external
script, style or font); the links are relative to DIR.
"""
from __future__ import annotations

import html
import json
import os
import re
import time
from typing import Dict, List, Optional, Tuple

from .snapshot import load_index

TOP_SHOWN = 3


def _fmt_s(ns: int) -> str:
    return f"{ns / 1e9:.2f} s"


def _esc(s) -> str:
    return html.escape(str(s), quote=True)


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def safe_href(link_base: str, path: str) -> Optional[str]:
    """The link to a snapshot file, escaped for an attribute, or None: the
    path comes from the index, a file, so only a relative path (no scheme
    such as `javascript:`, no leading /, no `..`) becomes a link."""
    if (not isinstance(path, str) or _SCHEME.match(path) or path.startswith(("/", "\\"))
            or ".." in path.split("/") or any(ord(c) < 32 for c in path)):
        return None
    link = os.path.join(link_base, path) if link_base else path
    if _SCHEME.match(link) and not link.lower().startswith(("http:", "https:")):
        return None
    return _esc(link)


def group_entries(index: dict) -> Dict[Tuple[str, str, str], List[dict]]:
    """(host, process name, command line) -> its entries, oldest first: one
    job's snapshots across restarts (new PIDs), apart from another job of
    the same name."""
    groups: Dict[Tuple[str, str, str], List[dict]] = {}
    for e in sorted(index.get("entries", []), key=lambda e: e.get("time", 0)):
        groups.setdefault((e.get("host", "?"), e.get("name", "?"), e.get("cmdline", "")), []).append(e)
    return groups


def _day(e: dict) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(e.get("time", 0)))


def _timeline(entries: List[dict], t0: float, t1: float) -> str:
    """An inline SVG: one bar per snapshot at its time, on-CPU share warm at
    the bottom, off-CPU share blue above it."""
    width, height = 900, 44
    span = max(t1 - t0, 1.0)
    bars = []
    for e in entries:
        on, off = e.get("on_cpu_ns", 0), e.get("off_cpu_ns", 0)
        if on + off <= 0:
            continue
        x = 4 + (e["time"] - t0) / span * (width - 12)
        on_h = (height - 4) * on / (on + off)
        tip = (f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['time']))} pid {e.get('pid')}: "
               f"on-CPU {_fmt_s(on)}, off-CPU {_fmt_s(off)}")
        bars.append(f'<g class="bar" data-day="{_esc(_day(e))}"><title>{_esc(tip)}</title>'
                    f'<rect x="{x:.1f}" y="2" width="5" height="{height - 4 - on_h:.1f}" fill="#5b8fd6"/>'
                    f'<rect x="{x:.1f}" y="{2 + height - 4 - on_h:.1f}" width="5" height="{on_h:.1f}" '
                    f'fill="#e8892b"/></g>')
    return (f'<svg class="timeline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'xmlns="http://www.w3.org/2000/svg"><rect width="{width}" height="{height}" fill="#f4f4f8"/>'
            + "".join(bars) + "</svg>")


def _reasons(e: dict) -> str:
    r = e.get("off_cpu_by_reason_ns", {})
    off = sum(r.values()) or 1
    return ", ".join(f"{k} {100 * v / off:.0f}%" for k, v in
                     sorted(r.items(), key=lambda kv: -kv[1])[:TOP_SHOWN])


def render_report(directory: str, link_base: str = "") -> str:
    """The page; links to the files go through `link_base` (the snapshot
    directory relative to where the page is written; "" beside it)."""
    index = load_index(directory)
    groups = group_entries(index)
    entries = [e for es in groups.values() for e in es]
    t0 = min((e["time"] for e in entries), default=0.0)
    t1 = max((e["time"] for e in entries), default=0.0)
    names = sorted({name for _, name, _ in groups})
    days = sorted({_day(e) for e in entries})
    out: List[str] = []
    w = out.append
    w("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      f"<title>pyoffcpu snapshots: {_esc(os.path.abspath(directory))}</title>\n<style>\n"
      "body { font-family: Verdana, 'DejaVu Sans', sans-serif; font-size: 13px; margin: 18px; color: #222; }\n"
      "h1 { font-size: 19px; } h2 { font-size: 15px; margin: 22px 0 2px; } .cmd { margin: 0 0 6px; }\n"
      "table { border-collapse: collapse; margin: 6px 0 12px; }\n"
      "td, th { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }\n"
      "th { background: #eef; } .num { text-align: right; white-space: nowrap; }\n"
      ".split { display: inline-block; width: 120px; height: 10px; background: #5b8fd6; }\n"
      ".split span { display: block; height: 10px; background: #e8892b; }\n"
      ".muted { color: #777; } .hidden { display: none; }\n"
      "</style></head><body>\n")
    w(f"<h1>pyoffcpu snapshots in {_esc(os.path.abspath(directory))}</h1>\n")
    if index.get("dropped"):
        w(f'<p class="muted">{index["dropped"]} entries of the index are not as pyoffcpu writes them: '
          "left out</p>\n")
    runs = index.get("runs", [])
    last = runs[-1] if runs else None
    w(f'<p class="muted" id="overview">{len(entries)} snapshots of {len(groups)} processes, '
      f"{len(days)} day" + ("s" if len(days) != 1 else "")
      + (f"; last run {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(last['time']))}, "
         f"{last.get('targets', 0)} targets" + (f", {len(last.get('errors', []))} errors"
                                                 if last.get("errors") else "") if last else "")
      + ". Orange: on-CPU, blue: off-CPU (waiting).</p>\n")
    w('<p>Process <select id="f-process"><option value="">all</option>'
      + "".join(f'<option value="{_esc(n)}">{_esc(n)}</option>' for n in names)
      + '</select> Day <select id="f-day"><option value="">all</option>'
      + "".join(f'<option value="{_esc(d)}">{_esc(d)}</option>' for d in days)
      + "</select></p>\n")
    if not entries:
        w('<p id="empty">No snapshots yet.</p>\n')
    for (host, name, line), es in sorted(groups.items()):
        pys = ", ".join(sorted({e.get("python", "") for e in es if e.get("python")}))
        w(f'<section class="proc" data-process="{_esc(name)}" data-host="{_esc(host)}">'
          f"<h2>{_esc(host)}: {_esc(name)} <span class=\"muted\">({len(es)} snapshots"
          + (f", CPython {_esc(pys)}" if pys else "") + ")</span></h2>\n"
          f'<p class="muted cmd">{_esc(line[:200])}</p>\n')
        w(_timeline(es, t0, t1) + "\n")
        w("<table><tr><th>when</th><th>pid</th><th class=\"num\">length</th><th>on / off CPU</th>"
          "<th>waiting for</th><th>top functions</th><th>files</th></tr>\n")
        for e in reversed(es):
            on, off = e.get("on_cpu_ns", 0), e.get("off_cpu_ns", 0)
            share = 100 * on / (on + off) if on + off else 0
            top = "<br>".join(f"{_esc(t['where'])} <span class=\"muted\">{_fmt_s(t.get('ns', 0))}</span>"
                              for t in e.get("top", [])[:TOP_SHOWN])
            links = [(fmt, safe_href(link_base, f["path"])) for fmt, f in sorted(e.get("files", {}).items())]
            files = " ".join(f'<a href="{href}">{_esc(fmt)}</a>' if href else _esc(fmt) for fmt, href in links)
            gpu = " GPU" if e.get("gpu") else ""
            w(f'<tr class="snap" data-day="{_esc(_day(e))}" data-process="{_esc(name)}">'
              f"<td>{_esc(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.get('time', 0))))}</td>"
              f"<td>{_esc(e.get('pid'))}{gpu}</td><td class=\"num\">{e.get('duration_s', 0):.1f} s</td>"
              f'<td><span class="split" title="on-CPU {share:.0f}%"><span style="width:{share:.0f}%">'
              f"</span></span> {_fmt_s(on)} / {_fmt_s(off)}</td>"
              f"<td>{_esc(_reasons(e))}</td><td>{top}</td><td>{files}</td></tr>\n")
        w("</table></section>\n")
    w("<script>\n" + _SCRIPT + "</script>\n")
    w('<script type="application/json" id="index-data">'
      + json.dumps({"entries": len(entries), "processes": names, "days": days}).replace("</", "<\\/")
      + "</script>\n</body></html>\n")
    return "".join(out)


_SCRIPT = r"""
(function () {
  var fp = document.getElementById("f-process"), fd = document.getElementById("f-day");
  function apply() {
    var p = fp.value, d = fd.value;
    document.querySelectorAll("section.proc").forEach(function (s) {
      var shown = 0;
      s.querySelectorAll("tr.snap").forEach(function (r) {
        var ok = (!p || r.dataset.process === p) && (!d || r.dataset.day === d);
        r.classList.toggle("hidden", !ok);
        if (ok) shown++;
      });
      s.querySelectorAll("g.bar").forEach(function (b) {
        b.style.opacity = (!d || b.dataset.day === d) ? "1" : "0.15";
      });
      s.classList.toggle("hidden", (p && s.dataset.process !== p) || shown === 0);
    });
    var h = [];
    if (p) h.push("process=" + encodeURIComponent(p));
    if (d) h.push("day=" + encodeURIComponent(d));
    history.replaceState(null, "", h.length ? "#" + h.join("&") : location.pathname);
  }
  location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
    var i = kv.indexOf("="); if (i < 0) return;
    var k = kv.slice(0, i), v = decodeURIComponent(kv.slice(i + 1));
    if (k === "process") fp.value = v;
    if (k === "day") fd.value = v;
  });
  fp.addEventListener("change", apply);
  fd.addEventListener("change", apply);
  apply();
})();
"""
