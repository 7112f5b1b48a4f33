"""`preflight launch` on the test cluster refuses a job whose launch runs a program by name that the nodes'
non-interactive SSH PATH does not find: accelerate's DeepSpeed runner is `deepspeed`, by name
(accelerate/utils/launch.py, prepare_deepspeed_cmd_env: cmd = ["deepspeed"]). The healthy case, the venv on
that PATH, is tests/cli/test_healthy_job_matrix.py's DeepSpeed nossh and pdsh cells."""
import json

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from healthy_jobs import ACCELERATE, DEEPSPEED_CONFIG, Job, accelerate_config

pytestmark = pytest.mark.cluster


def test_the_gate_refuses_accelerates_deepspeed_runner_when_the_nodes_path_has_no_deepspeed(cluster, tmp_path):
    job = Job(cluster, tmp_path, "no-venv-on-path", ("node01", "node02"), 29731)
    try:
        for node in job.nodes:
            cluster.set_env(node, PATH="/usr/local/bin:/usr/bin:/bin")  # the venv is not activated there
        job.write("ds.json", json.dumps(DEEPSPEED_CONFIG))
        job.write("hostfile", job.hostfile())
        section = {"deepspeed_config_file": "ds.json", "deepspeed_multinode_launcher": "nossh",
                   "deepspeed_hostfile": "hostfile", "zero3_init_flag": False}
        job.write("accelerate.yaml", accelerate_config(2, 0, cluster.ip("node01"), 29731, distributed_type="DEEPSPEED",
                                                       mixed_precision=None, deepspeed_config=section))
        command = [ACCELERATE, "launch", "--config_file", "accelerate.yaml", "train.py", str(job.marks)]
        gate = job.gate(command, ["--config", "accelerate.yaml"])
        gate["proc"].wait(timeout=60)
        assert gate["refused"] and gate["doc"] is not None, gate["stderr"][-2000:]
        [found] = [r for r in gate["doc"]["results"] if r["id"] == "JOB010" and r["status"] == "fail"]
        assert found["message"].startswith("deepspeed is not found on the non-interactive SSH PATH of node[01-02]")
        assert found["nodes"] == ["node01", "node02"]
        assert not list(job.marks.glob("*.starts"))  # nothing was started
    finally:
        job.stop()
