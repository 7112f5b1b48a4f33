"""doctor's client of NCCL's RAS (preflight.node.ras), node side: the protocol as NCCL's own client speaks it, over
real TCP to a service that replays NCCL's recorded answers (tests/ras_server.py, tests/fixtures/nccl_ras), read in
both formats; the census that asks it where the job's ranks use NCCL; and services that answer garbage, slowly,
too much or never, each one line within the time given."""
import ctypes.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from preflight.node import census, ras
from preflight.remote import shapes
from ras_server import FIXTURES, RasServer, recorded


def snapshot(case, version, n=1):
    ext = "txt" if version < "2.28.7" else "json"
    return ras.parse("json" if ext == "json" else "text", (FIXTURES / case / f"{version}-{n}.{ext}").read_text())


def test_the_client_speaks_as_ncclras_and_reads_the_json_status():
    with RasServer(recorded("behind", "2.29.7")) as server:
        fmt, protocol, body = ras.query("127.0.0.1", server.port, time.monotonic() + 5, 3)
    assert (fmt, protocol) == ("json", 2)
    # ncclras -t 3 -f json: the handshake, its timeout, its format, then the status (src/ras/client.cc)
    assert server.sessions == [["CLIENT PROTOCOL 2", "TIMEOUT 3", "SET FORMAT json", "STATUS"]]
    assert server.closed_by_client == [True]  # nothing left open
    [comm] = ras.parse(fmt, body)["comms"]
    assert comm["hash"] == "0x7b1a5c3e9d2f4806" and comm["size"] == 4 and comm["usual"] == {"AllReduce": 7}
    assert comm["ops"] == {"AllReduce": [
        {"value": 6, "count": 1, "ranks": [{"rank": 2, "pid": 4242, "host": "10.0.0.2"}]},
        {"value": 7, "count": 3, "ranks": [{"rank": r, "pid": 4240 + r, "host": "10.0.0.%d" % (1 + r // 2)}
                                           for r in (0, 1, 3)]}]}


def test_an_nccl_before_json_answers_in_text_on_the_same_connection():
    with RasServer(recorded("behind", "2.27.7"), json=False) as server:
        fmt, _, body = ras.query("127.0.0.1", server.port, time.monotonic() + 5, 3)
    assert fmt == "text" and server.sessions[0][-1] == "STATUS"
    found = ras.parse(fmt, body)
    assert found["version"] == "2.27.7"
    [comm] = found["comms"]  # the text lists a group's ranks where it is an outlier only
    assert comm["ops"] == {"AllReduce": [{"value": 6, "count": 1, "ranks": [{"rank": 2, "pid": 4242, "host": "10.0.0.2"}]},
                                         {"value": 7, "count": 3, "ranks": None}]}


@pytest.mark.parametrize("case", ["behind", "missing", "dead", "mismatch", "healthy", "moving"])
def test_text_and_json_tell_the_same_ranks_apart(case):
    """What doctor judges (the ranks apart from the most in each op, the ranks missing or dead) is the same in both
    formats (JSON lists the lowest group too, where it is the most; text lists outliers only)."""
    def essentials(found):
        return [(c["hash"], {op: [(g["value"], g["count"], [w["rank"] for w in g["ranks"] or ()]) for g in groups
                                  if g["count"] < max(h["count"] for h in groups)] for op, groups in c["ops"].items()},
                 [(m["rank"], m["pid"], m["host"], m["dead"]) for m in c["missing"]]) for c in found["comms"]]

    for n in (1, 2):
        text = essentials(snapshot(case, "2.27.7", n))
        assert text == essentials(snapshot(case, "2.29.7", n))
        if (FIXTURES / case / f"2.28.9-{n}.json").exists():
            assert text == essentials(snapshot(case, "2.28.9", n))


def test_the_missing_comma_of_nccl_2_28_is_repaired_and_the_missing_rank_read():
    body = (FIXTURES / "missing" / "2.28.9-1.json").read_text()
    with pytest.raises(ValueError):
        json.loads(body)  # as NCCL 2.28.7-2.28.9 print it (jsonWriteMissingRank)
    [comm] = ras.from_json(body)["comms"]
    assert comm["missing"] == [{"rank": 3, "pid": 4243, "host": "10.0.0.2", "unresponsive": True, "dead": False}]


def test_the_census_asks_ras_twice_where_the_job_ranks_use_nccl(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with RasServer(recorded("behind", "2.29.7")) as server:
        env = dict(os.environ, RANK="2", WORLD_SIZE="4", NCCL_RAS_ADDR=server.address)
        proc = subprocess.Popen([sys.executable, str(script)], env=env)
        try:
            time.sleep(0.3)
            found = census.take_census({"pids": [proc.pid], "deadline_s": 6, "interval_s": 0.3, "stacks": False})
        finally:
            proc.kill()
            proc.wait()
    [answer] = found["nccl_ras"]["answers"]
    assert answer["address"] == server.address and answer["source"] == "NCCL_RAS_ADDR" and answer["error"] is None
    assert answer["format"] == "json" and answer["version"] == "2.29.7" and len(answer["snapshots"]) == 2
    assert len(server.sessions) == 2 and server.closed_by_client == [True, True]
    assert found["nccl_ras"]["uses"] == f"rank pid {proc.pid} has NCCL_ variables"
    assert shapes.problem(json.loads(json.dumps(found)), shapes.CENSUS, "census") is None  # as the head holds it


@pytest.mark.parametrize("env, asked", [({"GROUP_RANK": "1", "RANK": "9"}, True), ({"GROUP_RANK": "5", "RANK": "40"}, False),
                                        ({"RANK": "0"}, True), ({"RANK": "3"}, False)])
def test_on_a_large_job_ras_is_asked_where_the_first_two_nodes_ranks_run(tmp_path, env, asked):
    """Any node's RAS answers for the whole job: past a few nodes doctor asks on the job's node 0 and 1 only
    (torchrun's GROUP_RANK, else the node of RANK 0), not on each of thousands at once."""
    script = tmp_path / "rank.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with RasServer(recorded("behind", "2.29.7")) as server:
        proc = subprocess.Popen([sys.executable, str(script)], env=dict(os.environ, WORLD_SIZE="64",
                                                                        NCCL_RAS_ADDR=server.address, **env))
        try:
            time.sleep(0.3)
            found = census.take_census({"pids": [proc.pid], "deadline_s": 6, "interval_s": 0.3, "stacks": False,
                                        "ras": "first"})
        finally:
            proc.kill()
            proc.wait()
    if asked:
        assert len(server.sessions) == 2 and found["nccl_ras"]["answers"], found["nccl_ras"]
    else:
        assert server.sessions == [] and "first two nodes" in found["nccl_ras"]["skipped"], found["nccl_ras"]


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*/*-1.*")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_recorded_answer_reduces_to_the_shape_the_head_holds_it_to(path):
    snap = ras.parse("json" if path.suffix == ".json" else "text", path.read_text())
    answer = {"address": "localhost:28028", "source": "default", "snapshots": [snap], "error": None, "absent": False,
              "interval_s": 1.0, "format": "json", "version": snap.pop("version"), "protocol": 2}
    assert shapes.problem({"answers": [answer]}, shapes.NCCL_RAS, "nccl_ras") is None
    wrong = json.loads(json.dumps(answer))
    wrong["snapshots"][0]["comms"] = [{"ops": {"AllReduce": [{"value": "7"}]}}]
    assert "value is a string" in shapes.problem({"answers": [wrong]}, shapes.NCCL_RAS, "nccl_ras")


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare")
def test_a_rank_in_a_pid_namespace_of_its_own_is_read_with_the_pid_ras_names_it_by(tmp_path):
    """NCCL's RAS reports the pid a rank sees (getpid in its container); the census reads it from NSpid."""
    script = tmp_path / "rank.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, str(script)],
                            env=dict(os.environ, RANK="0", WORLD_SIZE="1"), stdout=subprocess.PIPE)
    try:
        inner = int(proc.stdout.readline())
        found = census.take_census({"pids": [proc.pid], "deadline_s": 3, "stacks": False})
        [rank] = [p for p in found["processes"] if p["kind"] == "rank"]
        assert rank["pid"] != inner and rank["own_pid"] == inner == 1
    finally:
        proc.kill()
        proc.wait()


def test_a_job_without_nccl_is_not_asked_and_one_with_ras_off_says_so(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import time\ntime.sleep(60)\n")
    for extra, said in (({}, "no rank of the job on this node uses NCCL"),
                        ({"NCCL_RAS_ENABLE": "0"}, "NCCL_RAS_ENABLE=0 in the ranks' environment: RAS is off")):
        env = dict((k, v) for k, v in os.environ.items() if not k.startswith("NCCL_"))
        proc = subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK="0", WORLD_SIZE="1", **extra))
        try:
            time.sleep(0.3)
            found = census.take_census({"pids": [proc.pid], "deadline_s": 3, "stacks": False})
        finally:
            proc.kill()
            proc.wait()
        assert found["nccl_ras"]["skipped"].startswith(said), found["nccl_ras"]


def test_a_rank_that_loaded_libnccl_uses_nccl(tmp_path):
    """No NCCL_ variable, but /proc/PID/maps shows a libnccl.so loaded (as a CUDA torch loads it)."""
    real = ctypes.util.find_library("m")
    lib = tmp_path / "libnccl.so.2"
    shutil.copy(next(p for p in (f"/lib/x86_64-linux-gnu/{real}", f"/usr/lib/x86_64-linux-gnu/{real}",
                                 f"/lib64/{real}", f"/usr/lib64/{real}") if os.path.exists(p)), lib)
    code = f"import ctypes, time\nctypes.CDLL({str(lib)!r})\nprint('up', flush=True)\ntime.sleep(60)\n"
    env = dict((k, v) for k, v in os.environ.items() if not k.startswith("NCCL_"))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"
        assert ras.uses_nccl([(proc.pid, {})]) == f"rank pid {proc.pid} has loaded libnccl"
        assert ras.uses_nccl([(os.getpid(), {})]) is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("env, host, port", [
    ({}, "localhost", 28028),
    ({"NCCL_RAS_ADDR": "localhost:12345"}, "localhost", 12345),
    ({"NCCL_RAS_ADDR": "10.1.2.3:29000,10.1.2.4:29001"}, "10.1.2.3", 29000),  # the first pair (parseStringList)
    ({"NCCL_RAS_ADDR": "[::1]:28100"}, "::1", 28100),
    ({"NCCL_RAS_ADDR": "node07"}, "node07", None),
])
def test_where_ras_listens_as_nccl_reads_ras_addr(env, host, port):
    assert ras.address(env)[:2] == (host, port)


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("1", True), ("0", False), ("0x1", True),
                                       ("2", False), ("yes", False), (" 1", True), ("1abc", True)])
def test_ras_is_on_as_nccl_reads_its_parameter(value, on):
    assert ras.enabled({} if value is None else {"NCCL_RAS_ENABLE": value}) is on


def test_an_answer_with_no_port_is_not_asked():
    answer = ras.ask("node07", None, "node07", "NCCL_RAS_ADDR", time.monotonic() + 2)
    assert answer["error"] == "node07 names no port: not asked" and answer["snapshots"] == []


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_listener_is_one_line_that_says_nothing_listens():
    port = free_port()
    answer = ras.ask("127.0.0.1", port, f"127.0.0.1:{port}", "NCCL_RAS_ADDR", time.monotonic() + 3)
    assert answer["absent"] is True and answer["error"] == f"nothing listens at 127.0.0.1:{port} (connection refused)"


def hostile(behaviour):
    """A service that takes the connection and then misbehaves; stop.set() ends it."""
    stop = threading.Event()

    def handler(conn):
        if behaviour == "silent":
            stop.wait(30)
        elif behaviour == "banner":
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            stop.wait(30)
        elif behaviour in ("huge", "bad json", "not a status", "slow"):
            reader = conn.makefile("rb")
            for reply in (b"SERVER PROTOCOL 2\n", b"OK\n", b"OK\n"):
                reader.readline()
                conn.sendall(reply)
            reader.readline()  # STATUS
            if behaviour == "huge":  # 100 MiB, as fast as it goes
                chunk = b" " * (1 << 20)
                for _ in range(100):
                    conn.sendall(chunk)
            elif behaviour == "slow":  # a byte now and then, never done
                while not stop.wait(0.2):
                    conn.sendall(b"{")
            else:
                conn.sendall(b'{"nccl_version": "2.29.7", "communicators": [{"hash": ' if behaviour == "bad json"
                             else b'{"nccl_version": "2.29.7", "communicators": 3}')
    return handler, stop


@pytest.mark.parametrize("behaviour, said", [
    ("silent", "did not answer CLIENT PROTOCOL 2 within the time left"),
    ("banner", 'does not speak NCCL\'s RAS protocol: it answered "HTTP/1.1 400 Bad Request" to CLIENT PROTOCOL 2'),
    ("huge", "answered STATUS with more than 16 MiB: not read"),
    ("bad json", "answered STATUS with JSON that does not parse (Expecting value: line 1 column 55"),
    ("not a status", "answered STATUS with JSON that is not its status (no list of communicators)"),
    ("slow", "did not finish its answer to STATUS within the time left"),
])
def test_a_service_that_answers_garbage_slowly_too_much_or_never_is_one_line_in_time(behaviour, said):
    handler, stop = hostile(behaviour)
    with RasServer(handler=handler) as server:
        started = time.monotonic()
        try:
            answer = ras.ask("127.0.0.1", server.port, server.address, "NCCL_RAS_ADDR", time.monotonic() + 3, 0.2)
        finally:
            stop.set()
    took = time.monotonic() - started
    assert took < 3.5, took
    assert answer["error"].startswith(f"NCCL RAS at {server.address} ") or behaviour == "silent"
    assert said in answer["error"] and "\n" not in answer["error"] and answer["absent"] is False, answer["error"]
    assert answer["snapshots"] == []


def test_another_protocol_version_is_read_on_as_ncclras_does():
    """ncclras warns of a protocol it does not know and goes on; so does doctor, and says which it was."""
    with RasServer(recorded("healthy", "2.29.7"), protocol=3) as server:
        answer = ras.ask("127.0.0.1", server.port, server.address, "NCCL_RAS_ADDR", time.monotonic() + 4, 0.1)
    assert answer["error"] is None and answer["protocol"] == 3 and len(answer["snapshots"]) == 2


def test_text_that_is_not_ras_is_one_line():
    with pytest.raises(ras.RasError) as caught:
        ras.from_text("<html>nope</html>\n")
    assert str(caught.value) == 'NCCL RAS answered STATUS with text that is not its status (it begins "<html>nope</html>")'


def test_what_a_large_job_sends_is_bounded_and_still_names_the_lowest_rank():
    """28,000 ranks (70 communicators of 400, every rank at another count: about the most 16 MiB of NCCL's JSON
    holds): a snapshot keeps MAX_COMMS communicators, MAX_GROUPS groups an op (the lowest, the most common, the
    highest) and MAX_LISTED ranks named."""
    def comm(i):
        ranks = [{"rank": r, "host": "10.1.%d.%d" % (r // 256, r % 256), "pid": 1000 + r, "status": {},
                  "collective_counts": {"AllReduce": 5000 + r if r else 17, "Broadcast": 3}} for r in range(400)]
        return {"hash": "0x%x" % (i + 1), "size": 400, "ranks": ranks, "missing_ranks": []}

    body = json.dumps({"nccl_version": "2.29.7", "communicators": [comm(i) for i in range(70)]}, indent=2)
    assert len(body) < ras.MAX_BYTES
    found = ras.from_json(body)
    assert found["communicators"] == 70 and len(found["comms"]) == ras.MAX_COMMS and found["comms_dropped"] == 6
    groups = found["comms"][0]["ops"]["AllReduce"]
    assert len(groups) == ras.MAX_GROUPS and groups[0]["value"] == 17 and groups[-1]["value"] == 5000 + 399
    assert groups[0]["ranks"] == [{"rank": 0, "pid": 1000, "host": "10.1.0.0"}]
    named = sum(len(g["ranks"]) for c in found["comms"] for gs in c["ops"].values() for g in gs)
    assert named == ras.MAX_LISTED and len(json.dumps(found)) < 64 << 10
