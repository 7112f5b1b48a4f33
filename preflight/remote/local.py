"""This machine as a transport: the shipped program run by /bin/sh here, with the same line protocol as over SSH
and srun (`check` on this machine with --python naming an interpreter other than preflight's own). Its process
class, LocalProcess, is also what carries srun (preflight.remote.srun), itself a process of this machine."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from typing import List, Optional, Tuple

from preflight.remote.session import LineReader, NodeError


class LocalConnection:
    """Runs each command by /bin/sh on this machine; a subclass says how else (argv) and what a failure to start
    is called (kind, remediation)."""
    kind, remediation = "local", "check this machine's /bin/sh"
    # What a process that takes none of its input means (the shipped program is bigger than a pipe holds)
    stalled = ("the interpreter read none of the program it was given", "run the training interpreter (--python) "
               "by hand: does it start, and is it Python?")

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.processes: List["LocalProcess"] = []

    def connect(self) -> "LocalConnection":
        return self

    def argv(self, command: str) -> List[str]:
        return ["/bin/sh", "-c", command]

    def start(self, command: str, stdin_text: str, timeout: Optional[float] = None) -> "LocalProcess":
        argv = self.argv(command)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            raise NodeError(self.kind, f"cannot run {argv[0]}: {exc}", self.remediation) from None
        process = LocalProcess(proc, self.stalled)
        self.processes.append(process)
        process.send_raw(stdin_text.encode(), self.timeout if timeout is None else timeout)
        return process

    def close(self) -> None:
        for process in self.processes:
            process.close()
        self.processes = []


class LocalProcess(LineReader):
    """The RemoteProcess interface over a process of this machine: srun (the step runs on the node) or /bin/sh."""

    def __init__(self, proc: subprocess.Popen, stalled: Tuple[str, str] = ("the process read none of its input",
                                                                            "check the process")):
        super().__init__()
        self.proc, self.stalled = proc, stalled  # stalled: what taking no input means, and what to do
        os.set_blocking(proc.stdin.fileno(), False)  # writes with a deadline (send_raw)
        self._stderr = bytearray()
        self._reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self._reader.start()

    def _drain_stderr(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            self._stderr += chunk
            del self._stderr[:-8192]

    def _terminate(self) -> None:
        """SIGTERM to the process, and to its process group when it leads one (start_new_session): a shell's
        children end with it."""
        try:
            if os.getpgid(self.proc.pid) == self.proc.pid:
                os.killpg(self.proc.pid, signal.SIGTERM)
                return
        except OSError:  # ended already
            pass
        self.proc.terminate()

    def send_raw(self, data: bytes, timeout: float = 30.0) -> None:
        """Into the process's input; NodeError when it takes none of it for `timeout` s (srun's step that never
        starts, an interpreter that reads nothing: the program is bigger than a pipe holds)."""
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        deadline = time.monotonic() + timeout
        try:
            while view:
                if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
                    raise NodeError("timeout", f"{self.proc.args[0]} took no input for {timeout:g} s: "
                                    f"{self.stalled[0]}", self.stalled[1])
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    continue
        except (BrokenPipeError, ValueError, OSError):
            pass  # the step ended: read_line says so

    def send_line(self, text: str, timeout: float = 30.0) -> None:
        self.send_raw((text + "\n").encode(), timeout)

    def _receive(self, seconds: float) -> Optional[bytes]:
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], seconds)[0]:
            return None
        return os.read(fd, 65536)

    def stderr_tail(self, limit: int = 2000) -> str:
        return bytes(self._stderr).decode(errors="replace")[-limit:]

    def exit_status(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except Exception:
            pass
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self._terminate()  # srun passes it on to the step
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
