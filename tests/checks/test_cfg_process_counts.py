"""num_processes as accelerate reads it, the total over all machines, where DeepSpeed's runner starts the job:
accelerate passes it `--num_gpus num_processes // num_machines` (accelerate/utils/launch.py prepare_deepspeed_cmd_env),
and the runner gives every host the slots 0 to that number - 1 (deepspeed/launcher/runner.py
apply_num_nodes_and_gpus)."""
from __future__ import annotations

import pytest

from conftest import run_cli

# The multi-node template as it is copied around: num_processes and gpu_ids "on this machine".
TEMPLATE = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_hostfile: hostfile
  zero_stage: 2
distributed_type: DEEPSPEED
gpu_ids: 0,1,2,3,4,5,6,7  # GPUs on this machine
machine_rank: 0
main_process_ip: node01
main_process_port: 29500
mixed_precision: bf16
num_machines: 2
num_processes: {procs}
"""


@pytest.fixture(autouse=True)
def empty_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def lint(capsys, tmp_path, text, hostfile="node01 slots=8\nnode02 slots=8\n"):
    (tmp_path / "accelerate.yaml").write_text(text)
    (tmp_path / "hostfile").write_text(hostfile)
    code, doc, err = run_cli(capsys, "lint", "--config", tmp_path / "accelerate.yaml", "--json")
    assert code in (0, 1), err
    return doc


def of(doc, check_id):
    return [r for r in doc["results"] if r["id"] == check_id]


@pytest.mark.parametrize("launcher", ["", "  deepspeed_multinode_launcher: pdsh\n",
                                      "  deepspeed_multinode_launcher: nossh\n"])
def test_num_processes_per_node_under_deepspeeds_runner_warns(capsys, tmp_path, launcher):
    text = TEMPLATE.format(procs=8).replace("  zero_stage: 2\n", "  zero_stage: 2\n" + launcher)
    doc = lint(capsys, tmp_path, text)
    per_node = [r for r in of(doc, "CFG020") if "the number of gpu_ids of one machine" in r["message"]]
    assert [r["status"] for r in per_node] == ["warn"], of(doc, "CFG020")
    assert f"accelerate.yaml:{12 + bool(launcher)}: num_processes is 8" in per_node[0]["message"]
    assert "accelerate passes --num_gpus 4 to DeepSpeed's runner, so each node runs 4 processes and leaves the " \
           "other 4 of its 8 GPUs idle" in per_node[0]["message"]
    assert per_node[0]["remediation"] == "to use every listed GPU on every machine, set num_processes: 16"
    # the hostfile's slots disagree too: the fix mends num_processes, not the slots
    fixes = {r["remediation"] for r in of(doc, "CFG021") if r["status"] == "fail"}
    assert fixes == {"set num_processes to 16, the total over all hosts (or slots=4)"}, of(doc, "CFG021")


def test_num_processes_over_all_machines_under_deepspeeds_runner_passes(capsys, tmp_path):
    doc = lint(capsys, tmp_path, TEMPLATE.format(procs=16))
    assert [r["status"] for r in of(doc, "CFG020")] == ["pass"], of(doc, "CFG020")
    assert [r["status"] for r in of(doc, "CFG021")] == ["pass"], of(doc, "CFG021")


def test_gpu_ids_other_than_the_runners_slots_are_still_not_read(capsys, tmp_path):
    doc = lint(capsys, tmp_path, TEMPLATE.format(procs=8).replace("0,1,2,3,4,5,6,7", "4,5,6,7"),
               hostfile="node01 slots=4\nnode02 slots=4\n")
    assert [(r["status"], r["message"].split(": ", 1)[1]) for r in of(doc, "CFG020")] == [
        ("warn", "gpu_ids '4,5,6,7' is not read: under DeepSpeed's runner each node uses the GPUs of its hostfile "
                 "slots")]


def test_a_host_filter_gives_the_runner_its_gpus(capsys, tmp_path):
    # with a filter accelerate passes --include instead of --num_gpus: num_processes is not divided
    text = TEMPLATE.format(procs=8).replace("  zero_stage: 2\n", "  zero_stage: 2\n  deepspeed_inclusion_filter: "
                                                                  "node01@node02\n")
    doc = lint(capsys, tmp_path, text)
    assert not [r for r in of(doc, "CFG020") if "the number of gpu_ids of one machine" in r["message"]], \
        of(doc, "CFG020")
