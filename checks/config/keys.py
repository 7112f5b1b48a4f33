"""CFG keys: the accelerate config, its deepspeed_config section and the DeepSpeed JSON hold only keys their
library knows, and the DeepSpeed JSON that deepspeed_config_file names is there with nothing beside it that
accelerate refuses."""
from __future__ import annotations

import difflib
import os
from typing import Dict, Iterator, List, Optional

from preflight.api import Finding, check, fail, fold, passed, skip, warn
from preflight.checks.config.common import (accel_doc, at, command_unknown, did_you_mean, dotted, ds_doc, ds_usage,
                                           files_unknown, live_ds_section, more_unknown, unknown, yaml_word)
from preflight.inputs.configs import (ACCELERATE_DS_KEYS, ACCELERATE_DS_KEYS_CONFLICTING_WITH_FILE, ACCELERATE_KEYS,
                                      ACCELERATE_REMOVED_KEYS, AUTO, SAGEMAKER_KEYS)
from preflight.inputs.deepspeed_keys import (DS_DEPRECATED_REPLACED, DS_DEPRECATED_ZERO_KEYS, DS_JSON_KEYS,
                                             DS_REMOVED_KEYS, DS_REMOVED_KEYS_SINCE, DS_REMOVED_OPTIMIZERS_SINCE,
                                             DS_REMOVED_ZERO_KEYS, DS_REMOVED_ZERO_KEYS_SINCE, DS_TOP_BLOCKS,
                                             DS_TOP_KEYS, STRICT_BLOCKS, STRICT_SINCE, ZERO_ALIASES)
from preflight.inputs.documents import shorten
from preflight.inputs import versions


@check("CFG001", "accelerate-keys", "config", tags=["accelerate"])
def accelerate_keys(ctx) -> Iterator[Finding]:
    """The accelerate config has only keys that accelerate knows.

    accelerate refuses to start with a ValueError naming the unknown keys, on every node, after the
    job has been queued and the nodes allocated; a misspelt key never takes effect.

    Remove the key, or correct its spelling to the one suggested; `accelerate config` writes a
    correct file.
    """
    doc = accel_doc(ctx)
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    schema = SAGEMAKER_KEYS if ctx.plan.accelerate.is_sagemaker else ACCELERATE_KEYS
    first, rest = unknown(doc.data, schema)
    for key in first:
        if key in ACCELERATE_REMOVED_KEYS:
            yield fail(f"{doc.where(key)}: key {key!r} is {ACCELERATE_REMOVED_KEYS[key]}; accelerate rejects the file",
                       f"delete the line `{key}: ...`", key=key, **at(doc, key))
        else:
            yield fail(f"{doc.where(key)}: unknown key {key!r}{did_you_mean(key, list(schema))}; "
                       "accelerate rejects the file with 'had unknown keys'",
                       f"correct or delete {key!r}; the keys accelerate knows are listed by `preflight explain CFG001`",
                       key=key, **at(doc, key))
    if rest:
        yield more_unknown(doc, (), rest, fail, "accelerate rejects the file with 'had unknown keys'")


@check("CFG004", "deepspeed-section-keys", "config", tags=["accelerate", "deepspeed"])
def deepspeed_section_keys(ctx) -> Iterator[Finding]:
    """The `deepspeed_config` section of the accelerate config holds only accelerate's own DeepSpeed keys.

    accelerate reads only its own keys there (zero_stage, offload_optimizer_device, ...). DeepSpeed-JSON
    keys pasted into it (train_batch_size, zero_optimization, fp16, ...) are silently ignored: the job
    runs with other settings than the file shows.

    Move DeepSpeed-JSON settings into a JSON file named by `deepspeed_config_file`, or express them with
    accelerate's keys (zero_stage, offload_optimizer_device, offload_param_device, gradient_clipping,
    gradient_accumulation_steps).
    """
    doc = accel_doc(ctx)
    written = doc.data.get("deepspeed_config") if doc is not None else None
    if written is not None and not isinstance(written, dict) and ctx.plan.accelerate.uses_deepspeed:
        # Only with --use_deepspeed over another type (under DEEPSPEED the file is refused as bad input):
        # launch_command reads defaults.deepspeed_config.keys() before it starts DeepSpeed.
        yield fail(f"{doc.where('deepspeed_config')}: deepspeed_config is {shorten(written)}, not a section, and the "
                   "launch uses DeepSpeed: accelerate launch stops on it (AttributeError: no attribute 'keys')",
                   f"write deepspeed_config: {{deepspeed_config_file: {written}}}" if isinstance(written, str) else
                   "make deepspeed_config a section of accelerate's DeepSpeed keys (zero_stage, deepspeed_config_file, "
                   "...), or delete it", **at(doc, "deepspeed_config"))
        return
    if not written:
        yield skip("the accelerate config has no deepspeed_config section")
        return
    if not ctx.plan.accelerate.uses_deepspeed:
        dtype = doc.data.get("distributed_type")
        shown = f"is {yaml_word(dtype)}" if "distributed_type" in doc.data else "not set"
        named = isinstance(written, str)  # a JSON's path where the section belongs: DeepSpeed was meant
        yield warn(f"{doc.where('deepspeed_config')}: distributed_type {shown}, so accelerate never reads "
                   + (f"deepspeed_config ({shorten(written)}): the job runs without DeepSpeed" if named else
                      "this deepspeed_config section: its settings are ignored")
                   + " (accelerate launch uses DeepSpeed only with distributed_type DEEPSPEED or --use_deepspeed)",
                   f"to run with that DeepSpeed JSON, set distributed_type: DEEPSPEED and deepspeed_config: "
                   f"{{deepspeed_config_file: {written}}}; else delete the deepspeed_config line" if named else
                   "delete the deepspeed_config section, or set distributed_type: DEEPSPEED if the job is meant to "
                   "use DeepSpeed", distributed_type=dtype, **at(doc, "deepspeed_config"))
        return
    section = doc.section("deepspeed_config")
    ds_keys = [k for k in section.data if k in DS_JSON_KEYS]
    if ds_keys:
        first = ds_keys[0]
        # The job runs (accelerate copies them into launch arguments no launcher reads): a warning, not a refusal.
        yield warn(f"{doc.where('deepspeed_config', first)}: deepspeed_config holds DeepSpeed-JSON keys "
                   f"({', '.join(ds_keys)}) that accelerate ignores; expected only accelerate's keys",
                   "put these settings in a DeepSpeed JSON file and name it with deepspeed_config_file, or use "
                   "accelerate's keys: zero_stage, offload_optimizer_device, offload_param_device, "
                   "gradient_accumulation_steps, gradient_clipping", keys=ds_keys, **at(doc, "deepspeed_config", first))
    for key in section.data:
        if key not in ACCELERATE_DS_KEYS and key not in DS_JSON_KEYS:
            yield warn(f"{doc.where('deepspeed_config', key)}: deepspeed_config.{key} is not a key accelerate "
                       f"knows{did_you_mean(key, list(ACCELERATE_DS_KEYS))}; it has no effect",
                       f"correct or delete deepspeed_config.{key}", key=key, **at(doc, "deepspeed_config", key))


@check("CFG005", "deepspeed-config-file", "config", tags=["accelerate", "deepspeed"])
def deepspeed_config_file(ctx) -> Iterator[Finding]:
    """The DeepSpeed JSON named by `deepspeed_config_file` exists, and nothing beside it contradicts it.

    With `deepspeed_config_file`, accelerate raises a ValueError on every node when the script starts if
    the config also sets mixed_precision (any value, even 'no') or one of zero_stage, offload_*,
    gradient_accumulation_steps, gradient_clipping, zero3_save_16bit_model; and it requires a
    zero_optimization block in the file. A DeepSpeed config given with an accelerate config that does
    not use DeepSpeed is not used at all.

    Keep those settings in the DeepSpeed JSON only and delete them (and mixed_precision) from the
    accelerate config; make deepspeed_config_file a path that exists on every node.
    """
    doc = accel_doc(ctx)
    plan = ctx.plan
    if doc is None:
        yield skip("no accelerate config given (--config)")
        return
    section = live_ds_section(ctx)
    named = section.data.get("deepspeed_config_file") if section is not None else None
    if named is None:
        if plan.deepspeed is not None and not ctx.plan.accelerate.uses_deepspeed:
            yield warn(f"{doc.where('distributed_type')}: distributed_type is {doc.data.get('distributed_type')!r}, "
                       f"so the DeepSpeed config {plan.deepspeed.doc.path} is not used by this accelerate config",
                       "set distributed_type: DEEPSPEED and deepspeed_config.deepspeed_config_file to the JSON's path",
                       **at(doc, "distributed_type"))
        elif plan.deepspeed is not None:
            yield warn(f"{doc.where('deepspeed_config')}: this accelerate config names no deepspeed_config_file: "
                       f"accelerate builds the DeepSpeed settings from its own keys, and {plan.deepspeed.doc.path} "
                       "is not used", "name the JSON in deepspeed_config.deepspeed_config_file (and remove "
                       "accelerate's own zero_stage, offload_* and mixed_precision)", **at(doc, "deepspeed_config"))
        elif plan.deepspeed is None:
            yield skip("the accelerate config names no deepspeed_config_file")
        return
    where = doc.where("deepspeed_config", "deepspeed_config_file")
    if (plan.deepspeed is None or plan.deepspeed_file_named is None) and files_unknown(ctx):
        yield skip(f"{where}: deepspeed_config_file {named!r} is not here (the working directory, beside "
                   f"{doc.path}): it may be on the nodes, where accelerate opens it (`preflight check` asks them); "
                   "not judged", **at(doc, "deepspeed_config", "deepspeed_config_file"))
    elif plan.deepspeed is None or plan.deepspeed_file_named is None:
        yield fail(f"{where}: deepspeed_config_file {named!r} does not exist (looked in the working directory "
                   f"and beside {doc.path}); accelerate reads the config without opening it, then stops when the "
                   "script starts and its DeepSpeedPlugin opens the file", "correct the path; it must exist on every node",
                   **at(doc, "deepspeed_config", "deepspeed_config_file"))
    elif not _same_path(plan.deepspeed.doc.path, plan.deepspeed_file_named):
        yield warn(f"{where}: the accelerate config uses {plan.deepspeed_file_named}, "
                   f"but the DeepSpeed config checked is {plan.deepspeed.doc.path}",
                   "lint the file the job will use: drop --deepspeed, or point deepspeed_config_file at it",
                   **at(doc, "deepspeed_config", "deepspeed_config_file"))
    # accelerate raises for the keys the config file writes (a flag over one does not hide it), and for its
    # mixed_precision unless a flag gives that (commands/launch.py, launch_command); flags alone never
    conflicting = [k for k in ACCELERATE_DS_KEYS_CONFLICTING_WITH_FILE if section.in_file(k)]
    if doc.data.get("mixed_precision") is not None and not doc.given_by_flag("mixed_precision"):
        conflicting.append("mixed_precision")
    for key in conflicting:
        keys = ("mixed_precision",) if key == "mixed_precision" else ("deepspeed_config", key)
        if key == "mixed_precision" and command_unknown(ctx):  # a --mixed_precision flag would clear it
            yield warn(f"{doc.where(*keys)}: mixed_precision is set beside deepspeed_config_file; unless the launch "
                       "command passes --mixed_precision, accelerate raises 'When using `deepspeed_config_file`, the "
                       "following accelerate config variables will be ignored' when the script starts",
                       "delete mixed_precision and set the precision in the DeepSpeed JSON", key="mixed_precision",
                       **at(doc, *keys))
            continue
        yield fail(f"{doc.where(*keys)}: {dotted(keys)} is set beside deepspeed_config_file; accelerate raises "
                   "'When using `deepspeed_config_file`, the following accelerate config variables will be "
                   "ignored' when the script starts", f"delete {dotted(keys)} and set it in the DeepSpeed JSON",
                   key=dotted(keys), **at(doc, *keys))
    ds = ds_doc(ctx)
    if ds is not None and "zero_optimization" not in ds.data:
        yield fail(f"{ds.path}: no zero_optimization block; accelerate requires one in the file it is given "
                   "('Please specify the ZeRO optimization config in the DeepSpeed config')",
                   'add "zero_optimization": {"stage": 0} (or the stage you want)', **at(ds))


def _same_path(a: str, b: str) -> bool:
    """The same file, however the two were spelt (./x, x, a/../x); no I/O."""
    return os.path.normcase(os.path.abspath(a)) == os.path.normcase(os.path.abspath(b))


@check("CFG060", "deepspeed-keys", "config", tags=["deepspeed"])
def deepspeed_keys(ctx) -> Iterator[Finding]:
    """The DeepSpeed config has only keys that DeepSpeed knows, and no feature it has removed.

    DeepSpeed refuses unknown keys in the blocks it reads with its pydantic models (zero_optimization and
    its offload blocks, fp16, bf16, compile, tensor_parallel, comms_logger, the monitors, timers,
    hybrid_engine, ...); elsewhere it ignores them, so a misspelt setting silently keeps its default.
    Since 0.19.7 it also refuses removed features (amp, elasticity, MiCS, ...) and no longer builds the
    1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb); the precision blocks (fp16, bf16) refuse
    unknown keys since 0.17.1, compile since 0.16.6. What only newer releases refuse fails where the
    DeepSpeed that runs is that new (the nodes' with `check` and `node`) and is a warning with `lint`, which
    does not know the job's DeepSpeed (a config written for an older release runs there).

    Correct the spelling to the one suggested, or delete the key; for a removed feature, delete it (or
    pin an older DeepSpeed on every node).
    """
    ds = ds_doc(ctx)
    if ds is None:
        yield skip("no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    in_use = _deepspeed_in_use(ctx) if _names_removed_features(ds) else {}
    strict_versions: List[Dict[str, List[str]]] = []

    def in_use_strict() -> Dict[str, List[str]]:  # looked up once, and only where a block's key needs it
        if not strict_versions:
            strict_versions.append(_deepspeed_in_use(ctx))
        return strict_versions[0]

    for key in ds.data:
        if key in DS_REMOVED_KEYS:
            yield from _removed(ds, in_use, (key,), f"{key!r}", DS_REMOVED_KEYS_SINCE[key], f"delete {key!r}")
    first, rest = unknown((k for k in ds.data if k not in DS_REMOVED_KEYS), DS_TOP_KEYS)
    others = []
    for key in first:
        # A block is no misspelt number: VideoX-Fun's "sequence_parallel": {"enabled": true} is its own setting.
        like = sorted(k for k in DS_TOP_KEYS if isinstance(ds.data[key], dict) == (k in DS_TOP_BLOCKS))
        typo = any(key.lower() == k.lower() or difflib.SequenceMatcher(None, key, k).ratio() >= 0.8 for k in like)
        if key in ACCELERATE_KEYS and not typo:  # accelerate's setting pasted here: it does not set DeepSpeed's
            yield warn(f"{ds.where(key)}: unknown key {key!r}: accelerate's config key, which DeepSpeed ignores here, "
                       "so the setting has no effect", f"delete {key!r} and set it where DeepSpeed reads it",
                       key=key, **at(ds, key))
            continue
        if not typo:  # another tool's key (`_comment`, a launcher's setting): DeepSpeed ignores it, nothing is lost
            others.append(key)
            continue
        # A warning for a misspelling: the job runs, without the setting (--strict makes it refuse).
        yield warn(f"{ds.where(key)}: unknown key {key!r}{did_you_mean(key, like)}; DeepSpeed ignores it, so the "
                   "setting has no effect", "correct the spelling", key=key, **at(ds, key))
    others += rest
    if others:
        yield passed(f"{ds.path}: keys DeepSpeed does not read, ignored (another tool's, or notes): "
                     f"{', '.join(repr(k) for k in others[:8])}{' and more' if len(others) > 8 else ''}",
                     ignored=[str(k) for k in others[:50]])
    for block, known in STRICT_BLOCKS.items():
        section = ds.section(*block)
        if section is None or (block == ("bfloat16",) and "bf16" in ds.data):  # get_bfloat16_config: bf16 first
            continue
        removed = DS_REMOVED_ZERO_KEYS if block == ("zero_optimization",) else frozenset()
        first, rest = unknown((k for k in section.data if k not in removed), known)
        since = STRICT_SINCE.get(block)
        if since is not None and (first or rest):  # one finding for the block: what newer releases refuse
            names = [dotted(block + (k,)) for k in first + rest if section.data[k] != AUTO]
            if names:
                shown = ", ".join(repr(n) for n in names[:6]) + (" and more" if len(names) > 6 else "")
                if len(names) == 1:
                    shown += did_you_mean(names[0].rsplit(".", 1)[-1], sorted(known - DS_DEPRECATED_ZERO_KEYS))
                yield from _refused_since(ds, in_use_strict(), block + (first[0] if first else rest[0],),
                                          f"unknown key{'s' if len(names) > 1 else ''} {shown}", since,
                                          f"correct or delete {', '.join(names[:6])}", "refuse "
                                          f"{'them' if len(names) > 1 else 'it'} ('Extra inputs are not permitted')")
            first, rest = [k for k in first if section.data[k] == AUTO], []
        for key in first:
            name, like = dotted(block + (key,)), sorted(known - DS_DEPRECATED_ZERO_KEYS)
            if section.data[key] == AUTO:
                # DeepSpeedConfigModel.__init__ (runtime/config_utils.py) drops "auto" values before validating;
                # accelerate fills in the keys it knows and raises on any other "auto" (DeepSpeedPlugin.fill_match).
                under_accelerate = ds_usage(ctx) == "accelerate"
                yield (fail if under_accelerate else warn)(
                    f"{ds.where(*block, key)}: unknown key {name!r}{did_you_mean(key, like)} set to \"auto\"; "
                    + (f"accelerate stops on it ('`{name}` not found in kwargs')" if under_accelerate else
                       "DeepSpeed drops keys set to \"auto\" unread: it has no effect (accelerate would stop on it)"),
                    f"correct or delete {name}", key=name, **at(ds, *block, key))
                continue
            yield fail(f"{ds.where(*block, key)}: unknown key {name!r}{did_you_mean(key, like)}; DeepSpeed "
                       "refuses it ('Extra inputs are not permitted')", f"correct or delete {name}", key=name,
                       **at(ds, *block, key))
        if rest:
            yield more_unknown(ds, block, rest, fail, "DeepSpeed refuses them ('Extra inputs are not permitted')")
    zero = ds.section("zero_optimization")
    if zero is not None:
        for key in zero.data:
            if key in DS_REMOVED_ZERO_KEYS:
                yield from _removed(ds, in_use, ("zero_optimization", key), f"'zero_optimization.{key}'",
                                    DS_REMOVED_ZERO_KEYS_SINCE[key], f"delete zero_optimization.{key}")
        for old, new in DS_DEPRECATED_REPLACED.items():
            if old in zero.data and new in zero.data and AUTO not in (zero.data[old], zero.data[new]):
                yield fail(f"{ds.where('zero_optimization', old)}: zero_optimization sets the deprecated {old} and "
                           f"{new}, which replaced it; DeepSpeed refuses the pair ('Cannot provide deprecated "
                           f"parameter {old!r} and replacing parameter {new!r} together')",
                           f"delete zero_optimization.{old} ({new} says where to offload)",
                           **at(ds, "zero_optimization", old))
        for field, alias in ZERO_ALIASES.items():
            if field in zero.data and alias in zero.data:
                yield fail(f"{ds.where('zero_optimization', field)}: zero_optimization sets both {field} and its "
                           f"alias {alias}; DeepSpeed refuses the pair", f"keep one of {field} and {alias}",
                           **at(ds, "zero_optimization", field))
    optimizer = _removed_optimizer(ds)
    if optimizer is not None:
        yield from _removed(ds, in_use, ("optimizer", "type"), f"optimizer {ds.data['optimizer']['type']!r}",
                            DS_REMOVED_OPTIMIZERS_SINCE[optimizer], "use one DeepSpeed still builds (Adam, AdamW, "
                            "Lamb, ...), a torch.optim optimizer, or create the optimizer in the script")


def _removed_optimizer(ds) -> Optional[str]:
    """The removed optimizer optimizer.type names, as DeepSpeed compares it: lower-cased
    (DeepSpeedConfig._initialize_params)."""
    optimizer = ds.data.get("optimizer")
    name = optimizer.get("type") if isinstance(optimizer, dict) else None
    return name.lower() if isinstance(name, str) and name.lower() in DS_REMOVED_OPTIMIZERS_SINCE else None


def _names_removed_features(ds) -> bool:
    """Whether the config has anything _removed judges (the DeepSpeed version is looked up only then)."""
    zero = ds.data.get("zero_optimization")
    return any(k in DS_REMOVED_KEYS for k in ds.data) or _removed_optimizer(ds) is not None or \
        (isinstance(zero, dict) and any(k in DS_REMOVED_ZERO_KEYS for k in zero))


def _deepspeed_in_use(ctx) -> Dict[str, List[str]]:
    """The DeepSpeed versions the job will run: {version: the nodes reporting it} with `check` and `node`, else {}
    (`lint` does not know it: the DeepSpeed installed where lint runs need not be the nodes')."""
    found: Dict[str, List[str]] = {}
    for node in ctx.reachable if ctx.facts else ():
        # dict.get: a packages section that failed on the node is no version (PKG003 reports it).
        packages = dict.get(ctx.facts[node]["facts"], "packages")
        reported = packages.get("versions") if isinstance(packages, dict) else None
        version = reported.get("deepspeed") if isinstance(reported, dict) else None
        if isinstance(version, str) and versions.version(version) is not None:
            found.setdefault(version, []).append(node)
    return found


def _removed(ds, in_use: Dict[str, List[str]], keys: tuple, what: str, since: str, fix: str) -> Iterator[Finding]:
    """A feature DeepSpeed removed in `since`."""
    yield from _refused_since(ds, in_use, keys, what, since, fix, "refuse it", removed=True)


def _refused_since(ds, in_use: Dict[str, List[str]], keys: tuple, what: str, since: str, fix: str, refuse: str,
                   removed: bool = False) -> Iterator[Finding]:
    """What DeepSpeed refuses since a release: a failure where the DeepSpeed in use is `since` or newer (as pip
    orders versions), a warning where no version is known, nothing where every known one still takes it."""
    refusing = {v: nodes for v, nodes in in_use.items() if versions.version(v) >= versions.version(since)}
    where = ds.where(*keys)
    change = f"was removed from DeepSpeed in {since}" if removed else f"DeepSpeed {since} and newer {refuse}"
    evidence = dict(key=dotted(keys), **({"removed_in": since} if removed else {"refused_since": since}),
                    **at(ds, *keys))
    pin = f"{fix} (or pin DeepSpeed older than {since} on every node)"
    if refusing:
        who = " and ".join(f"DeepSpeed {v} on {fold(nodes)}" for v, nodes in
                           sorted(refusing.items(), key=lambda item: versions.version(item[0])))
        verb = "refuses" if len(refusing) == 1 else "refuse"
        yield fail(f"{where}: {what}{' ' if removed else '; '}{change}: {who} {verb} it and the job stops when the "
                   "engine starts", pin,
                   deepspeed=sorted(refusing), **evidence)
    elif not in_use:
        also = f": {since} and newer refuse it" if removed else ""
        yield warn(f"{where}: {what}{' ' if removed else '; '}{change}{also} (the DeepSpeed the job runs is not known "
                   "here: `preflight check` asks the nodes)", pin, **evidence)
