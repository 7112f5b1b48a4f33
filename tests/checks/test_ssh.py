"""SSH: reaching every node (SSH001), from recorded facts (each way a connection fails, an unreached node's
other checks skipped) and on the real test cluster, side by side with the real OpenSSH `ssh` (preflight's
default client is that ssh; where the fallback's own code decides, --ssh paramiko is run beside it): a stopped and a
frozen sshd, unknown and changed host keys, ProxyJump chains and `user@host:port` hops, IdentitiesOnly and
the order keys are offered in, a server that sends its banner and then nothing, and the modes of a
known_hosts file preflight creates."""
import contextlib
import json
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cluster import cluster, cluster_up, testcluster  # noqa: F401  (fixtures)
from cluster_check import check, not_passing
from conftest import results
from node_facts import by_node, facts, run
from preflight.result import Status


CLIENTS = ("openssh", "paramiko")  # the default, and the fallback where no ssh is installed (--ssh paramiko)


def ssh001(cluster, config, hosts, *extra, env=None, binds=None):
    """preflight's SSH001 for each host: {host: result}, after a real run of `preflight check` (config None:
    no --ssh-config, as ssh without -F; binds: what it sees of the machine's files, see private_mounts)."""
    args = [sys.executable, "-m", "preflight", "check", "--hosts", hosts,
            *(["--ssh-config", str(config)] if config else []),
            "--python", sys.executable, "--json", "--only", "SSH001", *extra]
    proc = subprocess.run(private_mounts(binds, args), capture_output=True, text=True, timeout=120, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return results(json.loads(proc.stdout), "SSH001")


def openssh(config, host, *extra, env=None, timeout=30, binds=None, batch=True):
    """The real OpenSSH client with the same ssh_config (None: no -F): (exit code, stdout, stderr). batch=False:
    `ssh NODE hostname` as a user types it, proven to need no prompt (no terminal, and every prompt answered by
    nothing through SSH_ASKPASS)."""
    argv = ["ssh", *(["-F", str(config)] if config else []), *(["-o", "BatchMode=yes"] if batch else []), *extra,
            host, "hostname"]
    if not batch:
        env = dict(env or os.environ, SSH_ASKPASS="/bin/false", SSH_ASKPASS_REQUIRE="force")
    proc = subprocess.run(private_mounts(binds, argv), capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, start_new_session=True)
    return proc.returncode, proc.stdout.strip(), proc.stderr


@contextlib.contextmanager
def ssh_only_from(cluster, node, source):
    """The node's sshd refuses (TCP reset) every SSH connection but those from the address `source`: the
    only way in is through that host."""
    table = "pfx_ssh_only_from"
    nft = ["ip", "netns", "exec", cluster.netns(node), "nft"]
    subprocess.run(nft + ["-f", "-"], check=True, text=True, timeout=30, input=(
        f"table inet {table} {{\n chain input {{\n  type filter hook input priority -1; policy accept;\n"
        f"  tcp dport 22 ip saddr != {source} reject with tcp reset\n }}\n}}\n"))
    try:
        yield
    finally:
        subprocess.run(nft + ["delete", "table", "inet", table], timeout=30)


def ssh_processes_on(config, settle_s=2.0) -> list:
    """ssh processes of this machine whose command line names `config` (preflight's sessions and a proxy's),
    still there `settle_s` after the run (each was sent SIGTERM as preflight ended; zombies are gone)."""
    deadline = time.monotonic() + settle_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    argv = handle.read().split(b"\0")
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    zombie = handle.read().rsplit(b")", 1)[1].split()[0] == b"Z"
            except (OSError, IndexError):
                continue
            if argv and os.path.basename(argv[0]) == b"ssh" and str(config).encode() in argv and not zombie:
                found.append(int(pid))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def with_host_lines(config_text, host, *lines):
    return config_text.replace(f"Host {host}\n", f"Host {host}\n" + "".join(f"    {line}\n" for line in lines), 1)


# ---------------------------------------------------------------------------------------------- ProxyJump

@pytest.mark.cluster
def test_a_chain_of_two_jump_hosts_goes_through_both_and_a_failure_names_the_hop(cluster, tmp_path):
    """node03 lets in only node02, node02 only node01: `ProxyJump node01,node02` is the only way."""
    config = tmp_path / "ssh_config"
    config.write_text(with_host_lines(cluster.ssh_config.read_text(), "node03", "ProxyJump node01,node02"))
    g = subprocess.run(["ssh", "-G", "-F", str(config), "node03"], capture_output=True, text=True, timeout=30).stdout
    assert "proxyjump node01,node02" in g.splitlines()
    with ssh_only_from(cluster, "node03", cluster.ip("node02")), ssh_only_from(cluster, "node02", cluster.ip("node01")):
        assert openssh(cluster.ssh_config, "node03", "-o", "ConnectTimeout=3")[0] != 0  # no direct way in
        assert openssh(cluster.ssh_config, "node03", "-J", "node01")[0] != 0  # nor through node01 alone
        assert openssh(config, "node03")[:2] == (0, "node03")
        ssh = ssh001(cluster, config, "node03")["node03"]
        assert ssh["status"] == "pass", ssh
    # node02 lets nobody in: the chain breaks at the hop from node01 to node02, and the message says so
    with ssh_only_from(cluster, "node02", "10.255.255.254"):
        assert openssh(config, "node03")[0] != 0
        for client in CLIENTS:
            ssh = ssh001(cluster, config, "node03", "--ssh", client)["node03"]
            assert ssh["status"] == "fail", ssh
            assert "through ProxyJump node01" in ssh["message"], (client, ssh)
            assert f"node01 could not connect to {cluster.ip('node02')}:22" in ssh["message"], (client, ssh)


@pytest.mark.cluster
def test_proxyjump_entries_with_user_and_port_override_the_hops_own(cluster, tmp_path):
    """`user@host:port` and `ssh://user@host:port`: the user and port of the entry win over the hop's own
    User and Port (OpenSSH runs `ssh -l user -p port HOP`); every other setting is the hop's Host entry."""
    base = cluster.ssh_config.read_text()
    jumpbox = base.split("Host node02\n", 1)[1].split("\n\n", 1)[0]
    jumpbox = jumpbox.replace("User root", "User nobody").replace("Port 22", "Port 2200")
    for entry in ("root@jumpbox:22", "ssh://root@jumpbox:22", "ssh://root@jumpbox:22/"):
        config = tmp_path / "ssh_config"
        config.write_text(with_host_lines(base, "node03", f"ProxyJump {entry}") + f"Host jumpbox\n{jumpbox}\n\n")
        with ssh_only_from(cluster, "node03", cluster.ip("node02")):
            assert openssh(config, "node03")[:2] == (0, "node03"), entry
            ssh = ssh001(cluster, config, "node03")["node03"]
        assert ssh["status"] == "pass", (entry, ssh)
    # the hop's own Port, when the entry gives none: refused at 2200, and the message names the hop
    config.write_text(with_host_lines(base, "node03", "ProxyJump root@jumpbox") + f"Host jumpbox\n{jumpbox}\n\n")
    assert openssh(config, "node03")[0] != 0
    ssh = ssh001(cluster, config, "node03")["node03"]
    assert ssh["status"] == "fail" and ssh["evidence"]["reason"] == "refused", ssh
    assert "through ProxyJump" in ssh["message"] and "jumpbox" in ssh["message"], ssh
    assert f"{cluster.ip('node02')} port 2200: Connection refused" in ssh["message"], ssh  # ssh's own words


@pytest.mark.cluster
def test_proxyjump_none_and_a_jump_host_that_would_jump_through_itself(cluster, tmp_path):
    """`Host *` with `ProxyJump node01` also matches node01: OpenSSH then starts ssh after ssh forever.
    preflight names the loop; `ProxyJump none` (first value wins) and `Host * !node01` are the fixes."""
    base = cluster.ssh_config.read_text()
    config = tmp_path / "ssh_config"
    config.write_text(base + "Host *\n    ProxyJump node01\n")
    doc = ssh001(cluster, config, "node01,node02")
    assert doc["node02"]["status"] == "fail" and "loops back to node01" in doc["node02"]["message"], doc
    assert "Host * !node01" in doc["node02"]["remediation"]
    assert not ssh_processes_on(config)  # the chain of ssh started by ssh is ended, all of it
    config.write_text(with_host_lines(base, "node01", "ProxyJump none") + "Host *\n    ProxyJump node01\n")
    with ssh_only_from(cluster, "node02", cluster.ip("node01")):
        assert openssh(config, "node02")[:2] == (0, "node02")
        doc = ssh001(cluster, config, "node01,node02")
    assert {node: r["status"] for node, r in doc.items()} == {"node01": "pass", "node02": "pass"}, doc


# ---------------------------------------------------------------------------------------------- keys

@contextlib.contextmanager
def sshd_with(cluster, node, port, *options, binds=None, env=None):
    """A second sshd on the node (its namespaces, its host key), on `port`, with extra sshd_config lines;
    `binds` ({target: source}) are seen by it alone (private_mounts), `env` added to its environment."""
    conf = cluster.node_dir(node) / "sshd_config"
    extra = cluster.node_dir(node).parent / f"{node}-sshd-{port}"
    # sshd takes the first value of each keyword (ListenAddress adds up: it is replaced)
    extra.write_text(f"PidFile {extra}.pid\n" + "".join(f"{o}\n" for o in options) + conf.read_text()
                     .replace(f"ListenAddress {cluster.ip(node)}\n", f"ListenAddress {cluster.ip(node)}:{port}\n"))
    proc = cluster.node_popen(node, private_mounts(binds or {}, [testcluster.SSHD, "-D", "-e", "-f", str(extra)]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection((cluster.ip(node), port), timeout=1) as sock:
                    if sock.recv(8).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, f"the extra sshd on {node}:{port} did not start"
            time.sleep(0.05)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


class Over:
    """A folder laid over a target folder (overlayfs) rather than in its place: the target's files stay, the
    folder's are added or replace them, and a whiteout in it (hide(): a 0/0 character device) hides one."""

    def __init__(self, upper):
        self.upper = Path(upper)
        self.upper.mkdir(parents=True, exist_ok=True)

    def hide(self, name):
        os.mknod(self.upper / name, stat.S_IFCHR | 0o600, os.makedev(0, 0))
        return self


def private_mounts(binds, argv):
    """argv in a mount namespace of its own where each source (a folder or a file, or an Over) is seen at its
    target: the machine's /etc/ssh, /etc/hosts or home folder as a site's image has them, for that process alone."""
    if not binds:
        return list(argv)
    mounts = []
    for target, source in binds.items():
        if isinstance(source, Over):
            work = source.upper.with_name(source.upper.name + ".work")
            work.mkdir(exist_ok=True)
            mounts.append(f"mount -t overlay overlay -o lowerdir={target},upperdir={source.upper},workdir={work} "
                          f"{shlex.quote(str(target))}")
        else:
            mounts.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}")
    return ["unshare", "--mount", "sh", "-c", " && ".join(mounts) + ' && exec "$@"', "sh", *argv]


@contextlib.contextmanager
def ssh_agent(tmp_path, *keys):
    """A real ssh-agent holding `keys`, in that order; yields the environment that points at it."""
    sock = Path(tempfile.mkdtemp(dir=tmp_path)) / "agent.sock"
    out = subprocess.run(["ssh-agent", "-s", "-a", str(sock)], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    pid = int(out.split("SSH_AGENT_PID=")[1].split(";")[0])
    env = dict(os.environ, SSH_AUTH_SOCK=str(sock))
    try:
        for key in keys:
            subprocess.run(["ssh-add", str(key)], env=env, check=True, capture_output=True, timeout=30)
        yield env
    finally:
        os.kill(pid, signal.SIGTERM)


def new_key(tmp_path, name):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(tmp_path / name)],
                   check=True, timeout=30)
    return tmp_path / name


@pytest.mark.cluster
def test_identities_only_and_the_order_keys_are_offered_in(cluster, tmp_path):
    """sshd with MaxAuthTries 2 (as on clusters where an agent full of keys ends in "Too many authentication
    failures"), an ssh-agent holding two keys the node does not know. preflight offers what OpenSSH offers."""
    known = tmp_path / "known_hosts"
    hostkey = " ".join((cluster.node_dir("node02") / "ssh_host_ed25519_key.pub").read_text().split()[:2])
    known.write_text(f"[{cluster.ip('node02')}]:2202 {hostkey}\n")
    node = cluster.ssh_config.read_text().split("Host node02\n", 1)[1].split("\n\n", 1)[0]
    node = node.replace("Port 22", "Port 2202").replace(str(cluster.known_hosts), str(known))
    only = tmp_path / "only"
    only.write_text(f"Host node02\n{node}\n")  # the cluster's entry says IdentitiesOnly yes
    agent_first = tmp_path / "agent_first"
    agent_first.write_text(f"Host node02\n{node.replace('IdentitiesOnly yes', 'IdentitiesOnly no')}\n")
    strangers = [new_key(tmp_path, "stranger1"), new_key(tmp_path, "stranger2")]
    with sshd_with(cluster, "node02", 2202, "MaxAuthTries 2"):
        # IdentitiesOnly yes: only the IdentityFile is offered, not the agent's keys ahead of it
        with ssh_agent(tmp_path, *strangers) as env:
            assert openssh(only, "node02", env=env)[:2] == (0, "node02")
            for client in CLIENTS:
                assert ssh001(cluster, only, "node02", "--ssh", client, env=env)["node02"]["status"] == "pass", client
            # without it, OpenSSH offers the agent's keys before the file: both fail, the same way
            code, _, err = openssh(agent_first, "node02", env=env)
            assert code != 0 and "Too many authentication failures" in err, err
            for client in CLIENTS:
                ssh = ssh001(cluster, agent_first, "node02", "--ssh", client, env=env)["node02"]
                assert ssh["status"] == "fail" and "IdentitiesOnly yes" in ssh["remediation"], (client, ssh)
        # the agent's copy of the configured identity goes first, ahead of its other keys (added before it)
        with ssh_agent(tmp_path, *strangers, cluster.identity) as env:
            assert openssh(agent_first, "node02", env=env)[:2] == (0, "node02")
            for client in CLIENTS:
                assert ssh001(cluster, agent_first, "node02", "--ssh", client, env=env)["node02"]["status"] == "pass"
        # an IdentityFile preflight cannot read (a passphrase, no .pub beside it) whose key the agent holds:
        # with IdentitiesOnly, its agent copy is offered, as OpenSSH does
        encrypted = tmp_path / "encrypted"
        encrypted.write_bytes(cluster.identity.read_bytes())
        encrypted.chmod(0o600)
        subprocess.run(["ssh-keygen", "-q", "-p", "-P", "", "-N", "secret", "-f", str(encrypted)], check=True,
                       capture_output=True, timeout=30)
        only.write_text(only.read_text().replace(str(cluster.identity), str(encrypted)))
        with ssh_agent(tmp_path, *strangers, cluster.identity) as env:
            assert openssh(only, "node02", env=env)[:2] == (0, "node02")
            for client in CLIENTS:
                assert ssh001(cluster, only, "node02", "--ssh", client, env=env)["node02"]["status"] == "pass", client


@pytest.mark.cluster
def test_nothing_is_ever_asked_on_the_terminal_or_through_the_users_askpass(cluster, tmp_path):
    """preflight run from a terminal, with everything that makes ssh ask: a key with a passphrase and no agent,
    an sshd that takes passwords and keyboard-interactive answers, a host key it has never seen (ssh's default
    StrictHostKeyChecking ask), and the user's own askpass program with DISPLAY set (a GUI prompt under X11
    forwarding). Nothing is shown on the terminal nor asked through that program; the node fails in ssh's words."""
    encrypted = tmp_path / "encrypted"
    encrypted.write_bytes(cluster.identity.read_bytes())
    encrypted.chmod(0o600)
    subprocess.run(["ssh-keygen", "-q", "-p", "-P", "", "-N", "secret", "-f", str(encrypted)], check=True,
                   capture_output=True, timeout=30)
    asked = tmp_path / "asked"
    askpass = tmp_path / "askpass"
    askpass.write_text(f"#!/bin/sh\necho \"$1\" >> {asked}\necho wrong\n")
    askpass.chmod(0o700)
    config = tmp_path / "ssh_config"
    config.write_text(f"Host node02\n    HostName {cluster.ip('node02')}\n    Port 2210\n    User root\n"
                      f"    IdentityFile {encrypted}\n    IdentitiesOnly yes\n"
                      f"    UserKnownHostsFile {tmp_path / 'known_hosts'}\n")
    env = dict(os.environ, DISPLAY=":99", SSH_ASKPASS=str(askpass))
    env.pop("SSH_AUTH_SOCK", None)
    for known in ("", f"[{cluster.ip('node02')}]:2210 {(cluster.node_dir('node02') / 'ssh_host_ed25519_key.pub').read_text()}"):
        (tmp_path / "known_hosts").write_text(known)
        command = shlex.join([sys.executable, "-m", "preflight", "check", "--hosts", "node02", "--ssh-config",
                              str(config), "--python", sys.executable, "--only", "SSH001", "--timeout", "10"])
        with sshd_with(cluster, "node02", 2210, "PasswordAuthentication yes", "KbdInteractiveAuthentication yes"):
            proc = subprocess.run(["script", "-qec", command, "/dev/null"], capture_output=True, text=True, env=env,
                                  timeout=60)
        shown = proc.stdout.lower()
        assert proc.returncode != 0 and "ssh001" in shown, proc.stdout
        assert not any(word in shown for word in ("passphrase", "password:", "continue connecting")), proc.stdout
        assert not asked.exists(), asked.read_text()
        assert ("host key" if not known else "authentication failed") in shown, proc.stdout


# ---------------------------------------------------------------------------------------------- handshake

STUB = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(16)
held = []
while True:
    conn, _ = server.accept()
    held.append(conn)
    conn.sendall(sys.argv[3].encode())
"""


@contextlib.contextmanager
def stub_server(cluster, node, port, greeting):
    """A server on the node's address that accepts, sends `greeting` (maybe nothing) and then nothing more."""
    proc = cluster.node_popen(node, [sys.executable, "-c", STUB, cluster.ip(node), str(port), greeting])
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection((cluster.ip(node), port), timeout=1):
                break
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


@pytest.mark.cluster
def test_a_banner_and_then_silence_is_told_apart_from_no_banner(cluster, tmp_path):
    base = cluster.ssh_config.read_text().split("Host node02\n", 1)[1].split("\n\n", 1)[0]
    config = tmp_path / "ssh_config"
    config.write_text(f"Host banner\n{base.replace('Port 22', 'Port 2203')}\n\n"
                      f"Host silent\n{base.replace('Port 22', 'Port 2204')}\n\n")
    with stub_server(cluster, "node02", 2203, "SSH-2.0-OpenSSH_9.2\r\n"), stub_server(cluster, "node02", 2204, ""):
        code, _, err = openssh(config, "silent", "-o", "ConnectTimeout=2")
        assert code == 255 and "timed out during banner exchange" in err, err
        started = time.monotonic()
        docs = {client: ssh001(cluster, config, "banner,silent", "--timeout", "2", "--ssh", client)
                for client in CLIENTS}
        assert time.monotonic() - started < 60
    ip = cluster.ip("node02")
    for doc in docs.values():
        assert doc["banner"]["status"] == "fail" and doc["silent"]["status"] == "fail", doc
        assert (f"{ip}:2203 sent its SSH banner (SSH-2.0-OpenSSH_9.2) and then nothing for 2 s: the key exchange "
                "never started") in doc["banner"]["message"], doc["banner"]
        assert f"{ip}:2204 accepted the connection but sent no SSH banner within 2 s" in doc["silent"]["message"], doc


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_server_that_closes_at_once_is_told_apart_from_a_hung_one(tmp_path):
    """A server that closes the connection before its banner (sshd past MaxStartups, a TCP wrapper) is said to
    have closed it, after the time it really took; one that accepts and stays silent is still the hung server."""
    closing, silent = free_port(), socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshakes; nothing ever reads or writes: a hung sshd
    lines = "    HostName 127.0.0.1\n    User root\n    IdentityFile {key}\n    UserKnownHostsFile {known}\n"
    lines = lines.format(key=tmp_path / "no-key", known=tmp_path / "known_hosts")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host closer\n    Port {closing}\n{lines}\nHost silent\n    Port {silent.getsockname()[1]}\n{lines}")
    stub = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "stub_sshd.py"), "--port", str(closing),
                             "--close"], stdout=subprocess.PIPE)
    try:
        assert stub.stdout.readline().strip() == b"ready"
        code, _, err = openssh(config, "closer")
        # OpenSSH: "kex_exchange_identification: Connection closed by remote host" (or "read: Connection reset")
        assert code == 255 and "kex_exchange_identification" in err and "Connection " in err, err
        docs = {}
        for client in CLIENTS:
            started = time.monotonic()
            docs[client] = ssh001(None, config, "closer,silent", "--timeout", "2", "--ssh", client)
            assert time.monotonic() - started < 30
    finally:
        stub.kill()
        stub.wait(10)
        silent.close()
    for doc in docs.values():
        closer = doc["closer"]
        assert closer["status"] == "fail" and closer["evidence"]["reason"] == "closed", closer
        assert closer["message"].startswith(f"connection closed before the SSH banner: 127.0.0.1:{closing} closed "
                                            "the connection before its SSH banner, 0."), closer["message"]
        assert "hung" not in closer["message"] + closer["remediation"] and "MaxStartups" in closer["remediation"]
        seconds = float(closer["message"].rsplit(", ", 1)[1].split()[0])
        assert seconds < 1.0  # the time it really took, not the timeout
        hung = doc["silent"]
        assert hung["status"] == "fail" and "accepted the connection but sent no SSH banner within 2 s" in \
            hung["message"]
        assert "hung or stopped" in hung["remediation"]


# ---------------------------------------------------------------------------------------------- known_hosts

@pytest.mark.cluster
def test_a_new_known_hosts_file_and_its_folder_are_private(cluster, tmp_path):
    """paramiko's client trusting a new host key writes ~/.ssh/known_hosts as OpenSSH does (which writes its
    own): the folder 0700, the file 0600, whatever the umask lets through."""
    home = tmp_path / "home"
    home.mkdir()
    node = cluster.ssh_config.read_text().split("Host node02\n", 1)[1].split("\n\n", 1)[0]
    node = "\n".join(line for line in node.splitlines() if "UserKnownHostsFile" not in line)
    config = tmp_path / "ssh_config"
    config.write_text(f"Host node02\n{node.replace('StrictHostKeyChecking yes', 'StrictHostKeyChecking accept-new')}\n")
    env = dict(os.environ, HOME=str(home))
    proc = subprocess.run([sys.executable, "-m", "preflight", "check", "--hosts", "node02", "--ssh-config",
                           str(config), "--python", sys.executable, "--json", "--only", "SSH001", "--ssh", "paramiko"],
                          capture_output=True, text=True, timeout=120, env=env, preexec_fn=lambda: os.umask(0o022))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder, known = home / ".ssh", home / ".ssh" / "known_hosts"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(known.stat().st_mode) == 0o600
    assert known.read_text().split()[0] == cluster.ip("node02")


@pytest.mark.parametrize("kind,phrase", [("refused", "connection refused"), ("timeout", "timed out"),
                                         ("no-banner", "no SSH banner"), ("auth", "authentication failed"),
                                         ("host-key-unknown", "unknown host key"), ("unresolved", "name not resolved")])
# --- SSH001 over recorded facts ------------------------------------------------------------------------------

def test_ssh_failure_names_the_reason(kind, phrase):
    def down(state):
        state.update(facts=None, error={"kind": kind, "message": "m", "remediation": "r"})

    results = by_node(run("SSH001", facts(n02=down)))
    assert results["n02"].status == Status.FAIL and phrase in results["n02"].message
    assert results["n01"].status == Status.PASS and results["n03"].status == Status.PASS


def test_an_unreachable_node_skips_its_node_checks_with_the_reason():
    def down(state):
        state.update(facts=None, error={"kind": "refused", "message": "10.0.0.2:22 refused", "remediation": "r"})

    results = by_node(run("FS001", facts(n02=down)))
    assert results["n02"].status == Status.SKIP and "10.0.0.2:22 refused" in results["n02"].message
    assert results["n01"].status == Status.PASS


# --- preflight check over the real test cluster, one sshd fault at a time ------------------------------------

@pytest.mark.cluster
def test_stopped_sshd_fails_that_node_and_the_others_are_still_checked(cluster):
    with cluster.stopped_sshd("node02"):
        doc, _ = check(cluster)
    ssh = results(doc, "SSH001")
    assert ssh["node02"]["status"] == "fail" and "connection refused" in ssh["node02"]["message"]
    assert ssh["node01"]["status"] == "pass" and ssh["node03"]["status"] == "pass"
    shm = results(doc, "FS001")
    assert shm["node02"]["status"] == "skip" and "refused" in shm["node02"]["message"]
    assert shm["node03"]["status"] == "pass"
    assert doc["verdict"] == "fail"


@pytest.mark.cluster
def test_frozen_sshd_gives_a_verdict_within_the_timeout(cluster):
    with cluster.frozen_sshd("node03"):  # COL selected too: it must not hold the verdict back
        doc, elapsed = check(cluster, "--timeout", "5", skip="deep,CLK002")
    assert elapsed < 7, elapsed
    ssh = results(doc, "SSH001")
    assert ssh["node03"]["status"] == "fail" and "no SSH banner" in ssh["node03"]["message"]
    [allreduce] = [r for r in doc["results"] if r["id"] == "COL001"]
    assert allreduce["status"] == "skip" and "node03 not reached (see SSH001)" in allreduce["message"]
    assert doc["verdict"] == "fail"


@pytest.mark.cluster
def test_unknown_host_key_is_refused_unless_accepted(cluster, tmp_path):
    config = tmp_path / "ssh_config"
    empty = tmp_path / "known_hosts"
    config.write_text(cluster.ssh_config.read_text().replace(str(cluster.known_hosts), str(empty)))
    base = [sys.executable, "-m", "preflight", "check", "--hosts", "node02", "--ssh-config", str(config),
            "--python", sys.executable, "--json", "--only", "SSH001"]
    doc = json.loads(subprocess.run(base, capture_output=True, text=True, timeout=120).stdout)
    assert results(doc, "SSH001")["node02"]["status"] == "fail"
    assert "unknown host key" in results(doc, "SSH001")["node02"]["message"]
    doc = json.loads(subprocess.run(base + ["--ssh-accept-new"], capture_output=True, text=True, timeout=120).stdout)
    assert results(doc, "SSH001")["node02"]["status"] == "pass"
    assert "ssh-ed25519" in empty.read_text()  # remembered
    doc = json.loads(subprocess.run(base, capture_output=True, text=True, timeout=120).stdout)
    assert results(doc, "SSH001")["node02"]["status"] == "pass"


@pytest.mark.cluster
def test_proxy_jump_and_the_ssh_agent(cluster, tmp_path):
    """node02 and node03 through node01 (ProxyJump), authenticated by a real ssh-agent, no IdentityFile."""
    # Without IdentityFile, IdentitiesOnly would leave no key to offer (OpenSSH refuses such a config too).
    lines = [line for line in cluster.ssh_config.read_text().splitlines()
             if "IdentityFile" not in line and "IdentitiesOnly" not in line]
    config = tmp_path / "ssh_config"
    text = "\n".join(lines) + "\n"
    for node in ("node02", "node03"):
        text = text.replace(f"Host {node}\n", f"Host {node}\n  ProxyJump node01\n")
    config.write_text(text)
    agent = subprocess.run(["ssh-agent", "-s", "-a", str(tmp_path / "agent.sock")], capture_output=True, text=True,
                           check=True, timeout=30).stdout
    pid = int(agent.split("SSH_AGENT_PID=")[1].split(";")[0])
    env = dict(os.environ, SSH_AUTH_SOCK=str(tmp_path / "agent.sock"), HOME=str(tmp_path))
    try:
        subprocess.run(["ssh-add", str(cluster.identity)], env=env, check=True, capture_output=True, timeout=30)
        args = [sys.executable, "-m", "preflight", "check", "--hosts", ",".join(cluster.nodes), "--ssh-config",
                str(config), "--python", sys.executable, "--json", "--only", "SSH001,PKG001"]
        doc = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=120, env=env).stdout)
    finally:
        os.kill(pid, 15)
    assert doc["verdict"] == "pass", not_passing(doc)
    assert set(results(doc, "SSH001")) == set(cluster.nodes)


@pytest.mark.cluster
def test_a_changed_host_key_is_refused_even_with_accept_new(cluster, tmp_path):
    config = tmp_path / "ssh_config"
    known = tmp_path / "known_hosts"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "impostor")], check=True,
                   timeout=30)
    impostor = (tmp_path / "impostor.pub").read_text().split()[:2]
    known.write_text(f"{cluster.ip('node02')} {' '.join(impostor)}\nnode02 {' '.join(impostor)}\n")
    config.write_text(cluster.ssh_config.read_text().replace(str(cluster.known_hosts), str(known)))
    for extra in ([], ["--ssh-accept-new"]):
        args = [sys.executable, "-m", "preflight", "check", "--hosts", "node02", "--ssh-config", str(config),
                "--python", sys.executable, "--json", "--only", "SSH001", *extra]
        doc = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=120).stdout)
        ssh = results(doc, "SSH001")["node02"]
        assert ssh["status"] == "fail" and "changed host key" in ssh["message"] and "ssh-keygen -R" in ssh["remediation"]


def test_a_program_that_ends_before_it_has_read_its_input_is_its_own_failure_not_sshds():
    """The exec request was answered, then the program ended (no such interpreter: exit 127) while the head still
    sent it the bundle: paramiko's `Socket is closed` is the program's end, which its exit status explains, not
    sshd refusing to run it."""
    from preflight.remote import ssh

    class Channel:
        def settimeout(self, seconds):
            pass

        def exec_command(self, command):
            self.command = command

        def sendall(self, data):
            raise OSError("Socket is closed")

        def close(self):
            pass

    class Transport:
        def open_session(self, timeout):
            return Channel()

    connection = ssh.SSHConnection(ssh.SSHSettings(alias="n1", hostname="n1"), 5.0)
    connection.transport = Transport()
    channel = connection.open_command("exec /bin/sh -c true", "the bundle\n")
    assert channel.command == "exec /bin/sh -c true"
