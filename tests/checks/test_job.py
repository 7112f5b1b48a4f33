"""JOB: what each node will actually launch, read over real SSH sessions on the test cluster.

Each node gets its own HF_HOME (sshd SetEnv) holding its own accelerate default config, and its own
working folder bound at the same path (its mount namespace), as on nodes without a shared filesystem.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)

pytestmark = pytest.mark.cluster

ACCELERATE = str(Path(sys.executable).parent / "accelerate")
DEEPSPEED_JSON = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}


class Job:
    """Per-node configs and files; `check(*command)` runs preflight from the job's folder."""

    def __init__(self, cluster, tmp_path):
        self.cluster, self.nodes = cluster, cluster.nodes
        self.workdir = tmp_path / "job"
        self.workdir.mkdir()
        self.folders = {n: cluster.bind_dir(n, str(self.workdir)) for n in self.nodes}
        self.homes = {}
        for node in self.nodes:
            self.homes[node] = tmp_path / f"hf-{node}"
            (self.homes[node] / "accelerate").mkdir(parents=True)
            cluster.set_env(node, HF_HOME=str(self.homes[node]))
        for index, node in enumerate(self.nodes):
            self.config(node, machine_rank=index)
            self.file(node, "train.py", "print('training')\n")

    def config(self, node, name=None, **changes):
        """The node's accelerate config: its default one, or `name` in its job folder."""
        # MULTI_GPU with use_cpu: accelerate starts torchrun on each node, and the ranks run on the CPU (gloo).
        data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 3,
                "machine_rank": 0, "num_processes": 3, "main_process_ip": self.cluster.ip(self.nodes[0]),
                "main_process_port": 29512, "mixed_precision": "bf16", "use_cpu": True}
        data.update(changes)
        path = self.folders[node] / name if name else self.homes[node] / "accelerate" / "default_config.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))

    def file(self, node, name, text):
        (self.folders[node] / name).write_text(text)

    def check(self, *command, only="JOB"):
        argv = [sys.executable, "-m", "preflight", "check", "--hosts", ",".join(self.nodes), "--ssh-config",
                str(self.cluster.ssh_config), "--python", sys.executable, "--only", only, "--json"]
        proc = subprocess.run(argv + (["--", *command] if command else []), capture_output=True, text=True,
                              timeout=120, cwd=self.workdir)
        assert "Traceback" not in proc.stderr, proc.stderr
        doc = json.loads(proc.stdout)
        assert proc.returncode == (1 if doc["verdict"] == "fail" else 0)
        return doc


@pytest.fixture
def job(cluster, tmp_path):
    return Job(cluster, tmp_path)  # the cluster fixture undoes the binds and the SetEnv after the test


def failures(doc):
    """(check ID, nodes) of every result that is not a pass or a skip."""
    return sorted((r["id"], tuple(r["nodes"])) for r in doc["results"] if r["status"] not in ("pass", "skip"))


def found(doc, check_id, status="fail"):
    return [r for r in doc["results"] if r["id"] == check_id and r["status"] == status]


def test_consistent_per_node_configs_that_differ_only_in_rank_pass(job):
    doc = job.check(ACCELERATE, "launch", "train.py")
    assert failures(doc) == []
    assert {n for r in found(doc, "JOB002", "pass") for n in r["nodes"]} == set(job.nodes)
    [plan] = [r["evidence"]["launch_plan"] for r in doc["results"] if r["id"] == "JOB001" and r["status"] == "pass"]
    assert [row["machine_rank"] for row in plan] == [0, 1, 2]
    assert len({row["config_sha"] for row in plan}) == 1  # the settings, less machine_rank, are the same
    assert {row["config"] for row in plan} == {str(job.homes[n] / "accelerate" / "default_config.yaml") for n in job.nodes}
    assert {row["main"] for row in plan} == {f"{job.cluster.ip(job.nodes[0])}:29512"}


def test_two_nodes_with_the_same_rank_are_named_and_nobody_else(job):
    job.config("node03", machine_rank=1)
    doc = job.check(ACCELERATE, "launch", "train.py")
    [shared, missing] = found(doc, "JOB002")
    assert shared["nodes"] == ["node02", "node03"] and "machine_rank 1 on 2 nodes" in shared["message"]
    assert str(job.homes["node03"] / "accelerate" / "default_config.yaml") + ":4" in shared["message"]
    assert "no node has machine_rank 2" in missing["message"]
    assert {i for i, _ in failures(doc)} == {"JOB002"}


def test_rank_zero_twice_says_each_hosts_its_own_store(job):
    job.config("node02", machine_rank=0)
    doc = job.check(ACCELERATE, "launch", "train.py")
    [shared] = [r for r in found(doc, "JOB002") if "on 2 nodes" in r["message"]]
    assert shared["nodes"] == ["node01", "node02"] and "its own rendezvous store" in shared["message"]


def test_a_rank_out_of_range_and_the_missing_one(job):
    job.config("node03", machine_rank=3)
    doc = job.check(ACCELERATE, "launch", "train.py")
    messages = [r["message"] for r in found(doc, "JOB002")]
    assert any("machine_rank 3 on node03" in m and "outside 0 to 2" in m for m in messages)
    assert any("no node has machine_rank 2" in m for m in messages)


def test_num_machines_two_on_three_nodes(job):
    for index, node in enumerate(job.nodes):
        job.config(node, machine_rank=index, num_machines=2, num_processes=2)
    doc = job.check(ACCELERATE, "launch", "train.py")
    [wrong] = found(doc, "JOB004")
    assert wrong["nodes"] == job.nodes and "num_machines is 2" in wrong["message"] and "3 nodes" in wrong["message"]


def test_bf16_on_two_nodes_and_fp16_on_one(job):
    job.config("node02", machine_rank=1, mixed_precision="fp16")
    doc = job.check(ACCELERATE, "launch", "train.py")
    [odd] = found(doc, "JOB005")
    assert odd["nodes"] == ["node02"] and "mixed_precision differs" in odd["message"] and "'fp16'" in odd["message"]
    assert f"node02:{job.homes['node02']}/accelerate/default_config.yaml:" in odd["message"]
    assert {i for i, _ in failures(doc)} == {"JOB005"}


def test_a_deepspeed_json_edited_on_one_node(job):
    for index, node in enumerate(job.nodes):
        job.config(node, machine_rank=index, distributed_type="DEEPSPEED", use_cpu=False,
                   deepspeed_config={"deepspeed_config_file": "ds.json", "deepspeed_multinode_launcher": "standard",
                                     "zero3_init_flag": False})
        edited = dict(DEEPSPEED_JSON, train_micro_batch_size_per_gpu=4 if node == "node03" else 1)
        job.file(node, "ds.json", json.dumps(edited, indent=1))
    doc = job.check(ACCELERATE, "launch", "train.py")
    [odd] = found(doc, "JOB006")
    assert odd["nodes"] == ["node03"] and "train_micro_batch_size_per_gpu is 4" in odd["message"]
    assert f"node03:{job.workdir}/ds.json:2" in odd["message"]
    [plan] = [r["evidence"]["launch_plan"] for r in found(doc, "JOB001", "pass")]
    assert [row["zero_stage"] for row in plan] == [2, 2, 2]
    assert {i for i, _ in failures(doc)} == {"JOB006"}


def test_a_stale_script_and_a_missing_one(job):
    job.file("node03", "train.py", "print('an older version')\n")
    (job.folders["node02"] / "train.py").unlink()
    doc = job.check(ACCELERATE, "launch", "train.py", "--data", "data.json")
    messages = {tuple(r["nodes"]): r["message"] for r in found(doc, "JOB007")}
    assert set(messages) == {("node02",), ("node03",)}
    assert "train.py is missing on node02" in messages[("node02",)]
    assert "train.py differs on node03" in messages[("node03",)]


def test_flags_in_the_command_override_every_nodes_file(job):
    doc = job.check(ACCELERATE, "launch", "--machine_rank", "0", "--num_processes", "7", "train.py")
    [rank] = [r for r in found(doc, "JOB002") if "on 3 nodes" in r["message"]]
    assert rank["nodes"] == job.nodes and "(flag --machine_rank)" in rank["message"]
    divide = [r for r in found(doc, "JOB004") if "does not divide" in r["message"]]
    assert {n for r in divide for n in r["nodes"]} == set(job.nodes) and "num_processes 7" in divide[0]["message"]


def test_a_variable_in_the_command_is_each_nodes_own(job):
    for node, rank in zip(job.nodes, ("0", "1", "1")):
        job.cluster.set_env(node, NODE_RANK=rank)
    doc = job.check(ACCELERATE, "launch", "--machine_rank", "$NODE_RANK", "train.py")
    [shared] = [r for r in found(doc, "JOB002") if "on 2 nodes" in r["message"]]
    assert shared["nodes"] == ["node02", "node03"]


def test_a_start_up_file_that_prints_is_named_and_the_facts_still_come(job):
    with job.cluster.noisy_shell_fault("node02", "Welcome to node02, have a nice day"):
        doc = job.check(ACCELERATE, "launch", "train.py", only="JOB,SSH")
    [noisy] = found(doc, "JOB009", "warn")
    assert noisy["nodes"] == ["node02"] and "Welcome to node02" in noisy["message"]
    assert {n for r in found(doc, "SSH001", "pass") for n in r["nodes"]} == set(job.nodes)


def test_a_launcher_missing_from_one_nodes_path(job):
    venv_bin = str(Path(sys.executable).parent)
    for node in job.nodes[:2]:
        job.cluster.set_env(node, PATH=f"{venv_bin}:/usr/local/bin:/usr/bin:/bin")
    doc = job.check("accelerate", "launch", "train.py")
    [missing] = found(doc, "JOB010")
    assert missing["nodes"] == ["node03"] and "not found on the non-interactive SSH PATH" in missing["message"]


def test_per_node_config_files_on_the_command_line_that_differ_only_in_rank_pass(job):
    for index, node in enumerate(job.nodes):
        job.config(node, "accelerate.yaml", machine_rank=index)
    doc = job.check(ACCELERATE, "launch", "--config_file", "accelerate.yaml", "train.py")
    assert failures(doc) == []
    [same] = found(doc, "JOB007", "pass")
    assert set(same["nodes"]) == set(job.nodes) and "accelerate.yaml" in same["message"]


def test_a_config_file_on_the_command_line_with_another_setting_still_fails(job):
    for index, node in enumerate(job.nodes):
        job.config(node, "accelerate.yaml", machine_rank=index, num_processes=6 if node == "node03" else 3)
    doc = job.check(ACCELERATE, "launch", "--config_file", "accelerate.yaml", "train.py")
    [odd] = found(doc, "JOB007")
    assert odd["nodes"] == ["node03"] and "accelerate.yaml differs on node03" in odd["message"]
    assert "as accelerate reads it" in odd["message"]


def test_a_deepspeed_config_in_another_formatting_is_the_same_and_another_setting_is_not(job):
    for node in job.nodes:
        text = json.dumps(DEEPSPEED_JSON, indent=4, sort_keys=True) if node == "node02" else json.dumps(DEEPSPEED_JSON)
        job.file(node, "ds.json", text)
    doc = job.check(ACCELERATE, "launch", "train.py", "--deepspeed", "ds.json")
    assert failures(doc) == []
    job.file("node03", "ds.json", json.dumps(dict(DEEPSPEED_JSON, zero_optimization={"stage": 3})))
    doc = job.check(ACCELERATE, "launch", "train.py", "--deepspeed", "ds.json")
    [odd] = found(doc, "JOB007")
    assert odd["nodes"] == ["node03"] and "ds.json differs on node03" in odd["message"]


def test_spellings_of_the_same_head_and_precision_pass(job):
    job.config("node02", machine_rank=1, main_process_ip="node01", mixed_precision="BF16")
    doc = job.check(ACCELERATE, "launch", "train.py")
    assert failures(doc) == []
    assert {n for r in found(doc, "JOB005", "pass") for n in r["nodes"]} == set(job.nodes)


def test_a_name_of_another_host_and_one_a_node_cannot_resolve_fail(job):
    job.config("node02", machine_rank=1, main_process_ip="no-such-head")
    job.config("node03", machine_rank=2, main_process_ip="node03")
    doc = job.check(ACCELERATE, "launch", "train.py")
    messages = {tuple(r["nodes"]): r["message"] for r in found(doc, "JOB005")}
    assert set(messages) == {("node02",), ("node03",)}, messages
    assert "main_process_ip 'no-such-head' does not resolve on node02" in messages[("node02",)]
    assert "node03 has 'node03', which reaches node03 there" in messages[("node03",)]


def test_without_a_launch_command_the_job_checks_say_so_not_that_no_node_was_reached():
    from preflight import registry, runner
    from preflight.plan import build_plan

    plan = build_plan(nodes=("n1", "n2"))
    plan = plan.__class__(**{**plan.__dict__, "remote": True})
    ctx = runner.CheckContext(plan, {n: {"facts": {"host": {}}, "error": None} for n in plan.nodes}, {"job": {}})
    [result] = runner.run_check(registry.load().get("JOB002"), ctx)
    assert result.status.value == "skip" and result.message == "no launch command given (after `--`)", result
