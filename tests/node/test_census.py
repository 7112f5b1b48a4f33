"""The census of a running job (preflight.node.census, node side) and its model (preflight.job.running), without a
cluster: a real process on this machine, /proc's formats, stacks as py-spy reports them, hostile census facts."""
import os
import signal
import subprocess
import sys
import time

import pytest

from own_network import own_network
from preflight import registry, runner
from preflight.node import census, procfs
from preflight.job import running as jobcensus
from preflight.plan import build_plan
from preflight.result import Status

# Censuses of this machine's processes on fixed ports (29984-29993): one at a time (tests/workers.py).
pytestmark = pytest.mark.machine


def test_proc_net_tcp_addresses():
    assert procfs.address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert procfs.address("0B004D0A:7149") == ("10.77.0.11", 29001)
    assert procfs.address("00000000000000000000000001000000:0016") == ("::1", 22)
    assert procfs.address("0000000000000000FFFF00000B004D0A:7149") == ("10.77.0.11", 29001)
    assert procfs.address("nonsense") == ("nonsense", None)


def frames(*names, user=("train.py", 12)):
    lib = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    return [[n, lib, 100] for n in names] + [["<module>", f"/job/{user[0]}", user[1]]]


@pytest.mark.parametrize("threads, phase, op", [
    ([{"name": "MainThread", "active": False, "frames": frames("all_reduce", "wrapper")}], "collective", "all_reduce"),
    ([{"name": "MainThread", "active": False, "frames": frames("_store_based_barrier", "init_process_group")}],
     "init_process_group", None),
    ([{"name": "MainThread", "active": False, "frames": frames("SimpleElasticAgent._rendezvous")}], "rendezvous", None),
    ([{"name": "MainThread", "active": False, "frames": frames()}], "idle", None),
    ([{"name": "MainThread", "active": True, "frames": frames()}], "busy", None),
    ([{"name": "Thread-1", "active": False, "frames": frames()},
      {"name": "MainThread", "active": False, "frames": frames("barrier")}], "collective", "barrier"),
    (None, "unknown", None), ("nonsense", "unknown", None), ([{"frames": [1, [None]]}], "idle", None),
])
def test_where_a_stack_stands(threads, phase, op):
    found = jobcensus.where(threads)
    assert (found.phase, found.op) == (phase, op)
    if phase in ("collective", "idle", "busy") and threads and isinstance(threads[-1].get("frames")[-1], list) \
            and threads[-1]["frames"][-1][0] == "<module>":
        assert found.at == "train.py:12 (<module>)"


def test_a_real_rank_on_this_machine_is_found_with_its_variables_and_stack(tmp_path):
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29987",
               HF_TOKEN="hf_secret_value", NCCL_DEBUG="INFO")
    script = tmp_path / "rank.py"
    script.write_text("import time\ndef wait():\n    time.sleep(60)\nwait()\n")
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        time.sleep(0.5)
        found = census.take_census({"port": 29987, "deadline_s": 8, "interval_s": 0.3})
        [rank] = [p for p in found["processes"] if p["pid"] == proc.pid]
        assert rank["kind"] == "rank" and rank["env"]["RANK"] == "1" and rank["env"]["NCCL_DEBUG"] == "INFO"
        assert "HF_TOKEN" not in rank["env"] and "hf_secret_value" not in repr(found)
        other = census.take_census({"port": 29988, "deadline_s": 2, "stacks": False})
        assert proc.pid not in [p["pid"] for p in other["processes"]]  # another job's port
        assert found["stacks"].get("tool"), found["stacks"]  # py-spy is installed with preflight
        assert rank["stable"] is True
        where = jobcensus.where(rank["threads"])
        assert (where.phase, where.at) == ("idle", "rank.py:3 (wait)")
        assert proc.poll() is None  # read, not touched
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("raw", [
    {"processes": "x"}, {"processes": [1, None, {"pid": "7"}, {"pid": 3, "argv": [None, 5], "env": [],
                                                              "sockets": "x", "threads": {"a": 1}}]},
    {"processes": [{"pid": 4, "kind": "launcher", "argv": ["torchrun", "--nnodes"], "config": {"text": "[1"}}]},
    {"processes": [{"pid": 5, "kind": "launcher", "argv": ["accelerate", "launch", "t.py"],
                    "config": {"path": "/c.yaml", "text": "machine_rank: x\n"}}], "stacks": [], "listeners": [1]},
    None, "census",
])
def test_a_node_that_sends_a_census_of_the_wrong_shape_is_no_crash(raw):
    facts = {"a": {"facts": {"census": raw, "host": 3}, "error": None, "clock": None},
             "b": {"facts": None, "error": {"kind": "timeout", "message": "timed out"}, "clock": None}}
    plan = build_plan(nodes=("a", "b"))
    model = jobcensus.build(plan.nodes, facts, 29500)
    ctx = runner.CheckContext(plan, facts, {"census": model})
    for spec in registry.load().checks:
        if spec.family == "RUN":
            for result in runner.run_check(spec, ctx):
                assert result.status != Status.ERROR, (spec.id, result.message)


def test_several_jobs_are_said_and_each_ranks_gpu_is_shown():
    def rank(pid, port):
        return {"pid": pid, "kind": "rank", "argv": ["python", "t.py"], "state": "S",
                "env": {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(port), "MASTER_ADDR": "a"}}

    gpus = {"available": True, "devices": [{"index": 0, "processes": [{"pid": 11, "used_memory_bytes": 3 * 2**30}]},
                                           {"index": 1, "processes": [{"pid": 12, "used_memory_bytes": None}]}]}
    facts = {"a": {"facts": {"census": {"processes": [rank(11, 29500), rank(12, 29600)]}, "gpus": gpus},
                   "error": None, "clock": None}}
    plan = build_plan(nodes=("a",))
    model = jobcensus.build(plan.nodes, facts, None)
    results = runner.run_check(registry.load().get("RUN001"), runner.CheckContext(plan, facts, {"census": model}))
    [several] = [r for r in results if r.status == Status.WARN]
    assert "2 jobs run on these nodes (port 29500 on a; port 29600 on a)" in several.message
    [census_rows] = [r.evidence["census"] for r in results if r.status == Status.PASS]
    assert [row["gpu"] for row in census_rows] == ["0 (3.0 GiB)", "1"]


def test_the_processes_of_a_node_are_found_as_they_are_added():
    # Census.on indexes the processes by node once they are in; one added later is found too
    def proc(node, pid, kind):
        return jobcensus.Proc(node=node, pid=pid, kind=kind, argv=[], state="S", age_s=1.0, cpu_percent=0.0, env={},
                              sockets=[], children=[], where=jobcensus.where(None))

    found = jobcensus.Census(["n1", "n2"])
    found.procs.append(proc("n1", 10, "launcher"))
    assert [p.pid for p in found.on("n1")] == [10] and found.on("n2") == []
    found.procs += [proc("n2", 20, "rank"), proc("n1", 11, "rank")]
    assert [p.pid for p in found.on("n1")] == [10, 11] and [p.pid for p in found.on("n1", "rank")] == [11]
    assert [p.pid for p in found.on("n2", "rank")] == [20]


RANK_WITH_HELPER = '''
import os, socket, sys, time
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(128)
port = server.getsockname()[1]
clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
accepted = [server.accept()[0] for _ in range(40)]
helper = os.fork()  # as a DataLoader worker: a copy of the rank, with its RANK
if helper == 0:
    time.sleep(60)
    os._exit(0)
print(helper, flush=True)
time.sleep(60)
'''


def test_a_ranks_census_keeps_its_arguments_redacted_its_helpers_apart_and_says_what_it_cut(tmp_path):
    """A rank that forks a helper (as DataLoader workers are made) and holds 81 sockets, with a password in a long
    argument, an empty argument and a secret option: the helper is not a rank, the listener is kept among the
    64 sockets and the 17 others are counted, the password is redacted before the argument is cut."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_WITH_HELPER)
    long_url = "--dataset=" + "x" * 174 + "https://user:hunter2@example.org/x"  # the node's cut: after "hun"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29989")
    proc = subprocess.Popen([sys.executable, str(script), "", long_url, "--token", "abc"], env=env,
                            stdout=subprocess.PIPE)
    try:
        helper = int(proc.stdout.readline())
        found = census.take_census({"port": 29989, "deadline_s": 4, "stacks": False})
        by_pid = {p["pid"]: p for p in found["processes"]}
        assert proc.pid in by_pid and helper not in by_pid, sorted(by_pid)
        rank = by_pid[proc.pid]
        assert rank["argv"][2] == "" and rank["argv"][4:] == ["--token", "<redacted>"], rank["argv"]
        assert len(rank["argv"][3]) == census.MAX_ARG and rank["argv"][3].endswith("https://<redacte")
        assert "hunter2" not in repr(found) and "user:hun" not in repr(found)
        assert len(rank["sockets"]) == census.MAX_SOCKETS and rank["sockets_dropped"] == 81 - census.MAX_SOCKETS
        assert rank["sockets"][0]["state"] == "LISTEN"
        assert found["processes_dropped"] == 0 and found["pids"] == []
    finally:
        proc.kill()
        proc.wait()
        try:
            os.kill(helper, signal.SIGKILL)
        except (NameError, ProcessLookupError):
            pass


@pytest.mark.parametrize("flags, missing", [
    (["--include", "a@b"], []), (["--exclude", "c"], []), (["--num_nodes", "2"], []), (["--include", "a:0@c"], ["c"]),
    ([], ["c"]),
])
def test_the_hosts_a_deepspeed_filter_leaves_out_are_not_missing(flags, missing):
    """DeepSpeed's runner on node a, its hostfile a, b, c, the job's ranks on a and b: a host its --include,
    --exclude or --num_nodes leave out is not a node where the job was never started; a host it uses is."""
    def proc(pid, argv, kind="rank", **env):
        return {"pid": pid, "ppid": 1, "kind": kind, "argv": argv, "state": "S", "env": env}

    deepspeed = proc(10, ["/venv/bin/python", "/venv/bin/deepspeed", "--hostfile", "hostfile", *flags, "--master_addr",
                       "a", "--master_port", "29500", "train.py"], kind="launcher")
    on = {"a": [deepspeed, proc(11, ["python", "train.py"], RANK="0", MASTER_PORT="29500")],
          "b": [proc(12, ["python", "train.py"], RANK="1", MASTER_PORT="29500")], "c": []}
    facts = {node: {"facts": {"census": {"processes": on.get(node, [])}}, "error": None, "clock": None}
             for node in ("a", "b", "c")}
    plan = build_plan(nodes=("a", "b", "c"))
    model = jobcensus.build(plan.nodes, facts, 29500)
    results = runner.run_check(registry.load().get("RUN001"), runner.CheckContext(plan, facts, {"census": model}))
    failed = [r for r in results if r.status == Status.FAIL]
    assert [list(r.nodes) for r in failed] == ([missing] if missing else []), [r.message for r in results]


def test_a_shell_wrapper_holding_the_ranks_variables_is_not_a_rank(tmp_path):
    """`RANK=0 bash run.sh` (as SLURM and hand-written wrappers start a rank): the shell has the rank's variables
    in its environment, as its python child does; the python process is the rank, the shell is not a second one."""
    script = tmp_path / "rank.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29991")
    with own_network():  # the census sees this job alone, not another on this machine
        shell = subprocess.Popen(["bash", "-c", f"{sys.executable} {script}; true"], env=env, stdout=subprocess.PIPE)
        try:
            assert shell.stdout.readline().strip() == b"up"
            found = census.take_census({"port": 29991, "deadline_s": 4, "stacks": False})
            ranks = [p for p in found["processes"] if p["kind"] == "rank"]
            assert [os.path.basename(p["argv"][0]) for p in ranks] == [os.path.basename(sys.executable)], ranks
            assert shell.pid not in [p["pid"] for p in found["processes"]]
        finally:
            for child in [pid for pid in procfs.pids() if procfs.parent(pid) == shell.pid]:
                os.kill(child, signal.SIGKILL)
            shell.kill()
            shell.wait()


def test_a_launchers_long_command_line_comes_whole_and_a_ranks_says_what_it_cut(tmp_path):
    """A launcher with 300 words and a 1,000-character path (as accelerate launch with every FSDP option spelled
    out): the head reads its options, so it comes whole; a rank's command line is only shown, cut at MAX_ARGS
    words, and the node says how many words it did not send."""
    launcher = tmp_path / "torchrun"  # a launcher by its name, as /proc shows a console script
    launcher.write_text("import os, subprocess, sys, time\n"
                        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'] + ['--x'] * 100,"
                        " env=dict(os.environ, RANK='0', WORLD_SIZE='1', MASTER_PORT='29993'))\n"
                        "print(child.pid, flush=True)\ntime.sleep(60)\n")
    long_path = "/data/" + "d" * 1000 + "/ds.json"
    words = ["--nnodes", "1", "--master_port", "29993"] + ["--tee", "3"] * 148 + ["train.py", "--deepspeed", long_path]
    proc = subprocess.Popen([sys.executable, str(launcher), *words], stdout=subprocess.PIPE)
    try:
        rank_pid = int(proc.stdout.readline())
        found = census.take_census({"port": 29993, "deadline_s": 4, "stacks": False})
        by_pid = {p["pid"]: p for p in found["processes"]}
        assert by_pid[proc.pid]["kind"] == "launcher" and by_pid[proc.pid]["argv"][2:] == words
        assert by_pid[proc.pid]["argv_dropped"] == 0
        rank = by_pid[rank_pid]
        assert len(rank["argv"]) == census.MAX_ARGS and rank["argv_dropped"] == 103 - census.MAX_ARGS
    finally:
        for child in [pid for pid in procfs.pids() if procfs.parent(pid) == proc.pid]:
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_a_launchers_line_is_cut_only_between_whole_words_and_within_the_census_budget():
    """The head parses a launcher's words: each comes whole or not at all, and the cut is counted. The budget is
    the JSON the agent writes (a non-ASCII character costs six bytes), per launcher and per census."""
    words = ["/venv/bin/torchrun"] + ["--tee", "3"] * 600 + ["train.py"]  # 1,202 words
    assert census._launcher_words(words, [0]) == words[:census.MAX_LAUNCHER_ARGS]
    hosts = ",".join(f"node{i:04d}" for i in range(600))  # 5,399 characters: longer than a word may be
    deepspeed = ["/venv/bin/python", "/venv/bin/deepspeed", "--include", hosts, "train.py"]
    assert census._launcher_words(deepspeed, [0]) == deepspeed[:3]  # the long value is not sent cut
    wide = ["/venv/bin/torchrun"] + ["\u00e9" * 4000] * 40  # 4,000 characters, 24,002 bytes of JSON each
    assert census._launcher_words(wide, [0]) == wide[:3]  # two fit in 64 KiB
    spent = [census.MAX_LAUNCHERS_TEXT - 10]  # the census's other launchers took nearly all of it
    assert census._launcher_words(["/venv/bin/torchrun", "--nnodes", "2", "--node_rank", "1", "t.py"], spent) == \
        ["/venv/bin/torchrun", "--nnodes", "2", "--node_rank"]  # the words that name it, always
    launcher = {"pid": 10, "ppid": 1, "kind": "launcher", "argv": deepspeed[:3], "argv_dropped": 2, "state": "S",
                "env": {}}
    proc = jobcensus._proc("a", launcher)
    assert proc.launcher == "deepspeed" and jobcensus.job_of(proc) is None


def test_a_launcher_cut_before_its_script_has_no_options_the_head_takes_for_known():
    """A node that cut a launcher's command line before its script (words it did not send): the head takes
    neither its rank, nodes and port from what came nor its command as another job's; cut after the script,
    the launcher's own options are all there and are read."""
    torchrun = ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes", "2", "--node_rank", "1", "--master_addr", "a",
                "--master_port", "29500"]

    def launcher(argv, dropped):
        return {"pid": 10, "ppid": 1, "kind": "launcher", "argv": argv, "argv_dropped": dropped, "state": "S",
                "env": {}, "age_s": 100.0}

    cut = jobcensus._proc("b", launcher(torchrun, 500))
    assert (cut.launcher, cut.node_rank, cut.nnodes, cut.master_port, cut.rdzv) == ("torchrun", None, None, None, None)
    assert jobcensus.job_of(cut) is None
    after_script = jobcensus._proc("b", launcher(torchrun + ["train.py", "--lr"], 500))
    assert (after_script.node_rank, after_script.nnodes, after_script.master_port) == (1, "2", 29500)
    assert jobcensus.job_of(after_script) is not None
    whole = jobcensus._proc("b", launcher(torchrun, 0))  # no script, nothing cut: as its parser reads it
    assert (whole.node_rank, whole.master_port) == (1, 29500)


def test_an_old_launcher_whose_command_line_was_cut_is_not_called_another_job():
    """RUN008 names a launcher holding the port, much older than the other nodes', as another job only when its
    command is known to differ: one cut before its script by its node is not."""
    def launcher(node_rank, argv_tail, dropped, age):
        argv = ["/venv/bin/torchrun", "--nnodes", "2", "--node_rank", str(node_rank), "--master_addr", "a",
                "--master_port", "29500", *argv_tail]
        return {"pid": 10 + node_rank, "ppid": 1, "kind": "launcher", "argv": argv, "argv_dropped": dropped,
                "state": "S", "env": {}, "age_s": age,
                "sockets": [{"local": "0.0.0.0", "local_port": 29500, "remote": "0.0.0.0", "remote_port": 0,
                             "state": "LISTEN"}] if node_rank == 0 else []}

    def run008(head_tail, dropped):
        facts = {"a": {"facts": {"census": {"processes": [launcher(0, head_tail, dropped, 300.0)]}}, "error": None,
                       "clock": None},
                 "b": {"facts": {"census": {"processes": [launcher(1, ["train.py"], 0, 10.0)]}}, "error": None,
                       "clock": None}}
        plan = build_plan(nodes=("a", "b"))
        model = jobcensus.build(plan.nodes, facts, 29500)
        return runner.run_check(registry.load().get("RUN008"), runner.CheckContext(plan, facts, {"census": model}))

    assert [r.status for r in run008(["other.py"], 0)] == [Status.FAIL]  # known to be another command: named
    assert [r.status for r in run008(["--max_restarts", "3"], 900)] == [Status.PASS]  # cut: not known to differ


def test_an_elastic_launcher_cut_before_its_script_stays_in_the_job_on_its_port():
    """An elastic torchrun whose node cut its line before its script: its ranks' MASTER_PORT is its store's own
    port, not the rendezvous port, so it is not taken for its port, and doctor --port keeps the launcher and its
    ranks in the job instead of calling the node one where the job never started; a DeepSpeed runner cut before
    its filter leaves every node in use."""
    def node(pid, argv, dropped):
        return [{"pid": pid, "ppid": 1, "kind": "launcher", "argv": argv, "argv_dropped": dropped, "state": "S",
                 "env": {}, "children": [pid + 1]},
                {"pid": pid + 1, "ppid": pid, "kind": "rank", "argv": ["python", "train.py"], "state": "S",
                 "env": {"RANK": "0", "GROUP_RANK": "0", "MASTER_PORT": "41234", "TORCHELASTIC_RUN_ID": "j"}}]

    elastic = ["/venv/bin/torchrun", "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "a:29400"]
    facts = {"a": {"facts": {"census": {"processes": node(10, elastic + ["train.py"], 0)}}, "error": None,
                   "clock": None},
             "b": {"facts": {"census": {"processes": node(20, elastic, 900)}}, "error": None, "clock": None}}
    model = jobcensus.build(["a", "b"], facts, 29400)
    assert sorted((p.node, p.pid) for p in model.procs) == [("a", 10), ("a", 11), ("b", 20), ("b", 21)]
    [cut] = [p for p in model.launchers if p.node == "b"]
    assert cut.master_port is None and cut.rdzv is None
    deepspeed = {"pid": 30, "ppid": 1, "kind": "launcher", "argv": ["/venv/bin/deepspeed", "--include"],
                 "argv_dropped": 2, "state": "S", "env": {}}
    whole = {"pid": 40, "ppid": 1, "kind": "launcher", "state": "S", "env": {}, "argv_dropped": 0,
             "argv": ["/venv/bin/deepspeed", "--include", "a", "train.py"]}
    facts = {n: {"facts": {"census": {"processes": procs}}, "error": None, "clock": None}
             for n, procs in (("a", [whole]), ("b", [deepspeed]), ("c", []))}
    assert jobcensus.hosts_in_use(jobcensus.build(["a", "b", "c"], facts, None)) == {"a", "b", "c"}


def _doctor(check_id, on, head_first=("a", "b")):
    """One RUN check over hostile census facts: {node: [process, ...]}, the nodes in the order doctor was given them."""
    facts = {node: {"facts": {"census": {"processes": on.get(node, [])},
                              "host": {"hostname": node, "interfaces": {"eth0": [f"10.0.0.{i + 1}"]}}},
                    "error": None, "clock": None} for i, node in enumerate(sorted(on))}
    plan = build_plan(nodes=head_first)
    plan = plan.__class__(**{**plan.__dict__, "remote": True})
    ctx = runner.CheckContext(plan, facts, {"census": jobcensus.build(plan.nodes, facts, 29500)})
    return runner.run_check(registry.load().get(check_id), ctx)


def _launcher(pid, argv, listens=False, age=10.0, **item):
    sockets = [{"local": "0.0.0.0", "local_port": 29500, "remote": "0.0.0.0", "remote_port": 0, "state": "LISTEN"}]
    return {"pid": pid, "ppid": 1, "kind": "launcher", "argv": argv, "argv_dropped": 0, "state": "S", "age_s": age,
            "sockets": sockets if listens else [], **item}


TORCHRUN = ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes", "2", "--master_port", "29500"]
HEAD = _launcher(10, [*TORCHRUN, "--node_rank", "0", "--master_addr", "a", "train.py"], listens=True, env={})
CONFIG = "/root/.cache/huggingface/accelerate/default_config.yaml"


def _accelerate(pid, main_ip, flags=()):
    text = ("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 2\n"
            f"machine_rank: 1\nmain_process_ip: {main_ip}\nmain_process_port: 29500\nrdzv_backend: static\n")
    return _launcher(pid, ["/venv/bin/python", "/venv/bin/accelerate", "launch", *flags, "train.py"], env={},
                     config={"path": CONFIG, "text": text, "default": True})


@pytest.mark.parametrize("worker, said, fix", [
    (_launcher(20, [*TORCHRUN, "--node_rank", "1", "train.py"], env={}),
     "b pid 20: torchrun was started without --master_addr (its default is 127.0.0.1), that is b itself: as node "
     "rank 1 of 2 it waits for a store on b", "stop pid 20 and start torchrun on b with --master_addr a"),
    (_launcher(20, [*TORCHRUN, "--node-rank=1", "--master-addr=localhost", "train.py"], env={}),
     "torchrun was started with --master_addr localhost", "start torchrun on b with --master_addr a"),
    (_launcher(20, [*TORCHRUN, "train.py"], env={"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "127.0.0.1"}),
     "PET_MASTER_ADDR=127.0.0.1 in torchrun's environment", "set PET_MASTER_ADDR=a on b"),
    (_accelerate(20, "127.0.0.1"), f"main_process_ip is 127.0.0.1 in its accelerate config ({CONFIG}:6)",
     f"set main_process_ip: a in {CONFIG} on b (or start it with --main_process_ip a)"),
    (_accelerate(20, "a", ["--main_process_ip", "127.0.0.1"]), "accelerate was started with --main_process_ip 127.0.0.1",
     "start accelerate on b with --main_process_ip a"),
])
@pytest.mark.parametrize("head_first", [("a", "b"), ("b", "a")])
def test_a_worker_at_a_loopback_master_is_named_with_what_gave_it(worker, said, fix, head_first):
    """A worker (node rank 1 of 2) whose master address is loopback waits for a store on itself: RUN003 names it,
    its pid and what gave it the address (torchrun's default without --master_addr, a flag, PET_MASTER_ADDR,
    accelerate's config key), with the head's address to give instead; never the head, whichever node doctor
    was given first (a tie of two nodes went to the first: the head was blamed)."""
    results = _doctor("RUN003", {"a": [HEAD], "b": [worker]}, head_first)
    [failed] = [r for r in results if r.status == Status.FAIL]
    assert failed.nodes == ("b",) and said in failed.message and fix in failed.remediation, failed
    assert [r.nodes for r in results if r.status == Status.PASS] == [("a",)]


@pytest.mark.parametrize("on", [
    # the head itself at 127.0.0.1 hosts the store (node rank 0), reachable at its own address
    {"a": [_launcher(10, [*TORCHRUN, "--node_rank", "0", "train.py"], listens=True, env={})],
     "b": [_launcher(20, [*TORCHRUN, "--node_rank", "1", "--master_addr", "a", "train.py"], env={})]},
    # torchrun's default is 127.0.0.1 only without PET_MASTER_ADDR; unread, the environment could have set it
    {"a": [HEAD], "b": [_launcher(20, [*TORCHRUN, "--node_rank", "1", "train.py"], env={"PET_MASTER_ADDR": "a"})]},
    {"a": [HEAD], "b": [_launcher(20, [*TORCHRUN, "--node_rank", "1", "train.py"], env=None)]},
    # two launchers of one job on one machine meet on loopback
    {"a": [_launcher(10, [*TORCHRUN, "--node_rank", "0", "train.py"], listens=True, env={}),
           _launcher(11, [*TORCHRUN, "--node_rank", "1", "train.py"], env={})]},
    # one node: 127.0.0.1 is the head
    {"a": [_launcher(10, ["/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], listens=True, env={})]},
])
def test_a_loopback_master_that_is_the_head_or_not_known_is_no_failure(on):
    results = _doctor("RUN003", on, tuple(sorted(on)))
    assert [r.status for r in results] == [Status.PASS], [r.message for r in results]


def _torchrun(pid, flags, script="train.py", listens=False, age=10.0):
    return _launcher(pid, ["/venv/bin/python", "/venv/bin/torchrun", *flags, "--master_port", "29500", script],
                     listens=listens, age=age, env={})


WORKER = ["--nnodes", "2", "--node_rank", "1", "--master_addr", "a", "--nproc-per-node", "1"]


@pytest.mark.parametrize("holder", [
    _torchrun(10, ["--nnodes=2", "--node-rank=0", "--master-addr=a", "--max-restarts=3"], listens=True, age=300.0),
    _torchrun(10, ["--nnodes", "2:2", "--node_rank", "0", "--master_addr", "a"], "/job/train.py", True, 300.0),
    # accelerate's --num_machines 2 and --num_processes 2 are torchrun's --nnodes 2 --nproc-per-node 1 (utils/launch.py,
    # prepare_multi_gpu_env); its config file says the rest
    dict(_accelerate(10, "a", ["--num_machines", "2", "--num_processes", "2", "--machine_rank", "0"]),
         sockets=HEAD["sockets"], age_s=300.0),
])
def test_a_port_holder_whose_job_is_only_spelled_otherwise_is_not_another_job(holder):
    """The head's launcher, started long before its worker, with the same job spelled otherwise (--nnodes=2,
    --nnodes 2:2, a path to the same script, accelerate's --num_machines): no other job holds the port, and the
    nodes agree."""
    on = {"a": [holder], "b": [_torchrun(20, WORKER)]}
    assert [r.status for r in _doctor("RUN008", on)] == [Status.PASS]
    assert [r.status for r in _doctor("RUN003", on)] == [Status.PASS]


@pytest.mark.parametrize("flags, script, differs", [
    (["--nnodes", "3"], "train.py", "its job (nodes 3, world size 3) is not the other nodes' (nodes 2, world size 2)"),
    (["--nnodes", "2", "--nproc-per-node", "2"], "train.py", "its job (world size 4) is not the other nodes' (world size 2)"),
    (["--nnodes", "2"], "old.py", "its job (script old.py) is not the other nodes' (script train.py)"),
])
def test_a_port_holder_of_another_job_is_named_whatever_its_age(flags, script, differs):
    """A launcher left from an earlier run holds the port, 2 s older than the new job's worker (under RUN008's 30 s):
    its nodes, world size or script are not the worker's, so it is another job (RUN008), not a node that disagrees
    (RUN003)."""
    holder = _torchrun(10, [*flags, "--node_rank", "0", "--master_addr", "a"], script, listens=True, age=12.0)
    on = {"a": [holder], "b": [_torchrun(20, WORKER)]}
    [held] = _doctor("RUN008", on)
    assert held.status == Status.FAIL and held.nodes == ("a",) and "pid 10" in held.message, held
    assert "held by an older job" in held.message and differs in held.message, held.message
    assert "stop pid 10 on a" in held.remediation
    assert [r.status for r in _doctor("RUN003", on)] == [Status.PASS]
