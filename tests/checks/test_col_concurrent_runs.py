"""COL beside other runs and hostile nodes: two runs of the all-reduce at once (on this machine and on the
real test cluster) never count each other's ranks nor blame a node, a main port held by another preflight run
is a port clash, not a failure, and a worker report of the wrong shape is that node's failure."""
import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check_code, clean
from conftest import results
from preflight.remote.shipping import ALLREDUCE, shipped_command, shipped_input

MIB = 1 << 20


# --- the worker on this machine: two runs on one port -------------------------------------------

def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker(port, ranks, world, run, budget, timeout_s=30):
    options = {"master_addr": "127.0.0.1", "master_port": port, "world_size": world, "ranks": ranks,
               "backend": "gloo", "sizes": [4096], "timeout_s": timeout_s, "budget_s": budget, "env": {}, "run": run}
    proc = subprocess.Popen(["bash", "-c", shipped_command(sys.executable)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(shipped_input(ALLREDUCE, options))
    proc.stdin.flush()
    return proc


def listening(port, timeout=60.0):
    """Wait until a store listens on the port (its rank 0 has imported torch and bound it)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port}")


def report_of(proc, timeout=60):
    """The worker's one line (stdin stays open until it comes: its end would abort the worker)."""
    line = proc.stdout.readline()
    proc.stdin.close()
    proc.wait(timeout=timeout)
    return json.loads(line)


def test_a_rank_of_another_run_is_never_counted():
    """Run a's rank 0 holds the store; run b's rank 1 finds a's token there and stays out (a port clash at its
    deadline), and a's own rank 1 meets rank 0 with the exact sum of a world of two."""
    port = free_port()
    head = start_worker(port, [0], 2, "a" * 16, budget=60.0, timeout_s=55)  # it waits for its rank 1 (below)
    listening(port)  # a's store is up (its torch import can take seconds on a loaded machine): then the stranger
    stranger = start_worker(port, [1], 2, "b" * 16, budget=20.0)
    # a's own rank 1 only once the stranger has given up: started beside it, it could finish run a (and close
    # its store) before a slow stranger had even imported torch, which then found no store at all
    [intruder] = report_of(stranger)["ranks"]
    assert intruder["kind"] == "clash" and intruder["stage"] == "store", intruder
    assert f"127.0.0.1:{port} is held by another preflight run" in intruder["error"]
    own = start_worker(port, [1], 2, "a" * 16, budget=40.0)  # the stranger was never counted as a's rank 1
    first, second = report_of(head), report_of(own)
    assert first["ok"] and second["ok"], (first, second)
    assert first["ranks"][0]["check"] == {"ok": True, "expected": 3.0, "mismatches": 0, "first": None}


def test_rank_zero_of_a_second_run_reports_the_port_clash():
    port = free_port()
    holder = start_worker(port, [0], 2, "a" * 16, budget=40.0)
    listening(port)
    second = start_worker(port, [0], 2, "b" * 16, budget=15.0)
    started = time.monotonic()
    [rank] = report_of(second)["ranks"]
    assert rank["kind"] == "clash" and rank["stage"] == "store", rank
    assert f"port {port} on the head is in use by another process (another preflight run" in rank["error"]
    assert time.monotonic() - started < 12  # the clash is said at once, not at the deadline
    holder.kill()
    holder.wait()


def test_the_main_port_held_by_another_preflight_run_is_a_port_clash_not_a_failure():
    """Run a's all-reduce holds the main port (its real rank 0, under the real keeper); run b's probe of the port
    (the collector's answer from /proc) makes NET003 say port clash, naming no node; a process that is not
    preflight's on the same port is still a failure of the head."""
    from preflight import registry, runner
    from preflight.node import agent
    from preflight.plan import build_plan

    net003 = {c.id: c for c in registry.load().checks}["NET003"]
    plan = build_plan(nodes=("n01", "n02"), port=free_port())
    port = plan.port

    def probed():
        listen = agent.bindable(port)
        assert isinstance(listen, dict), "the port is free"
        ctx = runner.CheckContext(plan, {}, {"port": {"head": "n01", "listen": listen, "workers": {}}})
        return runner.run_check(net003, ctx)

    holder = start_worker(port, [0], 2, "a" * 16, budget=40.0)
    try:
        listening(port)
        [result] = probed()
        assert result.status.value == "error" and result.nodes == (), result
        assert result.message.startswith(f"port clash, not judged: port {port} on the head n01 is held by another "
                                          "preflight run"), result.message
    finally:
        holder.stdin.close()  # the end of its session: the keeper ends it
        holder.wait(timeout=30)
    other = subprocess.Popen([sys.executable, "-c", "import socket, time\ns = socket.socket()\n"
                              "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                              f"s.bind(('0.0.0.0', {port})); s.listen(); time.sleep(30)"])
    try:
        listening(port)
        [result] = probed()
        assert result.status.value == "fail" and result.nodes == ("n01",), result
        assert f"held by pid {other.pid}" in result.message, result.message
    finally:
        other.kill()
        other.wait()


# --- the real test cluster ----------------------------------------------------------------------

@pytest.mark.cluster
def test_two_runs_at_once_never_count_each_others_ranks_nor_blame_a_node(cluster):
    """Two users (or a prolog and a user) run `check --only COL` on the same nodes at the same moment: one
    run's all-reduce passes on every node; the other, whose port the first holds, says port clash and fails
    no node. (--col-port: both go straight to the all-reduce, as the main port's probe would otherwise stop
    the second run first when the two happen to meet there.)"""
    argv = [sys.executable, "-m", "preflight", "check", "--hosts", ",".join(cluster.nodes), "--ssh-config",
            str(cluster.ssh_config), "--python", sys.executable, "--only", "COL", "--timeout", "40",
            "--col-sizes", "1M", "--col-port", "29611", "--json"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    docs = []
    for proc, (out, err) in zip(procs, outs):
        clean(err)
        doc = json.loads(out)
        assert proc.returncode == (1 if doc["verdict"] == "fail" else 0)
        docs.append(doc)
    shown = [[(r["id"], r["status"], r["nodes"], r["message"]) for r in d["results"]] for d in docs]
    for doc in docs:
        for r in doc["results"]:
            if r["status"] in ("fail", "error"):  # the other run's port: said as such, on no node
                assert r["nodes"] == [] and "port clash" in r["message"] and "29611" in r["message"], shown
    passed = [d for d in docs if {n: r["status"] for n, r in results(d, "COL001").items()} ==
              {n: "pass" for n in cluster.nodes}]
    assert len(passed) >= 1 and passed[0]["verdict"] == "pass", shown  # the run that holds the port tests all


HOSTILE = textwrap.dedent("""\
    #!/bin/bash
    # A training interpreter that is the real one, but whose all-reduce worker on {node} answers {line}.
    IFS= read -r n
    src=$(mktemp)
    head -c "$n" > "$src"
    if [ "$(hostname)" = {node} ] && grep -q "The all-reduce worker" "$src"; then
        rm -f "$src"
        cat {line}
        exit 0
    fi
    {{ printf '%s\\n' "$n"; cat "$src"; rm -f "$src"; exec cat; }} | exec {python} "$@"
""")

WRONG_REPORTS = {
    "list": "[]",
    "string": '"all good"',
    "null": "null",
    "missing-ranks": '{"ok": true}',
    "ranks-not-a-list": '{"ok": true, "ranks": "all"}',
    "rank-not-an-object": '{"ok": false, "ranks": [1]}',
    "wrong-rank": '{"ok": true, "ranks": [{"rank": 7, "ok": true, "sizes": []}]}',
    "size-as-text": '{"ok": true, "ranks": [{"rank": 1, "ok": true, "sizes": [{"bytes": "many", "iters": 1, '
                    '"time_s": 1, "algbw_gbps": 1, "busbw_gbps": 1}]}]}',
    "nested": "[" * 5000 + "]" * 5000,  # past the recursion limit of the JSON decoder
}


@pytest.mark.cluster
@pytest.mark.parametrize("shape", sorted(WRONG_REPORTS))
def test_a_worker_report_of_the_wrong_shape_is_that_nodes_failure(cluster, tmp_path, shape):
    node = cluster.nodes[1]
    line = tmp_path / "report.json"
    line.write_text(WRONG_REPORTS[shape] + "\n")
    python = tmp_path / "python"
    python.write_text(HOSTILE.format(node=node, line=line, python=sys.executable))
    python.chmod(0o755)
    # Two nodes: the head's worker is aborted as soon as node02's answer comes, and no rerun follows.
    code, doc, err = check_code(cluster, "--only", "COL", "--col-sizes", "1M", python=python, timeout="10",
                           nodes=cluster.nodes[:2])
    clean(err)
    assert code == 1, doc
    allreduce = results(doc, "COL001")
    assert allreduce[node]["status"] == "fail", allreduce
    assert "report is not what preflight's worker writes" in allreduce[node]["message"], allreduce[node]
    assert [n for n, r in allreduce.items() if r["status"] == "fail"] == [node]


