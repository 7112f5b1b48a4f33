"""The all-reduce's options as the command line gives them: backends and message sizes. Apart from
preflight.collective.allreduce, whose transport the commands that run no all-reduce (lint, node) never import."""
from __future__ import annotations

import argparse
import re
from typing import Tuple

MIB = 1 << 20
DEFAULT_SIZES = (1 * MIB, 64 * MIB, 256 * MIB)
BACKENDS = ("auto", "gloo", "nccl")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_sizes(text: str) -> Tuple[int, ...]:
    """`1M,64M,256M` (K, M, G are binary: KiB, MiB, GiB; plain numbers are bytes) as sorted bytes."""
    sizes = []
    for part in str(text).split(","):
        if not part.strip():
            continue
        match = _SIZE.match(part)
        if not match:
            raise argparse.ArgumentTypeError(f"bad message size {part.strip()!r}: use e.g. 1M,64M,256M")
        number, unit = float(match.group(1)), match.group(2).lower()
        value = int(number * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit])
        if value < 4:
            raise argparse.ArgumentTypeError(f"message size {part.strip()!r} is under 4 bytes (one float32)")
        if value > 16 << 30:
            raise argparse.ArgumentTypeError(f"message size {part.strip()!r} is over 16G")
        sizes.append(value)
    if not sizes:
        raise argparse.ArgumentTypeError("no message size given: use e.g. 1M,64M,256M")
    return tuple(sorted(set(sizes)))


def format_size(nbytes: int) -> str:
    """In the largest unit it reaches: whole where it divides, else to a tenth (1 MiB, 1.5 GiB, 12.3 KiB)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}" if nbytes % scale == 0 else f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
