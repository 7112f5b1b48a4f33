"""Will it fit: the memory a model needs as the job shards it (the MEM checks): DeepSpeed's ZeRO stage and
offload, FSDP's sharding strategy and parameter offload, or DDP (nothing sharded), and the precision.

Pure functions over the model (preflight.inputs.models). The ZeRO figures are DeepSpeed's own estimators
(deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs and
stage3.estimate_zero3_model_states_mem_needs), written out here so that a lint needs no DeepSpeed import;
the MEM tests hold them equal to the installed DeepSpeed. FSDP and DDP have no estimator of their own: their
figures are written out in fsdp_needs and DDP_BYTES.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

from preflight.inputs.models import Model

BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor default
# Activations per token, layer and hidden unit, in bytes, 16-bit (Korthikanti et al. 2022, flash attention:
# no s^2 term): 34 without recomputation; with activation checkpointing each layer keeps its input, 2.
ACTIVATION_BYTES, CHECKPOINTED_BYTES = 34, 2
# FSDP's strategies (torch.distributed.fsdp.ShardingStrategy, numbered 1..5 in this order), and the number of
# ranks each shards the states over: all of them, one (NO_SHARD), or the GPUs of one node (the hybrids shard
# within a node and replicate across nodes: torch/distributed/fsdp/_init_utils.py _init_intra_node_process_group).
FSDP_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
# Strategies that keep the gathered parameters from the forward to the backward (no reshard after forward).
KEEPS_GATHERED = ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
# FSDP's sharded states: fp32 weights (accelerate upcasts them under mixed precision, utils/fsdp_utils.py and
# accelerator.py), fp32 gradients and Adam's exp_avg and exp_avg_sq: 16 bytes a parameter.
FSDP_STATE_BYTES = 16
# DDP: every rank holds the fp32 weights, their gradients, the reducer's gradient buckets (a second copy of the
# gradients unless gradient_as_bucket_view, torch/nn/parallel/distributed.py) and Adam's two states.
DDP_BYTES = 4 + 4 + 4 + 8


# --- DeepSpeed's estimators -----------------------------------------------------------------------------

def zero2_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
                additional_buffer_factor: float = BUFFER_FACTOR) -> Tuple[int, int]:
    """(host bytes per node, GPU bytes per GPU): estimate_zero2_model_states_mem_needs, line for line."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def zero3_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                cpu_offload: bool = True, cpu_offload_params: bool = True, zero_init: bool = True,
                additional_buffer_factor: float = BUFFER_FACTOR) -> Tuple[int, int, int]:
    """(host bytes per node, GPU bytes per GPU, largest layer bytes): estimate_zero3_model_states_mem_needs."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


# --- the estimate ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """How the job trains: what the estimate depends on."""

    stage: int = 0
    offload_optimizer: str = "none"  # none, cpu, nvme
    offload_param: str = "none"
    gpus_per_node: int = 1
    nodes: int = 1
    zero_init: bool = False  # at stage 3, build the model partitioned (zero.Init; accelerate's zero3_init_flag)
    weight_bytes: int = 2  # 2: bf16/fp16 training (what DeepSpeed's estimators assume), 4: fp32
    micro_batch: Optional[int] = None
    seq_len: Optional[int] = None
    # How the job shards: "zero" (DeepSpeed, by `stage`), "ddp" (nothing sharded), or an FSDP strategy
    # (FSDP_STRATEGIES; offload_param "cpu" is fsdp_offload_params).
    sharding: str = "zero"
    fsdp_version: int = 1  # FSDP2 says its strategy with fsdp_reshard_after_forward
    one_copy_per_node: bool = False  # FSDP's cpu_ram_efficient_loading: local rank 0 alone loads the weights

    @property
    def fsdp(self) -> bool:
        return self.sharding in FSDP_STRATEGIES

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP shards the states over."""
        if self.sharding == "NO_SHARD":
            return 1
        if self.sharding in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
            return self.gpus_per_node
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        counts = f", {self.gpus_per_node} GPU(s) per node x {self.nodes} node(s)"
        if self.sharding == "ddp":
            return "DDP (every GPU holds the whole model, its gradients and optimizer states)" + counts
        if self.fsdp:
            name = self.sharding if self.fsdp_version == 1 else (
                f"reshard_after_forward {'false' if self.sharding in KEEPS_GATHERED else 'true'}")
            return (f"FSDP{self.fsdp_version if self.fsdp_version != 1 else ''} {name}" +
                    (", offload parameters to the CPU" if self.offload_param != "none" else "") + counts)
        offload = [f"{what} to {dev}" for what, dev in (("optimizer", self.offload_optimizer),
                                                        ("parameters", self.offload_param)) if dev != "none"]
        return (f"ZeRO stage {self.stage}" + (f", offload {' and '.join(offload)}" if offload else "") + counts)


@dataclass(frozen=True)
class Need:
    gpu: int  # model states per GPU (DeepSpeed's per-GPU figure)
    host: int  # host RAM per node: the larger of DeepSpeed's per-CPU figure and loading the model
    states_host: int  # DeepSpeed's per-CPU (per node) figure: an upper bound, with its buffer factor
    load: int  # host RAM per node to load the model
    offloaded: int  # host RAM per node the states offloaded to the CPU take (offloaded_share)
    certain: int  # host RAM per node the job surely needs: the larger of loading and the offloaded states
    nvme_optimizer: int  # NVMe bytes per node at offload_optimizer.nvme_path
    nvme_param: int  # NVMe bytes per node at offload_param.nvme_path
    activations: Optional[int]  # per GPU, without activation checkpointing; None when unknown
    checkpointed: Optional[int]  # per GPU, with activation checkpointing


def offloaded_share(params: int, setup: Setup) -> int:
    """Host bytes per node that the states offloaded to the CPU surely take. Each rank keeps its 1/N partition
    on the CPU, so a node holds G/N = 1/M of them: at stages 1-2 (stage_1_and_2.py, where device nvme is CPU
    offload too) the fp32 master weights, Adam's exp_avg and exp_avg_sq and the fp32 gradients, 16 bytes a
    parameter; at stage 3 the same with the optimizer on the CPU, and the 16-bit parameters (2 bytes) with
    offload_param on the CPU. DeepSpeed's per-node figure (P·max(4N, 16)·1.5 at stage 2) is an upper bound
    that grows with the node count; this is what the job cannot run without."""
    per_param = 0
    if setup.stage in (1, 2) and setup.offload_optimizer != "none":
        per_param = 16
    elif setup.stage >= 3:
        per_param = (16 if setup.offload_optimizer == "cpu" else 0) + (2 if setup.offload_param == "cpu" else 0)
    return per_param * params // setup.nodes


def fsdp_needs(model: Model, setup: Setup) -> Tuple[int, int]:
    """(GPU bytes per GPU, host bytes per node offloaded) under FSDP: the 16 bytes a parameter of sharded states
    over the ranks the strategy shards across; the largest layer gathered whole in the compute precision with
    its unsharded gradient; with SHARD_GRAD_OP (FSDP2: reshard_after_forward false) every gathered layer kept
    from the forward to the backward. fsdp_offload_params moves the sharded states to the CPU (CPUOffload: the
    parameters, their gradients and the optimizer step)."""
    states = FSDP_STATE_BYTES * model.params // setup.shard_ranks
    gathered = 2 * setup.weight_bytes * model.largest_layer
    kept = setup.weight_bytes * model.params if setup.sharding in KEEPS_GATHERED and setup.shard_ranks > 1 else 0
    if setup.offload_param != "none":
        return gathered + kept, states * setup.gpus_per_node
    return states + gathered + kept, 0


def estimate(model: Model, setup: Setup) -> Need:
    """The memory the job needs. Stages 2 and 3 are DeepSpeed's estimators; DeepSpeed has none for 0 and 1:
    stage 0 is stage 2's formula for one GPU (nothing sharded: 2 + 18 bytes a parameter), stage 1 shards
    only the 16 bytes of fp32 weights and Adam states, the 16-bit weights and gradients stay whole
    (2 + 2 + 16/N); its optimizer offload moves those 16 bytes to the CPU and keeps the 16-bit weights and
    gradients on the GPU (stage_1_and_2.py: cpu_offload moves the fp32 partition and the optimizer, stage 1
    reduces whole gradients). Offload to NVMe counts as offload for the GPU; its states go to the NVMe
    (16 bytes a parameter for the optimizer, 2 for the parameters, split over the nodes) instead of host RAM.
    FSDP is fsdp_needs; DDP holds DDP_BYTES a parameter on every GPU. Neither has DeepSpeed's host figure:
    the host needs what loading takes and what FSDP offloads."""
    p, gpn, nodes = model.params, setup.gpus_per_node, setup.nodes
    if setup.sharding != "zero":
        gpu, offloaded = fsdp_needs(model, setup) if setup.fsdp else (DDP_BYTES * p, 0)
        load = (1 if setup.fsdp and setup.one_copy_per_node else gpn) * p * setup.weight_bytes
        return Need(gpu, max(load, offloaded), offloaded, load, offloaded, max(load, offloaded), 0, 0,
                    *activations(model, setup))
    opt, par = setup.offload_optimizer != "none", setup.offload_param != "none"
    if setup.stage >= 3:
        host, gpu, _ = zero3_needs(p, model.largest_layer, gpn, nodes, opt, opt and par, setup.zero_init)
    elif setup.stage == 2:
        host, gpu = zero2_needs(p, gpn, nodes, opt)
    elif setup.stage == 1:
        host, gpu = zero2_needs(p, gpn, nodes, opt)
        gpu = 4 * p + (0 if opt else int(16 * p / (gpn * nodes)))  # 16-bit weights and whole gradients stay
    else:
        host, gpu = zero2_needs(p, 1, 1, False)[0] * gpn, zero2_needs(p, 1, 1, False)[1]
    nvme_optimizer = 16 * p // nodes if setup.stage >= 3 and setup.offload_optimizer == "nvme" else 0
    nvme_param = 2 * p // nodes if setup.stage >= 3 and opt and setup.offload_param == "nvme" else 0
    nvme = nvme_optimizer + nvme_param
    if nvme:  # what goes to the NVMe is not held in host RAM; DeepSpeed's buffers stay
        floor = zero3_needs(p, model.largest_layer, gpn, nodes, False, False, True)[0]
        host = max(floor, int(host - nvme * BUFFER_FACTOR))
    load = (1 if setup.stage >= 3 and setup.zero_init else gpn) * p * setup.weight_bytes
    offloaded = offloaded_share(p, setup)
    return Need(gpu, max(host, load), host, load, offloaded, max(load, offloaded), nvme_optimizer, nvme_param,
                *activations(model, setup))


def activations(model: Model, setup: Setup) -> Tuple[Optional[int], Optional[int]]:
    """Activations per GPU (without, with activation checkpointing); None when the batch or the shape is unknown."""
    if not (setup.micro_batch and setup.seq_len and model.layers and model.hidden):
        return None, None
    tokens = setup.micro_batch * setup.seq_len * model.layers * model.hidden
    return tokens * ACTIVATION_BYTES, tokens * CHECKPOINTED_BYTES


def fsdp_changes(setup: Setup):
    """FSDP's changes, least speed lost first: a strategy that shards more (the hybrids only across nodes, and
    FSDP2 only by fsdp_reshard_after_forward), parameter offload, more nodes. DDP's: FSDP."""
    if setup.sharding == "ddp":
        for name in ("SHARD_GRAD_OP", "FULL_SHARD"):
            yield f"FSDP (distributed_type: FSDP, fsdp_sharding_strategy: {name})", replace(setup, sharding=name)
        yield ("FSDP with fsdp_offload_params: true (distributed_type: FSDP, FULL_SHARD)",
               replace(setup, sharding="FULL_SHARD", offload_param="cpu"))
        return
    order = ["NO_SHARD", "_HYBRID_SHARD_ZERO2", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD"]
    for name in order[order.index(setup.sharding) + 1:]:
        if setup.fsdp_version == 2 and name not in ("SHARD_GRAD_OP", "FULL_SHARD"):
            continue  # FSDP2's sharding is fully_shard's; hybrid sharding needs a 2-D device mesh
        if name.startswith("_HYBRID") or name == "HYBRID_SHARD":
            if setup.nodes == 1:
                continue  # within one node a hybrid is the plain strategy
        what = (f"fsdp_reshard_after_forward: {'false' if name in KEEPS_GATHERED else 'true'}"
                if setup.fsdp_version == 2 else f"fsdp_sharding_strategy: {name.lstrip('_')}")
        yield what, replace(setup, sharding=name)
    if setup.offload_param == "none":
        yield "fsdp_offload_params: true", replace(setup, offload_param="cpu")
    if setup.shard_ranks == setup.gpus_per_node * setup.nodes and setup.shard_ranks > 1:
        for nodes in (2 * setup.nodes, 4 * setup.nodes, 8 * setup.nodes):
            yield f"{nodes} nodes", replace(setup, nodes=nodes)


def changes(setup: Setup):
    """The changes that lower the GPU's or the host's share, cheapest first (the least training speed lost first):
    (what to do, setup). A move to stage 3 keeps the job's zero3_init_flag (true unless it says false). A job
    without DeepSpeed gets FSDP's changes, never a ZeRO stage."""
    if setup.sharding != "zero":
        yield from fsdp_changes(setup)
        return
    if setup.stage >= 3 and not setup.zero_init:
        yield "zero3_init_flag: true (each rank builds only its part of the model)", replace(setup, zero_init=True)
    if setup.gpus_per_node * setup.nodes > 1:  # on one GPU a stage shards nothing (DeepSpeed's stage-3 figure
        for stage in range(setup.stage + 1, 4):  # drops the 16-bit gradients, which the GPU still holds)
            yield f"ZeRO stage {stage}", replace(setup, stage=stage)
    if setup.offload_optimizer == "none":  # DeepSpeed offloads from stage 1 on; stage 2 shards the gradients too
        yield ("ZeRO stage 2 with optimizer offload to the CPU" if setup.stage == 0 else "optimizer offload to the CPU",
               replace(setup, stage=setup.stage or 2, offload_optimizer="cpu"))
    if setup.offload_param == "none":
        yield "parameter and optimizer offload to the CPU (stage 3)", replace(
            setup, stage=3, offload_optimizer=setup.offload_optimizer if setup.offload_optimizer != "none" else "cpu",
            offload_param="cpu")
    if setup.stage >= 1 and setup.offload_optimizer != "none":  # back on the GPU, when the host is short
        yield "no optimizer offload", replace(setup, offload_optimizer="none", offload_param="none")
    if setup.stage >= 1:
        for nodes in (2 * setup.nodes, 4 * setup.nodes, 8 * setup.nodes):
            yield f"{nodes} nodes", replace(setup, nodes=nodes)


def cheapest(model: Model, setup: Setup, gpu_bytes: Optional[int], host_bytes: Optional[int]):
    """The first change whose need fits `gpu_bytes` per GPU and `host_bytes` per node (the host RAM it surely
    needs, as the checks judge): (what, need) or None."""
    for what, changed in changes(setup):
        need = estimate(model, changed)
        if (gpu_bytes is None or need.gpu <= gpu_bytes) and (host_bytes is None or need.certain <= host_bytes):
            return what, need
    return None


def gib(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def count_text(n: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}".replace(".00", "")
    return str(n)
