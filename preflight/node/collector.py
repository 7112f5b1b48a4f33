"""One JSON document of facts about the node it runs on, section by section.

It never imports torch or any other training library: versions come from package metadata, torch's CUDA build
from torch/version.py. A section that raises is kept as {"error": "collector section NAME failed on the node:
..."}: one broken fact must not lose the others.
"""
import time

from preflight.node import fabric, gpus, host, launchfiles, ncclconf, packages, shipped_by

SECTION_FAILED = "collector section %s failed on the node: "


# The sections that need no options, in the document's order: they may be read before the options come.
BEFORE_OPTIONS = ("python", "packages", "gpus", "fabric")


def collect(options, ready=None):
    """Facts about this node. `options`: head (name), port, paths (name -> path to measure), job (what its
    launch would read: launchfiles.facts), census (the running job: census.take_census). `ready`: sections
    already read (prepare)."""
    facts = {"schema": 1, "preflight": shipped_by(), "collected_at": time.time()}
    for name, gather in (
        ("python", host.python),
        ("packages", packages.facts),
        ("host", lambda: host.host(options)),
        ("env", host.environment),
        ("nccl_conf", lambda: ncclconf.section(options.get("job"))),
        ("storage", lambda: host.storage(options.get("paths") or {})),
        ("limits", host.limits),
        ("memory", host.memory),
        ("clock", host.clock),
        ("gpus", lambda: gpus.facts()),
        ("job", lambda: launchfiles.facts(options.get("job"))),
        ("fabric", lambda: fabric.facts()),
        ("census", lambda: census(options.get("census"))),
    ):
        facts[name] = ready[name] if ready and name in ready else _section(name, gather)
    return facts


def prepare():
    """The sections that need no options (BEFORE_OPTIONS; 40 ms of a node's run, NVML's import the most), read
    while the program waits for its options line."""
    gather = {"python": host.python, "packages": packages.facts, "gpus": gpus.facts, "fabric": fabric.facts}
    return dict((name, _section(name, gather[name])) for name in BEFORE_OPTIONS)


def _section(name, gather):
    try:
        return gather()
    except Exception as exc:  # one broken fact must not lose the others
        return {"error": SECTION_FAILED % name + "%s: %s" % (type(exc).__name__, exc)}


def census(options):
    """The running job's processes on this node (preflight doctor); None: not asked."""
    if not options:
        return None
    from preflight.node.census import take_census  # only doctor asks: the others never compile it

    return take_census(options)
