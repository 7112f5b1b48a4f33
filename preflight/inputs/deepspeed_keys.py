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
# Keys and optimizers older DeepSpeed releases took, each with the first release that refuses it: DeepSpeedConfig
# raises DeepSpeedConfigError on the key (runtime/config.py, _reject_removed_config_keys over
# _REMOVED_TOP_LEVEL_CONFIG_KEYS and _REMOVED_ZERO_CONFIG_KEYS), and the engine stops on an optimizer no longer in
# DEEPSPEED_OPTIMIZERS ("... is not a supported DeepSpeed Optimizer", engine.py _do_sanity_check). From the
# released sources of each version: 0.19.6 refuses none and builds the 1-bit optimizers, 0.19.7 is the first
# without them and with the lists, 0.19.8 adds the rest.
DS_REMOVED_KEYS_SINCE = {
    "nebula": "0.19.7", "compression_training": "0.19.7", "quantize_training": "0.19.7", "sparse_attention": "0.19.7",
    "amp": "0.19.8", "sparse_gradients": "0.19.8", "eigenvalue": "0.19.8", "elasticity": "0.19.8",
    "graph_harvesting": "0.19.8", "curriculum_learning": "0.19.8", "progressive_layer_drop": "0.19.8",
}
DS_REMOVED_ZERO_KEYS_SINCE = {
    "mics_shard_size": "0.19.7", "mics_hierarchical_params_gather": "0.19.7", "zeropp_loco_param": "0.19.8",
}
# optimizer.type, as DeepSpeed compares it (lower-cased): OneBitAdam, ZeroOneAdam, OneBitLamb.
DS_REMOVED_OPTIMIZERS_SINCE = {"onebitadam": "0.19.7", "zerooneadam": "0.19.7", "onebitlamb": "0.19.7"}
DS_REMOVED_KEYS = frozenset(DS_REMOVED_KEYS_SINCE)
DS_REMOVED_ZERO_KEYS = frozenset(DS_REMOVED_ZERO_KEYS_SINCE)
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
# The blocks DeepSpeed reads with its pydantic models (DeepSpeedConfigModel, extra="forbid" in
# runtime/config_utils.py), each with the keys its model takes (field names and aliases; nested models are blocks
# of their own): an unknown key there stops DeepSpeedConfig ("Extra inputs are not permitted"). Read as
# DeepSpeedConfig._initialize_params reads them (runtime/config.py): get_zero_config (zero/config.py,
# offload_config.py, leaf_module_config.py, zenflow/zenflow_config.py), get_float16_config and get_bfloat16_config
# (precision_config.py; bfloat16 only without bf16), DeepSpeedCommsConfig (comm/config.py, only with comms_logger),
# get_monitor_config (monitor/config.py), get_hybrid_engine_config, WeightQuantConfig (inference/config.py),
# CompileConfig (compile/config.py), get_timers_config (utils/config.py: timers.throughput alone),
# get_tensor_parallel_config (tensor_parallel/config.py). The other blocks (optimizer, scheduler, aio, checkpoint,
# activation_checkpointing, flops_profiler, autotuning, data_efficiency, pipeline, expert_parallel, ...) are read
# key by key with .get: unknown keys there are ignored. tests/checks/test_cfg_deepspeed_schema.py holds this
# table to the installed DeepSpeed's models.
_TP = frozenset("tp_size tp_grain_size mpu tp_group".split())
_MONITOR = frozenset("enabled output_path job_name".split())
_BF16 = frozenset("enabled immediate_grad_update check_grad_overflow bf16_master_weights_and_grads "
                  "bf16_optimizer_states".split())
STRICT_BLOCKS = {
    ("zero_optimization",): frozenset("""
stage contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce allgather_partitions
allgather_bucket_size overlap_comm load_from_fp32_weights elastic_checkpoint offload_param offload_optimizer
sub_group_size cpu_offload_param cpu_offload_use_pin_memory cpu_offload stage3_gather_fp16_weights_on_model_save
ignore_unused_parameters legacy_stage1 round_robin_gradients zero_hpz_partition_size zero_quantized_weights
zero_quantized_nontrainable_weights zero_quantized_gradients memory_efficient_linear pipeline_loading_checkpoint
override_module_apply log_trace_cache_warnings enable_sanity_checks compute_grad_norm parameter_alignment
save_muon_momentum_buffer_in_memory zenflow leaf_module
""".split()) | frozenset(ZERO_ALIASES) | frozenset(ZERO_ALIASES.values()),
    ("zero_optimization", "offload_param"): frozenset(
        "device nvme_path buffer_count buffer_size max_in_cpu pin_memory".split()),
    ("zero_optimization", "offload_optimizer"): frozenset("""
device nvme_path buffer_count pin_memory pipeline_read pipeline_write fast_init ratio super_offload
cpuadam_cores_perc
""".split()),
    ("zero_optimization", "leaf_module"): frozenset("classes names name_suffixes".split()),
    ("zero_optimization", "zenflow"): frozenset("""
topk_ratio select_strategy select_interval update_interval overlap_step offload auto_ratio full_warm_up_rounds
steps_per_epoch pt_reserved_cores_perc
""".split()),
    ("fp16",): frozenset("""
enabled auto_cast loss_scale initial_scale_power loss_scale_window hysteresis consecutive_hysteresis
min_loss_scale fp16_master_weights_and_grads
""".split()),
    ("bf16",): _BF16,
    ("bfloat16",): _BF16,
    ("comms_logger",): frozenset("enabled prof_all prof_ops verbose debug".split()),
    ("tensorboard",): _MONITOR,
    ("csv_monitor",): _MONITOR,
    ("wandb",): frozenset("enabled group team project".split()),
    ("comet",): frozenset("""
enabled samples_log_interval project workspace api_key experiment_name experiment_key online mode
""".split()),
    ("hybrid_engine",): frozenset("""
enabled max_out_tokens inference_tp_size release_inference_cache pin_parameters tp_gather_partition_size
enable_cuda_graph
""".split()),
    ("weight_quantization",): frozenset(
        "enabled num_bits q_type q_groups quantized_initialization post_init_quant".split()),
    ("compile",): frozenset("""
deepcompile autoep_non_moe free_activation free_activation_threshold offload_activation offload_activation_pin_memory
offload_opt_states double_buffer symmetric_memory debug_log offload_parameters sync_before_reduce sync_after_reduce
sync_before_allgather sync_after_allgather keep_int_input_tensors keep_all_input_tensors passes
""".split()),
    ("timers", "throughput"): frozenset("enabled synchronized".split()),
    ("tensor_parallel",): frozenset("""
dtype autotp_size tp_overlap_comm vocab_parallel_lm_head vocab_parallel_ce_backend tensor_parallel tp
injection_policy_tuple partition_config preset_model keep_module_on_host replace_with_kernel_inject kernel_inject
""".split()),
    # TPTrainingConfig's tensor_parallel field, under its name or its alias tp
    ("tensor_parallel", "tensor_parallel"): _TP,
    ("tensor_parallel", "tp"): _TP,
}
# The release since which DeepSpeed refuses unknown keys in a block (the block became a DeepSpeedConfigModel, whose
# pydantic config forbids extra fields): precision_config.py (fp16, bf16) in 0.17.1, compile/config.py in 0.16.6,
# runtime/tensor_parallel/config.py in 0.16.4, zenflow_config.py in 0.17.5, leaf_module_config.py in 0.18.0. Before,
# the block was read key by key and other keys were ignored. The other blocks are strict in every release the tables
# here follow (zero/config.py since 0.7.0).
STRICT_SINCE = {("fp16",): "0.17.1", ("bf16",): "0.17.1", ("bfloat16",): "0.17.1", ("compile",): "0.16.6",
                ("tensor_parallel",): "0.16.4", ("tensor_parallel", "tensor_parallel"): "0.16.4",
                ("tensor_parallel", "tp"): "0.16.4", ("zero_optimization", "zenflow"): "0.17.5",
                ("zero_optimization", "leaf_module"): "0.18.0"}
# Deprecated spellings DeepSpeed still converts (zero/config.py, new_param): never suggested as a fix.
DS_DEPRECATED_ZERO_KEYS = frozenset(
    "cpu_offload_param cpu_offload_use_pin_memory cpu_offload stage3_gather_fp16_weights_on_model_save".split())
# A deprecated key and the one that replaced it, which DeepSpeed refuses together: DeepSpeedConfigModel's
# _process_deprecated_field asserts "Cannot provide deprecated parameter '{old}' and replacing parameter '{new}'
# together" (runtime/config_utils.py; zero/config.py names the replacements).
DS_DEPRECATED_REPLACED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
# Keys of DeepSpeed's JSON at any level, as found pasted into accelerate's deepspeed_config section: the top
# level, ZeRO's and the precision blocks' (not the monitors' or compile's generic enabled, project, mode, ...).
PASTED_BLOCKS = (("zero_optimization",), ("zero_optimization", "offload_param"),
                 ("zero_optimization", "offload_optimizer"), ("fp16",), ("bf16",))
DS_JSON_KEYS = (DS_TOP_KEYS | DS_REMOVED_ZERO_KEYS | frozenset().union(*(STRICT_BLOCKS[b] for b in PASTED_BLOCKS))) \
    - frozenset(ACCELERATE_DS_KEYS)
