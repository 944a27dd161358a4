"""A command's process started by fork and exec (vaccel/run/quick_run.py), as vaccel/run/runner.py
watches it: subprocess.Popen's poll, send_signal, pid and returncode (negative for a signal)."""

import os


class Forked:
    """A child process of ours, by its pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)
