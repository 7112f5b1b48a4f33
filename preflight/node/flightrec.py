"""torch's flight recorder on this node, for `preflight doctor`: the records a job's ranks dumped, reduced to plain
data per process group.

A dump is the pickle torch writes (torch/csrc/distributed/c10d/FlightRecorder.cpp, `dump`; the same bytes as
torch._C._distributed_c10d._dump_fr_trace()): {"version", "pg_config", "pg_status", "entries": [{"record_id",
"pg_id", "process_group": (name, desc), "collective_seq_id", "p2p_seq_id", "is_p2p", "profiling_name":
"nccl:all_reduce", "input_sizes", "input_dtypes", "output_sizes", "state", "time_created_ns", "timeout_ms",
"frames": [{"name", "filename", "line"}], ...}]}. Each rank's file is PREFIX<rank> (DebugInfoWriter; torch's
own reader, torch/distributed/flight_recorder/components/loader.py `read_dump`, takes the rank from the name).

A running rank may also serve its records: a job wrapped in torch.distributed.elastic.control_plane.worker_main
with TORCH_WORKER_SERVER_SOCKET set answers `POST /handler/fr_trace_json` on that unix socket (torch's
WorkerServer) with the same document as JSON, live, with no dump written (`served`). torch's debug server
(torch.distributed.debug.start_debug_server) runs the same WorkerServer in every rank on an ephemeral TCP port that
only the job's TCPStore records; it is asked only where /proc proves the port its own (`debug_server`): a
rank's other listeners are gloo's and NCCL's, which must never be sent HTTP.

A dump is untrusted input: opened without blocking (a FIFO), read only when it is a regular file of at most
MAX_BYTES, and its pickle is read by preflight.node.pickled, which never imports or calls anything. A socket's
answer is read within the census's time and MAX_BYTES, as JSON.
"""
import json
import os
import re
import socket
import stat
import time

from preflight.node import procfs
from preflight.node.pickled import plain_data

MAX_BYTES = 8 << 20  # 2,000 entries with their frames are about 1 MB
MAX_TOTAL = 64 << 20  # read per census, over every file
MAX_FILES = 256  # dumps read per prefix (the ranks whose files sit in one folder)
MAX_LISTED = 10000  # names of a folder looked at
MAX_GROUPS, RECENT, MAX_FRAMES, MAX_TEXT = 16, 16, 4, 200
DEFAULT_NAME = "comm_lib_trace_rank_"
# The prefix's variable, then its older name (FlightRecorder.cpp, DebugInfoWriter::getWriter: getCvarString).
PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
SOCKET_VAR = "TORCH_WORKER_SERVER_SOCKET"  # torch/distributed/elastic/control_plane.py, worker_main
SOCKET_TIMEOUT = 2.0  # seconds for one rank's answer: the handler copies its ring buffer and returns
# What a rank's WorkerServer is asked, in turn: the recorder gloo records into (torch/csrc/distributed/c10d/
# control_plane/Handlers.cpp, "fr_trace_json"), then NCCL's own (ProcessGroupNCCL.cpp, "dump_nccl_trace_json": the
# same JSON, every entry by default; registered only where torch is built with NCCL, else HTTP 404).
SERVED = ("fr_trace_json", "dump_nccl_trace_json")
# The thread of torch's WorkerServer that accepts its connections (torch/csrc/distributed/c10d/control_plane/
# WorkerServer.cpp: c10::setThreadName("pt_workerserver") before cpp-httplib's listen_after_bind, whose loop waits
# in accept4 on the listening descriptor), and accept/accept4's numbers by machine (asm/unistd_64.h; aarch64:
# asm-generic/unistd.h), as /proc/PID/task/TID/syscall gives the call a thread waits in.
SERVER_THREAD = b"pt_workerserver"
ACCEPT_CALLS = {"x86_64": (43, 288), "aarch64": (202, 242)}
MAX_TASKS = 4096  # threads of a rank looked at for the server's
LIBRARY = re.compile(r"(site-packages|dist-packages|/lib/python\d|<frozen|^<)")
# What torch's debug server writes to its dump folder every dump_interval (start_debug_server(dump_dir=...):
# torch/distributed/debug/_frontend.py, PeriodicDumper: f"{handler.dump_filename()}_{%Y%m%d_%H%M%S}.txt", "fr_trace"
# for the flight recorder): torch's analysis of all ranks as a text table, not a rank's records, so not read.
SERVER_DUMP = re.compile(r"fr_trace_\d{8}_\d{6}\.txt\Z")


def default_prefix(environ):
    """Where torch writes when no variable names a prefix (DebugInfoWriter::getWriter): $XDG_CACHE_HOME, else
    ${HOME:-/tmp}/.cache, then /torch/comm_lib_trace_rank_."""
    cache = environ.get("XDG_CACHE_HOME") or (environ.get("HOME") or "/tmp") + "/.cache"
    return cache + "/torch/" + DEFAULT_NAME


def prefix_of(environ):
    """(the prefix a process with this environment dumps to, "env" or "default")."""
    for name in PREFIX_VARS:
        if environ.get(name):
            return environ[name], "env"
    return default_prefix(environ), "default"


def dump_files(prefix):
    """[(rank, path)] of the files PREFIX<rank> (at most MAX_FILES, by rank); [] when the folder is not there."""
    folder, start = os.path.split(prefix)
    found = []
    try:
        with os.scandir(folder or ".") as names:
            for i, entry in enumerate(names):
                if i >= MAX_LISTED:
                    break
                rest = entry.name[len(start):] if entry.name.startswith(start) else ""
                if rest.isdigit() and len(rest) < 9:
                    found.append((int(rest), os.path.join(folder, entry.name)))
    except OSError:
        return []
    return sorted(found)[:MAX_FILES]


def server_dump(prefix):
    """The newest dump of torch's debug server (SERVER_DUMP) in the folder `prefix` names (the prefix itself where
    it is a folder), or None: the folder a user may give --flight-recorder for the ranks' own files."""
    folder = prefix if os.path.isdir(prefix) else os.path.dirname(prefix) or "."
    newest = None
    try:
        with os.scandir(folder) as names:
            for i, entry in enumerate(names):
                if i >= MAX_LISTED:
                    break
                if SERVER_DUMP.match(entry.name) and (newest is None or entry.name > newest):
                    newest = entry.name  # its name is its time, to the second
    except OSError:
        return None
    return newest and os.path.join(folder, newest)


def read_bytes(path, limit=MAX_BYTES):
    """(the bytes of a regular file of at most `limit` bytes, st) ; ValueError says why it is not read. Opened
    O_NONBLOCK (a FIFO returns at once) and checked on the descriptor (fstat), so a path swapped after a look is
    never read as something else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise ValueError("cannot be opened: %s" % (exc.strerror or exc))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file")
        if st.st_size > limit:
            raise ValueError("is %d bytes, more than the %d MiB read" % (st.st_size, limit >> 20))
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # it grew past the limit while read
            raise ValueError("is more than the %d MiB read" % (limit >> 20))
        return b"".join(chunks), st
    except OSError as exc:
        raise ValueError("cannot be read: %s" % (exc.strerror or exc))
    finally:
        os.close(fd)


def read_dump(path, rank):
    """One rank's dump reduced (summary), or {"path", "rank", "error"} saying in one line why it was not read."""
    try:
        data, st = read_bytes(path)
    except ValueError as exc:
        return {"path": path, "rank": rank, "error": str(exc)}
    doc = plain_data(data) if data else None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        return {"path": path, "rank": rank, "error": "is not a flight-recorder dump (a pickle of plain data with "
                                                     "its entries)" if data else "is empty"}
    found = summary(doc)
    found.update(path=path, rank=rank, size=st.st_size, mtime_ns=int(st.st_mtime * 1e9))
    return found


def _text(value):
    return value[:MAX_TEXT] if isinstance(value, str) else None


def _int(value):
    return value if type(value) is int else None


def _count(value):
    """A pg_status number: an int in a dump, its text in fr_trace_json's answer ("3", "-1")."""
    if isinstance(value, str) and re.match(r"^-?\d{1,18}$", value):
        return int(value)
    return _int(value)


def _sizes(value):
    """A list of tensor shapes, as plain lists of ints (at most 8 tensors of 8 dimensions), else None."""
    if not isinstance(value, (list, tuple)):
        return None
    shapes = []
    for shape in list(value)[:8]:
        if not isinstance(shape, (list, tuple)) or not all(type(d) is int for d in shape):
            return None
        shapes.append(list(shape)[:8])
    return shapes


def _frames(value):
    """[[name, file, line]] of a record's frames (innermost first), the first MAX_FRAMES, and the first of the
    user's own code (outside the libraries) when it is further in."""
    frames = []
    for frame in value if isinstance(value, list) else ():
        if isinstance(frame, dict) and isinstance(frame.get("filename"), str):
            frames.append([_text(frame.get("name")), _text(frame.get("filename")), _int(frame.get("line"))])
        if len(frames) >= 64:
            break
    kept = frames[:MAX_FRAMES]
    user = next((f for f in frames if not LIBRARY.search(f[1])), None)
    if user is not None and user not in kept:
        kept.append(user)
    return kept


def _entry(raw):
    seq = _int(raw.get("collective_seq_id"))
    name = _text(raw.get("profiling_name")) or ""
    return {"seq": seq, "op": name.split(":", 1)[-1], "backend": name.split(":", 1)[0] if ":" in name else None,
            "sizes": _sizes(raw.get("input_sizes")), "out_sizes": _sizes(raw.get("output_sizes")),
            "dtypes": [_text(d) for d in raw.get("input_dtypes")[:8]] if isinstance(raw.get("input_dtypes"), list)
            else None, "state": _text(raw.get("state")), "created_ns": _int(raw.get("time_created_ns")),
            "timeout_ms": _int(raw.get("timeout_ms")), "frames": _frames(raw.get("frames"))}


def _ranks(text):
    """pg_config's "ranks": a list of ints written as text ("[0, 1, 2]") or a list; None otherwise."""
    if isinstance(text, list):
        return [r for r in text if type(r) is int][:4096]
    if isinstance(text, str) and re.match(r"^\[[\d,\s]*\]$", text[:65536]):
        return [int(r) for r in re.findall(r"\d+", text)][:4096]
    return None


def summary(doc):
    """The dump as plain JSON data: per process group, where its collectives stood (pg_status) and its
    RECENT last collectives (not p2p: those count their own p2p_seq_id)."""
    groups, p2p = {}, 0
    for raw in doc["entries"]:
        if not isinstance(raw, dict):
            continue
        if raw.get("is_p2p") is True:
            p2p += 1
            continue
        pg = raw.get("process_group")
        name, desc = (pg[0], pg[1]) if isinstance(pg, (list, tuple)) and len(pg) == 2 else (raw.get("pg_id"), None)
        key = str(name)[:MAX_TEXT]
        if key not in groups:
            if len(groups) >= MAX_GROUPS:
                continue
            groups[key] = {"pg": key, "desc": _text(desc), "pg_id": _int(raw.get("pg_id")), "entries": []}
        entry = _entry(raw)
        if entry["seq"] is not None:
            groups[key]["entries"].append(entry)
    config = doc.get("pg_config") if isinstance(doc.get("pg_config"), dict) else {}
    status = doc.get("pg_status") if isinstance(doc.get("pg_status"), dict) else {}
    for group in groups.values():
        group["entries"] = sorted(group["entries"], key=lambda e: e["seq"])[-RECENT:]
        # pg_config is keyed by the group's name; gloo's default group is written under "" with one entry.
        conf = config.get(group["pg"])
        if conf is None and len(config) == 1 and (group["desc"] == "default_pg" or group["pg_id"] == 0):
            conf = list(config.values())[0]
        group["ranks"] = _ranks(conf.get("ranks")) if isinstance(conf, dict) else None
        state = status.get(str(group["pg_id"])) if group["pg_id"] is not None else None
        state = state if isinstance(state, dict) else {}
        for key in ("last_enqueued_collective", "last_started_collective", "last_completed_collective"):
            group[key.split("_")[1]] = _count(state.get(key))
    return {"version": _text(doc.get("version")), "groups": list(groups.values()), "p2p": p2p}


def collect(flag_prefix, ranks, started, deadline=None):
    """The dumps on this node: those of `flag_prefix` (doctor --flight-recorder, read from this node's root);
    else those where each running rank writes (its TORCH_FR_DUMP_TEMP_FILE, else torch's default under its
    own HOME), read through /proc/PID/root (a rank in a container sees its own files); and the live records each
    running rank serves: on its worker socket (TORCH_WORKER_SERVER_SOCKET), else on its debug server where /proc
    proves the port (debug_server). `ranks`: [(pid,
    environment, its RANK)]; `started`: pid -> when it started (s since the epoch), to leave out a file a
    rank of an earlier run wrote; `deadline` (time.monotonic) and MAX_TOTAL bytes bound the reading. Returns
    {"looked": [...], "dumps": [...], "errors": [...], "stale": [...]}."""
    places = []  # (prefix as the rank names it, path read here, source, pid)
    if flag_prefix:
        places.append((flag_prefix, os.path.expanduser(flag_prefix), "flag", None))
    else:
        for pid, environ, _ in ranks:
            prefix, source = prefix_of(environ)
            root = "/proc/%d/root" % pid
            if not prefix.startswith("/"):  # relative to the rank's working directory
                prefix = os.path.join("/proc/%d/cwd" % pid, prefix)
                root = ""
            places.append((prefix, root + prefix, source, pid))
    looked, dumps, errors, stale, seen, total = [], [], [], [], set(), 0
    for prefix, path, source, pid in places:
        if path in seen:
            continue
        seen.add(path)
        looked.append({"prefix": prefix[:MAX_TEXT], "source": source})
        files = dump_files(path)
        if not files and source == "flag":
            server = server_dump(path)
            if server:
                looked[-1]["server_dump"] = server[:MAX_TEXT]
        for rank, file_path in files:
            shown = (prefix + file_path[len(path):])[:MAX_TEXT]  # the path as the rank names it
            own = [when for p, _, r in ranks if r == rank for when in [started.get(p)] if when is not None]
            try:
                mtime = os.stat(file_path).st_mtime
            except OSError:
                mtime = None
            if own and mtime is not None and mtime < min(own) - 2:  # older than its rank (/proc: 1 s): another run
                stale.append(shown)
                continue
            if total > MAX_TOTAL or deadline is not None and time.monotonic() > deadline:
                errors.append({"path": shown, "rank": rank, "error": "was not read: the census's time or %d MiB "
                                                                       "were spent on the others" % (MAX_TOTAL >> 20)})
                continue
            found = read_dump(file_path, rank)
            total += found.get("size") or 0
            found["path"] = shown
            (errors if "error" in found else dumps).append(found)
    for pid, environ, rank in ranks:  # the live records of a rank that serves them: newer than any file
        if rank is None or total > MAX_TOTAL:
            continue
        if environ.get(SOCKET_VAR):
            found, source = served(pid, environ[SOCKET_VAR], rank, deadline), "socket"
        else:
            try:
                at = debug_server(pid)
            except ValueError as exc:
                errors.append({"path": "debug-server(pid %d)" % pid, "rank": rank, "error": "was not asked: %s" % exc})
                continue
            if at is None:
                continue
            found, source = served(pid, at, rank, deadline), "debug-server"
        total += found.get("size") or 0
        looked.append({"prefix": found["path"], "source": source})
        (errors if "error" in found else dumps).append(found)
    return {"looked": looked, "dumps": dumps, "errors": errors[:32], "stale": stale[:32]}


def debug_server(pid, listening=None):
    """(address, port) of the TCP socket on which torch's WorkerServer in process `pid` accepts (its debug server),
    proven on /proc: the server's thread waits in accept on a descriptor of the process that is, by its inode, a
    socket listening there (`listening`: procfs.tcp_sockets("LISTEN"), this network namespace's, read when None).
    None where the process runs no such thread, or it accepts on a unix socket (worker_main's); ValueError saying
    why a port was not proven (reading a thread's syscall takes ptrace's permission, as py-spy does)."""
    try:
        tasks = os.listdir("/proc/%d/task" % pid)[:MAX_TASKS]
    except OSError:
        return None
    why = None
    for tid in tasks:
        if (procfs.read("/proc/%d/task/%s/comm" % (pid, tid)) or b"").strip() != SERVER_THREAD:
            continue
        calls = ACCEPT_CALLS.get(os.uname()[4])
        if calls is None:
            raise ValueError("its debug server's port is not read on %s (accept's number is known for %s)"
                             % (os.uname()[4], ", ".join(sorted(ACCEPT_CALLS))))
        for _ in range(3):  # between two connections it is briefly elsewhere
            raw = procfs.read("/proc/%d/task/%s/syscall" % (pid, tid))
            if raw is None:
                raise ValueError("/proc/%d/task/%s/syscall cannot be read (as py-spy, it needs ptrace's permission), "
                                 "so its debug server's port is not proven" % (pid, tid))
            words = raw.split()
            if len(words) > 1 and words[0].isdigit() and int(words[0]) in calls:
                break
            time.sleep(0.01)
        else:
            why = "its thread %s was not waiting in accept, so its debug server's port is not proven" % tid
            continue
        try:
            target = procfs.link("/proc/%d/fd/%d" % (pid, int(words[1], 16))) or ""
        except ValueError:
            continue
        if listening is None:
            listening = procfs.tcp_sockets("LISTEN")
        found = listening.get(target[8:-1]) if target.startswith("socket:[") else None
        if found is not None and found["state"] == "LISTEN" and found["local_port"]:
            return found["local"], found["local_port"]
    if why:
        raise ValueError(why)
    return None


def served(pid, path, rank, deadline=None):
    """The records rank `rank` (process `pid`) serves on its worker socket `path` (read through /proc/PID/root:
    the rank's own filesystem), or on its debug server's TCP socket `path`=(address, port) (asked on loopback
    where it listens on every address), summarized as a dump's; {"path", "rank", "error"} saying in one line why
    not."""
    if isinstance(path, tuple):
        host, port = path
        shown = "debug-server:%s:%d" % ("[%s]" % host if ":" in host else host, port)
        where = ({"::": "::1", "0.0.0.0": "127.0.0.1"}.get(host, host), port)
    else:
        shown = ("socket:" + path)[:MAX_TEXT]
        where = "/proc/%d/root%s" % (pid, path) if path.startswith("/") else "/proc/%d/cwd/%s" % (pid, path)
    found, size = None, 0
    for handler in SERVED:
        left = SOCKET_TIMEOUT if deadline is None else min(SOCKET_TIMEOUT, deadline - time.monotonic())
        if left <= 0:
            return {"path": shown, "rank": rank, "error": "was not asked: the census's time was spent"}
        try:
            data = _post(where, "/handler/" + handler, left)
            doc = json.loads(data.decode("utf-8"))
        except ValueError as exc:
            if found is not None and str(exc).startswith("HTTP 404"):  # a torch built without NCCL
                break
            return _unanswered(shown, rank, handler, exc)
        except OSError as exc:  # refused, not a socket, silent
            return _unanswered(shown, rank, handler, exc)
        if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
            return {"path": shown, "rank": rank, "error": "answered, but not with flight-recorder records (%s)" % handler}
        size += len(data)
        if found is None:
            found = summary(doc)
        else:  # NCCL's groups; gloo's beside them where a group has no NCCL records
            nccl = summary(doc)["groups"]
            found["groups"] = nccl + [g for g in found["groups"] if g["pg"] not in set(n["pg"] for n in nccl)]
    found.update(path=shown, rank=rank, size=size, mtime_ns=time.time_ns())  # as of now: a live answer
    return found


def _unanswered(shown, rank, handler, exc):
    return {"path": shown, "rank": rank, "error": "did not answer with flight-recorder records (%s: %s)"
            % (handler, str(exc)[:MAX_TEXT] or type(exc).__name__)}


def _post(where, target, timeout):
    """The body of an HTTP POST to `target` on the unix socket at path `where`, or at (host, port) (torch's
    WorkerServer: HTTP/1.1, one request per connection); ValueError for an answer that is not 200 or longer than
    MAX_BYTES."""
    family = socket.AF_UNIX if isinstance(where, str) else socket.AF_INET6 if ":" in where[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(where)  # a path past 107 bytes: OSError, said as such
        conn.sendall(("POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                      % target).encode())
        received, size = [], 0
        while True:
            piece = conn.recv(1 << 16)
            if not piece:
                break
            received.append(piece)
            size += len(piece)
            if size > MAX_BYTES + 65536:
                raise ValueError("answered more than %d MiB" % (MAX_BYTES >> 20))
    head, _, body = b"".join(received).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or not status[0].startswith(b"HTTP/"):
        raise ValueError("not an HTTP answer")
    if status[1] != b"200":
        raise ValueError("HTTP %s: %s" % (status[1].decode("ascii", "replace")[:8], body[:120].decode("utf-8", "replace")))
    if b"chunked" in head.lower():
        raise ValueError("a chunked answer, which torch's WorkerServer does not send")
    return body
