"""The test cluster itself (scripts/testcluster.py), checked with the plain OpenSSH client: every node is a
separate host with its own name, and every fault bites and is reversed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import cluster, cluster_unavailable, cluster_up, testcluster  # noqa: F401  (fixtures are found by module attribute)

pytestmark = pytest.mark.cluster

VENV_PYTHON = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python")
REMOTE_PYTHON = VENV_PYTHON if os.access(VENV_PYTHON, os.X_OK) else sys.executable
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except socket.timeout:
    print("timeout")
except OSError as exc:
    print(type(exc).__name__)
"""


def ssh_out(cluster, node, command):
    proc = cluster.ssh(node, command)
    assert proc.returncode == 0, f"ssh {node} {command!r}: rc {proc.returncode}: {proc.stderr}"
    return proc.stdout.strip()


def remote_clock_offset(cluster, node):
    before = time.time()
    remote = float(ssh_out(cluster, node, "python3 -c 'import time; print(time.time())'"))
    after = time.time()
    return remote - (before + after) / 2


def connect_from(cluster, node, ip, port, timeout=2.0):
    """A TCP connect from inside another node's network namespace: connected / timeout / the error."""
    proc = cluster.netns_exec(node, [sys.executable, "-c", CONNECT, ip, str(port), str(timeout)],
                              timeout=timeout + 10, check=True)
    return proc.stdout.strip()


def test_each_node_is_its_own_host(cluster):
    assert cluster.nodes == ["node01", "node02", "node03"]
    for i, node in enumerate(cluster.nodes, start=1):
        assert cluster.ip(node) == f"10.77.0.{10 + i}"
        out = ssh_out(cluster, node, "hostname; python3 -c 'import socket; print(socket.gethostname())';"
                                     " getent hosts node01 node02 node03 login")
        lines = out.splitlines()
        assert lines[:2] == [node, node]
        resolved = {line.split()[1]: line.split()[0] for line in lines[2:]}
        assert resolved == {"node01": "10.77.0.11", "node02": "10.77.0.12", "node03": "10.77.0.13",
                            "login": "10.77.0.1"}
    # node to node over the bridge, by name
    assert connect_from(cluster, "node01", "10.77.0.13", 22) == "connected"
    # the host keys are pinned under the IP too (StrictHostKeyChecking yes)
    proc = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes",
                           "-o", f"UserKnownHostsFile={cluster.known_hosts}", "-i", str(cluster.identity),
                           "root@10.77.0.12", "hostname"], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "node02", proc.stderr


def test_root_namespace_is_untouched(cluster):
    assert Path("/etc/hosts").read_text().find("10.77.0.") == -1
    assert socket.gethostname() not in cluster.nodes


def test_stopped_sshd_refuses_connections(cluster):
    with cluster.stopped_sshd("node02"):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((cluster.ip("node02"), 22), timeout=3)
        proc = cluster.ssh("node02", "true")
        assert proc.returncode == 255 and "Connection refused" in proc.stderr
        assert ssh_out(cluster, "node01", "hostname") == "node01"
    assert ssh_out(cluster, "node02", "hostname") == "node02"


def test_frozen_sshd_accepts_tcp_but_sends_no_banner(cluster):
    with cluster.frozen_sshd("node02"):
        with socket.create_connection((cluster.ip("node02"), 22), timeout=3) as sock:
            sock.settimeout(3)
            with pytest.raises(socket.timeout):
                sock.recv(64)
    assert cluster.banner("node02", timeout=3).startswith(b"SSH-2.0-")
    assert ssh_out(cluster, "node02", "hostname") == "node02"


def test_fake_time_shifts_the_clock_of_sessions_only(cluster):
    assert abs(remote_clock_offset(cluster, "node02")) < 1.0
    with cluster.faked_time("node02", "+5s"):
        assert 4.0 < remote_clock_offset(cluster, "node02") < 6.5
        assert abs(remote_clock_offset(cluster, "node01")) < 1.0
        sshd_pid = cluster.sshd_pid("node02")
        sshd_env = Path(f"/proc/{sshd_pid}/environ").read_bytes()
        assert b"LD_PRELOAD" not in sshd_env  # sshd itself runs without libfaketime
    assert abs(remote_clock_offset(cluster, "node02")) < 1.0


def test_set_env_reaches_sessions(cluster):
    with cluster.env("node03", PF_MARK="one two"):
        assert ssh_out(cluster, "node03", 'echo "$PF_MARK"') == "one two"
        assert ssh_out(cluster, "node01", 'echo "${PF_MARK:-unset}"') == "unset"
    assert ssh_out(cluster, "node03", 'echo "${PF_MARK:-unset}"') == "unset"


def test_shadowed_package_version(cluster):
    query = f"{REMOTE_PYTHON} -c 'import importlib.metadata as m; print(m.version(\"accelerate\"))'"
    real = ssh_out(cluster, "node01", query)
    assert real and real != "0.20.0"
    with cluster.shadowed_package("node02", "accelerate", "0.20.0"):
        assert ssh_out(cluster, "node02", query) == "0.20.0"
        assert ssh_out(cluster, "node01", query) == real
    assert ssh_out(cluster, "node02", query) == real


def test_dropped_port_times_out_while_listening(cluster):
    port = 29500
    ip = cluster.ip("node02")
    listener = cluster.netns_popen("node02", [sys.executable, "-c",
                                              "import socket, time\n"
                                              f"s = socket.create_server(('0.0.0.0', {port}))\n"
                                              "while True: s.accept()[0].close()"])
    try:
        deadline = time.monotonic() + 10
        while connect_from(cluster, "node01", ip, port, 1) != "connected":
            assert time.monotonic() < deadline, "listener did not come up"
            time.sleep(0.1)
        with cluster.dropped_port("node02", port):
            assert connect_from(cluster, "node01", ip, port, 1.5) == "timeout"
            assert connect_from(cluster, "node03", ip, 22, 1.5) == "connected"  # only that port
        assert connect_from(cluster, "node01", ip, port, 1.5) == "connected"
    finally:
        listener.terminate()
        listener.wait(timeout=10)


def test_blocked_incoming_refuses_new_connections_but_to_the_allowed_ports(cluster):
    ip = cluster.ip("node02")
    listener = cluster.netns_popen("node02", [sys.executable, "-c",
                                              "import socket\n"
                                              "servers = [socket.create_server(('0.0.0.0', p)) for p in (29500, 40000)]\n"
                                              "while True: [s.accept()[0].close() for s in servers]"])
    try:
        deadline = time.monotonic() + 10
        while connect_from(cluster, "node01", ip, 29500, 1) != "connected":
            assert time.monotonic() < deadline, "listener did not come up"
            time.sleep(0.1)
        with cluster.blocked_incoming("node02", 29500):
            assert connect_from(cluster, "node01", ip, 40000, 1.5) == "timeout"
            assert connect_from(cluster, "node01", ip, 29500, 1.5) == "connected"
            assert connect_from(cluster, "node01", ip, 22, 1.5) == "connected"  # SSH always
            assert connect_from(cluster, "node02", cluster.ip("node01"), 22, 1.5) == "connected"  # going out
        assert connect_from(cluster, "node01", ip, 40000, 1.5) == "connected"
    finally:
        listener.terminate()
        listener.wait(timeout=10)


def test_loopback_hostname(cluster):
    hosts = cluster.node_dir("node02") / "hosts"
    inode = hosts.stat().st_ino
    with cluster.loopback_hostname_fault("node02"):
        assert ssh_out(cluster, "node02", "getent hosts node02").split()[0] == "127.0.1.1"
        assert ssh_out(cluster, "node01", "getent hosts node02").split()[0] == "10.77.0.12"
        assert hosts.stat().st_ino == inode  # rewritten in place: the bind mount follows
    assert ssh_out(cluster, "node02", "getent hosts node02").split()[0] == "10.77.0.12"


def test_small_shm(cluster):
    query = "python3 -c 'import os; s = os.statvfs(\"/dev/shm\"); print(s.f_blocks * s.f_frsize)'"
    normal = int(ssh_out(cluster, "node02", query))
    with cluster.small_shm_fault("node02", "64m"):
        assert int(ssh_out(cluster, "node02", query)) == 64 * 2 ** 20
        assert int(ssh_out(cluster, "node01", query)) == normal
        assert os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize == normal
    assert int(ssh_out(cluster, "node02", query)) == normal


def plain_ssh(cluster, node, *command):
    """stdout of `ssh -F DIR/ssh_config NODE COMMAND...`, exactly as the OpenSSH client prints it."""
    proc = subprocess.run(["ssh", "-F", str(cluster.ssh_config), node, *command], capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"ssh {node} {command}: rc {proc.returncode}: {proc.stderr}"
    return proc.stdout


def mounted_in_node(cluster, node, path):
    """The processes of the node (sshd and its sessions) whose mount table has `path`."""
    found = []
    for pid in testcluster.netns_pids(cluster.netns(node)):
        try:
            if f" {path} " in Path(f"/proc/{pid}/mountinfo").read_text():
                found.append(pid)
        except OSError:
            pass  # ended meanwhile
    return found


def test_bind_dir_is_private_to_the_node(cluster, tmp_path):
    target = tmp_path / "data"  # missing: bind_dir creates it
    private = cluster.bind_dir("node02", target)
    assert target.is_dir() and private.is_dir() and private.parent == cluster.node_dir("node02") / "binds"
    (private / "file").write_text("node02's own\n")
    other = cluster.bind_dir("node03", target)
    (other / "file").write_text("node03's own\n")
    assert plain_ssh(cluster, "node02", f"cat {target}/file") == "node02's own\n"
    assert plain_ssh(cluster, "node03", f"cat {target}/file") == "node03's own\n"
    assert plain_ssh(cluster, "node01", f"ls -A {target}") == ""  # the login node's folder, empty
    assert list(target.iterdir()) == []
    pid = cluster.sshd_pid("node02")
    cluster.set_env("node02", PF_MARK="1")  # restarts sshd: a fresh mount namespace, the bind again
    assert cluster.sshd_pid("node02") != pid
    assert plain_ssh(cluster, "node02", f"cat {target}/file") == "node02's own\n"
    assert cluster.bind_dir("node02", target) == private  # once per target

    cluster.restore("node02")
    assert plain_ssh(cluster, "node02", f"ls -A {target}") == ""
    assert not private.exists() and not (cluster.node_dir("node02") / "binds").exists()
    assert mounted_in_node(cluster, "node02", target) == []
    assert mounted_in_node(cluster, "node03", target) != []  # restore is per node
    assert str(target) not in Path("/proc/self/mountinfo").read_text()
    proc = subprocess.run([sys.executable, str(Path(testcluster.__file__)), "restore", "--dir", str(cluster.dir),
                           "node03", "bind-dir", str(target)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert mounted_in_node(cluster, "node03", target) == [] and not other.exists()

    proc = subprocess.run([sys.executable, str(Path(testcluster.__file__)), "fault", "--dir", str(cluster.dir),
                           "node01", "bind-dir", str(target)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    (Path(proc.stdout.strip()) / "file").write_text("node01's own\n")
    assert plain_ssh(cluster, "node01", f"cat {target}/file") == "node01's own\n"
    cluster.unbind_dir("node01")
    with cluster.bound_dir("node01", target) as private:
        assert plain_ssh(cluster, "node01", f"ls -A {target}") == ""
    assert not private.exists() and mounted_in_node(cluster, "node01", target) == []
    assert cluster.healthy() == []


def test_noisy_shell_prints_before_the_command(cluster):
    path = plain_ssh(cluster, "node01", 'echo "$PATH"')
    assert plain_ssh(cluster, "node02", "echo hi") == "hi\n"
    with cluster.noisy_shell_fault("node02") as home:
        assert plain_ssh(cluster, "node02", "echo hi") == "Welcome to node02\nhi\n"
        assert plain_ssh(cluster, "node02", 'echo "$HOME"; echo "$PATH"') == f"Welcome to node02\n{home}\n{path}"
        assert plain_ssh(cluster, "node01", "echo hi") == "hi\n"
    assert plain_ssh(cluster, "node02", 'echo hi; echo "$HOME"') == f"hi\n{os.path.expanduser('~root')}\n"
    assert not home.exists()

    proc = subprocess.run([sys.executable, str(Path(testcluster.__file__)), "fault", "--dir", str(cluster.dir),
                           "node03", "noisy-shell", "Last", "login:", "never"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert plain_ssh(cluster, "node03", "echo", "hi") == "Last login: never\nhi\n"
    cluster.restore("node03")
    assert plain_ssh(cluster, "node03", "echo", "hi") == "hi\n"
    assert not (cluster.node_dir("node03") / "home").exists() and cluster.healthy() == []


def test_sessions_run_none_of_this_machines_shell_start_up_files(cluster):
    """This machine's ~/.bashrc is its user's, not a node's (here it defines pyenv's functions and rehashes under a
    lock every test host shares): no session reads it, HOME stays the real one; a node's own HOME's .bashrc is read
    (set_home), and quiet_shell takes it away again."""
    shown = 'echo "$HOME"; declare -F; alias'
    assert plain_ssh(cluster, "node02", shown) == os.path.expanduser("~root") + "\n"
    home = cluster.set_home("node02")
    (home / ".bashrc").write_text("alias ll='ls -l'\n")
    assert plain_ssh(cluster, "node02", shown) == f"{home}\nalias ll='ls -l'\n"
    assert plain_ssh(cluster, "node01", shown) == os.path.expanduser("~root") + "\n"
    cluster.quiet_shell("node02")
    assert plain_ssh(cluster, "node02", shown) == os.path.expanduser("~root") + "\n" and not home.exists()


def test_ntp_server_answers(cluster):
    ntplib = pytest.importorskip("ntplib")
    with cluster.ntp_server("node03") as ip:
        assert ip == "10.77.0.13"
        answer = ntplib.NTPClient().request(ip, version=4, timeout=2)
        assert answer.stratum == 8
        assert abs(answer.offset) < 0.5
        assert testcluster.ntp_query(ip)["stratum"] == 8
    with pytest.raises(ntplib.NTPException):
        ntplib.NTPClient().request(ip, version=4, timeout=0.5)


def test_slow_link(cluster):
    def transfer_s():
        t0 = time.monotonic()
        proc = subprocess.run(cluster.ssh_argv("node03", "head -c 200000 /dev/zero"), capture_output=True,
                              timeout=30)
        assert len(proc.stdout) == 200000, proc.stderr
        return time.monotonic() - t0
    fast = transfer_s()
    with cluster.slowed_link("node03", "1mbit"):
        slow = transfer_s()  # 1.6 Mbit through a 1 Mbit/s token bucket
    assert slow > 1.2 and fast < 1.0, (fast, slow)
    assert transfer_s() < 1.0


def node_to_node_s(cluster, src, dst, size=200000):
    """Seconds to send `size` bytes over TCP from node `src` to node `dst` (a receiver in dst's namespace)."""
    port = 47111
    receiver = cluster.netns_popen(dst, [sys.executable, "-c", RECEIVER, str(port)], stdout=subprocess.PIPE)
    try:
        sender = cluster.netns_exec(src, [sys.executable, "-c", SENDER, cluster.ip(dst), str(port), str(size)],
                                    timeout=30, check=True)
        assert receiver.communicate(timeout=30)[0].strip() == str(size).encode()
        return float(sender.stdout)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


RECEIVER = """import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1); s.settimeout(20); c = s.accept()[0]; n = 0
while True:
    d = c.recv(65536)
    if not d: break
    n += len(d)
print(n)"""
SENDER = """import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20); break
    except OSError:
        time.sleep(0.05)
t = time.monotonic(); c.sendall(b"x" * int(sys.argv[3])); c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.monotonic() - t)"""


def test_slow_path_shapes_one_link_between_two_nodes_only(cluster):
    with cluster.slowed_path("node02", "node03", "1mbit"):
        slow = node_to_node_s(cluster, "node02", "node03")  # 1.6 Mbit through a 1 Mbit/s class
        other = node_to_node_s(cluster, "node02", "node01")
        back = node_to_node_s(cluster, "node03", "node02")  # only what node02 sends is shaped (data, not ACKs)
        assert cluster.status()["nodes"][1]["faults"] == {"slow_path": "node03"}
    assert slow > 1.2 and other < 0.5 and back < 0.5, (slow, other, back)
    assert node_to_node_s(cluster, "node02", "node03") < 0.5


def test_restore_removes_a_slow_path(cluster):
    cluster.slow_path("node02", "node03", "1mbit")
    cluster.restore("node02")
    assert node_to_node_s(cluster, "node02", "node03") < 0.5
    assert "htb" not in cluster.netns_exec("node02", ["tc", "qdisc", "show", "dev", "eth0"]).stdout


def test_cli_status_and_module_helpers(cluster):
    proc = subprocess.run([sys.executable, str(Path(testcluster.__file__)), "status", "--dir", str(cluster.dir)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert [n["name"] for n in status["nodes"]] == cluster.nodes
    assert all(n["banner"].startswith("SSH-2.0-") and not n["faults"] for n in status["nodes"])
    testcluster.freeze_sshd(cluster.dir, "node01")  # module helper: Cluster.load(dir).freeze_sshd(node)
    assert cluster.banner("node01", timeout=0.5) is None
    # no restore here: the per-test fixture must thaw it (checked by its baseline assertion)


def test_half_failed_up_and_down_leave_nothing(tmp_path, monkeypatch):
    """A second, small cluster on its own bridge and subnet: a failing up cleans up after itself, and
    a normal up/down leaves no namespace, link, process or folder behind."""
    reason = cluster_unavailable()
    if reason:
        pytest.skip(f"test cluster unavailable: {reason}")
    with testcluster.cluster_lock():  # re-entrant: already held when the module's cluster is up
        _half_failed_up_and_down(tmp_path, monkeypatch)


def _half_failed_up_and_down(tmp_path, monkeypatch):
    kwargs = dict(nodes=2, prefix="tc", bridge="pfbr9", subnet="10.77.9")
    testcluster.clean_stale("tc", bridge="pfbr9")  # a run killed in the middle of this test
    broken = testcluster.Cluster(tmp_path / "broken", **kwargs)
    real_wait = testcluster.Cluster._wait_sshd

    def wait_then_fail(self, node, deadline):
        real_wait(self, node, deadline)
        if node["name"] == "tc02":
            raise testcluster.ClusterError("injected failure")

    monkeypatch.setattr(testcluster.Cluster, "_wait_sshd", wait_then_fail)
    with pytest.raises(testcluster.ClusterError, match="injected"):
        broken.up()
    monkeypatch.undo()
    assert testcluster.leftovers("tc", bridge="pfbr9") == []
    assert (tmp_path / "broken" / "tc01" / "sshd.log").exists()  # the logs stay for a post-mortem
    bridges = {link for link in testcluster._link_names() if link.startswith("pfbr")}
    testcluster.down(tmp_path / "broken")  # reads state.down.json: its own names, not the default bridge
    assert not (tmp_path / "broken").exists()
    assert {link for link in testcluster._link_names() if link.startswith("pfbr")} == bridges

    good = testcluster.Cluster(tmp_path / "good", **kwargs).up()
    assert good.ssh("tc02", "hostname", check=True).stdout.strip() == "tc02"
    pids = testcluster.netns_pids("pf-tc01") + testcluster.netns_pids("pf-tc02")
    assert pids
    good.down()
    good.down()  # idempotent
    assert testcluster.leftovers("tc", bridge="pfbr9", pids=pids) == []
    assert not (tmp_path / "good").exists()
