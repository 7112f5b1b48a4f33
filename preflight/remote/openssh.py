"""The SSH transport by the system's OpenSSH client, the default where `ssh` is installed: a node is reached
exactly when `ssh NODE true` reaches it, since ssh itself reads the config (Include, Match, ProxyCommand,
ProxyJump, CanonicalizeHostname), verifies the host (known_hosts, @cert-authority, KnownHostsCommand) and
authenticates (agent, certificates, PKCS#11/FIDO keys, GSSAPI, hostbased), as pdsh -R ssh, ClusterShell and
DeepSpeed's runner do.

One connection per node: the first program a node runs (the agent, or the launched job) is the master
(`ssh -M -S SOCKET`, ControlPersist=no, its socket in a private folder preflight removes), and every later
one (the all-reduce) runs in a session of its own multiplexed over it, as ssh falls back to a connection of
its own when the master has gone. Where the user's own ssh keeps a master to the node (ControlPersist), every
program is a session of that one instead, as `ssh NODE true` would be. So a node costs what `ssh NODE CMD` costs, one process and one session, as
with pdsh. Ending a program's ssh ends its session: sshd closes its input, and the node's keeper
(preflight.remote.shipping) ends the program; nothing stays behind on either side. What ssh says (-v on the
master: its stages and its error) names why a node could not be reached, in SSH001's classes.
"""
from __future__ import annotations

import atexit
import functools
import glob
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import List, Optional

from preflight.remote.local import LocalProcess
from preflight.remote.session import NodeError

MAX_PROXIES = 8  # ProxyJump through more hops than this (a `Host *` that matches its own jump host) is a loop
LOG_HEAD = 64 << 10  # the start of ssh's -v output kept on the master: its stages (and the last 8 KiB)
STARTED = b"preflight-session-started"  # the line a launched command's shell prints first
NOT_STARTED = "the sshd or the machine is hung or overloaded: check the node's sshd and its logs"
_CONTROL_DIR_MAX = 60  # a unix socket path has 108 bytes, ssh adds a 17-byte suffix while it binds


def available() -> bool:
    return shutil.which("ssh") is not None


def base_argv(ssh_config: Optional[str], accept_new: bool, timeout: float) -> List[str]:
    """ssh with the run's options: the run's deadline for the TCP connection and the banner (ssh's ConnectTimeout
    covers both), the unknown keys trusted only when asked; never a prompt (no_prompt_environment)."""
    argv = [shutil.which("ssh") or "ssh"]
    if ssh_config:
        argv += ["-F", ssh_config]
    argv += ["-o", f"ConnectTimeout={max(1, math.ceil(timeout))}"]
    if accept_new:
        argv += ["-o", "StrictHostKeyChecking=accept-new"]
    if not _sets_key_exchange(ssh_config):
        argv += ["-o", FAST_KEX]
    return argv


def no_prompt_environment() -> dict:
    """The environment of every ssh preflight starts: each prompt it would show (a passphrase, a PIN, a password,
    a host key to confirm) goes to SSH_ASKPASS, which answers nothing (SSH_ASKPASS_REQUIRE=force, OpenSSH 8.4+);
    an older ssh finds no terminal to ask on (each runs in a session of its own) and asks SSH_ASKPASS only where
    DISPLAY is set. Not BatchMode: in batch mode ssh lists no key of a PKCS#11 token that needs a PIN ("pin
    required", ssh-pkcs11.c), so with IdentitiesOnly it would not offer the agent's copy of that key, which
    `ssh NODE true` uses without a prompt. A BatchMode line of the user's own config is left as it is."""
    return dict(os.environ, SSH_ASKPASS=shutil.which("false") or "/bin/false", SSH_ASKPASS_REQUIRE="force")


# OpenSSH 9 prefers the post-quantum sntrup761x25519 exchange: 140 ms of the client's CPU per connection (measured:
# `ssh NODE true` 0.30 s against 0.15 s), most of a one-node run and 7 s of CPU at 96 nodes. curve25519 first,
# ssh's own list after it, where the config says nothing of KexAlgorithms (a site's own list is left as it is).
FAST_KEX = "KexAlgorithms=^curve25519-sha256"


@functools.lru_cache(maxsize=None)
def _config_keywords(ssh_config: Optional[str]) -> frozenset:
    """The keywords (lower case) of the config ssh reads (-F's file alone, else ~/.ssh/config and
    /etc/ssh/ssh_config), with the files its Include lines name; ALL_KEYWORDS where a file cannot be read through
    (Include past 8 levels): whether a line could set a keyword, read once per config, without a process."""
    found, pending = set(), [(ssh_config, 0)] if ssh_config else [(os.path.expanduser("~/.ssh/config"), 0),
                                                                  ("/etc/ssh/ssh_config", 0)]
    while pending:
        path, depth = pending.pop()
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read(1 << 20)
        except OSError:
            continue
        for line in text.splitlines():
            words = line.strip().replace("=", " ", 1).split()
            if not words or words[0].startswith("#"):
                continue
            found.add(words[0].lower())
            if words[0].lower() != "include":
                continue
            if depth >= 8:
                return ALL_KEYWORDS
            base = os.path.dirname(path) if path.startswith("/etc/") else os.path.expanduser("~/.ssh")
            for pattern in words[1:]:  # relative to ~/.ssh for a user's file, /etc/ssh for the system's (ssh_config(5))
                matched = glob.glob(os.path.join(base, os.path.expanduser(pattern)))
                pending += [(name, depth + 1) for name in sorted(matched)[:256]]
    return frozenset(found)


class _Everything(frozenset):
    def __contains__(self, keyword) -> bool:
        return True


ALL_KEYWORDS = _Everything()


def _sets_key_exchange(ssh_config: Optional[str]) -> bool:
    return "kexalgorithms" in _config_keywords(ssh_config)


def _ssh_G(ssh_config: Optional[str], host: str, timeout: float):
    """(exit code, stdout, stderr) of `ssh -G [-F FILE] HOST`, ssh's own reading of the config (Include, Match,
    canonicalization); None where no ssh is here or it did not answer in time. Its own session: a `Match exec`
    command that hangs is ended with ssh, not left holding the pipes."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return None
    try:
        proc = subprocess.Popen([ssh, *(["-F", ssh_config] if ssh_config else []), "-G", "--", host],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError:
        return None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        return None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def settings(alias: str, ssh_config: Optional[str], timeout: float = 10.0) -> dict:
    """What ssh makes of `alias`, keys in lower case (the last value of a repeated key); {} when ssh cannot say."""
    answer = _ssh_G(ssh_config, alias, timeout)
    if answer is None or answer[0] != 0:
        return {}
    return dict(line.partition(" ")[::2] for line in answer[1].splitlines())


def refused_config(path: str, host: str, timeout: float = 10.0) -> Optional[str]:
    """What OpenSSH says of an ssh_config it refuses (a bad value anywhere in the file stops it), or None where
    it takes the file, or no `ssh` is here, or it did not answer in time (the run's steps are bounded anyway)."""
    answer = _ssh_G(path, host, timeout)
    if answer is None or answer[0] == 0:
        return None
    said = [line.strip() for line in answer[2].splitlines() if line.strip()]
    return "; ".join(said[:3])[:500] or f"ssh -G exited {answer[0]}"


_FOLDERS: set = set()  # the control folders of this process, removed at its exit whatever was left open


def _control_folder() -> str:
    base = tempfile.gettempdir()
    base = base if len(base) <= _CONTROL_DIR_MAX else "/tmp"
    with _SWEEP:
        if not _SWEPT:
            _SWEPT.append(_sweep(base))
    folder = tempfile.mkdtemp(prefix=f"preflight-ssh-{os.getpid()}-", dir=base)
    _FOLDERS.add(folder)
    return folder


_SWEEP, _SWEPT = threading.Lock(), []


def _sweep(base: str) -> int:
    """Removes the control folders that runs of preflight ended by SIGKILL left here (theirs, by this user,
    whose process is gone); the number removed."""
    removed = 0
    try:
        names = [n for n in os.listdir(base) if n.startswith("preflight-ssh-")]
    except OSError:
        return 0
    for name in names:
        pid = name.split("-")[2]
        path = os.path.join(base, name)
        try:
            if not pid.isdigit() or os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        except OSError:  # alive under another user, or not ours to judge
            continue
    return removed


@atexit.register
def _remove_folders() -> None:
    for folder in list(_FOLDERS):
        shutil.rmtree(folder, ignore_errors=True)


# ssh's own words (OpenSSH 7-9: sshconnect.c, ssh.c, clientloop.c) -> SSH001's class and what to do
_SAID = [
    (r"Could not resolve hostname", "unresolved",
     "correct the host name, or add it to DNS, /etc/hosts or ssh_config (HostName)"),
    (r"REMOTE HOST IDENTIFICATION HAS CHANGED|Host key for .* has changed|HOST KEY HAS CHANGED", "host-key-changed",
     "if the node was reinstalled: ssh-keygen -R {host}, then reconnect once"),
    (r"host key is known for|Host key verification failed|No matching host key|certificate .*(invalid|not valid)",
     "host-key-unknown", "connect once with `{ssh}` to verify and accept it, or pass --ssh-accept-new to "
     "trust new keys"),
    (r"Too many authentication failures", "auth", "sshd closed after too many keys (MaxAuthTries): set "
     "IdentitiesOnly yes and IdentityFile in ssh_config"),
    (r"Permission denied \(", "auth", "install your public key in ~{user}/.ssh/authorized_keys on the node, or set "
     "IdentityFile in ssh_config; preflight never prompts for a password"),
    (r"timed out during banner exchange", "no-banner", "the sshd is hung or stopped (SIGSTOP), or the port is not "
     "SSH: check `systemctl status ssh` on the node"),
    (r"open failed|stdio forwarding failed", "unreachable",
     "check that the jump host can reach the next hop, and that its sshd allows TCP forwarding"),
    (r"Connection refused", "refused", "start sshd on the node, or correct the port (Port in ssh_config)"),
    (r"Connection timed out|Operation timed out", "timeout",
     "the node is down, or a firewall drops SSH; check the address and the network"),
    (r"No route to host|Network is unreachable", "unreachable", "check the address and the network route to the node"),
    (r"kex_exchange_identification|Connection (closed|reset) by", "closed",
     "sshd closed the connection at once: MaxStartups reached (too many connections still authenticating), a "
     "TCP wrapper (/etc/hosts.deny) or sshd's rules refusing this host, or sshd failing before it speaks "
     "(no /run/sshd); its log on the node says which (journalctl -u ssh)"),
    (r"Bad configuration option|Unsupported option|missing argument|unsupported|[Bb]ad .*specification|"
     r"terminating, \d+ bad configuration options", "config", "correct ssh_config: ssh refuses it"),
]
_SAID = [(re.compile(pattern), kind, remedy) for pattern, kind, remedy in _SAID]
_NOISE = re.compile(r"^(debug\d|OpenSSH_|Authenticated to |Transferred: |Bytes per second|Warning: Permanently "
                    r"added)")


def _said(log: str) -> List[str]:
    """ssh's own messages, without its -v stages."""
    return [line.strip() for line in log.splitlines() if line.strip() and not _NOISE.match(line.strip())]


def _proxy(log: str) -> Optional[str]:
    """The proxy the connection went through, from ssh -v: ProxyJump's hop list (the first implicit command,
    `ssh -J a -W ... b` for `ProxyJump a,b`), or a ProxyCommand."""
    m = re.search(r"Setting implicit ProxyCommand from ProxyJump: .*?(?:-J (\S+) .*?)?-W \S+ (\S+)\s*$", log, re.M)
    if m:
        return "ProxyJump " + ",".join(h for h in m.groups() if h)
    m = re.search(r"Executing proxy command: (?:exec )?(.+)", log)
    return f"ProxyCommand `{m.group(1).strip()[:120]}`" if m else None


def _last_hop(log: str) -> Optional[str]:
    """The innermost jump host and what it was asked to reach (`HOP could not connect to ADDR:PORT`)."""
    hops = re.findall(r"Executing proxy command: exec \S*ssh .*?-W '?\[?([^\]' ]+)\]?:(\d+)'? (\S+)\s*$", log, re.M)
    return f"{hops[-1][2]} could not connect to {hops[-1][0]}:{hops[-1][1]}" if hops else None


def _looping(log: str) -> bool:
    return log.count("Setting implicit ProxyCommand from ProxyJump") > MAX_PROXIES


def _failure(alias: str, log: str, status: Optional[int], elapsed: float, timeout: float,
             ssh_config: Optional[str] = None) -> NodeError:
    """Why ssh did not connect to `alias`: in its own words where it ended with some (status: its exit code),
    else by the stage its -v lines show it had reached when preflight's deadline passed (status None)."""
    address = re.search(r"^debug1: Connecting to \S+ \[([^\]]+)\] port (\d+)", log, re.M)
    where = f"{address.group(1)}:{address.group(2)}" if address else alias
    user = re.search(r"Authenticating to \S+ as '([^']*)'", log)
    proxy = _proxy(log)
    via = f"through {proxy}: " if proxy else ""
    jumps = re.findall(r"Setting implicit ProxyCommand from ProxyJump: .* (\S+)\s*$", log, re.M)
    if len(jumps) > MAX_PROXIES:
        loop = max(set(jumps), key=jumps.count)
        return NodeError("unreachable", f"ProxyJump {jumps[0]} for {alias} loops back to {loop}: ssh would start "
                         "ssh after ssh", f"exclude the jump host from the pattern that sets ProxyJump "
                         f"(Host * !{loop}), or give it `ProxyJump none`")
    said = _said(log)
    by_hand = "ssh " + (f"-F {shlex.quote(ssh_config)} " if ssh_config else "") + alias
    verbose = by_hand.replace("ssh ", "ssh -v ", 1)
    if status is not None:
        for line in said:
            for pattern, kind, remedy in _SAID:
                if not pattern.search(line):
                    continue
                ip, _, port = where.rpartition(":")
                remedy = remedy.format(host=shlex.quote(ip if port == "22" else f"[{ip}]:{port}"), ssh=by_hand,
                                       user=user.group(1) if user else "USER")
                if kind == "host-key-changed":
                    offending = [x for x in said if x.startswith("Offending")]
                    return NodeError(kind, f"{alias}: {via}the host key of {where} CHANGED; this can be a "
                                     f"man-in-the-middle or a reinstalled node ({'; '.join(offending[:1]) or line})",
                                     remedy)
                if kind == "no-banner" and proxy:
                    return NodeError(kind, f"{alias}: no SSH banner through {proxy} within {timeout:g} s "
                                     f"({line[:200]})", f"check the proxy with `{verbose} true`")
                if kind == "no-banner":
                    return NodeError(kind, f"{where} accepted the connection but sent no SSH banner within "
                                     f"{timeout:g} s ({line[:200]})", remedy)
                if kind == "closed" and not proxy:
                    return NodeError(kind, f"{where} closed the connection before its SSH banner, {elapsed:.2f} s "
                                     f"after ssh started ({line[:200]})", remedy)
                if kind == "unreachable" and proxy:
                    line = f"{_last_hop(log) or 'a hop'} ({line[:200]})"
                return NodeError(kind, f"{alias}: {via}{line[:400]}", remedy)
        return NodeError("protocol", f"{alias}: {via}ssh exited {status}"
                         f"{': ' + '; '.join(said[-3:])[:400] if said else ' and said nothing'}",
                         f"run `{verbose} true` and read where it stops")
    t = f"{timeout:g} s"
    if "Remote protocol version" not in log:
        if proxy:
            return NodeError("timeout", f"{alias}: no SSH banner {via.rstrip(': ')} within {t}",
                             f"check the proxy with `{verbose} true`")
        if "Connection established" not in log:
            return NodeError("timeout", f"{where} did not answer within {t}",
                             "the node is down, or a firewall drops SSH; check the address and the network")
        return NodeError("no-banner", f"{where} accepted the connection but sent no SSH banner within {t}",
                         "the sshd is hung or stopped (SIGSTOP), or the port is not SSH: check `systemctl status "
                         "ssh` on the node")
    banner = re.search(r"remote software version (\S+)", log)
    if "SSH2_MSG_KEXINIT received" not in log:
        return NodeError("handshake", f"{via}{where} sent its SSH banner (SSH-2.0-{banner.group(1) if banner else '?'})"
                         f" and then nothing for {t}: the key exchange never started", "sshd is stuck after accepting "
                         "(overloaded, or hung in DNS or PAM), or the path drops larger packets (an MTU mismatch): "
                         "check sshd's log and `ping -M do -s 1472`")
    if "SSH2_MSG_NEWKEYS received" not in log:
        return NodeError("handshake", f"{via}the SSH key exchange with {where} did not finish within {t}",
                         "check the node's sshd and its load")
    # through a proxy, the hops' own ssh say "Authenticated to" too; this host's line says "(via proxy)"
    if re.search(r"^Authenticated to .*\(via proxy\)" if proxy else r"^Authenticated to ", log, re.M):
        return NodeError("timeout", f"{via}the node's sshd did not start the program within {t} (no answer to the "
                         "session or exec request)", NOT_STARTED)
    return NodeError("auth", f"{via}authentication to {where} did not finish within {t}",
                     "sshd or its PAM/GSSAPI/LDAP lookups hang: check the node's sshd log")


class ReachError(NodeError):
    """ssh did not reach the node (its connection, not the program, failed or stalled)."""


class OpenSSHConnection:
    """One node reached by the system's ssh; start() and open_command() run a program in a session of its own,
    the first one as the master that the later ones share."""

    def __init__(self, alias: str, timeout: float, accept_new: bool = False, ssh_config: Optional[str] = None):
        self.alias, self.timeout, self.ssh_config = alias, timeout, ssh_config
        self.argv = base_argv(ssh_config, accept_new, timeout)
        self.folder: Optional[str] = None
        self.processes: list = []  # SessionProcess and ProcessChannel, to close
        self._lock = threading.Lock()
        self._mastered = False  # a master has been started (it may have ended since)
        self.users_master = False  # the user's own master connection serves every program

    def connect(self, handshaken=None, wait: bool = False) -> "OpenSSHConnection":
        """Ready to run programs; the connection itself is made by the first one (its failure is that
        program's, in ssh's words: ReachError). handshaken is called at once: ssh's key exchange runs in its
        own process, and the head's start-up need not wait for it. wait: connected now, by a master whose own
        program only waits for the end of its input (`launch` starts no node's job before every node is
        reached; that program ends with preflight, however preflight ends)."""
        self.folder = _control_folder()
        self.users_master = self._users_master()
        if handshaken is not None:
            handshaken()
        if wait:
            try:
                self.start("exec cat >/dev/null", "").begin(self.timeout + 1)
            except BaseException:
                self.close()
                raise
        return self

    def _users_master(self) -> bool:
        """Whether the user's own ssh keeps a master connection to this node (ControlMaster, ControlPath and
        ControlPersist in their config): `ssh NODE true` then runs over it without a new authentication (a login
        made once, with a one-time password or a touch), and so do preflight's programs, as sessions of that
        master, which stays the user's. Asked of ssh itself (`ssh -O check`), only where a ControlPath line is."""
        if "controlpath" not in _config_keywords(self.ssh_config):
            return False
        argv = [self.argv[0], *(["-F", self.ssh_config] if self.ssh_config else []), "-O", "check", "--", self.alias]
        try:
            return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True, env=no_prompt_environment(),
                                  timeout=min(self.timeout, 5)).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _spawn(self, command, pty: bool = False, verbose: bool = True):
        """(the ssh process running `command` on the node, whether it is the first: the master, or over the
        user's own master the session whose -v output says why the node was not reached)."""
        with self._lock:
            if self.folder is None:
                raise NodeError("protocol", f"the connection to {self.alias} is closed", "run preflight again")
            master, self._mastered = not self._mastered, True
            # -v: its stages and errors say why a node was not reached; not on a job's terminal. Later ones: LogLevel
            # ERROR, not ssh's "Connection to X closed." of a terminal session on the job's output
            how = (["-v"] if verbose else ["-o", "LogLevel=ERROR"]) if master else ["-o", "LogLevel=ERROR"]
            if self.users_master:  # its ControlPath, from the config; ssh connects by itself if that master is gone
                how += ["-o", "ControlMaster=no"]
            elif master:
                how += ["-o", "ControlMaster=yes", "-o", "ControlPersist=no", "-S", os.path.join(self.folder, "c")]
            else:
                how += ["-o", "ControlMaster=no", "-S", os.path.join(self.folder, "c")]
            argv = self.argv + how + ["-tt" if pty else "-T", "--", self.alias, command]
            try:
                return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True, env=no_prompt_environment()), master
            except OSError as exc:
                raise NodeError("ssh", f"cannot run {argv[0]}: {exc.strerror or exc}",
                                "install the OpenSSH client, or pass --ssh paramiko") from None

    def start(self, command: str, stdin_text: str, timeout: Optional[float] = None) -> "SessionProcess":
        timeout = self.timeout if timeout is None else timeout
        proc, master = self._spawn(f"echo {STARTED.decode()} && {command}")
        process = SessionProcess(proc, self, master)
        self.processes.append(process)
        try:  # ssh takes its input only once the node's sshd has opened the session
            process.send_raw(stdin_text.encode(), timeout)
        except NodeError:
            process.unreached(None)
        return process

    def open_command(self, command, timeout: Optional[float] = None, pty: bool = False) -> "ProcessChannel":
        """A program whose output is read as a channel's (preflight.gate.launcher), in a terminal with pty:
        started once its first line, a mark the shell there prints before it, has come back (within the
        timeout: a sshd that never answers the exec request costs this node, not the run)."""
        timeout = self.timeout if timeout is None else timeout
        command = command if isinstance(command, bytes) else command.encode()
        proc, _ = self._spawn(b"echo " + STARTED + b" && " + command, pty, verbose=False)
        channel = ProcessChannel(proc, self.alias, self.ssh_config)
        self.processes.append(channel)
        try:
            channel.wait_for(STARTED, timeout)
        except BaseException:
            channel.close()
            raise
        return channel

    def close(self) -> None:
        """Every session (the master last), then the private folder; idempotent, from any thread."""
        with self._lock:
            processes, self.processes = self.processes, []
            folder, self.folder = self.folder, None
        for process in reversed(processes):
            process.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
            _FOLDERS.discard(folder)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """ssh's process group (its own session: a ProxyCommand's processes with it), also once ssh has ended: ssh ends
    its ProxyCommand with SIGHUP alone (sshconnect.c, kill_proxy_command), which a command started under nohup
    ignores, and it would outlive the run."""
    if proc.poll() is None or _orphaned_group(proc.pid):
        try:
            os.killpg(proc.pid, signum)
        except OSError:
            pass


def _orphaned_group(pgid: int) -> bool:
    """Whether the process group `pgid` still has members after its leader (a child already reaped) ended: no
    process has that pid, yet the group exists. The kernel gives no new process a pid that a group still holds
    as its id, so such a group is the leader's own; a process of that pid is another's, never signalled."""
    try:
        os.kill(pgid, 0)
        return False  # a process of that pid: not ours (ours was reaped)
    except PermissionError:
        return False
    except OSError:
        pass
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False


class SessionProcess(LocalProcess):
    """A program on the node in a session of its own; the master's also says why the node was not reached."""

    def __init__(self, proc: subprocess.Popen, connection: OpenSSHConnection, master: bool):
        self.connection, self.master, self._head = connection, master, bytearray()
        self.begun, self.started = False, time.monotonic()  # begun: the mark came back, the program runs
        super().__init__(proc, ("", ""))

    def _drain_stderr(self) -> None:
        """The first LOG_HEAD bytes (ssh's stages, on the master) and the last 8 KiB, whatever a node sends."""
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            room = LOG_HEAD - len(self._head)
            if room > 0:
                self._head += chunk[:room]
                chunk = chunk[room:]
                if self.master and _looping(self._head.decode(errors="replace")):
                    _kill_group(self.proc)  # ssh would start ssh after ssh, one more every few milliseconds
            self._stderr += chunk
            del self._stderr[:-8192]

    def log(self, wait: float = 0.0) -> str:
        self._reader.join(wait)
        return (bytes(self._head) + bytes(self._stderr)).decode(errors="replace")

    def stderr_tail(self, limit: int = 2000) -> str:
        """What the program wrote on stderr, without ssh's own -v lines."""
        return "\n".join(line for line in self.log().splitlines() if not _NOISE.match(line.strip()))[-limit:]

    def unreached(self, status: Optional[int]) -> None:
        """ReachError: the program never began (its mark never came back), in ssh's words where it ended
        (status: its exit), else by the stage ssh had reached (None: preflight's deadline passed, ssh is ended)."""
        if status is None:
            _kill_group(self.proc)
        elif 0 <= status != 255:  # ssh's own failures are 255 (or it was ended); anything else is the node's shell
            return
        error = _failure(self.connection.alias, self.log(wait=1.0), status, time.monotonic() - self.started,
                         self.connection.timeout, self.connection.ssh_config)
        raise ReachError(error.kind, error.message, error.remediation)

    def _line(self, deadline: float) -> Optional[str]:
        """The next line as it comes; before the mark, ssh's failure to get there is a ReachError."""
        try:
            line = super().read_line(max(0.0, deadline - time.monotonic()))
        except NodeError as exc:
            if exc.kind == "timeout" and not self.begun:
                self.unreached(None)
            raise
        if line is None and not self.begun:
            self.unreached(self.exit_status(2))
        return line

    def begin(self, timeout: float) -> None:
        """Until the mark has come back: the program runs (ReachError, or a NodeError, otherwise)."""
        deadline = time.monotonic() + timeout
        while not self.begun:
            line = self._line(deadline)
            if line is None:
                raise NodeError("protocol", f"{self.connection.alias}: the session ended before its program began",
                                f"run `ssh {self.connection.alias} true` by hand")
            self.begun = line.strip() == STARTED.decode()

    def read_line(self, timeout: float) -> Optional[str]:
        """The program's next line; before it, the mark its shell printed is taken (and what login scripts
        printed before the mark is the program's too, as it always was)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(deadline)
            if self.begun or line is None:
                return line
            if line.strip() == STARTED.decode():
                self.begun = True
                continue
            return line

    def close(self) -> None:
        """The end of its input, then of its session, at once (the node's keeper ends the program)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        _signal_group(self.proc, signal.SIGTERM)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: a ProxyCommand's processes with it
    except OSError:
        pass
    try:
        proc.wait(2)
    except subprocess.TimeoutExpired:
        pass


class ProcessChannel:
    """An ssh process seen as a paramiko channel, what the launcher reads a node's job through: recv and
    recv_stderr with settimeout's deadline (socket.timeout when idle), the exit status, close."""

    def __init__(self, proc: subprocess.Popen, alias: str, ssh_config: Optional[str]):
        self.proc, self._timeout, self._early = proc, None, b""
        self.alias, self.ssh_config = alias, ssh_config

    def wait_for(self, mark: bytes, timeout: float) -> None:
        """Reads up to the line `mark`, the program's own output kept for recv; NodeError when it does not come
        (the session never started: ssh's own words where it ended)."""
        deadline, seen = time.monotonic() + timeout, b""
        while mark not in seen or b"\n" not in seen[seen.index(mark):]:
            self.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                chunk = self.recv(65536)
            except socket.timeout:
                chunk = None
            if chunk is None:
                raise NodeError("timeout", f"the node's sshd did not start the program within {timeout:g} s (no "
                                "answer to the session or exec request)", NOT_STARTED)
            if not chunk:  # ssh ended first: in its own words
                said = b""
                self.settimeout(1.0)
                try:
                    while len(said) < 65536:
                        more = self.recv_stderr(65536)
                        if not more:
                            break
                        said += more
                except socket.timeout:
                    pass
                status = self.proc.wait()
                raise _failure(self.alias, said.decode(errors="replace"), status, 0.0, timeout, self.ssh_config)
            seen += chunk
            if len(seen) > 65536:
                raise NodeError("protocol", "the node's shell printed more than 64 KiB before the program started",
                                "check the login shell's startup files on the node")
        at = seen.index(mark)
        self._early = seen[seen.index(b"\n", at) + 1:]
        self.settimeout(None)

    def settimeout(self, seconds: Optional[float]) -> None:
        self._timeout = seconds

    def _read(self, stream, size: int) -> bytes:
        import select

        if not select.select([stream], [], [], self._timeout)[0]:
            raise socket.timeout()
        return os.read(stream.fileno(), size)

    def recv(self, size: int) -> bytes:
        if self._early:
            early, self._early = self._early[:size], self._early[size:]
            return early
        return self._read(self.proc.stdout, size)

    def recv_stderr(self, size: int) -> bytes:
        return self._read(self.proc.stderr, size)

    def exit_status_ready(self) -> bool:
        return self.proc.poll() is not None

    def recv_exit_status(self) -> int:
        code = self.proc.wait()
        return code if code >= 0 else -1  # ended by a signal: no status, as a channel without one says

    def close(self) -> None:
        """The session ends: ssh is ended, its multiplexed session closes, and a terminal's job gets SIGHUP."""
        _signal_group(self.proc, signal.SIGTERM)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
