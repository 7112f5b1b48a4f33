"""Reaching nodes: an SSH connection per node (paramiko), with a deadline on every step.

A node is asked to run a stdlib Python program that is shipped over the connection: the remote
command is fixed (the interpreter's path, quoted, and a constant bootstrap), and everything else,
the program and its options, travels on stdin. Nothing a user typed is ever part of a shell command
unquoted.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

# Reads a length line, that many bytes of source, one line of JSON options, then runs the source. It
# reads fd 0 unbuffered, so that what follows (the agent's requests) is left for the agent to read.
BOOTSTRAP = (
    "import os,json\n"
    "def line():\n"
    " b=b''\n"
    " while not b.endswith(b'\\n'):\n"
    "  c=os.read(0,1)\n"
    "  if not c:break\n"
    "  b+=c\n"
    " return b\n"
    "n=int(line());s=b''\n"
    "while len(s)<n:\n"
    " c=os.read(0,n-len(s))\n"
    " if not c:break\n"
    " s+=c\n"
    "exec(compile(s,'preflight-shipped','exec'),{'__name__':'__main__','OPTIONS':json.loads(line())})"
)

# paramiko logs tracebacks of failed handshakes at ERROR: they are our results, not the user's terminal's.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False
logging.getLogger("paramiko").setLevel(logging.CRITICAL + 1)


class NodeError(Exception):
    """Why a node could not be reached or could not run the program: kind, message, remediation."""

    def __init__(self, kind: str, message: str, remediation: str):
        super().__init__(message)
        self.kind, self.message, self.remediation = kind, message, remediation


def shipped_command(python: str) -> str:
    return f"exec {shlex.quote(python)} -u -c {shlex.quote(BOOTSTRAP)}"


def shipped_input(source: str, options: dict) -> str:
    return f"{len(source.encode())}\n{source}{json.dumps(options)}\n"


@dataclass
class SSHSettings:
    """One host's settings, from ssh_config and the command line."""

    alias: str
    hostname: str
    port: int = 22
    user: Optional[str] = None
    identity_files: List[str] = field(default_factory=list)
    known_hosts_files: List[str] = field(default_factory=list)
    strict_host_key_checking: str = "yes"
    proxy_jump: Optional[str] = None
    connect_timeout: Optional[float] = None


def load_ssh_settings(alias: str, config_path: Optional[str]) -> SSHSettings:
    import paramiko

    config = paramiko.SSHConfig()
    path = config_path or os.path.expanduser("~/.ssh/config")
    if os.path.isfile(path):
        config = paramiko.SSHConfig.from_path(path)
    entry = config.lookup(alias)
    known = entry.get("userknownhostsfile")
    known_files = (known.split() if isinstance(known, str) else list(known or [])) or ["~/.ssh/known_hosts"]
    identities = entry.get("identityfile") or []
    return SSHSettings(
        alias=alias,
        hostname=entry.get("hostname", alias),
        port=int(entry.get("port", 22)),
        user=entry.get("user") or _current_user(),
        identity_files=[os.path.expanduser(p) for p in identities],
        known_hosts_files=[os.path.expanduser(p) for p in known_files],
        strict_host_key_checking=str(entry.get("stricthostkeychecking", "yes")).lower(),
        proxy_jump=entry.get("proxyjump") if entry.get("proxyjump", "none") != "none" else None,
        connect_timeout=float(entry["connecttimeout"]) if "connecttimeout" in entry else None,
    )


def _current_user() -> str:
    import getpass

    return getpass.getuser()


class SSHConnection:
    """One authenticated SSH connection, reused for every phase of a run."""

    def __init__(self, settings: SSHSettings, timeout: float, accept_new: bool = False,
                 ssh_config: Optional[str] = None):
        self.settings, self.timeout, self.accept_new, self.ssh_config = settings, timeout, accept_new, ssh_config
        self.transport = None
        self._jump: Optional["SSHConnection"] = None

    # -- connecting ------------------------------------------------------------------------------
    def connect(self) -> "SSHConnection":
        import paramiko

        s = self.settings
        timeout = min(self.timeout, s.connect_timeout or self.timeout)
        where = f"{s.hostname}:{s.port}"
        sock = self._open_socket(timeout, where)
        try:
            transport = paramiko.Transport(sock)
            transport.banner_timeout = transport.handshake_timeout = transport.auth_timeout = self.timeout
            try:
                transport.start_client(timeout=self.timeout)
            except paramiko.SSHException as exc:
                if "banner" in str(exc).lower() or isinstance(exc, EOFError):
                    raise NodeError("no-banner", f"{where} accepted the connection but sent no SSH banner within "
                                    f"{self.timeout:g} s", "the sshd is hung or stopped (SIGSTOP), or the port is "
                                    "not SSH: check `systemctl status ssh` on the node") from None
                raise NodeError("handshake", f"SSH handshake with {where} failed: {exc}",
                                "check the node's sshd and its logs") from None
            except (EOFError, OSError) as exc:
                raise NodeError("no-banner", f"{where} closed or stalled the connection before the SSH banner "
                                f"({type(exc).__name__})", "check the node's sshd and its logs") from None
            # start_client returns quietly at its timeout: find out how far the handshake got.
            if not transport.remote_version:
                raise NodeError("no-banner", f"{where} accepted the connection but sent no SSH banner within "
                                f"{self.timeout:g} s", "the sshd is hung or stopped (SIGSTOP), or the machine is "
                                "overloaded: check sshd on the node")
            if transport.host_key is None:
                raise NodeError("handshake", f"the SSH key exchange with {where} did not finish within "
                                f"{self.timeout:g} s", "check the node's sshd and its load")
            self.transport = transport
            self._verify_host_key(transport.get_remote_server_key())
            self._authenticate(transport)
        except BaseException:
            self.close()
            sock.close()
            raise
        return self

    def _open_socket(self, timeout: float, where: str):
        s = self.settings
        if s.proxy_jump:
            jump_alias = s.proxy_jump.split(",")[0].strip()
            jump_alias = jump_alias.split("@")[-1]
            try:
                self._jump = SSHConnection(load_ssh_settings(jump_alias, self.ssh_config), self.timeout,
                                           self.accept_new, self.ssh_config).connect()
                return self._jump.transport.open_channel("direct-tcpip", (s.hostname, s.port), ("", 0),
                                                          timeout=timeout)
            except NodeError as exc:
                raise NodeError(exc.kind, f"through ProxyJump {jump_alias}: {exc.message}", exc.remediation) from None
            except Exception as exc:
                raise NodeError("refused", f"ProxyJump {jump_alias} could not reach {where}: {exc}",
                                "check that the jump host can reach the node") from None
        try:
            return socket.create_connection((s.hostname, s.port), timeout=timeout)
        except socket.gaierror:
            raise NodeError("unresolved", f"the name {s.hostname!r} does not resolve",
                            "correct the host name, or add it to DNS, /etc/hosts or ~/.ssh/config (HostName)") from None
        except ConnectionRefusedError:
            raise NodeError("refused", f"{where} refused the connection",
                            "start sshd on the node, or correct the port (Port in ~/.ssh/config)") from None
        except (socket.timeout, TimeoutError):
            raise NodeError("timeout", f"{where} did not answer within {timeout:g} s",
                            "the node is down, or a firewall drops SSH; check the address and the network") from None
        except OSError as exc:
            raise NodeError("unreachable", f"{where}: {exc.strerror or exc}",
                            "check the address and the network route to the node") from None

    def _verify_host_key(self, key) -> None:
        import paramiko

        s = self.settings
        hosts = paramiko.HostKeys()
        for path in s.known_hosts_files:
            if os.path.isfile(path):
                try:
                    hosts.load(path)
                except Exception as exc:
                    raise NodeError("host-key", f"cannot read known_hosts file {path}: {exc}",
                                    f"fix or remove {path}") from None
        names = [s.hostname if s.port == 22 else f"[{s.hostname}]:{s.port}"]
        if s.alias != s.hostname:
            names.append(s.alias if s.port == 22 else f"[{s.alias}]:{s.port}")
        known = [hosts.lookup(n) for n in names]
        known = [k for k in known if k]
        matching = [k for k in known if key.get_name() in k]
        if any(k[key.get_name()] == key for k in matching):
            return
        fingerprint = key.fingerprint if hasattr(key, "fingerprint") else key.get_name()
        if matching:
            raise NodeError("host-key-changed", f"the host key of {names[0]} CHANGED (now {fingerprint}); "
                            "this can be a man-in-the-middle or a reinstalled node",
                            f"if the node was reinstalled: ssh-keygen -R {shlex.quote(names[0])}, then reconnect once")
        if s.strict_host_key_checking == "no" or self.accept_new or s.strict_host_key_checking == "accept-new":
            self._remember(names, key)
            return
        raise NodeError("host-key-unknown", f"the host key of {names[0]} is not in known_hosts ({fingerprint})",
                        "connect once with `ssh` to verify and accept it, or pass --ssh-accept-new to trust new keys")

    def _remember(self, names, key) -> None:
        path = self.settings.known_hosts_files[0]
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "a") as handle:
                handle.write(f"{names[0]} {key.get_name()} {key.get_base64()}\n")
        except OSError:
            pass  # trusting it for this run is what was asked; saving is a courtesy

    def _authenticate(self, transport) -> None:
        import paramiko

        s = self.settings
        tried = []
        keys = []
        try:
            keys.extend(paramiko.Agent().get_keys())
        except Exception:
            pass
        files = s.identity_files or [os.path.expanduser(f"~/.ssh/{n}") for n in ("id_ed25519", "id_ecdsa", "id_rsa")]
        for path in files:
            if not os.path.isfile(path):
                continue
            try:
                keys.append(paramiko.PKey.from_path(path))
            except paramiko.PasswordRequiredException:
                tried.append(f"{path} (encrypted: load it into ssh-agent)")
            except Exception as exc:
                tried.append(f"{path} ({exc})")
        for key in keys:
            try:
                transport.auth_publickey(s.user, key)
                if transport.is_authenticated():
                    return
            except paramiko.AuthenticationException:
                tried.append(key.get_name())
            except paramiko.SSHException as exc:
                raise NodeError("auth", f"authentication as {s.user} stalled or failed: {exc}",
                                "check the node's sshd") from None
        raise NodeError("auth", f"key authentication as {s.user!r} failed (tried: {', '.join(tried) or 'no keys'})",
                        f"install your public key in ~{s.user}/.ssh/authorized_keys on the node, or set "
                        "IdentityFile in ~/.ssh/config; preflight never prompts for a password")

    # -- running ---------------------------------------------------------------------------------
    def start(self, command: str, stdin_text: str) -> "RemoteProcess":
        channel = self.transport.open_session(timeout=self.timeout)
        channel.settimeout(self.timeout)
        channel.exec_command(command)
        channel.sendall(stdin_text.encode())
        return RemoteProcess(channel)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self._jump is not None:
            self._jump.close()
            self._jump = None


class LineReader:
    """Lines out of a node's program, each read with a deadline. A subclass says how bytes arrive:
    `_receive(seconds)` gives bytes, b"" at the end of output, or None when nothing came in time."""

    _buffer = b""

    def _receive(self, seconds: float) -> Optional[bytes]:
        raise NotImplementedError

    def read_line(self, timeout: float) -> Optional[str]:
        """The next line, or None at end of output; NodeError past the deadline."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeError("timeout", f"no answer within {timeout:g} s", "the node is overloaded or hung")
            chunk = self._receive(left)
            if chunk is None:
                continue
            if not chunk:
                line, self._buffer = self._buffer, b""
                return line.decode(errors="replace") if line else None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(errors="replace")


class RemoteProcess(LineReader):
    """A program running on a node over SSH: lines in, lines out."""

    def __init__(self, channel):
        self.channel = channel

    def send_line(self, text: str) -> None:
        self.channel.sendall((text + "\n").encode())

    def _receive(self, seconds: float) -> Optional[bytes]:
        self.channel.settimeout(seconds)
        try:
            return self.channel.recv(65536)
        except socket.timeout:
            return None

    def stderr_tail(self, limit: int = 2000) -> str:
        data = b""
        while self.channel.recv_stderr_ready():
            data += self.channel.recv_stderr(65536)
        return data.decode(errors="replace")[-limit:]

    def exit_status(self, timeout: float) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while not self.channel.exit_status_ready():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return self.channel.recv_exit_status()

    def close(self) -> None:
        try:
            self.channel.shutdown_write()
        except Exception:
            pass
        self.channel.close()


def run_with_deadline(func, timeout: float):
    """Run func() in a thread; NodeError if it has not returned in time (the thread is abandoned)."""
    result: dict = {}

    def target():
        try:
            result["value"] = func()
        except BaseException as exc:  # carried over to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise NodeError("timeout", f"no answer within {timeout:g} s", "the node is hung or overloaded")
    if "error" in result:
        raise result["error"]
    return result.get("value")
