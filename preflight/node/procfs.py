"""The /proc readers every node-side module uses: bounded reads that never block, and None (or nothing) for
a process that is gone or that this user may not read."""
import os
import socket
import struct

TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
              "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def read(path, limit=1 << 16):
    """At most `limit` bytes of a /proc file, or None."""
    try:
        with open(path, "rb") as handle:
            return handle.read(limit)
    except OSError:
        return None


def pids():
    try:
        return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError:
        return []


def link(path):
    try:
        return os.readlink(path)
    except OSError:
        return None


def namespace(pid, kind):
    """The inode name of a process's namespace of this kind ("net", ...), None when unreadable."""
    return link("/proc/%s/ns/%s" % (pid, kind))


def boot_time():
    raw = read("/proc/stat", 1 << 20)
    for line in (raw or b"").decode("ascii", "replace").splitlines():
        if line.startswith("btime "):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def argv(pid):
    """A process's arguments as text (undecodable bytes replaced; empty ones kept), [] when unreadable."""
    raw = read("/proc/%s/cmdline" % pid)
    if not raw:
        return []
    words = raw.split(b"\0")
    if raw.endswith(b"\0"):
        words.pop()
    return [w.decode("utf-8", "replace") for w in words]


def stat_fields(pid):
    """The fields of /proc/PID/stat after "pid (comm)" (the name may hold spaces and parentheses), or None."""
    raw = read("/proc/%s/stat" % pid)
    if not raw or b")" not in raw:
        return None
    return raw[raw.rfind(b")") + 2:].split()


def parent(pid):
    fields = stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def environ(pid):
    """A process's environment (None when /proc/PID/environ cannot be read)."""
    raw = read("/proc/%s/environ" % pid, 1 << 20)
    if raw is None:
        return None
    env = {}
    for item in raw.split(b"\0"):
        name, _, value = item.decode("utf-8", "replace").partition("=")
        if name:
            env[name] = value
    return env


def mapped_files(pid):
    """The files a process maps (/proc/PID/maps: paths in its own mount namespace; a file deleted or replaced since
    ends with " (deleted)"), each once in the order first mapped; [] where it cannot be read."""
    found = {}
    for line in (read("/proc/%s/maps" % pid, 8 << 20) or b"").split(b"\n"):
        fields = line.split(None, 5)  # address perms offset dev inode path (which may hold spaces)
        if len(fields) == 6 and fields[5].startswith(b"/"):
            found.setdefault(fields[5].decode("utf-8", "replace"), None)
    return list(found)


def socket_inodes(pid):
    """The inodes of the sockets a process holds open, in the order of its descriptors."""
    try:
        fds = os.listdir("/proc/%s/fd" % pid)
    except OSError:
        return []
    found = []
    for fd in fds:
        target = link("/proc/%s/fd/%s" % (pid, fd))  # None: closed while we looked
        if target and target.startswith("socket:["):
            found.append(target[8:-1])
    return found


PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def ptrace_scope():
    """kernel.yama.ptrace_scope (0-3); None where the kernel has no Yama (classic ptrace rules) or it is unreadable."""
    raw = read(PTRACE_SCOPE)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def tcp_sockets(state=None):
    """inode -> {local, local_port, remote, remote_port, state} from /proc/net/tcp and tcp6 (this netns); with
    `state` ("LISTEN"), only those: the others' addresses are not decoded (a node may hold 10,000 connections)."""
    code = next((k for k, v in TCP_STATES.items() if v == state), None) if state else None
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        raw = read(table, 1 << 24)
        for line in (raw or b"").decode("ascii", "replace").splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or code is not None and fields[3] != code:
                continue
            local, remote = address(fields[1]), address(fields[2])
            found[fields[9]] = {"local": local[0], "local_port": local[1], "remote": remote[0],
                                "remote_port": remote[1], "state": TCP_STATES.get(fields[3], fields[3])}
    return found


def address(text):
    """'0100007F:1F90' -> ('127.0.0.1', 8080); IPv6 (and IPv4-mapped) as /proc writes them."""
    host, _, port = text.partition(":")
    try:
        raw = bytes.fromhex(host)
        if len(raw) == 4:
            found = socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
        else:
            words = struct.unpack("<4I", raw)
            packed = struct.pack(">4I", *words)
            found = socket.inet_ntop(socket.AF_INET6, packed)
            if found.startswith("::ffff:") and "." in found:
                found = found[7:]
        return found, int(port, 16)
    except (ValueError, struct.error, OSError):
        return text, None
