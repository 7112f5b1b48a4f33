"""The public check API: what a check module imports, built-in or third-party. Moves inside the engine do not
change these names.

A check is a function declared with `@check(ID, name, scope, tags=[...])` whose docstring says what it checks,
why it matters and how to fix it (three parts, blank lines between). It reads a CheckContext (the plan, each
node's facts, the probes' results; no I/O) and yields Findings. A package makes its checks known through the
entry-point group `preflight.checks`, as the built-in families do:

    [project.entry-points."preflight.checks"]
    acme = "acme_checks"

    from preflight.api import Finding, Status, check, odd_ones_out

    @check("ACME001", "scratch-mounted", "node", tags=["fs"])
    def scratch(ctx):
        \"\"\"/scratch is mounted on every node.

        The job writes its checkpoints there.

        Mount /scratch (see the cluster's storage guide).\"\"\"
        ...
"""
from preflight.compare import grouped, holders, nodes_with, odd_ones_out
from preflight.inputs.inventory import fold
from preflight.registry import check
from preflight.result import Finding, Status, fail, passed, skip, warn
from preflight.runner import CheckContext, cause_of, failed_sections, node_error_check

__all__ = ["CheckContext", "Finding", "Status", "cause_of", "check", "fail", "failed_sections", "fold", "grouped",
           "holders", "node_error_check", "nodes_with", "odd_ones_out", "passed", "skip", "warn"]
