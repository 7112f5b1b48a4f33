"""CFG syntax: how the files are written. Numbers that YAML or JSON read as text, quoted booleans, NO read as
false, keys given twice, and what json.load refuses of a DeepSpeed config that DeepSpeed's hjson takes."""
from __future__ import annotations

from typing import Callable, Iterator, Mapping, Optional, Sequence, Tuple

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.checks.config.common import accel_doc, at, dotted, ds_doc, ds_usage, dynamo_backend_read, yaml_word
from preflight.inputs.configs import ACCELERATE_NUMERIC, DS_NUMERIC, ds_text_number_stops, text_number_stops_launch
from preflight.inputs.documents import Document
from preflight.inputs.numbers import is_numeric_string


@check("CFG003", "yaml-traps", "config", tags=["accelerate", "deepspeed", "yaml", "json"])
def yaml_traps(ctx) -> Iterator[Finding]:
    """Numbers written so that the parser reads them as strings, and NO / no read as false.

    YAML 1.1 (PyYAML, which accelerate uses) reads `5e8` and `1e-5` as strings, and an unquoted `NO` or
    `no` as false; a quoted number in JSON is a string too. DeepSpeed then fails comparing a string with
    a number, or accelerate launch crashes on `False.lower()` (mixed_precision, dynamo_backend), at
    start-up on every node. An unquoted `distributed_type: NO` (or yes) happens to launch as 'NO' (a
    warning). In accelerate's config, only text that accelerate compares or computes with stops it:
    num_machines, num_processes over several machines or in the simple launcher, the head's
    main_process_port, a zero_stage or gradient_accumulation_steps that int() cannot read back in the
    script; text it passes on (machine_rank, num_processes on one machine, gradient_clipping) works. In the
    DeepSpeed JSON, DeepSpeed's models read integer text in zero_optimization and fp16 (a quoted ZeRO stage
    still misleads accelerate and transformers: a warning), while text in the batch keys,
    gradient_clipping, steps_per_print and the optimizer's and scheduler's params stops the job.

    Write numbers with a dot and a signed exponent (`5.0e+8`) or in full (`500000000`), never in quotes;
    quote words such as 'NO' and 'no'.
    """
    docs = [d for d in (accel_doc(ctx), ds_doc(ctx)) if d is not None]
    if not docs:
        yield skip("no config given (--config, --deepspeed)")
        return
    accel = accel_doc(ctx)
    if accel is not None:
        dynamo = dynamo_backend_read(ctx, accel)
        for key in ("distributed_type", "mixed_precision", "dynamo_backend"):
            if not isinstance(accel.data.get(key), bool):
                continue
            word = str(accel.data[key]).lower()
            if key == "dynamo_backend" and dynamo is None:  # a --dynamo_backend flag, or DeepSpeed's launcher
                yield warn(f"{accel.where(key)}: dynamo_backend is {word} (YAML 1.1 reads an unquoted NO / no as "
                           "false); this launch does not read it, but another would stop on it",
                           "quote it: `dynamo_backend: 'NO'`", key=key, **at(accel, key))
                continue
            if key == "distributed_type":
                # accelerate only tests it against its types (commands/launch.py): true or false launches as 'NO'.
                read = "NO as false" if word == "false" else "yes / on as true"
                yield warn(f"{accel.where(key)}: distributed_type is {word} (YAML 1.1 reads an unquoted {read}); "
                           "accelerate launches it as 'NO': one process, no distributed setup",
                           "quote it: `distributed_type: 'NO'` (or write the distributed type you meant)",
                           key=key, **at(accel, key))
                continue
            # mixed_precision.lower() and dynamo_backend.upper() in accelerate's launch: AttributeError on a bool.
            yield fail(f"{accel.where(key)}: {key} is {word}, expected a word such as 'NO': YAML 1.1 reads an "
                       "unquoted NO / no as false (and yes as true), and accelerate launch stops on it",
                       f"quote it: `{key}: '{'no' if key == 'mixed_precision' else 'NO'}'`", key=key, **at(accel, key))
        if dynamo is not None and dynamo[0] != ("dynamo_backend",) and not isinstance(dynamo[1], str):
            keys, value = dynamo  # dynamo_config's own: the same .upper() on it
            yield fail(f"{accel.where(*keys)}: {dotted(keys)} is {yaml_word(value)}, expected a word such as 'NO'"
                       + (": YAML 1.1 reads an unquoted NO / no as false" if isinstance(value, bool) else "")
                       + "; accelerate launch stops on it (AttributeError)", "quote it: `dynamo_backend: 'NO'`",
                       key=dotted(keys), **at(accel, *keys))
        # (DeepSpeed-JSON keys pasted into the section are never read: CFG004 says they are ignored.)
        launch = ctx.plan.accelerate.launch

        def judge_accelerate(keys: Tuple[str, ...], text: str) -> Optional[Tuple[bool, str]]:
            why = text_number_stops_launch(keys, text, launch)
            return (True, why) if why else None

        yield from _numeric_strings(accel, ACCELERATE_NUMERIC, judge_accelerate)
    ds = ds_doc(ctx)
    if ds is not None:
        usage = ds_usage(ctx)
        yield from _numeric_strings(ds, list(DS_NUMERIC), lambda keys, text: ds_text_number_stops(keys, text, usage))
        yield from _boolean_strings(ds, ())


def _boolean_strings(doc: Document, keys: Tuple[str, ...]) -> Iterator[Finding]:
    """"true" / "false" in quotes. DeepSpeed's pydantic models coerce them, so DeepSpeed alone trains as
    meant; but accelerate's and transformers' HfDeepSpeedConfig.is_true() take bool("false"), which is True,
    and the transformers Trainer compares fp16/bf16.enabled with its own flag by != and stops with 'Please
    correct the following DeepSpeed config values that mismatch TrainingArguments'."""
    section = doc.section(*keys) if keys else doc
    if section is None:
        return
    for key, value in section.data.items():
        path = keys + (key,)
        if isinstance(value, Mapping):
            yield from _boolean_strings(doc, path)
            continue
        if not (isinstance(value, str) and value.strip().lower() in ("true", "false")):
            continue
        word = value.strip().lower()
        precision = key == "enabled" and keys in (("fp16",), ("bf16",), ("bfloat16",))
        common = (f"{doc.where(*path)}: {dotted(path)} is the string {value!r}, expected {word} without quotes: "
                  "DeepSpeed's own models coerce it")
        if precision and word == "false":
            yield fail(f"{common}, but accelerate's and transformers' HfDeepSpeedConfig.is_true() read the text "
                       f"'false' as true (bool of a non-empty string) and pick {keys[0]}",
                       f'write "{key}": false, without quotes', key=dotted(path), value=value, **at(doc, *path))
        elif precision:
            yield warn(f"{common}, but the transformers Trainer compares it with its own --{keys[0].replace('bfloat16', 'bf16')} "
                       "flag by != and stops ('values that mismatch TrainingArguments')",
                       f'write "{key}": true, without quotes (or "auto" under the Trainer)', key=dotted(path),
                       value=value, **at(doc, *path))
        else:
            yield warn(f"{common}; accelerate's and transformers' is_true() read the text 'false' as true",
                       f'write "{key}": {word}, without quotes', key=dotted(path), value=value, **at(doc, *path))


def _numeric_strings(doc: Document, paths: Sequence[Tuple[str, ...]],
                     judge: Callable[[Tuple[str, ...], str], Optional[Tuple[bool, str]]]) -> Iterator[Finding]:
    """Numbers written as text at `paths`, as judge(keys, text) sees them: None where every reader takes the
    text as its number, else (whether the job stops: a failure, else a warning, and why)."""
    for keys in paths:
        section = doc.section(*keys[:-1]) if len(keys) > 1 else doc
        if section is None:
            continue
        value = section.data.get(keys[-1])
        if not is_numeric_string(value):
            continue
        verdict = judge(keys, value)
        if verdict is None:
            continue
        stops, stop = verdict
        number = float(value)
        shown = str(int(number)) if number.is_integer() else repr(number)
        if doc.kind == "yaml" and doc.is_plain_string(*keys):
            why = f"YAML 1.1 reads {value} (no dot in the mantissa, or no sign in the exponent) as a string"
        else:
            why = "the number is quoted, so it is a string"
        fix = f'write "{keys[-1]}": {shown}, without quotes' if doc.kind == "json" else f"write {keys[-1]}: {shown}"
        yield (fail if stops else warn)(f"{doc.where(*keys)}: {dotted(keys)} is the string {value!r}, expected a "
                                        f"number: {why}; {stop}", fix, key=dotted(keys), value=value, **at(doc, *keys))


@check("CFG006", "duplicate-keys", "config", tags=["accelerate", "deepspeed", "yaml", "json"])
def duplicate_keys(ctx) -> Iterator[Finding]:
    """No key is given twice in the same mapping.

    DeepSpeed refuses a config file with repeated keys when it opens the file itself ('Duplicate keys in
    DeepSpeed config': hjson with dict_raise_error_on_duplicate_keys). YAML, json.load and so accelerate
    (its own config, and the DeepSpeed JSON its DeepSpeedPlugin reads and hands to DeepSpeed as a mapping)
    silently keep the last one, so an edit to the first occurrence does nothing.

    Delete one of the two occurrences.
    """
    docs = [d for d in (accel_doc(ctx), ds_doc(ctx)) if d is not None]
    if not docs:
        yield skip("no config given (--config, --deepspeed)")
        return
    ds = ds_doc(ctx)
    # accelerate's DeepSpeedPlugin reads the DeepSpeed JSON with json.load and hands DeepSpeed the mapping
    # (accelerate/utils/deepspeed.py HfDeepSpeedConfig); DeepSpeed opening the file refuses repeated keys
    # (deepspeed/runtime/config.py: hjson with dict_raise_error_on_duplicate_keys)
    under_accelerate = ds_usage(ctx) == "accelerate"
    for doc in docs:
        for keys, line in doc.duplicates:
            where = f"{doc.path}:{line}"
            if doc is ds and doc.kind == "json" and ds_usage(ctx) == "deepspeed":
                yield fail(f"{where}: key {dotted(keys)!r} is given twice; DeepSpeed refuses the file "
                           "('Duplicate keys in DeepSpeed config')", "delete one of the two", key=dotted(keys),
                           file=doc.path, line=line)
            elif doc is ds and doc.kind == "json" and under_accelerate:
                yield warn(f"{where}: key {dotted(keys)!r} is given twice; accelerate's DeepSpeedPlugin reads the "
                           "file with json.load, which keeps only this last one (DeepSpeed opening the file itself "
                           "would refuse it)", "delete one of the two", key=dotted(keys), file=doc.path, line=line)
            elif doc is ds and doc.kind == "json":  # who opens it is not known: the HF Trainer, a script, DeepSpeed
                yield warn(f"{where}: key {dotted(keys)!r} is given twice; DeepSpeed refuses the file when it opens "
                           "it itself ('Duplicate keys in DeepSpeed config'), the HF Trainer and accelerate keep only "
                           "this last one", "delete one of the two", key=dotted(keys), file=doc.path, line=line)
            else:
                yield warn(f"{where}: key {dotted(keys)!r} is given twice; only this last one takes effect",
                           "delete one of the two", key=dotted(keys), file=doc.path, line=line)


@check("CFG008", "json-comments", "config", tags=["deepspeed", "json"])
def json_comments(ctx) -> Iterator[Finding]:
    """The DeepSpeed config is plain JSON, which every reader of it takes.

    DeepSpeed reads a config file with hjson, which takes // # and /* */ comments, a comma before } or ] and a
    byte order mark. accelerate's DeepSpeedPlugin, the transformers Trainer (HfDeepSpeedConfig) and Lightning
    read the same file with json.load, whatever its name, which stops on each of these ('Expecting property
    name enclosed in double quotes') on every node as the script starts; and none of them reads a DeepSpeed
    config written in YAML.

    Delete the comments and trailing commas (keep the notes in a README beside the file), and write the
    settings as JSON; or keep such a file only for scripts that read it themselves.
    """
    ds = ds_doc(ctx)
    if ds is None:
        yield skip("no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    if ds.json_load_refusal is None:
        yield passed(f"{ds.path} is plain JSON")
        return
    line, problem = ds.json_load_refusal
    refusal = f"({ds.path}:{line}: {problem.replace('malformed JSON: ', '')})"
    readers = f"accelerate's DeepSpeedPlugin and the transformers Trainer read it with json.load, which stops on it " \
        f"{refusal}"
    if ds.kind == "yaml":
        holds, fix, unless = "is YAML, not JSON", "write it as JSON", "unless the script reads the file itself"
        alone = ("DeepSpeed (hjson), accelerate's DeepSpeedPlugin and the transformers Trainer (json.load) read a "
                 f"DeepSpeed config as JSON whatever its name, and json.load stops on it {refusal}; only a script "
                 "that reads the YAML itself can use it")
    else:
        holds = f"holds {' and '.join(ds.hjson_only)}"
        fix = "delete " + " and ".join("the " + (w[2:] if w.startswith("a ") else w) for w in ds.hjson_only)
        unless = "unless the script hands the file to deepspeed.initialize itself"
        alone = f"DeepSpeed reads it with hjson and takes them, but {readers}"
    if ds_usage(ctx) == "accelerate":
        yield fail(f"{ds.path}: the DeepSpeed config {holds}, and accelerate launches the job: {readers}", fix,
                   **at(ds))
    else:
        yield warn(f"{ds.path}: the DeepSpeed config {holds}: {alone}", f"{fix}, {unless}", **at(ds))
