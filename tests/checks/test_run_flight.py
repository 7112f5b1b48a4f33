"""RUN010 and its judge (preflight.job.flight) over NCCL-shaped flight-recorder dumps (tests/fixtures/flight_recorder,
made by its make.py in torch's format): 4 ranks on 2 nodes, each node's folder holding its own ranks' files as
NCCL's watchdog leaves them, read by the node side (preflight.node.flightrec) as doctor reads them. The real gloo
jobs on the test cluster are in test_run.py."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from preflight import registry, runner
from preflight.job import flight
from preflight.job import running as jobcensus
from preflight.node import flightrec
from preflight.plan import build_plan
from preflight.result import Status

FIXTURES = Path(__file__).parent.parent / "fixtures" / "flight_recorder"
NODES = {"gpu1": (0, 1), "gpu2": (2, 3)}


def node_records(job, tmp_path, shared=False):
    """{node: what that node's census reads at PREFIX} for a fixture job: each node's ranks' files in a folder of
    its own (or every file in one folder all nodes see), their times set to when the ranks wrote them."""
    times = json.loads((FIXTURES / "manifest.json").read_text())[job]
    found = {}
    for node, ranks in NODES.items():
        folder = tmp_path / ("shared" if shared else node)
        folder.mkdir(exist_ok=True)
        for rank in (r for ranks_of in NODES.values() for r in ranks_of) if shared else ranks:
            name = f"comm_lib_trace_rank_{rank}"
            if (FIXTURES / job / name).exists():
                shutil.copy(FIXTURES / job / name, folder / name)
                ns = times[name]
                os.utime(folder / name, ns=(ns, ns))
        found[node] = flightrec.collect(str(folder / "comm_lib_trace_rank_"), [], {})
    return found


def run010(records, procs=()):
    """RUN010's Results with these records on each node, and these running processes (census entries)."""
    facts = {node: {"facts": {"census": {"processes": [p for p in procs if p.pop("node", node) == node],
                                         "flight_recorder": records[node]}}, "error": None, "clock": None}
             for node in NODES}
    plan = build_plan(nodes=tuple(NODES))
    model = jobcensus.build(plan.nodes, facts, None)
    return runner.run_check(registry.load().get("RUN010"), runner.CheckContext(plan, facts, {"census": model}))


def failures(results):
    return [r for r in results if r.status == Status.FAIL]


def test_the_rank_that_issued_one_bucket_fewer_is_named(tmp_path):
    [blame] = failures(run010(node_records("behind", tmp_path)))
    assert blame.nodes == ("gpu2",)
    assert blame.evidence["rank"] == 2 and blame.evidence["seq"] == 7 and blame.evidence["op"] == "all_reduce"
    assert blame.evidence["kind"] == "behind" and blame.evidence["last_seq"] == 6 and blame.evidence["pid"] is None
    assert blame.message.startswith("rank 2 on gpu2 (not running) never entered all_reduce #7 of process group 0")
    assert "ranks 0, 1, 3 waited in all_reduce #7" in blame.message and "past their 600 s timeout" in blame.message
    assert blame.evidence["at"] == "train.py:120 (train_step)"


def test_the_rank_whose_collective_differs_is_named_with_its_line(tmp_path):
    [blame] = failures(run010(node_records("mismatch", tmp_path)))
    assert blame.nodes == ("gpu2",) and blame.evidence["rank"] == 3 and blame.evidence["seq"] == 5
    assert "issued all_reduce [5000] BFloat16 as collective #5" in blame.message
    assert "where ranks 0, 1, 2 issued all_reduce [5000] Float" in blame.message
    assert blame.evidence["at"] == "train.py:131 (train_step)"


def test_a_rank_without_records_is_named_where_it_runs(tmp_path):
    rank3 = {"node": "gpu2", "pid": 4242, "kind": "rank", "argv": ["python", "train.py"], "state": "S",
             "env": {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "gpu1", "MASTER_PORT": "29500"}}
    [blame] = failures(run010(node_records("missing", tmp_path), [rank3]))
    assert blame.nodes == ("gpu2",) and blame.evidence["rank"] == 3 and blame.evidence["pid"] == 4242
    assert blame.evidence["seq"] == 9 and blame.evidence["kind"] == "missing"
    assert blame.evidence["at"] == "train.py:120 (train_step)"  # where the others wait
    assert blame.message.startswith("rank 3 on gpu2 (pid 4242) has no record of process group 0")
    # after the job died: the rank is named, its node is not known
    [blame] = failures(run010(node_records("missing", tmp_path)))
    assert blame.evidence["rank"] == 3
    assert blame.message.startswith("rank 3 has no record of process group 0 (default_pg) (no file"), blame.message


@pytest.mark.parametrize("job", ["healthy", "slow"])
def test_a_healthy_or_slow_job_is_not_blamed(tmp_path, job):
    results = run010(node_records(job, tmp_path))
    [result] = results
    assert result.status == Status.PASS and result.nodes == ("gpu1", "gpu2"), result
    assert result.evidence["ranks"] == [0, 1, 2, 3]
    if job == "slow":
        assert "rank 3 before it (none waited in it past its timeout" in result.message


def test_every_rank_waiting_in_the_same_collective_is_a_warning(tmp_path):
    [result] = run010(node_records("all_waiting", tmp_path))
    assert result.status == Status.WARN and "every rank recorded (ranks 0, 1, 2, 3) waited in all_reduce #3" in \
        result.message


def test_a_shared_folder_counts_each_rank_once_and_finds_the_node_where_it_runs(tmp_path):
    records = node_records("behind", tmp_path, shared=True)
    assert all(len(r["dumps"]) == 4 for r in records.values())  # every node sees every file
    [blame] = failures(run010(records))
    assert blame.evidence["rank"] == 2 and blame.evidence["node"] is None and "node not known" in blame.message
    rank2 = {"node": "gpu2", "pid": 77, "kind": "rank", "argv": ["python", "train.py"], "state": "S",
             "env": {"RANK": "2", "WORLD_SIZE": "4"}}
    [blame] = failures(run010(records, [rank2]))
    assert blame.nodes == ("gpu2",) and blame.evidence["pid"] == 77


def test_no_records_is_a_skip_that_says_what_to_set_only_where_the_stacks_cannot_tell(tmp_path):
    empty = {node: flightrec.collect(str(tmp_path / "none_"), [], {}) for node in NODES}
    still = {"node": "gpu1", "pid": 5, "kind": "rank", "argv": ["python", "t.py"], "state": "S", "stable": True,
             "env": {"RANK": "0", "WORLD_SIZE": "1"},
             "threads": [{"name": "MainThread", "active": False,
                          "frames": [["wait", "/v/lib/python3.11/site-packages/torch/x.py", 1],
                                     ["step", "/job/train.py", 9]]}]}
    [result] = run010(empty, [dict(still)])
    assert result.status == Status.SKIP and "TORCH_FR_BUFFER_SIZE=2000" in result.message
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in result.message and "--flight-recorder" in result.message
    [result] = run010(empty, [dict(still, stable=False)])  # a job that moves: no advice
    assert result.status == Status.SKIP and "TORCH_FR" not in result.message


@pytest.mark.parametrize("given", ["dumps/", "dumps", "dumps/fr_"])
def test_the_debug_server_s_dump_folder_given_as_the_prefix_is_named_as_such(tmp_path, given):
    """The folder of start_debug_server(dump_dir=...) given to --flight-recorder: its fr_trace_<time>.txt tables
    (torch's analysis, no rank's records) are not read, and the skip names the newest for the user to read."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    for name in ("fr_trace_20261208_010203.txt", "fr_trace_20261208_010303.txt", "stacks_20261208_010303.txt"):
        (folder / name).write_text("=== FR Trace ===\n")
    records = {"gpu1": flightrec.collect(str(tmp_path / given), [], {}),
               "gpu2": flightrec.collect(str(tmp_path / "none_"), [], {})}
    [result] = run010(records)
    assert result.status == Status.SKIP and result.message.startswith("no flight-recorder records at ")
    assert f"; {folder / 'fr_trace_20261208_010303.txt'} on gpu1 is a dump of torch's debug server" in result.message
    assert "TORCH_FR_DUMP_TEMP_FILE=" in result.message
    (folder / "fr_trace_20261208_010203.txt").rename(folder / "fr_trace_0.txt")  # not torch's name: not said
    (folder / "fr_trace_20261208_010303.txt").unlink()
    records["gpu1"] = flightrec.collect(str(tmp_path / given), [], {})
    [result] = run010(records)
    assert result.status == Status.SKIP and "debug server" not in result.message


def test_a_file_that_is_not_a_dump_is_a_warning_naming_node_and_file(tmp_path):
    records = node_records("healthy", tmp_path)
    (tmp_path / "gpu2" / "comm_lib_trace_rank_3").write_bytes(b"\x80\x02garbage")
    records["gpu2"] = flightrec.collect(str(tmp_path / "gpu2" / "comm_lib_trace_rank_"), [], {})
    results = run010(records)
    [warned] = [r for r in results if r.status == Status.WARN]
    assert warned.nodes == ("gpu2",) and warned.message.startswith(
        f"gpu2: {tmp_path / 'gpu2' / 'comm_lib_trace_rank_3'} is not a flight-recorder dump")
    assert warned.remediation.startswith("remove or replace")


@pytest.mark.parametrize("path, error, fix", [
    ("debug-server(pid 77)", "was not asked: /proc/77/task/78/syscall cannot be read (as py-spy, it needs ptrace's "
     "permission), so its debug server's port is not proven", "run doctor as root"),
    ("debug-server:[::]:40123", "did not answer with flight-recorder records (timed out)", "check the rank's server"),
    ("socket:/run/w.sock", "did not answer with flight-recorder records (HTTP 404)", "check the rank's server"),
])
def test_a_rank_s_server_not_read_is_a_warning_whose_fix_is_not_a_file_s(tmp_path, path, error, fix):
    """A rank's debug server or worker socket that was not asked or did not answer: the fix is ptrace's permission,
    or the server, never "remove or replace" it as a file."""
    records = node_records("healthy", tmp_path)
    records["gpu2"]["errors"].append({"path": path, "rank": 3, "error": error})
    [warned] = [r for r in run010(records) if r.status == Status.WARN]
    assert warned.nodes == ("gpu2",) and warned.message == f"gpu2: {path} {error}: not read as flight-recorder records"
    assert warned.remediation.startswith(fix), warned.remediation


def test_the_judge_needs_the_others_to_have_entered_before_the_laggard_wrote():
    """A laggard whose records were written before the others entered the collective proves nothing."""
    def record(rank, top, dumped):
        entries = {s: flight.Entry(s, "all_reduce", ((10,),), ("Float",), "started" if s == top else "completed",
                                   s * 10**9, 1000, ()) for s in range(1, top + 1)}
        return flight.Record(rank, f"/r{rank}", dumped, {"0": flight.Group("0", None, (0, 1), entries)}, ("n",), "n")

    early = flight.Records([record(0, 5, 100 * 10**9), record(1, 4, 2 * 10**9)], [], {}, {})
    assert flight.judge(early)[0] == []
    late = flight.Records([record(0, 5, 100 * 10**9), record(1, 4, 90 * 10**9)], [], {}, {})
    [blame] = flight.judge(late)[0]
    assert (blame.kind, blame.rank, blame.seq) == ("behind", 1, 5)


def test_an_empty_prefix_is_bad_input_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "preflight", "doctor", "--flight-recorder", ""], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--flight-recorder is an empty prefix (give PATH/PREFIX: "
                                                          "the files are PREFIX<rank>)"), proc.stderr


def test_no_job_and_no_prefix_says_how_to_read_what_a_job_left():
    nothing = {node: {"skipped": "no rank of a job on this node and no --flight-recorder"} for node in NODES}
    [result] = run010(nothing)
    assert result.status == Status.SKIP and "no --flight-recorder PREFIX was given" in result.message


def test_reading_stops_when_the_census_time_is_spent(tmp_path):
    records = node_records("healthy", tmp_path)
    assert len(records["gpu1"]["dumps"]) == 2
    spent = flightrec.collect(str(tmp_path / "gpu1" / "comm_lib_trace_rank_"), [], {}, deadline=0.0)
    assert spent["dumps"] == [] and all("was not read: the census's time" in e["error"] for e in spent["errors"])


@pytest.mark.parametrize("desc, blamed", [("default_pg", [2]), ("undefined", [])])
def test_a_rank_without_records_of_a_group_whose_ranks_gloo_does_not_write(desc, blamed):
    """gloo's records list no group's ranks (torch 2.13): the default group's are the job's world, and a running rank
    without records is named; another group's members are not known, and nobody is said to be missing from it."""
    def record(rank):
        entries = {1: flight.Entry(1, "all_reduce", ((10,),), ("Float",), "scheduled", 10**9, 4000, ())}
        return flight.Record(rank, f"/r{rank}", 9 * 10**9, {"0": flight.Group("0", desc, None, entries)}, ("n",), "n")

    found = flight.Records([record(0), record(1)], [], {}, {}, live={2: [("n3", 33)]}, world=3)
    blames, notes = flight.judge(found)
    assert [(b.kind, b.rank, b.node, b.pid) for b in blames if b.kind != "all-waiting"] == [
        ("missing", r, "n3", 33) for r in blamed]
    assert bool(blamed) != any("its records do not list its ranks" in n for n in notes)


def test_a_rank_two_collectives_behind_is_said_to_miss_the_first_of_them():
    def record(rank, top):
        entries = {s: flight.Entry(s, "all_reduce" if s < 5 else "all_gather", ((10,),), ("Float",), "started",
                                   s * 10**9, 1000, (("step", "/job/train.py", 40 + s),)) for s in range(1, top + 1)}
        return flight.Record(rank, f"/r{rank}", 100 * 10**9, {"0": flight.Group("0", None, (0, 1), entries)}, ("n",),
                             "n")

    [blame] = flight.judge(flight.Records([record(0, 5), record(1, 3)], [], {}, {}))[0]
    assert (blame.kind, blame.rank, blame.seq, blame.op) == ("behind", 1, 4, "all_reduce")
    assert "never entered all_reduce #4 of process group 0: its last collective was #3 (all_reduce at train.py:43 " \
           "(step)), while rank 0 went on to all_reduce #4 at train.py:44 (step) and all_gather #5 at train.py:45 " \
           "(step), where rank 0 waited past its 1 s timeout" in blame.message, blame.message


def test_ranks_that_all_completed_their_last_collective_long_ago_are_idle_not_stuck():
    """gloo leaves every entry "scheduled"; its pg_status says the last collective completed: a job idle since."""
    def record(rank, completed):
        entries = {3: flight.Entry(3, "all_reduce", ((10,),), ("Float",), "scheduled", 10**9, 1000, ())}
        group = flight.Group("0", "default_pg", None, entries, enqueued=3, completed=completed)
        return flight.Record(rank, f"/r{rank}", 100 * 10**9, {"0": group}, ("n",), "n")

    assert flight.judge(flight.Records([record(0, 3), record(1, 3)], [], {}, {}))[0] == []
    [blame] = flight.judge(flight.Records([record(0, 2), record(1, 2)], [], {}, {}))[0]
    assert blame.kind == "all-waiting"
