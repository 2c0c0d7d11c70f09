"""Which processes `-a` takes (--match, --uid, --python-only)."""
from __future__ import annotations

import re
from typing import Optional

from ..kernel.procfs import cmdline, uid_of


class Select:
    """Which processes -a takes: --match (a regex searched in the command
    line), --uid, --python-only; none given: every process."""

    def __init__(self, match: Optional[str] = None, uid: Optional[int] = None,
                 python_only: bool = False):
        self.pattern = re.compile(match) if match is not None else None
        self.uid = uid
        self.python_only = python_only

    @property
    def filtered(self) -> bool:
        return self.pattern is not None or self.uid is not None or self.python_only

    def wants(self, pid: int) -> bool:
        """By what /proc says now (--python-only is decided by detection)."""
        if self.uid is not None and uid_of(pid) != self.uid:
            return False
        if self.pattern is not None:
            cmd = cmdline(pid)
            if not cmd or not self.pattern.search(cmd):
                return False
        return True
