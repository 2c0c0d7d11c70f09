"""An unexpected exception as one line for a note: what it was and where it
was raised.  Where one process's data meets a case the code did not expect
(a crash report, a stack, a snapshot's file), the run goes on and says this
line instead of ending."""
from __future__ import annotations

import os
import traceback


def failure_text(e: BaseException, limit: int = 300) -> str:
    """`KeyError: 'x' in merge.py:123 frames_for`, at most limit characters."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" in {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} {tb[-1].name}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"[:limit]
