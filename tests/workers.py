"""A pytest plugin (conftest.py's `pytest_plugins`): how the suite is shared between pytest-xdist's workers when
scripts/test runs it on two (`-n 2 --dist loadscope --no-loadscope-reorder`). A plain `pytest` run is untouched.

- The "machine" group, run by one worker, one test at a time, first: every module with a test on the test
  cluster (marked `cluster`, or one of its fixtures: the cluster is held under a machine-wide lock from a test
  of the group to the worker's end) or marked `machine` (what the whole machine shares: its process table,
  which a census of this machine reads; a fixed port). Its modules that save checkpoints come last in it.
- Every other module is a group of its own, so that its module-scoped fixtures are built once, on one worker;
  the modules that save checkpoints with the libraries (tests/checkpoints.py keeps a save for the process's
  later modules) are one group, so that each save runs once.
- The coverage test of check_outcomes.py is a group of its own and comes last: it waits for every other test
  of the run to be over and reads what each worker recorded (check_outcomes.gather).
"""
import glob
import json
import os
import shutil
import tempfile

import pytest

MACHINE = "machine"
# The run's folder, which every worker sees: made by xdist's controller before it starts the workers (they inherit
# its environment), removed at its end.
_FOLDER = "PREFLIGHT_TEST_RUN_FOLDER"


def run_folder():
    """Under xdist, in the controller and in each worker: the run's folder; else None."""
    return os.environ.get(_FOLDER)


@pytest.hookimpl(tryfirst=True)  # before check_outcomes.py's, which writes into it
def pytest_configure(config):
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        os.environ[_FOLDER] = tempfile.mkdtemp(prefix="pf-run-")


def pytest_unconfigure(config):
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(_FOLDER), ignore_errors=True)


def _on_the_cluster(item):
    """A test that asks for a fixture of tests/cluster.py (marked `cluster` or not)."""
    defs = item._fixtureinfo.name2fixturedefs
    return any(d.func.__module__ == "cluster" for name in item.fixturenames for d in defs.get(name, ()))


def _saves_checkpoints(module):
    return any(getattr(value, "__module__", None) == "checkpoints" for value in vars(module).values())


def pytest_collection_modifyitems(session, config, items):
    """An xdist worker: the tests in the order the groups are to start, and each test's group, written for the
    controller's scheduler (xdist's own `loadgroup` reads `xdist_group` marks into test IDs, which pytest 9's
    IDs no longer take)."""
    if not hasattr(config, "workerinput") or not run_folder():
        return
    from check_outcomes import COVERAGE_TEST  # it imports this module
    machine = {item.module for item in items if item.get_closest_marker("cluster")
               or item.get_closest_marker(MACHINE) or _on_the_cluster(item)}
    first, saves, rest, last, groups = [], [], [], [], {}
    for item in items:
        if item.nodeid.endswith(COVERAGE_TEST):
            groups[item.nodeid], into = "coverage", last
        elif item.module in machine:  # a save the other worker made by then is copied, not waited for
            groups[item.nodeid], into = MACHINE, saves if _saves_checkpoints(item.module) else first
        elif _saves_checkpoints(item.module):
            groups[item.nodeid], into = "checkpoints", rest
        else:
            groups[item.nodeid], into = item.nodeid.split("::", 1)[0], rest
        into.append(item)
    items[:] = first + saves + rest + last
    path = os.path.join(run_folder(), f"groups-{config.workerinput['workerid']}.json")
    with open(path + ".part", "w") as out:
        json.dump(groups, out)
    os.replace(path + ".part", path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's controller, `--dist loadscope`: its scheduler over the workers' groups instead of modules (a group
    is a unit that one worker runs, in the order the workers collected; a unit is handed out as a worker runs
    short of work)."""
    if config.getvalue("dist") != "loadscope" or not run_folder():
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups = None

        def _split_scope(self, nodeid):
            if self.groups is None:  # read once every worker has collected (and written them)
                [path, *_] = sorted(glob.glob(os.path.join(run_folder(), "groups-*.json")))
                with open(path) as read:
                    self.groups = json.load(read)
            return self.groups[nodeid]

    return GroupScheduling(config, log)
