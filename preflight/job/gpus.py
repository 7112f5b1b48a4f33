"""The GPUs a job uses on a node, from the node's NVML facts and the plan: whether the job needs GPUs at all,
which of the node's GPUs gpu_ids or CUDA_VISIBLE_DEVICES choose, and what is wrong with that choice. The GPU
and MEM checks read a node's GPUs through these; no I/O here."""
from __future__ import annotations

from typing import List, Optional, Tuple

from preflight.inputs.settings import gpu_id_list
from preflight.result import Finding, fail, skip, warn

GPU_DISTRIBUTED_TYPES = ("MULTI_GPU", "DEEPSPEED", "FSDP")


def gpus_of(facts: dict) -> Optional[dict]:
    """A node's GPU facts when NVML answered there, else None."""
    gpus = facts.get("gpus") or {}
    return gpus if gpus.get("available") else None


def no_gpus_reason(facts: dict) -> str:
    gpus = facts.get("gpus") or {}
    return gpus.get("reason") or gpus.get("error") or "the collector reported no GPU facts"


def needs_gpus(plan) -> Optional[str]:
    """Why the job needs GPUs on every node, or None when the plan does not say it does."""
    if plan.deepspeed is not None:
        return f"a DeepSpeed config ({plan.deepspeed.doc.path})"
    accel = plan.accelerate
    kind = accel.data.get("distributed_type") if accel is not None else None
    if kind in GPU_DISTRIBUTED_TYPES and not accel.data.get("use_cpu"):
        return f"distributed_type {kind} in {accel.doc.path}"
    return None


def selection(ctx, gpus: dict) -> Tuple[List[dict], int, str, List[Finding]]:
    """_selection of the node's own GPUs, once per node however many checks ask (the GPU, MEM and RDMA checks
    do, about nine of them); callers do not change what it returns."""
    if gpus is ctx.fact.get("gpus"):
        return ctx.memo(selection, lambda: _selection(ctx, gpus))
    return _selection(ctx, gpus)


def _selection(ctx, gpus: dict) -> Tuple[List[dict], int, str, List[Finding]]:
    """The GPUs the job will use on this node, how many CUDA devices that is, how they are chosen, and
    what is wrong with the choice. accelerate launch sets CUDA_VISIBLE_DEVICES to gpu_ids when gpu_ids
    is not 'all'; otherwise the node's CUDA_VISIBLE_DEVICES (as SLURM sets it) decides; else all GPUs.
    NVML numbers GPUs in PCI order, as CUDA does for identical GPUs."""
    devices = gpus.get("devices") or []
    by_index = {d["index"]: d for d in devices}
    have = f"this node has {len(devices)} GPU(s)" + (f" (0-{len(devices) - 1})" if devices else "")
    visible = (ctx.fact.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    accel = ctx.plan.accelerate
    raw_ids = accel.data.get("gpu_ids") if accel is not None else None
    ids = gpu_id_list(raw_ids)
    problems: List[Finding] = []
    if ids is not None and all(i.isdigit() for i in ids):
        chosen = [by_index[int(i)] for i in ids if int(i) in by_index]
        for missing in [i for i in ids if int(i) not in by_index]:
            problems.append(fail(f"gpu_ids {raw_ids!r} names GPU {missing}, but {have}",
                                 f"list only existing GPUs in gpu_ids (in {accel.doc.path}), or set gpu_ids: all",
                                 gpu_ids=str(raw_ids), count=len(devices)))
        if visible is not None and visible.replace(" ", "") != ",".join(ids):
            problems.append(warn(f"CUDA_VISIBLE_DEVICES is {visible!r} here, but accelerate launch replaces it with "
                                 f"gpu_ids {','.join(ids)!r}: the job uses GPUs {','.join(ids)}, not the ones this "
                                 "environment selects", "make gpu_ids match the GPUs the node gives the job, or set "
                                 "gpu_ids: all", cuda_visible_devices=visible, gpu_ids=str(raw_ids)))
        return chosen, len(chosen), f"gpu_ids {','.join(ids)}", problems
    if visible is None:
        return list(devices), len(devices), "all GPUs", problems
    entries = [e.strip() for e in visible.split(",")] if visible.strip() else []
    if any(e.startswith("MIG-") for e in entries):  # MIG instances: their parents are the GPUs in MIG mode
        parents = [d for d in devices if d.get("mig_enabled")]
        if not parents:
            problems.append(fail(f"CUDA_VISIBLE_DEVICES={visible!r} names MIG instances, but no GPU here has MIG "
                                 "mode on", "set CUDA_VISIBLE_DEVICES to this node's GPUs, or unset it",
                                 cuda_visible_devices=visible))
        return parents, len(entries) if parents else 0, f"CUDA_VISIBLE_DEVICES={visible}", problems
    chosen = []
    for entry in entries:
        match = by_index.get(int(entry)) if entry.isdigit() else next(
            (d for d in devices if entry.startswith("GPU-") and (d.get("uuid") or "").startswith(entry)), None)
        if match is None:  # CUDA stops at the first entry it cannot use
            problems.append(fail(f"CUDA_VISIBLE_DEVICES={visible!r} names {entry!r}, which is no GPU here ({have}): "
                                 "CUDA ignores it and every entry after it",
                                 "set CUDA_VISIBLE_DEVICES to indices or UUIDs of this node's GPUs, or unset it",
                                 cuda_visible_devices=visible, count=len(devices)))
            break
        chosen.append(match)
    return chosen, len(chosen), f"CUDA_VISIBLE_DEVICES={visible}", problems


def job_gpus(ctx) -> Tuple[Optional[List[dict]], Optional[Finding]]:
    """The GPUs the job uses on this node, or a skip that says why there are none to check."""
    gpus = gpus_of(ctx.fact)
    if gpus is None:
        also = " (GPU001 fails: the job needs GPUs)" if needs_gpus(ctx.plan) else ""
        return None, skip(f"no GPU facts on this node: {no_gpus_reason(ctx.fact)}{also}")
    chosen = selection(ctx, gpus)[0]
    if not chosen:
        return None, skip("the job uses no GPU on this node")
    return chosen, None
