"""What reaching a node costs, kept small without changing what comes back: the node runs the head's bytecode when
its interpreter reads it, the program loads (and reads what needs no options) before its options line comes, the
first sessions start while the head builds its plan (remote.early), and ssh_config and known_hosts are parsed
once per run, without paramiko's import of invoke; small packets go out and are
acknowledged at once."""
import base64
import json
import marshal
import subprocess
import sys
import threading
import time
import types
import zlib

import pytest

from preflight.node import collector
from preflight.remote import early, shipping, ssh
from preflight.remote.session import NodeError

OPTIONS = {"head": "127.0.0.1", "port": 29500}


def run_shipped(text: str, later: str = "", delay: float = 0.0) -> subprocess.CompletedProcess:
    """The shipped command on this machine, reading `text`, then after `delay` s `later` and "done"."""
    proc = subprocess.Popen(["sh", "-c", shipping.shipped_command(sys.executable)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write(text)
    proc.stdin.flush()
    time.sleep(delay)
    out, err = proc.communicate(later + "done\n", timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def bundle_input(change) -> str:
    doc = json.loads(shipping.bundle(shipping.AGENT))
    change(doc)
    text = json.dumps(doc)
    return f"{len(text.encode())}\n{text}{json.dumps(OPTIONS)}\n"


def broken_agent_source(doc):
    doc["modules"]["preflight.node.agent"] = "raise SystemExit(9)\n"


def test_a_node_with_the_heads_interpreter_runs_the_heads_bytecode_not_the_source():
    proc = run_shipped(bundle_input(broken_agent_source))
    assert proc.stdout.startswith('{"schema"'), proc.stderr[-500:]  # the source was never compiled


def test_another_interpreter_compiles_the_shipped_source():
    def other_magic(doc):
        doc["magic"] = "00000000"

    def other_magic_and_broken_source(doc):
        other_magic(doc)
        broken_agent_source(doc)

    assert run_shipped(bundle_input(other_magic)).stdout.startswith('{"schema"')
    assert run_shipped(bundle_input(other_magic_and_broken_source)).returncode == 9


def test_the_shipped_bytecode_is_named_as_the_compiled_source_is():
    doc = json.loads(shipping.bundle(shipping.AGENT))
    code = marshal.loads(zlib.decompress(base64.b64decode(doc["code"])))
    assert set(code) == set(doc["modules"])

    def filenames(c):
        yield c.co_filename
        for inner in c.co_consts:
            if isinstance(inner, types.CodeType):
                yield from filenames(inner)

    assert set(filenames(code["preflight.node.agent"])) == {"preflight-shipped/preflight/node/agent.py"}


def test_the_options_line_may_come_after_the_program_has_loaded():
    proc = run_shipped(shipping.shipped_bundle(shipping.AGENT), json.dumps({"head": "localhost", "port": 29500}) + "\n",
                       delay=1.0)
    facts = json.loads(proc.stdout.splitlines()[0])
    assert facts["host"]["head_resolves_to"] and facts["python"]["executable"] == sys.executable


def test_the_facts_are_the_same_when_their_first_sections_are_read_before_the_options():
    at_once, prepared = collector.collect(OPTIONS), collector.collect(OPTIONS, collector.prepare())
    assert list(at_once) == list(prepared)
    for name in collector.BEFORE_OPTIONS + ("host", "env", "storage", "limits"):
        assert at_once[name] == prepared[name], name


# --- sessions begun before the plan is built ---------------------------------------------------------------

class FakeSession:
    def __init__(self, name, log, hold=None, fail=None):
        self.name, self.log, self.hold, self.fail = name, log, hold, fail

    def start(self, command, stdin_text, timeout):
        if self.hold is not None:
            self.hold.wait(10)
        if self.fail:
            raise NodeError("protocol", f"{self.name}: {self.fail}", "fix it")
        assert stdin_text == shipping.shipped_bundle(shipping.AGENT)  # no options yet: the plan is not built
        self.log.append(("started", self.name))
        return self

    def close(self):
        self.log.append(("closed", self.name))


def options(fanout=64):
    return types.SimpleNamespace(python=sys.executable, timeout=5.0, fanout=fanout, ssh_config=None, accept_new=False,
                                 transport="ssh")


def test_early_sessions_are_taken_by_the_gather_and_the_rest_closed(monkeypatch):
    log = []
    monkeypatch.setattr(early.transport, "connect", lambda kind, name, opts, handshaken: FakeSession(name, log))
    started = early.EarlyStart(["n1", "n2", "n3"], options(fanout=2))
    connection, agent = started.take("n1", 5)
    assert connection.name == "n1" and agent is connection
    assert started.take("n3", 5) is None  # past the fan-out: gather reaches it itself
    started.close()
    assert ("closed", "n2") in log and ("closed", "n1") not in log
    assert started.take("n2", 5) is None


def test_an_early_start_that_fails_or_hangs_is_that_nodes_failure(monkeypatch):
    log, hold = [], threading.Event()
    sessions = {"bad": FakeSession("bad", log, fail="sshd said no"), "hung": FakeSession("hung", log, hold=hold)}
    monkeypatch.setattr(early.transport, "connect", lambda kind, name, opts, handshaken: sessions[name])
    started = early.EarlyStart(["bad", "hung"], options())
    with pytest.raises(NodeError, match="sshd said no"):
        started.take("bad", 5)
    with pytest.raises(NodeError, match="no answer within 0.2 s"):
        started.take("hung", 0.2)
    hold.set()  # it starts after all: nobody wants it any more
    for _ in range(100):
        if ("closed", "hung") in log:
            break
        time.sleep(0.05)
    assert ("closed", "hung") in log and ("closed", "bad") in log


def test_the_head_goes_on_once_the_first_key_exchange_is_done_not_the_whole_start(monkeypatch):
    """Authentication and the exec request are the node's sshd's time (100 ms of a one-node run): the head
    loads its checks meanwhile, where it waited for the program to start."""
    log, authenticating = [], threading.Event()

    def connect(kind, name, opts, handshaken):
        handshaken()
        authenticating.wait(10)  # the node's sshd checking the key
        return FakeSession(name, log)

    monkeypatch.setattr(early.transport, "connect", connect)
    args = types.SimpleNamespace(command="check", hosts="n1", slurm=False, python=sys.executable, timeout=5.0,
                                 fanout=64, ssh_config=None, ssh_accept_new=False)
    begun = time.monotonic()
    started = early.start(args)
    try:
        assert time.monotonic() - begun < early.FIRST_WAIT_S / 2 and log == []
        authenticating.set()
        connection, agent = started.take("n1", 5)
        assert ("started", "n1") in log and agent is connection
    finally:
        authenticating.set()
        started.close()


def test_only_check_and_launch_on_hosts_start_early():
    def args(**given):
        return types.SimpleNamespace(**dict({"command": "check", "hosts": None, "slurm": False}, **given))

    assert early.start(args()) is None  # this machine alone: no transport
    assert early.start(args(command="doctor", hosts="n1")) is None
    assert early.start(args(hosts="bad[")) is None  # the run says what is wrong with it


# --- ssh_config and known_hosts ------------------------------------------------------------------------------

def test_ssh_config_and_known_hosts_are_parsed_once_per_version_of_the_file(tmp_path, monkeypatch):
    paramiko = ssh._paramiko()
    config = tmp_path / "ssh_config"
    config.write_text("".join(f"Host n{i}\n    HostName 10.0.0.{i}\n    User u\n" for i in range(1, 4)))
    parsed = []
    real = paramiko.SSHConfig.from_path
    monkeypatch.setattr(paramiko.SSHConfig, "from_path", lambda path: parsed.append(path) or real(path))
    assert [ssh.load_ssh_settings(f"n{i}", str(config)).hostname for i in (1, 2, 3)] == \
        ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert len(parsed) == 1
    config.write_text("Host n1\n    HostName 10.9.9.9\n")
    assert ssh.load_ssh_settings("n1", str(config)).hostname == "10.9.9.9" and len(parsed) == 2

    key = paramiko.ECDSAKey.generate()
    known = tmp_path / "known_hosts"
    known.write_text("".join(f"10.0.0.{i} {key.get_name()} {key.get_base64()}\n" for i in (1, 2)))
    loads = []
    real_load = paramiko.HostKeys.load
    monkeypatch.setattr(paramiko.HostKeys, "load", lambda self, path: loads.append(path) or real_load(self, path))
    for i in (1, 2):
        settings = ssh.SSHSettings(alias=f"n{i}", hostname=f"10.0.0.{i}", known_hosts_files=[str(known)])
        ssh.SSHConnection(settings, 5.0)._verify_host_key(key)  # known: no NodeError
    assert len(loads) == 1
    settings = ssh.SSHSettings(alias="n3", hostname="10.0.0.3", known_hosts_files=[str(known)])
    with pytest.raises(NodeError, match="not in known_hosts"):
        ssh.SSHConnection(settings, 5.0)._verify_host_key(key)


def test_paramiko_comes_without_invoke_unless_the_config_has_match_exec(tmp_path):
    plain, matching = tmp_path / "plain", tmp_path / "matching"
    plain.write_text("Host n1\n    HostName 10.0.0.1\n")
    matching.write_text("Match exec \"true\"\n    HostName 10.0.0.7\n")
    code = ("import sys; from preflight.remote import ssh; print(ssh.load_ssh_settings('n1', sys.argv[1]).hostname, "
            "'invoke' in sys.modules)")
    said = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                           check=True).stdout.split() for path in (plain, matching)]
    assert said == [["10.0.0.1", "False"], ["10.0.0.7", "True"]]


def test_the_connection_sends_and_acknowledges_small_packets_at_once():
    """sshd keeps Nagle's algorithm on without a terminal, and Linux delays an acknowledgement by 40 ms: the
    head's socket has TCP_NODELAY, and TCP_QUICKACK set again after every read (Linux clears it)."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    try:
        sock = ssh._prompt(socket.create_connection(server.getsockname(), timeout=5))
        peer, _ = server.accept()
        with peer:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            for word in (b"banner", b"kexinit", b"userauth-success"):
                peer.sendall(word)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)  # as Linux clears it
                assert sock.recv(100) == word
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1
            sock.settimeout(1.0)  # the rest is the socket's own
            assert sock.gettimeout() == 1.0 and not sock._closed
        sock.close()
    finally:
        server.close()


def test_what_the_head_imports_before_its_first_connection_holds_no_yaml_parser_and_no_node_program():
    """The first session starts once the CLI and preflight.remote.early are imported: PyYAML (20 ms) comes only
    with a YAML file to read, the node's programs (the agent, the collector) are shipped as files, not imported."""
    code = ("import sys, preflight.cli, preflight.remote.early; "
            "print(sorted(m for m in ('yaml', 'preflight.node.agent', 'preflight.node.collector') if m in sys.modules))")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert said.stdout.split() == ["[]"], said.stdout


def test_the_program_ends_at_once_with_everything_it_wrote_flushed(tmp_path):
    """`python -m preflight` (and the console script, cli.command) ends without the interpreter's teardown: what
    it printed is whole, through a pipe too, and its exit status is main()'s."""
    listed = subprocess.run([sys.executable, "-m", "preflight", "list", "--json"], capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0 and json.loads(listed.stdout)  # the whole document, flushed
    bad = subprocess.run([sys.executable, "-m", "preflight", "lint", "--config", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr and bad.stderr.count("\n") == 1
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"preflight": "preflight.cli:command"}
