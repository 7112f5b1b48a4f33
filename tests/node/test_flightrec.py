"""Reading torch's flight-recorder dumps on a node (preflight.node.flightrec): a real dump torch wrote, where the
files are looked for, and hostile files (truncated, huge, a FIFO, a pickle that would run a command), each refused
in one line, nothing run, nothing blocked."""
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest

from preflight.node import census, flightrec

# Censuses of this machine's processes on fixed ports (29984-29993): one at a time (tests/workers.py).
pytestmark = pytest.mark.machine

# A one-rank gloo job with the flight recorder on: an asynchronous all_reduce and a broadcast, then its records
# as torch dumps them (torch._C._distributed_c10d._dump_fr_trace: the bytes torch writes to PREFIX<rank>); then it
# serves them on torch's WorkerServer at an ephemeral TCP port, as start_debug_server starts it in every rank
# (torch/distributed/debug/__init__.py: _WorkerServer("::", worker_port=0)), and says the port torch chose.
ONE_RANK = '''
import datetime, os, sys, torch, torch.distributed as dist
from torch._C._distributed_c10d import _WorkerServer
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
dist.all_reduce(torch.ones(1000), async_op=True).wait()
dist.broadcast(torch.ones(3, 4, dtype=torch.float16), src=0)
with open(sys.argv[1] + "0", "wb") as out:
    out.write(torch._C._distributed_c10d._dump_fr_trace())
server = _WorkerServer("::", 0)
print(server.port, flush=True)
sys.stdin.read()  # until the tests are done
'''


@pytest.fixture(scope="module")
def real_job(tmp_path_factory):
    """(its dump, its pid, the port its WorkerServer listens on) of the one-rank job, alive for the module."""
    folder = tmp_path_factory.mktemp("fr")
    script = folder / "job.py"
    script.write_text(ONE_RANK)
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000")
    proc = subprocess.Popen([sys.executable, str(script), str(folder / "fr_"), str(folder / "store")], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(proc.stdout.readline() or 0)
        assert port and (folder / "fr_0").exists(), "the one-rank job did not start its WorkerServer"
        yield folder / "fr_0", proc.pid, port
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def real_dump(real_job):
    return real_job[0]


def test_a_dump_torch_wrote_is_read_as_its_collectives(real_dump):
    found = flightrec.read_dump(str(real_dump), 0)
    assert "error" not in found, found
    [group] = found["groups"]
    assert group["pg"] == "0" and group["desc"] == "default_pg" and group["enqueued"] == 2
    first, second = group["entries"]
    assert (first["seq"], first["op"], first["backend"], first["sizes"], first["dtypes"]) == (
        1, "all_reduce", "gloo", [[1000]], ["Float"])
    assert (second["seq"], second["op"], second["sizes"], second["dtypes"]) == (2, "broadcast", [[3, 4]], ["Half"])
    assert first["frames"][0][0] == "all_reduce" and first["frames"][-1][1].endswith("job.py")
    assert first["timeout_ms"] == 30000 and first["created_ns"] <= found["mtime_ns"]
    # the reduction is plain JSON data, held to the shape the head holds it to
    from preflight.remote import shapes
    assert shapes.problem({"dumps": [found]}, shapes.FLIGHT_RECORDER, "fr") is None


def test_the_files_of_a_prefix_are_found_by_rank(tmp_path):
    for name in ("fr_0", "fr_12", "fr_x", "fr_", "other_3", "fr_3.tmp"):
        (tmp_path / name).write_bytes(b"")
    assert flightrec.dump_files(str(tmp_path / "fr_")) == [(0, str(tmp_path / "fr_0")), (12, str(tmp_path / "fr_12"))]
    assert flightrec.dump_files(str(tmp_path / "missing" / "fr_")) == []


@pytest.mark.parametrize("env, prefix", [
    ({"TORCH_FR_DUMP_TEMP_FILE": "/x/fr_", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/y/t_"}, ("/x/fr_", "env")),
    ({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/y/t_"}, ("/y/t_", "env")),
    ({"HOME": "/home/u"}, ("/home/u/.cache/torch/comm_lib_trace_rank_", "default")),
    ({"HOME": "/home/u", "XDG_CACHE_HOME": "/c"}, ("/c/torch/comm_lib_trace_rank_", "default")),
    ({}, ("/tmp/.cache/torch/comm_lib_trace_rank_", "default")),
])
def test_where_a_rank_writes_its_records_as_torch_decides(env, prefix):
    assert flightrec.prefix_of(env) == prefix


def _hostile(tmp_path, real_dump):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = real_dump.read_bytes()
    files = {
        "truncated": data[: len(data) // 2],
        "evil": pickle.dumps({"entries": [Evil()], "version": "2.10"}),
        "evil_top": pickle.dumps(Evil()),
        "text": b"not a pickle at all\n",
        "empty": b"",
        "list": pickle.dumps([1, 2, 3]),
        "odd_entries": pickle.dumps({"entries": [1, None, {"collective_seq_id": "x"}, {"process_group": 5,
                                                                                     "collective_seq_id": 2,
                                                                                     "input_sizes": "big",
                                                                                     "frames": [None, {"x": 1}]}]}),
    }
    return marker, files


def test_hostile_files_are_refused_in_one_line_and_nothing_runs(tmp_path, real_dump):
    marker, files = _hostile(tmp_path, real_dump)
    said = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        said[name] = flightrec.read_dump(str(tmp_path / name), 0)
    assert not marker.exists()  # os.system was never called
    for name in ("truncated", "evil_top", "text", "list"):
        assert said[name]["error"].startswith("is not a flight-recorder dump"), (name, said[name])
    assert said["evil"]["groups"] == []  # a dump whose one entry is an object: no collective read from it
    assert said["empty"]["error"] == "is empty"
    # entries of the wrong types are left out, the rest read
    [group] = said["odd_entries"]["groups"]
    assert [e["seq"] for e in group["entries"]] == [2] and group["entries"][0]["sizes"] is None


def test_a_fifo_a_folder_and_a_huge_file_are_not_read(tmp_path, monkeypatch):
    os.mkfifo(tmp_path / "fr_0")  # nobody writes into it: a blocking open would wait for ever
    (tmp_path / "fr_1").mkdir()
    with open(tmp_path / "fr_2", "wb") as huge:
        huge.truncate(flightrec.MAX_BYTES + 1)  # sparse: no disk used
    started = time.monotonic()
    found = flightrec.collect(str(tmp_path / "fr_"), [], {})
    assert time.monotonic() - started < 2
    assert found["dumps"] == []
    errors = {e["rank"]: e["error"] for e in found["errors"]}
    assert errors[0] == "is not a regular file" and errors[1] == "is not a regular file"
    assert errors[2].startswith("is %d bytes, more than" % (flightrec.MAX_BYTES + 1))


def test_a_rank_s_records_are_read_where_its_environment_says_and_old_ones_left_out(tmp_path, real_dump):
    """The census reads TORCH_FR_DUMP_TEMP_FILE from a running rank's environment, through /proc/PID/root; a file
    older than the rank whose number it has is an earlier run's."""
    folder = tmp_path / "records"
    folder.mkdir()
    (folder / "fr_0").write_bytes(real_dump.read_bytes())
    (folder / "fr_1").write_bytes(real_dump.read_bytes())
    os.utime(folder / "fr_1", (time.time() - 3600, time.time() - 3600))
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29986",
               TORCH_FR_DUMP_TEMP_FILE=str(folder / "fr_"))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        time.sleep(0.5)
        found = census.take_census({"port": 29986, "deadline_s": 5, "stacks": False})
    finally:
        proc.kill()
        proc.wait()
    records = found["flight_recorder"]  # (another job's ranks on this machine would add theirs: left out here)
    assert {"prefix": str(folder / "fr_"), "source": "env"} in records["looked"]
    ours = [d for d in records["dumps"] if d["path"].startswith(str(folder))]
    assert [(d["rank"], d["path"]) for d in ours] == [(0, str(folder / "fr_0"))]
    assert [p for p in records["stale"] if p.startswith(str(folder))] == [str(folder / "fr_1")]
    assert census._flight_records([], {}, time.monotonic() + 5) == {
        "skipped": "no rank of a job on this node and no --flight-recorder"}


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_a_rank_in_a_container_is_read_in_its_own_filesystem(tmp_path, real_dump):
    """A rank in a mount namespace of its own (a container) writes where only it sees: its folder here is empty, and
    the census reads its records through /proc/PID/root."""
    folder = tmp_path / "inside"
    folder.mkdir()
    (tmp_path / "fr_0").write_bytes(real_dump.read_bytes())
    script = (f"mount -t tmpfs none {folder} && cp {tmp_path / 'fr_0'} {folder}/fr_0 && "
              f"exec {sys.executable} -c 'import time; print(1, flush=True); time.sleep(60)'")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29984",
               TORCH_FR_DUMP_TEMP_FILE=str(folder / "fr_"))
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=env,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"1"
        assert not (folder / "fr_0").exists()  # not here: inside the rank's own mount namespace
        found = census.take_census({"port": 29984, "deadline_s": 5, "stacks": False})["flight_recorder"]
    finally:
        proc.kill()
        proc.wait()
    ours = [(d["rank"], d["path"]) for d in found["dumps"] if d["path"].startswith(str(folder))]
    assert ours == [(0, str(folder / "fr_0"))], found


# --- records a rank serves on its worker socket (torch's worker_main, TORCH_WORKER_SERVER_SOCKET) ----------------

# What torch's WorkerServer answers for NCCL's records where torch is built without NCCL (as here).
NO_NCCL = b"HTTP/1.1 404 Not Found\r\nContent-Length: 38\r\n\r\nHandler dump_nccl_trace_json not found"


def answering(path, reply, delay=0.0, nccl=NO_NCCL):
    """A unix socket server at `path` that answers one connection with `reply` (bytes, after `delay` s), the next
    (NCCL's records) with `nccl`, and closes; a thread, ended with the test."""
    import socket
    import threading

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)

    def serve():
        for answer in (reply, nccl):
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                time.sleep(delay)
                try:
                    conn.sendall(answer)
                except OSError:  # the reader gave up first
                    pass
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return server


def http(body, status=b"200 OK"):
    return b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body


LIVE = {"version": "2.10", "pg_config": {"": {"desc": "", "name": "", "ranks": "[0, 1]"}},
        "pg_status": {"0": {"last_enqueued_collective": "4", "last_started_collective": "-1",
                            "last_completed_collective": "3"}},
        "entries": [{"collective_seq_id": 4, "profiling_name": "gloo:all_reduce", "input_sizes": [[4]],
                     "input_dtypes": ["Float"], "output_sizes": [[4]], "is_p2p": False, "pg_id": 0,
                     "process_group": ["0", "default_pg"], "state": "scheduled", "time_created_ns": 1,
                     "timeout_ms": 1800000}]}


def test_the_records_a_rank_serves_are_read_as_its_dump_would_be(tmp_path):
    """The answer torch's WorkerServer gives (fr_trace_json, as a real gloo rank served it in torch 2.13) becomes the
    same summary as a dump, as of now; the socket is reached through the rank's /proc/PID/root."""
    import json

    answering(tmp_path / "w.sock", http(json.dumps(LIVE).encode()))
    before = time.time_ns()
    found = flightrec.served(os.getpid(), str(tmp_path / "w.sock"), 1)
    assert "error" not in found, found
    assert found["path"] == f"socket:{tmp_path}/w.sock" and found["rank"] == 1 and found["mtime_ns"] >= before
    [group] = found["groups"]
    assert group["ranks"] == [0, 1] and group["enqueued"] == 4 and group["completed"] == 3
    assert [(e["seq"], e["op"], e["backend"], e["state"]) for e in group["entries"]] == \
        [(4, "all_reduce", "gloo", "scheduled")]


# What a server that is not torch's WorkerServer (or a broken one) may answer, and the line each is said in.
HOSTILE_ANSWERS = [
    (b"", "not an HTTP answer"),  # closed without a word
    (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP answer"),
    (http(b"Handler fr_trace_json not found", b"404 Not Found"), "HTTP 404: Handler fr_trace_json not found"),
    (http(b"{not json"), "did not answer with flight-recorder records"),
    (http(b'{"entries": 7}'), "answered, but not with flight-recorder records"),
    (http(b"x" * (flightrec.MAX_BYTES + (1 << 20))), "answered more than 8 MiB"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "chunked"),
]


@pytest.mark.parametrize("reply, said", [(None, "No such file"), *HOSTILE_ANSWERS])  # None: no socket there
def test_a_socket_that_answers_anything_else_is_one_line(tmp_path, reply, said):
    if reply is not None:
        answering(tmp_path / "w.sock", reply)
    found = flightrec.served(os.getpid(), str(tmp_path / "w.sock"), 0)
    assert said in found["error"] and "\n" not in found["error"] and "groups" not in found, found


def test_a_socket_that_never_answers_costs_the_time_given_and_no_more(tmp_path):
    answering(tmp_path / "w.sock", http(b"{}"), delay=30)
    started = time.monotonic()
    found = flightrec.served(os.getpid(), str(tmp_path / "w.sock"), 0, deadline=time.monotonic() + 0.5)
    assert time.monotonic() - started < 1.5 and "timed out" in found["error"], found
    spent = flightrec.served(os.getpid(), str(tmp_path / "w.sock"), 0, deadline=time.monotonic() - 1)
    assert "time was spent" in spent["error"], spent


def test_a_fifo_or_a_file_at_the_socket_path_is_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    for name in ("fifo", "file"):
        started = time.monotonic()
        found = flightrec.served(os.getpid(), str(tmp_path / name), 0)
        assert time.monotonic() - started < 1 and "refused" in found["error"].lower(), found


def test_collect_reads_each_serving_rank_beside_its_files(tmp_path):
    import json

    answering(tmp_path / "w.sock", http(json.dumps(LIVE).encode()))
    environ = {"TORCH_WORKER_SERVER_SOCKET": str(tmp_path / "w.sock"), "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr_")}
    found = flightrec.collect(None, [(os.getpid(), environ, 1), (os.getpid(), {"RANK": "0"}, None)], {})
    assert [d["path"] for d in found["dumps"]] == [f"socket:{tmp_path}/w.sock"], found
    assert {"prefix": f"socket:{tmp_path}/w.sock", "source": "socket"} in found["looked"], found


# --- records a rank serves on torch's debug server (torch.distributed.debug.start_debug_server) -----------------

def test_the_debug_server_s_port_is_proven_on_proc_and_its_records_read(real_job):
    """torch's own WorkerServer on an ephemeral TCP port: its accepting thread (pt_workerserver, waiting in accept on
    the listening descriptor) proves the port torch chose, and the records it serves are the dump's."""
    _, pid, port = real_job
    assert flightrec.debug_server(pid) == ("::", port)
    found = flightrec.collect(None, [(pid, {"RANK": "0"}, 0)], {})
    assert {"prefix": f"debug-server:[::]:{port}", "source": "debug-server"} in found["looked"], found
    [served] = found["dumps"]
    [group] = served["groups"]
    assert [(e["seq"], e["op"], e["sizes"]) for e in group["entries"]] == [(1, "all_reduce", [[1000]]),
                                                                          (2, "broadcast", [[3, 4]])], served


def pretending(reply=None, accept=True, delay=0.0, nccl=NO_NCCL):
    """A TCP listener in this process whose accepting thread takes WorkerServer's name (prctl PR_SET_NAME), waiting
    in accept (or, with accept=False, asleep beside another, unnamed thread that accepts); it answers a connection
    with `reply` after `delay` s, the next (NCCL's records) with `nccl`. Returns (port, the connections it took: a
    list, the function that ends its threads)."""
    import ctypes
    import socket
    import threading

    server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    server.bind(("::", 0))
    server.listen(4)
    taken, named, stop = [], threading.Event(), threading.Event()

    def serve(name):
        if name:
            ctypes.CDLL(None, use_errno=True).prctl(15, name, 0, 0, 0)  # PR_SET_NAME: this thread's comm
            named.set()
        for answer in (reply, nccl):
            try:
                conn, _ = server.accept()  # blocking: accept4 on the listening descriptor, as cpp-httplib waits
            except OSError:  # ended
                return
            taken.append(conn)
            with conn:
                conn.recv(65536)
                stop.wait(delay)
                try:
                    conn.sendall(answer or b"")
                except OSError:  # the reader gave up first
                    pass

    def idle():
        ctypes.CDLL(None, use_errno=True).prctl(15, b"pt_workerserver", 0, 0, 0)
        named.set()
        stop.wait(30)

    threading.Thread(target=serve, args=(b"pt_workerserver" if accept else None,), daemon=True).start()
    if not accept:
        threading.Thread(target=idle, daemon=True).start()
    named.wait(5)
    time.sleep(0.1)  # into accept

    def end():  # wakes a thread still in accept (shutdown), so that no named thread outlives its test
        stop.set()
        try:
            server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        server.close()
        time.sleep(0.05)
    return server.getsockname()[1], taken, end


@pytest.mark.parametrize("reply, said", HOSTILE_ANSWERS)
def test_a_debug_server_that_answers_anything_else_is_one_line(reply, said):
    port, _, end = pretending(reply)
    found = flightrec.collect(None, [(os.getpid(), {"RANK": "3"}, 3)], {})
    end()
    [error] = [e for e in found["errors"] if e["path"] == f"debug-server:[::]:{port}"]
    assert said in error["error"] and "\n" not in error["error"] and error["rank"] == 3, found


def test_a_debug_server_that_never_answers_costs_the_time_given():
    port, _, end = pretending(http(b"{}"), delay=30)
    started = time.monotonic()
    found = flightrec.collect(None, [(os.getpid(), {"RANK": "0"}, 0)], {}, deadline=time.monotonic() + 0.5)
    end()
    assert time.monotonic() - started < 1.5, found
    [error] = [e for e in found["errors"] if e["path"] == f"debug-server:[::]:{port}"]
    assert "timed out" in error["error"] and found["dumps"] == [], found


def test_a_port_not_proven_the_debug_server_s_is_never_sent_a_byte():
    """A listener of the rank whose accepting thread is not WorkerServer's (gloo's, NCCL's, the user's own) is never
    connected to, nor is any while WorkerServer's thread is not waiting in accept: said, in one line."""
    port, taken, end = pretending(http(json.dumps(LIVE).encode()), accept=False)
    try:
        found = flightrec.collect(None, [(os.getpid(), {"RANK": "0"}, 0)], {})
        assert found["dumps"] == [] and taken == [], found
        [error] = found["errors"]
        assert error["path"] == f"debug-server(pid {os.getpid()})" and "not waiting in accept" in error["error"]
    finally:
        end()
    time.sleep(0.1)  # the named thread has ended: a process that runs no WorkerServer is not asked, and says nothing
    assert flightrec.debug_server(os.getpid()) is None and taken == []


def test_a_rank_that_uses_nccl_is_read_from_nccl_s_own_recorder():
    """fr_trace_json serves the recorder gloo records into; NCCL records into its own, served as dump_nccl_trace_json
    (torch built with NCCL): its groups are read, gloo's beside them where NCCL has none of a group; a broken NCCL
    answer is an error, not a rank read from gloo's records alone (which would show no NCCL collective)."""
    gloo = dict(LIVE, entries=LIVE["entries"] + [dict(LIVE["entries"][0], process_group=["1", "cpu_group"], pg_id=1)])
    nccl = dict(LIVE, entries=[dict(LIVE["entries"][0], collective_seq_id=9, profiling_name="nccl:all_gather")])
    port, _, end = pretending(http(json.dumps(gloo).encode()), nccl=http(json.dumps(nccl).encode()))
    found = flightrec.collect(None, [(os.getpid(), {"RANK": "0"}, 0)], {})
    end()
    [served] = found["dumps"]
    assert [(g["pg"], [(e["seq"], e["op"], e["backend"]) for e in g["entries"]]) for g in served["groups"]] == [
        ("0", [(9, "all_gather", "nccl")]), ("1", [(4, "all_reduce", "gloo")])], served
    port, _, end = pretending(http(json.dumps(gloo).encode()), nccl=http(b"boom", b"500 Internal Server Error"))
    found = flightrec.collect(None, [(os.getpid(), {"RANK": "0"}, 0)], {})
    end()
    assert found["dumps"] == [] and "(dump_nccl_trace_json: HTTP 500: boom)" in found["errors"][0]["error"], found
