"""The SSH transport by paramiko, where no `ssh` is installed or --ssh paramiko asks (preflight.remote.openssh is
the default): a connection per node, with a deadline on every step; the part of ssh_config it reads honoured.

A node is asked to run a program of preflight.node, shipped over the connection (preflight.remote.shipping):
the remote command is fixed, and the program and its options travel on stdin.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from preflight.remote.session import LineReader, NodeError, run_with_deadline

# paramiko logs tracebacks of failed handshakes at ERROR: they are our results, not the user's terminal's.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False
logging.getLogger("paramiko").setLevel(logging.CRITICAL + 1)


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
    identities_only: bool = False


_IMPORTING = threading.Lock()


def _paramiko():
    """paramiko, without invoke: paramiko.config imports it at once (asyncio, unittest.mock: 50 ms of a one-node
    run) for `Match exec` alone, and raises its ImportError only when such a line is evaluated
    (SSHConfig._does_match); _ssh_config imports it for a config that has one."""
    with _IMPORTING:
        blocked = "paramiko" not in sys.modules and "invoke" not in sys.modules
        if blocked:
            sys.modules["invoke"] = None  # `import invoke` fails at once, and paramiko goes on without it
        try:
            import paramiko

            return paramiko
        finally:
            if blocked:
                del sys.modules["invoke"]


_PARSED: dict = {}
_PARSING = threading.Lock()


def _parsed(parse, *paths: str):
    """parse(*paths), once per version of the files (inode, size, mtime) in this process: every connection reads
    the same ssh_config and known_hosts, and reading them anew for each node grew as N^2 (96 nodes: 0.36 s
    of parsing ssh_config, 1.0 s of known_hosts). The parsed objects are only looked up in afterwards."""
    key = (parse,) + tuple((p, st.st_ino, st.st_size, st.st_mtime_ns) for p, st in ((p, os.stat(p)) for p in paths))
    with _PARSING:
        if key not in _PARSED:
            _PARSED[key] = parse(*paths)
        return _PARSED[key]


MATCH_EXEC = re.compile(r"^[ \t]*match[ \t].*\bexec\b", re.I | re.M)


def _ssh_config(path: str):
    paramiko = _paramiko()
    with open(path, encoding="utf-8", errors="replace") as handle:
        if MATCH_EXEC.search(handle.read()) and paramiko.config.invoke is None:
            try:  # paramiko runs `Match exec` commands through invoke
                paramiko.config.invoke = __import__("invoke")
            except ImportError as exc:
                paramiko.config.invoke_import_error = exc
    return paramiko.SSHConfig.from_path(path)


# What this client reads of ssh_config (load_ssh_settings, _authenticate, _verify_host_key), and lines that do
# not change how a node is reached; any other keyword is one OpenSSH honours and this client does not.
HONOURED = {"host", "match", "hostname", "port", "user", "identityfile", "userknownhostsfile",
            "stricthostkeychecking", "proxyjump", "connecttimeout", "identitiesonly"}
NO_BEARING = {"loglevel", "serveraliveinterval", "serveralivecountmax", "compression", "forwardagent", "forwardx11",
              "forwardx11trusted", "sendenv", "setenv", "addkeystoagent", "hashknownhosts", "tcpkeepalive",
              "visualhostkey", "updatehostkeys", "controlmaster", "controlpath", "controlpersist", "batchmode",
              "requesttty", "localforward", "remoteforward", "dynamicforward", "passwordauthentication",
              "kbdinteractiveauthentication", "challengeresponseauthentication", "pubkeyauthentication",
              "preferredauthentications", "escapechar", "permitlocalcommand", "localcommand", "usekeychain",
              "ciphers", "macs", "kexalgorithms", "hostkeyalgorithms", "pubkeyacceptedkeytypes",
              "pubkeyacceptedalgorithms", "exitonforwardfailure", "gatewayports", "clearallforwardings",
              "numberofpasswordprompts", "rekeylimit", "streamlocalbindunlink", "ipqos", "checkhostip"}


SYSTEM_SSH_CONFIG = "/etc/ssh/ssh_config"


def unhonoured(path: str, read: bool = True) -> List[str]:
    """`FILE line N: Keyword` for each line of an ssh_config that OpenSSH honours and this client does not
    (Include, ProxyCommand, CertificateFile, GSSAPI, hostbased, PKCS#11 ...), and `@cert-authority` lines of the
    known_hosts files it names; [] for a file that is not there. read=False: a file this client never reads (the
    system's), where every line that bears on reaching a node is lost (an Include of no file loses nothing)."""
    found = []
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read(1 << 20).splitlines()
    except OSError:
        return []
    for number, line in enumerate(lines, 1):
        words = line.strip().replace("=", " ", 1).split()
        if not words or words[0].startswith("#"):
            continue
        keyword = words[0].lower()
        off = len(words) > 1 and words[1].lower() in ("no", "none")  # GSSAPIAuthentication no: nothing lost
        lost = keyword not in HONOURED or (not read and keyword not in ("host", "match"))
        if not read and keyword == "include":
            lost = any(glob.glob(os.path.join(os.path.dirname(path), pattern)) for pattern in words[1:])
        if lost and keyword not in NO_BEARING and not off:
            found.append(f"{path} line {number}: {words[0]}")
        if keyword in ("userknownhostsfile", "globalknownhostsfile"):
            for known in words[1:]:
                if _has_cert_authority(os.path.expanduser(known)):
                    found.append(f"{known}: @cert-authority (host certificates)")
    return list(dict.fromkeys(found))


def _has_cert_authority(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return any(line.lstrip().startswith("@cert-authority") for line in handle.read(1 << 20).splitlines())
    except OSError:
        return False


def load_ssh_settings(alias: str, config_path: Optional[str]) -> SSHSettings:
    paramiko = _paramiko()
    config = paramiko.SSHConfig()
    path = config_path or os.path.expanduser("~/.ssh/config")
    if os.path.isfile(path):
        config = _parsed(_ssh_config, path)
    entry = config.lookup(alias)
    known = entry.get("userknownhostsfile")
    known_files = (known.split() if isinstance(known, str) else list(known or [])) or ["~/.ssh/known_hosts"]
    identities = entry.get("identityfile") or []
    jump = str(entry.get("proxyjump") or "").strip()
    return SSHSettings(
        alias=alias,
        hostname=entry.get("hostname", alias),
        port=int(entry.get("port", 22)),
        user=entry.get("user") or _current_user(),
        identity_files=[os.path.expanduser(p) for p in identities],
        known_hosts_files=[os.path.expanduser(p) for p in known_files],
        strict_host_key_checking=str(entry.get("stricthostkeychecking", "yes")).lower(),
        proxy_jump=jump if jump.lower() not in ("", "none") else None,
        connect_timeout=float(entry["connecttimeout"]) if "connecttimeout" in entry else None,
        identities_only=str(entry.get("identitiesonly", "no")).lower() == "yes",
    )


def _current_user() -> str:
    import getpass

    return getpass.getuser()


def _public_blob(path: str) -> Optional[bytes]:
    """The public half of an identity that cannot be read without its passphrase, to find its copy in the
    agent: from path.pub, else from the private file (OpenSSH's format keeps the public key in clear)."""
    import base64
    import struct

    paramiko = _paramiko()

    try:
        return paramiko.PublicBlob.from_file(path + ".pub").key_blob
    except Exception:
        pass
    try:
        with open(path) as handle:
            data = base64.b64decode("".join(line.strip() for line in handle if not line.startswith("-----")))
        if not data.startswith(b"openssh-key-v1\0"):
            return None
        at = len(b"openssh-key-v1\0")
        for _ in range(3):  # cipher, KDF and its options; then the number of keys, then the first public key
            at += 4 + struct.unpack(">I", data[at:at + 4])[0]
        size = struct.unpack(">I", data[at + 4:at + 8])[0]
        return data[at + 8:at + 8 + size]
    except (OSError, ValueError, struct.error):
        return None


MAX_JUMPS = 8


def _jump_entry(entry: str):
    """One ProxyJump entry as OpenSSH reads it: [user@]host[:port] or ssh://[user@]host[:port], IPv6 in []."""
    text = entry[len("ssh://"):].rstrip("/") if entry.lower().startswith("ssh://") else entry
    user, at, host = text.rpartition("@")
    port = None
    if host.startswith("[") and "]" in host:
        host, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (rest or None)
    elif host.count(":") == 1:
        host, port = host.split(":")
    if not host or (port is not None and not (port.isdigit() and 0 < int(port) < 65536)) or (at and not user) \
            or any(c.isspace() for c in text):
        raise NodeError("unresolved", f"ProxyJump entry {entry!r} is not [user@]host[:port]",
                        "correct ProxyJump in ssh_config (several hops: ProxyJump first,second)")
    return user or None, host, int(port) if port else None


def _jump_chain(spec: str, ssh_config: Optional[str], seen: tuple = ()) -> list:
    """The hops of a ProxyJump value, first to last, as (entry, SSHSettings), the way OpenSSH makes them:
    `ProxyJump a,b` runs `ssh -J a -W host:port b`, so each hop is its own Host entry with the entry's
    user and port over its own; the rest of the list replaces a hop's own ProxyJump, and only the first
    hop's own ProxyJump still applies (a chain before it)."""
    hops = []
    for index, entry in enumerate(e.strip() for e in spec.split(",")):
        user, host, port = _jump_entry(entry)
        if host in seen or len(seen) + len(hops) >= MAX_JUMPS:
            raise NodeError("unreachable", f"ProxyJump {spec} loops back to {host} (through {' -> '.join(seen)})"
                            if host in seen else f"ProxyJump {spec}: more than {MAX_JUMPS} hops",
                            f"exclude the jump host from the pattern that sets ProxyJump (Host * !{host})")
        hop = load_ssh_settings(host, ssh_config)
        hop.user, hop.port = user or hop.user, port or hop.port
        own, hop.proxy_jump = hop.proxy_jump, None
        if index == 0 and own:
            hops.extend(_jump_chain(own, ssh_config, seen + (host,)))
        hops.append((entry, hop))
    return hops


def closed_by_server(failure: Optional[BaseException]) -> bool:
    """Whether the handshake ended because the server closed or reset the connection (not for its silence).
    paramiko reads the banner until the end of the stream (packet.Packetizer._read_timeout raises EOFError
    there, socket.timeout at the deadline) and reports either as SSHException("Error reading SSH protocol
    banner"), the cause as its context; a failed write of our own banner is an EOFError (write_all)."""
    for exc in (failure, getattr(failure, "__context__", None)):
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return False
        if isinstance(exc, (EOFError, ConnectionError)):
            return True
    return False


def _known_hosts(*paths: str):
    """The known_hosts files as one paramiko.HostKeys, in order."""
    hosts = _paramiko().HostKeys()
    for path in paths:
        try:
            hosts.load(path)
        except Exception as exc:
            raise NodeError("host-key", f"cannot read known_hosts file {path}: {exc}", f"fix or remove {path}") from None
    return hosts


def _prompt(sock):
    """The TCP connection to a node's sshd, each small packet sent and acknowledged at once. sshd leaves Nagle's
    algorithm on for a session without a terminal: a small packet of its own waits until the one before it is
    acknowledged, and Linux delays an acknowledgement by 40 ms when it has nothing to send with it (and ours
    wait on sshd's acknowledgements alike). That was 40 ms in authentication, 40 ms in the opening of the
    session and at times 40 ms in the key exchange: about 80 ms of a one-node run's 283. TCP_NODELAY sends ours
    at once; TCP_QUICKACK acknowledges theirs at once, set again after every read since Linux clears it."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    return _QuickAcking(sock) if hasattr(socket, "TCP_QUICKACK") else sock


class _QuickAcking:
    """A socket, for paramiko's Transport, that acknowledges what it has read at once (_prompt)."""

    def __init__(self, sock):
        self._sock = sock

    def recv(self, *args) -> bytes:
        data = self._sock.recv(*args)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        except OSError:
            pass
        return data

    def __getattr__(self, name):
        return getattr(self._sock, name)


class SSHConnection:
    """One authenticated SSH connection, reused for every phase of a run."""

    def __init__(self, settings: SSHSettings, timeout: float, accept_new: bool = False,
                 ssh_config: Optional[str] = None):
        self.settings, self.timeout, self.accept_new, self.ssh_config = settings, timeout, accept_new, ssh_config
        self.transport = None
        self._jumps: List["SSHConnection"] = []  # the ProxyJump hops this connection runs through, first first

    # -- connecting ------------------------------------------------------------------------------
    def connect(self, sock=None, handshaken: Optional[Callable[[], None]] = None) -> "SSHConnection":
        """Connect and authenticate; `sock` is the channel a ProxyJump hop opened to this host, if any;
        `handshaken` is called once the key exchange is done and the host key verified."""
        paramiko = _paramiko()
        s = self.settings
        timeout = min(self.timeout, s.connect_timeout or self.timeout)
        where = f"{s.hostname}:{s.port}"
        try:
            if sock is None:
                sock = self._open_socket(timeout, where)
            self.transport = transport = paramiko.Transport(sock)
            transport.banner_timeout = transport.handshake_timeout = transport.auth_timeout = self.timeout
            failure = None
            started = time.monotonic()
            try:
                transport.start_client(timeout=self.timeout)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                failure = exc
            # start_client fails, or returns quietly at its timeout: find out how far the handshake got.
            if not transport.remote_version:
                if closed_by_server(failure):
                    raise NodeError("closed", f"{where} closed the connection before its SSH banner, "
                                    f"{time.monotonic() - started:.2f} s after accepting it", "sshd turned it away at "
                                    "once: MaxStartups reached (too many connections still authenticating), a TCP "
                                    "wrapper (/etc/hosts.deny) or sshd's rules refusing this host, or sshd failing "
                                    "before it speaks (no /run/sshd); its log on the node says which "
                                    "(journalctl -u ssh)")
                if failure is None or "banner" in str(failure).lower():
                    raise NodeError("no-banner", f"{where} accepted the connection but sent no SSH banner within "
                                    f"{self.timeout:g} s", "the sshd is hung or stopped (SIGSTOP), or the port is "
                                    "not SSH: check `systemctl status ssh` on the node")
                raise NodeError("no-banner", f"{where} closed or stalled the connection before the SSH banner "
                                f"({type(failure).__name__})", "check the node's sshd and its logs")
            # paramiko's own handshake timer ends a stalled handshake with an EOFError: that is silence too
            if transport.host_key is None and (failure is None or transport.packetizer.handshake_timed_out()):
                if transport.remote_kex_init is None:
                    raise NodeError("handshake", f"{where} sent its SSH banner ({transport.remote_version[:60]}) and "
                                    f"then nothing for {self.timeout:g} s: the key exchange never started",
                                    "sshd is stuck after accepting (overloaded, or hung in DNS or PAM), or the path "
                                    "drops larger packets (an MTU mismatch): check sshd's log and `ping -M do -s 1472`")
                raise NodeError("handshake", f"the SSH key exchange with {where} did not finish within "
                                f"{self.timeout:g} s", "check the node's sshd and its load")
            if failure is not None:
                raise NodeError("handshake", f"SSH handshake with {where} failed after its banner "
                                f"({transport.remote_version[:60]}): {str(failure) or type(failure).__name__}",
                                "check the node's sshd and its logs")
            self._verify_host_key(transport.get_remote_server_key())
            if handshaken is not None:
                handshaken()
            self._authenticate(transport)
        except BaseException:
            self.close()
            if sock is not None:
                sock.close()
            raise
        return self

    def _open_socket(self, timeout: float, where: str):
        s = self.settings
        if s.proxy_jump:
            return self._through_jumps(timeout)
        try:
            return _prompt(socket.create_connection((s.hostname, s.port), timeout=timeout))
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

    def _through_jumps(self, timeout: float):
        """A channel to this host through its ProxyJump hops: connect to the first, through it to the next,
        and through the last to this host, as `ssh -J` does. A failure names the hop."""
        hops = _jump_chain(self.settings.proxy_jump, self.ssh_config, (self.settings.alias,))
        sock = None
        for index, (entry, hop) in enumerate(hops):
            via = " -> ".join(e for e, _ in hops[:index + 1])
            try:
                self._jumps.append(SSHConnection(hop, self.timeout, self.accept_new, self.ssh_config))
                self._jumps[-1].connect(sock)
            except NodeError as exc:
                raise NodeError(exc.kind, f"through ProxyJump {via}: {exc.message}", exc.remediation) from None
            nxt = hops[index + 1][1] if index + 1 < len(hops) else self.settings
            dest = f"{nxt.hostname}:{nxt.port}"
            try:
                sock = self._jumps[-1].transport.open_channel("direct-tcpip", (nxt.hostname, nxt.port), ("", 0),
                                                              timeout=timeout)
            except Exception as exc:
                why = getattr(exc, "text", None) or str(exc) or type(exc).__name__
                raise NodeError("unreachable", f"through ProxyJump {via}: {entry} could not connect to {dest} "
                                f"({why})", f"check that {entry} can reach {dest} (and that its sshd allows "
                                "TCP forwarding)") from None
        return sock

    def _verify_host_key(self, key) -> None:
        s = self.settings
        hosts = _parsed(_known_hosts, *(p for p in s.known_hosts_files if os.path.isfile(p)))
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
            folder = os.path.dirname(path)
            if folder and not os.path.isdir(folder):
                os.makedirs(folder, mode=0o700)  # as OpenSSH makes ~/.ssh: private to its owner
            handle = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # 0600 when new, as OpenSSH
            with os.fdopen(handle, "a") as out:
                out.write(f"{names[0]} {key.get_name()} {key.get_base64()}\n")
        except OSError:
            pass  # trusting it for this run is what was asked; saving is a courtesy

    def _authenticate(self, transport) -> None:
        paramiko = _paramiko()
        s = self.settings
        tried = []
        configured = []  # (path, the key or None when it cannot be read here, its public blob, why not)
        files = s.identity_files or [os.path.expanduser(f"~/.ssh/{n}") for n in ("id_rsa", "id_ecdsa", "id_ed25519")]
        for path in files:
            if not os.path.isfile(path):
                continue
            key, problem = None, None
            try:
                key = paramiko.PKey.from_path(path)
            except paramiko.PasswordRequiredException:
                problem = "encrypted: load it into ssh-agent"
            except Exception as exc:
                problem = str(exc)
            configured.append((path, key, key.asbytes() if key else _public_blob(path), problem))
        agent, agent_keys = None, []
        try:
            agent = paramiko.Agent()
            agent_keys = list(agent.get_keys())
        except Exception:
            pass
        wanted = {blob for _, _, blob, _ in configured if blob}
        in_agent = {key.asbytes() for key in agent_keys}
        # OpenSSH's order: the agent's copies of the configured identities, then the agent's other keys (none
        # with IdentitiesOnly: sshd's MaxAuthTries counts every key offered), then the configured files.
        offers = [(f"{path} (agent)", key) for key in agent_keys for path, _, blob, _ in configured
                  if blob == key.asbytes()]
        if not s.identities_only:
            offers += [(f"agent key {key.fingerprint}", key) for key in agent_keys if key.asbytes() not in wanted]
        for path, key, blob, problem in configured:
            if blob in in_agent:
                continue  # offered above, as the agent's copy
            if key is None:
                tried.append(f"{path} ({problem})")
            else:
                offers.append((path, key))
        try:
            for label, key in offers:
                try:
                    transport.auth_publickey(s.user, key)
                    if transport.is_authenticated():
                        return
                except paramiko.AuthenticationException:
                    tried.append(label)
                except paramiko.SSHException as exc:
                    raise NodeError("auth", f"authentication as {s.user} stalled or failed after "
                                    f"{len(tried)} key(s) ({', '.join(tried) or 'none'}): {exc}",
                                    "check the node's sshd; if it closed after too many keys (MaxAuthTries), "
                                    "set IdentitiesOnly yes and IdentityFile in ~/.ssh/config") from None
        finally:
            if agent is not None:
                agent.close()
        unoffered = len(in_agent - wanted) if s.identities_only else 0
        if unoffered:
            tried.append(f"not the agent's {unoffered} other key(s): IdentitiesOnly yes")
        raise NodeError("auth", f"key authentication as {s.user!r} failed (tried: {', '.join(tried) or 'no keys'})",
                        f"install your public key in ~{s.user}/.ssh/authorized_keys on the node, or set "
                        "IdentityFile in ~/.ssh/config; preflight never prompts for a password")

    # -- running ---------------------------------------------------------------------------------
    def open_command(self, command: str, stdin_text: str = "", timeout: Optional[float] = None, pty: bool = False):
        """A session channel running `command` with `stdin_text` sent, all within the timeout: paramiko waits
        for the answer to the exec request without end, and a server that accepts the session but never
        answers it must cost a node, not the run. Past the deadline the channel is closed (which wakes the
        abandoned wait)."""
        timeout = self.timeout if timeout is None else timeout
        opened: list = []
        abandoned = threading.Event()

        def begin():
            channel = self.transport.open_session(timeout=timeout)
            opened.append(channel)
            if abandoned.is_set():  # the deadline passed while the session opened
                channel.close()
            channel.settimeout(timeout)
            if pty:
                channel.get_pty(term="dumb", width=500)
            channel.exec_command(command)
            if stdin_text:
                try:
                    channel.sendall(stdin_text.encode())
                except OSError:  # it has ended before reading it all (no such interpreter: 127): its status says
                    pass
            return channel

        try:
            return run_with_deadline(begin, timeout)
        except NodeError:
            abandoned.set()
            for channel in opened:
                channel.close()
            raise NodeError("timeout", f"the node's sshd did not start the program within {timeout:g} s (no answer "
                            "to the session or exec request)", "the sshd or the machine is hung or overloaded: "
                            "check the node's sshd and its logs") from None
        except Exception as exc:  # refused or dropped: the session is the node's, not ours
            for channel in opened:
                channel.close()
            raise NodeError("protocol", f"the node's sshd did not run the program: {type(exc).__name__}: {exc}",
                            "check the node's sshd and its logs (MaxSessions, ForceCommand)") from None

    def start(self, command: str, stdin_text: str, timeout: Optional[float] = None) -> "RemoteProcess":
        return RemoteProcess(self.open_command(command, stdin_text, timeout))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        while self._jumps:  # the last hop carries this connection: close it first
            self._jumps.pop().close()


class RemoteProcess(LineReader):
    """A program running on a node over SSH: lines in, lines out."""

    def __init__(self, channel):
        super().__init__()
        self.channel = channel

    def send_line(self, text: str, timeout: float = 30.0) -> None:
        self.channel.settimeout(timeout)
        self.channel.sendall((text + "\n").encode())

    def _receive(self, seconds: float) -> Optional[bytes]:
        self.channel.settimeout(seconds)
        try:
            return self.channel.recv(65536)
        except socket.timeout:
            return None

    def stderr_tail(self, limit: int = 2000) -> str:
        """The end of what has come in on stderr; bounded, however much the node keeps sending."""
        data = bytearray()
        for _ in range(64):
            if not self.channel.recv_stderr_ready():
                break
            data += self.channel.recv_stderr(65536)
            del data[:-4 * limit]
        return data.decode(errors="replace")[-limit:]

    def exit_status(self, timeout: float) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while not self.channel.exit_status_ready():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return self.channel.recv_exit_status()

    def close(self) -> None:
        """The end of the program's input, then of the session (the node's keeper then ends the program);
        idempotent, from any thread."""
        try:
            self.channel.shutdown_write()
        except Exception:
            pass
        try:
            self.channel.close()
        except Exception:
            pass
