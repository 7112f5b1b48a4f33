"""FS: /dev/shm, the checkpoint folder and the NVMe offload folders."""
from __future__ import annotations

from typing import Iterator

from preflight.api import Finding, Status, cause_of, check, fail, passed, skip, warn


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


@check("FS001", "dev-shm", "node", tags=["filesystem", "nccl", "container"],
       reads=["storage.shm"])
def dev_shm(ctx) -> Iterator[Finding]:
    """/dev/shm is large enough and has the room free: fail under 512 MiB (of size, or free), warn under 1 GiB.

    NCCL's shared-memory transport and PyTorch's DataLoader workers allocate in /dev/shm; containers give
    it 64 MB by default, and NCCL then fails with 'unhandled system error' or the DataLoader with 'bus
    error' once training starts. A large /dev/shm filled by the segments of earlier jobs fails the same way.

    Run the container with --shm-size=16g (or --ipc=host), or remount: mount -o remount,size=16G /dev/shm;
    when it is full, remove what killed jobs left there (`ls -la /dev/shm`: nccl-*, torch_*, psm_*).
    """
    shm = (ctx.fact.get("storage") or {}).get("shm") or {}
    if not shm.get("exists"):
        yield fail("/dev/shm does not exist", "mount a tmpfs on /dev/shm (or run the container with --ipc=host)")
        return
    total, free, limits = shm["total_bytes"], shm["free_bytes"], ctx.plan.limits
    evidence = {"total_bytes": total, "free_bytes": free}
    # The same thresholds for what is free as for the size: what the job gets is what is free when it starts.
    # NCCL's SHM transport maps a segment per connection between local ranks, of buffers sized by NCCL_BUFFSIZE
    # (4 MiB by default) for each channel, and each DataLoader keeps prefetch_factor * num_workers batches in
    # shared memory (torch/utils/data/dataloader.py, DataLoader.__init__: prefetch_factor 2 by default;
    # _MultiProcessingDataLoaderIter._reset puts that many in flight): hundreds of MiB per rank for image
    # batches. Under 512 MiB free one of them fails once training starts; under 1 GiB, more workers or a larger
    # batch is one step from it.
    used = f"{gib(free)} free of {gib(total)}"
    clear = "remove what earlier jobs left in /dev/shm (`ls -la /dev/shm`: nccl-*, torch_*, psm_*; first check that " \
            "no process of a running job holds them: `fuser /dev/shm/*`)"
    if total < limits.shm_fail_bytes:
        yield fail(f"/dev/shm is {gib(total)}, expected at least {gib(limits.shm_fail_bytes)}",
                   "give the container --shm-size=16g or --ipc=host, or mount -o remount,size=16G /dev/shm", **evidence)
    elif free < limits.shm_fail_bytes:
        yield fail(f"/dev/shm has {used}, expected at least {gib(limits.shm_fail_bytes)} free: NCCL's shared-memory "
                   "segments and the DataLoader's batches do not fit", clear, **evidence)
    elif total < limits.shm_warn_bytes:
        yield warn(f"/dev/shm is {gib(total)}, under the recommended {gib(limits.shm_warn_bytes)}",
                   "give the container --shm-size=16g or --ipc=host", **evidence)
    elif free < limits.shm_warn_bytes:
        yield warn(f"/dev/shm has {used}, under the recommended {gib(limits.shm_warn_bytes)} free", clear, **evidence)
    else:
        yield passed(f"/dev/shm is {gib(total)} ({gib(free)} free)", **evidence)


def _folder(ctx, key: str, what: str) -> Iterator[Finding]:
    entry = (ctx.fact.get("storage") or {}).get(key)
    if entry is None:
        return
    path = entry["path"]
    if not entry.get("exists"):
        yield fail(f"{what} {path} does not exist", f"create {path} on every node (or correct the path)", path=path)
    elif not entry.get("writable"):
        yield fail(f"{what} {path} is not writable by this user", f"fix the permissions of {path}", path=path)
    elif entry["free_bytes"] < ctx.plan.limits.disk_warn_bytes:
        yield warn(f"{what} {path} has {gib(entry['free_bytes'])} free, under {gib(ctx.plan.limits.disk_warn_bytes)}",
                   f"free space on the filesystem of {path}", path=path, free_bytes=entry["free_bytes"])
    else:
        yield passed(f"{what} {path}: writable, {gib(entry['free_bytes'])} free", path=path,
                     free_bytes=entry["free_bytes"])


@check("FS002", "checkpoint-dir", "node", tags=["filesystem", "checkpoint"],
       reads=["storage"])
def checkpoint_dir(ctx) -> Iterator[Finding]:
    """The checkpoint folder (--checkpoint-dir) exists, is writable and has free space (warn under 10 GiB).

    The first checkpoint is written hours into the run: a missing, read-only or full folder loses those
    hours.

    Create the folder on every node (or on the shared filesystem), fix its permissions, or free space.
    """
    if not ctx.plan.checkpoint_dir:
        yield skip("no --checkpoint-dir given")
        return
    yield from _folder(ctx, "checkpoint_dir", "the checkpoint folder")


@check("FS003", "offload-path", "node", tags=["filesystem", "deepspeed", "offload"],
       reads=["storage"])
def offload_path(ctx) -> Iterator[Finding]:
    """The nvme_path of DeepSpeed's parameter and optimizer offload exists, is writable and has free space.

    DeepSpeed creates its swap files there when the engine starts; a missing folder fails on that node,
    a small one fails when the swap files grow.

    Create nvme_path on a local NVMe drive of every node, writable by the training user.
    """
    paths = ctx.plan.paths
    keys = [k for k in ("offload_param.nvme_path", "offload_optimizer.nvme_path") if k in paths]
    if not keys:
        yield skip("the DeepSpeed config offloads nothing to NVMe" if ctx.plan.deepspeed is not None else
                   "no DeepSpeed config given (--deepspeed, or deepspeed_config_file in the accelerate config)")
        return
    for key in keys:
        yield from _folder(ctx, key, f"DeepSpeed's {key}")


@check("FS004", "shared-dir", "cluster", tags=["filesystem", "shared"])
def shared_dir(ctx) -> Iterator[Finding]:
    """With --shared-dir, a token the head writes into that folder is read back, the same, by every node.

    Jobs that write checkpoints or datasets to a shared filesystem assume every node sees the same files:
    a node where it is not mounted (or mounted stale) writes its shard to local disk and the checkpoint
    is silently incomplete.

    Mount the shared filesystem on every node at the same path (check `findmnt PATH` on the odd node).
    """
    probe = (ctx.probes or {}).get("shared_dir")
    if probe is None:
        yield skip("no --shared-dir given")
        return
    head, write = probe["head"], probe.get("write")
    if write is None:
        yield skip(f"the head {head} was not reached", blocked_by=cause_of(ctx, head))
        return
    if not write.get("ok"):
        yield Finding(Status.FAIL, f"cannot write into {probe['path']}: {write.get('error')}",
                      f"make {probe['path']} writable on {head}", nodes=(head,))
        return
    seen = [head]
    for node, answer in sorted(probe["nodes"].items()):
        if answer.get("ok"):
            seen.append(node)
        else:
            yield Finding(Status.FAIL, f"does not see the file the head wrote in {probe['path']}: {answer.get('error')}",
                          f"mount the shared filesystem at {probe['path']} on this node", nodes=(node,))
    yield Finding(Status.PASS, f"{probe['path']} is shared", nodes=tuple(seen))

