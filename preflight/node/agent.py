"""The request agent: after the facts, one JSON answer line for each JSON request line the head sends (the
clock samples, the main-port probe, the shared folder, the files a node's config names, the data path to its
peers), until "done" or the end of its input. One process per node serves every phase of a run. Its program: `main`."""
import json
import os
import socket
import struct
import sys
import time

from preflight.node import collector, paths, procfs
from preflight.node.launchfiles import read_file

# The variables a launcher gives its ranks: all that is read of a port holder's environment.
JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def holders(port):
    """Processes listening on `port` (from /proc: what this user may see of them): "pid", "command" (the
    command line as one line, 200 characters), "argv" (each argument up to 200 characters, at most 64),
    "ppid" and "parent_argv" (the launcher of a rank process), "children" (how many processes it has
    started: None when unknown), and "env": only the variables a launcher gives its ranks (RANK,
    MASTER_PORT, ...), no other variable is read."""
    def argv_of(pid):
        return [a[:200] for a in procfs.argv(pid)][:64]

    def job_env(pid):
        env = procfs.environ(pid)
        return None if env is None else dict((k, v[:200]) for k, v in env.items() if k in JOB_VARIABLES)

    inodes = set(inode for inode, s in procfs.tcp_sockets().items()
                 if s["state"] == "LISTEN" and s["local_port"] == port)
    found = []
    for pid in procfs.pids():
        if any(inode in inodes for inode in procfs.socket_inodes(pid)):
            argv, ppid = argv_of(pid), procfs.parent(pid)
            found.append({"pid": pid, "command": " ".join(argv).strip()[:200], "argv": argv, "ppid": ppid,
                          "parent_argv": argv_of(ppid) if ppid else [], "children": None, "env": job_env(pid)})
    if found:  # one pass over /proc/*/stat: how many processes each holder has started
        counts = dict((h["pid"], 0) for h in found)
        for pid in procfs.pids():
            ppid = procfs.parent(pid)
            if ppid in counts:
                counts[ppid] += 1
        for h in found:
            h["children"] = counts[h["pid"]]
    return found


def bindable(port):
    """A socket bound to the port on all addresses, as torch's TCPStore binds it (SO_REUSEADDR, so that
    connections in TIME_WAIT do not count); or, when it is taken, a dict that says by whom."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("0.0.0.0", port))
        return server
    except OSError as exc:
        server.close()
        return {"bound": False, "error": exc.strerror or str(exc), "holders": holders(port)}


def close_without_time_wait(sock):
    """Close with a reset, leaving no TIME_WAIT entry: one on the main port makes the job's own bind fail
    on some kernels (a probe must leave the port as it found it)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def connect(address, port, timeout_s):
    started = time.monotonic()
    try:
        sock = socket.create_connection((address, port), timeout=timeout_s)
    except socket.timeout:
        return {"ok": False, "error": "timed out after %gs" % timeout_s, "seconds": time.monotonic() - started}
    except OSError as exc:
        return {"ok": False, "error": exc.strerror or str(exc), "seconds": time.monotonic() - started}
    source = sock.getsockname()[0]
    close_without_time_wait(sock)
    return {"ok": True, "seconds": time.monotonic() - started, "source": source}


def shared_file(op, folder, name, token=None):
    """The shared-folder probe: the head writes a token, the others read it, the head removes it."""
    path = os.path.join(folder, name)
    try:
        if op == "write":
            with open(path, "w") as handle:
                handle.write(token)
                handle.flush()
                os.fsync(handle.fileno())
            return {"ok": True, "path": path}
        if op == "read":
            with open(path) as handle:
                same = handle.read() == token
            return {"ok": same, "path": path, "error": None if same else "the file holds another token"}
        os.unlink(path)
        return {"ok": True, "path": path}
    except OSError as exc:
        return {"ok": False, "path": path, "error": exc.strerror or str(exc)}


class Agent(object):
    """Answers requests: {"op": "time"}, {"op": "listen", "port"}, {"op": "unlisten"},
    {"op": "connect", "address", "port", "timeout_s"}, {"op": "write"|"read"|"remove", "folder", "name",
    "token"}, {"op": "files", "paths", "cwd"}, {"op": "paths_open"}, {"op": "paths_probe", "peers", "timeout_s",
    "wait_s"}, {"op": "paths_close"} (preflight.node.paths). While a port is listened on, connections are accepted
    between requests; the data-path responder answers on its own thread."""

    def __init__(self):
        self.server, self.peers, self.conns, self.responder = None, [], [], None

    def handle(self, request):
        op = request.get("op")
        if op == "time":
            return {"time": time.time()}
        if op == "listen":
            server = bindable(int(request["port"]))
            if isinstance(server, dict):
                return server
            server.listen(128)
            self.server, self.peers = server, []
            return {"bound": True}
        if op == "unlisten":
            self.stop_listening()
            return {"peers": self.peers}
        if op == "connect":
            return connect(request["address"], int(request["port"]), float(request["timeout_s"]))
        if op == "files":  # the files a node's own config names (asked once that config is parsed)
            return dict((p, read_file(p, request["cwd"], True)) for p in request["paths"][:16])
        if op in ("write", "read", "remove"):
            return shared_file(op, request["folder"], request["name"], request.get("token"))
        if op == "paths_open":
            self.close_paths()
            try:
                self.responder = paths.Responder()
            except OSError as exc:
                return {"open": False, "error": exc.strerror or str(exc)}
            return dict(self.responder.ports(), open=True)
        if op == "paths_probe":
            return {"paths": paths.probe(request["peers"], float(request["timeout_s"]), float(request["wait_s"]))}
        if op == "paths_close":
            self.close_paths()
            return {}
        return {"error": "unknown request %r" % op}

    def on_readable(self, sock):
        if sock is self.server:
            conn, address = self.server.accept()
            self.peers.append(address[0])
            self.conns.append(conn)  # the worker closes first: no TIME_WAIT on the main port here
        else:
            self.conns.remove(sock)
            sock.close()

    def close_paths(self):
        if self.responder is not None:
            self.responder.stop()
        self.responder = None

    def stop_listening(self):
        for conn in self.conns:
            close_without_time_wait(conn)
        if self.server is not None:
            self.server.close()
        self.server, self.conns = None, []


def serve(agent, fd_in, out):
    """One JSON answer line per request line, until "done" or end of input."""
    import select

    pending = b""
    try:
        while True:
            while b"\n" not in pending:
                watched = [fd_in] + ([agent.server] if agent.server else []) + agent.conns
                ready = select.select(watched, [], [])[0]
                for sock in ready:
                    if sock is not fd_in:
                        agent.on_readable(sock)
                if fd_in in ready:
                    chunk = os.read(fd_in, 65536)
                    if not chunk:
                        return
                    pending += chunk
            line, pending = pending.split(b"\n", 1)
            if line.strip() in (b"", b"done"):
                return
            try:
                answer = agent.handle(json.loads(line.decode()))
            except Exception as exc:  # a bad request gets an answer, not a dead agent
                answer = {"error": "%s: %s" % (type(exc).__name__, exc)}
            out.write(json.dumps(answer) + "\n")
            out.flush()
    finally:
        agent.stop_listening()
        agent.close_paths()


# --- the fabric: RDMA devices and ports, GPUDirect modules, NCCL libraries, Xid events -------------


def prepare():
    """What the agent reads before its options come (remote.shipping's bootstrap calls it first)."""
    return collector.prepare()


def main(options, ready=None):
    """The agent's program: the facts line, then answers until the end of its input."""
    sys.stdout.write(json.dumps(collector.collect(options, ready)) + "\n")
    sys.stdout.flush()
    serve(Agent(), 0, sys.stdout)


if __name__ == "__main__":  # by hand on a node, or under a fan-out tool: python -m preflight.node.agent
    main({})
