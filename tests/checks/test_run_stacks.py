"""RUN009: the Python stacks of a running job's processes can be read, over real censuses of rank processes
on this machine (preflight.node.census with the py-spy installed beside preflight), without a cluster."""
import os
import signal
import subprocess
import sys
import time

from own_network import own_network
from preflight import registry, runner
from preflight.job import running as jobcensus
from preflight.node import census
from preflight.plan import build_plan
from preflight.result import Status


def stacks_readable(argv, port, tmp_path):
    """RUN009's Results over the census of one rank process (argv) of a job on `port`, on node "a"."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with own_network():  # the census sees this rank alone, not another job on this machine
        proc = subprocess.Popen(argv, env=env, cwd=tmp_path)
        try:
            time.sleep(0.5)
            found = census.take_census({"port": port, "deadline_s": 8, "interval_s": 0.3})
            assert proc.pid in [p["pid"] for p in found["processes"] if p["kind"] == "rank"], found["processes"]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    facts = {"a": {"facts": {"census": found}, "error": None, "clock": None}}
    plan = build_plan(nodes=("a",))
    model = jobcensus.build(plan.nodes, facts, port)
    return runner.run_check(registry.load().get("RUN009"), runner.CheckContext(plan, facts, {"census": model}))


def test_the_stack_of_a_python_rank_is_read(tmp_path):
    (tmp_path / "rank.py").write_text("import time\ndef wait():\n    time.sleep(60)\nwait()\n")
    [result] = stacks_readable([sys.executable, "rank.py"], 29981, tmp_path)
    assert result.status == Status.PASS, result
    assert result.nodes == ("a",) and result.evidence["read_per_node"] >= 1, result


def test_a_rank_py_spy_cannot_read_warns_with_what_it_said(tmp_path):
    """A rank process that is not a Python interpreter (a compiled launcher's child, here `sleep`): py-spy
    finds no Python in it, so doctor can say nothing of where it waits."""
    [result] = stacks_readable(["sleep", "60"], 29982, tmp_path)
    assert result.status == Status.WARN and result.nodes == ("a",), result
    assert result.message.startswith("the stacks cannot be read: ") and result.evidence["error"], result
    assert "pip install py-spy" in result.remediation
    # Yama: at ptrace_scope 1 a user attaches to its own children only; the job's ranks are not doctor's
    assert "ptrace_scope is 0 (at 1 and 2 only root attaches" in result.remediation, result.remediation


def test_without_a_census_the_stacks_are_not_judged():
    plan = build_plan(nodes=("a",))
    facts = {"a": {"facts": {}, "error": None, "clock": None}}
    [result] = runner.run_check(registry.load().get("RUN009"), runner.CheckContext(plan, facts, {}))
    assert result.status == Status.SKIP and "preflight doctor" in result.message
