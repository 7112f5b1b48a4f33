"""RUN011 and its judge (preflight.job.ras) over NCCL RAS's recorded answers (tests/fixtures/nccl_ras, in the formats
NCCL's source prints), asked over real TCP by the node side (preflight.node.ras) from a service that replays them
(tests/ras_server.py): 4 ranks on 2 nodes, gpu1 (10.0.0.1) and gpu2 (10.0.0.2). The same jobs as the flight
recorder's fixtures (test_run_flight.py): RAS and the records name the same rank on the same node."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preflight import registry, runner
from preflight.job import ras as judge
from preflight.job import running as jobcensus
from preflight.node import flightrec, ras
from preflight.plan import build_plan
from preflight.result import Status
from ras_server import RasServer, recorded

NODES = {"gpu1": "10.0.0.1", "gpu2": "10.0.0.2"}
PIDS = {0: ("gpu1", 4240), 1: ("gpu1", 4241), 2: ("gpu2", 4242), 3: ("gpu2", 4243)}
FLIGHT = Path(__file__).parent.parent / "fixtures" / "flight_recorder"


def asked(case, version):
    """What a node's census gets from RAS replaying a case (an NCCL before 2.28.7 knows no JSON): two queries a
    moment apart, over TCP."""
    with RasServer(recorded(case, version), json=version >= "2.28.7") as server:
        answer = ras.ask("127.0.0.1", server.port, "localhost:28028", "default", time.monotonic() + 5, 0.05)
    assert answer["error"] is None and len(answer["snapshots"]) == 2, answer
    return {"uses": "rank pid 4240 has NCCL_ variables", "answers": [answer]}


def rank(n, stable=True):
    node, pid = PIDS[n]
    return {"node": node, "pid": pid, "kind": "rank", "argv": ["python", "train.py"], "state": "S", "stable": stable,
            "env": {"RANK": str(n), "WORLD_SIZE": "4", "MASTER_ADDR": "gpu1", "MASTER_PORT": "29500"}}


def results(check, by_node, procs=(), flight=None):
    """The Results of one RUN check with these census parts on each node (and these processes running)."""
    facts = {node: {"facts": {"host": {"hostname": node, "interfaces": {"eth0": [address]}},
                              "census": {"processes": [dict(p) for p in procs if p["node"] == node],
                                         "nccl_ras": by_node.get(node),
                                         "flight_recorder": (flight or {}).get(node)}},
                    "error": None, "clock": None} for node, address in NODES.items()}
    for state in facts.values():
        for p in state["facts"]["census"]["processes"]:
            p.pop("node")
    plan = build_plan(nodes=tuple(NODES))
    model = jobcensus.build(plan.nodes, facts, None)
    return runner.run_check(registry.load().get(check), runner.CheckContext(plan, facts, {"census": model}))


def run011(case, version, procs=tuple(rank(n) for n in range(4))):
    answer = asked(case, version)
    return results("RUN011", {node: answer for node in NODES}, procs)


def failures(found):
    return [r for r in found if r.status == Status.FAIL]


def flight_records(job, tmp_path):
    """Each node's flight-recorder records of a fixture job (test_run_flight.py's node_records)."""
    times = json.loads((FLIGHT / "manifest.json").read_text())[job]
    found = {}
    for node, ranks in (("gpu1", (0, 1)), ("gpu2", (2, 3))):
        folder = tmp_path / node
        folder.mkdir(exist_ok=True)
        for r in ranks:
            name = f"comm_lib_trace_rank_{r}"
            if (FLIGHT / job / name).exists():
                shutil.copy(FLIGHT / job / name, folder / name)
                os.utime(folder / name, ns=(times[name], times[name]))
        found[node] = flightrec.collect(str(folder / "comm_lib_trace_rank_"), [], {})
    return found


@pytest.mark.parametrize("version", ["2.29.7", "2.27.7"])
def test_the_rank_one_collective_behind_is_the_one_the_flight_recorder_names(tmp_path, version):
    [blame] = failures(run011("behind", version))
    assert blame.nodes == ("gpu2",)
    assert (blame.evidence["kind"], blame.evidence["rank"], blame.evidence["pid"]) == ("behind", 2, 4242)
    assert (blame.evidence["op"], blame.evidence["seq"], blame.evidence["count"]) == ("AllReduce", 7, 6)
    others = "ranks 0, 1, 3" if version > "2.28" else "3 ranks"  # the text lists outliers only
    assert blame.message == (
        f"rank 2 on gpu2 (pid 4242) never launched AllReduce #7 of NCCL communicator 0x7b1a5c3e9d2f4806: it launched "
        f"6, while {others} launched 7, the same in RAS's two answers 0.05 s apart (NCCL {version}, localhost:28028 on "
        "gpu1): the communicator is stuck")
    # the flight recorder's records of the same job (test_run_flight.py): the same rank, node and collective
    procs = [rank(n) for n in range(4)]
    [recorded_blame] = failures(results("RUN010", {}, procs, flight_records("behind", tmp_path)))
    assert (recorded_blame.nodes, recorded_blame.evidence["rank"], recorded_blame.evidence["pid"],
            recorded_blame.evidence["seq"]) == (blame.nodes, 2, 4242, 7)


@pytest.mark.parametrize("case, version, kind", [("missing", "2.29.7", "missing"), ("missing", "2.28.9", "missing"),
                                                 ("missing", "2.27.7", "missing"), ("dead", "2.29.7", "dead"),
                                                 ("dead", "2.28.9", "dead"), ("dead", "2.27.7", "dead")])
def test_the_rank_ras_cannot_reach_is_the_one_without_flight_records(tmp_path, case, version, kind):
    [blame] = failures(run011(case, version))
    assert blame.nodes == ("gpu2",)
    assert (blame.evidence["kind"], blame.evidence["rank"], blame.evidence["pid"]) == (kind, 3, 4243)
    said = "is considered dead by RAS (unreachable for a minute)" if kind == "dead" else "does not answer RAS"
    assert blame.message == (
        f"rank 3 on gpu2 (pid 4243) {said}: NCCL communicator 0x7b1a5c3e9d2f4806 misses its data in RAS's two answers "
        f"0.05 s apart (NCCL {version}, localhost:28028 on gpu1), while the other ranks stand still"
        # the text names no count where the ranks agree
        + (" (they launched 9 AllReduce)" if version != "2.27.7" else ""))
    procs = [rank(n) for n in range(4)]
    [recorded_blame] = failures(results("RUN010", {}, procs, flight_records("missing", tmp_path)))
    assert (recorded_blame.nodes, recorded_blame.evidence["rank"], recorded_blame.evidence["pid"]) == \
        (blame.nodes, 3, 4243)


@pytest.mark.parametrize("version", ["2.29.7", "2.27.7"])
def test_the_rank_that_launched_another_collective_is_named(version):
    [blame] = failures(run011("mismatch", version))
    assert blame.nodes == ("gpu2",) and blame.evidence["kind"] == "mismatch" and blame.evidence["rank"] == 2
    assert (blame.evidence["op"], blame.evidence["expected_op"]) == ("Broadcast", "AllReduce")
    others = "ranks 0, 1, 3" if version > "2.28" else "3 ranks"
    assert blame.message.startswith(
        f"rank 2 on gpu2 (pid 4242) launched Broadcast #1 of NCCL communicator 0x7b1a5c3e9d2f4806 where {others} "
        "launched AllReduce #7, which it never launched (it launched 6), the same in RAS's two answers"), blame.message
    assert blame.message.endswith("the collectives do not match, so the job hangs")


@pytest.mark.parametrize("case", ["healthy", "moving"])
@pytest.mark.parametrize("version", ["2.29.7", "2.27.7"])
def test_a_healthy_or_moving_job_is_not_blamed(case, version):
    [result] = run011(case, version)
    assert result.status == Status.PASS and result.nodes == ("gpu1",), result
    fmt = "json" if version > "2.28" else "text"
    assert result.message.startswith(f"NCCL {version} RAS at localhost:28028 on gpu1 ({fmt}) shows no rank holding the "
                                     "others")
    if case == "moving":
        assert "AllReduce counts rank 2 at 18, " in result.message and \
            "its counts moved between RAS's two answers: not proof of a hang" in result.message


def test_a_job_whose_stacks_moved_is_not_blamed_whatever_ras_says():
    procs = [rank(n) for n in range(3)] + [rank(3, stable=False)]
    [result] = run011("behind", "2.29.7", procs)
    assert result.status == Status.PASS and "the ranks' stacks moved: not proof of a hang" in result.message


def test_a_rank_the_census_does_not_have_is_named_in_ras_words():
    """RAS's pid is the one the rank sees: in a container's PID namespace, not the node's the census reads."""
    procs = [dict(rank(n), pid=rank(n)["pid"] + 90000) for n in range(4)]
    [blame] = failures(run011("behind", "2.29.7", procs=procs))
    assert blame.nodes == ("gpu2",) and blame.evidence["rank"] is None and blame.evidence["comm_rank"] == 2
    assert blame.message.startswith("rank 2 of communicator 0x7b1a5c3e9d2f4806 on gpu2 (pid 4242) never launched")
    # the census read each rank's own pid there (NSpid): it is the rank RAS names
    [blame] = failures(run011("behind", "2.29.7", procs=[dict(p, own_pid=p["pid"] - 90000) for p in procs]))
    assert (blame.evidence["rank"], blame.evidence["pid"], blame.evidence["ras_pid"]) == (2, 94242, 4242)
    assert blame.message.startswith("rank 2 on gpu2 (pid 94242) never launched")


def test_one_answer_is_no_proof():
    answer = asked("behind", "2.29.7")
    answer["answers"][0]["snapshots"].pop()
    answer["answers"][0]["error"] = "NCCL RAS at localhost:28028 did not answer STATUS within the time left"
    found = results("RUN011", {"gpu1": answer}, [rank(n) for n in range(4)])
    assert [r.status for r in found] == [Status.WARN, Status.PASS]
    assert found[0].message == "gpu1: NCCL RAS at localhost:28028 did not answer STATUS within the time left: RAS's " \
                               "answer was not read" and found[0].nodes == ("gpu1",)
    assert "(one answer only: not proof of a hang)" in found[1].message


def test_no_ras_anywhere_is_a_skip_that_says_why():
    absent = {"uses": "rank pid 1 has NCCL_ variables", "answers": [
        {"address": "localhost:28028", "source": "default", "snapshots": [], "error":
         "nothing listens at localhost:28028 (connection refused)", "absent": True, "interval_s": 1.0}]}
    [result] = results("RUN011", {"gpu1": absent, "gpu2": {"skipped": "no rank of a job on this node"}}, [rank(0)])
    assert result.status == Status.SKIP and result.message == (
        "nothing listens at localhost:28028 (connection refused) on gpu1 (NCCL 2.24+ runs RAS unless "
        "NCCL_RAS_ENABLE=0; give each job on a node its own NCCL_RAS_ADDR)")
    skipped = {"skipped": "no rank of the job on this node uses NCCL (no NCCL_ variable, no libnccl loaded)"}
    [result] = results("RUN011", {"gpu1": skipped, "gpu2": skipped}, [rank(0)])
    assert result.status == Status.SKIP and result.message == skipped["skipped"]
    [result] = results("RUN011", {}, ())
    assert result.status == Status.SKIP and result.message == "no process of a job on any node reached"
    launcher = dict(rank(0), kind="launcher", argv=["torchrun", "--nnodes", "2", "train.py"])
    [result] = results("RUN011", {}, [launcher])
    assert result.message == "no rank of the job on any node reached (NCCL's RAS runs in its ranks)"


def test_a_communicator_made_or_torn_down_is_not_a_missing_rank():
    """A missing rank that answered RAS but is not (or no longer) in the communicator (JSON: unresponsive false)."""
    comm = {"hash": "0x1", "usual": {}, "ops": {}, "errors": [],
            "missing": [{"rank": 1, "pid": 7, "host": "10.0.0.2", "unresponsive": False, "dead": False}]}
    snap = {"communicators": 1, "comms": [comm], "dead": [], "unreachable": [], "timeouts": 0}
    answer = judge.Answer("gpu1", "localhost:28028", "2.29.7", "json", [snap, snap], None, False, 1.0)
    blames, notes = judge.judge(answer, lambda host, pid, node: judge.Place(None, None), False)
    assert blames == []


def test_nccl_before_2_26_names_a_missing_rank_by_number_and_its_process_in_its_lists():
    """2.24 and 2.25 print "The missing rank: 3" and the process under DEAD: the process is named, once."""
    comm = {"hash": "0x1", "usual": {}, "ops": {}, "errors": [],
            "missing": [{"rank": 3, "pid": None, "host": None, "unresponsive": True, "dead": False}]}
    snap = {"communicators": None, "comms": [comm], "dead": [[4243, "10.0.0.2"]], "unreachable": [], "timeouts": 0}
    answer = judge.Answer("gpu1", "localhost:28028", "2.24.3", "text", [snap, snap], None, False, 1.0)
    [blame] = judge.judge(answer, lambda host, pid, node: judge.Place("gpu2" if host else None, 3 if pid else None),
                          False)[0]
    assert (blame.kind, blame.rank, blame.node, blame.pid) == ("dead", 3, "gpu2", 4243)


@pytest.mark.parametrize("python", [None, "/usr/bin/python3"], ids=["in-process", "shipped"])
def test_doctor_names_the_rank_behind_from_what_ras_answers(tmp_path, python):
    """`preflight doctor` on this machine: a rank (RANK=2 of 4) whose NCCL_RAS_ADDR is a service replaying the
    `behind` answers, with its address and pid where NCCL would print them (RAS's host is this node's loopback):
    the node's census asks it (in-process, or shipped to another interpreter as to a node), RUN011 names it."""
    if python and not os.path.exists(python):
        pytest.skip(f"{python} is not installed")
    script = tmp_path / "rank.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with RasServer() as server:
        env = dict(os.environ, RANK="2", WORLD_SIZE="4", MASTER_PORT="29611", NCCL_RAS_ADDR=server.address)
        proc = subprocess.Popen([sys.executable, str(script)], env=env)
        try:
            server.answers = [text.replace('"10.0.0.2"', '"127.0.0.1"').replace("4242", str(proc.pid))
                              for text in recorded("behind", "2.29.7")]
            time.sleep(0.3)
            said = subprocess.run([sys.executable, "-m", "preflight", "doctor", "--pid", str(proc.pid), "--json",
                                   "--no-stacks", *(["--python", python] if python else [])],
                                  capture_output=True, text=True, timeout=60)
        finally:
            proc.kill()
            proc.wait()
    doc = json.loads(said.stdout)
    [blame] = [r for r in doc["results"] if r["id"] == "RUN011"]
    assert blame["status"] == "fail" and blame["nodes"] == doc["nodes"], blame
    assert (blame["evidence"]["rank"], blame["evidence"]["pid"], blame["evidence"]["node"]) == \
        (2, proc.pid, doc["nodes"][0])
    assert blame["message"].startswith(f"rank 2 on {doc['nodes'][0]} (pid {proc.pid}) never launched AllReduce #7")
    assert len(server.sessions) == 2 and server.closed_by_client == [True, True]
