"""A pytest plugin (its hooks are conftest.py's): the (check ID, status) of every Result a real built-in check
produced during the run, for tests/checks/test_every_check_fails_and_passes.py.

Two sources, both of which only a real run of a registered check can feed:
- in this process: `preflight.runner._run`, through which `runner.run` and `runner.run_check` evaluate every
  check (the CLI in-process, the engine, the tests that run one check over recorded facts). A Result counts
  only when the function that ran is the one the registry holds for that ID: a test that swaps a check's
  function, or declares its own check, records nothing;
- in subprocesses: the JSON document on the stdout of `python -m preflight ... --json` (subprocess.run,
  check_output, Popen.communicate: every way the tests read a whole stdout), parsed as the CLI helpers of
  conftest.py parse it. A document a test writes by hand is not a process's stdout and records nothing.

Results built by hand (`Result(...)`, `Finding(...)` for the renderers' tests) go through neither.

Under pytest-xdist each worker records its own tests: it writes, after each test, what that test recorded to a
file of its own in the run's folder (tests/workers.py); `gather` reads them all for the coverage test, which
workers.py schedules last.
"""
import json
import os
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

#: check ID -> statuses ("pass", "warn", "fail", "skip", "error") -> the first test that produced one
RECORDED = defaultdict(dict)
#: the cluster tests this machine could not run (no root, no ip netns or sshd): their reasons
CLUSTER_SKIPPED = []
#: the nodeid of the test running now (set around each test's call and fixtures)
_current = {"test": None}
_lock = threading.Lock()
#: an xdist worker's own: its ID, the run's folder of records, what it wrote there so far
_worker = {"id": None, "folder": None, "written": set(), "skipped": 0}
#: xdist's controller: the run's folder of records, the failures after which the run stops (-x, --maxfail)
_controller = {"folder": None, "maxfail": 0, "failed": 0}

COVERAGE_TEST = "test_every_check_fails_and_passes.py::test_every_check_is_shown_to_give_its_worst_status_and_to_pass"


def record(check_id, status):
    record_as(check_id, status, _current["test"])


def record_as(check_id, status, test):
    with _lock:
        RECORDED[check_id].setdefault(status, test)


def _builtin_functions():
    from preflight import registry

    return {spec.id: spec.func for spec in registry.load().checks}


def _install_in_process(functions):
    from preflight import runner

    original = runner._run

    def recording_run(spec, ctx, nodes=()):
        results = original(spec, ctx, nodes)
        if functions.get(spec.id) is spec.func:
            for result in results:
                record(result.id, result.status.value)
        return results

    runner._run = recording_run


def _is_preflight_json(args):
    if isinstance(args, (str, bytes)):
        return False
    words = [str(a) for a in args]
    return "--json" in words and any(words[i] == "-m" and words[i + 1] == "preflight" for i in range(len(words) - 1))


def _record_document(text, functions):
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        return
    if not isinstance(doc, dict) or doc.get("schema") != 1 or not isinstance(doc.get("results"), list):
        return
    for result in doc["results"]:
        if isinstance(result, dict) and result.get("id") in functions and isinstance(result.get("status"), str):
            record(result["id"], result["status"])


def _install_subprocess(functions):
    original = subprocess.Popen.communicate

    def recording_communicate(self, *args, **kwargs):
        out, err = original(self, *args, **kwargs)
        if out and _is_preflight_json(self.args):
            _record_document(out, functions)
        return out, err

    subprocess.Popen.communicate = recording_communicate


def pytest_configure(config):
    import workers  # not before conftest.py registers it as a plugin

    if workers.run_folder():
        folder = os.path.join(workers.run_folder(), "outcomes")
        os.makedirs(folder, exist_ok=True)
        if hasattr(config, "workerinput"):
            _worker.update(id=config.workerinput["workerid"], folder=folder)
        else:
            _controller.update(folder=folder, maxfail=config.option.maxfail)
    functions = _builtin_functions()
    config._check_functions = functions
    _install_in_process(functions)
    _install_subprocess(functions)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid
    yield
    _current["test"] = None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker died (the run fails on it; the tests it had may never run: gather stops)."""
    if error:
        _write(os.path.join(_controller["folder"], "controller.jsonl"), {"stopped": f"worker {node.gateway.id} died"})


def _write(path, line):
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_runtest_logfinish(nodeid):
    """An xdist worker: what this test recorded (what is new since the last test), for `gather`."""
    if not _worker["folder"]:
        return
    with _lock:
        recorded = [[check_id, status, test] for check_id, seen in RECORDED.items() for status, test in seen.items()
                    if (check_id, status) not in _worker["written"]]
        _worker["written"].update((check_id, status) for check_id, status, _ in recorded)
    skipped, _worker["skipped"] = CLUSTER_SKIPPED[_worker["skipped"]:], len(CLUSTER_SKIPPED)
    _write(os.path.join(_worker["folder"], f"{_worker['id']}.jsonl"),
           {"test": nodeid, "recorded": recorded, "skipped": skipped})


def gather(session, timeout=1800):
    """Under xdist: wait until every other test of the run is over, on whichever worker ran it, then add what
    each worker recorded to RECORDED and CLUSTER_SKIPPED. Without xdist, nothing to do."""
    if not _worker["folder"]:
        return
    others = {item.nodeid for item in session.items} - {_current["test"]}
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(line) for path in Path(_worker["folder"]).glob("*.jsonl")
                 for line in path.read_text().split("\n")[:-1]]  # a line being written has no newline yet
        left = others - {line.get("test") for line in lines}
        if not left:
            break
        stopped = [line["stopped"] for line in lines if "stopped" in line]
        if stopped:
            pytest.skip(f"the run stopped early ({stopped[0]}): not every test ran")
        assert time.monotonic() < deadline, f"{len(left)} tests not over after {timeout} s: {sorted(left)[:5]}"
        time.sleep(0.5)
    for line in lines:
        for check_id, status, test in line.get("recorded", ()):
            record_as(check_id, status, test)
        CLUSTER_SKIPPED.extend(line.get("skipped", ()))


def pytest_runtest_logreport(report):
    if _controller["folder"] and report.failed:  # xdist's controller: the run stops at --maxfail, gather with it
        _controller["failed"] += 1
        if _controller["failed"] == _controller["maxfail"]:
            _write(os.path.join(_controller["folder"], "controller.jsonl"), {"stopped": f"{report.nodeid} failed"})
    if report.skipped and "cluster" in report.keywords and report.when == "setup":
        CLUSTER_SKIPPED.append(str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else report.nodeid)


def pytest_collection_modifyitems(session, config, items):
    """The coverage test runs last, after every test that can record."""
    last = [item for item in items if item.nodeid.endswith(COVERAGE_TEST)]
    items[:] = [item for item in items if item not in last] + last
