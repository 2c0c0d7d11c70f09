"""`pyoffcpu -- CMD`: the command, forked at once and held before its exec
until it is registered (so that its first instruction is recorded), then
let go, and watched until it exits."""
from __future__ import annotations

import os
import signal
from typing import List, Optional

from .platform import ProfilerError


class Launcher:
    """One command line, run once."""

    def __init__(self, command: List[str]):
        self.command = command
        self.pid: Optional[int] = None
        self.exit_status: Optional[int] = None
        self._release = None

    def fork(self) -> int:
        """fork; the child waits until start(), then execs the command."""
        go_r, go_w = os.pipe()
        # closed by a successful exec: EOF tells the parent the child is the command now
        exec_r, exec_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(go_w)
                os.close(exec_r)
                os.read(go_r, 1)
                os.close(go_r)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.execvp(self.command[0], self.command)
            except OSError as e:
                os.write(exec_w, (e.strerror or str(e)).encode())
            os._exit(127)
        os.close(go_r)
        os.close(exec_w)
        self._release = (go_w, exec_r)
        self.pid = pid
        return pid

    def start(self) -> None:
        """Let the registered child exec, and wait until it has."""
        go_w, exec_r = self._release
        os.write(go_w, b"x")
        os.close(go_w)
        err = b""
        while True:
            chunk = os.read(exec_r, 512)
            if not chunk:
                break
            err += chunk
        os.close(exec_r)
        if err:
            os.waitpid(self.pid, 0)
            raise ProfilerError(f"cannot run {self.command[0]}: {err.decode(errors='replace')}",
                                "check the command after --")

    def running(self) -> bool:
        """True while the command runs (exit_status is set once it has ended)."""
        if self.pid is None:
            return self.exit_status is None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.pid = None
            return False
        if pid == 0:
            return True
        self.exit_status = os.waitstatus_to_exitcode(status)
        self.pid = None
        return False
