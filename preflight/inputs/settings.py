"""What the job's configs add up to, worked out as accelerate and DeepSpeed do: the processes each machine
runs, the GPUs gpu_ids lists, and where the ZeRO stage and offload come from. The CFG, GPU and MEM checks
all read the configs through these."""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple

from preflight.inputs.configs import gpu_id_items
from preflight.inputs.documents import Document
from preflight.inputs.numbers import is_int, text_number


def processes_per_machine(data: Mapping[str, Any]) -> Optional[int]:
    procs, machines = text_number(data.get("num_processes")), text_number(data.get("num_machines", 1))
    if is_int(procs) and is_int(machines) and procs > 0 and machines > 0:
        return procs // machines
    return None


def gpu_id_list(value: Any) -> Optional[List[str]]:
    """gpu_ids as a list, as torch reads it (configs.gpu_id_items), or None for 'all' and unset."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("all", "")):
        return None
    return gpu_id_items(str(value))


def zero_settings(plan) -> Optional[Tuple[Document, Tuple[str, ...], Any, Mapping[str, Any]]]:
    """Where the ZeRO settings come from: (doc, path of the stage key, stage, offload devices).

    The DeepSpeed JSON when there is one; else accelerate's own keys, which accelerate turns into one.
    """
    ds = plan.deepspeed.doc if plan.deepspeed is not None else None
    if ds is not None:
        zero = ds.data.get("zero_optimization")
        if isinstance(zero, bool):  # the old boolean form: true is stage 1
            return ds, ("zero_optimization",), int(zero), {}
        if not isinstance(zero, Mapping):
            return ds, ("zero_optimization",), 0, {}
        return ds, ("zero_optimization", "stage"), text_number(zero.get("stage", 0)), zero
    # accelerate's deepspeed_config section, read only when accelerate uses DeepSpeed
    doc = plan.accelerate.doc if plan.accelerate is not None else None
    section = doc.section("deepspeed_config") if doc is not None and plan.accelerate.uses_deepspeed else None
    if section is None or "zero_stage" not in section.data:
        return None

    def lower(value: Any) -> Any:  # accelerate lower-cases the devices (str(...).lower(), utils/launch.py)
        return value.lower() if isinstance(value, str) else value

    devices = {
        "offload_param": {"device": lower(section.data.get("offload_param_device")),
                          "nvme_path": section.data.get("offload_param_nvme_path")},
        "offload_optimizer": {"device": lower(section.data.get("offload_optimizer_device")),
                              "nvme_path": section.data.get("offload_optimizer_nvme_path")},
    }
    stage = section.data["zero_stage"]  # null: DeepSpeedPlugin's default, 2 (utils/dataclasses.py)
    return doc, ("deepspeed_config", "zero_stage"), 2 if stage is None else text_number(stage), devices
