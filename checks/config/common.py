"""What the CFG checks share: evidence that points at a file and line, the spelling suggestions for unknown
keys, and the plan's documents as accelerate and DeepSpeed read them (which DeepSpeed section is live, who
reads the DeepSpeed JSON, which dynamo backend a launch reads). No checks here."""
from __future__ import annotations

import difflib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from preflight.api import Finding
from preflight.inputs.documents import Document, shorten


def at(doc: Document, *keys: Any) -> dict:
    """Evidence that points at a file and line."""
    return {"file": doc.path, "line": doc.line(*keys)}


def dotted(keys: Sequence[Any]) -> str:
    return ".".join(str(k) for k in keys)


def did_you_mean(value: Any, options: Sequence[str]) -> str:
    if not isinstance(value, str):
        return ""
    exact = [o for o in options if o.lower() == value.lower()]
    close = exact or difflib.get_close_matches(value, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


MAX_SUGGESTED = 20  # unknown keys of a section looked at one by one; past them, one finding says how many more


def unknown(keys: Iterator[Any], known) -> Tuple[List[Any], List[Any]]:
    """The keys not in `known`: the first MAX_SUGGESTED (each matched against the known spellings) and the rest
    (counted only: a config with tens of thousands of keys stays linear)."""
    found = [k for k in keys if k not in known]
    return found[:MAX_SUGGESTED], found[MAX_SUGGESTED:]


def more_unknown(doc: Document, keys: Sequence[Any], rest: List[Any], make, consequence: str) -> Finding:
    """One finding for the unknown keys past the first MAX_SUGGESTED, at the first of them."""
    first = keys + (rest[0],)
    shown = ", ".join(repr(dotted(keys + (k,))) for k in rest[:3])
    return make(f"{doc.where(*first)}: {len(rest)} more unknown keys ({shown}, ...), not matched against the known "
                f"spellings; {consequence}", "delete the keys that are not for another tool", count=len(rest),
                **at(doc, *first))


def yaml_word(value: Any) -> str:
    """A value as YAML writes it, for a message: null, true, false, or the value quoted (and shortened)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else shorten(value)


def accel_doc(ctx) -> Optional[Document]:
    return ctx.plan.accelerate.doc if ctx.plan.accelerate is not None else None


def ds_doc(ctx) -> Optional[Document]:
    return ctx.plan.deepspeed.doc if ctx.plan.deepspeed is not None else None


def live_ds_section(ctx) -> Optional[Document]:
    """accelerate's deepspeed_config section when accelerate reads it (distributed_type DEEPSPEED), else None."""
    doc = accel_doc(ctx)
    if doc is None or not ctx.plan.accelerate.uses_deepspeed:
        return None
    return doc.section("deepspeed_config")


def accelerate_command(ctx):
    """The launch command when it is `accelerate launch` (preflight.inputs.launchcmd.LaunchCommand), else None."""
    command = ctx.plan.launch
    return command if command is not None and command.launcher == "accelerate" else None


def dynamo_backend_read(ctx, doc: Document) -> Optional[Tuple[Tuple[str, ...], Any]]:
    """The dynamo backend accelerate launch reads from the config, as (key path, value), or None: the top-level
    dynamo_backend, else dynamo_config's (config_args.py moves the first into the second); a --dynamo_backend flag
    wins, and DeepSpeed's launcher never reads it (utils/launch.py upper()s it in the simple, multi-GPU and TPU
    launchers only)."""
    command = accelerate_command(ctx)
    if command is not None and "dynamo_backend" in command.options:
        return None
    if ctx.plan.accelerate.uses_deepspeed and not ctx.plan.accelerate.cpu:
        return None
    for keys in (("dynamo_backend",), ("dynamo_config", "dynamo_backend")):
        holder = doc.section(*keys[:-1]) if len(keys) > 1 else doc
        if holder is not None and holder.data.get(keys[-1]) is not None:
            return keys, holder.data[keys[-1]]
    return None


def ds_usage(ctx) -> str:
    """Who reads the DeepSpeed JSON: "accelerate" (an accelerate config or command names it), "deepspeed"
    (DeepSpeed's runner alone), or "unknown" (only --deepspeed: the HF Trainer, Lightning, a script)."""
    plan = ctx.plan
    if plan.accelerate is not None and plan.accelerate.uses_deepspeed and plan.deepspeed_file_named:
        return "accelerate"
    if plan.launch is not None:
        launcher = plan.launch.launcher
        if launcher == "accelerate" and plan.accelerate is not None and plan.accelerate.uses_deepspeed:
            return "accelerate"
        if launcher == "deepspeed":
            return "deepspeed"
    return "unknown"


def from_shell(text: str) -> bool:
    """Whether a value of the launch command is left for the node's shell to fill in ($VAR, `cmd`)."""
    return "$" in text or "`" in text


def command_unknown(ctx) -> bool:
    """No launch command is known (`lint --config` alone, `node`): its flags may still give or override what the
    file leaves out, so a value missing from the file is not judged, and one the flag would replace only warned."""
    return ctx.plan.launch is None


def files_unknown(ctx) -> bool:
    """`lint` reads no node: a file the config names relative to the job's folder (or on the cluster) is not known
    to be missing from here."""
    return not ctx.plan.nodes
