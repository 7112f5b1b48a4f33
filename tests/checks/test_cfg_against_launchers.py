"""False alarms and misses of the CFG checks, each from a fixture under tests/fixtures/config/real/ (sources
in its README.md), judged by what accelerate 1.15 and DeepSpeed 0.19.8 do with the file."""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

import realworld
from conftest import run_cli

CMD = ("--", "accelerate", "launch", "train.py")  # a launch command that gives nothing the file lacks
REAL = Path(__file__).parents[1] / "fixtures" / "config" / "real"


@pytest.fixture(autouse=True)
def empty_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def lint(capsys, *args):
    args = [str(a) for a in args]
    cut = args.index("--") if "--" in args else len(args)  # --json is preflight's, not the command's
    code, doc, err = run_cli(capsys, "lint", *args[:cut], "--json", *args[cut:])
    assert code in (0, 1), f"exit {code}: {err}"
    return code, doc


def of(doc, check_id, status=None):
    return [r for r in doc["results"] if r["id"] == check_id and (status is None or r["status"] == status)]


def shown(doc):
    return "\n".join(f"  {r['id']} {r['status']}: {r['message']}" for r in doc["results"] if r["status"] != "pass")


# 1. upper-case offload devices: accelerate lower-cases them
def test_upper_case_offload_devices_are_accepted(capsys):
    code, doc = lint(capsys, "--config", REAL / "offload-upper-case/accelerate.yaml")
    assert not of(doc, "CFG002", "fail") and not of(doc, "CFG041", "fail"), shown(doc)
    assert [r["status"] for r in of(doc, "CFG002")] == ["pass"]


# 2. sequence_parallel_size divides the world before the batch assertion
def test_sequence_parallel_divides_the_world(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "sequence-parallel/ds.json", "--world-size", "8")
    assert [r["status"] for r in of(doc, "CFG030")] == ["pass"], shown(doc)
    assert "world size 2" in of(doc, "CFG030")[0]["message"]


def test_sequence_parallel_fix_uses_the_data_parallel_size(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "sequence-parallel/ds.json", "--world-size", "16")
    failed = of(doc, "CFG030", "fail")
    assert failed and "set train_batch_size: 4" in failed[0]["remediation"], shown(doc)


def test_world_not_divisible_by_sequence_parallel(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "sequence-parallel/ds.json", "--world-size", "6")
    assert "does not divide by sequence_parallel_size 4" in of(doc, "CFG030", "fail")[0]["message"]


# Megatron-DeepSpeed hands DeepSpeed its mpu (or a PipelineModule on its topology), and DeepSpeedConfig asserts the
# batch over that mpu's data-parallel world (runtime/config.py): the world over TP x PP (megatron/training.py,
# megatron/core/parallel_state.py). 16 ranks, TP 2 x PP 2: 32 = 2 x 4 x 4, not 2 x 4 x 16.
MEGATRON = ("deepspeed", "pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
            "2", "--deepspeed", "--deepspeed_config", "ds.json")


@pytest.mark.parametrize("flags, status, said", [
    ((), "pass", "2 x 4 x world size 4 (--world-size over TP 2 x PP 2"),
    (("--ds-sequence-parallel-size", "2"), "skip", "not judged"),
    (("--tensor-model-parallel-size", "$TP"), "skip", "set when the job runs"),
])
def test_megatron_deepspeeds_batch_is_judged_over_its_data_parallel_world(capsys, tmp_path, flags, status, said):
    (tmp_path / "ds.json").write_text('{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, '
                                      '"gradient_accumulation_steps": 4}')
    code, doc = lint(capsys, "--deepspeed", tmp_path / "ds.json", "--world-size", "16", "--", *MEGATRON, *flags)
    [result] = of(doc, "CFG030")
    assert result["status"] == status and said in result["message"], shown(doc)


def test_megatron_deepspeeds_batch_that_does_not_fit_its_data_parallel_world_fails(capsys, tmp_path):
    (tmp_path / "ds.json").write_text('{"train_batch_size": 128, "train_micro_batch_size_per_gpu": 2, '
                                      '"gradient_accumulation_steps": 4}')
    code, doc = lint(capsys, "--deepspeed", tmp_path / "ds.json", "--world-size", "16", "--", *MEGATRON)
    [result] = of(doc, "CFG030")
    assert result["status"] == "fail" and "set train_batch_size: 32" in result["remediation"], shown(doc)


# 3. no batch keys: fail only where DeepSpeed fails, a warning when nobody says who reads the file
def test_no_batch_keys_alone_is_not_judged_and_names_who_fills_them(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "no-batch-keys/ds.json")
    said = of(doc, "CFG030", "pass")
    assert said and "Lightning" in said[0]["message"] and "not judged" in said[0]["message"], shown(doc)
    assert code == 0


def test_no_batch_keys_under_deepspeed_runner_fails(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "no-batch-keys/ds.json", "--", "deepspeed", "train.py")
    assert of(doc, "CFG030", "fail"), shown(doc)


# 4. a deepspeed_config section under MULTI_GPU is not read by accelerate
def test_ignored_deepspeed_section_is_not_bad_input(capsys):
    code, doc = lint(capsys, "--config", REAL / "multi-gpu-ds-section/accelerate.yaml")
    warned = of(doc, "CFG004", "warn")
    assert warned and "never reads this deepspeed_config section" in warned[0]["message"], shown(doc)
    assert not of(doc, "CFG040", "fail") and not of(doc, "CFG002", "fail"), shown(doc)


@pytest.mark.parametrize("name,shown_type,words", [
    # PhoenixBeaudry/gradients-modified: a DeepSpeed JSON's path where the section belongs, under MULTI_GPU
    ("multi-gpu-ds-section/gradients-modified-accelerate_config.yaml", "'MULTI_GPU'",
     "never reads deepspeed_config ('./deepspeed_stage2.json'): the job runs without DeepSpeed"),
    # Luodian/GenBench: a whole ZeRO-2 section under distributed_type: null
    ("multi-gpu-ds-section/genbench-accelerate_config.yaml", "null", "never reads this deepspeed_config section"),
])
def test_real_dead_deepspeed_config_is_a_warning_not_bad_input(capsys, name, shown_type, words):
    code, doc = lint(capsys, "--config", REAL / name)
    warned = of(doc, "CFG004", "warn")
    assert code == 0 and warned and words in warned[0]["message"], shown(doc)
    assert f"distributed_type is {shown_type}" in warned[0]["message"]
    if name.startswith("multi-gpu-ds-section/gradients"):
        assert "deepspeed_config_file: ./deepspeed_stage2.json" in warned[0]["remediation"]


@pytest.mark.parametrize("name,multi_gpu", [
    ("multi-gpu-ds-section/gradients-modified-accelerate_config.yaml", True),
    ("multi-gpu-ds-section/genbench-accelerate_config.yaml", False),
    ("null-distributed-type/googletrend-accelerate_config.yaml", False),
    ("../CFG003/unquoted-no-distributed-type/accelerate.yaml", False),
])
def test_accelerate_launches_these_as_the_findings_say(name, multi_gpu):
    """The findings above are what accelerate's own launch makes of the files: no DeepSpeed, and for a null or
    false distributed_type no launcher flag at all (commands/launch.py then runs the simple launcher, one
    process, as for 'NO')."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(REAL / name), "train.py"])
    args = _validate_launch_command(args)[0]
    assert (args.multi_gpu, args.use_deepspeed, args.use_fsdp, args.cpu) == (multi_gpu, False, False, False)


def test_real_null_distributed_type_runs_as_no(capsys):
    # LUN000/AI_googletrend_tag: `distributed_type:` left empty; accelerate accepts it and runs one process
    code, doc = lint(capsys, "--config", REAL / "null-distributed-type/googletrend-accelerate_config.yaml")
    warned = of(doc, "CFG002", "warn")
    assert code == 0 and warned and "googletrend-accelerate_config.yaml:3: distributed_type is null" in \
        warned[0]["message"] and "as with 'NO'" in warned[0]["message"], shown(doc)


def accelerate_launch(tmp_path, config, *flags):
    """accelerate's own launch of a script that prints 'ran', on this CPU machine: (exit code, its output)."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    (tmp_path / "train.py").write_text("print('ran')\n")
    proc = subprocess.run([str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config),
                           *flags, str(tmp_path / "train.py")], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_deepspeed_json_path_under_use_deepspeed_stops_the_launch(capsys, tmp_path):
    """The gradients-modified config (a JSON's path where the section belongs, under MULTI_GPU) with
    --use_deepspeed on the launch command: accelerate launch stops on the path's missing .keys(). Lint said
    that CFG004 itself raised."""
    config = REAL / "multi-gpu-ds-section/gradients-modified-accelerate_config.yaml"
    code, doc = lint(capsys, "--config", config, "--", "accelerate", "launch", "--use_deepspeed", "train.py")
    failed = of(doc, "CFG004", "fail")
    assert code == 1 and failed and "deepspeed_config is './deepspeed_stage2.json', not a section" in \
        failed[0]["message"] and "accelerate launch stops on it" in failed[0]["message"], shown(doc)
    assert "deepspeed_config_file: ./deepspeed_stage2.json" in failed[0]["remediation"]
    assert not [r for r in doc["results"] if " raised " in r["message"]], shown(doc)
    code, said = accelerate_launch(tmp_path, config, "--use_deepspeed")
    assert code != 0 and "'str' object has no attribute 'keys'" in said, said


@pytest.mark.parametrize("word", ["yes", "on", "true"])
def test_distributed_type_read_as_true_launches_as_no(capsys, tmp_path, word):
    """An unquoted yes / on is true in YAML 1.1: accelerate runs the script as one process, as for 'NO' (and
    false), where lint said that accelerate launch stops on it."""
    config = tmp_path / "accelerate.yaml"
    config.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: {word}\nnum_machines: 1\n"
                      "num_processes: 1\nmixed_precision: 'no'\n")
    code, doc = lint(capsys, "--config", config)
    warned = of(doc, "CFG003", "warn")
    assert code == 0 and not of(doc, "CFG003", "fail") and warned, shown(doc)
    assert "accelerate.yaml:2: distributed_type is true (YAML 1.1 reads an unquoted yes / on as true); " \
           "accelerate launches it as 'NO'" in warned[0]["message"]
    if word == "yes":  # accelerate's own launch, once
        code, said = accelerate_launch(tmp_path, config)
        assert code == 0 and "ran" in said, said


# 5. offload_param at stage 2 does nothing: a warning (also CFG041 rows in checks/test_cfg.py)

# 6. booleans written as strings
def test_string_booleans(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "string-booleans/ds.json")
    fails = [r["message"] for r in of(doc, "CFG003", "fail")]
    warns = [r["message"] for r in of(doc, "CFG003", "warn")]
    assert any("bf16.enabled is the string 'false'" in m and "is_true()" in m for m in fails), shown(doc)
    assert any("fp16.enabled is the string 'true'" in m and "transformers Trainer" in m for m in warns), shown(doc)
    assert any("zero_optimization.overlap_comm is the string 'true'" in m for m in warns), shown(doc)


# 7. partial optimizer offload to NVMe
def test_partial_offload_to_nvme_fails(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "partial-nvme/ds.json")
    failed = of(doc, "CFG041", "fail")
    assert failed and "with device 'nvme'" in failed[0]["message"] and "ds.json:5" in failed[0]["message"], shown(doc)


# 8. placeholder addresses; the fix never echoes them
@pytest.mark.parametrize("ip", ["xxx.xxx.xxx.xxx", "x.x.x.x", "<IP>", "your_ip", "IP_ADDRESS", "0.0.0.0"])
def test_placeholder_main_process_ip(capsys, tmp_path, ip):
    text = (REAL / "placeholder-ip/accelerate.yaml").read_text().replace("xxx.xxx.xxx.xxx", f"'{ip}'")
    (tmp_path / "accelerate.yaml").write_text(text)
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")  # the command may give --main_process_ip
    assert of(doc, "CFG010", "warn") and not of(doc, "CFG010", "fail"), shown(doc)
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml", *CMD)
    failed = of(doc, "CFG010", "fail")
    assert failed and "accelerate.yaml:4" in failed[0]["message"], shown(doc)
    assert ip not in failed[0]["remediation"]


@pytest.mark.parametrize("dtype,status", [("MULTI_GPU", None), ("DEEPSPEED", None)])
def test_wildcard_address_on_one_machine_is_not_refused(capsys, tmp_path, dtype, status):
    # connecting to 0.0.0.0 reaches this machine: a one-machine job with it works
    (tmp_path / "accelerate.yaml").write_text(f"distributed_type: {dtype}\nnum_machines: 1\nnum_processes: 2\n"
                                              "main_process_ip: 0.0.0.0\nmain_process_port: 29500\n")
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")
    assert not [r for r in of(doc, "CFG010") if r["status"] in ("fail", "warn")], shown(doc)


@pytest.mark.parametrize("dtype,status", [("MULTI_GPU", "warn"), ("DEEPSPEED", "warn"), ("NO", "warn"),
                                          ("MULTI_CPU", "fail")])
@pytest.mark.parametrize("ip", ["your_ip", "10.0.0.1:29500"])
def test_head_address_on_one_machine(capsys, tmp_path, dtype, status, ip):
    # On one machine accelerate runs torchrun for MULTI_GPU and DEEPSPEED, which never reads main_process_ip, and
    # one process for 'NO'; MULTI_CPU's processes meet at MASTER_ADDR (accelerate/utils/launch.py)
    (tmp_path / "accelerate.yaml").write_text(f"distributed_type: {dtype}\nnum_machines: 1\nnum_processes: 2\n"
                                              f"main_process_ip: '{ip}'\nmain_process_port: 29500\n")
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml", *CMD)
    assert [r["status"] for r in of(doc, "CFG010")] == [status], shown(doc)
    if dtype != "MULTI_CPU":
        assert launch_refusal(tmp_path / "accelerate.yaml") is None


@pytest.mark.parametrize("dtype,flags,status", [("MULTI_GPU", (), "fail"), ("DEEPSPEED", (), "fail"),
                                                ("NO", (), "warn"), ("MULTI_GPU", ("--cpu",), "warn")])
def test_head_port_out_of_range_on_one_machine(capsys, tmp_path, dtype, flags, status):
    # torchrun binds the port even on one machine; one process alone never does
    (tmp_path / "accelerate.yaml").write_text(f"distributed_type: {dtype}\nnum_machines: 1\nnum_processes: 2\n"
                                              "main_process_port: 65536\n")
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml", "--", "accelerate", "launch", *flags, "t.py")
    assert [r["status"] for r in of(doc, "CFG010")] == [status], shown(doc)


def test_placeholder_fixture(capsys):
    code, doc = lint(capsys, "--config", REAL / "placeholder-ip/accelerate.yaml", *CMD)
    assert "placeholder" in of(doc, "CFG010", "fail")[0]["message"], shown(doc)


# 9. deepspeed_hostfile named by the accelerate config
def test_deepspeed_hostfile_from_the_config_is_checked(capsys):
    code, doc = lint(capsys, "--config", REAL / "hostfile-named/accelerate.yaml")
    failed = of(doc, "CFG021", "fail")
    assert failed and "node02 has slots=4" in failed[0]["message"], shown(doc)


def test_missing_deepspeed_hostfile_fails_on_the_head(capsys, tmp_path, monkeypatch):
    text = (REAL / "hostfile-named/accelerate.yaml").read_text().replace("deepspeed_hostfile: hostfile",
                                                                         "deepspeed_hostfile: nowhere/hostfile")
    (tmp_path / "accelerate.yaml").write_text(text)
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")  # lint reads no node: it may be on the head
    assert "is not here" in of(doc, "CFG021", "skip")[0]["message"], shown(doc)
    monkeypatch.chdir(tmp_path)
    code, doc, err = run_cli(capsys, "node", "--config", tmp_path / "accelerate.yaml", "--only", "CFG021", "--json")
    assert "does not exist" in of(doc, "CFG021", "fail")[0]["message"], shown(doc)


# 10. the command's flags over the file
def test_launch_flags_override_the_file(capsys):
    config = REAL / "launch-flags/accelerate.yaml"
    code, doc = lint(capsys, "--config", config)
    assert of(doc, "CFG020", "fail") and of(doc, "CFG002", "fail"), shown(doc)  # the file alone is wrong
    code, doc = lint(capsys, "--config", config, "--", "accelerate", "launch", "--num_processes", "16",
                     "--mixed_precision", "bf16", "train.py")
    assert not of(doc, "CFG020", "fail") and not of(doc, "CFG002", "fail"), shown(doc)


def test_launch_flag_findings_name_the_flag(capsys):
    code, doc = lint(capsys, "--config", REAL / "launch-flags/accelerate.yaml", "--", "accelerate", "launch",
                     "--num_processes", "9", "--mixed_precision", "bf16", "train.py")
    failed = of(doc, "CFG020", "fail")
    assert failed and "flag --num_processes" in failed[0]["message"] and "9 does not divide" in failed[0]["message"]
    # the flag wins over the file: a fix that edits the file would change nothing
    assert failed[0]["remediation"].startswith("set --num_processes to a multiple of 2"), failed[0]["remediation"]


def test_fixes_name_the_flag_that_gives_the_value(capsys, tmp_path):
    (tmp_path / "accelerate.yaml").write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 8\n"
                                              "machine_rank: 0\nmain_process_ip: 10.0.0.1\nmain_process_port: 29500\n")
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml", "--", "accelerate", "launch", "--machine_rank",
                     "2", "--main_process_ip", "<IP>", "--main_process_port", "70000", "train.py")
    fixes = sorted(r["remediation"] for r in doc["results"] if r["status"] == "fail")
    assert fixes == ["set --machine_rank between 0 and 1", "set --main_process_ip to the head node's (machine_rank 0) "
                     "address as the workers resolve it: `hostname -I` on the head, or its host name",
                     "set --main_process_port to 29500"], shown(doc)
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")  # the file's own values: its keys
    assert not of(doc, "CFG010", "fail") and not of(doc, "CFG011", "fail"), shown(doc)
    # flags alone: a missing value is a flag to pass
    code, doc = lint(capsys, "--", "accelerate", "launch", "--multi_gpu", "--num_processes", "8", "--num_machines",
                     "2", "train.py")
    assert [r["remediation"] for r in of(doc, "CFG010", "fail")] == [
        "set --main_process_ip to the head node's (machine_rank 0) address as the workers resolve it: `hostname -I` "
        "on the head, or its host name"], shown(doc)


# 11. remediations that can be followed
def test_too_few_gpu_ids_fix_speaks_of_every_machine(capsys, tmp_path):
    (tmp_path / "accelerate.yaml").write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 8\n"
                                              "gpu_ids: '0,1'\nmain_process_ip: 10.0.0.1\nmain_process_port: 29500\n")
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml")
    fix = of(doc, "CFG020", "fail")[0]["remediation"]
    assert "every machine" in fix and "on each machine" in fix


def test_unknown_offload_key_never_suggests_a_deprecated_one(capsys, tmp_path):
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": '
                                      '{"stage": 3, "cpu_offload_params": true}}')
    code, doc = lint(capsys, "--deepspeed", tmp_path / "ds.json")
    failed = of(doc, "CFG060", "fail")
    assert failed and "cpu_offload_param'" not in failed[0]["message"], shown(doc)


def test_url_main_process_ip_fix_gives_the_host_not_the_url(capsys, tmp_path):
    (tmp_path / "accelerate.yaml").write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 8\n"
                                              "main_process_ip: 'tcp://<IP>:29500'\nmain_process_port: 29500\n")
    code, doc = lint(capsys, "--config", tmp_path / "accelerate.yaml", *CMD)
    fix = of(doc, "CFG010", "fail")[0]["remediation"]
    assert "<IP>" not in fix and "tcp://" not in fix


# --- the same classes, from real configs (sources in fixtures/config/real/README.md) ---------------

def test_real_string_boolean_from_deepspeed_issue_3024(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "string-booleans/deepspeed-issue-3024.json")
    warns = [r["message"] for r in of(doc, "CFG003", "warn")]
    assert any("deepspeed-issue-3024.json:3: bf16.enabled is the string 'true'" in m for m in warns), shown(doc)
    assert any("'mixed_precision'" in r["message"] for r in of(doc, "CFG060", "warn")), shown(doc)


def test_real_placeholder_from_accelerate_issue_1317(capsys):
    code, doc = lint(capsys, "--config", REAL / "placeholder-ip/accelerate-issue-1317/ds_mn_hf.yaml", *CMD)
    failed = of(doc, "CFG010", "fail")
    assert failed and "ds_mn_hf.yaml:15: main_process_ip is '<your main node IP>'" in failed[0]["message"]
    assert "<your main node IP>" not in failed[0]["remediation"]


def test_real_placeholder_port_from_accelerate_issue_412(capsys):
    # the template's IP1 and PORT1, over two machines: accelerate hands both to torchrun, which stops on the port
    code, doc = lint(capsys, "--config", REAL / "placeholder-ip/accelerate-issue-412/default_config.yaml", *CMD)
    messages = [r["message"].split(": ", 1)[1] for r in of(doc, "CFG010", "fail")]
    assert len(messages) == 2 and messages[0].startswith("main_process_ip is 'IP1': it is a placeholder") and \
        messages[1].startswith("main_process_port is 'PORT1', expected a port number"), shown(doc)
    assert launch_refusal(REAL / "placeholder-ip/accelerate-issue-412/default_config.yaml") is not None


def test_real_template_hostfile_from_accelerate_issue_1317(capsys):
    # the hostfile the config names is the thread's template ('localhost slots={num gpus on node1}'): DeepSpeed's
    # runner cannot parse it either
    code, doc, err = run_cli(capsys, "lint", "--config", REAL / "hostfile-named/accelerate-issue-1317/ds_mn_hf.yaml")
    assert code == 2 and "hostfile:1:" in err and "slots={num gpus on node1}" in err


@pytest.mark.parametrize("option,name,check,status,words", [
    # the maintainers' answer in deepspeedai/DeepSpeed#4872: "device should be cpu, not nvme"
    ("--deepspeed", "partial-nvme/deepspeed-issue-4872.json", "CFG041", "fail", "(ratio 0.5) with device 'nvme'"),
    # the thread's /root/hostfile is on its author's head node: lint, which reads no node, does not judge it
    ("--config", "hostfile-named/deepspeed-issue-5136/accelerate.yaml", "CFG021", "skip",
     "deepspeed_hostfile '/root/hostfile' is not here"),
    ("--config", "offload-param-stage2/diffusers-cogview4-control.yaml", "CFG041", "warn",
     "offload_param_device is 'cpu' at ZeRO stage 2"),
])
def test_real_config_finding(capsys, option, name, check, status, words):
    code, doc = lint(capsys, option, REAL / name)
    found = of(doc, check, status)
    assert found and words in found[0]["message"], shown(doc)
    assert code == (1 if status == "fail" else 0), shown(doc)


def test_real_multi_gpu_flag_drops_the_deepspeed_section(capsys):
    # kohya-ss/sd-scripts#1139: a DEEPSPEED config launched with --multi_gpu; accelerate then sets use_deepspeed
    # only when no type flag is given (commands/launch.py), so the run is plain DDP
    config = REAL / "launch-flags/sd-scripts-pr-1139/accelerate.yaml"
    code, doc = lint(capsys, "--config", config)
    assert not of(doc, "CFG004", "warn"), shown(doc)
    code, doc = lint(capsys, "--config", config, "--", "accelerate", "launch", "--gpu_ids=0,1", "--multi_gpu",
                     "--num_processes=2", "--num_cpu_threads_per_process=2", "./sdxl_train.py")
    warned = of(doc, "CFG004", "warn")
    assert warned and "accelerate.yaml:3:" in warned[0]["message"] and "never reads" in warned[0]["message"]


@pytest.mark.parametrize("world,status", [(2, "pass"), (4, "pass"), (3, "fail")])
def test_real_sequence_parallel_from_deepspeed_tests(capsys, world, status):
    code, doc = lint(capsys, "--deepspeed", REAL / "sequence-parallel/deepspeed-test-ulysses-sp-hf.json",
                     "--world-size", world)
    assert [r["status"] for r in of(doc, "CFG030")] == [status], shown(doc)
    if status == "pass":
        assert "sequence_parallel_size 2" in of(doc, "CFG030")[0]["message"]


def test_real_no_batch_keys_from_lightning_docs(capsys):
    code, doc = lint(capsys, "--deepspeed", REAL / "no-batch-keys/lightning-docs-custom-config.json")
    assert [r["status"] for r in of(doc, "CFG030")] == ["pass"], shown(doc)  # Lightning sets it: not judged
    # Its OneBitAdam is no longer built by DeepSpeed 0.19.7 and newer (CFG060, without --deep): nothing else fails
    assert {r["id"] for r in doc["results"] if r["status"] == "fail"} <= {"CFG060"}, shown(doc)


def test_deep_validator_does_not_refuse_what_the_framework_fills(capsys, tmp_path):
    # Lightning sets the micro batch itself: with nothing saying who reads the file, DeepSpeed's validator gets
    # a stand-in for it, as the fast check only warns (CFG030); under DeepSpeed's runner it is a failure
    for library in ("accelerate", "deepspeed"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed (the 'train' extra)")
    import json

    real = REAL / "no-batch-keys/lightning-docs-custom-config.json"
    code, doc = lint(capsys, "--deepspeed", real, "--deep")
    # Its OneBitAdam is gone from DeepSpeed 0.19.8: the engine would stop on it (the docs predate that release).
    assert "optimizer 'OneBitAdam' is neither" in of(doc, "CFG091", "fail")[0]["message"], shown(doc)
    data = json.loads(real.read_text())
    data["optimizer"]["type"] = "Adam"
    config = tmp_path / "lightning.json"
    config.write_text(json.dumps(data))
    code, doc = lint(capsys, "--deepspeed", config, "--deep")
    assert [r["status"] for r in of(doc, "CFG091")] == ["pass"], shown(doc)
    assert "stand" in of(doc, "CFG091")[0]["message"]
    code, doc = lint(capsys, "--deepspeed", config, "--deep", "--", "deepspeed", "train.py")
    assert [r["status"] for r in of(doc, "CFG091")] == ["fail"], shown(doc)


# The fast lint never FAILs a config both libraries' validators accept, unless its message says why they are
# wrong to accept it.
DOCUMENTED = {  # check ID: words in the message that say why the libraries' acceptance is not the job's
    # CFG010: accelerate's config classes take any text as the head's address and port; the launchers cannot use it
    "CFG003": ("is_true()", "keeps it as text"), "CFG010": ("the workers cannot reach the head", "expected a port number"),
    "CFG041": ("supports a partial offload only",),  # DeepSpeed's model takes it; stage3.py cannot run it
    "CFG020": ("accelerate would start",),  # the validators never see num_processes against num_machines
    "CFG021": ("but the accelerate config runs",  # nor the hostfile against the config,
               "does not exist (looked in",),  # nor whether it is there: DeepSpeed's runner reads it
    "CFG005": ("when the script starts",),  # accelerate's DeepSpeedPlugin raises then, not when the config loads
}
BAD_INPUT = {  # real files lint refuses as bad input (exit 2), as the launchers do: no findings to compare
    "hostfile-named/accelerate-issue-1317/ds_mn_hf.yaml",  # its hostfile is the thread's unfilled template
}
AGREE = [("--config" if p.suffix == ".yaml" else "--deepspeed", str(p))  # every fixture here and the corpus's configs
         for p in sorted(REAL.rglob("*")) if p.suffix in (".yaml", ".json") and p.relative_to(REAL).as_posix()
         not in BAD_INPUT] + [("--config" if e.kind == "accelerate" else "--deepspeed", str(realworld.ROOT / e.path))
                              for e in realworld.entries() if e.kind in ("accelerate", "deepspeed")]


def test_every_real_fixture_is_in_the_agreement_test():
    assert len(AGREE) >= 50 and all(Path(name).is_file() for _, name in AGREE)
    assert all((REAL / name).is_file() for name in BAD_INPUT)


@pytest.mark.parametrize("option,name", AGREE, ids=[Path(a[1]).parent.name + "/" + Path(a[1]).name for a in AGREE])
def test_fast_lint_agrees_with_the_validators(capsys, option, name):
    for library in ("accelerate", "deepspeed"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed (the 'train' extra)")
    code, doc = lint(capsys, option, REAL / name, "--world-size", "8", "--deep")
    validators = {r["id"]: r["status"] for r in doc["results"] if r["id"] in ("CFG090", "CFG091")}
    if "fail" in validators.values() or "error" in validators.values():
        return  # a library refuses it: the fast checks may too
    for r in doc["results"]:
        if r["status"] == "fail" and r["id"] not in ("CFG090", "CFG091"):
            assert any(words in r["message"] for words in DOCUMENTED.get(r["id"], ())), \
                f"undocumented fail over accepted config:\n{shown(doc)}"


# What `accelerate launch` refuses, lint refuses: every accelerate config among the fixtures goes through
# accelerate's own launch path as far as starting its launcher (argument validation, then the environment its
# launcher would get: where bools are .lower()ed, gpu_ids split, ports connected to), without starting anything.
# This machine's hardware and ports, not the file's.
MACHINE_ONLY = ("FP8 is not available", "already in use", "no available devices found",
                "mpirun or mpiexec were not found")
# Where lint only warns or says it did not judge, and why: the launch command may complete the file (and with the
# command, lint fails), or a file it names may be on the nodes (lint reads none; `check` and `node` fail there).
COMPLETED_BY_THE_COMMAND = {"CFG020": ("unless the launch command passes --num_processes",),
                            "CFG010": ("the launch command must give --main_process_ip",
                                       "unless the launch command gives --main_process_ip"),
                            "CFG005": ("unless the launch command passes --mixed_precision", "is not here"),
                            "CFG021": ("is not here",),
                            # the oracle's script calls Accelerator() itself; the transformers Trainer fills it in,
                            # and lint does not read the script: a pass that says it did not judge
                            "CFG002": ("not judged (the script is not read)",)}


def launch_refusal(path: Optional[Path], flags=()):
    """Why accelerate 1.15's `accelerate launch --config_file PATH FLAGS train.py` stops before its launcher
    starts anything (or its launcher does, reading its arguments), or the script's DeepSpeedPlugin,
    FullyShardedDataParallelPlugin or torch rendezvous stops on the environment the launcher gives it (where
    the file's values are read back), or None. (SageMaker configs launch through AWS: not tried.) With PATH None,
    `accelerate launch FLAGS train.py` with no config file at all (not even a default one)."""
    import contextlib
    import io
    import logging
    import os
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin, parse_choice_from_env
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args([*(("--config_file", str(path)) if path else ()), *flags, "train.py"])
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                mock.patch("accelerate.commands.launch.default_config_file", os.devnull + "/none"):
            args, defaults, mp_from_flag = _validate_launch_command(args)
            plugin, env, torchrun = None, {}, False
            if args.use_deepspeed and not args.cpu:  # as launch_command does before deepspeed_launcher
                fields = (list(defaults.deepspeed_config.keys()) if defaults else []) + (["mixed_precision"] if mp_from_flag else [])
                args.deepspeed_fields_from_accelerate_config = ",".join(fields)
                cmd, env = prepare_deepspeed_cmd_env(args)
                plugin = DeepSpeedPlugin
                # deepspeed_launcher: DeepSpeed's runner over several machines, else torchrun
                torchrun = args.num_machines <= 1 or args.deepspeed_multinode_launcher == "standard"
                if not torchrun:  # the runner reads its arguments first, then picks its launcher by name
                    from deepspeed.launcher.runner import LAUNCHER_CLASSES
                    from deepspeed.launcher.runner import parse_args as deepspeed_runner_args

                    runner = deepspeed_runner_args(cmd[1:])
                    if not runner.no_ssh and runner.launcher.lower() not in LAUNCHER_CLASSES:
                        raise NotImplementedError(f"Unknown launcher {runner.launcher.lower()}")  # as main() raises
            elif (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
                env = prepare_multi_gpu_env(args)
                plugin = FullyShardedDataParallelPlugin if args.use_fsdp else None
                torchrun = True
            elif not args.tpu:
                env = prepare_simple_launcher_cmd_env(args)[1]
                if defaults is not None and defaults.distributed_type == "MULTI_CPU" and "MASTER_PORT" in env:
                    int(env["MASTER_PORT"])  # the processes' env:// rendezvous (torch/distributed/rendezvous.py)
            if torchrun:  # torchrun reads its arguments (distrib_run.run, before it starts anything)
                import torch.distributed.run as distrib_run
                from accelerate.utils.launch import _filter_args
                from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

                torchrun_args = _filter_args(args, distrib_run.get_args_parser(), [  # as accelerate's launchers do
                    "--training_script", args.training_script, "--training_script_args", args.training_script_args])
                with mock.patch.dict(os.environ, env, clear=True):
                    config = distrib_run.config_from_args(torchrun_args)[0]
                # and its rendezvous handler, created first when the agent starts, reads the endpoint
                parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
            if plugin is not None:  # what the script builds when accelerate's Accelerator starts, run where
                # the file's relative paths hold (lint reads them beside the config)
                with mock.patch.dict(os.environ, env, clear=True), contextlib.chdir(path.parent if path else "."):
                    plugin()
                    # Accelerator.__init__ then reads the accumulation back (accelerator.py, without a plugin of
                    # its own): int(parse_choice_from_env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", 1)).
                    int(parse_choice_from_env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", 1))
    except (Exception, SystemExit) as exc:  # SystemExit: argparse refusing an argument of DeepSpeed's runner
        return None if any(words in str(exc) for words in MACHINE_ONLY) else f"{type(exc).__name__}: {exc}"
    finally:
        logging.disable(logging.NOTSET)
    return None


def test_what_accelerate_launch_refuses_lint_refuses(capsys):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    import json

    import yaml

    from preflight.cli import main

    fixtures = Path(__file__).parents[1] / "fixtures"
    configs = [p for p in sorted(fixtures.rglob("*.yaml")) if "config" in p.parts] + \
        [realworld.ROOT / e.path for e in realworld.entries() if e.kind == "accelerate"]
    refused, missed = [], []
    for path in configs:
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict) or "compute_environment" not in data and "distributed_type" not in data \
                or data.get("compute_environment") == "AMAZON_SAGEMAKER":
            continue  # not an accelerate config, or one accelerate launches on AWS
        why = launch_refusal(path)
        if why is None:
            continue
        refused.append(path)
        code = main(["lint", "--config", str(path), "--json"])
        out, _ = capsys.readouterr()
        found = [] if code == 2 else json.loads(out)["results"]
        if code != 2 and not [r for r in found if r["status"] == "fail" or r["status"] in ("warn", "skip", "pass")
                              and any(w in r["message"] for w in COMPLETED_BY_THE_COMMAND.get(r["id"], ()))]:
            missed.append(f"{path.relative_to(fixtures)}: accelerate launch stops ({why[:160]}), lint passes")
    assert len(refused) >= 15, refused  # the fixtures of refused configs are all tried
    assert not missed, "\n".join(missed)


def test_numbers_as_text_fail_where_accelerate_stops_and_only_there(capsys, tmp_path):
    """A number written as text in accelerate's config ('2', or 1e8, which YAML 1.1 reads as text) stops accelerate
    only where it compares or computes with it. Over every launcher, machine count, rank and key, CFG003 fails on
    the text exactly where accelerate 1.15 stops on it (the same config with the number launching)."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    import json

    import yaml

    from preflight.cli import main

    def lint_fails(path):
        code = main(["lint", "--config", str(path), "--only", "CFG003", "--json"])
        out, _ = capsys.readouterr()
        assert code in (0, 1), out
        return [r["message"] for r in json.loads(out)["results"] if r["status"] == "fail"]

    texts = {("num_processes",): ["PROCS", "PROCS.0", "1_PROCS"], ("num_machines",): ["MACHINES"],
             ("machine_rank",): ["RANK", "RANK.0"],
             ("main_process_port",): ["29517", "29517.0", "+29517", " 29517", "2_9517"]}
    sections = {"DEEPSPEED": {("deepspeed_config", "zero_stage"): ["2", "2.0"],
                              ("deepspeed_config", "gradient_accumulation_steps"): ["2", "2.0"],
                              ("deepspeed_config", "gradient_clipping"): ["1e0", "1.0"]},
                "FSDP": {("fsdp_config", "fsdp_min_num_params"): ["100000000", "1e8"]}}
    disagree, tried, stopped = [], 0, 0
    for dtype in ("NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP", "XLA"):
        for machines, rank in ((1, 0), (2, 0), (2, 1)):
            for use_cpu in (False, True):
                # FSDP's wrap policies; DeepSpeed's runner started from the head on the GPUs of a filter
                variants = {"FSDP": ("SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP"), "DEEPSPEED": ("standard", "pdsh")}
                for policy in variants.get(dtype, (None,)):
                    base = {"compute_environment": "LOCAL_MACHINE", "distributed_type": dtype, "use_cpu": use_cpu,
                            "num_machines": machines, "machine_rank": rank, "num_processes": 2 * machines,
                            "main_process_ip": "10.0.0.1", "main_process_port": 29517, "mixed_precision": "no"}
                    if dtype == "DEEPSPEED":
                        base["deepspeed_config"] = {"zero_stage": 2, "gradient_accumulation_steps": 2,
                                                    "gradient_clipping": 1.0, "deepspeed_multinode_launcher": policy}
                        if policy == "pdsh":
                            base["deepspeed_config"]["deepspeed_inclusion_filter"] = "node1@node2"
                    if dtype == "FSDP":
                        base["fsdp_config"] = {"fsdp_version": 1, "fsdp_auto_wrap_policy": policy,
                                               "fsdp_min_num_params": 100000000,
                                               "fsdp_transformer_layer_cls_to_wrap": "Block"}
                    path = tmp_path / "accelerate.yaml"
                    path.write_text(yaml.safe_dump(base))
                    if launch_refusal(path) is not None:
                        continue  # the config stops with the numbers already: not the text's doing
                    for keys, written in {**texts, **sections.get(dtype, {})}.items():
                        for text in written:
                            for word, number in (("PROCS", 2 * machines), ("MACHINES", machines), ("RANK", rank)):
                                text = text.replace(word, str(number))
                            data = json.loads(json.dumps(base))
                            holder = data if len(keys) == 1 else data[keys[0]]
                            holder[keys[-1]] = text
                            path.write_text(yaml.safe_dump(data))
                            refused = launch_refusal(path)
                            failed = [m for m in lint_fails(path) if ".".join(keys) in m]
                            tried += 1
                            stopped += refused is not None
                            if bool(refused) != bool(failed):
                                disagree.append(f"{dtype} machines={machines} rank={rank} use_cpu={use_cpu} "
                                                f"policy={policy} {'.'.join(keys)}={text!r}: accelerate "
                                                f"{'stops (' + refused[:90] + ')' if refused else 'launches'}, "
                                                f"CFG003 {'fails' if failed else 'passes'}")
    assert tried > 150 and 30 < stopped < tried - 30, (tried, stopped)  # both outcomes are tried, many times
    assert not disagree, "\n".join(disagree)


def test_numbers_as_text_in_the_deepspeed_json_fail_where_deepspeed_refuses_them(capsys, tmp_path):
    """Every number of the DeepSpeed JSON that lint knows, written as text in four ways: where DeepSpeed's own
    config (CFG091) refuses the text, CFG003 fails; where it accepts it, CFG003 fails only saying why the job
    still stops (DeepSpeed keeps the text and computes with it later), and warns only for what accelerate and
    transformers read differently."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (the 'train' extra)")
    import json

    from preflight.cli import main
    from preflight.inputs.configs import DS_NUMERIC

    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "gradient_clipping": 1, "steps_per_print": 10,  # integers all: the forms add a fraction, an exponent
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 500000000, "allgather_bucket_size": 500000000,
                                  "stage3_prefetch_bucket_size": 1000000, "stage3_param_persistence_threshold": 100000,
                                  "stage3_max_live_parameters": 1000000000, "stage3_max_reuse_distance": 1000000000,
                                  "sub_group_size": 1000000000},
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                     "hysteresis": 2, "min_loss_scale": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 2, "eps": 1, "weight_decay": 0}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2,
                                                              "warmup_num_steps": 10, "total_num_steps": 100}}}
    path = tmp_path / "ds.json"

    def lint(config, command=()):
        path.write_text(json.dumps(config))
        code = main(["lint", "--deepspeed", str(path), "--world-size", "2", "--deep", "--only", "CFG003,CFG091",
                     "--json", *command])
        out, err = capsys.readouterr()
        assert code in (0, 1), err
        return json.loads(out)["results"]

    assert {r["status"] for r in lint(base)} == {"pass"}
    wrong, refused, accepted = [], 0, 0
    arabic_indic = {str(d): chr(0x660 + d) for d in range(10)}  # digits Python's int() reads, and pydantic not
    forms = ("{}", "{}.0", "{}.", "{}e0", " {} ", "+{}", "arabic")
    # Who reads the JSON: unknown (the HF Trainer, Lightning, a script), or DeepSpeed's runner alone.
    commands = ((), ("--", "deepspeed", "t.py"))
    for keys, form, command in ((k, f, c) for k in DS_NUMERIC for f in forms for c in commands):
        config = json.loads(json.dumps(base))
        holder = config
        for key in keys[:-1]:
            holder = holder[key]
        number = str(holder[keys[-1]])
        holder[keys[-1]] = "".join(map(arabic_indic.get, number)) if form == "arabic" else form.format(number)
        results = lint(config, command)
        deepspeed_refuses = [r for r in results if r["id"] == "CFG091" and r["status"] == "fail"]
        found = [r for r in results if r["id"] == "CFG003" and ".".join(keys) in r["message"]]
        shown = f"{' '.join(command)} {'.'.join(keys)}={holder[keys[-1]]!r}: " + "; ".join(
            f"{r['status']} {r['message']}" for r in found)
        refused += bool(deepspeed_refuses)
        accepted += not deepspeed_refuses
        if deepspeed_refuses and not [r for r in found if r["status"] == "fail"]:
            wrong.append(f"DeepSpeed refuses, CFG003 does not fail: {shown}")
        elif not deepspeed_refuses and [r for r in found if r["status"] == "fail" and "keeps it as text" not in
                                        r["message"] and "compares it with numbers" not in r["message"]]:
            wrong.append(f"DeepSpeed accepts, CFG003 fails without saying why the job stops: {shown}")
        elif [r for r in found if r["status"] == "warn" and "HfDeepSpeedConfig" not in r["message"] and
              "without accelerate" not in r["message"]]:
            wrong.append(f"an unexplained warning: {shown}")
    assert refused > 20 and accepted > 40, (refused, accepted)
    assert not wrong, "\n".join(wrong)


def test_launch_flags_decide_whether_numbers_as_text_stop_the_job(capsys, tmp_path):
    """The launch command's flags change what reads the file's text: --cpu runs accelerate's simple launcher
    whatever the type (it compares num_processes with 1, and only exports the port); --fsdp_auto_wrap_policy
    decides whether fsdp_min_num_params is read, and --fsdp_min_num_params replaces it. Each verdict is the
    same with and without the flag as accelerate's own, and the flag turns it round."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    import json

    from preflight.cli import main

    base = "compute_environment: LOCAL_MACHINE\nnum_machines: 1\nmixed_precision: 'no'\nnum_processes: {procs}\n"
    fsdp = "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n  fsdp_auto_wrap_policy: {policy}\n" \
           "  fsdp_min_num_params: 1e8\n  fsdp_transformer_layer_cls_to_wrap: Block\n"
    cases = [
        ("distributed_type: MULTI_GPU\n", "'8'", "num_processes", ("--cpu",)),
        ("distributed_type: MULTI_GPU\nmain_process_port: '29517'\n", "8", "main_process_port", ("--cpu",)),
        (fsdp.format(policy="TRANSFORMER_BASED_WRAP"), "2", "fsdp_min_num_params",
         ("--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP")),
        (fsdp.format(policy="SIZE_BASED_WRAP"), "2", "fsdp_min_num_params", ("--fsdp_min_num_params", "100000000")),
    ]
    for extra, procs, key, flags in cases:
        path = tmp_path / "accelerate.yaml"
        path.write_text(base.format(procs=procs) + extra)
        judged = {}
        for given in ((), flags):
            code = main(["lint", "--only", "CFG003", "--json", "--", "accelerate", "launch", "--config_file", str(path),
                         *given, "train.py"])
            out, _ = capsys.readouterr()
            failed = [r for r in json.loads(out)["results"] if r["status"] == "fail" and key in r["message"]]
            judged[given] = (bool(launch_refusal(path, given)), bool(failed))
        assert all(refused == failed for refused, failed in judged.values()), (key, flags, judged)
        assert judged[()] != judged[flags], (key, flags, judged)


def test_multinode_launcher_fails_where_accelerate_and_the_runner_stop_and_only_there(capsys, tmp_path):
    """deepspeed_multinode_launcher is read only over several machines: accelerate compares 'standard' and 'nossh'
    with its own spelling and hands any other value to DeepSpeed's runner, which lower-cases it. CFG002 fails
    exactly where that stops the launch, warns where the value is not read, and passes the rest."""
    for library in ("accelerate", "deepspeed"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed (the 'train' extra)")
    import json

    from preflight.cli import main

    (tmp_path / "hostfile").write_text("node01 slots=2\nnode02 slots=2\n")
    seen = set()
    for machines in (1, 2):
        for launcher in ("pdsh", "PDSH", "Slurm", "impi", "openmpi", "standard", "STANDARD", "nossh", "NoSSH", "ssh"):
            path = tmp_path / "accelerate.yaml"
            path.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: 'no'\n"
                            f"num_machines: {machines}\nnum_processes: {2 * machines}\nmachine_rank: 0\n"
                            f"main_process_ip: 10.0.0.1\nmain_process_port: 29517\ndeepspeed_config:\n  zero_stage: 2\n"
                            f"  deepspeed_hostfile: hostfile\n  deepspeed_multinode_launcher: {launcher}\n")
            main(["lint", "--only", "CFG002", "--json", "--config", str(path)])
            out, _ = capsys.readouterr()
            statuses = {r["status"] for r in json.loads(out)["results"]}
            refused = launch_refusal(path)
            verdict = "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"
            assert (verdict == "fail") == bool(refused), (machines, launcher, verdict, refused)
            if machines == 1:  # not read: a value that would stop a launch over several machines is a warning
                assert verdict == ("pass" if launcher in ("pdsh", "PDSH", "Slurm", "impi", "openmpi", "standard",
                                                          "nossh") else "warn"), (launcher, verdict)
            seen.add((machines, verdict))
    assert seen == {(1, "pass"), (1, "warn"), (2, "pass"), (2, "fail")}, seen


def test_rdzv_backend_in_the_file_is_dead_as_accelerate_launch_reads_it(capsys, tmp_path):
    """accelerate copies a config value only over a flag left at None; --rdzv_backend defaults to 'static', so the
    file's rdzv_backend never reaches torchrun. CFG002 warns about it (and never fails), unless the flag is given."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = tmp_path / "accelerate.yaml"
    for value in ("c10d", "c10"):
        path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: 'no'\n"
                        "num_machines: 2\nnum_processes: 4\nmachine_rank: 0\nmain_process_ip: 10.0.0.1\n"
                        f"main_process_port: 29517\nrdzv_backend: {value}\n")
        for flags, used in (((), "static"), (("--rdzv_backend", "c10d"), "c10d")):
            args = launch_command_parser().parse_args(["--config_file", str(path), *flags, "train.py"])
            assert _validate_launch_command(args)[0].rdzv_backend == used
            code, doc = lint(capsys, "--config", path, "--", "accelerate", "launch", "--config_file", path, *flags,
                             "train.py")
            statuses = [r["status"] for r in of(doc, "CFG002")]
            assert statuses == (["warn"] if not flags else ["pass"]), shown(doc)


def test_launch_flags_alone_fail_where_accelerate_stops(capsys, tmp_path):
    """`lint -- accelerate launch FLAGS` with no config file lints the flags, as accelerate launches them over its
    own defaults: every failure is one accelerate's launch path refuses (or a documented one it cannot see), and
    every refusal is a failure. Counts, ranks, types and --cpu over one and two machines."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    import itertools
    import json

    from preflight.cli import main

    verdicts = set()
    for kind, procs, machines, rank in itertools.product(
            ((), ("--multi_gpu",), ("--use_deepspeed",), ("--use_fsdp",), ("--cpu",), ("--cpu", "--multi_gpu")),
            (1, 2, 3, 4), (1, 2), (0, 1)):
        if rank >= machines:
            continue
        flags = (*kind, "--num_processes", str(procs), "--num_machines", str(machines), "--machine_rank", str(rank),
                 "--main_process_ip", "10.0.0.1", "--main_process_port", "29517", "--mixed_precision", "no")
        code = main(["lint", "--json", "--", "accelerate", "launch", *flags, "train.py"])
        out, _ = capsys.readouterr()
        failed = [r for r in json.loads(out)["results"] if r["status"] == "fail"] if code != 2 else ["exit 2"]
        undocumented = [r for r in failed if not isinstance(r, dict) or
                        not any(words in r["message"] for words in DOCUMENTED.get(r["id"], ()))]
        refused = launch_refusal(None, flags)
        assert bool(refused) == bool(undocumented), (flags, refused, failed)
        verdicts.add(bool(refused))
    assert verdicts == {True, False}


def test_launch_flags_alone_findings_name_the_flag(capsys):
    code, doc = lint(capsys, "--deep", "--", "accelerate", "launch", "--multi_gpu", "--num_processes", "3",
                     "--num_machines", "2", "--main_process_ip", "10.0.0.1", "--main_process_port", "29517", "train.py")
    assert [r["message"].split(";")[0] for r in of(doc, "CFG020", "fail")] == [
        "flag --num_processes: num_processes 3 does not divide by num_machines 2"], shown(doc)
    assert [r["status"] for r in of(doc, "CFG090")] == ["skip"], shown(doc)
    # no file and no flag: accelerate's defaults (the GPU count, one machine), nothing missing
    code, doc = lint(capsys, "--", "accelerate", "launch", "train.py")
    assert code == 0 and not [r for r in doc["results"] if r["status"] in ("fail", "warn")], shown(doc)
    assert [r["status"] for r in of(doc, "CFG020")] == ["pass"], shown(doc)


BASE = "compute_environment: LOCAL_MACHINE\nmixed_precision: 'no'\n"
DS = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"


@pytest.mark.parametrize("body,flags", [
    ("distributed_type: DEEPSPEED\nnum_processes: 1\ndeepspeed_config: {zero_stage: 2}\n", ("--gpu_ids", "0")),
    ("distributed_type: MULTI_GPU\nnum_machines: 1\nmachine_rank: 1\nnum_processes: 2\n", ()),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\n", ("--machine_rank", "1")),
    ("distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\nmain_process_ip: 10.0.0.1:29500\n", ()),
    (DS + "num_processes: 2\nmain_process_ip: <head_ip>\n", ()),
    ("distributed_type: 'NO'\nnum_processes: 1\nmain_process_port: 65536\n", ()),
    (DS + "num_processes: 2\ndynamo_backend: no\n", ()),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\ndynamo_backend: no\n", ("--dynamo_backend", "no")),
    (DS + "  deepspeed_config_file: null\n  gradient_accumulation_steps: null\nnum_processes: 2\nmachine_rank: null\n"
     "debug: 1\nfp16: 'true'\nsame_network: 'yes'\nenable_cpu_affinity: null\ntpu_use_sudo: 1\n", ()),
    ("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config: {zero_stage: null}\n", ()),
    ("distributed_type: MULTI_CPU\nnum_processes: 2\ngpu_ids: '0'\nuse_cpu: true\n", ()),
    ("distributed_type: MULTI_CPU\nnum_processes: 3\nnum_machines: 2\nmachine_rank: 0\nmain_process_ip: 10.0.0.1\n"
     "main_process_port: 29517\nuse_cpu: true\n", ()),
    ("distributed_type: 'NO'\n", ("--multi_gpu",)),
    (DS + "  deepspeed_multinode_launcher: pdsh\n  deepspeed_hostfile: hostfile\nnum_machines: 2\nnum_processes: 4\n"
     "main_process_port: 29517\nmachine_rank: 3\ngpu_ids: '0'\n", ()),
    ("distributed_type: 'NO'\nnum_machines: 1\nnum_processes: 1\nmain_process_port: abc\n", ()),
], ids=["gpu-ids-flag-is-text", "rank-on-one-machine", "rank-flag-on-one-machine", "bad-ip-unread",
        "placeholder-unread-by-deepspeed-on-one-machine", "port-unread-by-one-process", "dynamo-false-unread",
        "dynamo-false-under-a-flag", "template-nulls-and-unread-keys", "zero-stage-null", "multi-cpu-gpu-ids",
        "multi-cpu-indivisible", "no-fills-num-processes", "head-runner-reads-no-rank-ip-or-gpu-ids",
        "text-port-unread"])
def test_what_accelerate_launches_lint_does_not_refuse(capsys, tmp_path, body, flags):
    """Configs (and launch flags) that accelerate launches, found by a generated sweep against its launch path
    (false alarms of an earlier lint): no failure, no exit 2."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    path = tmp_path / "accelerate.yaml"
    path.write_text(BASE + body)
    (tmp_path / "hostfile").write_text("node01 slots=2\nnode02 slots=2\n")
    assert launch_refusal(path, flags) is None
    code, doc = lint(capsys, "--config", path, "--", "accelerate", "launch", "--config_file", path, *flags, "t.py")
    assert not [r for r in doc["results"] if r["status"] == "fail"], shown(doc)


def test_real_switch_given_a_value_from_accelerate_issue_1489(capsys, monkeypatch):
    """The command of accelerate#1489, expanded by bash as on the cluster: `--same_network false distrib.py` runs a
    script named 'false' (the thread's torchrun log shows `entrypoint : false`), and accelerate's parser agrees."""
    text = (REAL / "launch-flags/accelerate-issue-1489/command.sh").read_text()
    inner = text.split("'")[1]  # what `srun bash -c '...'` runs on each node
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "7010", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0",
           "PATH": "/usr/bin:/bin"}
    argv = subprocess.run(["bash", "-c", "printf '%s\\0' " + inner], env=env, capture_output=True, text=True,
                          check=True).stdout.split("\0")[:-1]
    assert argv[:2] == ["accelerate", "launch"] and "--num_processes=8" in argv
    code, doc = lint(capsys, "--", *argv)
    assert [r["message"] for r in of(doc, "CFG007", "fail")] == [
        "--same_network takes no value: accelerate launch reads the 'false' after it as the training script, and "
        "runs a script named 'false', with 'distrib.py' as its argument"], shown(doc)
    if importlib.util.find_spec("accelerate") is not None:
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(argv[2:])
        assert args.training_script == "false" and args.training_script_args == ["distrib.py"]


def videox_fun_command():
    """VideoX-Fun's ZeRO-3 launch line, expanded by bash as the README has it run."""
    text = (REAL / "launch-flags/videox-fun/command.sh").read_text()
    env = {"MODEL_NAME": "models/Diffusion_Transformer/Wan2.1-T2V-1.3B", "DATASET_NAME": "datasets/internal_datasets/",
           "DATASET_META_NAME": "datasets/internal_datasets/metadata.json", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["bash", "-c", "printf '%s\\0' " + text.replace("\\\n", " ")], env=env,
                          capture_output=True, text=True, check=True).stdout.split("\0")[:-1]


def test_real_deepspeed_flags_beside_a_json_from_videox_fun(capsys, monkeypatch):
    """VideoX-Fun gives --zero_stage, --zero3_save_16bit_model and --zero3_init_flag as flags beside
    --deepspeed_config_file, with no accelerate config. accelerate raises only for the keys its config file writes
    (ACCELERATE_CONFIG_DS_FIELDS), so the job starts: no CFG005 failure. The JSON's own "sequence_parallel" block is
    VideoX-Fun's, not a misspelt sequence_parallel_size (a number), and DeepSpeed ignores it: no failure either."""
    argv = videox_fun_command()
    monkeypatch.chdir(REAL / "launch-flags/videox-fun")  # the JSON's path is relative to where the job starts
    script = argv.index("scripts/wan2.1/train.py")
    assert argv[:2] == ["accelerate", "launch"] and "--zero_stage" in argv[:script]
    if importlib.util.find_spec("accelerate") is not None:
        assert launch_refusal(None, argv[2:script]) is None
    code, doc = lint(capsys, "--", *argv)
    assert code == 0 and not of(doc, "CFG005", "fail") and of(doc, "CFG005"), shown(doc)
    assert "fail" not in {r["status"] for r in of(doc, "CFG060")}, shown(doc)
    assert [r["message"].split(": ", 1)[1] for r in of(doc, "CFG060") if "'sequence_parallel'" in r["message"]] == \
        ["keys DeepSpeed does not read, ignored (another tool's, or notes): 'tensor_model_parallel_size', "
         "'sequence_parallel'"], shown(doc)


def test_a_deepspeed_key_the_file_writes_fails_beside_a_json_even_under_its_flag(capsys, tmp_path):
    """The other side of accelerate's rule: zero_stage in the config file stops the script even when --zero_stage
    gives another value (the file's keys are listed, not the values launched)."""
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}')
    path = tmp_path / "accelerate.yaml"
    path.write_text(BASE + DS + "  deepspeed_config_file: ds.json\nnum_processes: 2\n")
    flags = ("--zero_stage", "3")
    if importlib.util.find_spec("accelerate") is not None:
        assert "When using `deepspeed_config_file`" in launch_refusal(path, flags)
    code, doc = lint(capsys, "--config", path, "--", "accelerate", "launch", "--config_file", path, *flags, "t.py")
    keys = sorted(r["evidence"].get("key") for r in of(doc, "CFG005", "fail"))
    assert keys == ["deepspeed_config.zero_stage", "mixed_precision"], shown(doc)
    code, doc = lint(capsys, "--config", path, "--", "accelerate", "launch", "--config_file", path,
                     "--mixed_precision", "bf16", "t.py")  # a flag over the file's mixed_precision hides it
    keys = sorted(r["evidence"].get("key") for r in of(doc, "CFG005", "fail"))
    assert keys == ["deepspeed_config.zero_stage"], shown(doc)


def test_launch_command_tables_are_the_parsers_own():
    """The option kinds CFG007 judges are those of the installed launchers' argument parsers."""
    from preflight.inputs import launchcmd

    parsers = {}
    if importlib.util.find_spec("accelerate") is not None:
        from accelerate.commands.launch import launch_command_parser

        parsers["accelerate"] = launch_command_parser()
    if importlib.util.find_spec("torch") is not None:
        import torch.distributed.run as distrib_run

        parsers["torchrun"] = distrib_run.get_args_parser()
    if not parsers:
        pytest.skip("neither accelerate nor torch is installed (the 'train' extra)")
    for launcher, parser in parsers.items():
        ints = {a.dest for a in parser._actions if a.type is int}
        floats = {a.dest for a in parser._actions if a.type is float}
        truths = {a.dest for a in parser._actions if getattr(a.type, "__name__", "") == "str_to_bool"}
        assert floats == set(launchcmd.FLOAT_OPTIONS[launcher]), launcher
        assert truths == set(launchcmd.TRUTH_OPTIONS[launcher]), launcher
        choices = {a.dest: tuple(a.choices) for a in parser._actions if a.choices}
        choices.pop("numa_binding", None)  # torchrun's, newer than its parser's other choices: not judged
        for dest in ("parallelism_config_cp_backend", "parallelism_config_sp_backend"):
            choices.pop(dest, None)  # one choice each, for configs of the future
        assert ints == set(launchcmd.INT_OPTIONS[launcher]), launcher
        assert choices == launchcmd.CHOICES[launcher], launcher
        options = {o.lstrip("-").replace("-", "_") for a in parser._actions for o in a.option_strings
                   if o.startswith("--")}
        known = set(launchcmd.ACCELERATE_OPTIONS if launcher == "accelerate" else launchcmd.OPTIONS[launcher])
        known -= {"use_env"} if launcher == "torchrun" else set()  # torch.distributed.launch's own
        assert options == known, (launcher, options ^ known)


def parser_built_by(parse_args):
    """The argparse parser a launcher's parse_args builds and reads its arguments with."""
    import argparse
    from unittest import mock

    built = []

    def keep(parser, args=None, namespace=None):
        built.append(parser)
        raise SystemExit(0)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", keep), contextlib.suppress(SystemExit):
        parse_args(["t.py"])
    return built[0]


def test_abbreviations_read_as_the_launchers_argparse_reads_them():
    """Every prefix of every long option of torchrun and DeepSpeed's runner, in both spellings (a real command gave
    `torchrun --nproc 8`): lint reads the command as argparse does, a usage error where argparse stops (an ambiguous
    prefix, counting both spellings of one option; an unknown spelling) and the same option where it reads one."""
    from preflight.inputs import launchcmd

    parsers = {}
    if importlib.util.find_spec("torch") is not None:
        import torch.distributed.run as distrib_run

        import torch.distributed.launch as legacy_launch

        parsers["torchrun",] = distrib_run.get_args_parser()
        parsers["python", "-m", "torch.distributed.launch"] = parser_built_by(legacy_launch.parse_args)  # --use-env
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed.launcher import runner

        parsers["deepspeed",] = parser_built_by(runner.parse_args)
    if not parsers:
        pytest.skip("neither torch nor deepspeed is installed (the 'train' extra)")
    tried = 0
    for launcher, parser in parsers.items():
        actions = {o[2:]: a for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        words = {w[:n] for w in list(actions) + [w.replace("_", "-") for w in actions] for n in range(1, len(w) + 1)}
        for word in sorted(words):
            exact = actions.get(word)
            matches = {a for o, a in actions.items() if o.startswith(word)}
            action = exact or (next(iter(matches)) if len(matches) == 1 else None)
            value = () if action is not None and action.nargs == 0 else \
                (str((action.choices or ["2"])[0]) if action is not None else "2",)
            with contextlib.redirect_stderr(io.StringIO()):
                try:
                    namespace = parser.parse_args([f"--{word}", *value, "t.py"])
                except SystemExit:
                    namespace = None
            command = launchcmd.parse([*launcher, f"--{word}", *value, "t.py"])
            assert (command.problem is None) == (namespace is not None), (launcher, word, command.problem)
            if namespace is not None and value:  # the same option, given the value
                assert command.get(action.dest) == value[0] and getattr(namespace, action.dest) is not None, \
                    (launcher, word)
            tried += 1
    assert tried > 500


SEVERAL = ("--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1", "--main_process_port",
           "29517")


@pytest.mark.parametrize("flags", [
    ("--num_processes", "two"), ("--mixed_precision", "FP16"), ("--dynamo_backend", "INDUCTOR"),
    ("--fsdp_version", "3"), ("--cpu", "--multi_gpu"), ("--multi_gpu", "--num_processes", "1"), ("--zero_stage", "x"),
    ("--use_parallelism_config",), ("--multi_gpu=1", "--num_processes", "2"), ("--num_proc", "2"),
    ("--multi_gpu", *SEVERAL, "--machine_rank", "0"),  # the control: this one launches
    ("--multi_gpu", *SEVERAL), ("--use_deepspeed", *SEVERAL),  # no --machine_rank: int(None)
    ("--num_processes", "\u0663"),  # int() reads an Arabic-Indic 3
    ("--gradient_clipping", "x"), ("--gradient_clipping", "1e-3"), ("--fp8_pad_inner_dim", "maybe"),
    ("--fp8_pad_inner_dim", "Yes"),
    ("--num_processes", "x", "--num_processes", "2"),  # argparse converts each value, the last one wins
    ("--mixed_precision", "FP16", "--mixed_precision", "bf16"), ("--num_processes", "2", "--num_processes", "4"),
])
def test_launch_flags_alone_fail_where_accelerate_refuses_them(capsys, flags):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            refused = launch_refusal(None, flags)
    except SystemExit:  # accelerate's argument parser: a usage error
        refused = "usage error"
    code, doc = lint(capsys, "--", "accelerate", "launch", *flags, "train.py")
    failed = [r for r in doc["results"] if r["status"] == "fail"]
    assert bool(refused) == bool(failed), (refused, shown(doc))
    code, doc = lint(capsys, "--", "accelerate", "launch", "--num_processes", "2", "train.py")
    assert [r["status"] for r in of(doc, "CFG007")] == ["pass"], shown(doc)


@pytest.mark.parametrize("body,flags", [
    ("distributed_type: MULTI_CPU\nnum_processes: 2\nnum_machines: 2\nmachine_rank: 0\nmain_process_ip: 10.0.0.1\n",
     ()),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: ALL\n", ()),
    ("distributed_type: MULTI-GPU\nnum_processes: 2\n", ("--multi_gpu",)),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\ndynamo_config:\n  dynamo_backend: no\n", ()),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\ndynamo_backend: inductr\n", ()),
    ("distributed_type: MULTI_GPU\nnum_processes: 1\nnum_machines: 1\ngpu_ids: '0'\n", ("--cpu",)),
    ("distributed_type: 'NO'\nnum_processes: -1\n", ()),
], ids=["simple-launcher-without-port", "gpu-ids-ALL", "bad-type-under-a-type-flag", "dynamo-section-false",
        "dynamo-unknown", "one-gpu-id-multi-gpu-file-under-cpu", "no-with-num-processes-minus-one"])
def test_what_accelerate_refuses_lint_fails(capsys, tmp_path, body, flags):
    """Misses of an earlier lint, found by the same sweep: accelerate's launch path stops, and lint fails."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    path = tmp_path / "accelerate.yaml"
    path.write_text(BASE + body)
    assert launch_refusal(path, flags) is not None
    code, doc = lint(capsys, "--config", path, "--", "accelerate", "launch", "--config_file", path, *flags, "t.py")
    assert code == 1 and [r for r in doc["results"] if r["status"] == "fail"], shown(doc)


def test_fsdp_values_fail_where_accelerate_stops_and_only_there(capsys, tmp_path):
    """fsdp_config's enumerations and booleans, over both FSDP versions: CFG002 fails exactly where accelerate's
    launch or its FSDP plugin (built as the script starts) stops on them."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    import json

    from preflight.cli import main

    values = {
        "fsdp_sharding_strategy": ["FULL_SHARD", "full_shard", 1, "5", 6, "FULL_SHARDING", None],
        "fsdp_backward_prefetch": ["BACKWARD_PRE", "no_prefetch", 2, 3, "BACKWARDS", None],
        "fsdp_state_dict_type": ["SHARDED_STATE_DICT", "local_state_dict", 3, 4, "FULL"],
        "fsdp_auto_wrap_policy": ["TRANSFORMER_BASED_WRAP", "no_wrap", 1, "bogus"],
        "fsdp_offload_params": [True, "yes", "maybe", None],
        "fsdp_sync_module_states": [False, "false", None],
        "fsdp_reshard_after_forward": [True, "FULL_SHARD", None],
        "fsdp_activation_checkpointing_offload": [True],
    }
    seen = set()
    for version in (1, 2):
        for key, options in values.items():
            for value in options:
                path = tmp_path / "accelerate.yaml"
                path.write_text(BASE + "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n"
                                f"  fsdp_version: {version}\n  fsdp_transformer_layer_cls_to_wrap: Block\n"
                                f"  {key}: {json.dumps(value)}\n")
                main(["lint", "--only", "CFG002", "--json", "--config", str(path)])
                failed = [r for r in json.loads(capsys.readouterr()[0])["results"] if r["status"] == "fail"]
                refused = launch_refusal(path)
                assert bool(failed) == bool(refused), (version, key, value, refused, failed)
                seen.add(bool(refused))
    assert seen == {True, False}
    path.write_text(BASE + "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 3\n")
    assert "KeyError" in launch_refusal(path)  # reshard_after_forward 'true' read as a sharding strategy
    code, doc = lint(capsys, "--config", path)
    assert [r["message"].split(", ", 1)[1][:16] for r in of(doc, "CFG002", "fail")] == ["expected 1 or 2 "], shown(doc)


def test_accumulation_auto_in_accelerates_section_is_said_and_not_judged(capsys, tmp_path):
    """accelerate's DeepSpeedPlugin keeps "auto"; a script's Accelerator() then stops on int('auto'), unless it is
    the transformers Trainer, which hands the Accelerator its own accumulation (trainer.py). Which one runs is in the
    script, which lint does not read: rhymes-ai/Aria's four published configs (tests/fixtures/realworld/Aria) run
    under trl's SFTTrainer and work, and were warned. Said, not judged: a pass that names both."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    path = tmp_path / "accelerate.yaml"
    path.write_text(BASE + DS + "  gradient_accumulation_steps: auto\nnum_processes: 2\n")
    assert "invalid literal for int()" in launch_refusal(path)  # a script with a plain Accelerator()
    for command in ((), ("--", "accelerate", "launch", "--config_file", str(path), "train.py")):
        code, doc = lint(capsys, "--config", path, *command)
        assert code == 0 and [r["status"] for r in of(doc, "CFG002")] == ["pass"], shown(doc)
        message = of(doc, "CFG002")[0]["message"]
        assert "not judged" in message and "transformers Trainer fills it in" in message, message


def test_a_config_file_the_command_names_must_be_here(capsys, tmp_path):
    """sdiehl/tiny-r1 and 15 more real commands name an accelerate config by --config_file; where it is not a file,
    accelerate launch stops (config_args.py), and lint, which then had no config to read, used to pass."""
    if importlib.util.find_spec("accelerate") is not None:
        assert "does not exist" in launch_refusal(tmp_path / "missing.yaml")
    code, doc = lint(capsys, "--", "accelerate", "launch", "--config_file", "configs/deepspeed_zero3.yaml", "t.py")
    assert code == 1 and "--config_file names 'configs/deepspeed_zero3.yaml', which is not a file here" in \
        of(doc, "CFG007", "fail")[0]["message"], shown(doc)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/deepspeed_zero3.yaml").write_text(BASE + DS + "num_processes: 2\n")
    code, doc = lint(capsys, "--", "accelerate", "launch", "--config_file", "configs/deepspeed_zero3.yaml", "t.py")
    assert code == 0 and [r["status"] for r in of(doc, "CFG007")] == ["pass"], shown(doc)


def test_deepspeed_counts_with_a_host_filter_fail_as_the_runner_stops(capsys, monkeypatch):
    """A real command (`deepspeed --num_gpus 1 --include localhost:0 fine_tuning.py`): DeepSpeed's runner refuses
    counts beside a filter before it starts anything."""
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed.launcher import runner

        monkeypatch.setattr(runner, "fetch_hostfile", lambda path: None)  # this machine's /job/hostfile aside
        with pytest.raises(ValueError, match="Cannot specify num_nodes/gpus with include/exclude"):
            runner.main(["--num_gpus", "1", "--include", "localhost:0", "t.py"])
        capsys.readouterr()  # what the runner printed
    code, doc = lint(capsys, "--", "deepspeed", "--num_gpus", "1", "--include", "localhost:0", "t.py")
    assert "Cannot specify num_nodes/gpus" in of(doc, "CFG007", "fail")[0]["message"], shown(doc)
    code, doc = lint(capsys, "--", "deepspeed", "--include", "localhost:0", "t.py")
    assert [r["status"] for r in of(doc, "CFG007")] == ["pass"], shown(doc)


def test_torchrun_standalone_over_several_nodes_fails(capsys, monkeypatch):
    """--standalone makes torchrun meet on localhost whatever --nnodes says: each of the nodes waits alone."""
    import torch.distributed.run as distrib_run

    started = []
    monkeypatch.setattr(distrib_run, "elastic_launch", lambda config, entrypoint: started.append(config) or
                        (lambda *args: None))
    distrib_run.run(distrib_run.parse_args(["--standalone", "--nnodes", "2", "--nproc_per_node", "4", "--node_rank",
                                            "1", "--master_addr", "node001", "t.py"]))
    assert started[0].rdzv_endpoint == "localhost:0" and started[0].max_nodes == 2
    argv = ["torchrun", "--standalone", "--nnodes", "2", "--nproc_per_node", "4", "--node_rank", "1", "--master_addr",
            "node001", "--master_port", "7000", "t.py"]  # as a launch script found by code search has it
    code, doc = lint(capsys, "--", *argv)
    assert "--standalone with --nnodes" in of(doc, "CFG007", "fail")[0]["message"], shown(doc)
    code, doc = lint(capsys, "--", "torchrun", "--standalone", "--nnodes", "1", "--nproc_per_node", "4", "t.py")
    assert [r["status"] for r in of(doc, "CFG007")] == ["pass"], shown(doc)


def test_runner_without_a_hostfile_or_address_and_an_uneven_count(capsys, tmp_path):
    """Ray's test config for DeepSpeed over pdsh (main_process_ip '', deepspeed_hostfile '', one process over two
    machines), as accelerate hands it to DeepSpeed's runner: no --master_addr (the runner finds one), --num_gpus 0
    (every slot), and a hostfile the runner cannot find (the head trains alone). The empty address and the uneven
    count are warnings; the missing hostfile fails, as a missing path does, and so does no deepspeed_hostfile."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(BASE + DS + "  deepspeed_hostfile: ''\n  deepspeed_multinode_launcher: pdsh\nnum_machines: 2\n"
                    "num_processes: 1\nmachine_rank: 0\nmain_process_ip: ''\nmain_process_port: 29500\n")
    if importlib.util.find_spec("deepspeed") is not None:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_deepspeed_cmd_env
        from deepspeed.launcher import runner

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "t.py"]))[0]
            args.deepspeed_fields_from_accelerate_config = ""
            cmd = prepare_deepspeed_cmd_env(args)[0]
        assert cmd[cmd.index("--hostfile") + 1] == "" and "--master_addr" not in cmd
        assert cmd[cmd.index("--num_gpus") + 1] == "0"
        assert runner.fetch_hostfile("") is None  # "Unable to find hostfile": local resources only
        pool = {"node01": [0, 1], "node02": [0, 1]}
        assert runner.apply_num_nodes_and_gpus(copy.deepcopy(pool), -1, 0) == pool
        capsys.readouterr()  # what the runner logged
    code, doc = lint(capsys, "--config", path)
    assert {r["id"]: r["status"] for r in doc["results"] if r["status"] not in ("pass", "skip")} == \
        {"CFG010": "warn", "CFG020": "warn", "CFG021": "fail"}, shown(doc)
    assert "trains on the head alone" in of(doc, "CFG021")[0]["message"]
    path.write_text(path.read_text().replace("  deepspeed_hostfile: ''\n", ""))
    code, doc = lint(capsys, "--config", path)
    assert "deepspeed_hostfile is not set: accelerate passes `--hostfile None`" in of(doc, "CFG021", "fail")[0][
        "message"], shown(doc)


def test_messages_name_what_the_launch_runs(capsys, tmp_path):
    """Two messages the real-config sweep found wrong: rdzv_backend under DeepSpeed's runner (no torchrun runs),
    and a deepspeed_config section beside no distributed_type key (not set, rather than null)."""
    path = tmp_path / "accelerate.yaml"
    (tmp_path / "hostfile").write_text("node01 slots=2\nnode02 slots=2\n")
    path.write_text(BASE + DS + "  deepspeed_hostfile: hostfile\nnum_machines: 2\nnum_processes: 4\nmachine_rank: 0\n"
                    "main_process_ip: 10.0.0.1\nmain_process_port: 29500\nrdzv_backend: c10d\n")
    code, doc = lint(capsys, "--config", path)
    message = [r["message"] for r in of(doc, "CFG002", "warn") if "rdzv_backend" in r["message"]]
    assert message and "DeepSpeed's runner starts the job" in message[0] and "torchrun" not in message[0], shown(doc)
    path.write_text(BASE + "deepspeed_config:\n  zero_stage: 2\nnum_processes: 2\n")
    code, doc = run_cli(capsys, "lint", "--config", str(path), "--json")[:2]
    assert any("distributed_type not set, so accelerate never reads" in r["message"] for r in of(doc, "CFG004")), \
        shown(doc)


def test_real_commented_deepspeed_json_from_deepspeedexamples(capsys, tmp_path):
    """DeepSpeedExamples' annotated ZeRO-3 config is JSON with // comments: DeepSpeed reads config files with hjson
    and takes it; accelerate's plugin (and the transformers Trainer) read it with json.load and stop. Alone it is a
    warning (it used to be bad input, exit 2); named by an accelerate config, a failure."""
    path = REAL / "json-comments/deepspeedexamples-zero3_nvme_offload_annotated.json"
    if importlib.util.find_spec("deepspeed") is not None:
        import json

        import hjson

        assert hjson.load(path.open())["zero_optimization"]["stage"] == 3  # deepspeed/runtime/config.py's reader
        with pytest.raises(json.JSONDecodeError):
            from accelerate.utils.deepspeed import HfDeepSpeedConfig

            HfDeepSpeedConfig(str(path))
    code, doc = lint(capsys, "--deepspeed", path)
    assert [r["status"] for r in of(doc, "CFG008")] == ["warn"] and code == 0, shown(doc)
    config = tmp_path / "accelerate.yaml"
    config.write_text(BASE + f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {path}\n"
                      "num_processes: 1\n")
    code, doc = lint(capsys, "--config", config)
    assert [r["status"] for r in of(doc, "CFG008")] == ["fail"], shown(doc)


def test_real_optimizer_deepspeed_no_longer_builds(capsys):
    """DeepSpeedExamples' 70B multi-node config (256 = 1 x 8 x 32 GPUs) names OneBitAdam, which DeepSpeed 0.19.8 has
    no more: DeepSpeedConfig takes the name, and the engine's getattr(torch.optim, 'OneBitAdam') stops every rank
    once the model has loaded. The deep validator asks the installed DeepSpeed and torch."""
    for library in ("deepspeed", "torch"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed (the 'train' extra)")
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    assert "onebitadam" not in DEEPSPEED_OPTIMIZERS and not hasattr(torch.optim, "OneBitAdam")
    path = REAL / "removed-optimizer/deepspeedexamples-llama_70b_multi_node.json"
    code, doc = lint(capsys, "--deepspeed", path, "--world-size", "32", "--deep")
    assert [r["status"] for r in of(doc, "CFG091")] == ["fail"], shown(doc)
    assert "optimizer 'OneBitAdam' is neither one of DeepSpeed" in of(doc, "CFG091")[0]["message"]
    code, doc = lint(capsys, "--deepspeed", REAL / "working/fastchat-deepspeed_config_s2.json", "--world-size", "32",
                     "--deep")
    assert [r["status"] for r in of(doc, "CFG091")] == ["pass"], shown(doc)


def test_real_host_filter_beyond_the_hostfile_from_deepspeed_issue_3625(capsys, monkeypatch):
    """DeepSpeed#3625: two nodes of four GPUs, a hostfile of `slots=2` each (the two free GPUs), and
    `--include=work1:2,3`; DeepSpeed's runner numbers a host's slots 0 to slots-1 and stops on slot 2 before it
    starts anything. lint reads the hostfile the command names, and the filter against it, as the runner does."""
    folder = REAL / "host-filter/deepspeed-issue-3625"
    monkeypatch.chdir(folder)
    argv = (folder / "command.sh").read_text().split()
    hosts = {"work1": 2, "work2": 2}
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed.launcher import runner

        assert runner.fetch_hostfile("hostfile") == hosts
        with pytest.raises(ValueError, match="No slot '2' specified on host 'work1'"):
            runner.parse_inclusion_exclusion(hosts, "work1:2,3", "")
        for include in ("work1:0,1", "work2@work1:1", "work1:0"):  # and what it takes
            runner.parse_inclusion_exclusion(hosts, include, "")
        capsys.readouterr()
    code, doc = lint(capsys, "--", *argv)
    assert "DeepSpeed's runner stops with 'No slot '2' specified on host 'work1''" in \
        of(doc, "CFG021", "fail")[0]["message"], shown(doc)
    for include in ("work1:0,1", "work2@work1:1", "work1:0"):
        code, doc = lint(capsys, "--", "deepspeed", "--hostfile", "hostfile", f"--include={include}", "training.py")
        assert not of(doc, "CFG021", "fail"), shown(doc)
    code, doc = lint(capsys, "--", "deepspeed", "--hostfile", "hostfile", "--exclude=work3", "training.py")
    assert "Hostname 'work3' not found in hostfile" in of(doc, "CFG021", "fail")[0]["message"], shown(doc)


def test_accelerates_host_filter_is_judged_against_its_hostfile(capsys, tmp_path):
    """accelerate hands deepspeed_inclusion_filter to DeepSpeed's runner as --include (utils/launch.py)."""
    (tmp_path / "hostfile").write_text("work1 slots=2\nwork2 slots=2\n")
    path = tmp_path / "accelerate.yaml"
    path.write_text(BASE + DS + "  deepspeed_hostfile: hostfile\n  deepspeed_inclusion_filter: work1:2,3\n"
                    "num_machines: 2\nnum_processes: 4\nmachine_rank: 0\nmain_process_ip: 10.0.0.1\n"
                    "main_process_port: 29500\n")
    code, doc = lint(capsys, "--config", path)
    assert "deepspeed_inclusion_filter" in of(doc, "CFG021", "fail")[0]["message"], shown(doc)
    path.write_text(path.read_text().replace("work1:2,3", "work1:0,1@work2"))
    code, doc = lint(capsys, "--config", path)
    assert not of(doc, "CFG021", "fail"), shown(doc)
    # with both keys accelerate passes the exclusion alone
    path.write_text(path.read_text().replace("  deepspeed_hostfile:", "  deepspeed_exclusion_filter: work3\n"
                                             "  deepspeed_hostfile:"))
    if importlib.util.find_spec("accelerate") is not None:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_deepspeed_cmd_env

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                contextlib.chdir(tmp_path):
            args = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "t.py"]))[0]
            args.deepspeed_fields_from_accelerate_config = ""
            cmd = prepare_deepspeed_cmd_env(args)[0]
        assert cmd[cmd.index("--exclude") + 1] == "work3" and "--include" not in cmd
    code, doc = lint(capsys, "--config", path)
    assert "Hostname 'work3' not found in hostfile" in of(doc, "CFG021", "fail")[0]["message"], shown(doc)


def test_runner_resources_are_deepspeeds_own():
    """What DeepSpeed's runner starts on each host (its world size) and where it stops, over a grid of
    --include/--exclude/--num_nodes/--num_gpus and a hostfile, as its main() computes them."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (the 'train' extra)")
    from deepspeed.launcher import runner

    from preflight.inputs.configs import runner_resources

    slots = {"n1": 2, "n2": 4, "n3": 1}
    filters = ["", "n1", "n2:1,3", "n1@n3", "n2:0@n2:2", "n2@n2:1", "n4", "n1:2", "n2:x", "n1:", "n3:0@n1:0,1"]
    tried = 0
    for include, exclude in [(f, "") for f in filters] + [("", f) for f in filters] + [("n1", "n2")]:
        for num_nodes, num_gpus in ((-1, -1), (2, -1), (-1, 3), (1, 1), (0, -1)):
            try:
                if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):  # main() says so first
                    raise ValueError("Cannot specify num_nodes/gpus with include/exclude")
                active = runner.parse_inclusion_exclusion(dict(slots), include, exclude)
                theirs = ({h: len(s) for h, s in runner.apply_num_nodes_and_gpus(active, num_nodes, num_gpus).items()},
                          None)
            except ValueError as exc:
                theirs = (None, str(exc))
            ours = runner_resources(slots, include, exclude, num_nodes, num_gpus)
            assert (ours[0], ours[1] is None) == (theirs[0], theirs[1] is None), (include, exclude, num_nodes,
                                                                                  num_gpus, ours, theirs)
            if ours[1] and "invalid literal" not in ours[1]:
                assert ours[1] == theirs[1], (include, exclude, ours, theirs)
            tried += 1
    assert tried > 100


def test_the_world_is_what_deepspeeds_runner_starts_over_the_hostfile(capsys, tmp_path, monkeypatch):
    """A batch that fits the processes --include/--num_nodes/--num_gpus leave is no CFG030 failure, though it does
    not fit every slot of the hostfile (lint took every slot when the hostfile came with such a command)."""
    monkeypatch.chdir(REAL / "host-filter/deepspeed-issue-3625")  # work1 slots=2, work2 slots=2
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}')
    for flags, status in ((["--include=work1:0,1"], "pass"), (["--num_nodes", "1"], "pass"),
                          (["--num_gpus", "1"], "pass"), (["--exclude=work2:1"], "fail"), ([], "fail")):
        code, doc = lint(capsys, "--deepspeed", ds, "--", "deepspeed", "--hostfile", "hostfile", *flags, "t.py")
        assert [r["status"] for r in of(doc, "CFG030")] == [status], (flags, shown(doc))


@pytest.mark.parametrize("argv", [
    ["torchrun", "--nnodes", "1:x", "t.py"], ["torchrun", "--nnodes=1:1:4", "t.py"],
    ["torchrun", "--nnodes", "1:4", "t.py"],
    ["torchrun", "--rdzv_conf", "--x", "t.py"], ["torchrun", "--master_port", "-1", "t.py"],
    ["deepspeed", "--launcher_args", "--foo", "t.py"], ["deepspeed", "--launcher_args", "--foo bar", "t.py"],
    ["deepspeed", "--num_nodes", "-1", "--include", "h1", "t.py"],
    ["deepspeed", "--num_gpus", "0", "--exclude", "h1", "t.py"],
], ids=lambda argv: " ".join(argv[1:-1]))
def test_launcher_values_read_as_the_launchers_read_them(capsys, argv):
    """A value argparse takes for an option, torchrun's --nnodes format, and DeepSpeed's
    test of counts beside a filter (>= 0): CFG007 fails exactly where the launcher stops before starting anything."""
    for library in ("torch", "deepspeed"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed (the 'train' extra)")
    import torch.distributed.run as distrib_run
    from deepspeed.launcher import runner

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            if argv[0] == "torchrun":
                distrib_run.parse_min_max_nnodes(distrib_run.parse_args(argv[1:]).nnodes)
            else:
                args = runner.parse_args(argv[1:])
                if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
                    raise ValueError("Cannot specify num_nodes/gpus with include/exclude")  # main(), first
        stops = False
    except (SystemExit, ValueError, RuntimeError):
        stops = True
    capsys.readouterr()  # what the libraries printed
    code, doc = lint(capsys, "--", *argv)
    assert bool(of(doc, "CFG007", "fail")) == stops, shown(doc)


def test_hostile_host_filters_and_hostfiles(capsys, tmp_path, monkeypatch):
    """A filter that leaves no slot (DeepSpeed's runner then indexes no host), one the node's shell fills in, a
    hostfile line with another launcher's setting after the slots (DeepSpeed reads the start), and host names too
    long to quote whole."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").write_text("h1 slots=2 max_slots=8\nh2 slots=2  # the spare\n")
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}')
    if importlib.util.find_spec("deepspeed") is not None:
        from deepspeed.launcher import runner

        assert runner._parse_hostfile((tmp_path / "hf").read_text().splitlines()) == {"h1": 2, "h2": 2}
        assert runner.parse_inclusion_exclusion({"h1": 2, "h2": 2}, "", "h1@h2") == {}
        with pytest.raises(ValueError, match="bad entry"):
            runner._parse_hostfile(["h1 slots = 2"])
        capsys.readouterr()
    code, doc = lint(capsys, "--deepspeed", ds, "--", "deepspeed", "--hostfile", "hf", "t.py")
    assert code == 0 and [r["status"] for r in of(doc, "CFG030")] == ["pass"], shown(doc)
    code, doc = lint(capsys, "--deepspeed", ds, "--", "deepspeed", "--hostfile", "hf", "--exclude", "h1@h2", "t.py")
    assert "leaves no slot" in of(doc, "CFG021", "fail")[0]["message"] and not of(doc, "CFG030", "error"), shown(doc)
    code, doc = lint(capsys, "--deepspeed", ds, "--", "deepspeed", "--hostfile", "hf", "--include", "$HOSTS", "t.py")
    assert not of(doc, "CFG021", "fail"), shown(doc)
    code, doc = lint(capsys, "--deepspeed", ds, "--", "deepspeed", "--hostfile", "hf", "--include", "h" * 3000, "t.py")
    assert len(of(doc, "CFG021", "fail")[0]["message"]) < 600, shown(doc)
    (tmp_path / "hf").write_text("h1 slots = 2\n")  # DeepSpeed refuses the spaces: bad input here too
    from preflight.cli import main

    assert main(["lint", "--hostfile", str(tmp_path / "hf")]) == 2
    assert "expected 'HOSTNAME slots=N'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["lr_scheduler", "Optimizer", "swa_utils", "OneBitAdam"])
def test_deep_validator_wants_an_optimizer_class(capsys, tmp_path, kind):
    """torch.optim holds more than optimizers: the engine's getattr(torch.optim, name)(params, ...) needs one."""
    for library in ("deepspeed", "torch"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed (the 'train' extra)")
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "%s"}}' % kind)
    code, doc = lint(capsys, "--deepspeed", path, "--world-size", "1", "--deep")
    assert [r["status"] for r in of(doc, "CFG091")] == ["fail"], shown(doc)
