"""The job as `preflight launch` will start it (preflight.job.view.launches with a launching plan): a command the
gate execs on the head alone (torchrun, DeepSpeed's runner with --no_ssh) is each node's own, `$VAR` each node's;
accelerate's DeepSpeed runner from the head starts every node; the programs a launch runs by name (JOB010)."""
import pytest

from preflight import registry, runner
from preflight.gate import launcher
from preflight.job import view as jobview
from preflight.plan import build_plan
from preflight.result import Status

HEAD = "10.0.0.1"
TORCHRUN = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--node_rank", "{rank}", "--master_addr", HEAD,
            "--master_port", "29721", "t.py"]


def program(name, found=True):
    """Where a node resolved a program (preflight.node.launchfiles), keyed by the word as the command has it."""
    path = name if name.startswith("/") else f"/venv/bin/{name}"
    return {"name": name, **({"path": path, "real": path, "interpreter": "/venv/bin/python3"} if found else
                             {"path": None})}


def facts(argv, config=None, programs=("torchrun", "python3")):
    job = {"cwd": "/job", "argv": list(argv), "files": {}, "programs": {n: program(n) for n in programs},
           "config": {"path": "/job/accelerate.yaml", **({"text": config, "sha256": "x"} if config else
                                                         {"error": "missing"})}}
    return {"facts": {"job": job, "host": {"interfaces": {"lo": ["127.0.0.1"]}}, "env": {},
                      "gpus": {"available": False}}, "error": None, "clock": None}


def two_nodes(argv_of):
    """Nodes a (the head, which owns HEAD) and b, each sending the command as its session expanded it."""
    nodes = {n: facts([w.format(rank=r) for w in argv_of]) for r, n in enumerate(("a", "b"))}
    nodes["a"]["facts"]["host"]["interfaces"]["eth0"] = [HEAD]
    return nodes


def context(nodes, command, launching):
    plan = build_plan(nodes=tuple(nodes), command=tuple(command), launching=launching)
    return runner.CheckContext(plan, nodes, {"job": jobview.launches(plan, nodes, HEAD), "head": {"address": HEAD}})


def by_id(ctx, check_id):
    return list(runner.run([registry.load().get(check_id)], ctx))


# --- a command the gate execs here: each node's own launch ----------------------------------------------------

def test_the_gate_reads_each_nodes_own_variables_in_a_command_it_runs_here():
    torchrun = [w.format(rank="$NODE_RANK") for w in TORCHRUN]
    assert jobview.request(build_plan(nodes=("a", "b"), command=tuple(torchrun), launching=True))["expand"]
    assert jobview.request(build_plan(nodes=("a", "b"), command=tuple(torchrun)))["expand"]
    # `accelerate launch` is started over SSH with every word quoted: its `$VAR` reaches the launcher as text
    accelerate = ("accelerate", "launch", "--gpu_ids", "$GPUS", "t.py")
    assert not jobview.request(build_plan(nodes=("a", "b"), command=accelerate, launching=True))["expand"]


def test_the_gate_execs_the_command_with_this_sessions_variables(monkeypatch):
    monkeypatch.setenv("NODE_RANK", "0")
    assert launcher.here_command(["torchrun", "--node_rank=$NODE_RANK", "t.py", "${NODE_RANK}x"]) == \
        ["torchrun", "--node_rank=0", "t.py", "0x"]


@pytest.mark.parametrize("rank_word", ["$NODE_RANK", "${NODE_RANK}"])
def test_a_rank_each_node_sets_passes_the_gate(rank_word):
    command = [w.format(rank=rank_word) for w in TORCHRUN]
    ctx = context(two_nodes(TORCHRUN), command, launching=True)
    results = runner.run([s for s in registry.load().checks if s.id in ("JOB001", "JOB002", "JOB003")], ctx)
    assert {(r.id, r.status) for r in results} == {("JOB001", Status.PASS), ("JOB002", Status.PASS),
                                                   ("JOB003", Status.PASS)}, [(r.id, r.message) for r in results]


def test_a_rank_written_out_is_the_heads_launch_alone_under_the_gate():
    """`--node_rank 0` as the head's shell expanded it: the gate starts the head's launch, the user the others."""
    command = [w.format(rank="0") for w in TORCHRUN]
    nodes = two_nodes([w.format(rank="0") for w in TORCHRUN])
    ctx = context(nodes, command, launching=True)
    [ranks] = by_id(ctx, "JOB002")
    assert ranks.status is Status.PASS and ranks.nodes == ("a",), ranks.message
    assert "machine_rank 0 on a (flag --node_rank)" in ranks.message and "b start(s) its own" in ranks.message
    [zero] = by_id(ctx, "JOB003")
    assert zero.status is Status.PASS and zero.message == f"rank 0 is a, which owns {HEAD}"
    rows = {row["node"]: row["machine_rank"] for row in jobview.plan_rows(ctx.probes["job"])}
    assert rows == {"a": 0, "b": "its own"}
    # `check` reads the command as every node's: rank 0 twice is a deadlock
    failed = [r.message for r in by_id(context(nodes, command, launching=False), "JOB002") if r.status is Status.FAIL]
    assert any("machine_rank 0 on 2 nodes" in message for message in failed), failed


def test_a_written_out_rank_that_is_not_the_heads_zero_is_not_an_error():
    command = [w.format(rank="1") for w in TORCHRUN]
    ctx = context(two_nodes(command), command, launching=True)
    results = runner.run([s for s in registry.load().checks if s.id in ("JOB002", "JOB003")], ctx)
    assert [r.status for r in results if r.id == "JOB003"] == [Status.SKIP], [(r.id, r.message) for r in results]
    assert Status.ERROR not in {r.status for r in results}


def test_an_unset_rank_variable_is_job001s_finding_and_job003_agrees():
    command = [w.format(rank="$NODE_RANK") for w in TORCHRUN]
    ctx = context(two_nodes(command), command, launching=True)  # neither session sets it: the text comes back
    results = {r.id: r for r in runner.run([s for s in registry.load().checks if s.family == "JOB"], ctx)}
    assert results["JOB001"].status is Status.FAIL and "$NODE_RANK" in results["JOB001"].message
    assert results["JOB003"].status is Status.SKIP, results["JOB003"].message
    assert Status.ERROR not in {r.status for r in results.values()}


# --- accelerate's DeepSpeed runner from the head --------------------------------------------------------------

ACCELERATE = ["/venv/bin/accelerate", "launch", "--config_file", "accelerate.yaml", "t.py"]


def deepspeed_config(multinode_launcher):
    return ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_machines: 2\nnum_processes: 2\n"
            f"machine_rank: 0\nmain_process_ip: {HEAD}\nmain_process_port: 29718\ndeepspeed_config:\n"
            f"  deepspeed_multinode_launcher: {multinode_launcher}\n  deepspeed_hostfile: hostfile\n"
            "  zero_stage: 1\n")


def accelerate_nodes(multinode_launcher, missing=(), programs=(ACCELERATE[0], "python3", "deepspeed", "pdsh")):
    nodes = {n: facts(ACCELERATE, deepspeed_config(multinode_launcher), programs) for n in ("a", "b")}
    for node, name in missing:
        nodes[node]["facts"]["job"]["programs"][name] = program(name, found=False)
    nodes["a"]["facts"]["host"]["interfaces"]["eth0"] = [HEAD]
    return nodes


@pytest.mark.parametrize("multinode_launcher, started", [
    ("pdsh", "pdsh"), ("openmpi", "openmpi"), ("mvapich", "mvapich"), ("mpich", "mpich"), ("slurm", "slurm"),
    ("nossh", None), ("standard", None)])
def test_the_gate_starts_the_head_alone_when_its_deepspeed_runner_starts_every_node(multinode_launcher, started):
    ctx = context(accelerate_nodes(multinode_launcher), ACCELERATE, launching=True)
    assert launcher.head_runner(ctx.probes["job"], "a") == started


def test_a_launch_the_head_starts_alone_opens_one_session(monkeypatch):
    import io

    opened = []

    class Channel:
        def settimeout(self, _):
            pass

        def recv(self, _):
            return b""

        def exit_status_ready(self):
            return True

        def recv_exit_status(self):
            return 0

        def close(self):
            pass

    class Connection:
        def __init__(self, name):
            self.name = name

        def open_command(self, line, timeout, pty):
            opened.append((self.name, line.decode()))
            return Channel()

        def close(self):
            pass

    def connect_all(runs, *_):
        for node in runs:
            node.connection = Connection(node.name)
        return []

    monkeypatch.setattr(launcher, "_connect_all", connect_all)
    err = io.StringIO()
    code = launcher.run(["a", "b"], HEAD, 29718, ACCELERATE, out=io.StringIO(), err=err, runner="pdsh", cwd="/job")
    assert code == 0 and [name for name, _ in opened] == ["a"]
    assert "--machine_rank 0" in opened[0][1] and "--num_machines 2" in opened[0][1]
    assert "launching on a (machine_rank 0) alone" in err.getvalue() and "2 node(s) over pdsh" in err.getvalue()
    opened.clear()
    launcher.run(["a", "b"], HEAD, 29718, ACCELERATE, out=io.StringIO(), err=io.StringIO(), cwd="/job")
    assert [name for name, _ in opened] == ["a", "b"]


# --- JOB010: the programs the launch runs by name ---------------------------------------------------------------

def test_the_collector_is_asked_where_the_programs_a_launch_may_run_by_name_resolve():
    asked = jobview.request(build_plan(nodes=("a", "b"), command=tuple(ACCELERATE), launching=True))["programs"]
    assert {ACCELERATE[0], "python3", "deepspeed", "pdsh"} <= set(asked)


@pytest.mark.parametrize("multinode_launcher, missing, failing", [
    ("nossh", [("a", "deepspeed"), ("b", "deepspeed")], {"deepspeed": ("a", "b")}),  # each node runs it
    ("pdsh", [("a", "deepspeed"), ("b", "deepspeed")], {"deepspeed": ("a",)}),  # the head alone runs it
    ("pdsh", [("a", "pdsh"), ("b", "pdsh")], {"pdsh": ("a",)}),  # the head's runner looks for pdsh
])
def test_job010_fails_a_program_the_launch_runs_by_name_that_a_node_lacks(multinode_launcher, missing, failing):
    ctx = context(accelerate_nodes(multinode_launcher, missing), ACCELERATE, launching=True)
    failed = {r.evidence["program"]: r.nodes for r in by_id(ctx, "JOB010") if r.status is Status.FAIL}
    assert failed == failing
    name = next(iter(failing))
    [result] = [r for r in by_id(ctx, "JOB010") if r.status is Status.FAIL]
    assert f"{name} is not found on the non-interactive SSH PATH" in result.message


@pytest.mark.parametrize("multinode_launcher", ["nossh", "pdsh", "standard"])
def test_job010_passes_when_every_program_the_launch_runs_is_found(multinode_launcher):
    ctx = context(accelerate_nodes(multinode_launcher), ACCELERATE, launching=True)
    assert {r.status for r in by_id(ctx, "JOB010")} == {Status.PASS}


def test_job010_asks_nothing_of_deepspeed_where_accelerate_does_not_run_it():
    """'standard' is torchrun on each machine: no `deepspeed` by name (prepare_deepspeed_cmd_env)."""
    ctx = context(accelerate_nodes("standard", [("a", "deepspeed"), ("b", "deepspeed"), ("a", "pdsh")]), ACCELERATE,
                  launching=True)
    assert {r.status for r in by_id(ctx, "JOB010")} == {Status.PASS}


def test_job010_fails_the_backend_deepspeeds_own_runner_needs_on_the_head():
    command = ["deepspeed", "--hostfile", "hostfile", "--launcher", "openmpi", "t.py"]
    nodes = {n: facts(command, programs=("deepspeed", "python3", "ompi_info")) for n in ("a", "b")}
    assert {r.status for r in by_id(context(nodes, command, launching=True), "JOB010")} == {Status.PASS}
    nodes["a"]["facts"]["job"]["programs"]["ompi_info"] = program("ompi_info", found=False)
    failed = [r for r in by_id(context(nodes, command, launching=True), "JOB010") if r.status is Status.FAIL]
    assert [(r.evidence["program"], r.nodes) for r in failed] == [("ompi_info", ("a",))]


@pytest.mark.parametrize("command", [["bash", "run.sh"], ["./run.sh"]])
def test_job010_never_advises_a_shell_or_a_wrapper_as_the_python(command):
    """`launch -- bash run.sh`: the wrapper starts its own Python; --python is never the shell (the first hour)."""
    nodes = {n: facts(command, programs=()) for n in ("a", "b")}
    shell = {"name": command[0], "path": "/usr/bin/bash" if command[0] == "bash" else "/job/run.sh",
             "real": "/usr/bin/bash" if command[0] == "bash" else "/job/run.sh",
             "interpreter": None if command[0] == "bash" else "/usr/bin/bash"}
    for node in nodes.values():
        node["facts"]["job"]["programs"][command[0]] = shell
    plan = build_plan(nodes=tuple(nodes), command=tuple(command), launching=True, python="/venv/bin/python3")
    ctx = runner.CheckContext(plan, nodes, {"job": jobview.launches(plan, nodes, HEAD), "head": {"address": HEAD}})
    found = by_id(ctx, "JOB010")
    assert {r.status for r in found} == {Status.PASS}, [(r.message, r.remediation) for r in found]
    assert "wrapper" in found[0].message and not any("--python" in (r.remediation or "") for r in found)


def test_job010_still_names_the_python_a_launcher_runs_when_it_is_not_the_one_given():
    command = ["accelerate", "launch", "t.py"]
    nodes = {n: facts(command, programs=("accelerate",)) for n in ("a", "b")}
    for node in nodes.values():
        node["facts"]["job"]["programs"]["accelerate"]["interpreter"] = "/other/bin/python3"
    plan = build_plan(nodes=tuple(nodes), command=tuple(command), launching=True, python="/venv/bin/python3")
    ctx = runner.CheckContext(plan, nodes, {"job": jobview.launches(plan, nodes, HEAD), "head": {"address": HEAD}})
    [warned] = [r for r in by_id(ctx, "JOB010") if r.status is Status.WARN]
    assert warned.remediation == "pass --python /other/bin/python3"
