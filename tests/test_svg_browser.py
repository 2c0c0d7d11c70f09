"""The SVG's script in a real browser: search from the URL fragment.

Needs /usr/bin/chromium; skipped without it, except that with
PYOFFCPU_REQUIRE_BPF=1 (CI, which installs chromium) a missing browser fails.
"""
import os
import shutil
import struct
import subprocess
import urllib.parse
import xml.etree.ElementTree as ET
import zlib

import pytest

from conftest import chromium_or_skip
from pyoffcpu.export.svg import render_svg
from pyoffcpu.profile.model import from_folded

SVG_NS = "{http://www.w3.org/2000/svg}"
MAGENTA = (230, 0, 230)

PROFILE = """\
process 42 python3;thread 42 MainThread;main (app.py:10);cpu_work (app.py:20) 500000
process 42 python3;thread 42 MainThread;main (app.py:10);wait_io (app.py:30);[off-cpu] 300000
process 42 python3;thread 43 worker;run (w.py:5);cpu_work (app.py:20);[off-cpu: runqueue] 50000
process 42 python3;thread 43 worker;run (w.py:5);helper (w.py:9) 150000
"""


@pytest.fixture(scope="module")
def chromium():
    return chromium_or_skip()


def _run_chromium(chromium, tmp_path, url, *extra):
    profile_dir = tmp_path / "chromium-profile"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile_dir}", "--virtual-time-budget=2000",
           *extra, url]
    env = dict(os.environ, HOME=str(tmp_path))
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
                         env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-3000:]
    return res.stdout.decode("utf-8", errors="replace")


def _svg_url(tmp_path, regex):
    path = tmp_path / "flame.svg"
    path.write_text(render_svg(from_folded(PROFILE), title="browser test"), encoding="utf-8")
    return "file://" + str(path) + "#search=" + urllib.parse.quote(regex, safe="")


def _dump(chromium, tmp_path, regex, url=None):
    dom = _run_chromium(chromium, tmp_path, url or _svg_url(tmp_path, regex), "--dump-dom")
    start = dom.index("<svg")
    root = ET.fromstring(dom[start:dom.rindex("</svg>") + len("</svg>")])
    fills = {}
    for g in root.iter(SVG_NS + "g"):
        if g.get("class") == "f":
            tip = g.find(SVG_NS + "title").text
            fills.setdefault(tip[:tip.rindex(" \u2014 ")], []).append(g.find(SVG_NS + "rect").get("fill"))
    return root, fills


def test_search_from_fragment(chromium, tmp_path):
    root, fills = _dump(chromium, tmp_path, "cpu_work")
    # 500 ms + 50 ms of 1 s; the cpu_work frames are in two places
    assert root.get("data-matched") == "55.0"
    assert fills["cpu_work (app.py:20)"] == ["rgb(230,0,230)", "rgb(230,0,230)"]
    assert all(f != "rgb(230,0,230)" for lb, fs in fills.items() if lb != "cpu_work (app.py:20)"
               for f in fs)
    matched = [t for t in root.iter(SVG_NS + "text") if t.get("id") == "matched"][0]
    assert matched.text == "Matched: 55.0%"


def test_search_nested_matches_not_double_counted(chromium, tmp_path):
    # main (80%) contains a cpu_work match (50%); run (20%) contains one (5%)
    root, fills = _dump(chromium, tmp_path, "^(main|run|cpu_work) ")
    assert root.get("data-matched") == "100.0"
    root, _ = _dump(chromium, tmp_path, "main|cpu_work")
    assert root.get("data-matched") == "85.0"
    root, _ = _dump(chromium, tmp_path, "wait_io")
    assert root.get("data-matched") == "30.0"


def test_no_fragment_no_search(chromium, tmp_path):
    path = tmp_path / "flame.svg"
    path.write_text(render_svg(from_folded(PROFILE)), encoding="utf-8")
    root, fills = _dump(chromium, tmp_path, None, url="file://" + str(path))
    assert root.get("data-matched") is None
    assert "cpu_work (app.py:20)" in fills
    assert all(f != "rgb(230,0,230)" for fs in fills.values() for f in fs)


# -- a small PNG decoder (stdlib only) -----------------------------------------
def decode_png(data):
    """Return (width, height, channels, rows) for an 8-bit RGB/RGBA PNG, rows
    being bytes objects of width*channels bytes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, [], None
    while pos < len(data):
        length, ctype = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if ctype == b"IHDR":
            width, height, depth, colour, _comp, _filt, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or colour not in (2, 6) or interlace:
                raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, "
                                 f"interlace {interlace}")
            channels = 3 if colour == 2 else 4
        elif ctype == b"IDAT":
            idat.append(body)
        elif ctype == b"IEND":
            break
    assert width is not None, "no IHDR"
    raw = zlib.decompress(b"".join(idat))
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        off = y * (stride + 1)
        ftype = raw[off]
        line = bytearray(raw[off + 1:off + 1 + stride])
        if ftype == 0:
            pass
        elif ftype == 1:                       # Sub
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif ftype == 2:                       # Up
            for i in range(stride):
                line[i] = (line[i] + prev[i]) & 0xFF
        elif ftype == 3:                       # Average
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif ftype == 4:                       # Paeth
            for i in range(stride):
                a = line[i - channels] if i >= channels else 0
                b = prev[i]
                c = prev[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        else:
            raise ValueError(f"bad PNG filter type {ftype} in row {y}")
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows


def _count_colour(png, rgb, tol=6):
    width, height, ch, rows = png
    n = 0
    for row in rows:
        for x in range(0, width * ch, ch):
            if (abs(row[x] - rgb[0]) <= tol and abs(row[x + 1] - rgb[1]) <= tol
                    and abs(row[x + 2] - rgb[2]) <= tol):
                n += 1
    return n


def _png_bytes(width, height, rows, colour):
    """Encode rows with a mix of filter types, to check the decoder."""
    ch = 3 if colour == 2 else 4
    out, prev = bytearray(), bytes(width * ch)
    for y, row in enumerate(rows):
        ftype = y % 5
        enc = bytearray(row)
        for i in range(len(row)):
            a = row[i - ch] if i >= ch else 0
            b = prev[i]
            c = prev[i - ch] if i >= ch else 0
            if ftype == 1:
                enc[i] = (row[i] - a) & 0xFF
            elif ftype == 2:
                enc[i] = (row[i] - b) & 0xFF
            elif ftype == 3:
                enc[i] = (row[i] - ((a + b) >> 1)) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                enc[i] = (row[i] - (a if pa <= pb and pa <= pc else (b if pb <= pc else c))) & 0xFF
        out += bytes([ftype]) + enc
        prev = row

    def chunk(t, body):
        return struct.pack(">I", len(body)) + t + body + struct.pack(">I", zlib.crc32(t + body))
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(out))) + chunk(b"IEND", b""))


@pytest.mark.parametrize("colour", [2, 6])
def test_png_decoder(colour):
    ch = 3 if colour == 2 else 4
    w, h = 7, 11
    rows = [bytes(((x * 37 + y * 91 + c * 53) * (y + 1)) & 0xFF for x in range(w) for c in range(ch))
            for y in range(h)]
    assert decode_png(_png_bytes(w, h, rows, colour)) == (w, h, ch, rows)


def test_screenshot_shows_magenta(chromium, tmp_path):
    shot = tmp_path / "shot.png"
    _run_chromium(chromium, tmp_path, _svg_url(tmp_path, "cpu_work"),
                  f"--screenshot={shot}", "--window-size=1200,600")
    data = shot.read_bytes()
    png = decode_png(data)
    assert png[0] == 1200 and png[1] == 600
    magenta = _count_colour(png, MAGENTA)
    # cpu_work: 55% of 1180 px wide, 15 px high, minus rounded corners and text
    assert magenta > 0.55 * 1180 * 15 * 0.5, magenta
    try:
        shutil.copyfile(shot, "/tmp/pyoffcpu-svg-search.png")
    except OSError:
        pass
    # without a search there is no magenta at all
    shot2 = tmp_path / "plain.png"
    _run_chromium(chromium, tmp_path, "file://" + str(tmp_path / "flame.svg"),
                  f"--screenshot={shot2}", "--window-size=1200,600")
    assert _count_colour(decode_png(shot2.read_bytes()), MAGENTA) == 0


def test_click_zoom_and_reset(chromium, tmp_path):
    text = render_svg(from_folded(PROFILE))
    # after load, click the "main" frame and record the zoomed layout, then reset
    probe = """<script type="text/ecmascript"><![CDATA[
(function () {
  var gs = document.getElementById("frames").getElementsByTagName("g"), main = null;
  for (var i = 0; i < gs.length; i++)
    if (gs[i].getElementsByTagName("title")[0].textContent.indexOf("main (app.py:10) ") === 0) main = gs[i];
  function snap() {
    var out = [];
    for (var i = 0; i < gs.length; i++) {
      var t = gs[i].getElementsByTagName("title")[0].textContent;
      var r = gs[i].getElementsByTagName("rect")[0];
      out.push(t.substring(0, t.lastIndexOf(" \\u2014 ")) + "|" + r.getAttribute("x") + "|" +
               r.getAttribute("width") + "|" + (gs[i].style.display === "none" ? "hidden" : "shown"));
    }
    return out.join("\\n");
  }
  main.getElementsByTagName("rect")[0].dispatchEvent(new MouseEvent("click", {bubbles: true}));
  document.documentElement.setAttribute("data-zoomed", snap());
  document.getElementById("unzoom").dispatchEvent(new MouseEvent("click", {bubbles: true}));
  document.documentElement.setAttribute("data-reset", snap());
})();
]]></script>
</svg>
"""
    path = tmp_path / "zoom.svg"
    path.write_text(text[:text.rindex("</svg>")] + probe, encoding="utf-8")
    root, _ = _dump(chromium, tmp_path, None, url="file://" + str(path))

    def parse(attr):
        out = {}
        for line in root.get(attr).split("\n"):
            label, x, w, vis = line.split("|")
            out[label] = (float(x), float(w), vis)
        return out
    zoomed, reset = parse("data-zoomed"), parse("data-reset")
    assert zoomed["main (app.py:10)"] == (10.0, 1180.0, "shown")
    assert zoomed["cpu_work (app.py:20)"][1] == pytest.approx(1180 * 5 / 8, abs=0.01)
    assert zoomed["wait_io (app.py:30)"][0] == pytest.approx(10 + 1180 * 5 / 8, abs=0.01)
    for anc in ("all", "process 42 python3", "thread 42 MainThread"):
        assert zoomed[anc] == (10.0, 1180.0, "shown")
    for other in ("thread 43 worker", "run (w.py:5)", "helper (w.py:9)"):
        assert zoomed[other][2] == "hidden"
    assert reset["main (app.py:10)"][1] == pytest.approx(1180 * 0.8, abs=0.01)
    assert reset["helper (w.py:9)"] == (pytest.approx(10 + 1180 * 0.85, abs=0.01),
                                        pytest.approx(1180 * 0.15, abs=0.01), "shown")
