"""CFG: lint of the accelerate config, the DeepSpeed config, the hostfile and the launch command, before any
node is touched; one module per topic. What accelerate and DeepSpeed accept is in preflight.inputs.

Every finding names the file and line, says what was found against what was expected, and how
to fix it. The facts behind each rule are those of accelerate 1.x and DeepSpeed 0.1x. The registry finds
the checks of the modules this package imports (preflight.registry.checks_in).
"""
from preflight.checks.config import (address, allocation, batch, command, keys, manifests, syntax, training,
                                     validators, values, world)

__all__ = ["address", "allocation", "batch", "command", "keys", "manifests", "syntax", "training", "validators", "values", "world"]
