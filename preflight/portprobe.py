"""The main-port probe, shipped to nodes like the collector (stdlib only).

mode "listen" (on the head): bind the port on all addresses, say so in one JSON line, accept
connections until "done" arrives or the deadline passes, then report who connected. When the port
is taken, name the processes that hold it.
mode "connect" (on a worker): connect to the head's address and port, with a deadline.
"""
import json
import os
import select
import socket
import struct
import sys
import time


def holders(port):
    """Processes listening on `port` (from /proc: what a non-root user may see of them)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                try:
                    cmdline = open("/proc/%s/cmdline" % pid, "rb").read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    cmdline = ""
                found.append({"pid": int(pid), "command": cmdline.strip()[:200]})
                break
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
    on some kernels (the probe must leave the port as it found it)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def listen(port, deadline_s, stdin=None, out=None):
    stdin, out = stdin or sys.stdin, out or sys.stdout
    server = bindable(port)
    if isinstance(server, dict):  # taken
        out.write(json.dumps(server) + "\n")
        out.flush()
        return
    server.listen(128)
    out.write(json.dumps({"bound": True}) + "\n")
    out.flush()
    peers, open_conns, end = [], [], time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([server, stdin] + open_conns, [], [], max(0.0, end - time.monotonic()))
            if server in ready:
                conn, address = server.accept()
                peers.append(address[0])
                open_conns.append(conn)  # the worker closes first: no TIME_WAIT on the main port here
            for conn in [c for c in open_conns if c in ready]:
                open_conns.remove(conn)
                conn.close()
            if stdin in ready:
                break  # "done", or the sender went away
    finally:
        for conn in open_conns:
            close_without_time_wait(conn)
        server.close()
    out.write(json.dumps({"peers": peers}) + "\n")
    out.flush()


def connect(address, port, timeout_s):
    started = time.monotonic()
    try:
        sock = socket.create_connection((address, port), timeout=timeout_s)
        local = sock.getsockname()[0]
        close_without_time_wait(sock)
        return {"ok": True, "seconds": time.monotonic() - started, "source": local}
    except socket.timeout:
        return {"ok": False, "error": "timed out after %gs" % timeout_s, "seconds": time.monotonic() - started}
    except OSError as exc:
        return {"ok": False, "error": exc.strerror or str(exc), "seconds": time.monotonic() - started}


if __name__ == "__main__":
    options = globals().get("OPTIONS") or {}
    if options.get("mode") == "listen":
        listen(int(options["port"]), float(options["deadline_s"]))
    else:
        sys.stdout.write(json.dumps(connect(options["address"], int(options["port"]), float(options["timeout_s"]))) + "\n")
        sys.stdout.flush()
