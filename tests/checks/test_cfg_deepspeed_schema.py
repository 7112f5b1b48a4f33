"""CFG060 against DeepSpeed itself: the blocks whose pydantic models refuse unknown keys, and their keys, are those
the installed DeepSpeed's models declare (walked: field names, aliases, nested models) and refuse; the removed keys
and optimizers are refused exactly from the release the table names, judged against the DeepSpeed that runs (the
nodes' with `check`, the one installed here with `lint`, a warning when neither is known), as pip orders versions."""
from __future__ import annotations

import importlib.util
import inspect
import json
import typing
from importlib import metadata
from pathlib import Path

import pytest

from conftest import run_cli
from preflight import registry, runner
from preflight.inputs.deepspeed_keys import (DS_REMOVED_KEYS_SINCE, DS_REMOVED_OPTIMIZERS_SINCE,
                                             DS_REMOVED_ZERO_KEYS_SINCE, DS_TOP_BLOCKS, DS_TOP_KEYS, STRICT_BLOCKS,
                                             STRICT_SINCE, ZERO_ALIASES)
from preflight.inputs.versions import version as parsed_version
from preflight.plan import build_plan

FIXTURES = Path(__file__).parents[1] / "fixtures"
SPECS = {c.id: c for c in registry.load().checks}


@pytest.fixture(autouse=True)
def empty_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def needs_deepspeed():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (the 'train' extra)")


def installed_here(monkeypatch, version):
    """The DeepSpeed version package metadata reports here (None: not installed)."""
    def reported(name):
        if name != "deepspeed" or version is None:
            raise metadata.PackageNotFoundError(name)
        return version
    monkeypatch.setattr(metadata, "version", reported)


def lint(capsys, tmp_path, config):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code, doc, err = run_cli(capsys, "lint", "--deepspeed", path, "--only", "CFG060", "--json")
    assert code in (0, 1), err
    return [r for r in doc["results"] if r["id"] == "CFG060"]


def on_nodes(tmp_path, config, versions):
    """CFG060 as `check` runs it, with the DeepSpeed version each node reports (None: none installed)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    states = {node: {"facts": {"packages": {"versions": {"deepspeed": version}}}, "error": None, "clock": None}
              for node, version in versions.items()}
    plan = build_plan(deepspeed=str(path), nodes=tuple(versions))
    return runner.run_check(SPECS["CFG060"], runner.CheckContext(plan, states, {}))


def statuses(results):
    return sorted(r["status"] if isinstance(r, dict) else r.status.value for r in results)


def with_block(block, inner):
    """A config holding `inner` at `block` (a path of keys)."""
    config = {"train_batch_size": 8}
    holder = config
    for key in block[:-1]:
        holder = holder.setdefault(key, {})
    holder[block[-1]] = inner
    return config


# --- the table is DeepSpeed's ------------------------------------------------------------------------------------

def strict_models():
    """Each top-level block (or timers.throughput) and the model DeepSpeedConfig._initialize_params builds from it
    (deepspeed/runtime/config.py and the readers it calls, as named beside STRICT_BLOCKS)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    # get_monitor_config: tensorboard, wandb, csv_monitor and comet, each the model of its field
    monitors = {(name,): field.annotation for name, field in DeepSpeedMonitorConfig.model_fields.items()}
    return {("zero_optimization",): DeepSpeedZeroConfig, ("fp16",): DeepSpeedFP16Config,
            ("bf16",): DeepSpeedBF16Config, ("bfloat16",): DeepSpeedBF16Config, ("comms_logger",): CommsLoggerConfig,
            ("hybrid_engine",): HybridEngineConfig, ("weight_quantization",): WeightQuantConfig,
            ("compile",): CompileConfig, ("timers", "throughput"): DeepSpeedThroughputTimerConfig,
            ("tensor_parallel",): TPTrainingConfig, **monitors}


def walked(model, block, table):
    """The keys `model` takes at `block`, and those of the models nested in it, each under every name it is
    read by; only models that forbid extra keys."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    def models_in(annotation):
        if inspect.isclass(annotation) and issubclass(annotation, DeepSpeedConfigModel):
            return [annotation]
        return [m for a in typing.get_args(annotation) for m in models_in(a)]

    if model.model_config.get("extra") != "forbid":
        return table
    keys = set()
    for name, field in model.model_fields.items():
        names = {name} | ({field.alias} if field.alias else set())
        keys |= names
        for nested in models_in(field.annotation):
            for spelling in names:
                walked(nested, block + (spelling,), table)
    table[block] = frozenset(keys)
    return table


def test_strict_blocks_are_the_installed_deepspeed_models():
    needs_deepspeed()
    table = {}
    for block, model in strict_models().items():
        walked(model, block, table)
    assert set(table) == set(STRICT_BLOCKS), set(table) ^ set(STRICT_BLOCKS)
    for block, keys in table.items():
        assert keys == STRICT_BLOCKS[block], (block, keys ^ STRICT_BLOCKS[block])


def test_zero_aliases_are_the_zero_model_aliases():
    needs_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    aliases = {name: f.alias for name, f in DeepSpeedZeroConfig.model_fields.items() if f.alias}
    assert aliases == ZERO_ALIASES


def deepspeed_reads(config):
    """What DeepSpeedConfig makes of `config`: None when it takes it, else its error (a world of one)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(config)
    except Exception as exc:  # pydantic's ValidationError, DeepSpeedConfigError, ...
        return f"{type(exc).__name__}: {exc}"
    return None


def test_deepspeed_refuses_unknown_keys_exactly_in_the_strict_blocks():
    """Behind the walk: an unknown key stops DeepSpeedConfig in every block of the table, and in no other block
    DeepSpeed reads (those it reads with .get: optimizer, scheduler, aio, checkpoint, timers itself, ...)."""
    needs_deepspeed()
    for block in STRICT_BLOCKS:
        refused = deepspeed_reads(with_block(block, {"preflight_unknown": 1}))
        assert refused and "Extra inputs are not permitted" in refused and "preflight_unknown" in refused, block
    for key in sorted(DS_TOP_BLOCKS - {b[0] for b in STRICT_BLOCKS if len(b) == 1}):
        assert deepspeed_reads(with_block((key,), {"preflight_unknown": 1})) is None, key
    for key in sorted(DS_TOP_KEYS - DS_TOP_BLOCKS):  # a block where DeepSpeed reads a value: never a model's
        refused = deepspeed_reads(with_block((key,), {"preflight_unknown": 1}))
        assert refused is None or "Extra inputs are not permitted" not in refused, key
    # bfloat16 is read only without bf16 (get_bfloat16_config)
    assert deepspeed_reads({"train_batch_size": 8, "bf16": {"enabled": False}, "bfloat16": {"junk": 1}}) is None


def test_deepspeed_drops_unknown_keys_set_to_auto():
    needs_deepspeed()
    for block in STRICT_BLOCKS:
        assert deepspeed_reads(with_block(block, {"preflight_unknown": "auto"})) is None, block


def test_removed_keys_are_those_the_installed_deepspeed_refuses():
    """Every key and optimizer the table says the installed release refuses, it refuses; the others it takes."""
    needs_deepspeed()
    import torch
    from deepspeed.runtime import config as ds_config

    installed = parsed_version(metadata.version("deepspeed"))
    refused = {k for k, since in DS_REMOVED_KEYS_SINCE.items() if parsed_version(since) <= installed}
    assert refused == set(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", ()))  # none before 0.19.7
    refused_zero = {k for k, since in DS_REMOVED_ZERO_KEYS_SINCE.items() if parsed_version(since) <= installed}
    assert refused_zero == set(getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", ()))
    for key in refused:
        assert "has been removed" in deepspeed_reads({"train_batch_size": 8, key: {}}), key
    for key in refused_zero:
        assert "has been removed" in deepspeed_reads({"train_batch_size": 8, "zero_optimization": {key: 1}}), key
    for name, since in DS_REMOVED_OPTIMIZERS_SINCE.items():
        gone = parsed_version(since) <= installed
        # the engine builds one of its own by lower-cased name, else getattr(torch.optim, name) (_do_sanity_check)
        assert (name in ds_config.DEEPSPEED_OPTIMIZERS) == (not gone), name
        assert not any(n.lower() == name for n in dir(torch.optim)), name


# --- CFG060 over the blocks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("block,key,suggested", [
    (("tensorboard",), "outpath", "output_path"),
    (("wandb",), "projct", "project"),
    (("csv_monitor",), "jobname", "job_name"),
    (("comet",), "workspce", "workspace"),
    (("comms_logger",), "prof_al", "prof_all"),
    (("compile",), "deepcompil", "deepcompile"),
    (("hybrid_engine",), "max_out_token", "max_out_tokens"),
    (("timers", "throughput"), "enable", "enabled"),
    (("tensor_parallel",), "autotp_sise", "autotp_size"),
    (("tensor_parallel", "tp"), "tp_sise", "tp_size"),
    (("weight_quantization",), "num_bit", "num_bits"),
    (("bfloat16",), "enable", "enabled"),
    (("zero_optimization", "leaf_module"), "class", "classes"),
    (("zero_optimization", "zenflow"), "topk_ratios", "topk_ratio"),
])
def test_unknown_key_in_a_strict_block_fails(capsys, tmp_path, block, key, suggested):
    # a block strict only in newer releases (STRICT_SINCE) warns with lint, which does not know the job's DeepSpeed,
    # and fails on the nodes whose DeepSpeed is that new
    results = lint(capsys, tmp_path, with_block(block, {key: True}))
    worst = "warn" if block in STRICT_SINCE else "fail"
    found = [r for r in results if r["status"] == worst]
    name = ".".join(block + (key,))
    assert len(found) == 1 and f"unknown key {name!r} (did you mean {suggested!r}?)" in found[0]["message"], results
    assert "Extra inputs are not permitted" in found[0]["message"]
    if block in STRICT_SINCE:
        assert statuses(on_nodes(tmp_path, with_block(block, {key: True}), {"n01": "0.19.8"})) == ["fail"]


@pytest.mark.parametrize("block,inner", [
    (("tensorboard",), {"enabled": True, "output_path": "logs/", "job_name": "run"}),
    (("comms_logger",), {"enabled": True, "verbose": False, "prof_all": True, "debug": False}),
    (("compile",), {"deepcompile": True, "offload_activation": False}),
    (("timers",), {"throughput": {"enabled": True, "synchronized": False}}),
    (("tensor_parallel",), {"autotp_size": 2, "tp": {"tp_size": 2}}),
    (("hybrid_engine",), {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1}),
])
def test_known_keys_of_a_strict_block_pass(capsys, tmp_path, block, inner):
    assert statuses(lint(capsys, tmp_path, with_block(block, inner))) == ["pass"]


@pytest.mark.parametrize("block", [("optimizer",), ("scheduler",), ("aio",), ("checkpoint",), ("flops_profiler",),
                                   ("activation_checkpointing",), ("expert_parallel",), ("data_types",), ("timers",)])
def test_blocks_deepspeed_reads_with_get_take_any_key(capsys, tmp_path, block):
    assert statuses(lint(capsys, tmp_path, with_block(block, {"preflight_unknown": 1}))) == ["pass"]


def test_bfloat16_beside_bf16_is_not_read(capsys, tmp_path):
    config = {"train_batch_size": 8, "bf16": {"enabled": True}, "bfloat16": {"junk": 1}}
    assert statuses(lint(capsys, tmp_path, config)) == ["pass"]


def test_unknown_key_set_to_auto_warns(capsys, tmp_path):
    results = lint(capsys, tmp_path, with_block(("zero_optimization",), {"stage": 2, "overlap_com": "auto"}))
    assert statuses(results) == ["warn"], results
    assert "'zero_optimization.overlap_com' (did you mean 'overlap_comm'?) set to \"auto\"" in results[0]["message"]


def test_unknown_key_set_to_auto_fails_under_accelerate(capsys, tmp_path):
    config = with_block(("zero_optimization",), {"stage": 2, "overlap_com": "auto"})
    (tmp_path / "ds.json").write_text(json.dumps(config))
    (tmp_path / "accelerate.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 2\n"
        f"machine_rank: 0\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    code, doc, err = run_cli(capsys, "lint", "--config", tmp_path / "accelerate.yaml", "--only", "CFG060", "--json")
    results = [r for r in doc["results"] if r["id"] == "CFG060"]
    assert statuses(results) == ["fail"], results
    assert "accelerate stops on it ('`zero_optimization.overlap_com` not found in kwargs')" in results[0]["message"]


def real_deepspeed_configs():
    """The DeepSpeed JSON files copied from real projects (sources in each folder's README.md), plain JSON ones."""
    found = []
    real = FIXTURES / "config" / "real"
    for path in sorted((FIXTURES / "realworld").rglob("*.json")) + sorted(real.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:  # hjson with comments: CFG008's cases
            continue
        if isinstance(data, dict):
            found.append(str(path.relative_to(FIXTURES)))
    return found


@pytest.mark.parametrize("name", real_deepspeed_configs())
def test_real_configs_have_no_unknown_key_in_a_strict_block(capsys, name):
    code, doc, err = run_cli(capsys, "lint", "--deepspeed", FIXTURES / name, "--only", "CFG060", "--json")
    results = [r for r in doc["results"] if r["id"] == "CFG060"]
    assert results and not [r["message"] for r in results if r["status"] == "fail" and "unknown key" in r["message"]]


# --- removed features, against the DeepSpeed that runs ----------------------------------------------------------

AMP = {"train_batch_size": 8, "amp": {"enabled": True}}
ONEBIT = {"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {"lr": 0.001}}}
MICS = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": 8}}


@pytest.mark.parametrize("installed", ["0.19.8", "0.19.6", None])
@pytest.mark.parametrize("config,what,since", [(AMP, "'amp'", "0.19.8"), (ONEBIT, "optimizer 'OneBitAdam'", "0.19.7"),
                                               (MICS, "'zero_optimization.mics_shard_size'", "0.19.7")])
def test_lint_warns_of_a_removed_feature_whatever_deepspeed_is_installed_here(capsys, tmp_path, monkeypatch, config,
                                                                               what, since, installed):
    # the DeepSpeed installed where lint runs need not be the nodes': the job's is not known to lint
    installed_here(monkeypatch, installed)
    results = lint(capsys, tmp_path, config)
    assert statuses(results) == ["warn"], results
    assert f"{what} was removed from DeepSpeed in {since}: {since} and newer refuse it" in results[0]["message"]
    assert "is not known here" in results[0]["message"]


@pytest.mark.parametrize("version,refused", [("0.19.7", False), ("0.19.8rc1", False), ("0.19.8.dev0", False),
                                             ("0.19.8", True), ("0.19.8+cu124", True), ("0.19.10", True),
                                             ("0.20", True), ("1.0.0", True)])
def test_versions_are_ordered_as_pip_orders_them(tmp_path, version, refused):
    assert statuses(on_nodes(tmp_path, AMP, {"n01": version})) == (["fail"] if refused else ["pass"])


def test_each_removed_key_counts_from_its_own_release(tmp_path):
    results = on_nodes(tmp_path, {"train_batch_size": 8, "amp": {}, "nebula": {}}, {"n01": "0.19.7"})
    assert [(r.status.value, r.evidence["key"]) for r in results] == [("fail", "nebula")], results


def test_removed_feature_fails_on_the_nodes_whose_deepspeed_refuses_it(tmp_path, monkeypatch):
    installed_here(monkeypatch, "0.19.5")  # this machine's DeepSpeed is not the job's under `check`
    results = on_nodes(tmp_path, AMP, {"n01": "0.19.8", "n02": "0.19.5", "n03": "0.19.8"})
    assert statuses(results) == ["fail"], results
    assert "DeepSpeed 0.19.8 on n[01,03] refuses it" in results[0].message


def test_removed_feature_passes_on_nodes_with_an_older_deepspeed(tmp_path, monkeypatch):
    installed_here(monkeypatch, "0.19.8")
    assert statuses(on_nodes(tmp_path, ONEBIT, {"n01": "0.19.5", "n02": "0.19.6"})) == ["pass"]


def test_removed_feature_warns_when_no_node_reports_deepspeed(tmp_path, monkeypatch):
    installed_here(monkeypatch, "0.19.8")
    results = on_nodes(tmp_path, AMP, {"n01": None, "n02": None})
    assert statuses(results) == ["warn"], results


@pytest.mark.parametrize("case,what,line", [("removed-top-key", "'amp' was removed from DeepSpeed in 0.19.8", 4),
                                            ("removed-zero-key", "'zero_optimization.mics_shard_size' was removed "
                                             "from DeepSpeed in 0.19.7", 5)])
def test_removed_key_cases_warn_with_lint(capsys, monkeypatch, case, what, line):
    installed_here(monkeypatch, "0.19.8")
    path = FIXTURES / "config" / "CFG060" / case / "ds.json"
    code, doc, err = run_cli(capsys, "lint", "--deepspeed", path, "--only", "CFG060", "--json")
    results = [r for r in doc["results"] if r["id"] == "CFG060"]
    assert statuses(results) == ["warn"], results
    assert results[0]["message"].startswith(f"{path}:{line}: {what}"), results


def test_a_node_whose_packages_section_failed_reports_no_version(tmp_path):
    """A packages section that failed on a node is no DeepSpeed version (PKG003 reports it), not an error of CFG060."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(AMP))
    failed = {"error": "collector section packages failed on the node: OSError"}
    states = {"n01": {"facts": {"packages": failed}, "error": None, "clock": None},
              "n02": {"facts": {"packages": {"versions": {"deepspeed": "0.19.8"}}}, "error": None, "clock": None}}
    plan = build_plan(deepspeed=str(path), nodes=tuple(states))
    results = [r for r in runner.run([SPECS["CFG060"]], runner.CheckContext(plan, states, {})) if r.id == "CFG060"]
    assert statuses(results) == ["fail"] and "DeepSpeed 0.19.8 on n02 refuses it" in results[0].message, results
    del states["n02"]
    results = [r for r in runner.run([SPECS["CFG060"]], runner.CheckContext(plan, states, {})) if r.id == "CFG060"]
    assert statuses(results) == ["warn"], results


@pytest.mark.parametrize("old,new,value", [("cpu_offload", "offload_optimizer", {"device": "cpu"}),
                                           ("cpu_offload_param", "offload_param", {"device": "cpu"})])
def test_a_deprecated_key_beside_the_one_that_replaced_it_fails_as_deepspeed_refuses_it(capsys, tmp_path, old, new,
                                                                                          value):
    needs_deepspeed()
    both = {"train_batch_size": 8, "zero_optimization": {"stage": 3, old: True, new: value}}
    refused = deepspeed_reads(both)
    assert refused and f"Cannot provide deprecated parameter '{old}' and replacing parameter '{new}' together" in \
        refused
    alone = {"train_batch_size": 8, "zero_optimization": {"stage": 3, old: True}}
    assert deepspeed_reads(alone) is None
    capsys.readouterr()  # DeepSpeed's own log lines
    found = [r for r in lint(capsys, tmp_path, both) if r["status"] == "fail"]
    assert len(found) == 1 and f"sets the deprecated {old} and {new}" in found[0]["message"], found
    assert "fail" not in statuses(lint(capsys, tmp_path, alone))
