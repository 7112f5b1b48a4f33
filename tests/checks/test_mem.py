"""MEM: will it fit. The estimate against the installed DeepSpeed's own estimators, parameter counts from real
config.json files (tests/fixtures/models) against the models built on the meta device, the checks over
recorded NVML answers (tests/fixtures/nvml) and, on the real test cluster, over real host memory and disks."""
import json
import os
import shutil
import sys
import time

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from conftest import preflight_json, results, run_cli, run_subprocess
from preflight import runner
from preflight.inputs import models
from preflight.job import memory
from preflight.inputs.documents import InputError
from preflight.job.memory import Setup
from preflight.plan import build_plan
from test_gpu import SPECS, node

MODELS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models")
# Counts of these configs' models built on the meta device (transformers 5.24; equal to the published sizes).
COUNTS = {"gpt2": 124439808, "llama-3-8b-instruct": 8030261248, "gemma-2-9b-it": 9241705984,
          "mistral-nemo-base-2407": 12247782400, "qwen2-0.5b": 494032768}


# --- the estimate is DeepSpeed's --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepspeed_estimators():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


params_st = st.integers(min_value=10**6, max_value=2 * 10**12)


@settings(max_examples=300, deadline=None)
@given(params=params_st, share=st.floats(0.001, 0.5), gpn=st.integers(1, 16), nodes=st.integers(1, 512),
       opt=st.sampled_from(["none", "cpu", "nvme"]), par=st.sampled_from(["none", "cpu"]), zero_init=st.booleans())
def test_stages_2_and_3_equal_deepspeeds_estimators(deepspeed_estimators, params, share, gpn, nodes, opt, par,
                                                     zero_init):
    zero2, zero3 = deepspeed_estimators
    largest = int(params * share)
    model = models.Model(params, largest, "given", "given")
    offload = opt != "none"
    need = memory.estimate(model, Setup(2, opt, "none", gpn, nodes))
    assert (need.states_host, need.gpu) == zero2(params, gpn, nodes, cpu_offload=offload)
    assert memory.zero2_needs(params, gpn, nodes, offload) == zero2(params, gpn, nodes, cpu_offload=offload)
    if opt != "nvme":
        need = memory.estimate(model, Setup(3, opt, par, gpn, nodes, zero_init=zero_init))
        host, gpu, _ = zero3(params, largest, gpn, nodes, cpu_offload=offload,
                             cpu_offload_params=offload and par != "none", zero_init=zero_init)
        assert (need.states_host, need.gpu) == (host, gpu)
    for flags in ((True, True), (True, False), (False, False)):
        assert memory.zero3_needs(params, largest, gpn, nodes, *flags, zero_init) == zero3(
            params, largest, gpn, nodes, cpu_offload=flags[0], cpu_offload_params=flags[1], zero_init=zero_init)


@settings(max_examples=200, deadline=None)
@given(params=params_st, gpn=st.integers(1, 16), nodes=st.integers(1, 512), offload=st.booleans())
def test_stages_0_and_1_as_documented(deepspeed_estimators, params, gpn, nodes, offload):
    """DeepSpeed has no estimator for 0 and 1: stage 0 is stage 2's formula for one GPU (nothing sharded), stage 1
    keeps the 16-bit weights and gradients whole and shards the 16 bytes of fp32 states; optimizer offload moves
    those 16 bytes to the CPU (stage 2's host figure) and leaves the 16-bit weights and whole gradients on the GPU.
    Between stage 2 and stage 0, always."""
    zero2, _ = deepspeed_estimators
    model = models.Model(params, params // 20, "given", "given")
    stage0 = memory.estimate(model, Setup(0, "none", "none", gpn, nodes))
    assert stage0.gpu == zero2(params, 1, 1, cpu_offload=False)[1] == 20 * params
    assert stage0.states_host == zero2(params, 1, 1, cpu_offload=False)[0] * gpn
    stage1 = memory.estimate(model, Setup(1, "cpu" if offload else "none", "none", gpn, nodes))
    stage2 = memory.estimate(model, Setup(2, "cpu" if offload else "none", "none", gpn, nodes))
    if offload:
        assert (stage1.gpu, stage1.states_host) == (4 * params, stage2.states_host)
        assert stage2.gpu <= stage1.gpu <= stage0.gpu
    else:
        assert stage1.gpu == 4 * params + int(16 * params / (gpn * nodes))
        assert stage2.gpu <= stage1.gpu <= stage0.gpu


def test_zero1_optimizer_offload_keeps_the_16_bit_weights_and_gradients_on_the_gpu():
    """stage_1_and_2.py: cpu_offload moves the fp32 partition and the optimizer to the CPU; stage 1 reduces whole
    16-bit gradients, so the GPU keeps 2 + 2 bytes a parameter (stage 2's estimator counts the weights alone)."""
    model = models.Model(7 * 10**9, 35 * 10**7, "7B", "given")
    offloaded = memory.estimate(model, Setup(1, "cpu", "none", 8, 2))
    assert offloaded.gpu == 4 * 7 * 10**9 and offloaded.offloaded == 16 * 7 * 10**9 // 2
    assert memory.estimate(model, Setup(1, "none", "none", 8, 2)).gpu == 4 * 7 * 10**9 + 16 * 7 * 10**9 // 16


def test_nvme_offload_moves_the_states_from_host_ram_to_the_drive():
    model = models.Model(10**10, 5 * 10**8, "10B", "given")
    cpu = memory.estimate(model, Setup(3, "cpu", "cpu", 8, 2, zero_init=True))
    nvme = memory.estimate(model, Setup(3, "nvme", "nvme", 8, 2, zero_init=True))
    assert nvme.gpu == cpu.gpu and (nvme.nvme_optimizer, nvme.nvme_param) == (16 * 10**10 // 2, 2 * 10**10 // 2)
    assert nvme.states_host == memory.zero3_needs(10**10, 5 * 10**8, 8, 2, False, False, True)[0] < cpu.states_host


def test_loading_costs_every_rank_a_copy_unless_zero3_builds_it_partitioned():
    model = models.Model(13 * 10**9, 10**9, "13B", "given")
    assert memory.estimate(model, Setup(2, "cpu", "none", 8, 1)).load == 8 * 13 * 10**9 * 2
    assert memory.estimate(model, Setup(3, "cpu", "none", 8, 1, zero_init=True)).load == 13 * 10**9 * 2
    assert memory.estimate(model, Setup(2, gpus_per_node=8, weight_bytes=4)).load == 8 * 13 * 10**9 * 4


def test_activations_are_a_margin_only_when_batch_and_length_are_known():
    model = models.Model(8 * 10**9, 5 * 10**8, "m", "x", layers=32, hidden=4096)
    assert memory.estimate(model, Setup(3, micro_batch=4)).activations is None
    need = memory.estimate(model, Setup(3, micro_batch=4, seq_len=2048))
    assert need.activations == 4 * 2048 * 32 * 4096 * 34 and need.checkpointed == 4 * 2048 * 32 * 4096 * 2


# --- the model's size -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,count", [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("1.3b", 1_300_000_000),
                                        ("350M", 350 * 10**6), ("70000000000", 7 * 10**10), ("1.8T", 18 * 10**11)])
def test_parameter_counts(text, count):
    model = models.resolve(text)
    assert model.params == count and model.how == "given" and model.largest_layer == int(count * 0.05)


@pytest.mark.parametrize("text", ["", "seven", "-7B", "0", "7 GB", "models/../x", "1e400B", "1e16", "inf"])
def test_what_is_no_model_is_exit_2_material(text):
    with pytest.raises(InputError, match="never downloads"):
        models.resolve(text)


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_counts_from_the_shipped_configs(name):
    """From the config alone (no transformers import): the architecture's shapes."""
    model = models.resolve(os.path.join(MODELS, name))  # a model folder
    assert model.params == COUNTS[name] and not model.estimated and "shapes" in model.how
    assert models.resolve(os.path.join(MODELS, name, "config.json")).params == COUNTS[name]
    assert model.layers and model.hidden


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_counts_equal_the_models_built_on_the_meta_device(name):
    pytest.importorskip("transformers")
    import torch
    import transformers

    with open(os.path.join(MODELS, name, "config.json")) as handle:
        config = json.load(handle)
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    total = sum(p.numel() for p in built.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in built.modules())
    assert (total, largest) == models.count_params(config)[:2] == models._on_meta_device(config)
    assert total == COUNTS[name]


def test_an_unknown_family_is_built_on_the_meta_device_or_estimated(monkeypatch):
    with open(os.path.join(MODELS, "gpt2", "config.json")) as handle:
        config = dict(json.load(handle), model_type="gpt2-unknown")
    monkeypatch.setattr(models, "_on_meta_device", lambda c: None)  # as without transformers
    params, largest, how, estimated = models.count_params(dict(config, num_hidden_layers=12, hidden_size=768))
    assert estimated and how.startswith("estimated") and params == 12 * 12 * 768**2 + 50257 * 768
    with pytest.raises(ValueError, match="not one preflight knows"):
        models.count_params({"model_type": "mystery"})


@pytest.mark.parametrize("field,value", [("hidden_size", 1e308), ("num_hidden_layers", 10**9), ("vocab_size", "32000"),
                                         ("intermediate_size", -1), ("num_attention_heads", True)])
def test_a_config_whose_shapes_no_model_has_is_one_line_naming_the_field(tmp_path, field, value):
    with open(os.path.join(MODELS, "qwen2-0.5b", "config.json")) as handle:
        config = dict(json.load(handle), **{field: value})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=f"{field} is") as info:
        models.resolve(str(tmp_path))
    assert "\n" not in str(info.value)


def test_a_family_transformers_does_not_know_is_estimated(tmp_path):
    """Built on the meta device only when transformers knows the model_type; else the estimate, not an error."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-family", "num_hidden_layers": 2,
                                                      "hidden_size": 64, "vocab_size": 100}))
    model = models.resolve(str(tmp_path))
    assert model.estimated and model.params == 12 * 2 * 64**2 + 100 * 64


def test_a_model_id_from_the_local_cache_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--Qwen--Qwen2-0.5B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copy(os.path.join(MODELS, "qwen2-0.5b", "config.json"), snapshot / "config.json")
    (tmp_path / "models--Qwen--Qwen2-0.5B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen2-0.5B" / "refs" / "main").write_text("abc123")  # no commit id: the newest
    assert models.resolve("Qwen/Qwen2-0.5B").params == COUNTS["qwen2-0.5b"]
    with pytest.raises(InputError, match=str(tmp_path)):
        models.resolve("Qwen/Qwen2-7B")  # not in the cache: said, not fetched


def test_a_broken_config_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError) as info:
        models.resolve(str(tmp_path))
    assert "config.json" in str(info.value) and "\n" not in str(info.value)


def test_a_config_too_large_or_nested_too_deep_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(InputError, match="nesting") as info:
        models.resolve(str(tmp_path))
    assert "config.json" in str(info.value)
    with open(tmp_path / "config.json", "wb") as handle:  # sparse: 300 MB of nothing, never read whole
        handle.truncate(300 * 2**20)
    with pytest.raises(InputError, match="larger than 16 MiB"):
        models.resolve(str(tmp_path / "config.json"))


def test_a_fifo_or_a_device_as_the_model_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "folder" / "config.json")
    for given, named in ((tmp_path / "fifo", "fifo"), (tmp_path / "folder", "config.json"), ("/dev/null", "null")):
        with pytest.raises(InputError, match="is not a regular file") as info:
            models.resolve(str(given))
        assert named in str(info.value)


def hub_model(cache, commit="0123456789abcdef0123456789abcdef01234567"):
    """A cached model as huggingface_hub lays it out: refs/main, snapshots/<commit>/config.json -> ../../blobs."""
    folder = cache / "models--Qwen--Qwen2-0.5B"
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(os.path.join(MODELS, "qwen2-0.5b", "config.json"), folder / "blobs" / "f00d")
    (folder / "snapshots" / commit / "config.json").symlink_to("../../blobs/f00d")
    (folder / "refs" / "main").write_text(commit)
    return folder


def test_the_cache_reads_only_regular_files_and_refs_main_is_only_a_commit_id(tmp_path):
    """A dangling snapshot link was exit 3, a FIFO hung the read, and refs/main = ../../x left the cache."""
    cache = tmp_path / "hub"
    folder = hub_model(cache)
    other = folder / "snapshots" / "fedcba9876543210fedcba9876543210fedcba98"
    other.mkdir()
    (other / "config.json").symlink_to("../../blobs/gone")  # dangling, and newer
    os.mkfifo(folder / "snapshots" / "fifo")  # a FIFO where a snapshot would be
    (folder / "snapshots" / "x").mkdir()
    os.mkfifo(folder / "snapshots" / "x" / "config.json")
    outside = tmp_path / "x"  # refs/main = ../../x would read <cache>/../x/config.json: a 7B decoy
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"model_type": "mystery", "num_hidden_layers": 32,
                                                     "hidden_size": 4096, "vocab_size": 32000}))
    env = {"HF_HUB_CACHE": str(cache)}
    for ref in ("../../x", "../../../x"):
        (folder / "refs" / "main").write_text(ref)
        proc = run_subprocess("lint", "--model", "Qwen/Qwen2-0.5B", "--only", "MEM001", "--json", env=env)
        assert proc.returncode == 0 and json.loads(proc.stdout)["results"][0]["evidence"]["params"] == COUNTS["qwen2-0.5b"]
    (folder / "refs" / "main").unlink()
    os.mkfifo(folder / "refs" / "main")  # never read: not a regular file
    (folder / "blobs" / "f00d").unlink()  # now every snapshot is a dangling link or a FIFO
    proc = run_subprocess("lint", "--model", "Qwen/Qwen2-0.5B", "--only", "MEM001", env=env)
    assert proc.returncode == 2 and "never downloads" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_refs_main_names_the_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    folder = hub_model(tmp_path)
    newer = folder / "snapshots" / "fedcba9876543210fedcba9876543210fedcba98"
    newer.mkdir()
    (newer / "config.json").write_text(json.dumps({"model_type": "mystery", "num_hidden_layers": 2,
                                                   "hidden_size": 64, "vocab_size": 100}))
    assert models.resolve("Qwen/Qwen2-0.5B").params == COUNTS["qwen2-0.5b"]  # refs/main's, not the newest


@pytest.mark.parametrize("text,size", [("80GB", 80 * 2**30), ("80GiB", 80 * 2**30), ("80", 80 * 2**30),
                                       ("512M", 512 * 2**20), ("1.5TiB", int(1.5 * 2**40)), (24, 24 * 2**30),
                                       ("85520809984B", 85520809984), ("2TB", 2 * 2**40)])
def test_sizes_are_binary_as_memory_is_sold(text, size):
    """An "80GB" GPU has 80 GiB (NVML: 79.6 usable), a "512GB" node 512 GiB: GB means GiB here."""
    assert models.parse_size(text, "--gpu-memory") == size


@pytest.mark.parametrize("text", ["9" * 400 + "GB", "2PB", "1025TB", "0GB", "1e9GB", "inf", "nan", "80 GB" * 20],
                         ids=["400-nines", "2PB", "1025TB", "0GB", "1e9GB", "inf", "nan", "long"])
def test_no_size_past_a_petabyte_nor_a_non_number(text):
    with pytest.raises(ValueError, match="--gpu-memory"):
        models.parse_size(text, "--gpu-memory")


@pytest.mark.parametrize("seq", ["9" * 5000, str(2**24 + 1), "\u00b2", "0", "-3", "1.5", 10**5000, True],
                         ids=["5000-digits", "2^24+1", "superscript-2", "0", "-3", "1.5", "int-5000-digits", "True"])
def test_sequence_lengths_past_16m_tokens_or_no_digits_are_refused(seq):
    with pytest.raises(InputError, match="sequence length") as info:
        models.parse_seq_len(seq, "--seq-len")
    assert len(str(info.value)) < 200
    assert models.parse_seq_len(" 8192 ", "--seq-len") == 8192 == models.parse_seq_len(8192, "x")


# --- the checks over recorded NVML answers -----------------------------------------------------------------

def job(tmp_path, stage, nodes=("n01", "n02"), offload="none", param="none", **ds):
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "machine_rank": 0,
              "num_machines": len(nodes), "num_processes": 8 * len(nodes), "main_process_ip": "10.0.0.1",
              "main_process_port": 29500, "mixed_precision": "bf16",
              "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero3_init_flag": True}}
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(config))
    zero = {"stage": stage, "offload_optimizer": {"device": offload}, "offload_param": {"device": param}}
    (tmp_path / "ds.json").write_text(json.dumps(dict({"bf16": {"enabled": "auto"}, "zero_optimization": zero,
                                                       "train_micro_batch_size_per_gpu": 1}, **ds)))
    model = models.resolve(os.path.join(MODELS, "mistral-nemo-base-2407"))  # 12.2B
    return build_plan(config=str(tmp_path / "accelerate.yaml"), nodes=tuple(nodes),
                      memory=models.Inputs(model=model))


def need_params(plan):
    return plan.memory.model.params


def run(check_id, plan, states):
    return runner.run_check(SPECS[check_id], runner.CheckContext(plan, states, {}))


def by_node(results):
    return {n: r for r in results for n in r.nodes}


def test_on_8x80gb_and_a_smaller_node_what_fits_passes_and_what_does_not_fails_naming_the_node(tmp_path):
    states = {"n01": node("h100x8.json"), "n02": node("v100.json")}  # 8 x 80 GB, 4 x 32 GB
    for state in states.values():  # room for every rank's copy: the advice is about the GPUs (this host's is not)
        state["facts"]["memory"]["available_bytes"] = 2**40
    stage3 = by_node(run("MEM002", job(tmp_path, 3), states))  # 18 x 12.2B / 16 + the largest layer: 15.3 GiB
    assert stage3["n01"].status.value == stage3["n02"].status.value == "pass"
    stage2 = by_node(run("MEM002", job(tmp_path, 2), states))  # 2 x 12.2B + 18 x 12.2B / 16: 35.6 GiB
    assert stage2["n01"].status.value == "pass"
    assert stage2["n02"].status.value == "fail" and stage2["n02"].nodes == ("n02",)
    assert "31.7 GiB in all" in stage2["n02"].message and "ZeRO stage 3 fits" in stage2["n02"].remediation
    stage0 = by_node(run("MEM002", job(tmp_path, 0), states))  # 20 bytes a parameter: 228 GiB
    assert {r.status.value for r in stage0.values()} == {"fail"}
    # The cheapest change that fits each node: stage 1 (4 + 16/16 bytes a parameter: 57 GiB) on 80 GB GPUs,
    # stage 3 on 32 GB ones (stage 1 and 2 do not fit there).
    assert stage0["n01"].remediation.startswith("ZeRO stage 1 fits: 57.0 GiB per GPU")
    assert stage0["n02"].remediation.startswith("ZeRO stage 3 fits")


def test_memory_another_process_holds_counts(tmp_path):
    states = {"n01": node("busy.json"), "n02": node("h100x8.json")}  # GPU 0: 40 GiB held by PID 48213
    result = by_node(run("MEM002", job(tmp_path, 1), states))  # 57 GiB: fits 80 GB, not the 39 GiB left
    assert result["n02"].status.value == "pass"
    assert result["n01"].status.value == "fail" and "PID 48213" in result["n01"].message
    assert result["n01"].remediation.startswith("stop what holds GPU 0")
    assert result["n01"].evidence["gpu_free_bytes"] == 85520809984 - 43534385152


def test_the_activation_margin_warns_when_the_states_fit_but_the_batch_may_not(tmp_path):
    states = {"n01": node("h100x8.json")}
    plan = job(tmp_path, 3, nodes=("n01",), train_micro_batch_size_per_gpu=16)
    plan = build_plan(config=plan.accelerate.doc.path, nodes=("n01",),
                      memory=models.Inputs(model=plan.memory.model, seq_len=8192))
    (result,) = run("MEM002", plan, states)
    assert result.status.value == "warn" and "activation" in result.message
    assert "train_micro_batch_size_per_gpu" in result.remediation


def test_without_a_model_every_mem_check_skips(tmp_path):
    plan = build_plan(config=job(tmp_path, 3).accelerate.doc.path, nodes=("n01",))
    for check_id in ("MEM002", "MEM003", "MEM004"):
        (result,) = run(check_id, plan, {"n01": node("h100x8.json")})
        assert result.status.value == "skip" and "--model" in result.message


def test_host_memory_and_nvme_from_the_nodes_facts(tmp_path):
    plan = job(tmp_path, 3, offload="cpu", param="cpu")
    state = node("h100x8.json")
    need = memory.estimate(plan.memory.model, Setup(3, "cpu", "cpu", 8, 2, zero_init=True))
    state["facts"]["memory"]["available_bytes"] = need.host + 1
    (fits,) = run("MEM003", plan, {"n01": state})
    state["facts"]["memory"]["available_bytes"] = need.host - 1
    (tight,) = run("MEM003", plan, {"n01": state})
    certain = max(need.load, 18 * need_params(plan) // 2)  # 16-bit weights and optimizer states, over 2 nodes
    assert need.certain == certain
    state["facts"]["memory"]["available_bytes"] = certain - 1
    (short,) = run("MEM003", plan, {"n01": state})
    assert (fits.status.value, tight.status.value, short.status.value) == ("pass", "warn", "fail")
    assert "DeepSpeed's estimate" in tight.message and "does not fit" in short.message


def test_without_offload_deepspeeds_fp32_host_figure_only_warns(tmp_path):
    """DeepSpeed's host figure without offload assumes an fp32 copy per rank (4P x G x 1.5); a bf16 job loads
    2P x G: a node with room for that is not refused."""
    plan = job(tmp_path, 2)
    state = node("h100x8.json")
    need = memory.estimate(plan.memory.model, Setup(2, "none", "none", 8, 2))
    assert need.host > need.load
    state["facts"]["memory"]["available_bytes"] = need.load + 1
    assert [r.status.value for r in run("MEM003", plan, {"n01": state})] == ["warn"]
    state["facts"]["memory"]["available_bytes"] = need.load - 1
    assert [r.status.value for r in run("MEM003", plan, {"n01": state})] == ["fail"]


def plan_of(tmp_path, stage, nodes, offload="none", param="none", model="7B", init=True, gpus=8, **inputs):
    """A 7B job at `stage`, `gpus` per node on `nodes` nodes; init None leaves zero3_init_flag unset."""
    names = tuple(f"n{i:02d}" for i in range(1, nodes + 1))
    plan = job(tmp_path, stage, names, offload, param)
    config = yaml.safe_load((tmp_path / "accelerate.yaml").read_text())
    config["num_processes"] = gpus * nodes
    if init is None:
        del config["deepspeed_config"]["zero3_init_flag"]
    else:
        config["deepspeed_config"]["zero3_init_flag"] = init
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(config))
    return build_plan(config=plan.accelerate.doc.path, nodes=names,
                      memory=models.Inputs(model=models.resolve(model), **inputs))


@pytest.mark.parametrize("nodes", [1, 2, 4, 8])
def test_zero2_cpu_offload_needs_its_share_of_the_states_not_deepspeeds_bound(tmp_path, nodes):
    """DeepSpeed's figure P·max(4N, 16)·1.5 grows with the nodes (2.5 TiB a node for 7B on 8 x 8 GPUs); each
    rank keeps 1/N of the fp32 weights, Adam's two states and the fp32 gradients: 16P/M a node."""
    plan = plan_of(tmp_path, 2, nodes, offload="cpu", host_bytes=256 * 2**30)
    need = memory.estimate(plan.memory.model, Setup(2, "cpu", "none", 8, nodes))
    assert need.offloaded == 16 * 7 * 10**9 // nodes and need.certain == max(need.load, need.offloaded)
    state = node("h100x8.json")
    state["facts"]["memory"]["available_bytes"] = 256 * 2**30  # 8 ranks x 14 GB to load: 104 GiB
    (host,) = run("MEM003", plan, {"n01": state})
    (lint,) = run("MEM001", plan, {})
    expected = "pass" if need.host <= 256 * 2**30 else "warn"
    assert host.status.value == lint.status.value == expected, (host.message, lint.message)
    if expected == "warn":
        assert "nothing in reach" not in host.remediation and "upper bound" in host.message
    assert host.evidence["certain_host_bytes"] == need.certain


def test_stage3_offload_needs_18_bytes_a_parameter_over_the_nodes_and_fails_below_it(tmp_path):
    plan = plan_of(tmp_path, 3, 2, offload="cpu", param="cpu", host_bytes=56 * 2**30)
    need = memory.estimate(plan.memory.model, Setup(3, "cpu", "cpu", 8, 2, zero_init=True))
    assert need.offloaded == 18 * 7 * 10**9 // 2 > need.load
    state = node("h100x8.json")
    state["facts"]["memory"]["available_bytes"] = 56 * 2**30  # 63 GB (58.7 GiB) needed
    (host,) = run("MEM003", plan, {"n01": state})
    (lint,) = run("MEM001", plan, {})
    assert host.status.value == lint.status.value == "fail"
    # The fix fits what the check judges: the states back on the 80 GB GPUs (8.6 GiB each), one 14 GB copy.
    assert host.remediation.startswith("no optimizer offload fits: 8.6 GiB per GPU, 13.0 GiB host RAM")
    assert lint.remediation.startswith("no optimizer offload fits")


def test_a_stage3_suggestion_carries_zero3_init_flag_unless_the_job_turns_it_off(tmp_path):
    """accelerate builds a stage-3 model partitioned unless zero3_init_flag is false: a move to stage 3 keeps it."""
    state = node("v100.json")  # 4 x 32 GB; 7B at stage 2 needs 42.4 GiB a GPU, at stage 3 30.6
    state["facts"]["memory"]["available_bytes"] = 40 * 2**30
    for init, fix in ((True, "ZeRO stage 3 fits: 30.6 GiB per GPU, 13.0 GiB host RAM"), (None, "ZeRO stage 3 fits"),
                      (False, "nothing in reach fits")):
        plan = plan_of(tmp_path, 2, 1, init=init, gpus=4)  # without zero.Init 4 ranks load 14 GB each: 52 GiB
        (gpu,) = run("MEM002", plan, {"n01": state})
        assert gpu.status.value == "fail" and gpu.remediation.startswith(fix), (init, gpu.remediation)


def test_mem002_suggests_only_what_fits_the_nodes_host_memory(tmp_path):
    state = node("v100.json")
    plan = plan_of(tmp_path, 2, 1, init=False, gpus=4)  # stage 3 would load a copy on each of the 4 ranks: 52 GiB
    state["facts"]["memory"]["available_bytes"] = 2**40
    (roomy,) = run("MEM002", plan, {"n01": state})
    state["facts"]["memory"]["available_bytes"] = 40 * 2**30
    (short,) = run("MEM002", plan, {"n01": state})
    assert roomy.remediation.startswith("ZeRO stage 3 fits: 30.6 GiB per GPU, 52.2 GiB host RAM")
    assert short.remediation.startswith("nothing in reach fits"), short.remediation


def test_mem003_suggests_what_fits_the_figure_it_fails_on(tmp_path):
    """Stage 3 without zero.Init on 2 nodes: 8 ranks load 14 GB each (104 GiB); zero3_init_flag loads one copy,
    and the 16P/2 offloaded (52 GiB) fits 64 GiB, though DeepSpeed's buffered 78 GiB does not."""
    plan = plan_of(tmp_path, 3, 2, offload="cpu", init=False)
    state = node("h100x8.json")
    state["facts"]["memory"]["available_bytes"] = 64 * 2**30
    (host,) = run("MEM003", plan, {"n01": state})
    assert host.status.value == "fail" and host.remediation.startswith("zero3_init_flag: true"), host.remediation


def test_stage0_advice_names_the_stage_offload_needs_and_one_gpu_gets_no_stage_that_shards_nothing():
    model = models.Model(10**9, 5 * 10**7, "1B", "given")
    names = [what for what, _ in memory.changes(Setup(0, gpus_per_node=8))]
    assert "ZeRO stage 2 with optimizer offload to the CPU" in names and "optimizer offload to the CPU" not in names
    offload = dict(memory.changes(Setup(0, gpus_per_node=8)))["ZeRO stage 2 with optimizer offload to the CPU"]
    assert (offload.stage, offload.offload_optimizer) == (2, "cpu")
    assert dict(memory.changes(Setup(1, offload_optimizer="none", gpus_per_node=8)))[
        "optimizer offload to the CPU"].stage == 1  # stage 1 offloads as it is
    # One GPU: 20 GB at stage 0 does not fit 19 GB; DeepSpeed's stage-3 figure (18P + 4L) would, but a single
    # GPU still holds all of the 16-bit weights and gradients. Offload is what fits.
    what, need = memory.cheapest(model, Setup(0), 19 * 10**9, None)
    assert what == "ZeRO stage 2 with optimizer offload to the CPU" and need.gpu == 2 * 10**9
    assert not any(w.startswith("ZeRO stage") and "offload" not in w for w, _ in memory.changes(Setup(0)))


def test_gb_means_what_an_80gb_gpu_has_so_lint_and_mem002_agree(capsys, tmp_path):
    """An H100 80GB has 85520809984 bytes (NVML; tests/fixtures/nvml/h100x8.json): 4.05B at stage 0 (81 GB)
    fits it, so `lint --gpu-memory 80GB` passes it too; 4.3B (86 GB) fits neither."""
    for model, verdict in (("4.05B", "pass"), ("4.3B", "fail")):
        plan = plan_of(tmp_path, 0, 1, model=model)
        (gpu,) = run("MEM002", plan, {"n01": node("h100x8.json")})
        code, doc, _ = run_cli(capsys, "lint", "--config", plan.accelerate.doc.path, "--only", "MEM001", "--json",
                               "--model", model, "--gpu-memory", "80GB")
        assert gpu.status.value == doc["results"][0]["status"] == verdict, (gpu.message, doc["results"][0])


# --- the command line --------------------------------------------------------------------------------------

def test_lint_without_model_skips_the_family(capsys, tmp_path):
    config = job(tmp_path, 2).accelerate.doc.path
    code, doc, _ = run_cli(capsys, "lint", "--config", config, "--only", "MEM", "--json")
    assert code == 0 and [(r["id"], r["status"]) for r in doc["results"]] == [("MEM001", "skip")]


def test_lint_against_gpu_memory(capsys, tmp_path):
    plan = job(tmp_path, 2)
    args = ["lint", "--config", plan.accelerate.doc.path, "--only", "MEM", "--json",
            "--model", os.path.join(MODELS, "mistral-nemo-base-2407")]
    code, doc, _ = run_cli(capsys, *args, "--gpu-memory", "80GB")
    assert code == 0 and doc["results"][0]["status"] == "pass"
    code, doc, _ = run_cli(capsys, *args, "--gpu-memory", "32GB")
    assert code == 1 and doc["results"][0]["status"] == "fail"
    assert doc["results"][0]["remediation"].startswith("ZeRO stage 3 fits")
    code, doc, _ = run_cli(capsys, *args, "--gpu-memory", "80GB", "--host-memory", "64GB")
    assert code == 1 and "host RAM" in doc["results"][0]["message"]  # 16 ranks x 24 GB to load


def test_the_profile_holds_the_model(capsys, tmp_path):
    profile = tmp_path / "preflight.toml"
    profile.write_text('[memory]\nmodel = "7B"\ngpu_memory = "24GB"\n')
    code, doc, _ = run_cli(capsys, "lint", "--profile", profile, "--only", "MEM", "--json")
    assert code == 1 and doc["results"][0]["status"] == "fail" and doc["results"][0]["evidence"]["params"] == 7 * 10**9
    profile.write_text('[memory]\nmodel = "7B"\ngpu_memory = "huge"\n')
    code, _, err = run_cli(capsys, "lint", "--profile", profile, "--only", "MEM")
    assert code == 2 and "huge" in err and "gpu_memory" in err
    profile.write_text('[memory]\nmodle = "7B"\n')
    code, _, err = run_cli(capsys, "lint", "--profile", profile, "--only", "MEM")
    assert code == 2 and "modle" in err


@pytest.mark.parametrize("args", [["--model", "nothing-here"], ["--model", "7B", "--gpu-memory", "lots"],
                                  ["--model", "7B", "--seq-len", "-3"]])
def test_bad_memory_input_is_exit_2(capsys, args):
    code, _, err = run_cli(capsys, "lint", *args)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err


def test_lint_with_no_gpu_count_says_what_it_assumed_and_refuses_nothing(capsys, tmp_path):
    """A DeepSpeed config alone says no process count: stage 3 for 7B is 118 GiB on 1 GPU, 8 GiB on 16."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                              "train_micro_batch_size_per_gpu": 1}))
    code, doc, _ = run_cli(capsys, "lint", "--deepspeed", ds, "--only", "MEM001", "--json", "--model", "7B",
                           "--gpu-memory", "80GB")
    (result,) = doc["results"]
    assert code == 0 and result["status"] == "warn", result
    assert "1 GPU per node x 1 node assumed" in result["message"] and "num_processes" in result["remediation"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("n01 slots=8\nn02 slots=8\n")  # 16 GPUs: 4L + 18P/16 = 8.6 GiB, said without a guess
    code, doc, _ = run_cli(capsys, "lint", "--deepspeed", ds, "--hostfile", hostfile, "--only", "MEM001", "--json",
                           "--model", "7B", "--gpu-memory", "80GB")
    assert code == 0 and doc["results"][0]["status"] == "pass" and "assumed" not in doc["results"][0]["message"]
    ds.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}))  # stage 0: 20P a GPU
    code, doc, _ = run_cli(capsys, "lint", "--deepspeed", ds, "--only", "MEM001", "--json", "--model", "7B",
                           "--gpu-memory", "80GB")
    assert code == 1 and "does not fit, whatever the GPU count" in doc["results"][0]["message"]


@pytest.mark.parametrize("args", [["--gpu-memory", "9" * 400 + "GB"], ["--host-memory", "3PB"],
                                  ["--seq-len", "9" * 5000], ["--seq-len", "\u00b2"]],
                         ids=["400-nines", "3PB", "5000-digit-seq-len", "superscript"])
def test_absurd_sizes_and_lengths_are_exit_2(capsys, args):
    code, _, err = run_cli(capsys, "lint", "--model", "7B", *args)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and len(err) < 300, err


def test_the_largest_batch_and_length_give_a_margin_not_an_error(capsys, tmp_path):
    plan = job(tmp_path, 3, train_micro_batch_size_per_gpu=10**300)
    for micro, verdict in ((10**300, "pass"), (2**24, "warn")):  # past 2^24 a micro-batch is no number we use
        (tmp_path / "ds.json").write_text(json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3},
                                                      "train_micro_batch_size_per_gpu": micro}))
        code, doc, _ = run_cli(capsys, "lint", "--config", plan.accelerate.doc.path, "--only", "MEM001", "--json",
                               "--model", os.path.join(MODELS, "llama-3-8b-instruct"), "--gpu-memory", "80GB",
                               "--seq-len", str(2**24))
        assert code == 0 and doc["results"][0]["status"] == verdict, doc["results"][0]


def test_explain_shows_the_arithmetic(capsys):
    code, out, _ = run_cli(capsys, "explain", "MEM001")
    assert code == 0 and "DeepSpeed" in out


def test_the_estimate_adds_under_50_ms():
    started = time.perf_counter()
    for _ in range(100):
        model = models.resolve(os.path.join(MODELS, "llama-3-8b-instruct"))
        memory.estimate(model, Setup(3, "cpu", "cpu", 8, 4, zero_init=True))
    assert (time.perf_counter() - started) / 100 < 0.05
    assert "transformers" not in sys.modules or "torch" in sys.modules  # the known families import nothing


# --- the real test cluster: host RAM and NVMe space as the nodes report them --------------------------------

@pytest.mark.cluster
def test_host_ram_and_nvme_findings_come_from_the_nodes(cluster, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    nvme.chmod(0o777)
    stat = os.statvfs(str(nvme))
    free = stat.f_bavail * stat.f_frsize
    available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    nodes = len(cluster.nodes)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
        "offload_param": {"device": "cpu"}}}))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{n} slots=1\n" for n in cluster.nodes))
    common = ["check", "--hosts", ",".join(cluster.nodes), "--ssh-config", cluster.ssh_config, "--python",
              sys.executable, "--deepspeed", ds, "--hostfile", hostfile, "--only", "MEM003,MEM004"]
    # Small enough for both: passes on every node, with the node's own figures.
    doc, _ = preflight_json(*common, "--model", "1M")
    for check_id in ("MEM003", "MEM004"):
        found = results(doc, check_id)
        assert set(found) == set(cluster.nodes) and {r["status"] for r in found.values()} == {"pass"}, found
    mem = results(doc, "MEM003")[cluster.nodes[1]]["evidence"]
    assert abs(mem["available_bytes"] - available) < available * 0.2
    assert abs(results(doc, "MEM004")[cluster.nodes[1]]["evidence"]["free_bytes"] - free) < 2**30
    # 16 bytes a parameter over the nodes: twice the drive's free space fails there, on every node.
    too_big = 2 * free * nodes // 16
    doc, _ = preflight_json(*common, "--model", str(too_big))
    assert {r["status"] for r in results(doc, "MEM004").values()} == {"fail"}
    # Host RAM: loading the model in bf16 takes 2 bytes a parameter (more than the offloaded parameters' share
    # here): as many parameters as bytes available needs twice what the nodes have.
    doc, _ = preflight_json(*common, "--model", str(available))
    host = results(doc, "MEM003")
    assert set(host) == set(cluster.nodes) and {r["status"] for r in host.values()} == {"fail"}, host
    assert all(n in r["nodes"] for n, r in host.items())
