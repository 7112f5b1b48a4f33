"""Which nodes the job runs on: from --hosts, a hostfile or SLURM. The first node is the head (rank 0)."""
from __future__ import annotations

import os
import re
from typing import List, Optional, Sequence

from preflight.documents import InputError

NODE_NAME = re.compile(r"^[A-Za-z0-9_.:\[\]-]+$")  # what ssh_config aliases, names and addresses use


def expand(text: str, source: str) -> List[str]:
    """A hostlist expression (`gpu[001-004],gpu010`) as a list of names."""
    import hostlist

    try:
        names = hostlist.expand_hostlist(text.strip())
    except hostlist.BadHostlist as exc:
        raise InputError(source, f"bad host list {text!r}: {exc}") from None
    return names


def validate(names: Sequence[str], source: str) -> List[str]:
    if not names:
        raise InputError(source, "no hosts given")
    seen = set()
    for name in names:
        if not name or not name.strip():
            raise InputError(source, "an empty host name")
        if not NODE_NAME.match(name):
            raise InputError(source, f"{name!r} is not a host name, address or ssh_config alias")
        if name in seen:
            raise InputError(source, f"host {name!r} is listed twice")
        seen.add(name)
    return list(names)


def from_slurm() -> List[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise InputError("--slurm", "SLURM_JOB_NODELIST is not set: run inside an allocation (salloc, sbatch)")
    return validate(expand(nodelist, "SLURM_JOB_NODELIST"), "SLURM_JOB_NODELIST")


def head_first(names: List[str], main_process_ip: Optional[str]) -> List[str]:
    """accelerate's main_process_ip names the head: when it is one of the nodes, it goes first."""
    if main_process_ip in names:
        return [main_process_ip] + [n for n in names if n != main_process_ip]
    return names


def fold(names: Sequence[str]) -> str:
    """n01,n02,n03 -> n[01-03] (names hostlist cannot fold are listed as they are)."""
    import hostlist

    try:
        return hostlist.collect_hostlist(list(names))
    except Exception:
        return ",".join(names)
