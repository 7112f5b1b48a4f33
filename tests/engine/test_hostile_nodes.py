"""Hostile and hung nodes on the real test cluster: a sshd that never starts the program (tests/stub_sshd.py), a
hostile interpreter given with --python that answers in the collector's place (crafted facts and answers, slow
answers, lines past the cap), and programs that ignore the end of their session. Each must cost one node a
clear failure within the timeout, never the run (exit 3, a hang, a thread's traceback), and leave no process
or file behind on the node."""
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import cluster, cluster_up, testcluster  # noqa: F401  (fixtures)
from conftest import preflight_json, results, signalled_child
from preflight.gate import launcher
from preflight.remote import shipping
from preflight.remote.session import MAX_LINE, LineReader, NodeError

STUB = Path(__file__).parents[1] / "stub_sshd.py"

# A stand-in for the training interpreter: it reads what preflight ships (as shipping.BOOTSTRAP does), runs
# the real collector's code, and on the node named HOSTILE_ON does what the test appends instead.
PREAMBLE = '''#!{python}
import json, os, signal, socket, sys, tempfile, time
STARTED = time.time()
HOSTILE = socket.gethostname() == {node!r}


def _line():
    b = b""
    while not b.endswith(b"\\n"):
        c = os.read(0, 1)
        if not c:
            break
        b += c
    return b


_n = int(_line())
_src = b""
while len(_src) < _n:
    _src += os.read(0, _n - len(_src))
OPTIONS = json.loads(_line())
import importlib
from preflight.node import agent as _agent, collector as _collector  # the shipped modules, as installed here
real = {{"collect": _collector.collect, "Agent": _agent.Agent, "serve": _agent.serve,
        "main": importlib.import_module(json.loads(_src)["main"]).main}}


def say(text):
    sys.stdout.write(text + "\\n")
    sys.stdout.flush()


def facts(**changes):
    doc = real["collect"](OPTIONS)
    doc.update(changes)
    return doc


def requests():
    """The requests as they come, until "done" or the end of input."""
    pending = b""
    while True:
        while b"\\n" not in pending:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\\n", 1)
        if line.strip() in (b"", b"done"):
            return
        yield json.loads(line)


def agent(answer=lambda request, real_answer: json.dumps(real_answer)):
    """The real agent's answers, each through answer() (the line sent)."""
    real_agent = real["Agent"]()
    for request in requests():
        say(answer(request, real_agent.handle(request)))


def stubborn():
    """Ignore every signal that can be ignored, and never end."""
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        time.sleep(1)


if "ranks" in OPTIONS and not HOSTILE:  # the all-reduce worker
    real["main"](OPTIONS)
    sys.exit(0)
if not HOSTILE:
    say(json.dumps(real["collect"](OPTIONS)))
    real["serve"](real["Agent"](), 0, sys.stdout)
    sys.exit(0)
'''


def interpreter(tmp_path, node, body, name="python"):
    """An executable stand-in for --python: the real collector everywhere but on `node`, where `body` runs."""
    path = tmp_path / name
    path.write_text(PREAMBLE.format(python=sys.executable, node=node) + body)
    path.chmod(0o755)
    return str(path)


def check(cluster, python, *extra, hosts=None, skip="deep,CLK002,COL"):
    args = ["check", "--hosts", hosts or ",".join(cluster.nodes), "--ssh-config", cluster.ssh_config,
            "--python", python, *extra]
    return preflight_json(*args, *(["--skip", skip] if skip else []))


def failure(doc, node):
    """The one failing result that names `node` (SSH001 for a node that stopped answering as it should)."""
    failed = [r for r in doc["results"] if r["status"] in ("fail", "error") and node in r["nodes"]]
    assert len(failed) == 1, failed
    return failed[0]


def node_pids(cluster, node):
    return set(testcluster.netns_pids(cluster.netns(node)))


def wait_for_pids(cluster, node, expected, seconds=10.0):
    deadline = time.monotonic() + seconds
    while node_pids(cluster, node) - expected and time.monotonic() < deadline:
        time.sleep(0.1)
    left = node_pids(cluster, node) - expected
    return {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for pid in left
            if Path(f"/proc/{pid}").exists()}


# --------------------------------------------------------------------------------- a sshd that never answers

def test_a_sshd_that_never_answers_the_exec_or_session_request_costs_one_timeout(cluster, tmp_path):
    node, ip = "node03", cluster.ip("node03")
    host_key = cluster.node_dir(node) / "ssh_host_ed25519_key"
    public = host_key.with_suffix(".pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(cluster.known_hosts.read_text() + "".join(f"[{ip}]:{port} {' '.join(public)}\n"
                                                               for port in (2301, 2302)))
    config = tmp_path / "ssh_config"
    config.write_text("".join(f"Host {name}\n    HostName {ip}\n    Port {port}\n    User root\n    IdentityFile "
                              f"{cluster.identity}\n    IdentitiesOnly yes\n    UserKnownHostsFile {known}\n"
                              "    StrictHostKeyChecking yes\n\n" for name, port in (("noexec", 2301), ("nosession", 2302)))
                      + cluster.ssh_config.read_text())
    stubs = [cluster.netns_popen(node, [sys.executable, str(STUB), "--port", str(port), "--host-key", str(host_key),
                                        "--authorized-key", f"{cluster.identity}.pub", "--stall", stall],
                                 stdout=subprocess.PIPE)
             for port, stall in ((2301, "exec"), (2302, "session"))]
    try:
        for stub in stubs:
            assert stub.stdout.readline().strip() == b"ready"
        started = time.monotonic()
        doc, elapsed = preflight_json("check", "--hosts", "node01,noexec,nosession", "--ssh-config", config,
                                      "--python", sys.executable, "--timeout", "3", "--skip", "deep,CLK002,COL")
        assert elapsed < 15, elapsed
        ssh = results(doc, "SSH001")
        for name in ("noexec", "nosession"):
            assert ssh[name]["status"] == "fail", ssh[name]
            assert "did not start the program within 3 s" in ssh[name]["message"], ssh[name]
        assert ssh["node01"]["status"] == "pass" and doc["verdict"] == "fail"
        # launch gates on the same run: not launched, and bounded the same way
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "preflight", "launch", "--hosts", "node01,noexec", "--ssh-config",
                               str(config), "--python", sys.executable, "--timeout", "3", "--skip", "deep,CLK002,COL",
                               "--", "true"], capture_output=True, text=True, timeout=120)
        assert time.monotonic() - started < 15
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "not launching" in proc.stderr
        # launch's own start of the job, past the gate: bounded too, the started nodes stopped
        out, err = io.StringIO(), io.StringIO()
        started = time.monotonic()
        code = launcher.run(["node01", "noexec"], cluster.ip("node01"), 29500, ["sleep", "30"], ssh_config=str(config),
                            timeout=3, pty=False, out=out, err=err)
        assert time.monotonic() - started < 15 and code == 1, err.getvalue()
        assert "noexec: the node's sshd did not start the program within 3 s" in err.getvalue(), err.getvalue()
    finally:
        for stub in stubs:
            os.killpg(stub.pid, signal.SIGKILL)
            stub.wait(10)


# ----------------------------------------------------------------------------- answers of the wrong shape

NESTED = "[" * 100000 + "]" * 100000

FACTS = {
    "host-a-list": ("say(json.dumps(facts(host=[])))", "'host' is a list"),
    "packages-a-string": ("say(json.dumps(facts(packages='torch')))", "'packages' is a string"),
    "env-null": ("say(json.dumps(facts(env=None)))", "'env' is null"),
    "no-gpus": ("doc = facts(); doc.pop('gpus'); say(json.dumps(doc))", "there is no 'gpus'"),
    "schema-a-string": ("say(json.dumps(facts(schema='1')))", "'schema' is a string"),
    "job-a-number": ("say(json.dumps(facts(job=5)))", "'job' is a number"),
    "nested": ("say('{\"schema\": 1, \"deep\": ' + %r + '}')" % NESTED, "nested too deeply"),
    "overflowing-float": ("say(json.dumps(facts()).replace('\"memory\": {', '\"memory\": {\"x\": 1e400, ', 1))",
                          "past a float's range"),
    "huge-integer": ("say(json.dumps(facts(collected_at=10 ** 40)))", "a number of 41 digits"),
    "not-json": ("say('{\"schema\": 1, oops')", "is not JSON"),
}


@pytest.mark.parametrize("case", sorted(FACTS))
def test_facts_of_the_wrong_shape_are_that_nodes_failure(cluster, tmp_path, case):
    body, expected = FACTS[case]
    doc, _ = check(cluster, interpreter(tmp_path, "node02", body + "\nagent()\n"))
    result = failure(doc, "node02")
    assert result["id"] == "SSH001" and result["message"].startswith("protocol error: "), result
    assert "node02" in result["message"] and expected in result["message"], result
    assert results(doc, "SSH001")["node01"]["status"] == "pass"
    assert results(doc, "PKG001")["node01"]["status"] == "pass"  # the others are checked as usual


SECTIONS = {  # a section of another shape inside well-formed facts: (the change, what PKG003 must say)
    "gpu-names": ("doc['gpus'] = {'available': True, 'count': 2, 'devices': ['GPU-0', 'GPU-1']}",
                  "gpus.devices[0] is a string"),
    "shm-sizes": ("doc['storage']['shm']['free_bytes'] = '64M'", "storage['shm'].free_bytes is a string"),
    "interfaces": ("doc['host']['interfaces'] = {'eth0': 5}", "host.interfaces['eth0'] is a number"),
    "limits": ("doc['limits']['nofile'] = [1024]", "limits['nofile'] has 1 items, not 2"),
}


@pytest.mark.parametrize("case", sorted(SECTIONS))
def test_a_section_of_another_shape_is_that_nodes_failed_section(cluster, tmp_path, case):
    """Well-formed facts with one section of another shape: that section is the node's PKG003 error and the
    checks that read it say "not evaluated" on that node; its other facts and the other nodes are checked."""
    change, expected = SECTIONS[case]
    body = f"doc = facts()\n{change}\nsay(json.dumps(doc))\nagent()\n"
    doc, _ = check(cluster, interpreter(tmp_path, "node02", body))  # exit as the verdict says, never 3
    pkg003 = results(doc, "PKG003")["node02"]
    assert pkg003["status"] == "error" and expected in pkg003["message"], pkg003
    assert "not the collector's" in pkg003["message"]
    assert not [r for r in doc["results"] if "defect in the check" in (r.get("remediation") or "")]
    assert results(doc, "SSH001")["node02"]["status"] == "pass"
    assert results(doc, "PKG001")["node01"]["status"] == "pass"


def lie(op, line):
    """An agent that answers `op` with `line` and every other request truly."""
    return f"say(json.dumps(facts()))\nagent(lambda request, answer: {line!r} if request['op'] == {op!r} " \
           "else json.dumps(answer))\n"


ANSWERS = {  # request: (node that lies, the line it sends, what the message must say)
    "time-a-string": ("node02", lie("time", '{"time": "soon"}'), "to 'time' is not the agent's: 'time' is a string"),
    "time-a-boolean": ("node02", lie("time", '{"time": true}'), "'time' is a boolean"),
    "time-a-list": ("node02", lie("time", "[]"), "to 'time' is not the agent's: it is a list, not an object"),
    "time-null": ("node02", lie("time", "null"), "it is null, not an object"),
    "time-nested": ("node02", lie("time", NESTED), "to 'time' is JSON nested too deeply"),
    "time-infinite": ("node02", lie("time", '{"time": Infinity}'), "Infinity is not a number"),
    "listen-a-string": ("node01", lie("listen", '{"bound": "yes"}'), "to 'listen' is not the agent's: 'bound' is a string"),
    "listen-holders": ("node01", lie("listen", '{"bound": false, "holders": ["pid 1"]}'), "'holders' are not objects"),
    "connect-no-ok": ("node02", lie("connect", '{"seconds": 0.1}'), "to 'connect' is not the agent's: there is no 'ok'"),
    "read-a-list": ("node02", lie("read", '{"ok": []}'), "to 'read' is not the agent's: 'ok' is a list"),
}


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_probe_answers_of_the_wrong_shape_are_that_nodes_failure(cluster, tmp_path, case):
    node, body, expected = ANSWERS[case]
    shared = tmp_path / "shared"
    shared.mkdir()
    doc, _ = check(cluster, interpreter(tmp_path, node, body), "--shared-dir", shared)
    result = failure(doc, node)
    assert result["id"] == "SSH001" and result["message"].startswith("protocol error: "), result
    assert f"the answer of {node}" in result["message"] and expected in result["message"], result
    others = [n for n in cluster.nodes if n != node]
    assert all(results(doc, "SSH001")[n]["status"] == "pass" for n in others)
    assert doc["verdict"] == "fail"
    assert list(shared.iterdir()) == []  # the token is removed whoever lied


# ------------------------------------------------------------------------------------------ line lengths

def test_a_line_past_the_cap_fails_that_node_and_nothing_else(cluster, tmp_path):
    body = ("chunk = b'a' * (1 << 20)\nsys.stdout.buffer.write(b'{\"schema\": 1, \"x\": \"')\n"
            f"for _ in range({(MAX_LINE >> 20) + 2}):\n    sys.stdout.buffer.write(chunk)\nsys.stdout.flush()\nstubborn()\n")
    doc, elapsed = check(cluster, interpreter(tmp_path, "node02", body), "--timeout", "30")
    result = failure(doc, "node02")
    assert f"a line longer than {MAX_LINE >> 20} MiB" in result["message"] and "node02" in result["message"], result
    assert results(doc, "SSH001")["node03"]["status"] == "pass"


class Chunks(LineReader):
    """A LineReader over bytes in memory, delivered in 64 KiB chunks as a channel gives them."""

    def __init__(self, data: bytes):
        super().__init__()
        self.data, self.offset = data, 0

    def _receive(self, seconds):
        chunk = self.data[self.offset:self.offset + 65536]
        self.offset += len(chunk)
        return chunk


def test_reading_a_line_is_linear_in_its_length_and_capped():
    big = b"x" * (MAX_LINE - 1)
    reader = Chunks(big + b"\nsecond\nlast")
    started = time.monotonic()
    assert reader.read_line(60) == big.decode()
    took = time.monotonic() - started
    assert took < 3, took  # re-scanning and copying the buffer per chunk (quadratic) takes minutes here
    assert [reader.read_line(1), reader.read_line(1), reader.read_line(1)] == ["second", "last", None]
    reader = Chunks(b"y" * (MAX_LINE + 1) + b"\nnext\n")
    with pytest.raises(NodeError, match="longer than 64 MiB"):
        reader.read_line(60)
    assert reader.read_line(1) is None  # what follows a line past the cap is not read as answers


# ------------------------------------------------------------------------------------------------ deadlines

def test_a_node_that_answers_each_request_just_in_time_costs_one_timeout_and_is_named_slow(cluster, tmp_path):
    body = ("time.sleep(max(0.0, 2.5 - (time.time() - STARTED)))\nsay(json.dumps(facts()))\n"
            "agent(lambda request, answer: time.sleep(2.5) or json.dumps(answer))\n")
    doc, elapsed = check(cluster, interpreter(tmp_path, "node02", body), "--timeout", "4")
    # eight clock samples at 2.5 s each used to cost 20 s more; now the start, facts and samples share 4 s
    assert elapsed < 10, elapsed
    result = failure(doc, "node02")
    assert result["id"] == "SSH001" and "node02 is too slow: no clock samples within --timeout 4 s" in result["message"]
    assert results(doc, "NET004")["node03"]["status"] == "pass"


# --------------------------------------------------------------------------------- nothing left on a node

def test_a_keeper_told_to_stop_kills_its_program_and_removes_its_folder(tmp_path):
    """SIGTERM (slurmstepd ending a step, a test cluster torn down), SIGHUP or SIGINT to the keeper itself: the
    program's group is killed and its private TMPDIR removed, as at the end of the session."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        marker = f"1000.{sig.value}"
        program = tmp_path / "hostile-python"
        program.write_text(f"#!/bin/sh\ntrap '' HUP TERM INT\nexec sleep {marker}\n")  # ignores its input too
        program.chmod(0o755)
        keeper = subprocess.Popen(shipping.shipped_command(str(program)), shell=True, stdin=subprocess.PIPE,
                                  env=dict(os.environ, TMPDIR=str(tmp_path)), start_new_session=True,
                                  preexec_fn=signalled_child)
        deadline = time.monotonic() + 10
        while not (list(tmp_path.glob("preflight.*")) and sleeping(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(tmp_path.glob("preflight.*")) and sleeping(marker)
        keeper.send_signal(sig)
        assert keeper.wait(10) != 0
        deadline = time.monotonic() + 5
        while sleeping(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sleeping(marker) and not list(tmp_path.glob("preflight.*")), sig
        keeper.stdin.close()


def sleeping(marker):
    return subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True).returncode == 0


def test_a_program_that_ignores_the_end_of_its_session_is_killed_and_leaves_no_files(cluster, tmp_path):
    where = tmp_path / "tmpdir"
    body = (f"open({str(where)!r}, 'w').write(tempfile.mkdtemp())\n"
            "say(json.dumps(facts()))\n"
            "agent()\n"
            "stubborn()\n")
    before = node_pids(cluster, "node02")
    doc, _ = check(cluster, interpreter(tmp_path, "node02", body), "--timeout", "5")
    assert doc["verdict"] == "pass", [r for r in doc["results"] if r["status"] not in ("pass", "skip")]
    left = wait_for_pids(cluster, "node02", before)
    assert not left, left
    assert not Path(where.read_text()).exists()


def test_a_hung_collector_is_killed_when_its_session_closes(cluster, tmp_path):
    body = "stubborn()\n"
    before = node_pids(cluster, "node02")
    doc, elapsed = check(cluster, interpreter(tmp_path, "node02", body), "--timeout", "3")
    assert "node02 is too slow: no facts within --timeout 3 s" in failure(doc, "node02")["message"]
    left = wait_for_pids(cluster, "node02", before)
    assert not left, left


def test_a_hung_all_reduce_worker_is_killed_and_leaves_no_files(cluster, tmp_path):
    where = tmp_path / "worker-file"
    body = ("if 'ranks' in OPTIONS:\n"
            f"    open({str(where)!r}, 'w').write(tempfile.mkstemp(prefix='preflight-col-')[1])\n"
            "    stubborn()\n"
            "say(json.dumps(facts()))\n"
            "real['serve'](real['Agent'](), 0, sys.stdout)\n")
    before = node_pids(cluster, "node02")
    doc, _ = check(cluster, interpreter(tmp_path, "node02", body), "--only", "COL001", "--timeout", "5",
                   "--col-sizes", "1K", hosts="node01,node02", skip=None)
    assert results(doc, "COL001")["node02"]["status"] in ("fail", "error")
    left = wait_for_pids(cluster, "node02", before)
    assert not left, left
    assert where.exists() and not Path(where.read_text()).exists()
