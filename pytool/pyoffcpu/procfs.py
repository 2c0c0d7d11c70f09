"""What /proc says about a process or thread: small readers that never raise."""
from __future__ import annotations

from typing import List, Optional


def read_text(path: str) -> Optional[str]:
    """A /proc file's text, None when it cannot be read (the task is gone)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def ns_id(status_path: str, host_id: int) -> int:
    """The id of a task in its own (innermost) PID namespace, from the NSpid
    line of /proc/.../status; 0 when it is the host's id or unknown."""
    for line in (read_text(status_path) or "").splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            inner = int(ids[-1]) if ids and ids[-1].isdigit() else 0
            return inner if inner != host_id else 0
    return 0


def stat_fields(stat_path: str) -> List[str]:
    """The fields of a /proc/.../stat file after the command name (which may
    hold spaces and parentheses): [0] the state, [1] the parent PID, [19]
    the start time; [] when it is gone."""
    return (read_text(stat_path) or "").rsplit(")", 1)[-1].split()


def proc_state(stat_path: str) -> str:
    """The state letter of a /proc/.../stat file ("" when it is gone)."""
    fields = stat_fields(stat_path)
    return fields[0] if fields else ""


def process_alive(pid: int) -> bool:
    return proc_state(f"/proc/{pid}/stat") not in ("", "Z", "X")


def rss_kib() -> int:
    """This process's resident memory."""
    for line in (read_text("/proc/self/status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0
