"""srun as the transport inside a SLURM allocation (`preflight check --slurm` with $SLURM_JOB_ID set): one
job step per node (`srun --overlap -N1 -n1 -w NODE`), the same shipped program and line protocol as over
SSH (preflight.remote.ssh), so the nodes need no SSH keys. srun is run with a list of arguments; the remote
command is the fixed bootstrap of shipping.shipped_command.
"""
from __future__ import annotations

import os
import select
import shutil
import subprocess
import threading
import time
from typing import List, Optional

from preflight.remote.session import LineReader, NodeError


def usable() -> bool:
    """Inside an allocation, with srun on PATH."""
    return bool(os.environ.get("SLURM_JOB_ID")) and shutil.which("srun") is not None


class SrunConnection:
    def __init__(self, node: str, timeout: float, jobid: Optional[str] = None):
        # jobid: a job step inside that job from outside it (`doctor --slurm-job` on a login node)
        self.node, self.timeout, self.jobid = node, timeout, jobid
        self.processes: List["StepProcess"] = []

    def connect(self) -> "SrunConnection":
        if shutil.which("srun") is None:
            raise NodeError("srun", "srun is not on PATH", "run inside an allocation (salloc/sbatch) with SLURM's tools")
        return self

    def start(self, command: str, stdin_text: str, timeout: Optional[float] = None) -> "StepProcess":
        argv = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={self.node}", "--quiet",
                "--input=all", *([f"--jobid={self.jobid}"] if self.jobid else []), "sh", "-c", command]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            raise NodeError("srun", f"cannot run srun: {exc}", "check SLURM's tools on this machine") from None
        step = StepProcess(proc)
        self.processes.append(step)
        step.send_raw(stdin_text.encode(), self.timeout if timeout is None else timeout)
        return step

    def close(self) -> None:
        for step in self.processes:
            step.close()
        self.processes = []


class StepProcess(LineReader):
    """The RemoteProcess interface over a local srun process."""

    def __init__(self, proc: subprocess.Popen):
        super().__init__()
        self.proc = proc
        os.set_blocking(proc.stdin.fileno(), False)  # writes with a deadline (send_raw)
        self._stderr = bytearray()
        self._reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self._reader.start()

    def _drain_stderr(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            self._stderr += chunk
            del self._stderr[:-8192]

    def send_raw(self, data: bytes, timeout: float = 30.0) -> None:
        """Into the step's input; NodeError when srun takes none of it for `timeout` s (a step that never
        starts: the program is bigger than a pipe holds)."""
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        deadline = time.monotonic() + timeout
        try:
            while view:
                if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
                    raise NodeError("timeout", f"srun took no input for {timeout:g} s: the job step did not start",
                                    "check the allocation (squeue, scontrol show job) and slurmd on the node")
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
            self.proc.terminate()  # srun passes it on to the step
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
