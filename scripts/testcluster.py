#!/usr/bin/env python3
"""A real test cluster on one Linux machine, for preflight's cluster tests.

N hosts, each a network namespace with its own OpenSSH server, hostname and /etc/hosts, on a bridge
in the root namespace (the "login node", where `preflight check` runs):

    pfbr0 10.77.0.1/24  <-veth->  pf-node01 (eth0 10.77.0.11, sshd, hostname node01)
                        <-veth->  pf-node02 (eth0 10.77.0.12, ...)

Needs root, iproute2 (`ip netns`), util-linux (unshare, nsenter) and openssh-server; the faults need
nftables (drop_port, block_incoming), iproute2's tc (slow_link, slow_path; jumbo_mtu, capture_route and
wrong_hosts_entry need only iproute2), faketime (fake_time) and chrony (start_ntp_server).
Stdlib only, Python 3.9+. Importable (``Cluster``, and module-level ``up``/``down``/fault helpers that take
the cluster folder first) and runnable::

    python scripts/testcluster.py up --nodes 3 --dir /tmp/pfc
    ssh -F /tmp/pfc/ssh_config node02 hostname
    python scripts/testcluster.py fault --dir /tmp/pfc node02 fake-time +5s
    python scripts/testcluster.py restore --dir /tmp/pfc node02
    python scripts/testcluster.py status --dir /tmp/pfc
    python scripts/testcluster.py down --dir /tmp/pfc

Rules it keeps: traffic only to loopback and to the hosts it creates (no forwarding is enabled, the nodes'
default route ends at the bridge); it signals only processes it started (by PID, checked to still live in
one of its namespaces or to carry the cluster folder on their command line) or the processes
`ip netns pids` lists for its own namespaces; `down` is idempotent and works after a half-failed `up`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

BRIDGE = "pfbr0"
SUBNET = "10.77.0"  # /24; the bridge (login node) is .1, node i is .(10+i)
NETNS_PREFIX = "pf-"
NAME_PREFIX = "node"
SSHD = "/usr/sbin/sshd"
STATE_FILE = "state.json"
DOWN_STATE_FILE = "state.down.json"  # what a failed `up` leaves next to the logs
LOCK_FILE = "/run/lock/preflight-testcluster.lock" if os.path.isdir("/run/lock") else "/tmp/preflight-testcluster.lock"
LOOPBACK_TRAP_IP = "127.0.1.1"
KERBEROS_REALM = "PREFLIGHT.TEST"
# The nodes cannot reach the machine's DNS server (nothing is forwarded): point them at their own loopback,
# where nothing listens, so a name missing from /etc/hosts fails at once instead of after a 5 s timeout per
# try (`getent hosts NAME` asks for AF_INET6 first and falls through to DNS for every name).
RESOLV_CONF = "# preflight test cluster: no DNS in here, names come from /etc/hosts\n" \
              "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
FAKETIME_GLOBS = ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                  "/usr/local/lib/faketime/libfaketime.so.1", "/usr/lib64/faketime/libfaketime.so.1")
CORE_TOOLS = ("ip", "ssh", "ssh-keygen", "unshare", "nsenter", "mount", "hostname")

__all__ = ["Cluster", "ClusterError", "requirements", "up", "down", "status", "clean_stale", "leftovers",
           "cluster_lock", "ntp_query", "faketime_library", "BRIDGE", "SUBNET", "NETNS_PREFIX", "NAME_PREFIX"]


class ClusterError(RuntimeError):
    """Something about the test cluster failed; the message says what and how to clean up."""


# ---------------------------------------------------------------------------------------------- helpers

def _run(argv: Sequence[str], check: bool = True, input: Optional[str] = None,
         timeout: float = 30, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout, env=env,
                              **({"stdin": subprocess.DEVNULL} if input is None else {}))
    except FileNotFoundError as exc:
        raise ClusterError(f"{argv[0]}: not installed ({exc})") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"timed out after {timeout:g} s: {shlex.join(argv)}") from None
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed (rc {proc.returncode}): {shlex.join(argv)}: "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _write_inplace(path: Path, text: str) -> None:
    """Rewrite a file's content keeping its inode (a bind mount of it sees the change)."""
    with open(path, "r+" if path.exists() else "w") as fh:
        fh.seek(0)
        fh.write(text)
        fh.truncate()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:]) or "(empty log)"


def _netns_inode(netns: str) -> Optional[int]:
    try:
        return os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return None


def _proc_state(pid: int) -> Optional[str]:
    """The one-letter state of a process, None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]


def _alive(pid: int) -> bool:
    return _proc_state(pid) not in (None, "Z", "X")


def _reap(pid: int) -> None:
    """Collect our own exited child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _in_netns(pid: int, netns_ino: Optional[int]) -> bool:
    if netns_ino is None:
        return False
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == netns_ino
    except OSError:
        return False


def _cmdline_has(pid: int, marker: str) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def netns_list() -> List[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def netns_pids(netns: str) -> List[int]:
    proc = _run(["ip", "netns", "pids", netns], check=False)
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def _link_names() -> List[str]:
    proc = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def faketime_library() -> Optional[str]:
    """The path of libfaketime.so.1 (Debian package `faketime`), or None."""
    for pattern in FAKETIME_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def requirements(probe: bool = True) -> List[str]:
    """Why a test cluster cannot be built here; empty when it can. With probe, tries `ip netns add`."""
    missing: List[str] = []
    if not sys.platform.startswith("linux"):
        return ["needs Linux network namespaces"]
    if os.geteuid() != 0:
        missing.append("needs root (ip netns, unshare, mount)")
    for tool in CORE_TOOLS:
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` not found")
    if not os.access(SSHD, os.X_OK):
        missing.append(f"{SSHD} not found (apt-get install openssh-server)")
    if missing or not probe:
        return missing
    name = f"{NETNS_PREFIX}probe{os.getpid()}"
    proc = _run(["ip", "netns", "add", name], check=False)
    if proc.returncode != 0:
        missing.append(f"`ip netns add` failed: {proc.stderr.strip()}")
    else:
        _run(["ip", "netns", "del", name], check=False)
    return missing


def ntp_query(host: str, port: int = 123, timeout: float = 1.0) -> Dict[str, Any]:
    """One SNTP client query (stdlib); returns stratum, leap, offset_s (server minus us), delay_s."""
    packet = b"\x23" + 47 * b"\0"  # LI 0, version 4, mode 3 (client)
    ntp_epoch = 2208988800
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        t0 = time.time()
        sock.sendto(packet, (host, port))
        data, _ = sock.recvfrom(512)
        t3 = time.time()
    if len(data) < 48:
        raise ClusterError(f"short NTP answer from {host}")

    def ts(offset: int) -> float:
        sec, frac = struct.unpack("!II", data[offset:offset + 8])
        return sec - ntp_epoch + frac / 2 ** 32

    t1, t2 = ts(32), ts(40)
    return {"leap": data[0] >> 6, "stratum": data[1], "offset_s": ((t1 - t0) + (t2 - t3)) / 2,
            "delay_s": (t3 - t0) - (t2 - t1)}


_LOCK_HELD: Dict[str, int] = {}


@contextlib.contextmanager
def cluster_lock(timeout: float = 600, path: str = LOCK_FILE) -> Iterator[None]:
    """Serialize test clusters on this machine (one bridge, one subnet, and `clean_stale` by name): an
    flock, released when the holder exits. The pytest fixture holds it for the cluster's life; the CLI
    takes it around up/down/clean. The file names the holder, for the timeout message. Re-entrant within
    a process (a test may build a second, small cluster while the module's cluster holds the lock)."""
    if _LOCK_HELD.get(path):
        _LOCK_HELD[path] += 1
        try:
            yield
        finally:
            _LOCK_HELD[path] -= 1
        return
    fh = open(path, "a+")
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    fh.seek(0)
                    holder = fh.read().strip() or "another process"
                    raise ClusterError(f"a test cluster is in use ({holder}; lock {path}); waited {timeout:g} s") from None
                time.sleep(0.2)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}: {' '.join(sys.argv)[:200]}\n")
        fh.flush()
        _LOCK_HELD[path] = 1
        try:
            yield
        finally:
            _LOCK_HELD.pop(path, None)
    finally:
        fh.close()


# ---------------------------------------------------------------------------------------------- cluster

# Every session's environment unless a fault says otherwise. Debian's bash, started by sshd, reads ~/.bashrc only
# as a top-level shell (SHLVL below 1): this machine's .bashrc is its user's, not a node's, and may run `pyenv init`,
# whose rehash takes one lock that every test host shares (one filesystem): 80 ms a session here, and sessions
# started at once queue for it (tens of seconds at 96). A node's own start-up file is set_home's.
NO_SHELL_START_UP = {"SHLVL": "1"}


class Cluster:
    """A test cluster described by DIR/state.json. Every public method re-reads the state from disk, so
    a `Cluster.load(dir)` in another process (the CLI) and the fixture's object stay consistent."""

    def __init__(self, dir: "os.PathLike[str] | str", nodes: int = 3, prefix: str = NAME_PREFIX,
                 bridge: str = BRIDGE, subnet: str = SUBNET, netns_prefix: str = NETNS_PREFIX):
        self.dir = Path(dir).resolve()
        self._procs: Dict[int, subprocess.Popen] = {}
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,8}", prefix):
            raise ClusterError(f"node name prefix {prefix!r}: use 1-9 of [a-z0-9-], starting with a letter")
        if not 1 <= nodes <= 99:
            raise ClusterError(f"--nodes {nodes}: between 1 and 99")
        ipaddress.IPv4Network(f"{subnet}.0/24")  # validates
        self._config = {"prefix": prefix, "bridge": bridge, "subnet": subnet, "netns_prefix": netns_prefix,
                        "count": nodes}

    # ---- state
    @classmethod
    def load(cls, dir: "os.PathLike[str] | str") -> "Cluster":
        path = Path(dir).resolve() / STATE_FILE
        if not path.exists() and path.with_name(DOWN_STATE_FILE).exists():
            path = path.with_name(DOWN_STATE_FILE)  # after a failed up: the names to clean are still there
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            raise ClusterError(f"{path}: no test cluster state (not up, or already down)") from None
        except (OSError, ValueError) as exc:
            raise ClusterError(f"{path}: unreadable state: {exc}") from None
        return cls(dir, nodes=len(state.get("nodes") or []) or state.get("count", 1),
                   prefix=state.get("prefix", NAME_PREFIX), bridge=state.get("bridge", BRIDGE),
                   subnet=state.get("subnet", SUBNET), netns_prefix=state.get("netns_prefix", NETNS_PREFIX))

    @property
    def state_path(self) -> Path:
        return self.dir / STATE_FILE

    def state(self) -> Dict[str, Any]:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            raise ClusterError(f"{self.state_path}: no test cluster state (not up, or already down)") from None

    def _save(self, state: Dict[str, Any]) -> None:
        _write_atomic(self.state_path, json.dumps(state, indent=2) + "\n")

    @contextlib.contextmanager
    def _mutate(self) -> Iterator[Dict[str, Any]]:
        state = self.state()
        try:
            yield state
        finally:
            self._save(state)

    def _node(self, state: Dict[str, Any], node: str) -> Dict[str, Any]:
        for entry in state["nodes"]:
            if entry["name"] == node or entry["ip"] == node:
                return entry
        raise ClusterError(f"unknown node {node!r}; nodes: {', '.join(n['name'] for n in state['nodes'])}")

    # ---- facts
    @property
    def prefix(self) -> str:
        return self._config["prefix"]

    @property
    def bridge(self) -> str:
        return self._config["bridge"]

    @property
    def login_ip(self) -> str:
        return f"{self._config['subnet']}.1"

    @property
    def nodes(self) -> List[str]:
        return [n["name"] for n in self.state()["nodes"]]

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def identity(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    def ip(self, node: str) -> str:
        return self._node(self.state(), node)["ip"]

    def netns(self, node: str) -> str:
        return self._node(self.state(), node)["netns"]

    def node_dir(self, node: str) -> Path:
        return Path(self._node(self.state(), node)["dir"])

    def sshd_pid(self, node: str) -> Optional[int]:
        return self._node(self.state(), node).get("pid")

    def hostfile(self, slots: int = 1) -> str:
        """A DeepSpeed hostfile for the cluster."""
        return "".join(f"{n} slots={slots}\n" for n in self.nodes)

    def _plan_nodes(self) -> List[Dict[str, Any]]:
        c = self._config
        out = []
        for i in range(1, c["count"] + 1):
            name = f"{c['prefix']}{i:02d}"
            netns = f"{c['netns_prefix']}{name}"
            veth = f"v{netns}"
            if len(veth) > 15:
                raise ClusterError(f"interface name {veth!r} is over 15 characters: shorten the prefixes")
            out.append({"name": name, "index": i, "ip": f"{c['subnet']}.{10 + i}", "netns": netns, "veth": veth,
                        "dir": str(self.dir / name), "pid": None, "env": {}, "loopback_hostname": False,
                        "shm": None, "drop_ports": [], "allowed_ports": None, "ntp_pid": None, "slow_link": None,
                        "slow_path": None, "frozen": False, "stopped": False, "binds": {}, "mtu": None,
                        "captured": None, "interfaces": [], "hosts_override": {}})
        return out

    # ---- ssh and exec helpers
    def ssh_argv(self, node: str, *command: str, batch: bool = True, connect_timeout: Optional[int] = None) -> List[str]:
        argv = ["ssh", "-F", str(self.ssh_config)]
        if batch:
            argv += ["-o", "BatchMode=yes"]
        if connect_timeout is not None:
            argv += ["-o", f"ConnectTimeout={connect_timeout}"]
        return argv + [node, *command]

    def ssh(self, node: str, command: str, timeout: float = 30, check: bool = False,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a shell command on a node with the system OpenSSH client; returns the CompletedProcess."""
        proc = subprocess.run(self.ssh_argv(node, command, **kwargs), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise ClusterError(f"ssh {node} {command!r}: rc {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def netns_exec(self, node: str, argv: Sequence[str], timeout: float = 30,
                   check: bool = False) -> subprocess.CompletedProcess:
        """Run argv in the node's network namespace only (not its hostname or /etc/hosts: use ssh for that)."""
        return _run(["ip", "netns", "exec", self.netns(node), *argv], check=check, timeout=timeout)

    def netns_popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start a process in the node's network namespace; `down` ends it with the namespace's other PIDs."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(["ip", "netns", "exec", self.netns(node), *argv], **kwargs)

    def node_popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start a process as a session on the node runs: in its network, mount (its /etc/hosts, its bound
        folders) and UTS (its hostname) namespaces, those of its sshd. Its own session (kill it by its group)."""
        pid = self.sshd_pid(node)
        if not pid:
            raise ClusterError(f"{node}: sshd is not running (its namespaces are the node's)")
        return self.netns_popen(node, ["nsenter", "--target", str(pid), "--mount", "--uts", "--", *argv], **kwargs)

    def banner(self, node: str, timeout: float = 2.0) -> Optional[bytes]:
        """The SSH banner of a node's sshd, None when nothing answers within the timeout."""
        try:
            with socket.create_connection((self.ip(node), 22), timeout=timeout) as sock:
                sock.settimeout(timeout)
                return sock.recv(256) or None
        except OSError:
            return None

    # ---- up
    def up(self, timeout: float = 15) -> "Cluster":
        """Create bridge, namespaces, keys and configs, start every sshd and wait until each answers."""
        missing = requirements(probe=False)
        if missing:
            raise ClusterError("cannot build a test cluster here: " + "; ".join(missing))
        if self.state_path.exists():
            raise ClusterError(f"{self.state_path} exists: a cluster is up there "
                               f"(run `testcluster.py down --dir {self.dir}` first)")
        plan = self._plan_nodes()
        existing_ns = set(netns_list())
        clash = [n["netns"] for n in plan if n["netns"] in existing_ns]
        if clash or self.bridge in _link_names():
            raise ClusterError(f"left over from another test cluster: {', '.join(clash + [self.bridge])} "
                               f"(run `testcluster.py down --dir DIR` or `clean --prefix {self.prefix}`)")
        if (self.dir / DOWN_STATE_FILE).exists():  # a failed up's leftovers (already torn down)
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if any(self.dir.iterdir()):
            raise ClusterError(f"{self.dir} is not empty: give `up` a new or empty folder")
        state = dict(self._config, dir=str(self.dir), login_ip=self.login_ip, nodes=plan, status="creating",
                     created=time.time())
        self._save(state)
        try:
            self._build(state, timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.down(remove_dir=False)
            raise
        return self

    def _build(self, state: Dict[str, Any], timeout: float) -> None:
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        _run(keygen + ["-C", "preflight-testcluster", "-f", str(self.identity)])
        (self.dir / "authorized_keys").write_text(Path(f"{self.identity}.pub").read_text())
        # network: the bridge is the login node; nothing is forwarded anywhere
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.login_ip}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for node in state["nodes"]:
            ns, veth, peer = node["netns"], node["veth"], "p" + node["veth"][1:]
            _run(["ip", "netns", "add", ns])
            self._save(state)
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
            _run(["ip", "link", "set", peer, "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "link", "set", peer, "name", "eth0"])
            _run(["ip", "-n", ns, "addr", "add", f"{node['ip']}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "route", "add", "default", "via", self.login_ip])
            ndir = Path(node["dir"])
            ndir.mkdir(exist_ok=True)
            _run(keygen + ["-C", node["name"], "-f", str(ndir / "ssh_host_ed25519_key")])
            (ndir / "hosts").write_text(self._hosts_text(state, node))
            (ndir / "resolv.conf").write_text(RESOLV_CONF)
            self._write_sshd_config(node)
        self._pin_neighbours(state)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        for node in state["nodes"]:
            node["pid"] = self._spawn_sshd(node)
            self._save(state)
        deadline = time.monotonic() + timeout
        for node in state["nodes"]:
            self._wait_sshd(node, deadline)
        lines = []
        for node in state["nodes"]:
            key = " ".join(Path(node["dir"], "ssh_host_ed25519_key.pub").read_text().split()[:2])
            lines += [f"{node['name']} {key}\n", f"{node['ip']} {key}\n"]
        self.known_hosts.write_text("".join(lines))
        self.ssh_config.write_text("".join(
            f"Host {n['name']}\n    HostName {n['ip']}\n    User root\n    Port 22\n"
            f"    IdentityFile {self.identity}\n    UserKnownHostsFile {self.known_hosts}\n"
            f"    StrictHostKeyChecking yes\n    IdentitiesOnly yes\n    ConnectTimeout 5\n"
            f"    LogLevel ERROR\n\n" for n in state["nodes"]))
        state["status"] = "up"
        self._save(state)

    def _pin_neighbours(self, state: Dict[str, Any]) -> None:
        """Each node's neighbour entries for the other nodes, permanent. The kernel has one ARP table for the whole
        machine (net/core/neighbour.c): its gc_thresh3 (1024) counts the entries of every namespace, and only the
        initial namespace has the sysctl, so 32 nodes that each reach every other would overflow it ("neighbor table
        overflow") and lose pairs; permanent entries are exempt from that limit (neigh_alloc's exempt_from_gc).
        The login node's (the bridge's MAC follows its ports) stays learned."""
        macs = {n["netns"]: json.loads(_run(["ip", "-j", "-n", n["netns"], "link", "show", "eth0"]).stdout)[0]["address"]
                for n in state["nodes"]}
        for node in state["nodes"]:
            _run(["ip", "-n", node["netns"], "-batch", "-"], input="".join(
                f"neigh replace {peer['ip']} lladdr {macs[peer['netns']]} dev eth0 nud permanent\n"
                for peer in state["nodes"] if peer is not node))

    # ---- per-node files
    def _hosts_text(self, state: Dict[str, Any], node: Dict[str, Any]) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if node.get("loopback_hostname"):
            lines.append(f"{LOOPBACK_TRAP_IP}\t{node['name']}")
        lines.append(f"{state['login_ip']}\tlogin")
        wrong = node.get("hosts_override") or {}
        for other in state["nodes"]:
            if other["name"] == node["name"] and node.get("loopback_hostname"):
                continue
            lines.append(f"{wrong.get(other['name'], other['ip'])}\t{other['name']}")
        return "\n".join(lines) + "\n"

    def _write_sshd_config(self, node: Dict[str, Any]) -> None:
        ndir = Path(node["dir"])
        text = (f"# preflight test cluster: {node['name']}\n"
                f"ListenAddress {node['ip']}\nPort 22\n"
                f"HostKey {ndir / 'ssh_host_ed25519_key'}\nPidFile {ndir / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "UsePAM no\nStrictModes no\nPrintMotd no\nPrintLastLog no\nUseDNS no\nX11Forwarding no\n"
                "MaxStartups 200:30:400\nMaxSessions 64\nLoginGraceTime 20\nLogLevel INFO\n"
                "Subsystem sftp /usr/lib/openssh/sftp-server\n")
        env = {**NO_SHELL_START_UP, **(node.get("env") or {})}
        for key, value in env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or '"' in str(value) or "\n" in str(value):
                raise ClusterError(f"SetEnv {key}={value!r}: unsupported name or value")
        text += "SetEnv " + " ".join(f'"{k}={v}"' for k, v in env.items()) + "\n"
        _write_atomic(ndir / "sshd_config", text)

    # ---- processes
    def _spawn_sshd(self, node: Dict[str, Any]) -> int:
        ndir = Path(node["dir"])
        script = (f"hostname {shlex.quote(node['name'])} && "
                  f"mount --bind {shlex.quote(str(ndir / 'hosts'))} /etc/hosts && "
                  f"mount --bind {shlex.quote(str(ndir / 'resolv.conf'))} /etc/resolv.conf && "
                  + "".join(f"mount --bind {shlex.quote(private)} {shlex.quote(target)} && "
                            for target, private in (node.get("binds") or {}).items()) +
                  f"exec {SSHD} -D -e -f {shlex.quote(str(ndir / 'sshd_config'))}")
        with open(ndir / "sshd.log", "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", node["netns"], "unshare", "--uts", "--mount",
                                     "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        self._procs[proc.pid] = proc
        return proc.pid

    def _wait_sshd(self, node: Dict[str, Any], deadline: float) -> None:
        pid = node["pid"]
        while True:
            proc = self._procs.get(pid)
            exited = proc.poll() is not None if proc else not _alive(pid)
            if exited:
                raise ClusterError(f"sshd on {node['name']} exited; {Path(node['dir'], 'sshd.log')}:\n"
                                   + _tail(Path(node["dir"], "sshd.log")))
            try:
                with socket.create_connection((node["ip"], 22), timeout=0.5) as sock:
                    sock.settimeout(1.0)
                    if sock.recv(64).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"sshd on {node['name']} ({node['ip']}:22) did not answer in time; log:\n"
                                   + _tail(Path(node["dir"], "sshd.log")))
            time.sleep(0.05)
        if node.get("shm"):
            self._mount_shm(node, node["shm"])

    def _kill(self, pid: Optional[int], netns: Optional[str], marker: str, timeout: float = 3) -> None:
        """End one process we started: only if it still lives in our namespace or names our folder."""
        if not pid:
            return
        ino = _netns_inode(netns) if netns else None
        if not (_in_netns(pid, ino) or _cmdline_has(pid, marker)):
            self._collect(pid)
            return
        for sig in (signal.SIGTERM, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if not self._wait_gone([pid], timeout):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_gone([pid], 2)

    def _collect(self, pid: int) -> None:
        proc = self._procs.pop(pid, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.01)
        _reap(pid)

    def _wait_gone(self, pids: Sequence[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            for pid in pids:
                self._collect(pid)
            if not any(_alive(pid) for pid in pids):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    # ---- down
    def down(self, remove_dir: bool = True) -> None:
        """End everything this cluster started and delete it. Idempotent; needs no (or a partial) state."""
        try:
            state: Optional[Dict[str, Any]] = self.state()
        except (ClusterError, ValueError, OSError):
            state = None
        nodes = (state or {}).get("nodes") or self._plan_nodes()
        c = self._config
        namespaces = {n["netns"] for n in nodes}
        pattern = re.compile(re.escape(c["netns_prefix"] + c["prefix"]) + r"\d+")
        namespaces |= {ns for ns in netns_list() if pattern.fullmatch(ns)}
        _teardown(sorted(namespaces), [n["veth"] for n in nodes], c["bridge"],
                  recorded=[(n.get(key), n["netns"]) for n in nodes for key in ("pid", "ntp_pid", "kdc_pid")],
                  marker=str(self.dir), collect=self._collect)
        if remove_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        elif state is not None:
            for n in state["nodes"]:
                n["pid"] = n["ntp_pid"] = n["kdc_pid"] = None
            state["status"] = "down"
            with contextlib.suppress(OSError):
                self._save(state)
                os.replace(self.state_path, self.dir / DOWN_STATE_FILE)

    # ---- status
    def status(self) -> Dict[str, Any]:
        state = self.state()
        existing = set(netns_list())
        out = {"dir": str(self.dir), "status": state.get("status"), "bridge": self.bridge,
               "login_ip": state.get("login_ip"), "ssh_config": str(self.ssh_config), "nodes": []}
        for n in state["nodes"]:
            banner = self.banner(n["name"], timeout=0.5) if n["netns"] in existing else None
            faults = {k: n[k] for k in ("env", "loopback_hostname", "shm", "binds", "drop_ports", "allowed_ports",
                                        "ntp_pid", "slow_link", "slow_path",
                                        "frozen", "stopped", "mtu", "captured", "interfaces", "hosts_override")
                      if n.get(k)}
            out["nodes"].append({"name": n["name"], "ip": n["ip"], "netns": n["netns"], "netns_exists":
                                 n["netns"] in existing, "sshd_pid": n.get("pid"), "sshd_alive":
                                 bool(n.get("pid")) and _alive(n["pid"]), "banner": banner.decode(errors="replace")
                                 .strip() if banner else None, "faults": faults})
        return out

    def healthy(self) -> List[str]:
        """Problems with the cluster's baseline (every sshd answering, no fault left); empty when healthy."""
        problems = []
        for n in self.status()["nodes"]:
            if not n["banner"]:
                problems.append(f"{n['name']}: sshd does not answer")
            if n["faults"]:
                problems.append(f"{n['name']}: faults left: {n['faults']}")
        return problems

    # ---- faults: sshd process
    def stop_sshd(self, node: str) -> None:
        """Kill the node's sshd (connections are refused until start_sshd)."""
        with self._mutate() as state:
            n = self._node(state, node)
            self._kill(n.get("pid"), n["netns"], str(Path(n["dir"]) / "sshd_config"))
            n["pid"], n["stopped"], n["frozen"] = None, True, False

    def start_sshd(self, node: str, timeout: float = 10) -> int:
        """(Re)start the node's sshd with the same command; returns its PID."""
        with self._mutate() as state:
            n = self._node(state, node)
            if n.get("pid") and _alive(n["pid"]):
                return n["pid"]
            n["pid"] = self._spawn_sshd(n)
            n["stopped"] = n["frozen"] = False
            self._wait_sshd(n, time.monotonic() + timeout)
            return n["pid"]

    def restart_sshd(self, node: str) -> int:
        self.stop_sshd(node)
        return self.start_sshd(node)

    def freeze_sshd(self, node: str) -> None:
        """SIGSTOP the sshd listener: TCP connects still complete (kernel backlog), no banner is sent."""
        with self._mutate() as state:
            n = self._node(state, node)
            self._signal_sshd(n, signal.SIGSTOP)
            n["frozen"] = True

    def thaw_sshd(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            self._signal_sshd(n, signal.SIGCONT)
            n["frozen"] = False

    def _signal_sshd(self, n: Dict[str, Any], sig: int) -> None:
        pid = n.get("pid")
        if not pid or not _in_netns(pid, _netns_inode(n["netns"])):
            raise ClusterError(f"{n['name']}: sshd is not running")
        os.kill(pid, sig)

    # ---- faults: environment of ssh sessions
    def set_env(self, node: str, **variables: Optional[str]) -> Dict[str, str]:
        """Set (value None: remove) variables in the node's sshd_config SetEnv line; restarts its sshd.
        sshd itself never runs with them (LD_PRELOAD=libfaketime in sshd would break its sandbox): only
        the sessions it starts get them. Returns the previous environment."""
        with self._mutate() as state:
            n = self._node(state, node)
            previous = dict(n.get("env") or {})
            env = dict(previous)
            for key, value in variables.items():
                if value is None:
                    env.pop(key, None)
                else:
                    env[key] = str(value)
            n["env"] = env
            self._write_sshd_config(n)
        if env != previous:
            self.restart_sshd(node)
        return previous

    def replace_env(self, node: str, env: Dict[str, str]) -> None:
        """Make the node's SetEnv exactly `env` (restores what set_env returned)."""
        current = self._node(self.state(), node).get("env") or {}
        self.set_env(node, **{**{k: None for k in current}, **env})

    def clear_env(self, node: str) -> None:
        self.replace_env(node, {})

    def fake_time(self, node: str, offset: str = "+5s") -> None:
        """Sessions on the node see the clock shifted by `offset` (libfaketime's FAKETIME syntax)."""
        lib = faketime_library()
        if lib is None:
            raise ClusterError("libfaketime.so.1 not found (apt-get install faketime)")
        self.set_env(node, LD_PRELOAD=lib, FAKETIME=offset)

    def real_time(self, node: str) -> None:
        self.set_env(node, LD_PRELOAD=None, FAKETIME=None)

    def shadow_package(self, node: str, dist: str, version: str) -> Path:
        """Make importlib.metadata.version(dist) report `version` in the node's ssh sessions: a fake
        dist-info in DIR/nodeXX/overlay, which goes first on PYTHONPATH."""
        with self._mutate() as state:
            n = self._node(state, node)
            overlay = Path(n["dir"]) / "overlay"
            norm = re.sub(r"[-_.]+", "_", dist).lower()
            for old in overlay.glob(f"{norm}-*.dist-info"):
                shutil.rmtree(old)
            info = overlay / f"{norm}-{version}.dist-info"
            info.mkdir(parents=True)
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
            (info / "INSTALLER").write_text("preflight-testcluster\n")
        self.set_env(node, PYTHONPATH=str(overlay))
        return overlay

    def unshadow_package(self, node: str, dist: Optional[str] = None) -> None:
        """Remove one shadowed distribution (all when dist is None); drop PYTHONPATH when none is left."""
        overlay = self.node_dir(node) / "overlay"
        norm = re.sub(r"[-_.]+", "_", dist).lower() if dist else "*"
        for old in overlay.glob(f"{norm}-*.dist-info"):
            shutil.rmtree(old)
        if not any(overlay.glob("*.dist-info")):
            shutil.rmtree(overlay, ignore_errors=True)
            self.set_env(node, PYTHONPATH=None)

    # ---- faults: names, /dev/shm
    def loopback_hostname(self, node: str) -> None:
        """The Debian trap: the node's own name resolves to 127.0.1.1 (its hosts file, rewritten in place)."""
        self._set_hosts(node, True)

    def real_hostname(self, node: str) -> None:
        self._set_hosts(node, False)

    def _set_hosts(self, node: str, loopback: bool) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            n["loopback_hostname"] = loopback
            _write_inplace(Path(n["dir"]) / "hosts", self._hosts_text(state, n))

    def wrong_hosts_entry(self, node: str, peer: str, address: str) -> None:
        """The node's hosts file maps another node's name to a wrong address (a stale entry on one node)."""
        with self._mutate() as state:
            n = self._node(state, node)
            n["hosts_override"] = dict(n.get("hosts_override") or {}, **{self._node(state, peer)["name"]: address})
            _write_inplace(Path(n["dir"]) / "hosts", self._hosts_text(state, n))

    def right_hosts_entries(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            n["hosts_override"] = {}
            _write_inplace(Path(n["dir"]) / "hosts", self._hosts_text(state, n))

    def small_shm(self, node: str, size: str = "64m") -> None:
        """Mount a tmpfs of `size` on /dev/shm in the node's mount namespace (kept across sshd restarts)."""
        with self._mutate() as state:
            n = self._node(state, node)
            if n.get("shm"):
                self._umount_shm(n)
                n["shm"] = None
            self._mount_shm(n, size)
            n["shm"] = size

    def restore_shm(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            if n.get("shm"):
                self._umount_shm(n)
            n["shm"] = None

    def _mount_shm(self, n: Dict[str, Any], size: str) -> None:
        if not re.fullmatch(r"\d+[kmgKMG]?", size):
            raise ClusterError(f"shm size {size!r}: use e.g. 64m")
        self._in_mounts(n, ["mount", "-t", "tmpfs", "-o", f"size={size}", "pf-shm", "/dev/shm"])

    def _umount_shm(self, n: Dict[str, Any]) -> None:
        self._in_mounts(n, ["umount", "/dev/shm"], check=False)

    def _in_mounts(self, n: Dict[str, Any], argv: Sequence[str], check: bool = True) -> None:
        """Run argv in the node's mount namespace (its sshd's, which every session inherits); without a
        running sshd there is none: an error, or (check False) nothing to do."""
        pid = n.get("pid")
        if not pid or not _in_netns(pid, _netns_inode(n["netns"])):
            if check:
                raise ClusterError(f"{n['name']}: sshd is not running (its mount namespace is the node's)")
            return
        _run(["nsenter", "--target", str(pid), "--mount", *argv], check=check)

    # ---- faults: per-node folders, HOME and shell start-up file
    def bind_dir(self, node: str, target: "os.PathLike[str] | str") -> Path:
        """Show a folder private to the node at the absolute path `target`, in the node's mount namespace
        only (every ssh session there; kept across sshd restarts): the same path holds different files on
        each node, as without a shared filesystem. `target` is created in the root namespace if missing and
        stays as it is there. Returns the private folder (DIR/nodeXX/binds/<n>), to write the node's files into."""
        target = Path(os.path.normpath(target))
        if not target.is_absolute() or target == self.dir or target in self.dir.parents:
            raise ClusterError(f"bind_dir {target}: give an absolute path that does not hide {self.dir}")
        with self._mutate() as state:
            n = self._node(state, node)
            binds = n.setdefault("binds", {})
            if str(target) in binds:
                return Path(binds[str(target)])
            i = 0
            while (Path(n["dir"]) / "binds" / str(i)).exists():
                i += 1
            private = Path(n["dir"]) / "binds" / str(i)
            target.mkdir(parents=True, exist_ok=True)
            private.mkdir(parents=True)
            try:
                self._in_mounts(n, ["mount", "--bind", str(private), str(target)])
            except ClusterError:
                shutil.rmtree(private)
                raise
            binds[str(target)] = str(private)
            return private

    def unbind_dir(self, node: str, target: "os.PathLike[str] | str | None" = None) -> None:
        """Undo bind_dir for `target` (all when None) and remove the private folder."""
        with self._mutate() as state:
            n = self._node(state, node)
            binds = n.get("binds") or {}
            for t in reversed(list(binds) if target is None else [os.path.normpath(target)]):
                if t in binds:
                    self._in_mounts(n, ["umount", "--lazy", t], check=False)
                    shutil.rmtree(binds.pop(t), ignore_errors=True)
            n["binds"] = binds
            with contextlib.suppress(OSError):
                (Path(n["dir"]) / "binds").rmdir()

    def set_home(self, node: str) -> Path:
        """Give the node's ssh sessions a HOME of their own, DIR/nodeXX/home (SetEnv HOME; restarts sshd),
        whose .bashrc bash reads (SHLVL 0: Debian's bash sources ~/.bashrc in sessions started by sshd) and
        that sets nothing: PATH and the rest stay as on the other nodes. Returns the folder."""
        home = self.node_dir(node) / "home"
        if not (home / ".bashrc").exists():
            home.mkdir(exist_ok=True)
            self._write_bashrc(home, None)
        self.set_env(node, HOME=str(home), SHLVL="0")
        return home

    def unset_home(self, node: str) -> None:
        """Back to the real HOME, and no start-up file; the node's own HOME is removed."""
        self.set_env(node, HOME=None, SHLVL=None)
        shutil.rmtree(self.node_dir(node) / "home", ignore_errors=True)

    def noisy_shell(self, node: str, text: Optional[str] = None) -> Path:
        """Non-interactive ssh sessions on the node print `text` (one line, default "Welcome to nodeXX") on
        stdout before the command runs: an echo in the .bashrc of a HOME of its own (set_home). Returns it.
        (SetEnv BASH_ENV does nothing here: bash started by sshd reads ~/.bashrc instead of $BASH_ENV.)"""
        text = f"Welcome to {self._node(self.state(), node)['name']}" if text is None else text
        if "\n" in text or "\r" in text:
            raise ClusterError(f"noisy_shell text {text!r}: one line")
        home = self.set_home(node)
        self._write_bashrc(home, text)
        return home

    def quiet_shell(self, node: str) -> None:
        """Undo noisy_shell (and set_home): the real HOME and its .bashrc again."""
        self.unset_home(node)

    def _write_bashrc(self, home: Path, text: Optional[str]) -> None:
        (home / ".bashrc").write_text("# preflight test cluster: this node's own HOME\n"
                                      + (f"printf '%s\\n' {shlex.quote(text)}\n" if text is not None else ""))

    # ---- faults: network
    def drop_port(self, node: str, port: int) -> None:
        """Drop incoming TCP to `port` on the node (nftables table `inet pfc_<node>` in its netns)."""
        with self._mutate() as state:
            n = self._node(state, node)
            n["drop_ports"] = sorted(set(n.get("drop_ports") or []) | {int(port)})
            self._apply_nft(n)

    def undrop_port(self, node: str, port: Optional[int] = None) -> None:
        """Stop dropping `port` (all ports when None)."""
        with self._mutate() as state:
            n = self._node(state, node)
            n["drop_ports"] = [] if port is None else sorted(set(n.get("drop_ports") or []) - {int(port)})
            self._apply_nft(n)

    def block_incoming(self, node: str, *allowed: int) -> None:
        """Refuse new incoming TCP connections except to SSH and `allowed` ports: a host firewall that lets
        in the main port but not the ephemeral ports the ranks of gloo or NCCL connect to each other on.
        The node's own outgoing connections still work."""
        with self._mutate() as state:
            n = self._node(state, node)
            n["allowed_ports"] = sorted({22} | {int(p) for p in allowed})
            self._apply_nft(n)

    def unblock_incoming(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            n["allowed_ports"] = None
            self._apply_nft(n)

    def _apply_nft(self, n: Dict[str, Any]) -> None:
        """The node's nftables table `inet pfc_<node>`, rebuilt from its drop_ports and allowed_ports."""
        table = "pfc_" + re.sub(r"[^A-Za-z0-9_]", "_", n["name"])
        ns = ["ip", "netns", "exec", n["netns"]]
        _run(ns + ["nft", "delete", "table", "inet", table], check=False)
        rules = []
        if n.get("drop_ports"):
            rules.append(f"tcp dport {{ {', '.join(map(str, n['drop_ports']))} }} drop")
        if n.get("allowed_ports"):
            rules.append(f"ct state new tcp dport != {{ {', '.join(map(str, n['allowed_ports']))} }} drop")
        if rules:
            _run(ns + ["nft", "-f", "-"], input=(
                f"table inet {table} {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n"
                + "".join(f"    {rule}\n" for rule in rules) + "  }\n}\n"))

    def slow_link(self, node: str, rate: str = "1mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """Shape the node's link both ways with a token bucket (tbf: this kernel has no netem)."""
        with self._mutate() as state:
            n = self._node(state, node)
            for argv in (["tc"], ["ip", "netns", "exec", n["netns"], "tc"]):
                dev = n["veth"] if len(argv) == 1 else "eth0"
                _run(argv + ["qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                             "latency", latency])
            n["slow_link"] = rate

    def fast_link(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            _run(["tc", "qdisc", "del", "dev", n["veth"], "root"], check=False)
            _run(["ip", "netns", "exec", n["netns"], "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
            n["slow_link"] = None

    def slow_path(self, node: str, peer: str, rate: str = "100mbit") -> None:
        """Shape only what the node sends to one peer (htb: a class at `rate` for the peer's address, u32 picks it;
        the rest at full speed): one slow link between two nodes, each fast with every other. This kernel has no
        prio qdisc; htb's default class is given a rate no veth reaches."""
        with self._mutate() as state:
            n, target = self._node(state, node), self._node(state, peer)["ip"]
            tc = ["ip", "netns", "exec", n["netns"], "tc"]
            _run(tc + ["qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10"])
            _run(tc + ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit"])
            _run(tc + ["class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb", "rate", rate])
            _run(tc + ["filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                       "match", "ip", "dst", f"{target}/32", "flowid", "1:20"])
            n["slow_path"] = peer

    def fast_path(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            _run(["ip", "netns", "exec", n["netns"], "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
            n["slow_path"] = None

    def jumbo_mtu(self, node: str, mtu: int = 9000) -> None:
        """Jumbo frames on the node's eth0 behind a bridge whose ports carry 1500: on veth, GSO lets oversized
        super-packets through, so `gso_max_segs 1` makes eth0 send one frame per segment, as a wire does."""
        with self._mutate() as state:
            n = self._node(state, node)
            _run(["ip", "-n", n["netns"], "link", "set", "eth0", "mtu", str(mtu), "gso_max_segs", "1"])
            n["mtu"] = int(mtu)

    def normal_mtu(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            _run(["ip", "-n", n["netns"], "link", "set", "eth0", "mtu", "1500", "gso_max_segs", "65535"])
            n["mtu"] = None

    def capture_route(self, node: str, peer: str) -> None:
        """A second interface on the node (a veth pair kept inside its namespace: this kernel has no `dummy`)
        with a more specific route to one peer's address: the traffic to that peer leaves where it is not."""
        with self._mutate() as state:
            n, target = self._node(state, node), self._node(state, peer)["ip"]
            ns = ["ip", "-n", n["netns"]]
            if not n.get("captured"):
                _run(ns + ["link", "add", "cap0", "type", "veth", "peer", "name", "cap1"])
                _run(ns + ["link", "set", "cap0", "up"])
                _run(ns + ["link", "set", "cap1", "up"])
            _run(ns + ["route", "replace", f"{target}/32", "dev", "cap0"])
            n["captured"] = target

    def add_interface(self, node: str, name: str, address: Optional[str] = None, carrier: bool = True) -> None:
        """Another interface on the node, after its eth0 in the kernel's order: a veth pair kept inside its
        namespace (NAME and pf-NAME), UP, with `address` (CIDR) if given; IPv6 gives it its link-local address.
        Without carrier, its peer stays down (NO-CARRIER)."""
        with self._mutate() as state:
            n = self._node(state, node)
            ns = ["ip", "-n", n["netns"]]
            _run(ns + ["link", "add", name, "type", "veth", "peer", "name", f"pf-{name}"])
            n.setdefault("interfaces", []).append(name)
            _run(ns + ["link", "set", name, "up"])
            if carrier:
                _run(ns + ["link", "set", f"pf-{name}", "up"])
            if address:
                _run(ns + ["addr", "add", address, "dev", name])

    def remove_interfaces(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            for name in n.get("interfaces") or []:
                _run(["ip", "-n", n["netns"], "link", "del", name], check=False)  # its peer and addresses too
            n["interfaces"] = []

    def release_route(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            _run(["ip", "-n", n["netns"], "link", "del", "cap0"], check=False)  # its routes go with it
            n["captured"] = None

    # ---- NTP server
    def start_ntp_server(self, node: str, timeout: float = 15) -> str:
        """Run chronyd (local stratum 8, -x: never touches the clock) in the node's netns; returns its IP
        once it answers NTP queries as a synchronized server."""
        chronyd = shutil.which("chronyd") or "/usr/sbin/chronyd"
        if not os.access(chronyd, os.X_OK):
            raise ClusterError("chronyd not found (apt-get install chrony)")
        with self._mutate() as state:
            n = self._node(state, node)
            if n.get("ntp_pid") and _alive(n["ntp_pid"]):
                return n["ip"]
            ndir = Path(n["dir"])
            conf = ndir / "chrony.conf"
            conf.write_text(f"# preflight test cluster NTP server on {n['name']}\n"
                            f"local stratum 8\nallow {self._config['subnet']}.0/24\n"
                            f"bindaddress {n['ip']}\ncmdport 0\nbindcmdaddress /\n"
                            f"pidfile {ndir / 'chronyd.pid'}\ndriftfile {ndir / 'chrony.drift'}\nuser root\n")
            proc = self._start_daemon(n, "ntp_pid", [chronyd, "-d", "-x", "-f", str(conf)], ndir / "chrony.log")

        def synchronized():
            answer = ntp_query(n["ip"], timeout=0.5)
            return answer["leap"] != 3 and answer["stratum"] not in (0, 16)

        self._wait_ready(proc, synchronized, f"chronyd on {node} (a synchronized answer)", ndir / "chrony.log", timeout)
        return n["ip"]

    def stop_ntp_server(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            self._kill(n.get("ntp_pid"), n["netns"], str(Path(n["dir"]) / "chrony.conf"))
            n["ntp_pid"] = None

    def start_kdc(self, node: str, timeout: float = 15) -> Dict[str, str]:
        """A Kerberos realm (KERBEROS_REALM) served by krb5kdc in the node's netns, as a site's KDC: principals
        root@REALM and host/NAME@REALM for every node, their keys in keytabs. Returns the files a client and an
        sshd need: `krb5.conf` (KRB5_CONFIG), `hosts.keytab` (KRB5_KTNAME for sshd), `root.keytab` (kinit -k)."""
        krb5kdc = shutil.which("krb5kdc") or "/usr/sbin/krb5kdc"
        if not os.access(krb5kdc, os.X_OK):
            raise ClusterError("krb5kdc not found (apt-get install krb5-kdc krb5-admin-server krb5-user)")
        with self._mutate() as state:
            n = self._node(state, node)
            folder = Path(n["dir"]) / "kerberos"
            files = {name: str(folder / name) for name in ("krb5.conf", "hosts.keytab", "root.keytab")}
            if n.get("kdc_pid") and _alive(n["kdc_pid"]):
                return files
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            realm = KERBEROS_REALM
            (folder / "krb5.conf").write_text(
                f"[libdefaults]\n    default_realm = {realm}\n    dns_lookup_kdc = false\n"
                f"    dns_lookup_realm = false\n    rdns = false\n    dns_canonicalize_hostname = false\n"
                f"[realms]\n    {realm} = {{\n        kdc = {n['ip']}:88\n    }}\n")
            (folder / "kdc.conf").write_text(
                f"[kdcdefaults]\n    kdc_ports = 88\n    kdc_tcp_ports = 88\n[realms]\n    {realm} = {{\n"
                f"        database_name = {folder / 'principal'}\n        key_stash_file = {folder / 'stash'}\n"
                f"        acl_file = {folder / 'kadm5.acl'}\n    }}\n[logging]\n    kdc = FILE:{folder / 'kdc.log'}\n")
            env = dict(os.environ, KRB5_CONFIG=files["krb5.conf"], KRB5_KDC_PROFILE=str(folder / "kdc.conf"))
            _run(["kdb5_util", "-r", realm, "-P", "preflight-test-master", "create", "-s"], env=env)
            principals = {"root.keytab": [f"root@{realm}"],
                          "hosts.keytab": [f"host/{other['name']}@{realm}" for other in state["nodes"]]}
            for keytab, names in principals.items():
                for name in names:
                    _run(["kadmin.local", "-q", f"addprinc -randkey {name}"], env=env)
                    _run(["kadmin.local", "-q", f"ktadd -k {files[keytab]} {name}"], env=env)
            proc = self._start_daemon(n, "kdc_pid", [krb5kdc, "-n", "-r", realm], folder / "kdc.log", env=env)

        def listening():
            socket.create_connection((n["ip"], 88), timeout=0.5).close()
            return True

        self._wait_ready(proc, listening, f"krb5kdc on {node} (port 88)", folder / "kdc.log", timeout)
        return files

    def _start_daemon(self, n: Dict[str, Any], key: str, argv: Sequence[str], log: Path,
                      env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """A daemon in the node's netns, in a session of its own, its output appended to `log`; its PID kept in
        the node's state under `key` (down() ends it with the namespace)."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", n["netns"], *argv], env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        self._procs[proc.pid] = proc
        n[key] = proc.pid
        return proc

    @staticmethod
    def _wait_ready(proc: subprocess.Popen, ready: Any, what: str, log: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise ClusterError(f"{what}: exited:\n" + _tail(log))
            with contextlib.suppress(OSError, ClusterError):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"{what}: not ready in {timeout:g} s:\n" + _tail(log))
            time.sleep(0.1)

    def stop_kdc(self, node: str) -> None:
        with self._mutate() as state:
            n = self._node(state, node)
            self._kill(n.get("kdc_pid"), n["netns"], KERBEROS_REALM)
            n["kdc_pid"] = None

    # ---- undo everything
    def restore(self, node: str) -> None:
        """Reverse every fault on one node and make sure its sshd answers."""
        n = self._node(self.state(), node)
        if n.get("ntp_pid"):
            self.stop_ntp_server(node)
        if n.get("kdc_pid"):
            self.stop_kdc(node)
        if n.get("slow_link"):
            self.fast_link(node)
        if n.get("slow_path"):
            self.fast_path(node)
        if n.get("binds"):
            self.unbind_dir(node)
        if n.get("drop_ports"):
            self.undrop_port(node)
        if n.get("allowed_ports"):
            self.unblock_incoming(node)
        if n.get("loopback_hostname"):
            self.real_hostname(node)
        if n.get("hosts_override"):
            self.right_hosts_entries(node)
        if n.get("mtu"):
            self.normal_mtu(node)
        if n.get("captured"):
            self.release_route(node)
        if n.get("interfaces"):
            self.remove_interfaces(node)
        if n.get("frozen"):
            self.thaw_sshd(node)
        overlay = Path(n["dir"]) / "overlay"
        if overlay.exists():
            shutil.rmtree(overlay, ignore_errors=True)
        shutil.rmtree(Path(n["dir"]) / "home", ignore_errors=True)
        if n.get("env"):
            self.clear_env(node)  # restarts sshd
        if n.get("shm"):
            self.restore_shm(node)
        n = self._node(self.state(), node)  # clear_env restarted sshd: its PID is a new one
        if not (n.get("pid") and _alive(n["pid"])):
            with self._mutate() as state:
                self._node(state, node)["pid"] = None
            self.start_sshd(node)

    def restore_all(self) -> None:
        for node in self.nodes:
            self.restore(node)

    # ---- the same faults as context managers
    @contextlib.contextmanager
    def stopped_sshd(self, node: str) -> Iterator[None]:
        self.stop_sshd(node)
        try:
            yield
        finally:
            self.start_sshd(node)

    @contextlib.contextmanager
    def frozen_sshd(self, node: str) -> Iterator[None]:
        self.freeze_sshd(node)
        try:
            yield
        finally:
            self.thaw_sshd(node)

    @contextlib.contextmanager
    def env(self, node: str, **variables: Optional[str]) -> Iterator[None]:
        previous = self.set_env(node, **variables)
        try:
            yield
        finally:
            self.replace_env(node, previous)

    @contextlib.contextmanager
    def extra_interface(self, node: str, name: str, address: Optional[str] = None,
                        carrier: bool = True) -> Iterator[None]:
        self.add_interface(node, name, address, carrier)
        try:
            yield
        finally:
            self.remove_interfaces(node)

    @contextlib.contextmanager
    def faked_time(self, node: str, offset: str = "+5s") -> Iterator[None]:
        previous = self._node(self.state(), node).get("env") or {}
        self.fake_time(node, offset)
        try:
            yield
        finally:
            self.replace_env(node, previous)

    @contextlib.contextmanager
    def shadowed_package(self, node: str, dist: str, version: str) -> Iterator[Path]:
        overlay = self.shadow_package(node, dist, version)
        try:
            yield overlay
        finally:
            self.unshadow_package(node, dist)

    @contextlib.contextmanager
    def blocked_incoming(self, node: str, *allowed: int) -> Iterator[None]:
        self.block_incoming(node, *allowed)
        try:
            yield
        finally:
            self.unblock_incoming(node)

    @contextlib.contextmanager
    def dropped_port(self, node: str, port: int) -> Iterator[None]:
        self.drop_port(node, port)
        try:
            yield
        finally:
            self.undrop_port(node, port)

    @contextlib.contextmanager
    def loopback_hostname_fault(self, node: str) -> Iterator[None]:
        self.loopback_hostname(node)
        try:
            yield
        finally:
            self.real_hostname(node)

    @contextlib.contextmanager
    def small_shm_fault(self, node: str, size: str = "64m") -> Iterator[None]:
        self.small_shm(node, size)
        try:
            yield
        finally:
            self.restore_shm(node)

    @contextlib.contextmanager
    def bound_dir(self, node: str, target: "os.PathLike[str] | str") -> Iterator[Path]:
        private = self.bind_dir(node, target)
        try:
            yield private
        finally:
            self.unbind_dir(node, target)

    @contextlib.contextmanager
    def noisy_shell_fault(self, node: str, text: Optional[str] = None) -> Iterator[Path]:
        home = self.noisy_shell(node, text)
        try:
            yield home
        finally:
            self.quiet_shell(node)

    @contextlib.contextmanager
    def slowed_link(self, node: str, rate: str = "1mbit") -> Iterator[None]:
        self.slow_link(node, rate)
        try:
            yield
        finally:
            self.fast_link(node)

    @contextlib.contextmanager
    def slowed_path(self, node: str, peer: str, rate: str = "100mbit") -> Iterator[None]:
        self.slow_path(node, peer, rate)
        try:
            yield
        finally:
            self.fast_path(node)

    @contextlib.contextmanager
    def jumbo_mtu_fault(self, node: str, mtu: int = 9000) -> Iterator[None]:
        self.jumbo_mtu(node, mtu)
        try:
            yield
        finally:
            self.normal_mtu(node)

    @contextlib.contextmanager
    def captured_route(self, node: str, peer: str) -> Iterator[None]:
        self.capture_route(node, peer)
        try:
            yield
        finally:
            self.release_route(node)

    @contextlib.contextmanager
    def wrong_hosts_entry_fault(self, node: str, peer: str, address: str) -> Iterator[None]:
        self.wrong_hosts_entry(node, peer, address)
        try:
            yield
        finally:
            self.right_hosts_entries(node)

    @contextlib.contextmanager
    def ntp_server(self, node: str) -> Iterator[str]:
        ip = self.start_ntp_server(node)
        try:
            yield ip
        finally:
            self.stop_ntp_server(node)


# ---------------------------------------------------------------------------------------------- teardown

def _teardown(namespaces: Sequence[str], veths: Sequence[str], bridge: Optional[str],
              recorded: Sequence[tuple] = (), marker: Optional[str] = None, collect=_reap) -> None:
    """Kill every process in the namespaces (plus recorded PIDs that still name `marker`), delete the
    namespaces, the veths and the bridge. Missing pieces are fine."""
    victims: List[int] = []
    for ns in namespaces:
        victims += netns_pids(ns)
    for pid, _ns in recorded:
        if pid and pid not in victims and marker and _cmdline_has(pid, marker) and _alive(pid):
            victims.append(pid)
    victims = [p for p in dict.fromkeys(victims) if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGCONT):
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def wait(timeout: float) -> List[int]:
        deadline = time.monotonic() + timeout
        while True:
            for pid in victims:
                collect(pid)
            left = [p for p in victims if _alive(p)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.02)

    left = wait(3)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    left = wait(3)
    for ns in namespaces:  # anything started after the first listing
        for pid in netns_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    existing = set(netns_list())
    for ns in namespaces:
        if ns in existing:
            _run(["ip", "netns", "del", ns], check=False)
    links = set(_link_names())
    for veth in veths:
        if veth in links:
            _run(["ip", "link", "del", veth], check=False)
    if bridge and bridge in links:
        _run(["ip", "link", "del", bridge], check=False)
    if left:
        raise ClusterError(f"processes did not end: {left}")


def clean_stale(prefix: str = NAME_PREFIX, netns_prefix: str = NETNS_PREFIX, bridge: Optional[str] = BRIDGE) -> List[str]:
    """Tear down what a crashed run left behind: namespaces named <netns_prefix><prefix>NN, their veths,
    and the bridge. Returns the namespaces it found."""
    pattern = re.compile(re.escape(netns_prefix + prefix) + r"\d+")
    namespaces = [ns for ns in netns_list() if pattern.fullmatch(ns)]
    veth_pattern = re.compile("v" + re.escape(netns_prefix + prefix) + r"\d+")
    veths = [link for link in _link_names() if veth_pattern.fullmatch(link)]
    _teardown(namespaces, veths, bridge)
    return namespaces


def leftovers(prefix: str = NAME_PREFIX, netns_prefix: str = NETNS_PREFIX, bridge: str = BRIDGE,
              pids: Sequence[int] = ()) -> List[str]:
    """What of a cluster still exists (namespaces, links, live PIDs); empty after a clean down."""
    pattern = re.compile(re.escape(netns_prefix + prefix) + r"\d+")
    out = [f"netns {ns}" for ns in netns_list() if pattern.fullmatch(ns)]
    veth_pattern = re.compile("v" + re.escape(netns_prefix + prefix) + r"\d+")
    out += [f"link {link}" for link in _link_names() if link == bridge or veth_pattern.fullmatch(link)]
    out += [f"pid {pid}" for pid in pids if pid and _alive(pid)]
    return out


# ---------------------------------------------------------------------------------------------- module API

def up(dir: "os.PathLike[str] | str", nodes: int = 3, **kwargs: Any) -> Cluster:
    return Cluster(dir, nodes=nodes, **kwargs).up()


def down(dir: "os.PathLike[str] | str", prefix: Optional[str] = None, **kwargs: Any) -> None:
    """Tear down the cluster in DIR (its state, or, without state, namespaces matching the prefix)."""
    try:
        cluster = Cluster.load(dir)
    except ClusterError:
        cluster = Cluster(dir, prefix=prefix or NAME_PREFIX, **kwargs)
    cluster.down()


def status(dir: "os.PathLike[str] | str") -> Dict[str, Any]:
    return Cluster.load(dir).status()


FAULT_METHODS = ("stop_sshd", "start_sshd", "restart_sshd", "freeze_sshd", "thaw_sshd", "set_env", "clear_env",
                 "fake_time", "real_time", "shadow_package", "unshadow_package", "drop_port", "undrop_port",
                 "block_incoming", "unblock_incoming",
                 "loopback_hostname", "real_hostname", "small_shm", "restore_shm", "bind_dir", "unbind_dir",
                 "set_home", "unset_home", "noisy_shell", "quiet_shell", "slow_link", "fast_link",
                 "slow_path", "fast_path", "jumbo_mtu", "normal_mtu", "capture_route", "release_route", "wrong_hosts_entry",
                 "right_hosts_entries",
                 "start_ntp_server", "stop_ntp_server", "restore", "restore_all")


def _module_helper(name: str):
    def helper(dir: "os.PathLike[str] | str", *args: Any, **kwargs: Any) -> Any:
        return getattr(Cluster.load(dir), name)(*args, **kwargs)
    helper.__name__ = helper.__qualname__ = name
    helper.__doc__ = f"Cluster.load(dir).{name}(...): " + (getattr(Cluster, name).__doc__ or "").strip()
    return helper


for _name in FAULT_METHODS:
    globals()[_name] = _module_helper(_name)
    __all__.append(_name)


# ---------------------------------------------------------------------------------------------- CLI

FAULTS_CLI = {
    # kind: (apply, restore, argument names)
    "stop-sshd": ("stop_sshd", "start_sshd", []),
    "freeze-sshd": ("freeze_sshd", "thaw_sshd", []),
    "fake-time": ("fake_time", "real_time", ["offset"]),
    "env": ("set_env", "clear_env", ["NAME=VALUE..."]),
    "shadow-package": ("shadow_package", "unshadow_package", ["dist", "version"]),
    "drop-port": ("drop_port", "undrop_port", ["port"]),
    "block-incoming": ("block_incoming", "unblock_incoming", ["[allowed port...]"]),
    "loopback-hostname": ("loopback_hostname", "real_hostname", []),
    "small-shm": ("small_shm", "restore_shm", ["[size]"]),
    "bind-dir": ("bind_dir", "unbind_dir", ["target"]),
    "noisy-shell": ("noisy_shell", "quiet_shell", ["[text]"]),
    "slow-link": ("slow_link", "fast_link", ["[rate]"]),
    "slow-path": ("slow_path", "fast_path", ["peer", "[rate]"]),
    "ntp-server": ("start_ntp_server", "stop_ntp_server", []),
    "jumbo-mtu": ("jumbo_mtu", "normal_mtu", ["[mtu]"]),
    "capture-route": ("capture_route", "release_route", ["peer"]),
    "wrong-hosts-entry": ("wrong_hosts_entry", "right_hosts_entries", ["peer", "address"]),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="testcluster.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="create the cluster")
    p.add_argument("--wait", type=float, default=5, help="seconds to wait for a running pytest cluster (lock)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--dir", required=True)
    p.add_argument("--prefix", default=NAME_PREFIX, help="node name prefix (default node -> node01..)")
    p.add_argument("--bridge", default=BRIDGE)
    p.add_argument("--subnet", default=SUBNET, help="first three octets of the /24 (default 10.77.0)")
    p = sub.add_parser("down", help="tear the cluster down (idempotent)")
    p.add_argument("--wait", type=float, default=5, help="seconds to wait for a running pytest cluster (lock)")
    p.add_argument("--dir", required=True)
    p.add_argument("--prefix", default=None, help="when DIR has no state: the node name prefix to clean")
    p = sub.add_parser("clean", help="tear down whatever a crashed run left (by name prefix, no DIR needed)")
    p.add_argument("--wait", type=float, default=5, help="seconds to wait for a running pytest cluster (lock)")
    p.add_argument("--prefix", default=NAME_PREFIX)
    p = sub.add_parser("status", help="print the cluster's state as JSON")
    p.add_argument("--dir", required=True)
    p = sub.add_parser("fault", help="apply a fault: " + ", ".join(
        f"{k} {' '.join(v[2])}".strip() for k, v in FAULTS_CLI.items()))
    p.add_argument("--dir", required=True)
    p.add_argument("node")
    p.add_argument("kind", choices=sorted(FAULTS_CLI))
    p.add_argument("args", nargs="*")
    p = sub.add_parser("restore", help="reverse one fault kind, or every fault on the node (or on `all`)")
    p.add_argument("--dir", required=True)
    p.add_argument("node")
    p.add_argument("kind", nargs="?", choices=sorted(FAULTS_CLI))
    p.add_argument("args", nargs="*")
    p = sub.add_parser("ssh", help="run ssh to a node with the cluster's ssh_config")
    p.add_argument("--dir", required=True)
    p.add_argument("node")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            t0 = time.monotonic()
            with cluster_lock(timeout=args.wait):
                cluster = Cluster(args.dir, nodes=args.nodes, prefix=args.prefix, bridge=args.bridge,
                                  subnet=args.subnet).up()
            print(f"up in {time.monotonic() - t0:.1f} s: {', '.join(f'{n} {cluster.ip(n)}' for n in cluster.nodes)}"
                  f"\n  ssh -F {cluster.ssh_config} {cluster.nodes[0]} hostname")
        elif args.cmd == "down":
            with cluster_lock(timeout=args.wait):
                down(args.dir, prefix=args.prefix)
        elif args.cmd == "clean":
            with cluster_lock(timeout=args.wait):
                found = clean_stale(args.prefix)
            print("removed: " + (", ".join(found) or "nothing"))
        elif args.cmd == "status":
            print(json.dumps(status(args.dir), indent=2))
        elif args.cmd == "ssh":
            cluster = Cluster.load(args.dir)
            os.execvp("ssh", cluster.ssh_argv(args.node, *args.command, batch=False))
        else:
            cluster = Cluster.load(args.dir)
            nodes = cluster.nodes if args.node == "all" else [args.node]
            for node in nodes:
                if args.cmd == "restore" and not args.kind:
                    cluster.restore(node)
                    continue
                apply, undo, _ = FAULTS_CLI[args.kind]
                method = getattr(cluster, apply if args.cmd == "fault" else undo)
                if args.kind == "env" and args.cmd == "fault":
                    method(node, **dict(a.split("=", 1) for a in args.args))
                elif args.kind in ("drop-port", "block-incoming"):
                    method(node, *[int(a) for a in args.args])
                elif args.kind == "noisy-shell" and args.cmd == "fault":
                    method(node, *([" ".join(args.args)] if args.args else []))
                elif args.kind == "bind-dir" and args.cmd == "fault":
                    print(method(node, *args.args))  # the node's private folder, to put its files in
                elif args.kind == "jumbo-mtu" and args.cmd == "fault":
                    method(node, *[int(a) for a in args.args])
                elif args.cmd == "fault" or args.kind in ("shadow-package", "bind-dir"):
                    method(node, *args.args)
                else:
                    method(node)
    except ClusterError as exc:
        print(f"testcluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
