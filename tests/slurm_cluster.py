"""A real SLURM on the test cluster (tests/cluster.py): munged and slurmctld in the root namespace (the login
node), one slurmd per test host, in the host's network namespace, with its hostname and /etc/hosts.

In a test module::

    from cluster import cluster, cluster_up  # noqa: F401
    from slurm_cluster import slurm, slurm_up  # noqa: F401

    pytestmark = pytest.mark.cluster

    def test_srun(slurm):
        slurm.run(["srun", "-N3", "hostname"])

Debian's packages: `apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge`
(slurm-wlm 22.05; everything runs as root, without systemd). Config, state, spool, sockets and logs live
under one tmp dir; `SLURM_CONF` in `slurm.env` points the clients at it. Every daemon is our child process
and is ended by its PID at teardown, always (finalizer and atexit).

Each slurmd runs in its own mount namespace (a copy of the root one, with the node's /etc/hosts and
/etc/resolv.conf bound over it): `slurm.small_shm(node)` mounts a small tmpfs on that namespace's /dev/shm, which the node's prologs
and job steps see. slurmd is started with `nsenter --net=/run/netns/X`, not `ip netns exec` (which remounts
/sys, and slurmd then fails on cgroups).

`make_slurm_fixtures(health_check=SCRIPT, health_check_env={...}, health_check_interval=S)` sets
HealthCheckProgram= (a wrapper that exports the variables and logs each run: `slurm.health_checks(node)`);
`ports=(CTLD, SLURMD)` and `scope="function"` let such a SLURM run beside the module's, for one test.
`gpus=N` gives every node N GPUs as a GRES without hardware: gres.conf with `AutoDetect=off` and `File=` naming
N character devices made here with /dev/null's numbers (slurmd 22.05 drops a GPU without `File=`, "Ignoring
file-less GPU", and the node is INVAL). slurmctld allocates them and sets the jobs' GPU variables.
"""
from __future__ import annotations

import atexit
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

SLURM_TOOLS = ("slurmctld", "slurmd", "munged", "scontrol", "srun", "sinfo")
CTLD_PORT = 6917
SLURMD_PORT = 6918


def slurm_unavailable() -> str:
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        return ("not installed: " + ", ".join(missing) +
                " (apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge)")
    return ""


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmError(RuntimeError):
    pass


class Slurm:
    def __init__(self, cluster, dir: Path, prolog: Optional[str] = None, prolog_env: Optional[dict] = None,
                 health_check: Optional[str] = None, health_check_env: Optional[dict] = None,
                 health_check_interval: int = 2, health_check_node_state: str = "ANY",
                 ports: Sequence[int] = (CTLD_PORT, SLURMD_PORT), gpus: int = 0):
        self.cluster = cluster
        self.gpus = gpus  # GPUs per node, as a GRES that no device backs
        self.dir = Path(dir)
        self.prolog = prolog  # a script for Prolog= (with PrologFlags=Alloc), run through a wrapper that
        self.prolog_env = dict(prolog_env or {})  # exports these variables first
        self.prolog_log = self.dir / "prolog.log"
        # HealthCheckProgram=: the same kind of wrapper. slurmd fires it at its start, before it registers,
        # and then whenever slurmctld asks (every HealthCheckInterval seconds, in HealthCheckNodeState).
        self.health_check = health_check
        self.health_check_env = dict(health_check_env or {})
        self.health_check_interval, self.health_check_node_state = health_check_interval, health_check_node_state
        self.health_check_log = self.dir / "healthcheck.log"
        self.health_check_runs = self.dir / "healthcheck-runs.log"  # a line per finished run (health_checks)
        self.ctld_port, self.slurmd_port = ports  # another pair lets a second SLURM run beside the first
        self.procs: Dict[str, subprocess.Popen] = {}
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket.2"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    @property
    def nodes(self) -> List[str]:
        return self.cluster.nodes

    # ---- up
    def up(self, timeout: float = 30) -> "Slurm":
        self.dir.mkdir(parents=True, exist_ok=True)
        self._start_munged()
        self._write_conf()
        ctld_log = open(self.dir / "slurmctld.stdout", "ab")
        self.procs["slurmctld"] = subprocess.Popen(
            [_tool("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=self.env, stdin=subprocess.DEVNULL,
            stdout=ctld_log, stderr=subprocess.STDOUT, start_new_session=True)
        for node in self.nodes:
            self._start_slurmd(node)
        self.wait_idle(self.nodes, timeout)
        return self

    def _start_munged(self) -> None:
        mdir = self.dir / "munge"
        mdir.mkdir(mode=0o711, exist_ok=True)
        os.chmod(mdir, 0o711)  # the socket's folder: world-executable
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)  # never group-readable
        log = open(self.dir / "munged.stdout", "ab")
        self.procs["munged"] = subprocess.Popen(
            [_tool("munged"), "-F", "-f", "--socket", str(self.munge_socket), "--key-file", str(key),
             "--pid-file", str(mdir / "munged.pid"), "--log-file", str(self.dir / "munged.log"),
             "--seed-file", str(mdir / "munged.seed")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmError(f"munged did not start: {self._tail(self.dir / 'munged.log')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir(exist_ok=True)
        for node in self.nodes:
            (d / "spool" / node).mkdir(exist_ok=True)
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=pftest",
            f"SlurmctldHost={host}({self.cluster.login_ip})",
            f"SlurmctldPort={self.ctld_port}", f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'spool' / '%n' / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'spool' / '%n' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SwitchType=switch/none",
            "SelectType=select/cons_tres", "ReturnToService=2",
            "SlurmctldTimeout=10", "SlurmdTimeout=10", "InactiveLimit=0", "KillWait=2", "MinJobAge=5",
            f"PlugStackConfig={d / 'plugstack.conf'}",
        ]
        if self.prolog:
            wrapper = self._wrapper("prolog", self.prolog, dict(self.prolog_env, PREFLIGHT_LOG=str(self.prolog_log)))
            lines += [f"Prolog={wrapper}", "PrologFlags=Alloc"]
        if self.health_check:
            env = dict(self.health_check_env, SLURM_CONF=str(self.conf), PREFLIGHT_LOG=str(self.health_check_log))
            wrapper = self._wrapper("healthcheck", self.health_check, env, runs=self.health_check_runs)
            lines += [f"HealthCheckProgram={wrapper}", f"HealthCheckInterval={self.health_check_interval}",
                      f"HealthCheckNodeState={self.health_check_node_state}"]
        cpus = os.cpu_count() or 1
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        if self.gpus:  # gres.conf beside slurm.conf, where slurmd looks for it
            lines.append("GresTypes=gpu")
            for k in range(self.gpus):
                device = d / f"gpu{k}"
                if not device.exists():
                    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
            (d / "gres.conf").write_text("AutoDetect=off\n" + "".join(
                f"NodeName={node} Name=gpu File={d}/gpu[0-{self.gpus - 1}]\n" for node in self.nodes))
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeAddr={self.cluster.ip(node)} CPUs={cpus}{gres} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        (d / "plugstack.conf").write_text("")
        self.conf.write_text("\n".join(lines) + "\n")

    def _wrapper(self, name: str, script: str, env: dict, runs: Optional[Path] = None) -> Path:
        """A script that exports env (what slurmd does not pass), then runs script; with runs, it appends
        a line per run there: start and end (time.time()), node, exit status, the environment slurmd gave."""
        exports = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
        if runs is None:
            body = f"{exports}exec {shlex.quote(str(script))}\n"
        else:
            body = (f"started=$(date +%s.%N) given=$(env | sort | tr '\\n' ' ')\n"
                    f"{exports}{shlex.quote(str(script))}\nstatus=$?\n"
                    f'echo "$started $(date +%s.%N) $(hostname) $status $given" >>{shlex.quote(str(runs))}\n'
                    "exit $status\n")
        wrapper = self.dir / f"{name}-wrapper.sh"
        wrapper.write_text("#!/bin/sh\n" + body)
        wrapper.chmod(0o755)
        return wrapper

    def health_checks(self, node: str) -> List[dict]:
        """The HealthCheckProgram runs slurmd finished on node, oldest first: {started, ended (time.time()),
        status, env (what slurmd gave it)}."""
        try:
            rows = [line.split(" ", 4) for line in self.health_check_runs.read_text().splitlines()]
        except OSError:
            return []
        return [{"started": float(r[0]), "ended": float(r[1]), "status": int(r[3]),
                 "env": r[4].split() if len(r) > 4 else []} for r in rows if len(r) >= 4 and r[2] == node]

    def _start_slurmd(self, node: str) -> None:
        hosts, resolv = self.cluster.node_dir(node) / "hosts", self.cluster.node_dir(node) / "resolv.conf"
        # The node's resolv.conf too, as its sshd has it: the machine's DNS server is out of the node's reach,
        # and every name or address missing from /etc/hosts would wait for its timeouts.
        script = (f"hostname {shlex.quote(node)} && mount --bind {shlex.quote(str(hosts))} /etc/hosts && "
                  f"mount --bind {shlex.quote(str(resolv))} /etc/resolv.conf && "
                  f"exec {_tool('slurmd')} -D -N {shlex.quote(node)} -f {shlex.quote(str(self.conf))}")
        log = open(self.dir / f"slurmd-{node}.stdout", "ab")
        self.procs[f"slurmd-{node}"] = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.cluster.netns(node)}", "unshare", "--uts", "--mount",
             "sh", "-c", script], env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    # ---- use
    def run(self, argv: Sequence[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        try:
            proc = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:  # a job waiting for nodes: say which state kept them
            nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], env=self.env, capture_output=True,
                                   text=True, timeout=10, stdin=subprocess.DEVNULL).stdout
            raise SlurmError(f"{shlex.join(argv)}: still running after {timeout:g} s; stderr: "
                             f"{(exc.stderr or b'').decode(errors='replace').strip()}\nnodes:\n{nodes}"
                             f"slurmctld.log: {self._tail(self.dir / 'slurmctld.log')}") from None
        if check and proc.returncode != 0:
            raise SlurmError(f"{shlex.join(argv)}: rc {proc.returncode}: {proc.stderr.strip()}\n"
                             f"slurmctld.log: {self._tail(self.dir / 'slurmctld.log')}")
        return proc

    def slurmd_pid(self, node: str) -> int:
        """The slurmd's PID (the exec'd `sh` keeps the Popen's PID)."""
        return self.procs[f"slurmd-{node}"].pid

    def node_exec(self, node: str, argv: Sequence[str], env: Optional[dict] = None,
                  timeout: float = 60) -> subprocess.CompletedProcess:
        """Run argv on the node as its slurmd would run a prolog: its network, hostname and mounts."""
        pid = str(self.slurmd_pid(node))
        return subprocess.run(["nsenter", "--target", pid, "--net", "--uts", "--mount", *argv],
                              env=dict(self.env, **(env or {})), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def small_shm(self, node: str, size: str = "64m") -> None:
        subprocess.run(["nsenter", "--target", str(self.slurmd_pid(node)), "--mount", "mount", "-t", "tmpfs",
                        "-o", f"size={size}", "pf-slurm-shm", "/dev/shm"], check=True, timeout=10)

    def restore_shm(self, node: str) -> None:
        while "pf-slurm-shm" in self.node_exec(node, ["cat", "/proc/self/mounts"]).stdout:
            subprocess.run(["nsenter", "--target", str(self.slurmd_pid(node)), "--mount", "umount", "/dev/shm"],
                           check=True, timeout=10)

    def node_info(self, node: str) -> Dict[str, str]:
        text = self.run(["scontrol", "show", "node", node]).stdout
        state = re.search(r"\bState=(\S+)", text)
        reason = re.search(r"\bReason=(.*)$", text, re.MULTILINE)
        return {"state": state.group(1) if state else "", "reason": reason.group(1).strip() if reason else ""}

    def slurmd_log(self, node: str) -> str:
        try:
            return (self.dir / "spool" / node / "slurmd.log").read_text(errors="replace")
        except OSError:
            return ""

    def ctld_log_size(self) -> int:
        try:
            return (self.dir / "slurmctld.log").stat().st_size
        except OSError:
            return 0

    def wait_ctld_log(self, pattern: str, since: int, timeout: float = 60) -> str:
        """The first line of slurmctld.log past byte `since` that matches the regex pattern."""
        deadline = time.monotonic() + timeout
        while True:
            with open(self.dir / "slurmctld.log", "rb") as log:
                log.seek(since)
                for line in log.read().decode(errors="replace").splitlines():
                    if re.search(pattern, line):
                        return line
            if time.monotonic() > deadline:
                raise SlurmError(f"slurmctld logged nothing matching {pattern!r} in {timeout:g} s: "
                                 f"{self._tail(self.dir / 'slurmctld.log')}")
            time.sleep(0.2)

    def drained(self) -> Dict[str, str]:
        """sinfo -R: node -> reason."""
        out = self.run(["sinfo", "-h", "-R", "-N", "-o", "%N|%E"]).stdout
        return {line.split("|", 1)[0]: line.split("|", 1)[1] for line in out.splitlines() if "|" in line}

    def wait_idle(self, nodes: Sequence[str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited (rc {proc.returncode}); logs in {self.dir}: "
                                     f"{self._tail(self.dir / 'slurmctld.log')}")
            proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in nodes):
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"nodes not idle after {timeout:g} s: {states or proc.stderr.strip()}")
            time.sleep(0.2)

    def resume(self, node: str) -> None:
        self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
        self.wait_idle([node])

    # ---- down
    def down(self) -> None:
        for name in [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def alive(self) -> List[str]:
        return [name for name, proc in self.procs.items() if proc.poll() is None]

    @staticmethod
    def _tail(path: Path, n: int = 8) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def make_slurm_fixtures(prolog: Optional[str] = None, prolog_env: Optional[dict] = None, name: str = "slurm",
                        scope: str = "module", **options):
    """`{name}_up` (one SLURM per module, or per test with scope="function") and the per-test `{name}`;
    options go to Slurm (health_check=SCRIPT, ports=...)."""
    @pytest.fixture(scope=scope, name=f"{name}_up")
    def _up(cluster_up, tmp_path_factory):
        reason = slurm_unavailable()
        if reason:
            pytest.skip(f"SLURM unavailable: {reason}")
        slurm = Slurm(cluster_up, tmp_path_factory.mktemp(name), prolog=prolog, prolog_env=prolog_env, **options)
        atexit.register(slurm.down)
        try:
            slurm.up()
            yield slurm
        finally:
            slurm.down()
            atexit.unregister(slurm.down)
        assert not slurm.alive(), f"SLURM teardown left: {slurm.alive()}"

    @pytest.fixture(name=name)
    def _per_test(request):
        slurm = request.getfixturevalue(f"{name}_up")
        yield slurm
        slurm.run(["scancel", "--user=root"], check=False)
        for node in slurm.nodes:  # every node back to idle, without a planted fault
            slurm.restore_shm(node)
            if slurm.node_info(node)["state"] != "IDLE":
                slurm.resume(node)
        slurm.wait_idle(slurm.nodes)

    return _up, _per_test


slurm_up, slurm = make_slurm_fixtures()
