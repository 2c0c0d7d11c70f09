"""Feeds `pyoffcpu diff` and `pyoffcpu report` random and mutated files
(folded, pprof, index JSON) for a bounded time, in one process: run by
tests/test_untrusted.py.  Every run must end with exit status 0 or 1 and
no exception but SystemExit; the process's peak RSS is printed at the end.

    python tests/fuzz_inputs.py SECONDS SEED WORKDIR

Prints `runs N rss_mib M`, or `FAIL kind seed input-file` and the
traceback.  Inputs are made from seeds of the real formats, then mutated:
bytes flipped, cut, repeated, spliced; JSON values swapped for other types,
nested deep, numbers made huge."""
import gzip
import json
import os
import random
import sys
import time
import traceback

from click.testing import CliRunner

from pyoffcpu.cli import main
from pyoffcpu.export.pprof import render_pprof
from pyoffcpu.profile.model import from_folded

FOLDED = """\
python3.11 (41);MainThread (41);<module> (app.py:9);work (app.py:5);sum (native) 3000000
python3.11 (41);MainThread (41);<module> (app.py:9);wait (app.py:7);[off-cpu: sleep] 5000000
python3.11 (41);worker (42);run (threading.py:975);[off-cpu: lock] 2000000
python3.11 (41);worker (42);run (threading.py:975);compute (w.py:3);do_work (libw.so);[k] schedule 700
"""


def seeds():
    prof = from_folded(FOLDED)
    pprof = render_pprof(prof)
    index = {"version": 1, "runs": [{"time": 1.7e9, "took_s": 3.0}],
             "entries": [{"time": 1.7e9 + i, "host": "h", "pid": 40 + i, "name": "python3.11",
                          "cmdline": "python3.11 app.py", "python": "3.11", "mode": "wall",
                          "duration_s": 10, "frequency_hz": 49, "on_cpu_ns": 3_000_000,
                          "off_cpu_ns": 7_000_000, "threads": 2,
                          "off_cpu_by_reason_ns": {"sleep": 5_000_000, "lock": 2_000_000},
                          "top": [{"where": "work (app.py:5)", "ns": 3_000_000, "on_cpu_ns": 3_000_000}],
                          "files": {"svg": {"path": f"h/2026-12-01/0000{i}-4{i}-python3.11.svg", "bytes": 10}},
                          "notices": ["one"]} for i in range(3)]}
    return FOLDED.encode(), pprof, json.dumps(index).encode()


def mutate_bytes(rng, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(7)
        if not b:
            b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
            continue
        i = rng.randrange(len(b))
        if op == 0:
            b[i] = rng.randrange(256)
        elif op == 1:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 2:
            del b[i:i + rng.randint(1, 64)]
        elif op == 3:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randint(1, 256)] * rng.randint(1, 16)
        elif op == 4:
            del b[i:]
        elif op == 5:
            b[i:i] = bytes(rng.choice([0, 0xff, 0x80, 0x0a, 0x3b, 0x20, 0x1b]) for _ in range(rng.randint(1, 16)))
        else:
            b[i:i] = str(rng.choice([-1, 0, 1 << 63, 1 << 64, 10 ** 30, -(1 << 63)])).encode()
    return bytes(b)


def mutate_json(rng, value, depth=0):
    """A JSON value with one part replaced by something of another type."""
    odd = [None, True, -1, 0, 1 << 64, 1e308, -1e308, "x", "", "javascript:x", [], {}, [1, [2]],
           {"a": 1}, "\x1b]2;t\x07", 10 ** 40]
    if depth > 6 or rng.random() < 0.25:
        return rng.choice(odd)
    if isinstance(value, dict) and value:
        out = dict(value)
        k = rng.choice(list(out))
        if rng.random() < 0.2:
            del out[k]
        else:
            out[k] = mutate_json(rng, out[k], depth + 1)
        return out
    if isinstance(value, list) and value:
        out = list(value)
        i = rng.randrange(len(out))
        out[i] = mutate_json(rng, out[i], depth + 1)
        if rng.random() < 0.2:
            out.append(rng.choice(odd))
        return out
    return rng.choice(odd)


def make(rng, kind: str, base: bytes) -> bytes:
    r = rng.random()
    if r < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 4096)))
    if kind == "index":
        if r < 0.1:
            return b"[" * rng.randint(1, 100000) + b"]" * rng.randint(0, 10)
        if r < 0.6:
            return json.dumps(mutate_json(rng, json.loads(base))).encode()
        return mutate_bytes(rng, base)
    if kind == "pprof":
        raw = gzip.decompress(base)
        if r < 0.4:
            return gzip.compress(mutate_bytes(rng, raw))
        if r < 0.5:
            return mutate_bytes(rng, raw)
        return mutate_bytes(rng, base)
    return mutate_bytes(rng, base)


def check(result) -> bool:
    return result.exit_code in (0, 1) and (result.exception is None
                                           or isinstance(result.exception, SystemExit))


def main_loop(seconds: float, seed: int, work: str) -> int:
    rng = random.Random(seed)
    folded, pprof, index = seeds()
    runner = CliRunner()
    end = time.monotonic() + seconds
    runs = 0
    while time.monotonic() < end:
        runs += 1
        kind = ("folded", "pprof", "index")[runs % 3]
        if kind == "index":
            d = os.path.join(work, f"dir{runs % 4}")
            os.makedirs(d, exist_ok=True)
            data = make(rng, kind, index)
            with open(os.path.join(d, "index.json"), "wb") as f:
                f.write(data)
            args = ["report", d, "-o", os.path.join(work, "report.html")]
        else:
            ext, base = (".folded", folded) if kind == "folded" else (".pb.gz", pprof)
            a, b = os.path.join(work, "a" + ext), os.path.join(work, "b" + ext)
            data = make(rng, kind, base)
            with open(a, "wb") as f:
                f.write(data)
            with open(b, "wb") as f:
                f.write(base if rng.random() < 0.5 else make(rng, kind, base))
            args = ["diff", a, b, "-o", os.path.join(work, "diff.svg")]
        result = runner.invoke(main, args)
        if not check(result):
            keep = os.path.join(work, f"failing-{kind}")
            with open(keep, "wb") as f:
                f.write(data)
            print(f"FAIL {kind} seed {seed} run {runs} {keep} exit {result.exit_code}")
            if result.exc_info:
                traceback.print_exception(*result.exc_info, file=sys.stdout)
            return 1
    rss = next(int(line.split()[1]) >> 10 for line in open("/proc/self/status")
               if line.startswith("VmHWM:"))      # (ru_maxrss carries a vfork parent's)
    print(f"runs {runs} rss_mib {rss}")
    return 0


if __name__ == "__main__":
    sys.exit(main_loop(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
