"""SYS: process limits and memory."""
from __future__ import annotations

from typing import Iterator

from preflight.api import Finding, check, fail, passed, skip, warn


@check("SYS001", "open-files", "node", tags=["limits"],
       reads=["limits"])
def open_files(ctx) -> Iterator[Finding]:
    """The open-files limit (ulimit -n) is at least 4096.

    Every rank holds sockets to its peers, NCCL and gloo open more per channel, and DataLoader workers
    share tensors through file descriptors: the default 1024 runs out on large jobs with 'Too many open
    files'.

    Raise the soft limit (`ulimit -n 65536` in the job script, or nofile in /etc/security/limits.conf).
    """
    soft, hard = (ctx.fact.get("limits") or {}).get("nofile", [None, None])
    need = ctx.plan.limits.nofile_warn
    if soft is not None and soft < need:
        yield warn(f"open-files limit is {soft}, under {need}", f"ulimit -n {hard if hard else 65536} in the job script",
                   soft=soft, hard=hard)
    else:
        yield passed(f"open-files limit is {soft if soft is not None else 'unlimited'}", soft=soft, hard=hard)


@check("SYS002", "locked-memory", "node", tags=["limits", "rdma"],
       reads=["host.rdma_devices", "limits"])
def locked_memory(ctx) -> Iterator[Finding]:
    """On nodes with RDMA devices, the locked-memory limit (ulimit -l) is unlimited.

    InfiniBand and RoCE register (pin) the buffers NCCL sends from; a small memlock limit makes NCCL fall
    back to sockets or fail with 'ibv_reg_mr failed'.

    Set memlock unlimited (`ulimit -l unlimited`, memlock in /etc/security/limits.conf, or
    LimitMEMLOCK=infinity for slurmd and containers).
    """
    devices = (ctx.fact.get("host") or {}).get("rdma_devices") or []
    if not devices:
        yield skip("no RDMA device on this node")
        return
    soft, hard = (ctx.fact.get("limits") or {}).get("memlock", [None, None])
    if soft is not None:
        yield warn(f"locked-memory limit is {soft // 1024} KiB with RDMA devices {', '.join(devices)}",
                   "ulimit -l unlimited (and memlock unlimited in /etc/security/limits.conf)", soft=soft, hard=hard)
    else:
        yield passed(f"locked memory unlimited for {', '.join(devices)}")


@check("SYS003", "free-memory", "node", tags=["memory", "offload"],
       reads=["memory"])
def free_memory(ctx) -> Iterator[Finding]:
    """The node has memory available: fail under 1 GiB; with DeepSpeed CPU offload, warn when under a
    quarter of its memory is available.

    CPU offload keeps optimizer states (and with offload_param the parameters) in host memory, pinned;
    a node already short of memory is killed by the OOM killer mid-run, with little said.

    Stop what holds the memory on that node, or offload less (offload_param to nvme, or no offload).
    """
    memory = ctx.fact.get("memory") or {}
    total, available = memory.get("total_bytes"), memory.get("available_bytes")
    if not total or available is None:
        yield skip("memory size unknown")
        return
    evidence = {"total_bytes": total, "available_bytes": available}
    shown = f"{available / 2**30:.1f} GiB of {total / 2**30:.1f} GiB available"
    if available < 2**30:
        yield fail(f"only {shown}", "free memory on this node before the job starts", **evidence)
    elif available < total / 4 and _cpu_offload(ctx.plan):  # the config only when it matters: once per node
        yield warn(f"{shown}, with DeepSpeed CPU offload configured", "free memory, or offload less", **evidence)
    else:
        yield passed(shown, **evidence)


def _cpu_offload(plan) -> bool:
    ds = plan.deepspeed
    return ds is not None and any(
        ds.get("zero_optimization", block, "device") == "cpu" for block in ("offload_param", "offload_optimizer"))
