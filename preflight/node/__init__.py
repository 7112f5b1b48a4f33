"""Everything that runs on a node: the facts, the request agent, the census of a running job, the all-reduce
worker, and the readers they share.

The rules of this package, which nothing outside it has to follow:
- Standard library only, and modules of this package: a node has nothing of preflight installed. The head
  ships these modules' sources (preflight.remote.shipping); the bootstrap there makes each one a module of
  this package, so they import each other as they do in-process.
- The oldest interpreter is MIN_PYTHON, stated here once. This file and the bootstrap keep to the syntax
  that Python 2.7 still compiles, so that any older interpreter is refused in one line that names it
  (`unsupported`) instead of a SyntaxError; the other modules need MIN_PYTHON.
- Read only, bounded: nothing is written but the agent's answers, no read can block on a FIFO or a device,
  every loop has a limit, and a value whose name looks secret never leaves the node (secret.secret_name).
"""
import platform
import sys

MIN_PYTHON = (3, 9)  # pyproject.toml's requires-python: the oldest interpreter preflight is tested with
UNSUPPORTED = "preflight: unsupported interpreter"
# The first line of the shipped program's code on its command line (remote.shipping.BOOTSTRAP): it tells a port's
# holder, or a line of `ps` on the node, to be preflight's own program (its agent or its all-reduce worker).
PROGRAM_MARK = "# preflight\n"


def shipped_by():
    """The version of the preflight whose head shipped this code (the bootstrap's `preflight` module carries it;
    in-process it is the installed package's), or None."""
    return getattr(sys.modules.get("preflight"), "__version__", None)


def unsupported():
    """The line an interpreter older than MIN_PYTHON writes instead of facts, or None."""
    if sys.version_info >= MIN_PYTHON:
        return None
    return "%s: %s is Python %s; preflight needs Python %d.%d or newer\n" % (
        UNSUPPORTED, sys.executable, platform.python_version(), MIN_PYTHON[0], MIN_PYTHON[1])
