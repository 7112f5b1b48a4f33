"""One JSON document of facts about the node it runs on, section by section.

It never imports torch or any other training library: versions come from package metadata, torch's CUDA build
from torch/version.py. A section that raises is kept as {"error": "collector section NAME failed on the node:
..."}: one broken fact must not lose the others.
"""
import time

from preflight.node import fabric, gpus, host, launchfiles, packages, shipped_by

SECTION_FAILED = "collector section %s failed on the node: "


def collect(options):
    """Facts about this node. `options`: head (name), port, paths (name -> path to measure), job (what its
    launch would read: launchfiles.facts), census (the running job: census.take_census)."""
    facts = {"schema": 1, "preflight": shipped_by(), "collected_at": time.time()}
    for name, gather in (
        ("python", host.python),
        ("packages", packages.facts),
        ("host", lambda: host.host(options)),
        ("env", host.environment),
        ("storage", lambda: host.storage(options.get("paths") or {})),
        ("limits", host.limits),
        ("memory", host.memory),
        ("clock", host.clock),
        ("gpus", lambda: gpus.facts()),
        ("job", lambda: launchfiles.facts(options.get("job"))),
        ("fabric", lambda: fabric.facts()),
        ("census", lambda: census(options.get("census"))),
    ):
        try:
            facts[name] = gather()
        except Exception as exc:  # one broken fact must not lose the others
            facts[name] = {"error": SECTION_FAILED % name + "%s: %s" % (type(exc).__name__, exc)}
    return facts


def census(options):
    """The running job's processes on this node (preflight doctor); None: not asked."""
    if not options:
        return None
    from preflight.node.census import take_census  # only doctor asks: the others never compile it

    return take_census(options)
