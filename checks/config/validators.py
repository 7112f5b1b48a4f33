"""CFG validators (--deep, and inside `check`): the installed accelerate's and DeepSpeed's own config classes
accept the configs, as the launch will load them."""
from __future__ import annotations

import contextlib
import copy
import logging
import sys
from typing import Any, Iterator

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.checks.config.common import accel_doc, at, ds_doc, ds_usage
from preflight.inputs.configs import AUTO
from preflight.inputs.documents import shorten
from preflight.inputs.numbers import is_int


def _not_importable(ctx, library: str, exc: ImportError):
    """`lint --deep` asked for the library's own validator: that it could not run is a warning the report shows;
    inside `check` (which runs the validators unasked) a skip."""
    said = f"{library} is not importable here ({exc})"
    if not ctx.plan.nodes:
        return warn(f"--deep: {said}, so its own validator did not run", f"install {library} where lint runs "
                    "(or preflight's 'train' extra)")
    return skip(f"{said}; install it, or the 'train' extra")


@check("CFG090", "accelerate-validator", "config", tags=["accelerate", "deep"])
def accelerate_validator(ctx) -> Iterator[Finding]:
    """accelerate's own config classes accept the accelerate config, as `accelerate launch` will load it.

    The installed accelerate is the final word on which keys and values it takes: it may be older or
    newer than the rules preflight knows.

    Fix what accelerate reports, or align the accelerate version with the config (`accelerate config`
    writes a file that the installed version accepts).
    """
    doc = accel_doc(ctx)
    if not ctx.plan.deep:
        yield skip("the libraries' validators run with --deep, and inside `preflight check`")
        return
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    if ctx.plan.accelerate.from_command:
        yield skip("no accelerate config file: the launch command's flags alone, which accelerate's argument parser "
                   "reads")
        return
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig
            from accelerate.utils import PrecisionType
            from accelerate import __version__ as version
    except ImportError as exc:
        yield _not_importable(ctx, "accelerate", exc)
        return
    cls = SageMakerConfig if ctx.plan.accelerate.is_sagemaker else ClusterConfig
    try:
        data = cls.process_config(copy.deepcopy(dict(doc.data)))
        extra = sorted(set(data) - set(cls.__dataclass_fields__))
        if extra:
            raise ValueError(f"unknown keys {extra}")
        cls(**data)
        mp = data.get("mixed_precision")
        if mp is not None:
            PrecisionType(str(mp).lower())  # what `accelerate launch` does with it
    except Exception as exc:
        yield fail(f"{doc.path}: accelerate {version} rejects the config: {type(exc).__name__}: {_one_line(exc)}",
                   "fix the key or value accelerate names", accelerate=version, **at(doc))
        return
    yield passed(f"accelerate {version} accepts {doc.path}", accelerate=version)


@check("CFG091", "deepspeed-validator", "config", tags=["deepspeed", "deep"])
def deepspeed_validator(ctx) -> Iterator[Finding]:
    """DeepSpeed's own DeepSpeedConfig accepts the DeepSpeed config for the planned world size.

    The installed DeepSpeed validates every block with its own models; a key or value it refuses stops
    the engine on every node after the model has been loaded.

    Fix what DeepSpeed reports ("auto" values are filled in first, as accelerate and the transformers
    Trainer do, so they are not reported here).
    """
    ds = ds_doc(ctx)
    if not ctx.plan.deep:
        yield skip("the libraries' validators run with --deep, and inside `preflight check`")
        return
    if ds is None:
        yield skip("no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    world, _ = ctx.plan.world_size
    world = world or 1
    try:
        # DeepSpeed's logger writes to stdout, which belongs to the report (--json): bind it to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
            import deepspeed.comm as dist
            from deepspeed.runtime.config import DeepSpeedConfig
        for handler in logging.getLogger("DeepSpeed").handlers:  # imported earlier, it may hold the real stdout
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stdout__:
                handler.setStream(sys.stderr)
    except ImportError as exc:
        yield _not_importable(ctx, "deepspeed", exc)
        return
    config = _without_auto(copy.deepcopy(dict(ds.data)), world)
    stand_in = ""
    if ds_usage(ctx) == "unknown" and not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(config):
        # A framework may set the micro batch itself (Lightning does; CFG030 warns): validate the rest.
        config["train_micro_batch_size_per_gpu"] = 1
        stand_in = " (a stand-in micro batch of 1 for the one the training framework sets, see CFG030)"
    saved = dist.get_rank, dist.get_world_size
    # Without an initialised process group DeepSpeedConfig assumes a world of 1: give it the plan's.
    dist.get_rank, dist.get_world_size = (lambda *a, **k: 0), (lambda *a, **k: world)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            parsed = DeepSpeedConfig(config)
    except Exception as exc:
        yield fail(f"{ds.path}: DeepSpeed {deepspeed.__version__} rejects the config at world size {world}: "
                   f"{type(exc).__name__}: {_one_line(exc)}", "fix the key or value DeepSpeed names",
                   deepspeed=deepspeed.__version__, world_size=world, **at(ds))
        return
    finally:
        dist.get_rank, dist.get_world_size = saved
    # The engine builds the optimizer block later, once the model is loaded: one of its own by name (in any case),
    # else getattr(torch.optim, name) (deepspeed/runtime/engine.py, _configure_basic_optimizer).
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    import torch

    name = parsed.optimizer_name
    found = getattr(torch.optim, name, None) if isinstance(name, str) else None
    optimizer_class = isinstance(found, type) and issubclass(found, torch.optim.Optimizer) and \
        found is not torch.optim.Optimizer
    if isinstance(name, str) and name not in DEEPSPEED_OPTIMIZERS and not optimizer_class:
        yield fail(f"{ds.where('optimizer', 'type')}: optimizer {shorten(name)} is neither one of DeepSpeed "
                   f"{deepspeed.__version__}'s own nor a torch.optim optimizer: the engine stops on it on every node "
                   "once the model has loaded", "use one DeepSpeed builds ("
                   + ", ".join(sorted(DEEPSPEED_OPTIMIZERS)) + ") or a torch.optim class by its name, or create the "
                   "optimizer in the script", optimizer=name, deepspeed=deepspeed.__version__,
                   **at(ds, "optimizer", "type"))
        return
    yield passed(f"DeepSpeed {deepspeed.__version__} accepts {ds.path} at world size {world}{stand_in}",
                 deepspeed=deepspeed.__version__, world_size=world)


def _without_auto(config: dict, world: int) -> dict:
    """Stand-ins for "auto", as accelerate would fill them: consistent batch sizes, and no other "auto"."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if any(config.get(k) == AUTO for k in keys):
        micro = config.get(keys[1]) if is_int(config.get(keys[1])) else 1
        steps = config.get(keys[2]) if is_int(config.get(keys[2])) else 1
        sp = config.get("sequence_parallel_size")
        data_parallel = world // sp if is_int(sp) and sp > 0 and world % sp == 0 else world  # as accelerate fills it
        config.update({keys[0]: micro * steps * data_parallel, keys[1]: micro, keys[2]: steps})

    def drop(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: drop(v) for k, v in node.items() if v != AUTO}
        if isinstance(node, list):
            return [drop(v) for v in node if v != AUTO]
        return node

    return drop(config)


def _one_line(exc: BaseException) -> str:
    if callable(getattr(exc, "errors", None)):  # pydantic: one "field: problem" per error
        try:
            text = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        except Exception:
            text = str(exc)
    else:
        text = str(exc)
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."
