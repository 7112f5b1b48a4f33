"""`lint --sbatch SCRIPT`: a SLURM batch script read as sbatch, srun and the launcher run it
(preflight.inputs.batchscript) and judged by the CFG07x checks (checks/config/batch.py); its launch line goes through
the lint pipeline as `-- COMMAND` does. Real scripts from public repositories and threads are in tests/fixtures/sbatch (README there)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from lint_results import assert_refused_in_one_line, statuses, unreadable_files, without_slurm_environment
from lint_results import lint as lint_args
from preflight import cli, engine, registry
from preflight.inputs import batchscript

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sbatch"
BATCH_IDS = ("CFG070", "CFG071", "CFG072", "CFG073", "CFG074")


def lint(capsys, script, *extra):
    """`preflight lint --sbatch SCRIPT --json`: (exit code, {id: [results]})."""
    return lint_args(capsys, "--sbatch", script, *extra)


def script(tmp_path, body, directives="#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:8\n"):
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\n" + directives + body)
    return path


@pytest.fixture(autouse=True)
def clean_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    without_slurm_environment(monkeypatch)


HEALTHY_TORCHRUN = """
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \\
    train.py --lr 1e-4
"""


# ---- real scripts -----------------------------------------------------------------------------------------------

def test_torchtitans_multinode_script_is_clean(capsys):
    code, found = lint(capsys, FIXTURES / "torchtitan_multinode_trainer.slurm")
    assert code == 0, found
    for check_id in BATCH_IDS:
        assert statuses(found, check_id) == ["pass"], (check_id, found.get(check_id))
    assert "computed at run time" in found["CFG073"][0]["message"]  # the head's address is said, not guessed


def test_accelerates_fsdp_example_lints_the_config_it_names(capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DIR", str(FIXTURES / "accelerate"))  # ${ACCELERATE_DIR:-/accelerate}
    code, found = lint(capsys, FIXTURES / "accelerate_submit_multinode_fsdp.sh")
    for check_id in BATCH_IDS:
        assert statuses(found, check_id) == ["pass"], (check_id, found.get(check_id))
    # the fsdp_config.yaml the launch line names is linted as `lint --config` lints it, its flags over the file
    assert statuses(found, "CFG001") == ["pass"]
    args = cli.build_parser().parse_args(["lint", "--json", "--sbatch",
                                          str(FIXTURES / "accelerate_submit_multinode_fsdp.sh")])
    plan = engine.evaluate(registry.load(), args)[0]
    assert plan.accelerate.doc.path == str(FIXTURES / "accelerate" / "examples" / "slurm" / "fsdp_config.yaml")
    assert plan.accelerate.data["distributed_type"] == "FSDP" and plan.accelerate.data["num_processes"] == 16


def test_a_head_address_computed_at_run_time_is_not_judged_as_a_host_name(capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_DIR", str(FIXTURES / "accelerate"))
    code, found = lint(capsys, FIXTURES / "accelerate_submit_multinode_fsdp.sh")
    assert "fail" not in statuses(found, "CFG010"), found["CFG010"]
    assert code == 0


def test_accelerates_example_with_the_script_variable_misspelt_is_said(capsys, tmp_path):
    # accelerate examples/slurm/submit_multinode.sh at 6525931: `$PYTHON_FILE` is set nowhere (accelerate#2881). It
    # sources activateEnviroment.sh first: where that file is here, it is read, and it sets no PYTHON_FILE.
    (tmp_path / "activateEnviroment.sh").write_text("module load cuda\nconda activate train\nexport HF_HOME=/x\n")
    code, found = lint(capsys, FIXTURES / "accelerate_submit_multinode.sh")
    warned = [r for r in found["CFG071"] if r["status"] == "warn"]
    assert len(warned) == 1 and "$PYTHON_FILE" in warned[0]["message"], found["CFG071"]
    assert "never sets" in warned[0]["message"]


def test_a_script_variable_a_sourced_file_may_set_is_not_judged(capsys):
    # the same script linted where activateEnviroment.sh is not: what it sets is not known
    code, found = lint(capsys, FIXTURES / "accelerate_submit_multinode.sh")
    assert statuses(found, "CFG071") == ["pass"], found["CFG071"]
    message = found["CFG071"][0]["message"]
    assert "$PYTHON_FILE, set nowhere in the script: activateEnviroment.sh (sourced, not here)" in message
    assert "not judged" in message


def test_a_multinode_launch_without_srun_runs_on_the_first_node_alone(capsys):
    # accelerate#2816: "I forgot to use srun so I was just starting my script on the main node"
    code, found = lint(capsys, FIXTURES / "no_srun_issue2816.sh")
    assert statuses(found, "CFG071") == ["fail"]
    assert "without srun on a 2-node allocation" in found["CFG071"][0]["message"]
    assert code == 1


def test_a_loop_of_one_srun_per_node_is_read(capsys):
    # accelerate#1645: one `srun -N 1 -n 1 -w NODE bash -c "$LAUNCHER --machine_rank $mrank ..." &` per node
    code, found = lint(capsys, FIXTURES / "loop_of_sruns_issue1645.sh")
    for check_id in BATCH_IDS:
        assert "fail" not in statuses(found, check_id), (check_id, found[check_id])
    assert "loop" in found["CFG071"][0]["message"]
    assert statuses(found, "CFG007") == ["pass"]  # the launcher's words, $LAUNCHER and $CMD split as bash does


# ---- the directives ---------------------------------------------------------------------------------------------

def test_a_variable_in_a_directive_is_literal_text(capsys, tmp_path):
    path = script(tmp_path, HEALTHY_TORCHRUN, "#SBATCH --nodes=$NNODES\n#SBATCH --gres=gpu:8\n")
    code, found = lint(capsys, path)
    assert statuses(found, "CFG070") == ["fail"]
    assert "literal text" in found["CFG070"][0]["message"] and found["CFG070"][0]["evidence"]["line"] == 2


def test_a_directive_after_the_first_command_is_ignored(capsys, tmp_path):
    path = script(tmp_path, "module load cuda\n#SBATCH --nodes=4\n" + HEALTHY_TORCHRUN, "#SBATCH --gres=gpu:8\n")
    code, found = lint(capsys, path)
    assert statuses(found, "CFG070") == ["fail"]
    assert "sbatch ignores it" in found["CFG070"][0]["message"]
    assert found["CFG070"][0]["evidence"]["first_command"] == 3


def test_the_environments_sbatch_variables_override_the_directives(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SBATCH_GPUS_PER_NODE", "4")
    path = script(tmp_path, HEALTHY_TORCHRUN, "#SBATCH --nodes=2\n#SBATCH --gpus-per-node=8\n")
    code, found = lint(capsys, path)
    assert statuses(found, "CFG070") == ["warn"]
    assert "SBATCH_GPUS_PER_NODE=4" in found["CFG070"][0]["message"]
    assert statuses(found, "CFG074") == ["fail"]  # --nproc_per_node 8 on nodes of 4 GPUs, as sbatch will ask


def test_healthy_directives_pass(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, HEALTHY_TORCHRUN))
    assert code == 0, found
    assert statuses(found, "CFG070") == ["pass"]
    assert found["CFG070"][0]["evidence"] == {"file": str(tmp_path / "job.sh"), "nodes": 2, "tasks_per_node": 1,
                                              "gpus_per_node": 8}


# ---- launchers per node -----------------------------------------------------------------------------------------

def test_eight_tasks_per_node_start_eight_launchers_per_node(capsys, tmp_path):
    body = "srun accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --rdzv_backend c10d " \
           "--main_process_ip node01 --main_process_port 29500 train.py\n"
    code, found = lint(capsys, script(tmp_path, body, "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=8\n"
                                                      "#SBATCH --gres=gpu:8\n"))
    assert statuses(found, "CFG071") == ["fail"]
    assert "8 launchers on every node" in found["CFG071"][0]["message"]


def test_srun_torchrun_without_nnodes_makes_each_node_its_own_job(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, "srun torchrun --nproc_per_node 8 train.py\n"))
    assert "fail" in statuses(found, "CFG071")
    assert any("without --nnodes" in r["message"] for r in found["CFG071"])


def test_srun_python_with_one_task_per_node_uses_one_gpu_of_eight(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, "srun python train.py --trainer.num_nodes 2\n"))
    assert statuses(found, "CFG071") == ["warn"]


def test_srun_python_with_one_task_per_gpu_passes(capsys, tmp_path):
    path = script(tmp_path, "srun python train.py\n", "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=8\n"
                                                      "#SBATCH --gpus-per-node=8\n")
    code, found = lint(capsys, path)
    assert statuses(found, "CFG071") == ["pass"] and statuses(found, "CFG074") == ["pass"]
    assert code == 0


# ---- node rank and the batch step -------------------------------------------------------------------------------

RANKED = ("srun {wrap}accelerate launch --multi_gpu --num_machines 2 --num_processes 16 --machine_rank {rank} "
          "--main_process_ip $MASTER_ADDR --main_process_port 29500 train.py{end}\n")
HEAD = 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'


@pytest.mark.parametrize("wrap,rank,end", [
    ("", "$SLURM_PROCID", ""),  # expanded once, in the batch step
    ("", "$SLURM_NODEID", ""),
    ('bash -c "', "$SLURM_NODEID", '"'),  # a double-quoted string: still the batch step's
])
def test_a_rank_the_batch_step_expands_is_zero_on_every_node(capsys, tmp_path, wrap, rank, end):
    code, found = lint(capsys, script(tmp_path, HEAD + RANKED.format(wrap=wrap, rank=rank, end=end)))
    assert statuses(found, "CFG072") == ["fail"], found["CFG072"]
    assert "every node's launcher gets rank 0" in found["CFG072"][0]["message"]
    assert found["CFG072"][0]["evidence"]["variable"] == rank[1:]


@pytest.mark.parametrize("wrap,rank,end", [
    ("bash -c '", "$SLURM_NODEID", "'"),  # single quotes: each task's shell expands it
    ('bash -c "', "\\$SLURM_NODEID", '"'),  # escaped
    ("bash -c '", "$SLURM_PROCID", "'"),  # one task per node: the task's rank is the node's
])
def test_a_rank_each_task_expands_passes(capsys, tmp_path, wrap, rank, end):
    code, found = lint(capsys, script(tmp_path, HEAD + RANKED.format(wrap=wrap, rank=rank, end=end)))
    assert statuses(found, "CFG072") == ["pass"], found["CFG072"]


def test_slurm_procid_with_several_tasks_per_node_is_not_the_node_rank(capsys, tmp_path):
    body = HEAD + "srun --ntasks-per-node=2 bash -c 'torchrun --nnodes 2 --nproc_per_node 4 " \
                  "--node_rank $SLURM_PROCID --master_addr $MASTER_ADDR --master_port 29500 train.py'\n"
    code, found = lint(capsys, script(tmp_path, body))
    assert statuses(found, "CFG072") == ["fail"] and "not the node's" in found["CFG072"][0]["message"]


def test_one_literal_rank_on_every_node(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, HEAD + RANKED.format(wrap="", rank="0", end="")))
    assert statuses(found, "CFG072") == ["fail"] and "they all claim one rank" in found["CFG072"][0]["message"]


def test_a_rendezvous_that_gives_ranks_needs_no_node_rank(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, HEALTHY_TORCHRUN))
    assert statuses(found, "CFG072") == ["pass"] and "c10d" in found["CFG072"][0]["message"]


# ---- the head's address -----------------------------------------------------------------------------------------

def test_a_head_address_computed_in_each_task_names_each_node(capsys, tmp_path):
    body = "srun bash -c 'export MASTER_ADDR=$(hostname); torchrun --nnodes 2 --nproc_per_node 8 " \
           "--node_rank $SLURM_NODEID --master_addr $MASTER_ADDR --master_port 29500 train.py'\n"
    code, found = lint(capsys, script(tmp_path, body))
    assert statuses(found, "CFG073") == ["fail"] and "computed in each task" in found["CFG073"][0]["message"]


def test_a_head_address_not_exported_is_empty_in_the_task(capsys, tmp_path):
    body = 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n' \
           "srun bash -c 'torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint " \
           "$MASTER_ADDR:29500 train.py'\n"
    code, found = lint(capsys, script(tmp_path, body))
    assert statuses(found, "CFG073") == ["fail"] and "without export" in found["CFG073"][0]["message"]


def test_localhost_on_several_nodes_points_each_at_itself(capsys, tmp_path):
    body = "srun torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint localhost:29500 train.py\n"
    code, found = lint(capsys, script(tmp_path, body))
    assert statuses(found, "CFG073") == ["fail"]


def test_a_head_address_exported_from_the_batch_step_passes(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, HEALTHY_TORCHRUN))
    assert statuses(found, "CFG073") == ["pass"]


# ---- world size and GPUs per task -------------------------------------------------------------------------------

def test_num_processes_against_nodes_times_gpus(capsys, tmp_path):
    body = HEAD + "srun accelerate launch --multi_gpu --num_machines $SLURM_NNODES --num_processes 8 " \
                  "--rdzv_backend c10d --main_process_ip $MASTER_ADDR --main_process_port 29500 train.py\n"
    code, found = lint(capsys, script(tmp_path, body))
    assert statuses(found, "CFG074") == ["fail"] and "expected 2 nodes x 8 GPUs = 16" in found["CFG074"][0]["message"]


def test_num_processes_computed_from_slurm_passes(capsys, tmp_path):
    body = HEAD + "GPUS_PER_NODE=8\nsrun accelerate launch --multi_gpu --num_machines $SLURM_NNODES " \
                  "--num_processes $((SLURM_NNODES * GPUS_PER_NODE)) --rdzv_backend c10d " \
                  "--main_process_ip $MASTER_ADDR --main_process_port 29500 train.py\n"
    code, found = lint(capsys, script(tmp_path, body))
    assert statuses(found, "CFG074") == ["pass"], found["CFG074"]


def test_gpus_per_node_the_directives_do_not_give_are_not_judged(capsys, tmp_path):
    # no --gres, no --gpus-per-node (a partition of GPU nodes): the processes per node are not compared, and said so
    body = HEAD + "srun accelerate launch --multi_gpu --num_machines $SLURM_NNODES --num_processes 8 " \
                  "--rdzv_backend c10d --main_process_ip $MASTER_ADDR --main_process_port 29500 train.py\n"
    code, found = lint(capsys, script(tmp_path, body, "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"))
    [result] = found["CFG074"]
    assert result["status"] == "pass" and "the GPUs per node: not in the directives; the launch's processes are " \
        "not compared (not judged)" in result["message"], result


def test_one_gpu_per_task_for_a_launcher_of_eight_processes(capsys, tmp_path):
    path = script(tmp_path, HEALTHY_TORCHRUN, "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
                                              "#SBATCH --gpus-per-task=1\n")
    code, found = lint(capsys, path)
    assert "fail" in statuses(found, "CFG074")
    assert any("--gpus-per-task=1" in r["message"] for r in found["CFG074"])


def test_one_gpu_per_task_with_one_task_per_gpu_is_device_zero_only(capsys, tmp_path):
    # whether the script picks cuda:0 or cuda:LOCAL_RANK is its own code: said, not warned
    path = script(tmp_path, "srun python train.py\n", "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=8\n"
                                                      "#SBATCH --gpus-per-task=1\n")
    code, found = lint(capsys, path)
    assert statuses(found, "CFG074") == ["pass"] and "device 0" in found["CFG074"][0]["message"]


# ---- the reader: what it reads and what it says it did not --------------------------------------------------------

def test_the_reader_keeps_continuations_quotes_heredocs_and_helpers(tmp_path):
    path = script(tmp_path, """
nodes=( $(scontrol show hostnames $SLURM_JOB_NODELIST) )
head=$(srun --nodes=1 --ntasks=1 -w "${nodes[0]}" hostname --ip-address)
cat > ds_config.json <<EOF
{"train_batch_size": 16, "text": "srun torchrun --nnodes 9"}
EOF
srun hostname
source env.sh
srun --label deepspeed --num_gpus 8 train.py \\
   --deepspeed ds_config.json \\
   --note "a b \\
c"
""")
    read = batchscript.load(str(path))
    assert [s.command.launcher for s in read.steps] == ["deepspeed"]  # not the heredoc's text
    assert read.steps[0].line == 13 and read.steps[0].srun == {"label": ""}  # lines 1-4: #! and the directives
    assert read.steps[0].command.script_args[-1] == "a b c"  # backslash-newline inside double quotes: removed
    assert read.helpers == ((7, "hostname --ip-address"), (11, "hostname"))  # in $(...) too
    assert read.written_files == {"ds_config.json": 8}
    assert read.unread == ((12, "sources env.sh: the variables it sets are not read"),)


@pytest.mark.parametrize("text", [
    "srun bash -c 'unterminated",
    "srun torchrun \"$(echo ((( \" --nnodes",
    "cat <<EOF\nno end",
    "for i in $(seq 1 4); do srun -N1 -n1 torchrun --nnodes 1 train.py & done; wait",
    "srun ${A:-${B:-${C}}} `x` $'\\x41' $((1/0)) train.py",
    "((x++))\n{ srun python t.py; } | tee log\n( srun python t.py )",
    "f() { srun torchrun --nnodes 2 train.py; }\nf",
    "case $X in\n a|b) srun torchrun t.py;;\n (c) srun python t.py;;\nesac\nesac\n;;\n0)",
    "f() ( srun torchrun t.py )\nf\nfunction g { g \"$@\"; }\ng a\nh() {\nsrun x",
    "cat <<-EOF > ds.json\n\t{\"a\": $((x\n\tEOF\nA=(a b\nsrun torchrun ${A[9]} ${A[@]} ${A[x]} ${#A[@]} t.py",
])
def test_odd_shell_never_breaks_the_reader(text):
    read = batchscript.parse("job.sh", "#!/bin/bash\n#SBATCH -N 2\n" + text + "\n", {})
    assert read.allocation.nodes == 2


def test_a_large_script_is_read_in_bounded_time():
    line = "srun torchrun --nnodes 2 --nproc_per_node 8 train.py --a \"$X\" 'b c' $(hostname) \\\n  --x y\n"
    text = "#!/bin/bash\n#SBATCH -N 2\n" + line * (batchscript.MAX_BYTES // len(line))
    started = time.monotonic()
    read = batchscript.parse("job.sh", text, {})
    assert time.monotonic() - started < 30
    assert len(read.steps) == batchscript.MAX_STEPS
    assert "more launch lines" in read.unread[-1][1]


# ---- bad input --------------------------------------------------------------------------------------------------

def test_bad_input_is_one_line_naming_the_file(tmp_path):
    cases = unreadable_files(tmp_path, ".sh", batchscript.MAX_BYTES, b"#!")
    (tmp_path / "train.py").write_text("import torch\n")
    cases[tmp_path / "train.py"] = "first line must start with #!"
    assert_refused_in_one_line(batchscript.load, cases)


# ---- the files the launch line names ----------------------------------------------------------------------------

def test_the_deepspeed_config_the_training_script_is_given_is_linted(capsys, tmp_path):
    (tmp_path / "ds.json").write_text('{"train_batch_size": 16, "zero_optimization": {"stage": 7}}')
    code, found = lint(capsys, script(tmp_path, HEALTHY_TORCHRUN.replace("--lr 1e-4", "--deepspeed ds.json")))
    assert statuses(found, "CFG040") == ["fail"]  # as `lint --deepspeed ds.json` says it
    assert code == 1


def test_a_config_the_script_writes_when_it_runs_is_not_missing(capsys, tmp_path):
    body = HEAD + "cat > accel.yaml <<EOF\ndistributed_type: MULTI_GPU\nEOF\n" \
                  "srun accelerate launch --config_file accel.yaml --num_machines 2 --num_processes 16 " \
                  "--rdzv_backend c10d --main_process_ip node01 --main_process_port 29500 train.py\n"
    code, found = lint(capsys, script(tmp_path, body))
    assert batchscript.load(str(tmp_path / "job.sh")).written_files == {"accel.yaml": 6}
    assert "fail" not in statuses(found, "CFG007"), found["CFG007"]


@pytest.mark.parametrize("launch", [
    "python -m torch.distributed.run --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d "
    "--rdzv_endpoint $MASTER_ADDR:29500 train.py",
    "env NCCL_DEBUG=INFO torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d "
    "--rdzv_endpoint $MASTER_ADDR:29500 train.py",
    "singularity exec --nv -B /data img.sif torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d "
    "--rdzv_endpoint $MASTER_ADDR:29500 train.py",
])
def test_the_launcher_is_found_behind_modules_env_and_containers(capsys, tmp_path, launch):
    code, found = lint(capsys, script(tmp_path, HEAD + "srun " + launch + "\n"))
    assert code == 0, found
    assert "running torchrun" in found["CFG071"][0]["message"]


def test_a_rank_kept_in_a_variable_of_the_batch_step_is_zero_on_every_node(capsys, tmp_path):
    # accelerate#3312: MACHINE_RANK=${SLURM_NODEID:-0} set in the batch script, then given to every node's launcher
    body = HEAD + "MACHINE_RANK=${SLURM_NODEID:-0}\nNUM_MACHINES=${SLURM_NNODES:-1}\n" \
                  "srun accelerate launch --multi_gpu --num_machines $NUM_MACHINES --num_processes 16 " \
                  "--machine_rank $MACHINE_RANK --main_process_ip $MASTER_ADDR --main_process_port 29500 train.py\n"
    code, found = lint(capsys, script(tmp_path, body))
    assert statuses(found, "CFG072") == ["fail"], found["CFG072"]
    assert found["CFG072"][0]["evidence"]["variable"] == "SLURM_NODEID"
    assert statuses(found, "CFG074") == ["pass"]  # ${SLURM_NNODES:-1} is the allocation's 2


# ---- shell forms real scripts use: functions, case, arrays, heredocs, SLURM's own variables ----------------------

def test_bigscience_176B_script_reads_its_heredoc_config_and_launcher_strings(capsys):
    # bigscience tr11-176B-ml.slurm: the DeepSpeed JSON written by an unquoted heredoc from the script's variables,
    # the launcher and its arguments in strings, `srun bash -c "$LAUNCHER --node_rank \$SLURM_PROCID $CMD"`
    code, found = lint(capsys, FIXTURES / "bigscience_tr11_176B_ml.slurm")
    assert code == 0, found
    for check_id in BATCH_IDS + ("CFG076",):
        assert statuses(found, check_id) == ["pass"], (check_id, found.get(check_id))
    assert found["CFG071"][0]["evidence"]["line"] == 219  # not the data-preparing `python` of line 43
    assert "'`pwd`/pretrain_gpt.py'" in found["CFG007"][0]["message"]  # as written: computed at run time
    read = batchscript.load(str(FIXTURES / "bigscience_tr11_176B_ml.slurm"))
    heredoc = read.written("./ds_config.$SLURM_JOB_ID.json")
    assert heredoc.runtime == () and '"train_batch_size": 2048' in heredoc.text and '"stage": 0' in heredoc.text
    assert [(reader, option) for reader, option, _ in read.named_configs()] == [("deepspeed", "--deepspeed_config")]


def test_slurms_own_variables_are_set_at_run_time(capsys):
    # AMDResearch/hpcfund#47: `--rdzv_id "$SLURM_JOB_ID"`; SLURM sets it in the batch step: not a variable set nowhere
    code, found = lint(capsys, FIXTURES / "srun_torchrun_issue_hpcfund47.sh")
    assert code == 0, found
    assert statuses(found, "CFG071") == ["pass"], found["CFG071"]
    body = "srun torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node01:29500 " \
           "--rdzv_id $SLURM_JOB_ID train.py\n"
    code, found = lint(capsys, script(Path("."), body))
    assert statuses(found, "CFG071") == ["pass"] and "'train.py'" in found["CFG007"][0]["message"]


FUNCTION = """
launch() {
  srun torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 "$@"
}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
launch train.py --lr 1e-4
"""


def test_a_launch_in_a_function_is_read_where_it_is_called(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, FUNCTION))
    assert code == 0, found
    assert statuses(found, "CFG071") == ["pass"], found["CFG071"]  # $MASTER_ADDR is set by the time it is called
    assert "'train.py'" in found["CFG007"][0]["message"]  # "$@": the call's words
    read = batchscript.load(str(tmp_path / "job.sh"))
    assert read.main.line == 7 and read.main.command.script_args == ("--lr", "1e-4")


def test_a_function_never_called_is_said_not_to_run(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, FUNCTION.replace("launch train.py", "echo train.py")))
    assert statuses(found, "CFG071") == ["skip"]
    assert "function launch is defined but never called" in found["CFG071"][0]["message"]


CASE = """
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
case $SLURM_NNODES in
  1) srun torchrun --standalone --nnodes 1 --nproc_per_node 8 train.py ;;
  *) srun torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 --rdzv_backend c10d \\
       --rdzv_endpoint $MASTER_ADDR:29500 train.py ;;
esac
"""


def test_a_case_on_a_value_the_directives_give_runs_its_branch(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, CASE))
    assert code == 0, found
    assert [r["evidence"]["line"] for r in found["CFG071"]] == [9], found["CFG071"]  # `*)`: the 2-node branch


def test_a_case_decided_at_run_time_is_said(capsys, tmp_path):
    text = CASE.replace("case $SLURM_NNODES in", "MODE=$(cat mode)\ncase $MODE in")
    code, found = lint(capsys, script(tmp_path, text))
    read = batchscript.load(str(tmp_path / "job.sh"))
    assert read.unread[0] == (8, "case $MODE: chosen at run time; every branch is read and the first launch in "
                                 "them judged")
    assert read.main.line == 9 and read.main.conditional


PER_TASK_CASE = HEAD + """srun bash -c 'case $SLURM_NODEID in
0) torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 --master_addr $MASTER_ADDR --master_port 29500 train.py ;;
*) torchrun --nnodes 2 --node_rank {rank} --nproc_per_node 8 --master_addr $MASTER_ADDR --master_port 29500 train.py ;;
esac'
"""


def test_each_task_picks_its_node_rank_by_case(capsys, tmp_path):
    code, found = lint(capsys, script(tmp_path, PER_TASK_CASE.format(rank=1)))
    assert statuses(found, "CFG072") == ["pass"], found["CFG072"]
    assert found["CFG072"][0]["evidence"]["branches"] == ["0", "1"]
    code, found = lint(capsys, script(tmp_path, PER_TASK_CASE.format(rank=0)))
    assert statuses(found, "CFG072") == ["fail"] and "claim one rank" in found["CFG072"][0]["message"]


def test_an_array_of_launcher_options_is_expanded(capsys, tmp_path):
    body = HEAD + 'ARGS=(--nnodes $SLURM_NNODES --nproc_per_node 8 --rdzv_backend c10d\n' \
                  '      --rdzv_endpoint "$MASTER_ADDR:29500")\nsrun torchrun "${ARGS[@]}" train.py\n'
    code, found = lint(capsys, script(tmp_path, body))
    assert code == 0, found
    assert statuses(found, "CFG071") == ["pass"] and statuses(found, "CFG074") == ["pass"]
    path = script(tmp_path, body.replace("--nproc_per_node 8", "--nproc_per_node 4"))
    code, found = lint(capsys, path)
    assert statuses(found, "CFG074") == ["fail"]  # the array's 4 against the allocation's 8 GPUs


def test_an_array_of_run_time_values_stays_unknown():
    read = batchscript.parse("job.sh", "#!/bin/bash\n#SBATCH -N 2\nnodes=( $(scontrol show hostnames) )\n"
                                       "srun -w ${nodes[0]} torchrun --nnodes 2 --master_addr ${nodes[1]} t.py\n", {})
    assert read.main.srun == {"nodelist": "${nodes[0]}"}
    assert read.main.value_of("master_addr").text == "${nodes[1]}"


HEREDOC = HEAD + """MICRO=4
cat > ds.json <<{delimiter}
{{"train_micro_batch_size_per_gpu": $MICRO, "train_batch_size": $GLOBAL, "zero_optimization": {{"stage": 2}}}}
{end}
srun torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \\
    train.py --deepspeed ds.json
"""


def test_a_heredoc_config_is_read_as_the_batch_shell_writes_it(capsys, tmp_path):
    text = HEREDOC.replace("MICRO=4\n", "MICRO=4\nGLOBAL=$((MICRO * 16))\n")
    code, found = lint(capsys, script(tmp_path, text.format(delimiter="EOF", end="EOF")))
    assert statuses(found, "CFG076") == ["pass"], found["CFG076"]
    heredoc = batchscript.load(str(tmp_path / "job.sh")).written("ds.json")
    assert heredoc.text == '{"train_micro_batch_size_per_gpu": 4, "train_batch_size": 64, ' \
                           '"zero_optimization": {"stage": 2}}'
    assert heredoc.document_text().count("\n") == 8 and heredoc.body_line == 9  # keys keep the script's lines


def test_a_quoted_heredoc_is_written_as_it_is(tmp_path):
    path = script(tmp_path, HEREDOC.format(delimiter="'EOF'", end="EOF"))
    heredoc = batchscript.load(str(path)).written("./ds.json")
    assert "$MICRO" in heredoc.text and heredoc.runtime == () and heredoc.unset == ()


def test_a_heredoc_computed_at_run_time_is_said(capsys, tmp_path):
    text = HEREDOC.replace("MICRO=4\n", "MICRO=4\nGLOBAL=$(python -c 'print(4 * 16)')\n")
    code, found = lint(capsys, script(tmp_path, text.format(delimiter="EOF", end="EOF")))
    assert statuses(found, "CFG076") == ["pass"]
    assert "computed at run time" in found["CFG076"][0]["message"] and "$GLOBAL" in found["CFG076"][0]["message"]


def test_a_heredoc_variable_set_nowhere_is_the_environments(capsys, tmp_path):
    # sbatch exports the environment it is submitted from: a $GLOBAL the script never sets may come from there
    code, found = lint(capsys, script(tmp_path, HEREDOC.format(delimiter="EOF", end="EOF")))
    assert statuses(found, "CFG076") == ["pass"]
    message = found["CFG076"][0]["message"]
    assert "computed at run time" in message and "$GLOBAL (set nowhere in the script" in message


def test_a_heredoc_config_that_does_not_load_is_the_scripts_finding(capsys, tmp_path):
    # a literal heredoc that is no JSON: a finding of the script (the launcher stops on it), not bad input
    text = HEREDOC.replace("$MICRO, ", ", ").replace("$GLOBAL", "64").format(delimiter="'EOF'", end="EOF")
    code, found = lint(capsys, script(tmp_path, text))
    assert code == 1 and statuses(found, "CFG076") == ["fail"]
    assert found["CFG076"][0]["message"].startswith(f"{tmp_path / 'job.sh'}:8: malformed JSON")


def test_a_config_written_after_the_launch_is_missing_when_it_starts(capsys, tmp_path):
    text = HEREDOC.replace("MICRO=4\n", "MICRO=4\nGLOBAL=64\n").format(delimiter="EOF", end="EOF")
    launch = text[text.index("srun torchrun"):]
    code, found = lint(capsys, script(tmp_path, text.replace(launch, "").replace("cat >", launch + "cat >")))
    assert statuses(found, "CFG076") == ["fail"] and "written after the launch" in found["CFG076"][0]["message"]


def test_a_heredoc_config_is_linted_as_lint_lints_it(capsys, tmp_path):
    text = HEREDOC.replace("MICRO=4\n", "MICRO=4\nGLOBAL=64\n").replace('"stage": 2', '"stage": 7')
    code, found = lint(capsys, script(tmp_path, text.format(delimiter="EOF", end="EOF")))
    assert statuses(found, "CFG040") == ["fail"], found.get("CFG040")  # as `lint --deepspeed` says it
    assert found["CFG040"][0]["message"].startswith(f"{tmp_path / 'job.sh'}:9: zero_optimization.stage is 7")
    text = HEREDOC.replace("MICRO=4\n", "MICRO=4\nGLOBAL=$(cat global)\n")  # computed at run time: not linted
    code, found = lint(capsys, script(tmp_path, text.format(delimiter="EOF", end="EOF")))
    assert statuses(found, "CFG040") == ["skip"]


# ---- what bash, sbatch and srun really do, where a guess used to become a FAIL --------------------------------------

DIRECTIVES = "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8\n"
EXPORTED_HEAD = 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
TORCHRUN_IN_TASK = ("srun bash -c 'torchrun --nnodes 2 --nproc_per_node 8 --node_rank $SLURM_NODEID "
                    "--master_addr $MASTER_ADDR --master_port 29500 train.py'\n")


@pytest.mark.parametrize("body", [
    # launcher options in a bash array over several lines, one element a command's output
    "declare -a ARGS=(\n  --nproc_per_node=8\n  --nnodes=$SLURM_JOB_NUM_NODES\n  --rdzv_id=$SLURM_JOB_ID\n"
    "  --rdzv_backend=c10d\n  --rdzv_endpoint=$(hostname)\n)\nARGS+=(--max_restarts=0)\nsrun torchrun \"${ARGS[@]}\" t.py\n",
    # $RANDOM: bash sets it, a number each time it is read
    EXPORTED_HEAD + "srun torchrun --nnodes 2 --nproc_per_node 8 --rdzv_id $RANDOM --rdzv_backend c10d "
                    "--rdzv_endpoint $MASTER_ADDR:29500 train.py\n",
    EXPORTED_HEAD + "srun bash -c 'torchrun --nnodes 2 --nproc_per_node 8 --rdzv_id $RANDOM --rdzv_backend c10d "
                    "--rdzv_endpoint $MASTER_ADDR:$((10000 + RANDOM % 20000)) train.py'\n",
    # `: "${VAR:=default}"` assigns
    ': "${SCRIPT:=train.py}"\nhead=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
    'srun torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $head:29500 "$SCRIPT"\n',
    # every way a variable reaches the tasks' environment
    "set -a\nMASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\nset +a\n" + TORCHRUN_IN_TASK,
    "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\nexport MASTER_ADDR\n" + TORCHRUN_IN_TASK,
    "declare -x MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n" + TORCHRUN_IN_TASK,
    "setup() {\n  export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n}\nsetup\n"
    + TORCHRUN_IN_TASK,
    "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
    + TORCHRUN_IN_TASK.replace("srun ", "srun --export=ALL,MASTER_ADDR=$MASTER_ADDR "),
    "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
    + TORCHRUN_IN_TASK.replace("srun ", "MASTER_ADDR=$MASTER_ADDR srun "),
    # a heredoc's #SBATCH lines are the child job's, not this one's
    EXPORTED_HEAD + "cat > eval.sbatch <<'EOT'\n#!/bin/bash\n#SBATCH --nodes=1\npython eval.py\nEOT\n"
                    "sbatch --dependency=afterok:$SLURM_JOB_ID eval.sbatch\n" + HEALTHY_TORCHRUN,
    # a condition this reader can decide picks its branch: `[ -z "$X" ]` of a variable set nowhere is true
    'if [ -z "$TRAINING_SCRIPT" ]; then\n  TRAINING_SCRIPT=train.py\nfi\n' + EXPORTED_HEAD
    + "srun torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 "
      "$TRAINING_SCRIPT\n",
    # $(( ... )) that is a subshell, not arithmetic (bash tries arithmetic, then command substitution)
    EXPORTED_HEAD + "srun bash -c \"torchrun --nnodes=2 --nproc_per_node=8 --rdzv_conf=is_host=\\$(((SLURM_NODEID)) "
                    "&& echo 0 || echo 1) --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 train.py\"\n",
    # srun options whose value is required (slurm_opt.c: cpu-bind has_arg required_argument)
    EXPORTED_HEAD + HEALTHY_TORCHRUN.replace("srun torchrun", "srun --cpu-bind none --mpi pmix torchrun"),
    # a launcher's options in a variable known only at run time: they may hold --nnodes and --node_rank
    "source ./launch_args.sh\nsrun torchrun $DISTRIBUTED_ARGS train.py --lr 1e-4\n",
])
def test_a_working_script_gets_no_fail(capsys, tmp_path, body):
    code, found = lint(capsys, script(tmp_path, body, DIRECTIVES))
    failed = [r for results in found.values() for r in results if r["status"] in ("fail", "error")]
    assert code == 0 and not failed, failed


def test_one_launcher_per_gpu_task_each_its_own_rendezvous_node(capsys, tmp_path):
    # --gpus-per-task=1, eight tasks a node, each a torchrun of one process: srun binds each task to its GPU
    body = EXPORTED_HEAD + "srun bash -c 'torchrun --nnodes $SLURM_NTASKS --node_rank $SLURM_PROCID " \
                           "--nproc_per_node 1 --master_addr $MASTER_ADDR --master_port 29500 train.py'\n"
    code, found = lint(capsys, script(tmp_path, body, "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=8\n"
                                                      "#SBATCH --gpus-per-task=1\n"))
    assert code == 0, found
    assert "each one node of the rendezvous" in found["CFG071"][0]["message"]
    assert statuses(found, "CFG072") == ["pass"] and statuses(found, "CFG074") == ["pass"]


def test_a_hostfile_the_script_writes_is_there_when_the_launcher_reads_it(capsys, tmp_path):
    body = EXPORTED_HEAD + "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed 's/$/ slots=8/' > hostfile.txt\n" \
                           "deepspeed --hostfile hostfile.txt --master_addr $MASTER_ADDR train.py\n"
    code, found = lint(capsys, script(tmp_path, body, DIRECTIVES))
    assert code == 0 and statuses(found, "CFG007") == ["pass"], found["CFG007"]
    assert "reaches the hostfile's nodes" in found["CFG071"][0]["message"]


@pytest.mark.parametrize("config,status", [
    ("deepspeed_multinode_launcher: pdsh\n", "pass"),  # accelerate hands it to DeepSpeed's runner: every node
    ("deepspeed_multinode_launcher: standard\n", "fail"),  # one torchrun per node: srun must start the others
    (None, "skip"),  # the config is not here: not judged
])
def test_accelerate_with_deepspeeds_multinode_launcher_starts_the_other_nodes(capsys, tmp_path, config, status):
    if config is not None:
        (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\nnum_machines: 2\nnum_processes: 16\n"
                                           "main_process_ip: node01\nmain_process_port: 29500\nmachine_rank: 0\n"
                                           "deepspeed_config:\n  zero_stage: 2\n  deepspeed_hostfile: ./hostfile\n  "
                                           + config)
    body = "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed 's/$/ slots=8/' > hostfile\n" \
           "accelerate launch --config_file acc.yaml train.py\n"
    code, found = lint(capsys, script(tmp_path, body, DIRECTIVES))
    assert statuses(found, "CFG071") == [status], found["CFG071"]


@pytest.mark.parametrize("body", [
    # a config inside the container image
    EXPORTED_HEAD + "srun --container-image=nvcr.io#nvidia/pytorch:24.05-py3 accelerate launch --config_file "
                    "/workspace/acc.yaml --num_machines 2 --num_processes 16 --rdzv_backend c10d "
                    "--main_process_ip $MASTER_ADDR --main_process_port 29500 train.py\n",
    # relative to a folder of the cluster (cd), or to where sbatch is run from (train.py is not here either)
    EXPORTED_HEAD + "cd /srv/project\nsrun bash -c 'accelerate launch --config_file acc.yaml --machine_rank "
                    "$SLURM_NODEID --main_process_ip $MASTER_ADDR train.py'\n",
    EXPORTED_HEAD + "srun accelerate launch --config_file acc.yaml --rdzv_backend c10d --num_machines 2 "
                    "--num_processes 16 --main_process_ip $MASTER_ADDR train.py\n",
])
def test_a_file_of_the_cluster_is_not_judged_missing(capsys, tmp_path, body):
    code, found = lint(capsys, script(tmp_path, body, DIRECTIVES))
    assert statuses(found, "CFG007") == ["pass"], found["CFG007"]
    assert "not judged" in found["CFG007"][0]["message"]


def test_a_config_missing_beside_the_script_it_launches_fails(capsys, tmp_path):
    # train.py is here, where sbatch runs: this is the job's folder, and its acc.yaml is not in it
    (tmp_path / "train.py").write_text("print('train')\n")
    body = EXPORTED_HEAD + "srun accelerate launch --config_file acc.yaml --rdzv_backend c10d --num_machines 2 " \
                           "--num_processes 16 --main_process_ip $MASTER_ADDR train.py\n"
    code, found = lint(capsys, script(tmp_path, body, DIRECTIVES))
    assert statuses(found, "CFG007") == ["fail"] and "'acc.yaml'" in found["CFG007"][0]["message"]


@pytest.mark.parametrize("text,line,words", [
    ("#!/bin/bash\r\n#SBATCH --nodes=2\r\nsrun hostname\r\n", 1, "DOS line breaks"),
    ("# submit me with sbatch\n#!/bin/bash\n#SBATCH --nodes=2\nsrun hostname\n", 1, "does not start with #!"),
])
def test_what_sbatch_refuses_is_a_finding_and_the_rest_is_read(capsys, tmp_path, text, line, words):
    path = tmp_path / "job.sh"
    path.write_bytes(text.encode())
    code, found = lint(capsys, path)
    refusal = [r for r in found["CFG070"] if words in r["message"]]
    assert code == 1 and refusal and refusal[0]["evidence"]["line"] == line, found["CFG070"]
    assert batchscript.load(str(path)).allocation.nodes == 2  # the directives are still read


@pytest.mark.parametrize("body", [
    "f() { f; f; f; f; f; f; f; f; f; f; srun torchrun --nnodes 2 train.py; }\nf\n",
    "f() {\ng\ng\ng\ng\ng\ng\n}\ng() {\nf\nf\nf\nf\nf\nf\n}\nf\n",
])
def test_recursive_functions_are_read_in_bounded_time(body):
    started = time.monotonic()
    read = batchscript.parse("job.sh", "#!/bin/bash\n#SBATCH --nodes=2\n" + body, {})
    assert time.monotonic() - started < 2
    assert any("calls past" in why for _, why in read.unread)


def test_a_sourced_file_that_is_here_is_read(tmp_path, monkeypatch):
    (tmp_path / "env.sh").write_text("export MASTER_ADDR=node01\nLAUNCH_ARGS='--nnodes 2 --nproc_per_node 8'\n")
    read = batchscript.parse("job.sh", "#!/bin/bash\n#SBATCH --nodes=2\nsource env.sh\n"
                                       "srun torchrun $LAUNCH_ARGS --master_addr $MASTER_ADDR t.py\n", {})
    assert read.main.command.get("nnodes") == "2" and read.main.value_of("master_addr").text == "node01"
