"""Case 7: the exporters on a synthetic 1,000,000-sample profile."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import fmt_bytes

from common import EXPORTERS, Results, Tools, log


# -- case 7: exporters -----------------------------------------------------------------------------------
def exporters_case(tools: Tools, res: Results):
    for fmt, ext in (("folded", "folded"), ("svg", "svg"), ("speedscope", "json")):
        path = os.path.join(tools.outdir, f"c7.{ext}")
        try:
            r = subprocess.run([sys.executable, EXPORTERS, fmt, path], capture_output=True, text=True,
                               timeout=600, env=tools.env)
            if r.returncode != 0:
                raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
            d = json.loads(r.stdout.strip().splitlines()[-1])
            res.exporters.append(d)
            log(f"case 7 {fmt}: export {d['export_s']:.2f}s, peak RSS {fmt_bytes(d['maxrss'])}")
            os.unlink(path)
        except Exception as e:                                  # noqa: BLE001
            res.errors.append(f"case 7 {fmt}: {e}")
            log(f"case 7 {fmt}: FAILED: {e}")
