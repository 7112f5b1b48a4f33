"""The CFG checks, rule by rule, from fixture files, through the real command line (in-process).

Every rule of every CFG check has a failing fixture and a passing one, under
tests/fixtures/config/<CHECK>/<case>/. A case folder holds any of:

  accelerate.yaml or accelerate.json   given as --config
  ds.json                              given as --deepspeed, unless the accelerate config names it
                                       (deepspeed_config_file), in which case preflight finds it itself
  hostfile                             given as --hostfile

The tests run from an empty working directory, so a deepspeed_config_file is found beside the
accelerate config, as it is wherever the job is launched from.

tests/fixtures/config/golden/ holds whole jobs (one machine, two machines) that must pass every check,
and tests/fixtures/realworld/ configurations copied from popular projects (see its README.md).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from conftest import run_cli
from preflight.inputs.documents import load
from preflight.inputs.configs import AccelerateConfig, DeepSpeedConfig
from preflight.plan import Plan
from preflight.runner import CheckContext

FIXTURES = Path(__file__).parents[1] / "fixtures"
CONFIG = FIXTURES / "config"
REALWORLD = FIXTURES / "realworld"


@pytest.fixture(autouse=True)
def empty_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def case_args(folder: Path, extra=()) -> list:
    args = []
    names_file = False
    for name in ("accelerate.yaml", "accelerate.json"):
        if (folder / name).exists():
            args += ["--config", folder / name]
            names_file = "deepspeed_config_file" in (folder / name).read_text()
            break
    if (folder / "ds.json").exists() and not names_file and "--deepspeed" not in extra:
        args += ["--deepspeed", folder / "ds.json"]
    if (folder / "hostfile").exists():
        args += ["--hostfile", folder / "hostfile"]
    return args + [str(a).format(case=folder) for a in extra]


def lint(capsys, *args):
    args = [str(a) for a in args]
    cut = args.index("--") if "--" in args else len(args)  # --json is preflight's, not the command's
    code, doc, err = run_cli(capsys, "lint", *args[:cut], "--json", *args[cut:])
    assert code in (0, 1), f"exit {code}: {err}"
    assert doc["schema"] == 1 and doc["nodes"] == []
    return code, doc


def results_of(doc, check_id):
    found = [r for r in doc["results"] if r["id"] == check_id]
    assert found, f"{check_id} yielded no result"
    return found


def shown(results):
    return "\n".join(f"  {r['id']} {r['status']}: {r['message']}" for r in results)


# (case folder under fixtures/config, extra CLI args, check, expected status, in the message, location)
# The location is FILE:LINE (or the file alone when the key is absent), and must be in the message.
# Passing cases: every result of the check is "pass" (so it was evaluated, not skipped), and the
# message holds the text given, if any.
BATCH_CHECKS = {"CFG070", "CFG071", "CFG072", "CFG073", "CFG074", "CFG075", "CFG076"}  # a SLURM batch script's (--sbatch)
MANIFEST_CHECKS = {f"CFG08{i}" for i in range(7)}  # a Kubernetes manifest's (--k8s)

CMD = ["--", "accelerate", "launch", "train.py"]  # a launch command that gives nothing the file lacks
CASES = [
    # CFG001 accelerate-keys
    ("CFG001/unknown-key", [], "CFG001", "fail", "unknown key 'mixed_precison' (did you mean 'mixed_precision'?)",
     "accelerate.yaml:3"),
    ("CFG001/unknown-key-json", [], "CFG001", "fail", "unknown key 'num_process' (did you mean 'num_processes'?)",
     "accelerate.json:5"),
    ("CFG001/removed-key", [], "CFG001", "fail", "'ipex_config' is removed in accelerate 1.x", "accelerate.yaml:6"),
    ("CFG001/sagemaker-cluster-key", [], "CFG001", "fail", "unknown key 'num_processes'", "accelerate.yaml:7"),
    ("CFG001/ok-all-known", [], "CFG001", "pass", "", None),
    ("CFG001/ok-sagemaker", [], "CFG001", "pass", "", None),
    # CFG002 accelerate-values
    ("CFG002/missing-distributed-type", [], "CFG002", "fail", "distributed_type is missing", "accelerate.yaml"),
    ("CFG002/bad-distributed-type", [], "CFG002", "fail",
     "distributed_type is 'multi_gpu', expected one of NO, MULTI_CPU, MULTI_GPU", "accelerate.yaml:2"),
    ("CFG002/bad-distributed-type", [], "CFG002", "fail", "(did you mean 'MULTI_GPU'?)", "accelerate.yaml:2"),
    ("CFG002/sagemaker-cluster-type", [], "CFG002", "fail",
     "distributed_type is 'MULTI_GPU', expected one of NO, DATA_PARALLEL, MODEL_PARALLEL", "accelerate.yaml:2"),
    ("CFG002/bad-compute-environment", [], "CFG002", "fail",
     "compute_environment is 'LOCAL', expected one of LOCAL_MACHINE, AMAZON_SAGEMAKER", "accelerate.yaml:1"),
    ("CFG002/bad-mixed-precision", [], "CFG002", "fail",
     "mixed_precision is 'bfloat16', expected one of no, fp16, bf16, fp8 (did you mean 'bf16'?)", "accelerate.yaml:3"),
    # accelerate never copies rdzv_backend from the file (the flag's default 'static' wins): any value there is dead
    ("CFG002/bad-rdzv-backend", [], "CFG002", "warn", "rdzv_backend is 'c10', but accelerate launch never reads it "
     "from the config", "accelerate.yaml:5"),
    # one machine: the static rendezvous starts it as c10d would (bionemo's esm2 recipes): said, not warned
    ("CFG002/one-machine-rdzv-backend", [], "CFG002", "pass", "rdzv_backend 'c10d' is not read from the config (the "
     "flag's default, 'static', wins); on one machine either starts the job", "accelerate.yaml:5"),
    ("CFG002/unread-rdzv-backend", [], "CFG002", "warn", "rdzv_backend is 'c10d', but accelerate launch never reads "
     "it from the config (its --rdzv_backend flag defaults to 'static', and the flag wins), so torchrun uses 'static'",
     "accelerate.yaml:7"),
    ("CFG002/ok-rdzv-backend-flag", ["--", "accelerate", "launch", "--config_file", "{case}/accelerate.yaml",
                                     "--rdzv_backend", "c10d", "train.py"], "CFG002", "pass", "", None),
    # CFG007 launch-command
    ("CFG007/switch-given-a-value", ["--", "accelerate", "launch", "--config_file", "{case}/accelerate.yaml",
                                     "--same_network", "false", "train.py"], "CFG007", "fail",
     "--same_network takes no value: accelerate launch reads the 'false' after it as the training script", None),
    ("CFG007/ok-command", ["--", "accelerate", "launch", "--config_file", "{case}/accelerate.yaml", "--same_network",
                           "train.py"], "CFG007", "pass", "accelerate launch reads the command: script 'train.py'", None),
    # CFG008 json-comments
    ("CFG008/comments-under-accelerate", [], "CFG008", "fail",
     "the DeepSpeed config holds comments, and accelerate launches the job", "ds.json"),
    ("CFG008/comments-alone", [], "CFG008", "warn", "DeepSpeed reads it with hjson and takes them", "ds.json"),
    ("CFG008/plain-json", [], "CFG008", "pass", "is plain JSON", None),
    ("CFG002/bad-multinode-launcher", [], "CFG002", "fail",
     "deepspeed_config.deepspeed_multinode_launcher is 'ssh' (did you mean 'nossh'?) over 2 machines: DeepSpeed's "
     "runner stops on the unknown launcher 'ssh'", "accelerate.yaml:3"),
    # accelerate reads the launcher only over several machines (utils/launch.py prepare_deepspeed_cmd_env)
    ("CFG002/unread-multinode-launcher", [], "CFG002", "warn",
     "is 'ssh' (did you mean 'nossh'?); accelerate reads it only when num_machines > 1", "accelerate.yaml:3"),
    # accelerate compares 'standard' exactly and hands anything else to DeepSpeed's runner, which lower-cases it
    ("CFG002/upper-case-standard-launcher", [], "CFG002", "fail",
     "accelerate recognises only 'standard', so it starts DeepSpeed's runner with --launcher STANDARD",
     "accelerate.yaml:3"),
    ("CFG002/ok-upper-case-runner-launcher", [], "CFG002", "pass", "", None),
    ("CFG002/bad-offload-device", [], "CFG002", "fail",
     "deepspeed_config.offload_optimizer_device is 'gpu', expected one of none, cpu, nvme", "accelerate.yaml:3"),
    # accelerate lower-cases the offload devices (utils/launch.py): 'CPU' works
    ("CFG002/bad-offload-param-device", [], "CFG002", "pass", "", None),  # once flagged: a false alarm
    ("CFG002/number-distributed-type", [], "CFG002", "warn",  # once bad input (exit 2); accelerate runs it as 'NO'
     "distributed_type is 1; accelerate launches the script as one process with no distributed setup, as with 'NO'",
     "accelerate.yaml:2"),
    ("CFG002/ok-values", [], "CFG002", "pass", "", None),
    ("CFG001/ok-sagemaker", [], "CFG002", "pass", "", None),
    ("CFG002/ok-upper-case-mixed-precision", [], "CFG002", "pass", "", None),  # accelerate lower-cases it
    # CFG003 yaml-traps
    ("CFG003/unquoted-no-distributed-type", [], "CFG003", "warn",  # accelerate launches false as 'NO'
     "distributed_type is false (YAML 1.1 reads an unquoted NO as false); accelerate launches it as 'NO'",
     "accelerate.yaml:2"),
    ("CFG003/unquoted-no-mixed-precision", [], "CFG003", "fail",
     "mixed_precision is false, expected a word such as 'NO'", "accelerate.yaml:3"),
    ("CFG003/unquoted-no-dynamo-backend", [], "CFG003", "fail",
     "dynamo_backend is false, expected a word such as 'NO'", "accelerate.yaml:4"),
    ("CFG003/quoted-port", [], "CFG003", "fail",
     "main_process_port is the string '29500', expected a number: the number is quoted", "accelerate.yaml:5"),
    ("CFG003/yaml-exponent-accelerate-key", [], "CFG003", "fail",
     "fsdp_config.fsdp_min_num_params is the string '1e8', expected a number: YAML 1.1 reads 1e8 (no dot in the "
     "mantissa, or no sign in the exponent) as a string; accelerate passes it on as text, and it is read back "
     "with int(), which refuses '1e8'", "accelerate.yaml:5"),
    ("CFG003/quoted-num-processes-multinode", [], "CFG003", "fail",
     "num_processes is the string '16', expected a number: the number is quoted, so it is a string; accelerate divides it by "
     "num_machines and stops with a TypeError", "accelerate.yaml:7"),
    # Text accelerate reads as its number: float() of the clipping, int() of a rank, torchrun's own reading of
    # num_processes on one machine; and a DeepSpeed-JSON key pasted into the section, never read (CFG004).
    ("CFG003/ok-yaml-exponent-clipping", [], "CFG003", "pass", "", None),
    ("CFG003/ok-quoted-num-processes-one-machine", [], "CFG003", "pass", "", None),
    ("CFG003/ok-exponent-in-ignored-key", [], "CFG003", "pass", "", None),
    ("CFG003/json-quoted-number", [], "CFG003", "fail",
     "zero_optimization.allgather_bucket_size is the string '5e8', expected a number: the number is quoted",
     "ds.json:6"),
    ("CFG003/ok-numbers", [], "CFG003", "pass", "", None),
    ("CFG003/ok-quoted-no", [], "CFG003", "pass", "", None),
    # CFG004 deepspeed-section-keys
    ("CFG004/deepspeed-json-keys", [], "CFG004", "warn",  # ignored, the job runs: not a refusal
     "deepspeed_config holds DeepSpeed-JSON keys (train_micro_batch_size_per_gpu, fp16) that accelerate ignores",
     "accelerate.yaml:4"),
    ("CFG004/unknown-key", [], "CFG004", "warn",
     "deepspeed_config.offload_optimizer_devce is not a key accelerate knows (did you mean 'offload_optimizer_device'?)",
     "accelerate.yaml:3"),
    ("CFG004/ok-accelerate-keys", [], "CFG004", "pass", "", None),  # gradient_accumulation_steps/clipping are accelerate's
    # CFG005 deepspeed-config-file
    ("CFG005/not-used", [], "CFG005", "warn",
     "distributed_type is 'MULTI_GPU', so the DeepSpeed config", "accelerate.yaml:2"),
    # lint reads no node: a file missing here may be on the nodes (`check` and `node` ask them: a failure there)
    ("CFG005/missing-file", [], "CFG005", "skip",
     "deepspeed_config_file 'configs/zero2.json' is not here (the working directory, beside", "accelerate.yaml:3"),
    ("CFG005/other-file-checked", ["--deepspeed", "{case}/other.json"], "CFG005", "warn",
     "but the DeepSpeed config checked is", "accelerate.yaml:3"),
    ("CFG005/conflicting-key", [], "CFG005", "fail",
     "deepspeed_config.zero_stage is set beside deepspeed_config_file; accelerate raises", "accelerate.yaml:5"),
    # a --mixed_precision flag would clear it: without the launch command a warning, with one that lacks it a failure
    ("CFG005/mixed-precision-beside-file", [], "CFG005", "warn",
     "mixed_precision is set beside deepspeed_config_file; unless the launch command passes --mixed_precision",
     "accelerate.yaml:5"),
    ("CFG005/mixed-precision-beside-file", CMD, "CFG005", "fail",
     "mixed_precision is set beside deepspeed_config_file; accelerate raises", "accelerate.yaml:5"),
    ("CFG005/no-zero-block", [], "CFG005", "fail",
     "no zero_optimization block; accelerate requires one", "ds.json"),
    ("CFG005/ok-file-beside-config", [], "CFG005", "pass", "", None),
    # the same file, spelt another way on the command line, is the file the job uses
    ("CFG005/ok-file-beside-config", ["--deepspeed", "{case}/./ds.json"], "CFG005", "pass", "", None),
    # CFG006 duplicate-keys
    # who opens the file is not known (the HF Trainer keeps the last): a warning; DeepSpeed's runner refuses it
    ("CFG006/json-duplicate", [], "CFG006", "warn",
     "key 'zero_optimization.stage' is given twice; DeepSpeed refuses the file when it opens it itself", "ds.json:6"),
    ("CFG006/json-duplicate", ["--", "deepspeed", "train.py"], "CFG006", "fail",
     "key 'zero_optimization.stage' is given twice; DeepSpeed refuses the file", "ds.json:6"),
    ("CFG006/yaml-duplicate", [], "CFG006", "warn",
     "key 'num_processes' is given twice; only this last one takes effect", "accelerate.yaml:5"),
    ("CFG006/ok-same-key-in-two-blocks", [], "CFG006", "pass", "", None),
    # CFG010 main-process-address
    # the launch command's --main_process_ip gives or replaces the file's: without the command, not judged (missing)
    # or a warning (no address); with a command that does not, a failure
    ("CFG010/ip-missing", [], "CFG010", "skip", "main_process_ip is not in the file: the launch command must give "
     "--main_process_ip", "accelerate.yaml"),
    ("CFG010/ip-missing", CMD, "CFG010", "fail", "num_machines is 2 but main_process_ip is not set", "accelerate.yaml"),
    ("CFG010/port-missing", CMD, "CFG010", "warn", "num_machines is 2 but main_process_port is not set",
     "accelerate.yaml"),
    ("CFG010/ip-with-user-and-port", [], "CFG010", "warn",
     "main_process_ip is 'root@10.0.0.1:29500', expected a host name or an IP address; unless the launch command",
     "accelerate.yaml:6"),
    ("CFG010/ip-with-user-and-port", CMD, "CFG010", "fail",
     "main_process_ip is 'root@10.0.0.1:29500', expected a host name or an IP address", "accelerate.yaml:6"),
    ("CFG010/ip-url", CMD, "CFG010", "fail", "main_process_ip is 'tcp://head-node/'", "accelerate.yaml:6"),
    ("CFG010/ip-not-an-address", CMD, "CFG010", "fail", "main_process_ip is '10.0.0.256', expected a host name",
     "accelerate.yaml:6"),
    ("CFG010/port-out-of-range", [], "CFG010", "fail", "main_process_port is 70000, expected 1-65535",
     "accelerate.yaml:7"),
    ("CFG010/port-privileged", [], "CFG010", "warn", "main_process_port is 80, a privileged port under 1024",
     "accelerate.yaml:7"),
    ("CFG010/port-zero-multinode", [], "CFG010", "warn",
     "main_process_port is 0 with 2 machines: accelerate picks a free port on each machine", "accelerate.yaml:7"),
    ("CFG010/ok-multinode", [], "CFG010", "pass", "", None),
    ("CFG010/ok-ipv6", [], "CFG010", "pass", "", None),
    ("CFG010/ok-port-zero-one-machine", [], "CFG010", "pass", "", None),
    # CFG011 machine-rank
    ("CFG011/no-machines", [], "CFG011", "warn", "num_machines is 0; accelerate launches the job on this machine "
     "alone", "accelerate.yaml:3"),
    ("CFG011/no-machines-cpu", [], "CFG011", "fail", "num_machines is 0 with use_cpu: accelerate launch divides "
     "num_processes by it to share the CPU threads and stops (ZeroDivisionError)", "accelerate.yaml:4"),
    # num_machines 0 is accelerate's one-machine launch, whose GPUs are judged as for num_machines: 1
    ("CFG020/no-machines-one-gpu-id", [], "CFG020", "fail", "gpu_ids is '0' under MULTI_GPU on one machine; "
     "accelerate launch stops with 'Less than two GPU ids were configured", "accelerate.yaml:3"),
    ("CFG011/rank-out-of-range", [], "CFG011", "fail", "machine_rank is 2, expected 0 to 1 (num_machines is 2)",
     "accelerate.yaml:3"),
    ("CFG011/ok-last-rank", [], "CFG011", "pass", "", None),
    # CFG020 process-counts
    ("CFG020/num-processes-missing", [], "CFG020", "skip",
     "num_processes is not set; accelerate launch stops with 'You need to manually pass in `--num_processes`' unless "
     "the launch command passes --num_processes", "accelerate.yaml"),
    ("CFG020/num-processes-missing", CMD, "CFG020", "fail",
     "num_processes is not set; accelerate launch stops with 'You need to manually pass in `--num_processes`'",
     "accelerate.yaml"),
    ("CFG020/not-divisible", [], "CFG020", "fail",
     "num_processes 7 does not divide by num_machines 2; accelerate would start 3 per machine (6 in all)",
     "accelerate.yaml:7"),
    ("CFG020/gpu-ids-number", [], "CFG020", "fail", "gpu_ids is the number 0, expected a string", "accelerate.yaml:3"),
    ("CFG020/gpu-ids-not-indices", [], "CFG020", "fail", "gpu_ids '0,1,cuda:2,3' holds 'cuda:2'", "accelerate.yaml:3"),
    ("CFG020/gpu-ids-duplicate", [], "CFG020", "fail", "gpu_ids '0,1,1,2' lists a GPU twice", "accelerate.yaml:3"),
    ("CFG020/per-node-reading", [], "CFG020", "warn",
     "num_processes is 4, the number of gpu_ids of one machine, but it is the total over all 2 machines",
     "accelerate.yaml:8"),
    ("CFG020/too-few-gpu-ids", [], "CFG020", "fail", "gpu_ids lists 2 GPUs but each machine runs 4 processes",
     "accelerate.yaml:3"),
    # accelerate defaults num_processes for 'NO' only: null stops at launch as MULTI_GPU does
    ("CFG020/null-type-num-processes-missing", [], "CFG020", "skip",
     "num_processes is not set; accelerate launch stops", "accelerate.yaml"),
    ("CFG020/no-type-over-machines", [], "CFG020", "fail",
     "num_machines is 2 but distributed_type is 'NO': accelerate launches the script as one process on each machine",
     "accelerate.yaml:6"),
    ("CFG020/no-type-several-processes", [], "CFG020", "warn",
     "num_processes is 4 but distributed_type is 'NO': accelerate launches one process, not 4", "accelerate.yaml:5"),
    ("CFG020/ok-gpu-ids", [], "CFG020", "pass", "", None),
    ("CFG020/ok-gpu-ids-all", [], "CFG020", "pass", "", None),
    # CFG021 hostfile
    ("CFG021/duplicate-host", [], "CFG021", "fail", "host 'node01' is listed again (first on line 1)", "hostfile:3"),
    ("CFG021/host-count", [], "CFG021", "fail", "lists 3 hosts, but num_machines is 2", "hostfile"),
    ("CFG021/slots-mismatch", [], "CFG021", "fail",
     "node02 has slots=4, but the accelerate config runs 8 processes per machine", "hostfile:2"),
    ("CFG021/ok-matches-config", [], "CFG021", "pass", "", None),
    ("CFG021/ok-hostfile-alone", [], "CFG021", "pass", "", None),
    # accelerate hands deepspeed_hostfile to DeepSpeed's runner only over several machines, and not to torchrun
    ("CFG021/unread-hostfile-one-machine", [], "CFG021", "warn",
     "unread-hostfile-one-machine/hosts' is never read: num_machines is 1", "accelerate.yaml:3"),
    ("CFG021/unread-hostfile-standard", [], "CFG021", "warn",
     "deepspeed_hostfile '/etc/deepspeed/hostfile' is never read: the launcher is 'standard'", "accelerate.yaml:3"),
    # CFG030 batch-size
    ("CFG030/below-one", [], "CFG030", "fail", "train_micro_batch_size_per_gpu is 0, expected at least 1", "ds.json:3"),
    # only --deepspeed: who reads the file is unknown (Lightning fills the micro batch in): a warning
    # who reads the file is not known (Lightning and Megatron set the batch themselves): said, not judged
    ("CFG030/neither-batch-size", [], "CFG030", "pass",
     "neither train_batch_size nor train_micro_batch_size_per_gpu is set", None),
    ("CFG030/neither-batch-size", ["--", "deepspeed", "train.py"], "CFG030", "fail",
     "neither train_batch_size nor train_micro_batch_size_per_gpu is set", "ds.json"),
    # accelerate fills in only keys set to "auto": a missing batch size stays missing
    ("CFG030/neither-batch-size-under-accelerate", [], "CFG030", "fail",
     "neither train_batch_size nor train_micro_batch_size_per_gpu is set", "ds.json"),
    ("CFG030/no-world-fits", [], "CFG030", "fail",
     "train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu x gradient_accumulation_steps = 8",
     "ds.json:2"),
    ("CFG030/mismatch", ["--world-size", "8"], "CFG030", "fail",
     "do not fit a world size of 8 (--world-size): DeepSpeed needs train_batch_size = micro batch x accumulation x "
     "world size = 4 x 2 x 8 = 64, not 32", "ds.json:2"),
    ("CFG030/mismatch-world-from-accelerate", [], "CFG030", "fail",
     "do not fit a world size of 6 (num_processes in", "ds.json:2"),
    ("CFG030/derived-micro-zero", ["--world-size", "8"], "CFG030", "fail", "= 0 x 1 x 8 = 0, not 4", "ds.json:2"),
    ("CFG030/ok-explicit", ["--world-size", "8"], "CFG030", "pass", "train_batch_size 64 = 4 x 2 x world size 8", None),
    ("CFG030/ok-derived-from-hostfile", [], "CFG030", "pass", "train_batch_size 64 = 2 x 2 x world size 16", None),
    # CFG040 zero-stage ("auto" cannot come through the loaders: see test_zero_stage_auto below)
    ("CFG040/stage-out-of-range", [], "CFG040", "fail", "zero_optimization.stage is 4, expected 0, 1, 2 or 3",
     "ds.json:4"),
    ("CFG040/accelerate-stage-out-of-range", [], "CFG040", "fail",
     "deepspeed_config.zero_stage is -1, expected 0, 1, 2 or 3", "accelerate.yaml:3"),
    # DeepSpeed's model reads '3' as 3; HfDeepSpeedConfig (accelerate, transformers) compares the text with 3
    ("CFG040/quoted-stage", [], "CFG003", "warn", "zero_optimization.stage is the string '3', expected a number: the "
     "number is quoted, so it is a string; DeepSpeed reads it as a number, but accelerate's and transformers' "
     "HfDeepSpeedConfig keep the text: under accelerate the job stops comparing it with 2 (Accelerator.no_sync), "
     "and ZeRO-3's zero.Init is skipped when the model loads", "ds.json:4"),
    ("CFG040/quoted-stage", [], "CFG040", "pass", "ZeRO stage 3", None),
    ("CFG040/ok-stage-3", [], "CFG040", "pass", "ZeRO stage 3", None),
    ("CFG040/ok-accelerate-stage-0", [], "CFG040", "pass", "ZeRO stage 0", None),
    # CFG041 zero-offload, DeepSpeed JSON
    ("CFG041/param-offload-below-stage-3", [], "CFG041", "warn",
     "zero_optimization.offload_param.device is 'cpu' at ZeRO stage 2; only stage 3 offloads parameters", "ds.json:5"),
    ("CFG041/optimizer-offload-at-stage-0", [], "CFG041", "fail",
     "zero_optimization.offload_optimizer.device is 'cpu' at ZeRO stage 0; optimizer offload needs stage 1, 2 or 3",
     "ds.json:5"),
    ("CFG041/nvme-without-path", [], "CFG041", "fail",
     "zero_optimization.offload_param.device is 'nvme' but zero_optimization.offload_param.nvme_path is not set",
     "ds.json:6"),
    ("CFG041/unknown-device", [], "CFG041", "fail",
     "zero_optimization.offload_optimizer.device is 'gpu', expected none, cpu or nvme", "ds.json:6"),
    ("CFG041/partial-ratio-below-stage-3", [], "CFG041", "fail",
     "partial optimizer offload (ratio 0.3) at ZeRO stage 2; DeepSpeed supports it only at stage 3", "ds.json:7"),
    ("CFG041/ok-stage-3-offload", [], "CFG041", "pass", "", None),
    ("CFG041/ok-stage-1-optimizer-offload", [], "CFG041", "pass", "", None),
    # CFG041 zero-offload, accelerate's own keys (an unknown device there is CFG002's to report)
    ("CFG041/accelerate-param-offload-below-stage-3", [], "CFG041", "warn",
     "deepspeed_config.offload_param_device is 'cpu' at ZeRO stage 2; only stage 3 offloads parameters",
     "accelerate.yaml:4"),
    ("CFG041/accelerate-optimizer-offload-at-stage-0", [], "CFG041", "fail",
     "deepspeed_config.offload_optimizer_device is 'cpu' at ZeRO stage 0", "accelerate.yaml:3"),
    ("CFG041/accelerate-nvme-without-path", [], "CFG041", "fail",
     "deepspeed_config.offload_optimizer_device is 'nvme' but deepspeed_config.offload_optimizer_nvme_path is not set",
     "accelerate.yaml:3"),
    ("CFG041/accelerate-unknown-device", [], "CFG002", "fail",
     "deepspeed_config.offload_param_device is 'disk', expected one of none, cpu, nvme", "accelerate.yaml:3"),
    ("CFG041/accelerate-unknown-device", [], "CFG041", "pass", "", None),  # reported once, by CFG002
    ("CFG041/ok-accelerate-offload", [], "CFG041", "pass", "", None),
    # CFG050 precision
    ("CFG050/both-enabled", [], "CFG050", "fail", "fp16.enabled and bf16.enabled are both true", "ds.json:4"),
    ("CFG050/both-enabled-bfloat16", [], "CFG050", "fail", "fp16.enabled and bfloat16.enabled are both true",
     "ds.json:4"),
    ("CFG050/other-type", [], "CFG050", "fail",
     "mixed_precision is 'fp16' but the DeepSpeed config", "accelerate.yaml:3"),
    ("CFG050/other-type", [], "CFG050", "fail",
     "accelerate raises '`--mixed_precision` arg cannot be set to `fp16` when `bf16` is set'", "accelerate.yaml:3"),
    ("CFG050/disabled-type", [], "CFG050", "fail",
     "sets bf16.enabled to false: DeepSpeed trains in full precision", "accelerate.yaml:3"),
    ("CFG050/no-but-enabled", [], "CFG050", "fail",
     "mixed_precision is 'no' but the DeepSpeed config", "accelerate.yaml:3"),
    ("CFG050/ok-auto-follows", [], "CFG050", "pass", "", None),
    ("CFG050/ok-agree", [], "CFG050", "pass", "", None),
    # CFG060 deepspeed-keys
    # a misspelling warns: DeepSpeed runs the job without the setting (a gate must not refuse it)
    ("CFG060/misspelt-top-key", [], "CFG060", "warn",
     "unknown key 'gradient_clippng' (did you mean 'gradient_clipping'?); DeepSpeed ignores it", "ds.json:3"),
    # a key no misspelling of DeepSpeed's (LLaMA-Factory's comms_config) is another tool's: said, not warned
    ("CFG060/unknown-top-key", [], "CFG060", "pass", "keys DeepSpeed does not read, ignored", None),
    ("CFG060/unknown-zero-key", [], "CFG060", "fail",
     "unknown key 'zero_optimization.stage3_prefetch_bucket' (did you mean 'stage3_prefetch_bucket_size'?); "
     "DeepSpeed refuses it", "ds.json:5"),
    ("CFG060/unknown-offload-key", [], "CFG060", "fail",
     "unknown key 'zero_optimization.offload_optimizer.pin_memroy' (did you mean 'pin_memory'?)", "ds.json:7"),
    # the precision blocks refuse unknown keys since DeepSpeed 0.17.1: lint does not know the job's DeepSpeed
    ("CFG060/unknown-fp16-key", [], "CFG060", "warn", "unknown key 'fp16.loss_scale_windows' (did you mean "
     "'loss_scale_window'?); DeepSpeed 0.17.1 and newer refuse it", "ds.json:5"),
    ("CFG060/unknown-bf16-key", [], "CFG060", "warn", "unknown key 'bf16.auto_cast'", "ds.json:5"),
    ("CFG060/alias-pair", [], "CFG060", "fail",
     "zero_optimization sets both prefetch_bucket_size and its alias stage3_prefetch_bucket_size", "ds.json:5"),
    ("CFG060/ok-known-keys", [], "CFG060", "pass", "", None),
    # CFG090 / CFG091 run only with --deep (see test_deep_validators)
    ("CFG090/rejected", [], "CFG090", "skip", "the libraries' validators run with --deep", None),
    ("CFG091/rejected-key", [], "CFG091", "skip", "the libraries' validators run with --deep", None),
]


def case_id(case):
    folder, extra, check_id, status = case[:4]
    return f"{check_id}-{status}-{folder.split('/', 1)[1]}" + ("-" + "-".join(extra) if extra else "")


@pytest.mark.parametrize("folder,extra,check_id,status,text,location", CASES, ids=[case_id(c) for c in CASES])
def test_rule(capsys, folder, extra, check_id, status, text, location):
    path = CONFIG / folder
    assert path.is_dir(), path
    code, doc = lint(capsys, *case_args(path, extra))
    results = results_of(doc, check_id)
    if status == "pass":
        assert all(r["status"] == "pass" for r in results), shown(results)
        assert any(text in r["message"] for r in results), shown(results)
        return
    matching = [r for r in results if r["status"] == status and text in r["message"]]
    assert matching, f"expected {status} with {text!r}, got:\n{shown(results)}"
    if location:  # FILE:LINE in the message, and as evidence
        matching = [r for r in matching if f"{os.sep}{location}" in r["message"]]
        assert matching, f"expected the location {location!r} in:\n{shown(results)}"
        file_name, _, line = location.partition(":")
        evidence = matching[0]["evidence"]
        assert evidence.get("file", "").endswith(os.sep + file_name), evidence
        assert evidence.get("line") == (int(line) if line else None), evidence
    if status in ("fail", "warn"):
        assert matching[0]["remediation"], "a finding says how to fix it"
        assert doc["verdict"] == "fail" if status == "fail" else doc["verdict"] in ("warn", "fail")
        assert code == (1 if doc["verdict"] == "fail" else 0)


def test_every_check_has_failing_and_passing_cases():
    from preflight import registry

    config_checks = {c.id for c in registry.load().checks if c.id.startswith("CFG")}
    # deep: below; batch scripts (--sbatch): tests/checks/test_batch_scripts.py; manifests (--k8s):
    # tests/checks/test_k8s_manifests.py
    elsewhere = {"CFG090", "CFG091"} | BATCH_CHECKS | MANIFEST_CHECKS
    failing = {c[2] for c in CASES if c[3] in ("fail", "warn")} | elsewhere
    passing = {c[2] for c in CASES if c[3] == "pass"} | elsewhere
    assert config_checks - failing == set()
    assert config_checks - passing == set()
    used = {c[0] for c in CASES} | {d[0] for d in DEEP} | set(GOLDEN)
    # judged by the DeepSpeed version in use, at each version: tests/checks/test_cfg_deepspeed_schema.py
    used |= {"CFG060/removed-top-key", "CFG060/removed-zero-key"}
    on_disk = {f"{p.parent.name}/{p.name}" for p in CONFIG.glob("*/*") if p.is_dir() and p.parent.name != "real"}
    assert on_disk - used == set(), "fixture folders that no test uses"


# --- whole jobs that must pass every check ---------------------------------------------------------

GOLDEN = ["golden/single-machine", "golden/two-machines"]


@pytest.mark.parametrize("folder", GOLDEN)
def test_golden_job_passes_every_check(capsys, folder):
    command = ["--", "accelerate", "launch", "--config_file", CONFIG / folder / "accelerate.yaml", "train.py"]
    code, doc = lint(capsys, *case_args(CONFIG / folder), *command)
    assert code == 0 and doc["verdict"] == "pass", shown(doc["results"])
    not_passed = {r["id"] for r in doc["results"] if r["status"] != "pass"}
    # the validators wait for --deep, the memory estimate for --model, the batch-script and manifest checks for
    # --sbatch and --k8s, the checkpoint checks for --resume-from
    assert not_passed == {"CFG090", "CFG091", "MEM001", "CKPT001", "CKPT002", "CKPT003", "CKPT004",
                          "CKPT007"} | BATCH_CHECKS | \
        MANIFEST_CHECKS, shown(doc["results"])
    # every input was read: the DeepSpeed JSON named by the accelerate config, the hostfile
    assert any("train_batch_size" in r["message"] and "world size" in r["message"]
               for r in results_of(doc, "CFG030")), shown(doc["results"])
    assert results_of(doc, "CFG021")[0]["status"] == "pass"


# --- the libraries' own validators (--deep) --------------------------------------------------------

DEEP = [
    ("golden/two-machines", [], {"CFG090": ("pass", "accepts"), "CFG091": ("pass", "accepts")}),
    ("CFG090/rejected", [], {"CFG090": ("fail", "rejects the config: ValueError: 'fp32' is not a valid PrecisionType")}),
    ("CFG091/rejected-key", ["--world-size", "2"],
     {"CFG091": ("fail", "rejects the config at world size 2: ValidationError: stage3_prefetch_bucket: "
                         "Extra inputs are not permitted")}),
    ("CFG091/rejected-batch", ["--world-size", "2"],
     {"CFG091": ("fail", "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size "
                         "30 != 4 * 1 * 2")}),
]


@pytest.mark.parametrize("folder,extra,expected", DEEP, ids=[d[0] for d in DEEP])
def test_deep_validators(capsys, folder, extra, expected):
    # find, not import: imported here, DeepSpeed's logger would keep this test's stdout as its stream
    for library in ("accelerate", "deepspeed"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed (the 'train' extra)")
    code, doc = lint(capsys, *case_args(CONFIG / folder, extra), "--deep")
    for check_id, (status, text) in expected.items():
        results = results_of(doc, check_id)
        assert len(results) == 1 and results[0]["status"] == status and text in results[0]["message"], shown(results)
        if status == "fail":
            assert results[0]["evidence"]["file"].endswith((".yaml", ".json"))
    assert code == (1 if any(s == "fail" for s, _ in expected.values()) else 0)


# --- "auto" as the ZeRO stage: the check itself (the loaders refuse the value today) ----------------

def zero_stage_results(tmp_path, ds_text, accelerate_text=None, command=()):
    from preflight.checks.config.training import zero_stage

    (tmp_path / "ds.json").write_text(ds_text)
    deepspeed = DeepSpeedConfig(load(str(tmp_path / "ds.json"), "DeepSpeed config", kind="json"))
    accelerate = None
    if accelerate_text is not None:
        (tmp_path / "accelerate.yaml").write_text(accelerate_text)
        accelerate = AccelerateConfig(load(str(tmp_path / "accelerate.yaml"), "accelerate config"))
    return list(zero_stage(CheckContext(Plan(accelerate=accelerate, deepspeed=deepspeed, command=tuple(command)))))


AUTO_STAGE = '{\n  "train_micro_batch_size_per_gpu": "auto",\n  "zero_optimization": {\n    "stage": "auto"\n  }\n}\n'


def test_zero_stage_auto_is_filled_in_by_accelerate(tmp_path):
    found = zero_stage_results(tmp_path, AUTO_STAGE, "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                     "  deepspeed_config_file: ds.json\nnum_processes: 2\n")
    assert [f.status.value for f in found] == ["pass"]
    assert "filled in by accelerate" in found[0].message and "ds.json:4" in found[0].message


def test_zero_stage_auto_read_by_whom_is_not_known_is_not_judged(tmp_path):
    found = zero_stage_results(tmp_path, AUTO_STAGE)
    assert [f.status.value for f in found] == ["pass"] and "not judged" in found[0].message


def test_zero_stage_auto_under_deepspeeds_runner_warns(tmp_path):
    found = zero_stage_results(tmp_path, AUTO_STAGE, command=("deepspeed", "train.py"))
    assert [f.status.value for f in found] == ["warn"]
    assert "ds.json:4: zero_optimization.stage is \"auto\"" in found[0].message
    assert "DeepSpeed on its own drops it and trains at stage 0" in found[0].message


TUNED = ('{"train_micro_batch_size_per_gpu": [1, 2], "train_batch_size": 7,\n "zero_optimization": {"stage": %s,'
         ' "reduce_bucket_size": [5e7, 5e8]},\n "autotuning": {"enabled": %s}}\n')


def test_the_autotuners_search_space_is_said_not_refused(capsys, tmp_path):
    """DeepSpeed's autotuner (autotuning.enabled, `deepspeed --autotuning`) takes the ZeRO stage as a list or "all"
    and the micro batch and ZeRO settings as lists, its search space, and writes each experiment's batch itself
    (deepspeed/autotuning/README.md, autotuner.py): EleutherAI/gpt-neox's configs/autotuning_configs/small_tune.json
    and tune_6-7B.json (`"stage": [0, 1, 2, 3]`) were refused as bad input. Without the autotuner a list is still
    bad input, as DeepSpeedConfig refuses it."""
    path = tmp_path / "ds.json"
    for stage in ("[2, 3]", '"all"'):
        path.write_text(TUNED % (stage, "true"))
        code, doc = lint(capsys, "--deepspeed", path, "--world-size", "8")
        assert code == 0, shown(doc["results"])
        assert [r["status"] for r in results_of(doc, "CFG040")] == ["pass"]
        assert "the autotuner's search space" in results_of(doc, "CFG040")[0]["message"]
        assert [r["status"] for r in results_of(doc, "CFG030")] == ["skip"]  # 7 fits no world: the autotuner's own
        assert [r["status"] for r in results_of(doc, "CFG041")] == ["skip"]
    path.write_text(TUNED % ("[2, 5]", "true"))
    code, doc = lint(capsys, "--deepspeed", path)
    assert "expected stages among 0, 1, 2 and 3" in results_of(doc, "CFG040")[-1]["message"]
    for stage, enabled in (("[2, 3]", "false"), ('[2, \"x\"]', "true")):
        path.write_text(TUNED % (stage, enabled))
        code, _, err = run_cli(capsys, "lint", "--deepspeed", str(path))
        assert code == 2 and "must be" in err, err
    path.write_text('{"zero_optimization": "all", "autotuning": {"enabled": true}}')
    code, doc = lint(capsys, "--deepspeed", path)
    assert code == 0 and "ZeRO stages all" in results_of(doc, "CFG040")[0]["message"], shown(doc["results"])


# --- real-world configurations (tests/fixtures/realworld, sources in its README.md) -----------------

# (inputs relative to fixtures/realworld, extra args, the fail/warn findings expected: (check, status, text))
REAL = [
    # huggingface/accelerate examples
    ("--config accelerate/examples/config_yaml_templates/deepspeed.yaml", [], []),
    ("--config accelerate/examples/config_yaml_templates/fsdp.yaml", [], []),
    ("--config accelerate/examples/config_yaml_templates/fp8.yaml", [], []),
    # a template's placeholder, which the launch command's --main_process_ip may replace: a warning without it
    ("--config accelerate/examples/config_yaml_templates/multi_node.yaml", [],
     [("CFG010", "warn", "multi_node.yaml:8: main_process_ip is '1234', expected a host name or an IP address; "
                         "unless the launch command gives --main_process_ip")]),
    ("--config accelerate/examples/config_yaml_templates/multi_node.yaml", CMD,
     [("CFG010", "fail", "multi_node.yaml:8: main_process_ip is '1234', expected a host name or an IP address")]),
    ("--deepspeed accelerate/examples/deepspeed_config_templates/zero_stage1_config.json", [], []),
    ("--deepspeed accelerate/examples/deepspeed_config_templates/zero_stage2_config.json", [], []),
    ("--deepspeed accelerate/examples/deepspeed_config_templates/zero_stage2_offload_config.json", [], []),
    ("--deepspeed accelerate/examples/deepspeed_config_templates/zero_stage3_config.json", [], []),
    ("--deepspeed accelerate/examples/deepspeed_config_templates/zero_stage3_offload_config.json", [], []),
    # huggingface/accelerate docs, usage_guides/deepspeed.md
    ("--config accelerate/docs/deepspeed_md/plugin_zero2.yaml", [], []),
    ("--config accelerate/docs/deepspeed_md/plugin_zero3_offload.yaml", [], []),
    # the JSON is on the author's machine (lint reads no node: not judged); mixed_precision beside it stops the job
    # unless the launch command passes --mixed_precision
    ("--config accelerate/docs/deepspeed_md/config_file_zero2.yaml", [],
     [("CFG005", "warn", "config_file_zero2.yaml:12: mixed_precision is set beside deepspeed_config_file")]),
    ("--config accelerate/docs/deepspeed_md/scenario1/accelerate.yaml", [],
     [("CFG005", "fail", f"accelerate.yaml:{line}: deepspeed_config.{key} is set beside deepspeed_config_file")
      for line, key in ((6, "gradient_accumulation_steps"), (7, "gradient_clipping"), (8, "offload_optimizer_device"),
                        (9, "offload_param_device"), (11, "zero3_save_16bit_model"), (12, "zero_stage"))]),
    ("--config accelerate/docs/deepspeed_md/scenario2/accelerate.yaml", [], []),
    # huggingface/alignment-handbook recipes
    ("--config alignment-handbook/recipes/accelerate_configs/deepspeed_zero2.yaml", [], []),
    ("--config alignment-handbook/recipes/accelerate_configs/deepspeed_zero3.yaml", [], []),
    ("--config alignment-handbook/recipes/accelerate_configs/multi_gpu.yaml", [], []),
    # huggingface/trl examples
    ("--config trl/examples/accelerate_configs/deepspeed_zero1.yaml", [], []),
    ("--config trl/examples/accelerate_configs/deepspeed_zero3.yaml", [], []),
    ("--config trl/examples/accelerate_configs/multi_gpu_deepspeed_zero2.yaml", [], []),
    ("--config trl/examples/accelerate_configs/alst_ulysses_4gpu.yaml", [],
     [("CFG004", "warn", "alst_ulysses_4gpu.yaml:21: deepspeed_config holds DeepSpeed-JSON keys "
                         "(seq_parallel_communication_data_type) that accelerate ignores")]),
    # huggingface/transformers tests
    ("--deepspeed transformers/tests/deepspeed/ds_config_zero2.json", [], []),
    ("--deepspeed transformers/tests/deepspeed/ds_config_zero3.json", [], []),
    # hiyouga/LLaMA-Factory examples
    # comms_config and monitor_config: another tool's keys, which DeepSpeed ignores (said in the pass)
    ("--deepspeed LLaMA-Factory/examples/deepspeed/ds_z0_config.json", [], []),
    ("--deepspeed LLaMA-Factory/examples/deepspeed/ds_z2_offload_config.json", [], []),
    ("--deepspeed LLaMA-Factory/examples/deepspeed/ds_z3_offload_config.json", [], []),
    ("--deepspeed LLaMA-Factory/examples/deepspeed/ds_z3_partial_offload_config.json", [], []),
    # axolotl-ai-cloud/axolotl
    ("--deepspeed axolotl/deepspeed_configs/zero1.json", [], []),
    ("--deepspeed axolotl/deepspeed_configs/zero2.json", [], []),
    ("--deepspeed axolotl/deepspeed_configs/zero3_bf16.json", [], []),
    ("--deepspeed axolotl/deepspeed_configs/zero3_bf16_cpuoffload_all.json", [], []),
    # deepspeedai/DeepSpeedExamples: real batch sizes, checked against a world size
    ("--deepspeed DeepSpeedExamples/training/DeepSpeed-ZenFlow/finetuning/zf_config.json", ["--world-size", "8"], []),
    ("--deepspeed DeepSpeedExamples/training/DeepSpeed-ZenFlow/finetuning/zf_config.json", ["--world-size", "6"],
     [("CFG030", "fail", "zf_config.json:2: train_batch_size 32, gradient_accumulation_steps 1 do not fit a world "
                         "size of 6")]),
    ("--deepspeed DeepSpeedExamples/training/tensor_parallel/hf_integration/configs/ds_config.json", [], []),
]


def real_args(inputs, extra):
    args = []
    for word in inputs.split():
        args.append(word if word.startswith("--") else str(REALWORLD / word))
    return args + extra


def real_id(row):
    parts = row[0].split()[1].split("/")
    return f"{parts[0]}/{'/'.join(parts[-2:])}" + "".join(row[1])


@pytest.mark.parametrize("inputs,extra,expected", REAL, ids=[real_id(r) for r in REAL])
def test_realworld(capsys, inputs, extra, expected):
    code, doc = lint(capsys, *real_args(inputs, extra))
    findings = [r for r in doc["results"] if r["status"] in ("fail", "warn", "error")]
    for check_id, status, text in expected:
        assert any(r["id"] == check_id and r["status"] == status and text in r["message"] for r in findings), \
            f"expected {check_id} {status} {text!r}, got:\n{shown(findings)}"
    # nothing else: no false positive
    assert len(findings) == len(expected), shown(findings)
    assert doc["verdict"] == ("fail" if any(s == "fail" for _, s, _ in expected)
                              else "warn" if expected else "pass")
    # each file was read and its checks evaluated, not skipped for want of input
    given = {"--config": ("CFG001", "CFG002", "CFG020"), "--deepspeed": ("CFG040", "CFG060")}
    for option, ids in given.items():
        if option in inputs:
            for check_id in ids:
                assert all(r["status"] != "skip" for r in results_of(doc, check_id)), shown(results_of(doc, check_id))


def test_realworld_deepspeed_config_file_is_found_beside_the_config(capsys):
    # deepspeed_config_file: ../deepspeed_config_templates/zero_stage1_config.json, relative to the YAML
    code, doc = lint(capsys, "--config", REALWORLD / "accelerate/examples/config_yaml_templates/deepspeed.yaml")
    assert code == 0 and doc["verdict"] == "pass", shown(doc["results"])
    assert [r["status"] for r in results_of(doc, "CFG005")] == ["pass"]
    assert [r["status"] for r in results_of(doc, "CFG060")] == ["pass"]  # the JSON was linted too
    assert [r["message"] for r in results_of(doc, "CFG040")] == ["ZeRO stage 1"]


def test_realworld_docs_scenario3_auto_stage(capsys):
    # "stage": "auto" in the JSON: accelerate fills it in from `accelerate launch --zero_stage`
    code, doc, err = run_cli(capsys, "lint", "--config",
                             REALWORLD / "accelerate/docs/deepspeed_md/scenario3/accelerate.yaml", "--json")
    assert code == 0, err
    assert doc["verdict"] == "pass", shown(doc["results"])


def test_lint_reads_accelerates_default_config_as_accelerate_launch_finds_it(capsys, tmp_path, monkeypatch):
    # accelerate reads default_config.json when there is no default_config.yaml (commands/config/config_args.py)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.json").write_text(
        '{"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 2, '
        '"num_processes": 3, "main_process_ip": "10.0.0.1", "main_process_port": 29500, "machine_rank": 0}')
    code, doc, err = run_cli(capsys, "lint", "--json")
    assert f"using accelerate's default config {tmp_path / 'accelerate' / 'default_config.json'}" in err
    assert [r["status"] for r in doc["results"] if r["id"] == "CFG020"] == ["fail"], shown(doc["results"])


def test_lint_with_nothing_to_lint_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    code, out, err = run_cli(capsys, "lint")
    assert code == 2 and "skipped" not in out + err  # no PASS of nothing: one line saying what lint reads
    assert "nothing to lint: give --config, --deepspeed, --sbatch, --k8s, --hostfile or --model (and no accelerate " \
           f"default config is at {tmp_path / 'accelerate' / 'default_config.yaml'})" in err
    assert err.count("\n") == 1


def accelerate_launch(tmp_path, config: Path, script: str) -> str:
    """The output of `accelerate launch --config_file CONFIG` running `script` (a CPU one), which must succeed."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the 'train' extra)")
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(script)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           str(tmp_path / "train.py")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_accelerate_launches_one_process_for_no_whatever_num_processes(tmp_path):
    """What CFG020 says of distributed_type 'NO' with num_processes 4, from `accelerate launch` itself: the
    script runs once, with no rank variables."""
    out = accelerate_launch(tmp_path, CONFIG / "CFG020/no-type-several-processes/accelerate.yaml",
                            "import os\nprint('RAN', os.environ.get('RANK'), os.environ.get('WORLD_SIZE'))\n")
    assert [line for line in out.splitlines() if line.startswith("RAN")] == ["RAN None None"], out


def test_dynamo_backend_null_is_accepted_as_accelerate_launch_accepts_it(capsys, tmp_path):
    # config_args.py keeps {"dynamo_backend": None}; launch then sets args.dynamo_backend = "no"
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\ndynamo_backend: null\n"
                      "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 1\n")
    code, doc, err = run_cli(capsys, "lint", "--config", config, "--json")
    assert code == 0 and doc["verdict"] == "pass", err


def test_num_processes_missing_with_a_command_that_does_not_pass_it_fails(capsys):
    config = CONFIG / "CFG020/num-processes-missing/accelerate.yaml"
    code, doc, err = run_cli(capsys, "lint", "--config", config, "--json", "--", "accelerate", "launch", "train.py")
    assert [(r["status"], r["message"].split(": ", 1)[1]) for r in results_of(doc, "CFG020")] == [
        ("fail", "num_processes is not set; accelerate launch stops with 'You need to manually pass in "
                 "`--num_processes`'")], err
    code, doc, err = run_cli(capsys, "lint", "--config", config, "--json", "--", "accelerate", "launch",
                             "--num_processes", "4", "train.py")
    assert [r["status"] for r in results_of(doc, "CFG020")] == ["pass"], shown(results_of(doc, "CFG020"))


def test_a_sagemaker_config_is_not_asked_for_num_processes(capsys):
    """SageMaker sizes the job by its instances: accelerate refuses num_processes in such a config (CFG001)."""
    config = CONFIG / "CFG001/ok-sagemaker/accelerate.yaml"
    code, doc, err = run_cli(capsys, "lint", "--config", config, "--json", "--", "accelerate", "launch", "train.py")
    assert [r["status"] for r in results_of(doc, "CFG020")] == ["pass"], shown(results_of(doc, "CFG020"))


def test_accelerate_lower_cases_mixed_precision_as_cfg002_says(tmp_path):
    """CFG002 passes mixed_precision: BF16 because `accelerate launch` itself trains it as bf16."""
    out = accelerate_launch(tmp_path, CONFIG / "CFG002/ok-upper-case-mixed-precision/accelerate.yaml",
                            "from accelerate import Accelerator\nprint('MP', Accelerator().mixed_precision)\n")
    assert "MP bf16" in out, out


def test_a_file_the_config_names_is_judged_missing_on_the_node_that_runs_the_job(capsys, tmp_path, monkeypatch):
    # `lint` reads no node (skip above); `node` runs where the job runs: the file missing there fails
    monkeypatch.chdir(tmp_path)
    config = CONFIG / "CFG005" / "missing-file" / "accelerate.yaml"
    code, doc, _ = run_cli(capsys, "node", "--config", config, "--only", "CFG005,CFG021", "--json")
    failed = [r for r in doc["results"] if r["id"] == "CFG005" and r["status"] == "fail"]
    assert failed and "deepspeed_config_file 'configs/zero2.json' does not exist" in failed[0]["message"], doc
