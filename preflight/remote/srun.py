"""srun as the transport inside a SLURM allocation (`preflight check --slurm` with $SLURM_JOB_ID set): one
job step per node (`srun --overlap -N1 -n1 -w NODE`), the same shipped program and line protocol as over
SSH (preflight.remote.ssh), so the nodes need no SSH keys. srun is run with a list of arguments; the remote
command is the fixed bootstrap of shipping.shipped_command.
"""
from __future__ import annotations

import os
import shutil
from typing import List, Optional

from preflight.remote.local import LocalConnection
from preflight.remote.session import NodeError


def usable() -> bool:
    """Inside an allocation, with srun on PATH."""
    return bool(os.environ.get("SLURM_JOB_ID")) and shutil.which("srun") is not None


class SrunConnection(LocalConnection):
    """srun, a process of this machine, runs each command as a job step on the node."""
    kind, remediation = "srun", "check SLURM's tools on this machine"
    stalled = ("the job step did not start", "check the allocation (squeue, scontrol show job) and slurmd on the node")

    def __init__(self, node: str, timeout: float, jobid: Optional[str] = None):
        super().__init__(timeout)
        # jobid: a job step inside that job from outside it (`doctor --slurm-job` on a login node)
        self.node, self.jobid = node, jobid

    def connect(self) -> "SrunConnection":
        if shutil.which("srun") is None:
            raise NodeError("srun", "srun is not on PATH", "run inside an allocation (salloc/sbatch) with SLURM's tools")
        return self

    def argv(self, command: str) -> List[str]:
        return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={self.node}", "--quiet", "--input=all",
                *([f"--jobid={self.jobid}"] if self.jobid else []), "sh", "-c", command]
