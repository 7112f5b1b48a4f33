"""preflight launch: the gate, and `accelerate launch` started on every node with its rank (preflight.gate.launcher)."""
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from conftest import signalled_child
from preflight.gate import launcher
from preflight.inputs import launchcmd

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
SKIP = "deep,CLK002,COL"
# torchrun on CPU with gloo: --multi_gpu picks accelerate's torchrun launcher; no GPU is needed for gloo.
QUIET = ["--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1"]


# --- the command each node runs -------------------------------------------------------------------

def test_rank_flags_are_inserted_and_the_users_own_are_replaced():
    command = ["/x/bin/accelerate", "launch", "--machine_rank", "7", "--num-machines=9", "--cpu",
               "--main_process_ip", "1.2.3.4", "--config_file", "a.yaml", "train.py", "--machine_rank", "5", "--cpu"]
    assert launchcmd.rank_command(command, 2, "10.0.0.1", 29500, 3) == [
        "/x/bin/accelerate", "launch", "--machine_rank", "2", "--main_process_ip", "10.0.0.1",
        "--main_process_port", "29500", "--num_machines", "3", "--cpu", "--config_file", "a.yaml",
        # the script's own arguments are the script's: left alone
        "train.py", "--machine_rank", "5", "--cpu"]


def test_which_commands_are_started_on_every_node():
    assert launchcmd.is_accelerate_launch(["accelerate", "launch", "t.py"])
    assert launchcmd.is_accelerate_launch(["/venv/bin/accelerate", "launch", "t.py"])
    assert not launchcmd.is_accelerate_launch(["deepspeed", "--hostfile", "h", "t.py"])
    assert not launchcmd.is_accelerate_launch(["accelerate", "config"])
    assert not launchcmd.is_accelerate_launch(["python", "t.py"])


def test_the_remote_line_quotes_every_word():
    line = launcher.remote_command("/w d", ["accelerate", "launch", "t.py", "'; touch /tmp/pwned'", "$(id)"])
    assert line == "cd '/w d' && exec accelerate launch t.py ''\"'\"'; touch /tmp/pwned'\"'\"'' '$(id)'"


def test_output_is_prefixed_per_line_and_per_redraw_and_a_partial_line_is_shown_when_idle():
    import io
    import socket

    def pump(*chunks, prefix="[n1] "):  # None: the channel idle for a while (its recv timed out)
        out = io.StringIO()
        feed = iter(chunks)

        def recv(size):
            chunk = next(feed, b"")
            if chunk is None:
                raise socket.timeout()
            return chunk

        launcher._pump(recv, launcher._Output(out, out), out, prefix)
        return out.getvalue()

    assert pump(b"hello\r\nwor", b"ld\r\n") == "[n1] hello\n[n1] world\n"  # a pty's line ends
    assert pump(b"\r 10%|#", None, b"\r 20%|##", None, b"\r100%|###|\r\n") == \
        "[n1]  10%|#\r[n1]  20%|##\r[n1] 100%|###|\n"  # tqdm: each redraw shown at once, prefixed
    assert pump(b"Password: ", None, b"\r\n") == "[n1] Password: \n"  # continued without a second prefix
    assert pump(b"\xc3", None, b"\xa9t\xc3\xa9\n") == "[n1] \u00e9t\u00e9\n"  # never half a character
    assert pump(b"x" * 70000) == "[n1] " + "x" * 70000 + "\n"
    out = io.StringIO()
    output = launcher._Output(out, out)
    output.write(out, "[a] ", " 10%", "")
    output.write(out, "[b] ", "line", "\n")  # another node's line ends a's partial one first
    output.write(out, "[a] ", "", "\r")
    output.write(out, "[a] ", " 20%", "")
    output.end(out, "[a] ")
    assert out.getvalue() == "[a]  10%\n[b] line\n[a]  20%\n"


# --- on the test cluster ---------------------------------------------------------------------------

def launch(cluster, workdir, *command, extra=(), **popen):
    argv = [sys.executable, "-m", "preflight", "launch", "--hosts", ",".join(cluster.nodes), "--ssh-config",
            str(cluster.ssh_config), "--python", sys.executable, "--skip", SKIP, "--timeout", "10", *extra,
            "--", *map(str, command)]
    if popen:
        return subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=signalled_child)
    return subprocess.run(argv, cwd=workdir, capture_output=True, text=True, timeout=180)


def leftovers(token: str) -> str:
    """Processes anywhere (the nodes' too: they share this PID namespace) whose command line has token."""
    return subprocess.run(["pgrep", "-af", token], capture_output=True, text=True).stdout.strip()


def scripts_running(name: str) -> list:
    """The interpreters running the script `name` (not the launchers, whose command lines name it too),
    whatever the interpreter is called (python, python3)."""
    return [line for line in leftovers(name).splitlines() if line.endswith(" " + name) and "accelerate" not in line]


ALL_REDUCE = """
import json, os, socket, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print("RESULT " + json.dumps({"host": socket.gethostname(), "rank": dist.get_rank(), "world": dist.get_world_size(),
      "sum": t.item(), "master": os.environ["MASTER_ADDR"], "port": os.environ["MASTER_PORT"], "argv": sys.argv[1:]}),
      flush=True)
dist.destroy_process_group()
"""


@pytest.mark.cluster
def test_accelerate_launch_runs_a_gloo_all_reduce_across_the_nodes_with_hostile_args_kept_literal(cluster, tmp_path):
    (tmp_path / "ar.py").write_text(ALL_REDUCE)
    pwned = tmp_path / "pwned"
    hostile = [f"'; touch {pwned}", f"$(touch {pwned})", f"`touch {pwned}`", "a b", "*"]
    started = time.monotonic()
    proc = launch(cluster, tmp_path, ACCELERATE, "launch", "--multi_gpu", "--num_processes", "3", *QUIET,
                  "--machine_rank", "9", "--num_machines", "1",  # wrong on purpose: preflight sets them
                  "ar.py", *hostile, extra=["--port", "29561"])
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    found = {}
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            prefix, _, doc = line.partition("RESULT ")
            found[prefix] = json.loads(doc)
    assert set(found) == {f"[{n}] " for n in cluster.nodes}, proc.stdout
    assert sorted(r["rank"] for r in found.values()) == [0, 1, 2]
    for prefix, r in found.items():
        assert prefix == f"[{r['host']}] "  # each line carries the node it came from
        assert r["world"] == 3 and r["sum"] == 6.0
        assert r["master"] == cluster.ip(cluster.nodes[0]) and r["port"] == "29561"
        assert r["argv"] == hostile
    assert found[f"[{cluster.nodes[0]}] "]["rank"] == 0
    assert not pwned.exists()
    assert "machine_rank 2" in proc.stderr
    print(f"3-node all-reduce launch: {elapsed:.1f} s")


FAIL_ONE = """
import socket, sys, time
host = socket.gethostname()
print(host, "started", flush=True)
if host == "node02":
    time.sleep(1)
    sys.exit(3)
time.sleep(60)
open(sys.argv[1] + "-" + host, "w").close()
"""


@pytest.mark.cluster
def test_a_failing_node_stops_the_others_and_sets_the_exit_code(cluster, tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text(FAIL_ONE)
    started = time.monotonic()
    proc = launch(cluster, tmp_path, ACCELERATE, "launch", "--cpu", "--num_processes", "1", *QUIET, script.name,
                  tmp_path / "survived")
    elapsed = time.monotonic() - started
    # accelerate's own launcher turns the script's exit 3 into its exit 1: that is node02's exit code
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "node02 exited with 1; stopping node01, node03" in proc.stderr
    assert "[node02] " in proc.stdout and "[node01] node01 started" in proc.stdout
    assert elapsed < 40, elapsed
    time.sleep(0.5)
    assert leftovers(str(script)) == ""
    assert not list(tmp_path.glob("survived-*"))


@pytest.mark.cluster
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
def test_ctrl_c_sigterm_and_sighup_stop_every_node(cluster, tmp_path, sig):
    script = tmp_path / "sleeper.py"
    script.write_text("import socket, time\nprint(socket.gethostname(), 'started', flush=True)\ntime.sleep(60)\n")
    proc = launch(cluster, tmp_path, ACCELERATE, "launch", "--cpu", "--num_processes", "1", *QUIET, script.name,
                  popen=True)
    try:
        deadline = time.monotonic() + 90
        while len(scripts_running(script.name)) < 3:  # the scripts themselves, on 3 nodes
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        stopped = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        assert time.monotonic() - stopped < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted; stopping node01, node02, node03" in err
    time.sleep(0.5)
    assert leftovers(str(tmp_path)) == ""


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["accelerate", "deepspeed-gate"])
def test_a_failing_verdict_launches_nothing_on_any_node(cluster, tmp_path, kind):
    marker = tmp_path / "marker"
    (tmp_path / "touch.py").write_text(f"import socket\nopen({str(marker)!r} + '-' + socket.gethostname(), 'w')\n")
    cluster.drop_port("node01", 29562)  # the workers cannot reach the head's main port: NET fails
    if kind == "accelerate":
        command = [ACCELERATE, "launch", "--cpu", "--num_processes", "1", *QUIET, "touch.py"]
    else:  # anything but `accelerate launch` is run here, by exec, only after a passing verdict
        command = ["touch", marker]
    proc = launch(cluster, tmp_path, *command, extra=["--only", "NET", "--port", "29562", "--timeout", "3"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "not launching" in proc.stderr
    assert not list(tmp_path.glob("marker*"))


PROGRESS = r"""
import os, socket, sys, time
for i in range(1, 4):
    sys.stdout.write(f"\r{socket.gethostname()} step {i}/3")  # as tqdm draws: `\r` first, no newline
    sys.stdout.flush()
    time.sleep(0.5)
while not os.path.exists(sys.argv[1]):  # the bar stays drawn until the test has seen it
    time.sleep(0.1)
print("\ndone", flush=True)
"""


@pytest.mark.cluster
def test_progress_bars_stream_as_they_are_drawn_prefixed_before_the_program_ends(cluster, tmp_path):
    import os
    import threading

    script = tmp_path / "progress.py"
    script.write_text(PROGRESS)
    go = tmp_path / "go"
    proc = launch(cluster, tmp_path, ACCELERATE, "launch", "--cpu", "--num_processes", "1", *QUIET, script.name, go,
                  popen=True)
    seen = []

    def read():
        while True:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            seen.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        wanted = [f"[{n}] {n} step 3/3".encode() for n in cluster.nodes]
        while not all(w in b"".join(seen) for w in wanted):  # drawn while every program still waits for `go`
            assert time.monotonic() < deadline and proc.poll() is None, (b"".join(seen)[-2000:], proc.stderr.read())
            time.sleep(0.1)
        go.touch()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    out = b"".join(seen).decode()
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    for node in cluster.nodes:
        # each redraw starts with the node's prefix and keeps its `\r` (a terminal redraws the bar in place),
        # unless another node's output came between: that ends the line first
        for step in (1, 2):
            assert re.search(rf"(^|[\r\n])\[{node}\] {node} step {step}/3[\r\n]", out), out
        assert f"[{node}] done\n" in out
