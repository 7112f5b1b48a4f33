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
"""
import json
import subprocess
import threading
from collections import defaultdict

import pytest

#: check ID -> statuses ("pass", "warn", "fail", "skip", "error") -> the first test that produced one
RECORDED = defaultdict(dict)
#: the cluster tests this machine could not run (no root, no ip netns or sshd): their reasons
CLUSTER_SKIPPED = []
#: the nodeid of the test running now (set around each test's call and fixtures)
_current = {"test": None}
_lock = threading.Lock()

COVERAGE_TEST = "test_every_check_fails_and_passes.py::test_every_check_is_shown_to_give_its_worst_status_and_to_pass"


def record(check_id, status):
    with _lock:
        RECORDED[check_id].setdefault(status, _current["test"])


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
    functions = _builtin_functions()
    config._check_functions = functions
    _install_in_process(functions)
    _install_subprocess(functions)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid
    yield
    _current["test"] = None


def pytest_runtest_logreport(report):
    if report.skipped and "cluster" in report.keywords and report.when == "setup":
        CLUSTER_SKIPPED.append(str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else report.nodeid)


def pytest_collection_modifyitems(session, config, items):
    """The coverage test runs last, after every test that can record."""
    last = [item for item in items if item.nodeid.endswith(COVERAGE_TEST)]
    items[:] = [item for item in items if item not in last] + last
