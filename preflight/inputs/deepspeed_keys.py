"""The keys DeepSpeed's config takes, level by level (DeepSpeed 0.1x): the top-level keys and which of them hold
a block, the blocks whose pydantic models refuse unknown keys, and the keys older releases took. The types of
the values DeepSpeed reads are in preflight.inputs.configs (DS_NUMERIC), for the loader."""
from __future__ import annotations

from preflight.inputs.configs import ACCELERATE_DS_KEYS

# DeepSpeed's top-level keys (deepspeed/runtime/config.py); unknown ones are ignored by DeepSpeed.
DS_TOP_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps managed_gradient_accumulation
steps_per_print wall_clock_breakdown memory_breakdown dump_state disable_python_gc log_level
communication_data_type seq_parallel_communication_data_type seq_parallel_comm_data_type gradient_allreduce_op
prescale_gradients gradient_predivide_factor disable_allgather gradient_clipping zero_optimization
zero_allow_untested_optimizer zero_force_ds_cpu_optimizer optimizer scheduler fp16 bf16 bfloat16 torch_autocast
flops_profiler comms_logger tensorboard wandb csv_monitor comet activation_checkpointing aio autotuning pipeline
data_efficiency dataloader_drop_last hybrid_engine compile tensor_parallel expert_parallel
use_data_before_expert_parallelism datastates_ckpt weight_quantization timers vocabulary_size checkpoint
data_types sequence_parallel_size
""".split())
# Those of them whose value is a block (a mapping), not a number, text or switch.
DS_TOP_BLOCKS = frozenset("""
zero_optimization optimizer scheduler fp16 bf16 bfloat16 torch_autocast flops_profiler comms_logger tensorboard
wandb csv_monitor comet activation_checkpointing aio autotuning pipeline data_efficiency hybrid_engine compile
tensor_parallel expert_parallel datastates_ckpt weight_quantization timers checkpoint data_types
""".split())
# Accepted by older DeepSpeed releases, rejected since 0.19.8.
DS_REMOVED_KEYS = frozenset("""
nebula compression_training amp quantize_training sparse_gradients eigenvalue sparse_attention elasticity
graph_harvesting curriculum_learning progressive_layer_drop
""".split())
# zero_optimization keys of older DeepSpeed releases, rejected since 0.19.8.
DS_REMOVED_ZERO_KEYS = frozenset("mics_shard_size mics_hierarchical_params_gather zeropp_loco_param".split())
# zero_optimization's fields that DeepSpeed also takes under another name (zero/config.py): field -> alias.
ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
# Blocks that DeepSpeed validates with pydantic models that forbid unknown keys.
STRICT_BLOCKS = {
    ("zero_optimization",): frozenset("""
stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce allgather_partitions
allgather_bucket_size overlap_comm load_from_fp32_weights elastic_checkpoint offload_param offload_optimizer
sub_group_size cpu_offload_param cpu_offload_use_pin_memory cpu_offload stage3_gather_fp16_weights_on_model_save
ignore_unused_parameters legacy_stage1 round_robin_gradients zero_hpz_partition_size zero_quantized_weights
zero_quantized_nontrainable_weights zero_quantized_gradients zeropp_loco_param mics_shard_size
mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint override_module_apply
log_trace_cache_warnings enable_sanity_checks compute_grad_norm parameter_alignment
save_muon_momentum_buffer_in_memory zenflow leaf_module
""".split()) | frozenset(ZERO_ALIASES) | frozenset(ZERO_ALIASES.values()),
    ("zero_optimization", "offload_param"): frozenset(
        "device nvme_path buffer_count buffer_size max_in_cpu pin_memory".split()),
    ("zero_optimization", "offload_optimizer"): frozenset("""
device nvme_path buffer_count pin_memory pipeline_read pipeline_write fast_init ratio super_offload
cpuadam_cores_perc
""".split()),
    ("fp16",): frozenset("""
enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis consecutive_hysteresis
min_loss_scale fp16_master_weights_and_grads
""".split()),
    ("bf16",): frozenset(
        "enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads bf16_optimizer_states".split()),
}
# Deprecated spellings DeepSpeed still converts (zero/config.py, new_param): never suggested as a fix.
DS_DEPRECATED_ZERO_KEYS = frozenset(
    "cpu_offload_param cpu_offload_use_pin_memory cpu_offload stage3_gather_fp16_weights_on_model_save".split())
# Keys of DeepSpeed's JSON at any level, as found pasted into accelerate's deepspeed_config section.
DS_JSON_KEYS = (DS_TOP_KEYS | frozenset().union(*STRICT_BLOCKS.values())) - frozenset(ACCELERATE_DS_KEYS)
