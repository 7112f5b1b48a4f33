"""The plan: what the job asks for, built once from the inputs and never changed."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from preflight.jobconfig import (
    AccelerateConfig,
    DeepSpeedConfig,
    Hostfile,
    load_accelerate_config,
    load_deepspeed_config,
    load_hostfile,
    resolve_beside,
)


@dataclass(frozen=True)
class Plan:
    accelerate: Optional[AccelerateConfig] = None
    deepspeed: Optional[DeepSpeedConfig] = None
    hostfile: Optional[Hostfile] = None
    world_size_override: Optional[int] = None
    # deepspeed_config_file as the accelerate config names it, resolved; None when it names none
    deepspeed_file_named: Optional[str] = None
    deep: bool = False  # also run accelerate's and DeepSpeed's own validators
    nodes: Tuple[str, ...] = ()

    @property
    def world_size(self) -> Tuple[Optional[int], str]:
        """The number of processes of the whole job, and where that number comes from."""
        if self.world_size_override:
            return self.world_size_override, "--world-size"
        if self.accelerate is not None:
            procs = self.accelerate.integer("num_processes")
            if procs is not None and procs > 0:
                return procs, f"num_processes in {self.accelerate.doc.path}"
        if self.hostfile is not None:
            return sum(e.slots for e in self.hostfile.entries), f"the slots of {self.hostfile.path}"
        return None, "unknown (give --world-size, an accelerate config or a hostfile)"


def default_accelerate_config() -> Optional[str]:
    """accelerate's default config file, as `accelerate launch` finds it, when it exists."""
    cache = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    path = os.path.join(os.path.expanduser(cache), "accelerate", "default_config.yaml")
    return path if os.path.isfile(path) else None


def build_plan(
    config: Optional[str] = None,
    deepspeed: Optional[str] = None,
    hostfile: Optional[str] = None,
    world_size: Optional[int] = None,
    deep: bool = False,
    nodes: Tuple[str, ...] = (),
) -> Plan:
    """Load every input; unreadable input raises InputError (exit 2)."""
    accel = load_accelerate_config(config) if config else None
    named = None
    if accel is not None:
        section = accel.deepspeed_section
        name = section.data.get("deepspeed_config_file") if section is not None else None
        if isinstance(name, str) and name.strip():
            named = resolve_beside(name, accel.doc.path)
    ds_path = deepspeed or (named if named and os.path.isfile(named) else None)
    return Plan(
        accelerate=accel,
        deepspeed=load_deepspeed_config(ds_path) if ds_path else None,
        hostfile=load_hostfile(hostfile) if hostfile else None,
        world_size_override=world_size,
        deepspeed_file_named=named,
        deep=deep,
        nodes=nodes,
    )
