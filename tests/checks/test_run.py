"""RUN: `preflight doctor` against REAL stuck jobs on the test cluster: torchrun and `accelerate launch` with gloo
on the CPU, 3 nodes, each fault made the way users make it. Each diagnosis must name the right family,
nodes and ranks within 10 s, a healthy running job must give no false alarm, and the job must be left
running, untouched (the tests check its processes afterwards)."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import transcripts
from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from healthy_jobs import end, start_on, tails

pytestmark = pytest.mark.cluster

VENV = Path(sys.executable).parent
SCRIPT = '''
import datetime, os, pathlib, time
rank = int(os.environ["RANK"])
marks, mode = pathlib.Path(os.environ["PF_MARKS"]), os.environ.get("PF_MODE", "")
(marks / f"{rank}.pid").write_text(str(os.getpid()))
if mode == f"sleep-before-init:{rank}":
    (marks / f"{rank}-sleeping").touch()
    time.sleep(900)
import torch, torch.distributed as dist
(marks / f"{rank}-init").touch()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
t = torch.ones(1)
if os.environ.get("PF_LOADER"):  # a DataLoader whose 2 workers (processes that inherit RANK) stay alive
    loader = iter(torch.utils.data.DataLoader(list(range(64)), batch_size=2, num_workers=2, persistent_workers=True))
    next(loader)
    (marks / f"{rank}-loader").touch()
if os.environ.get("PF_DIAL"):  # a connection to an address nobody answers (not the master)
    import socket
    dial = socket.socket()
    dial.setblocking(False)
    dial.connect_ex((os.environ["PF_DIAL"], 8080))
if mode == f"sleep:{rank}":
    (marks / f"{rank}-sleeping").touch()
    time.sleep(900)
if mode == "loop":
    (marks / f"{rank}-loop").touch()
    while True:
        dist.all_reduce(t)
        time.sleep(0.02)
if mode == "busy":
    (marks / f"{rank}-busy").touch()
    big = torch.ones(1 << 22)
    while True:
        dist.all_reduce(big)
(marks / f"{rank}-collective").touch()
dist.all_reduce(t)
time.sleep(900)
'''

LINES = SCRIPT.splitlines()
SLEEP_LINE = next(i for i, line in enumerate(LINES, 1) if "time.sleep(900)" in line and "sleep:" in LINES[i - 3])
REDUCE_LINE = max(i for i, line in enumerate(LINES, 1) if line.strip() == "dist.all_reduce(t)")


class Jobs:
    """Jobs started on the nodes as a user's launch would run there; every process ended at the end."""

    def __init__(self, cluster, tmp_path):
        self.cluster, self.tmp = cluster, tmp_path
        self.script = tmp_path / "train.py"
        self.script.write_text(SCRIPT)
        self.marks = tmp_path / "marks"
        self.marks.mkdir()
        self.started = []

    def torchrun(self, node, node_rank, port, nnodes=3, master="node01", mode="", script=None, flags=None,
                 args=(), **env):
        """torchrun with these flags (or the usual ones for this node rank), the script, and its args."""
        if flags is None:
            flags = ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--master_addr", master,
                     "--master_port", str(port), "--nproc-per-node", "1", "--max-restarts", "0"]
        return self._start(node, [str(VENV / "torchrun"), *flags, str(script or self.script), *args], mode, **env)

    def accelerate(self, node, port, machine_rank, mode="", machines=3, head="node01", **env):
        """`accelerate launch` with this node's own default config (its HF_HOME), as after `accelerate config`."""
        home = self.tmp / f"hf-{node}"
        (home / "accelerate").mkdir(parents=True, exist_ok=True)
        config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "use_cpu": True,
                  "num_machines": machines, "machine_rank": machine_rank, "num_processes": machines,
                  "main_process_ip": head, "main_process_port": port, "mixed_precision": "no", "rdzv_backend": "static"}
        (home / "accelerate" / "default_config.yaml").write_text(yaml.safe_dump(config))
        return self._start(node, [str(VENV / "accelerate"), "launch", str(self.script)], mode, HF_HOME=str(home), **env)

    def _start(self, node, argv, mode, **env):
        proc = start_on(self.cluster, node, argv, self.tmp / f"{node}-{len(self.started)}.log",
                        PF_MARKS=str(self.marks), PF_MODE=mode, **env)
        self.started.append(proc)
        return proc

    def wait_for(self, *names, timeout=120):
        deadline = time.monotonic() + timeout
        while not all((self.marks / n).exists() for n in names):
            dead = [p for p in self.started if p.poll() is not None]
            assert time.monotonic() < deadline, f"the job did not reach {names}: {self.logs()}"
            assert not dead or len(dead) < len(self.started), f"every launcher exited: {self.logs()}"
            time.sleep(0.2)
        time.sleep(1.5)  # from the mark to the blocking call

    def listening(self, node, port):
        return f":{port} " in self.cluster.netns_exec(node, ["ss", "-Hltn"]).stdout

    def wait_listening(self, node, port, timeout=60):
        deadline = time.monotonic() + timeout
        while not self.listening(node, port):
            assert time.monotonic() < deadline, f"nothing listens on {node}:{port}: {self.logs()}"
            time.sleep(0.2)

    def rank_pids(self):
        return {int(p.name.split(".")[0]): int(p.read_text()) for p in self.marks.glob("*.pid")}

    def untouched(self, launchers, ranks):
        """The launchers and ranks the test left running are alive and not stopped (doctor signals nothing)."""
        for proc in launchers:
            assert proc.poll() is None, f"a launcher exited: {self.logs()}"
        for pid in ranks:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state in ("S", "R", "D"), f"rank pid {pid} is in state {state}"

    def logs(self):
        return tails(self.tmp, "*.log", 600)

    def stop(self):
        end(self.started, list(self.rank_pids().values()))


# Run, in this same process, the command read on stdin: [argv, variables to add].
EXEC_WHEN_TOLD = ("import json, os, sys; argv, env = json.loads(sys.stdin.readline()); "
                  "os.execve(argv[0], argv, dict(os.environ, **env))")


@pytest.fixture(scope="module", autouse=True)
def older_process(cluster_up, tmp_path_factory):
    """(process, when it was forked) on node01, forked as the module starts and idle (neither a launcher nor a
    rank to the census) until the old job's test has it exec that job's launcher. A process's start time is its
    fork's, so by then it is older than the launchers that test starts by the other tests' run time: RUN008's
    30 s are taken from them instead of waited out."""
    log = tmp_path_factory.mktemp("older") / "node01.log"
    with open(log, "wb") as out:
        proc = cluster_up.node_popen("node01", [sys.executable, "-c", EXEC_WHEN_TOLD], stdin=subprocess.PIPE,
                                     stdout=out, stderr=subprocess.STDOUT)
    forked = time.monotonic()
    try:
        yield proc, forked
    finally:
        end([proc], [])


@pytest.fixture
def jobs(cluster, tmp_path):
    started = Jobs(cluster, tmp_path)
    try:
        yield started
    finally:
        started.stop()


def doctor(cluster, *extra, hosts=None):
    """`preflight doctor` on the three nodes (or these hosts): (JSON document, seconds)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "preflight", "doctor", "--hosts", ",".join(hosts or cluster.nodes),
                           "--ssh-config", str(cluster.ssh_config), "--python", sys.executable, "--json", *extra],
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    assert proc.returncode == (1 if doc["verdict"] == "fail" else 0)
    assert elapsed < 10, f"doctor took {elapsed:.1f} s"
    return doc, elapsed


def found(doc, check_id, status="fail"):
    return [r for r in doc["results"] if r["id"] == check_id and r["status"] == status]


def problems(doc):
    return sorted((r["id"], tuple(r["nodes"])) for r in doc["results"] if r["status"] in ("fail", "error", "warn"))


def messages(doc):
    return [r["message"] for r in doc["results"] if r["status"] != "pass"]


@pytest.fixture(scope="class")
def running(cluster_up, tmp_path_factory):
    """(the jobs, the launchers) of one healthy job on port 29651 (torchrun on the three nodes, small all-reduces
    for ever), for the tests of one class; ended after them."""
    jobs = Jobs(cluster_up, tmp_path_factory.mktemp("healthy-job"))
    try:
        launchers = [jobs.torchrun(node, rank, 29651, mode="loop") for rank, node in enumerate(cluster_up.nodes)]
        jobs.wait_for("0-loop", "1-loop", "2-loop")
        yield jobs, launchers
    finally:
        jobs.stop()


class TestAHealthyRunningJob:
    """One healthy job, started once for these looks at it."""

    def test_a_healthy_running_job_gives_no_false_alarm(self, cluster, running):
        jobs, launchers = running
        doc, _ = doctor(cluster, "--port", "29651")
        assert problems(doc) == [], messages(doc)
        [census] = [r["evidence"]["census"] for r in found(doc, "RUN001", "pass")]
        assert sorted(row["rank"] for row in census if row["kind"] == "rank") == [0, 1, 2]
        jobs.untouched(launchers, jobs.rank_pids().values())

    def test_a_part_of_a_healthy_job_is_not_read_as_ranks_that_died(self, cluster, running):
        """doctor on two of the job's three nodes, or on one rank's PID, sees only part of the job: the ranks it
        did not look at are not "not running"."""
        jobs, launchers = running
        doc, _ = doctor(cluster, "--port", "29651", hosts=cluster.nodes[:2])
        assert problems(doc) == [], messages(doc)
        doc, _ = doctor(cluster, "--port", "29651", "--pid", str(jobs.rank_pids()[0]))
        assert problems(doc) == [], messages(doc)
        [census] = [r["evidence"]["census"] for r in found(doc, "RUN001", "pass")]
        assert [row["rank"] for row in census] == [0]
        jobs.untouched(launchers, jobs.rank_pids().values())


def test_dataloader_workers_of_a_healthy_job_are_not_ranks(cluster, jobs):
    launchers = [jobs.torchrun(node, rank, 29661, mode="loop", PF_LOADER="1") for rank, node in enumerate(cluster.nodes)]
    jobs.wait_for("0-loop", "1-loop", "2-loop", "0-loader", "1-loader", "2-loader")
    doc, _ = doctor(cluster, "--port", "29661")
    assert problems(doc) == [], messages(doc)
    [census] = [r["evidence"]["census"] for r in found(doc, "RUN001", "pass")]
    assert sorted(row["rank"] for row in census if row["kind"] == "rank") == [0, 1, 2]
    jobs.untouched(launchers, jobs.rank_pids().values())


def test_a_sleeping_rank_is_named_and_not_the_dataloader_workers_of_the_others(cluster, jobs):
    """Each rank's 2 DataLoader workers inherit RANK and poll their queues: neither ranks, nor a sign that the
    job moves on, nor stragglers."""
    launchers = [jobs.torchrun(node, rank, 29662, mode="sleep:2", PF_LOADER="1")
                 for rank, node in enumerate(cluster.nodes)]
    jobs.wait_for("0-collective", "1-collective", "2-sleeping", "0-loader", "1-loader", "2-loader")
    doc, _ = doctor(cluster, "--port", "29662")
    [straggler] = found(doc, "RUN006")
    assert straggler["nodes"] == ["node03"] and straggler["message"].startswith("rank 2 on node03"), messages(doc)
    assert {i for i, _ in problems(doc)} == {"RUN006"}, messages(doc)
    [census] = [r["evidence"]["census"] for r in found(doc, "RUN001", "pass")]
    assert len([row for row in census if row["kind"] == "rank"]) == 3
    jobs.untouched(launchers, jobs.rank_pids().values())


def test_the_nodes_of_one_job_whose_flags_are_spelled_otherwise_are_one_job(cluster, jobs):
    """--nnodes 3, --nnodes=3 and --nnode 3 (argparse's abbreviation) are one command to torchrun; the
    workers started half a second after the head are not a newer job."""
    spellings = (["--nnodes", "3", "--node_rank", "0", "--master_addr", "node01", "--master_port", "29663"],
                 ["--nnodes=3", "--node-rank=1", "--master-addr=node01", "--master-port=29663"],
                 ["--nnode", "3", "--node_r", "2", "--master_a", "node01", "--master_p", "29663"])
    launchers = []
    for node, flags in zip(cluster.nodes, spellings):
        launchers.append(jobs.torchrun(node, None, None, mode="loop", flags=[*flags, "--max-restarts=0"]))
        time.sleep(0.5)
    jobs.wait_for("0-loop", "1-loop", "2-loop")
    doc, _ = doctor(cluster, "--port", "29663")
    assert problems(doc) == [], messages(doc)
    jobs.untouched(launchers, jobs.rank_pids().values())


def test_doctor_on_one_port_leaves_out_another_job_whose_port_is_in_its_config(cluster, jobs, tmp_path):
    """Two healthy accelerate jobs on the same nodes, each port in its config file: node01 heads the one on
    29664, node02 the one on 29665. `doctor --port 29664` judges that job alone; without --port it says that
    two jobs run, and a rank's unanswered connection elsewhere is not the master's."""
    (tmp_path / "other").mkdir()
    other = Jobs(jobs.cluster, tmp_path / "other")
    try:
        launchers = [jobs.accelerate(node, 29664, rank, mode="loop", PF_DIAL="192.0.2.1")  # dropped on the way
                     for rank, node in enumerate(cluster.nodes)]
        launchers += [other.accelerate(node, 29665, rank, mode="loop", machines=2, head="node02")
                      for rank, node in enumerate(cluster.nodes[1:])]
        jobs.wait_for("0-loop", "1-loop", "2-loop")
        other.wait_for("0-loop", "1-loop")
        doc, _ = doctor(cluster, "--port", "29664")
        assert problems(doc) == [], messages(doc)
        [census] = [r["evidence"]["census"] for r in found(doc, "RUN001", "pass")]
        assert sorted(row["pid"] for row in census if row["kind"] == "rank") == sorted(jobs.rank_pids().values())
        assert len([row for row in census if row["kind"] != "rank"]) == 3
        doc, _ = doctor(cluster)  # the findings mix the two jobs (RUN001 says so), but no connection is the master's
        [several] = found(doc, "RUN001", "warn")
        assert "2 jobs run on these nodes" in several["message"]
        assert not found(doc, "RUN004"), messages(doc)
        jobs.untouched(launchers, [*jobs.rank_pids().values(), *other.rank_pids().values()])
    finally:
        other.stop()


def test_an_elastic_job_on_fewer_nodes_than_its_maximum_is_healthy(cluster, jobs):
    """--nnodes 1:3 on 2 nodes, c10d rendezvous on node01:29666: its launchers meet on that port, and they
    hand their ranks the port of a store of their own as MASTER_PORT; one job, complete."""
    flags = ["--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node01:29666", "--rdzv-id", "elastic",
             "--rdzv-conf", "last_call_timeout=5", "--nproc-per-node", "1", "--max-restarts", "0"]
    launchers = [jobs.torchrun(node, None, None, mode="loop", flags=flags) for node in cluster.nodes[:2]]
    jobs.wait_for("0-loop", "1-loop", timeout=180)
    for extra in (("--port", "29666"), ()):
        doc, _ = doctor(cluster, *extra, hosts=cluster.nodes[:2])
        assert problems(doc) == [], messages(doc)
        [census] = [r["evidence"]["census"] for r in found(doc, "RUN001", "pass")]
        assert sorted(row["rank"] for row in census if row["kind"] == "rank") == [0, 1]
    jobs.untouched(launchers, jobs.rank_pids().values())


def test_a_worker_left_at_the_loopback_master_address(cluster, jobs):
    """node02 started without --master_addr: torchrun's default 127.0.0.1 is node02 itself, not the head."""
    launchers = []
    for rank, node in enumerate(cluster.nodes):
        flags = ["--nnodes", "3", "--node_rank", str(rank), "--master_port", "29667", "--max-restarts", "0"]
        launchers.append(jobs.torchrun(node, None, None, flags=flags if node == "node02" else
                                       [*flags, "--master_addr", "node01"]))
    jobs.wait_listening("node01", 29667)
    time.sleep(3)
    doc, _ = doctor(cluster, "--port", "29667")
    [wrong] = found(doc, "RUN003")
    assert wrong["nodes"] == ["node02"], messages(doc)
    assert f"node02 pid {launchers[1].pid}: torchrun was started without --master_addr (its default is 127.0.0.1), " \
        "that is node02 itself: as node rank 1 of 3 it waits for a store on node02" in wrong["message"], wrong
    assert wrong["remediation"] == f"stop pid {launchers[1].pid} and start torchrun on node02 with --master_addr node01"
    assert not found(doc, "RUN004"), messages(doc)  # refused at once on its own loopback: no connection hangs
    jobs.untouched(launchers, [])


def test_an_old_launcher_on_the_port_started_just_before_the_new_job(cluster, jobs, tmp_path):
    """A launcher left from an earlier run (2 nodes, old.py) holds the port on node01, started seconds before the new
    job (3 nodes, train.py): the new launcher on node01 stops (the port is taken), node02 and node03 join the old
    store. Its job is not theirs: RUN008 names it though it is not 30 s older, and RUN003 does not call node01 a node
    that disagrees."""
    old = tmp_path / "old.py"
    old.write_text("import time\ntime.sleep(900)\n")
    stale = jobs.torchrun("node01", 0, 29669, nnodes=2, script=old)
    jobs.wait_listening("node01", 29669)
    new = [jobs.torchrun(node, rank, 29669) for rank, node in enumerate(cluster.nodes)]
    try:
        new[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the new launcher on node01 did not stop on the port the old one holds: {jobs.logs()}")
    time.sleep(3)
    doc, _ = doctor(cluster, "--port", "29669")
    [held] = found(doc, "RUN008")
    assert held["nodes"] == ["node01"] and f"torchrun pid {stale.pid}" in held["message"], messages(doc)
    assert "its job (nodes 2, world size 2, script old.py) is not the other nodes' (nodes 3, world size 3, " \
        "script train.py)" in held["message"], held["message"]
    assert held["evidence"]["older_s"] < 30, held["evidence"]
    assert not [r for r in found(doc, "RUN003") if "node01" in r["nodes"]], messages(doc)
    jobs.untouched([stale, *new[1:]], [])


def test_a_store_with_more_connections_than_the_census_keeps_is_not_read_as_nodes_missing(cluster, jobs):
    """70 idle connections to the head's store arrive before node03's launcher: the census keeps 64 sockets of
    the store's process, says how many it left out, and RUN005 does not take the cut for node03's absence."""
    launchers = [jobs.torchrun(node, rank, 29668, mode="loop") for rank, node in enumerate(cluster.nodes[:2])]
    jobs.wait_listening("node01", 29668)
    idle = jobs.cluster.node_popen("node02", [sys.executable, "-c", (
        "import socket, sys, time\n"
        "held = [socket.create_connection(('node01', 29668)) for _ in range(70)]\n"
        "print('ok', flush=True)\ntime.sleep(900)\n")], stdout=subprocess.PIPE)
    jobs.started.append(idle)
    assert idle.stdout.readline().strip() == b"ok"
    launchers.append(jobs.torchrun("node03", 2, 29668, mode="loop"))
    jobs.wait_for("0-loop", "1-loop", "2-loop")
    doc, _ = doctor(cluster, "--port", "29668")
    assert not found(doc, "RUN005"), messages(doc)
    [store] = [r for r in doc["results"] if r["id"] == "RUN005"]
    assert store["status"] == "skip" and "not read" in store["message"], store
    jobs.untouched(launchers, jobs.rank_pids().values())


def test_ranks_that_move_on_through_their_all_reduces_are_a_job_that_progresses(cluster, jobs):
    """Every rank is in all_reduce at each look (16 MiB over gloo, one after the other), but each has blocked
    and woken between the two stack samples: no straggler, the job progresses."""
    launchers = [jobs.torchrun(node, rank, 29659, mode="busy") for rank, node in enumerate(cluster.nodes)]
    jobs.wait_for("0-busy", "1-busy", "2-busy")
    time.sleep(1)
    doc, _ = doctor(cluster, "--port", "29659")
    [result] = [r for r in doc["results"] if r["id"] == "RUN006"]
    assert result["status"] == "pass" and "the job progresses" in result["message"], result
    assert result["nodes"] == list(cluster.nodes)
    jobs.untouched(launchers, jobs.rank_pids().values())


def test_one_rank_sleeping_before_the_all_reduce_the_others_wait_in(cluster, jobs):
    launchers = [jobs.torchrun(node, rank, 29652, mode="sleep:2") for rank, node in enumerate(cluster.nodes)]
    jobs.wait_for("0-collective", "1-collective", "2-sleeping")
    doc, _ = doctor(cluster)
    [straggler] = found(doc, "RUN006")
    assert straggler["nodes"] == ["node03"] and straggler["message"].startswith("rank 2 on node03")
    assert f"idle at train.py:{SLEEP_LINE}" in straggler["message"]
    assert f"2 rank(s) wait in all_reduce at train.py:{REDUCE_LINE}" in straggler["message"]
    assert {i for i, _ in problems(doc)} == {"RUN006"}
    doc, _ = doctor(cluster, hosts=cluster.nodes[:2])  # rank 2 sleeps on node03, which doctor was not told of
    assert not found(doc, "RUN007") and not found(doc, "RUN001"), messages(doc)
    jobs.untouched(launchers, jobs.rank_pids().values())


@pytest.fixture
def short_jobs(cluster):
    """jobs in the folder the transcripts show (the launch plan's cells are cut at 40 characters: a long or random
    path would be cut elsewhere each run)."""
    folder = Path("/tmp/pfdocs-job")
    shutil.rmtree(folder, ignore_errors=True)  # a run killed before its teardown
    folder.mkdir()
    started = Jobs(cluster, folder)
    try:
        yield started
    finally:
        started.stop()
        shutil.rmtree(folder)


def test_two_nodes_with_the_same_machine_rank_each_host_a_store(cluster, short_jobs):
    """The guide's deadlock: `accelerate config` said machine_rank 0 on node01 and node02. doctor names it, and so
    does `check`, run meanwhile with the nodes' own configs (their HF_HOME), which also names the job on the port."""
    jobs = short_jobs
    launchers = [jobs.accelerate(node, 29653, rank) for node, rank in zip(cluster.nodes, (0, 0, 2))]
    jobs.wait_listening("node01", 29653)
    jobs.wait_listening("node02", 29653)
    time.sleep(2)
    doc, _ = doctor(cluster, "--port", "29653")
    [duplicate] = found(doc, "RUN002")
    assert duplicate["nodes"] == ["node01", "node02"] and "node rank 0 on 2 nodes" in duplicate["message"]
    assert "each host a rendezvous store on port 29653" in duplicate["message"]
    shown = {cluster.ssh_config: "/tmp/pfdocs/ssh_config", jobs.tmp: "/tmp/pfdocs-job", transcripts.VENV: "/venv"}
    said, code = transcripts.run("doctor-duplicate-rank", jobs.tmp, shown)
    assert code == 1
    # what differs from one run to the next: process IDs, ages, CPU use
    pids = [(r"\bpid \d+", "pid P"), (r"\bkill \d+", "kill P"), (r"(?m)^(  node\d\d  )\d+", r"\1P"),
            (r"\b\d+%  \d+s\b", "C%  As")]
    transcripts.held("doctor-duplicate-rank", said, varies=pids)
    with contextlib.ExitStack() as configs:
        for node in cluster.nodes:
            configs.enter_context(cluster.env(node, HF_HOME=str(jobs.tmp / f"hf-{node}")))
        said, code = transcripts.run("doctor-check-meanwhile", jobs.tmp, shown)
    assert code == 1
    transcripts.held("doctor-check-meanwhile", said, varies=pids + transcripts.SIZES)
    jobs.untouched(launchers, [])


def test_a_node_never_started(cluster, jobs):
    launchers = [jobs.torchrun(node, rank, 29654) for rank, node in enumerate(cluster.nodes[:2])]
    jobs.wait_listening("node01", 29654)
    time.sleep(3)
    doc, _ = doctor(cluster, "--port", "29654")
    [missing] = found(doc, "RUN001")
    assert missing["nodes"] == ["node03"]
    [store] = found(doc, "RUN005")
    assert "2 of 3 nodes" in store["message"] and "node03 never joined" in store["message"]
    jobs.untouched(launchers, [])


def test_a_wrong_master_address_on_one_node(cluster, jobs):
    launchers = [jobs.torchrun(node, rank, 29655, master="10.77.0.99" if node == "node03" else "node01")
                 for rank, node in enumerate(cluster.nodes)]
    jobs.wait_listening("node01", 29655)
    time.sleep(3)
    doc, _ = doctor(cluster, "--port", "29655")
    [wrong] = found(doc, "RUN003")
    assert wrong["nodes"] == ["node03"] and "master address is 10.77.0.99 on node03" in wrong["message"]
    jobs.untouched(launchers, [])


def test_the_master_port_dropped_for_one_node(cluster, jobs):
    table = "pfc_doctor"
    rules = (f"table inet {table} {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n"
             f"    ip saddr {cluster.ip('node03')} tcp dport 29656 drop\n  }}\n}}\n")
    subprocess.run(["ip", "netns", "exec", cluster.netns("node01"), "nft", "-f", "-"], input=rules, text=True, check=True)
    try:
        launchers = [jobs.torchrun(node, rank, 29656) for rank, node in enumerate(cluster.nodes)]
        jobs.wait_listening("node01", 29656)
        time.sleep(3)
        doc, _ = doctor(cluster, "--port", "29656")
    finally:
        subprocess.run(["ip", "netns", "exec", cluster.netns("node01"), "nft", "delete", "table", "inet", table])
    [blocked] = found(doc, "RUN004")
    assert blocked["nodes"] == ["node03"] and f"{cluster.ip('node01')}:29656 (node01)" in blocked["message"]
    [store] = found(doc, "RUN005")
    assert "node03 never joined" in store["message"]
    jobs.untouched(launchers, [])


def test_a_rank_killed_while_the_others_wait(cluster, jobs):
    launchers = [jobs.torchrun(node, rank, 29657, mode="sleep-before-init:2") for rank, node in enumerate(cluster.nodes)]
    jobs.wait_for("2-sleeping", "0-init", "1-init")  # ranks 0 and 1 wait in init_process_group for rank 2
    os.kill(jobs.rank_pids()[2], signal.SIGKILL)  # our own rank's PID, from its mark
    time.sleep(1)
    doc, _ = doctor(cluster, "--port", "29657")
    dead = found(doc, "RUN007") + found(doc, "RUN001")
    assert dead, problems(doc)
    assert any("rank 2" in r["message"] or r["nodes"] == ["node03"] for r in dead), [r["message"] for r in dead]
    jobs.untouched(launchers[:2], [jobs.rank_pids()[0], jobs.rank_pids()[1]])


def test_an_old_job_holding_the_port(cluster, jobs, tmp_path, older_process):
    """The old job's command line holds a URL with a password, placed where the message's cut of the command
    line falls inside it: the report shows neither the password nor a piece of it, in any output. The old
    job's launcher runs in the process forked when the module started (older_process)."""
    old = tmp_path / "old.py"
    old.write_text("import time\ntime.sleep(900)\n")
    interpreter = (VENV / "torchrun").read_text().splitlines()[0][2:].strip()  # as /proc shows a console script
    before = " ".join([interpreter, str(VENV / "torchrun"), "--rdzv-id", "", "--role", "https://user:"])
    pad = "x" * (120 - 3 - len(before))  # RUN008 quotes 120 characters: the cut after "hun"
    assert pad, before
    flags = ["--rdzv-id", pad, "--role", "https://user:hunter2@example.org/x", "--nnodes", "2", "--node_rank", "0",
             "--master_addr", "node01", "--master_port", "29658"]
    stale, forked = older_process
    jobs.started.append(stale)
    argv = [str(VENV / "torchrun"), *flags, str(old)]
    stale.stdin.write(json.dumps([argv, {"PF_MARKS": str(jobs.marks), "PF_MODE": ""}]).encode() + b"\n")
    stale.stdin.close()
    jobs.wait_listening("node01", 29658)
    time.sleep(max(0.0, forked + 32 - time.monotonic()))  # a job left waiting for its second node, for a while
    launchers = [jobs.torchrun(node, rank, 29658) for rank, node in enumerate(cluster.nodes) if node != "node01"]
    time.sleep(6)
    junit, html = tmp_path / "doctor.xml", tmp_path / "doctor.html"
    doc, _ = doctor(cluster, "--port", "29658", "--junit", str(junit), "--html", str(html))
    [held] = found(doc, "RUN008")
    assert held["nodes"] == ["node01"] and f"pid {stale.pid}" in held["message"] and "older job" in held["message"]
    assert "--role https://<redacte" in held["message"], held["message"]  # redacted, then cut
    for shown in (json.dumps(doc), junit.read_text(), html.read_text()):
        assert "user:hun" not in shown and "hunter2" not in shown
    jobs.untouched([stale, *launchers], [])


# A training step as DDP runs it: four gradient buckets, all_reduce'd asynchronously and waited together, so every
# rank's stack shows the same wait. The flight recorder is on (TORCH_FR_BUFFER_SIZE); gloo does not write its records
# by itself (torch 2.13), so the job's own handler does, as a user's timeout handler would: torch's dump to
# TORCH_FR_DUMP_TEMP_FILE + rank when a wait fails (the job's process group times out after PF_TIMEOUT s), and when
# the job is ended (SIGTERM) before it wrote them.
FR_SCRIPT = '''
import datetime, os, pathlib, signal, time
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
marks, mode = pathlib.Path(os.environ["PF_MARKS"]), os.environ.get("PF_MODE", "")
(marks / f"{rank}.pid").write_text(str(os.getpid()))
dumped, me = [], os.getpid()
serving = os.environ.get("TORCH_WORKER_SERVER_SOCKET") or os.environ.get("PF_DEBUG_SERVER")
if os.environ.get("TORCH_WORKER_SERVER_SOCKET"):  # worker_main serves the records on that socket: none written
    from torch.distributed.elastic.control_plane import worker_main
    server = worker_main()  # held: the server ends when its context is collected
    server.__enter__()
if os.environ.get("PF_DEBUG_SERVER"):  # torch's debug server: a WorkerServer per rank on an ephemeral TCP port, and
    from torch.distributed.debug import start_debug_server  # rank 0's frontend (a forked process) on port 0
    start_debug_server(port=0)


def dump(why):
    if not serving:
        with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as out:
            out.write(torch._C._distributed_c10d._dump_fr_trace())
    dumped.append(why)
    (marks / f"{rank}-{why}").touch()


def on_term(signum, frame):
    if os.getpid() != me:  # the debug server's frontend, forked from rank 0 with this handler
        os._exit(0)
    if not dumped:
        dump("dumped-at-exit")
    os._exit(1)


signal.signal(signal.SIGTERM, on_term)
(marks / f"{rank}-imported").touch()  # the nodes import torch at their own pace: init's short timeout waits for none
while len(list(marks.glob("*-imported"))) < int(os.environ["WORLD_SIZE"]):
    time.sleep(0.05)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("PF_TIMEOUT", "4"))))
works = []
for i, size in enumerate((1000, 2000, 3000, 4000)):
    bucket = torch.ones(size)
    if mode == f"fewer:{rank}" and i == 3:
        break
    if mode == f"slow:{rank}" and i == 3:  # slow, not stuck: its records are written before its last bucket
        for work in works:
            work.wait()
        dump("dumped")
        time.sleep(1.5)
    if mode == f"op:{rank}" and i == 1:
        works.append(dist.broadcast(bucket, src=0, async_op=True))
    else:
        works.append(dist.all_reduce(bucket, async_op=True))
try:
    for work in works:
        work.wait()
except RuntimeError:
    dump("dumped")
else:
    (marks / f"{rank}-done").touch()
    if not dumped and os.environ.get("PF_EVERY_STEP"):  # a job that writes its records at every step's end
        dump("dumped")
time.sleep(900)
'''
FR_ROOT = "/tmp/pf-flight"  # a folder of each node's own: no shared filesystem, as on most clusters


@pytest.fixture
def fr_jobs(cluster, jobs):
    """(jobs, the records' prefix) with FR_ROOT a folder of each node's own."""
    for node in cluster.nodes:
        cluster.bind_dir(node, FR_ROOT)
    (jobs.tmp / "fr.py").write_text(FR_SCRIPT)
    try:
        yield jobs, f"{FR_ROOT}/fr_"
    finally:
        jobs.stop()
        for node in cluster.nodes:
            cluster.unbind_dir(node, FR_ROOT)
        with contextlib.suppress(OSError):
            os.rmdir(FR_ROOT)  # bind_dir made it here, empty


def start_fr(jobs, prefix, port, mode, **env):
    return [jobs.torchrun(node, rank, port, mode=mode, script=jobs.tmp / "fr.py", TORCH_FR_BUFFER_SIZE="2000",
                          TORCH_FR_DUMP_TEMP_FILE=prefix, **env) for rank, node in enumerate(jobs.cluster.nodes)]


def ended(jobs, *marks):
    """End the job as a scheduler does (SIGTERM to every rank), wait for `marks` and for the ranks to be gone."""
    pids = jobs.rank_pids()
    for pid in pids.values():
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while not all((jobs.marks / m).exists() for m in marks) or any(
            Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
            for pid in pids.values()):
        assert time.monotonic() < deadline, jobs.logs()
        time.sleep(0.2)
    jobs.stop()


@pytest.mark.parametrize("mode, port, kind, seq", [("op:2", 29671, "mismatch", 2), ("fewer:2", 29672, None, 4)])
def test_flight_records_name_the_rank_that_holds_an_asynchronous_step(cluster, fr_jobs, mode, port, kind, seq):
    """Every rank waits at the same line (the step's wait), so the stacks cannot tell; the flight records name the
    rank that issued a broadcast for bucket 2 (op:2), or one bucket fewer (fewer:2), with its node, rank, pid, op and
    sequence id: while the job hangs, and again after it died, from the files its ranks left on each node."""
    jobs, prefix = fr_jobs
    launchers = start_fr(jobs, prefix, port, mode)
    jobs.wait_for("0-dumped", "1-dumped", *(["2-dumped"] if kind == "mismatch" else ["2-done"]), timeout=180)
    pid = jobs.rank_pids()[2]
    doc, elapsed = doctor(cluster, "--port", str(port))
    [blame] = found(doc, "RUN010")
    assert blame["nodes"] == ["node03"] and blame["evidence"]["rank"] == 2, messages(doc)
    assert blame["evidence"]["pid"] == pid and f"rank 2 on node03 (pid {pid})" in blame["message"], blame
    assert blame["evidence"]["seq"] == seq and blame["evidence"]["pg"] == "0", blame
    assert blame["evidence"]["at"].startswith("fr.py:"), blame  # the Python line from the records' frames
    if kind == "mismatch":
        assert blame["evidence"]["kind"] == "mismatch" and blame["evidence"]["op"] == "broadcast", blame
        assert "issued broadcast [2000] Float as collective #2 of process group 0 (default_pg) at fr.py:" in \
            blame["message"], blame
    else:  # rank 2 is done with its step and wrote nothing: it has no record of the collective the others wait in
        assert blame["evidence"]["kind"] == "missing" and blame["evidence"]["op"] == "all_reduce", blame
        assert "while ranks 0, 1 waited in all_reduce #4 of process group 0 (default_pg) at fr.py:" in \
            blame["message"], blame
    assert not found(doc, "RUN006"), messages(doc)  # the stacks name nobody
    [ras] = [r for r in doc["results"] if r["id"] == "RUN011"]  # gloo: no NCCL, no RAS to ask
    assert ras["status"] == "skip" and ras["message"].startswith("no rank of the job on this node uses NCCL"), ras
    jobs.untouched(launchers, jobs.rank_pids().values())
    ended(jobs, *(["2-dumped-at-exit"] if kind is None else []))
    after, _ = doctor(cluster, "--flight-recorder", prefix)  # post-mortem: no process of the job is left
    [blame] = found(after, "RUN010")
    assert blame["nodes"] == ["node03"] and blame["evidence"]["rank"] == 2 and blame["evidence"]["pid"] is None
    assert blame["evidence"]["seq"] == seq and "rank 2 on node03 (not running)" in blame["message"], blame
    if kind is None:  # its records, written when it was ended, show it stopped after bucket 3
        assert blame["evidence"]["kind"] == "behind" and blame["evidence"]["last_seq"] == 3, blame
        assert "never entered all_reduce #4 of process group 0 (default_pg): its last collective was #3" in \
            blame["message"], blame
        said, code = transcripts.run("doctor-flight-recorder", jobs.tmp, {cluster.ssh_config: "/tmp/pfdocs/ssh_config"})
        assert code == 1
        transcripts.held("doctor-flight-recorder", said)
    else:
        assert blame["evidence"]["kind"] == "mismatch" and blame["evidence"]["op"] == "broadcast", blame
    assert [r["status"] for r in after["results"] if r["id"] == "RUN001"] == ["warn"]  # no job runs: said, not failed
    print(f"doctor on the hung job ({mode}): {elapsed:.1f} s")


@pytest.mark.parametrize("mode, port, kind, seq, server", [
    ("fewer:2", 29676, "behind", 4, {"TORCH_WORKER_SERVER_SOCKET": f"{FR_ROOT}/worker.sock"}),
    ("op:2", 29677, "mismatch", 2, {"PF_DEBUG_SERVER": "1"})])
def test_records_a_rank_serves_on_its_worker_socket_name_the_rank_that_holds_the_step(cluster, fr_jobs, mode, port,
                                                                                     kind, seq, server):
    """A job run inside torch's worker_main with TORCH_WORKER_SERVER_SOCKET, or with torch's debug server
    (start_debug_server), writes no file: doctor asks each rank's socket, or the TCP port /proc proves its debug
    server's, for its records (POST /handler/fr_trace_json) and names the rank, live: the records are as of the
    question, so the others' wait in #4 is past its timeout and rank 2 never entered it (fewer:2); rank 2 issued a
    broadcast as collective #2 (op:2). (tests/node/test_flightrec.py reads served records as files.)"""
    jobs, prefix = fr_jobs
    launchers = start_fr(jobs, prefix, port, mode, **server)
    jobs.wait_for("0-dumped", "1-dumped", "2-dumped" if kind == "mismatch" else "2-done", timeout=180)
    pid = jobs.rank_pids()[2]
    doc, elapsed = doctor(cluster, "--port", str(port))
    [blame] = found(doc, "RUN010")
    assert blame["nodes"] == ["node03"] and blame["evidence"]["rank"] == 2, messages(doc)
    assert blame["evidence"]["pid"] == pid and blame["evidence"]["kind"] == kind, blame
    assert blame["evidence"]["seq"] == seq and blame["evidence"]["pg"] == "0", blame
    if kind == "mismatch":
        assert blame["evidence"]["op"] == "broadcast" and blame["evidence"]["expected_op"] == "all_reduce", blame
        assert "rank 2 on node03 (pid %d) issued broadcast [2000] Float as collective #2" % pid in blame["message"]
    else:  # its step's three buckets are done: it is alive and serves records that stop at #3
        assert blame["evidence"]["last_seq"] == 3 and "4 s timeout" in blame["message"], blame
    # every rank answered; rank 0's debug-server frontend (a process it forked) is neither a rank nor another job
    assert problems(doc) == [("RUN010", ("node03",))], messages(doc)
    jobs.untouched(launchers, jobs.rank_pids().values())
    print(f"doctor on the hung job ({mode}), records served by the ranks ({', '.join(server)}): {elapsed:.1f} s")


@pytest.mark.parametrize("mode, port", [("", 29673), ("slow:2", 29674)])
def test_flight_records_of_a_healthy_or_merely_slow_job_blame_nobody(cluster, fr_jobs, mode, port):
    """Every rank writes its records at the end of its step; a slow rank 2 writes them before its last bucket, which
    it issues 1.5 s after the others: the records are a collective apart, but nobody waited past the timeout."""
    jobs, prefix = fr_jobs
    launchers = start_fr(jobs, prefix, port, mode, PF_TIMEOUT="20", PF_EVERY_STEP="1")
    jobs.wait_for("0-done", "1-done", "2-done", "0-dumped", "1-dumped", "2-dumped", timeout=180)
    doc, _ = doctor(cluster, "--port", str(port))
    assert problems(doc) == [], messages(doc)
    [result] = [r for r in doc["results"] if r["id"] == "RUN010"]
    assert result["status"] == "pass" and result["evidence"]["ranks"] == [0, 1, 2], result
    if mode:
        assert "rank 2 before it (none waited in it past its timeout" in result["message"], result
    jobs.untouched(launchers, jobs.rank_pids().values())
