"""Every registered check is shown by the tests to give its worst status and to pass.

tests/check_outcomes.py (a plugin; its hooks are conftest.py's) records the status of every Result a real
built-in check produced while the tests ran: in-process through the runner, and from the JSON document of
every `python -m preflight ... --json` subprocess. The test here runs last (the plugin orders it so).
"""
import inspect
import sys
import types

import pytest
from check_outcomes import CLUSTER_SKIPPED, RECORDED, gather
from preflight import registry
from preflight.result import Status


def _reached(func):
    """The functions a check runs (itself, the functions of its own module and of preflight.compare it calls,
    transitively) and the module-level values they read (tables such as GPU003's precision needs)."""
    module = sys.modules[func.__module__]
    functions, values, todo = set(), [], [func]
    while todo:
        function = todo.pop()
        if function in functions:
            continue
        functions.add(function)
        codes = [function.__code__]
        while codes:
            code = codes.pop()
            codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]
            for name in code.co_names:
                found = getattr(module, name, None)
                if isinstance(found, types.FunctionType):
                    if found.__module__ in (module.__name__, "preflight.compare"):
                        todo.append(found)
                elif isinstance(found, (dict, list, tuple, set, frozenset, Status)):
                    values.append(found)
    return functions, values


def _statuses_in(value, depth=0):
    if isinstance(value, Status):
        return {value.value}
    if depth > 4 or not isinstance(value, (dict, list, tuple, set, frozenset)):
        return set()
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
    return set().union(set(), *(_statuses_in(item, depth + 1) for item in items))


def worst_status(spec):
    """'fail' when the check's code (see _reached) can yield a failure, else 'warn' when it can warn."""
    functions, values = _reached(spec.func)
    source = "".join(inspect.getsource(function) for function in functions)
    named = set().union(set(), *(_statuses_in(value) for value in values))
    if "Status.FAIL" in source or "fail(" in source or "fail" in named:
        return "fail"
    if "Status.WARN" in source or "warn(" in source or "warn" in named:
        return "warn"
    return "pass"


def test_every_check_is_shown_to_give_its_worst_status_and_to_pass(request):
    """For each check ID in the registry (preflight.registry.load().checks), the tests must have made the
    registered check function give `fail` and `pass`. A check that cannot fail (no failure in its code, the
    helpers of its module it calls, nor the tables it reads: CLK002, SYS001, the RDMA and PKG findings that
    may be intended, ...) must be shown to `warn` and to `pass` instead; should a test make such a check
    fail, the reading of its code was wrong, and this test fails naming it. `warn` never stands for `fail`;
    `skip` and `error` count for nothing. Nothing recorded (this test run alone, or with the tests that
    show a check deselected) is a failure naming every ID not shown. Only a machine that cannot build the test
    cluster (its tests skipped: no root, no ip netns or sshd) skips it, with that reason, as they are."""
    gather(request.session)  # under xdist: every worker's records, once every other test is over
    specs = sorted(registry.load().checks, key=lambda spec: spec.id)
    assert len(specs) >= 13, [spec.id for spec in specs]  # at least one check per family
    missing = []
    for spec in specs:
        seen = RECORDED.get(spec.id, {})
        worst = worst_status(spec)
        if worst != "fail" and "fail" in seen:
            missing.append(f"{spec.id} ({spec.name}): read as unable to fail, but failed in {seen['fail']}")
            continue
        lacking = [status for status in (worst, "pass") if status not in seen]
        if lacking:
            missing.append(f"{spec.id} ({spec.name}): no test made it {' or '.join(dict.fromkeys(lacking))}"
                           f" (recorded: {', '.join(sorted(seen)) or 'nothing'})")
    if missing and RECORDED and CLUSTER_SKIPPED:  # a machine without the test cluster: not judged, and said so
        pytest.skip(f"{len(missing)} checks are shown only by cluster tests, skipped here: {CLUSTER_SKIPPED[0]}")
    assert not missing, f"{len(missing)} of {len(specs)} checks are not shown by a test:\n" + "\n".join(missing)


def test_the_reading_of_a_checks_code_finds_failures_in_helpers_and_tables():
    """worst_status sees a failure a check yields through a helper of its module (FS002's folder rules) or a
    table it reads (GPU003's precision needs), and none in a check that only warns (CLK002)."""
    specs = {spec.id: spec for spec in registry.load().checks}
    assert {check_id: worst_status(specs[check_id]) for check_id in ("FS002", "GPU003", "CLK002", "SYS001")} == \
        {"FS002": "fail", "GPU003": "fail", "CLK002": "warn", "SYS001": "warn"}
