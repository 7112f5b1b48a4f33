"""NCCL's RAS on this node, for `preflight doctor`: what the RAS service of the job's ranks says of every NCCL
communicator of the job (its ranks and their collective counts, the ranks missing or dead, its errors), asked as
NCCL's own client `ncclras` asks (src/ras/client.cc) and read as src/ras/client_support.cc writes it.

The protocol (NCCL 2.24+, NCCL_RAS_CLIENT_PROTOCOL 2), one TCP connection per query to NCCL_RAS_ADDR (default
localhost:28028): the client sends "CLIENT PROTOCOL 2\\n" and reads "SERVER PROTOCOL N\\n" (another N: it goes
on), "TIMEOUT S\\n" and reads "OK\\n", "SET FORMAT json\\n" and reads "OK\\n" (2.28.7+; an older NCCL answers
"ERROR: Unknown command ...", and its status comes as text), then "STATUS\\n" and reads until RAS closes the
connection. Each query has its deadline and MAX_BYTES; an answer that is not RAS's is one line (RasError), never
an exception. The answer is reduced here to what doctor judges: the communicators whose ranks disagree, miss a
rank or report an error, with the ranks that stand apart.
"""
import json
import os
import re
import socket
import time

from preflight.node import procfs
from preflight.node.packages import LIBNCCL

PORT = 28028  # NCCL_RAS_CLIENT_PORT (src/ras/ras_internal.h)
PROTOCOL = 2  # NCCL_RAS_CLIENT_PROTOCOL, the same from 2.24 to 2.30
LEG_TIMEOUT_S = 5  # RAS_COLLECTIVE_LEG_TIMEOUT_SEC: RAS's own wait for each process, unless TIMEOUT says less
MAX_BYTES = 16 << 20  # a status of thousands of ranks in JSON (about 600 bytes a rank)
MAX_LINE = 1024  # the client's buffer for a handshake line
MAX_COMMS, MAX_RANKS, MAX_OPS, MAX_ADDRESSES, MAX_TEXT = 64, 64, 16, 4, 200
# What one snapshot sends at most, whatever the job's size (every node of a job of thousands sends its own): the
# lowest counts of an op, its most common and its highest (MAX_GROUPS groups), and MAX_LISTED ranks named in all.
MAX_GROUPS, MAX_LISTED = 8, 256
# A communicator's rank is fine in these states (init_state, async_error): ncclSuccess, ncclInProgress.
FINE = (0, 7)
# NCCL 2.28.7 to 2.28.9 leave out the comma after a missing rank's "nvml_dev" (jsonWriteMissingRank; fixed in
# 2.29.2): the one defect of its JSON repaired here, so that the missing ranks (what doctor wants) are read.
MISSING_COMMA = re.compile(r'("nvml_dev": -?\d+)(\n\s*"status": \{)')


class RasError(Exception):
    """Why an answer was not read, in one line; `absent`: nothing listens at the address (RAS is off, or the
    job's NCCL is older than 2.24 or has no communicator yet), which says nothing of the job."""

    def __init__(self, line, absent=False):
        Exception.__init__(self, line)
        self.absent = absent


def address(environ):
    """(host, port, the address as given, where it comes from) of the RAS service of a rank with this environment:
    NCCL_RAS_ADDR as ncclSocketGetAddrFromString reads it ("[IPv6]:port", else the first "host:port" of a
    comma-separated list), else localhost:28028. port is None where none is given."""
    text = environ.get("NCCL_RAS_ADDR")
    if not text:
        return "localhost", PORT, "localhost:%d" % PORT, "default"
    if text.startswith("["):
        end = text.find("]")
        host, port = (text[1:end], _atoi(text[end + 2:])) if end > 0 else (text, None)
    else:
        parts = text.split(",")[0].split(":")
        host, port = parts[0], _atoi(parts[1]) if len(parts) > 1 else None
    return host, port, text[:MAX_TEXT], "NCCL_RAS_ADDR"


def enabled(environ):
    """Whether NCCL starts RAS in a process with this environment: NCCL_RAS_ENABLE read as NCCL reads a parameter
    (strtoll base 0; unset or empty: 1), and RAS runs only at 1 (src/bootstrap.cc)."""
    text = environ.get("NCCL_RAS_ENABLE")
    if not text:
        return True
    found = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", text)
    if not found:
        return False  # strtoll reads no digits: 0
    value = int(found.group(2), 16 if found.group(2)[:2] in ("0x", "0X") else 8 if found.group(2)[0] == "0" else 10)
    return (-value if found.group(1) == "-" else value) == 1


def _atoi(text):
    found = re.match(r"\s*(\d+)", text or "")
    return int(found.group(1)) if found else None


def uses_nccl(ranks, most=8):
    """Why the job's ranks on this node use NCCL (a rank's NCCL_ variables, else a libnccl loaded in one of the
    first `most`: /proc/PID/maps), or None. `ranks`: [(pid, environment)]."""
    for pid, environ in ranks:
        if any(name.startswith("NCCL_") for name in environ):
            return "rank pid %d has NCCL_ variables" % pid
    for pid, _ in ranks[:most]:
        if any(LIBNCCL.match(os.path.basename(path)) for path in procfs.mapped_files(pid)):
            return "rank pid %d has loaded libnccl" % pid
    return None


def collect(ranks, deadline, interval_s=1.0):
    """What RAS says where the job's ranks on this node run it: `ranks`, [(pid, environment)]; two queries
    `interval_s` apart (a job that moves changes its counts between them; a stuck one does not), before
    `deadline` (time.monotonic). {"skipped": why}, or {"uses": why, "answers": [one per address: {"address",
    "source", "format", "version", "protocol", "snapshots": [...], "error", "absent"}]}."""
    why = uses_nccl(ranks)
    if why is None:
        return {"skipped": "no rank of the job on this node uses NCCL (no NCCL_ variable, no libnccl loaded)"}
    places, off = {}, None
    for pid, env in ranks:
        if enabled(env):
            host, port, text, source = address(env)
            places.setdefault(text, (host, port, source))
        else:
            off = env.get("NCCL_RAS_ENABLE", "")[:MAX_TEXT]
    if not places:
        return {"skipped": "NCCL_RAS_ENABLE=%s in the ranks' environment: RAS is off" % off}
    answers, chosen = [], list(places.items())[:MAX_ADDRESSES]
    for i, (text, (host, port, source)) in enumerate(chosen):  # several jobs' RAS: each its share of the time
        share = (deadline - time.monotonic()) / (len(chosen) - i)
        answers.append(ask(host, port, text, source, time.monotonic() + share, interval_s))
    return {"uses": why, "answers": answers}


def ask(host, port, text, source, deadline, interval_s=1.0):
    """Two snapshots of RAS at host:port, `interval_s` apart, before `deadline`; the first error ends it."""
    answer = {"address": text, "source": source, "snapshots": [], "error": None, "absent": False,
              "interval_s": interval_s}
    if port is None:
        answer["error"] = "%s names no port: not asked" % text
        return answer
    for i in range(2):
        if i:
            time.sleep(max(0.0, min(interval_s, deadline - time.monotonic() - 1.0)))
        left = deadline - time.monotonic()
        until = time.monotonic() + (left - interval_s) / 2 if i == 0 else deadline  # room for the second
        try:
            fmt, protocol, body = query(host, port, until, max(1, min(LEG_TIMEOUT_S, int(until - time.monotonic()) - 1)))
            snapshot = parse(fmt, body, "NCCL RAS at %s:%d" % (host, port))
        except RasError as exc:
            answer["error"], answer["absent"] = str(exc)[:2 * MAX_TEXT], exc.absent
            break
        answer.update(format=fmt, protocol=protocol, version=snapshot.pop("version", None))
        answer["snapshots"].append(snapshot)
    return answer


def query(host, port, deadline, wait_s):
    """(format, the server's protocol, the status text) from one connection, as ncclras asks it with `-t wait_s
    -f json`; RasError says in one line why not."""
    where = "NCCL RAS at %s:%d" % (host, port)
    conn = _connect(host, port, deadline, where)
    try:
        reader = _Reader(conn, deadline, where)
        line = reader.ask("CLIENT PROTOCOL %d" % PROTOCOL)
        if not line.upper().startswith("SERVER PROTOCOL "):
            raise RasError("%s does not speak NCCL's RAS protocol: it answered %s to CLIENT PROTOCOL %d"
                           % (where, _quoted(line), PROTOCOL))
        protocol = _atoi(line[len("SERVER PROTOCOL "):])
        line = reader.ask("TIMEOUT %d" % wait_s)
        if line.strip().upper() != "OK":
            raise RasError("%s answered %s to TIMEOUT %d" % (where, _quoted(line), wait_s))
        line = reader.ask("SET FORMAT json")
        if line.strip().upper() == "OK":
            fmt = "json"
        elif line.upper().startswith("ERROR"):  # NCCL before 2.28.7: the status comes as text
            fmt = "text"
        else:
            raise RasError("%s answered %s to SET FORMAT json" % (where, _quoted(line)))
        reader.send("STATUS")
        return fmt, protocol, reader.rest()
    finally:
        conn.close()


def _connect(host, port, deadline, where):
    """A connection to the first address of host:port that takes it (ncclras tries each in turn)."""
    try:
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise RasError("%s: %s cannot be resolved (%s)" % (where, host, exc))
    refused = None
    for family, kind, proto, _, addr in infos[:8]:
        conn = socket.socket(family, kind, proto)
        conn.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            conn.connect(addr)
            return conn
        except socket.timeout:
            conn.close()
            raise RasError("%s did not take the connection within the time left" % where)
        except OSError as exc:
            conn.close()
            refused = exc
    if isinstance(refused, ConnectionRefusedError) or refused is None:
        raise RasError("nothing listens at %s:%d (connection refused)" % (host, port), absent=True)
    raise RasError("%s cannot be reached: %s" % (where, refused.strerror or refused))


class _Reader:
    """Lines and the rest of one connection, each read bounded by the deadline and the byte limits."""

    def __init__(self, conn, deadline, where):
        self.conn, self.deadline, self.where, self.buffer, self.said = conn, deadline, where, b"", None
        self.received = 0  # bytes of the answer to the last command

    def send(self, command):
        self.said, self.received = command, 0
        self.conn.settimeout(max(0.05, self.deadline - time.monotonic()))
        try:
            self.conn.sendall(command.encode("ascii") + b"\n")
        except socket.timeout:
            raise RasError("%s did not take %s within the time left" % (self.where, command))
        except OSError as exc:
            raise RasError("%s closed the connection at %s (%s)" % (self.where, command, exc.strerror or exc))

    def ask(self, command):
        """The line RAS answers to `command`."""
        self.send(command)
        while b"\n" not in self.buffer:
            if len(self.buffer) >= MAX_LINE:
                raise RasError("%s answered %s with more than %d bytes and no end of line: not RAS"
                               % (self.where, command, MAX_LINE))
            chunk = self._recv(MAX_LINE)
            if not chunk:
                raise RasError("%s closed the connection at %s%s" % (
                    self.where, command, " after %s" % _quoted(self.buffer.decode("utf-8", "replace"))
                    if self.buffer else ""))
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace").rstrip("\r")

    def rest(self):
        """Everything until RAS closes the connection, at most MAX_BYTES."""
        chunks, size = [self.buffer], len(self.buffer)
        while True:
            chunk = self._recv(1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_BYTES:
                raise RasError("%s answered STATUS with more than %d MiB: not read" % (self.where, MAX_BYTES >> 20))
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

    def _recv(self, size):
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise socket.timeout()
            self.conn.settimeout(left)
            chunk = self.conn.recv(size)
        except socket.timeout:
            if self.received:
                raise RasError("%s did not finish its answer to %s within the time left (%d bytes came)"
                               % (self.where, self.said, self.received))
            raise RasError("%s did not answer %s within the time left" % (self.where, self.said))
        except OSError as exc:
            raise RasError("%s broke the connection at %s (%s)" % (self.where, self.said, exc.strerror or exc))
        self.received += len(chunk)
        return chunk


def _quoted(text):
    return json.dumps(text[:80] + ("..." if len(text) > 80 else ""))


def parse(fmt, body, where="NCCL RAS"):
    """One snapshot of the job from RAS's status: {"version", "communicators" (how many RAS reported), "comms"
    (those whose ranks disagree, miss one or report an error: communicator()), "comms_dropped", "dead" and
    "unreachable" (processes: [pid, host]), "timeouts"}."""
    return from_json(body, where) if fmt == "json" else from_text(body, where)


def from_json(body, where="NCCL RAS"):
    """The snapshot of a JSON status (SET FORMAT json, NCCL 2.28.7+: rasDumpCommsToJSON)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        try:
            doc = json.loads(MISSING_COMMA.sub(r"\1,\2", body))
        except (ValueError, RecursionError):
            raise RasError("%s answered STATUS with JSON that does not parse (%s)" % (where, str(exc)[:MAX_TEXT]))
    if not isinstance(doc, dict) or not isinstance(doc.get("communicators"), list):
        raise RasError("%s answered STATUS with JSON that is not its status (no list of communicators)" % where)
    comms = []
    for raw in doc["communicators"]:
        if isinstance(raw, dict):
            comm = _json_comm(raw)
            if comm["ops"] or comm["missing"] or comm["errors"]:
                comms.append(comm)
    footer = doc.get("ras") if isinstance(doc.get("ras"), dict) else {}
    return {"version": _text(doc.get("nccl_version")), "communicators": len(doc["communicators"]),
            "comms": _budget(comms[:MAX_COMMS]), "comms_dropped": max(0, len(comms) - MAX_COMMS), "dead": [],
            "unreachable": [], "timeouts": _int(footer.get("timeouts_count"))}


def _json_comm(raw):
    ranks = [r for r in raw.get("ranks") or () if isinstance(r, dict)] if isinstance(raw.get("ranks"), list) else []
    counts = {}  # op -> [(value, rank, pid, host)]
    launched = 0
    for r in ranks:
        ops = r.get("collective_counts") if isinstance(r.get("collective_counts"), dict) else {}
        for op, value in ops.items():
            if _int(value) is not None and (op in counts or len(counts) < MAX_OPS):
                counts.setdefault(op[:MAX_TEXT], []).append((value, _who(r)))
                launched += value
    errors = []
    for r in ranks:
        status = r.get("status") if isinstance(r.get("status"), dict) else {}
        bad = dict((k, status.get(k)) for k in ("init_state", "async_error") if _int(status.get(k)) not in FINE + (None,))
        if bad and len(errors) < MAX_RANKS:
            errors.append(dict(_who(r), **bad))
    missing = []
    for m in raw.get("missing_ranks") or () if isinstance(raw.get("missing_ranks"), list) else ():
        if isinstance(m, dict) and len(missing) < MAX_RANKS:
            status = m.get("status") if isinstance(m.get("status"), dict) else {}
            missing.append(dict(_who(m), unresponsive=status.get("unresponsive") is True,
                                dead=status.get("considered_dead") is True))
    usual = {}  # op -> the count most of its ranks launched, where not 0
    for op, values in counts.items():
        tally = {}
        for value, _ in values:
            tally[value] = tally.get(value, 0) + 1
        top = max(tally, key=lambda v: (tally[v], v))
        if top:
            usual[op] = top
    return {"hash": _hash(raw.get("hash")), "size": _int(raw.get("size")), "ranks_count": _int(raw.get("ranks_count")),
            "missing_count": _int(raw.get("missing_ranks_count")), "launched": launched, "usual": usual,
            "ops": dict((op, _groups(values)) for op, values in counts.items() if len(set(v for v, _ in values)) > 1),
            "missing": missing, "errors": errors}


def _groups(values):
    """The ranks of one op grouped by their count, lowest first: {"value", "count", "ranks" (at most MAX_RANKS;
    the text lists a group's ranks only where it is an outlier, and None there)}."""
    by_value = {}
    for value, who in values:
        by_value.setdefault(value, []).append(who)
    return _kept([{"value": v, "count": len(by_value[v]), "ranks": by_value[v][:MAX_RANKS]} for v in sorted(by_value)])


def _kept(groups):
    """At most MAX_GROUPS of an op's groups (lowest first): the lowest, the most common and the highest."""
    if len(groups) <= MAX_GROUPS:
        return groups
    usual = max(groups, key=lambda g: (g["count"], g["value"]))
    kept = groups[:MAX_GROUPS - 2] + [g for g in (usual, groups[-1]) if g not in groups[:MAX_GROUPS - 2]]
    return sorted(kept, key=lambda g: g["value"])


def _budget(comms):
    """Names at most MAX_LISTED ranks over the snapshot's communicators (the first ones in full)."""
    left = MAX_LISTED
    for comm in comms:
        for key in ("missing", "errors"):
            comm[key] = comm[key][:max(0, left)]
            left -= len(comm[key])
        for groups in comm["ops"].values():
            for g in groups:
                if g["ranks"] is not None:
                    g["ranks"] = g["ranks"][:max(0, left)]
                    left -= len(g["ranks"])
    return comms


def _who(raw):
    """{"rank", "pid", "host"} of a rank as RAS reports it (pid -1 and host "unknown" where RAS did not know)."""
    pid, host = _int(raw.get("pid")), _text(raw.get("host"))
    return {"rank": _int(raw.get("rank")), "pid": pid if pid is not None and pid > 0 else None,
            "host": host if host != "unknown" else None}


def _hash(value):
    try:
        return "0x%x" % int(str(value), 16)
    except ValueError:
        return _text(value)


def _int(value):
    return value if type(value) is int else None


def _text(value):
    return value[:MAX_TEXT] if isinstance(value, str) else None


# The text status (NCCL 2.24 to 2.28: rasClientRunInit and rasClientRunComms), the lines doctor reads.
VERSION = re.compile(r"^NCCL version (\S+)")
HEADER = re.compile(r"^#\d+-\d+ \(([0-9a-fA-F]+)\) (INCOMPLETE|ERROR|MISMATCH)$")
PROCESS = re.compile(r"^  Process (\d+) on node (\S+) managing GPUs? ")
OPS = re.compile(r"^  Communicator ranks have different (\S+) operation counts$")  # 2.24, 2.25: "collective"
GROUP = re.compile(r"^  (\d+) ranks have (?:launched up to operation (\d+)|not launched any operations)$")
RANK = re.compile(r"^  Rank (\d+)(?: has launched up to operation (\d+)| (has not launched any operations)|"
                  r" reported (.+?)| has status \S+)? -- (?:GPU .+ managed by process (\d+) on node (\S+)|"
                  r"\[process information not found\])$")
ERRORS = re.compile(r"^  (\d+) ranks reported (.+)$")
MISSING = re.compile(r"^  The missing ranks?: ([\d, ]+)$")  # 2.24, 2.25: rank numbers only
TIMEOUTS = re.compile(r"^  Encountered (\d+) communication timeouts? while gathering communicator data$")


def from_text(body, where="NCCL RAS"):
    """The snapshot of a text status: its Errors and Warnings sections (INCOMPLETE, DEAD, TIMEOUT, and per
    communicator INCOMPLETE, ERROR, MISMATCH), as rasClientRunComms prints them. RAS lists a group's ranks only
    where the group is an outlier (rasCountIsOutlier); the others are counted, not named."""
    lines = body.splitlines()
    if not lines or not VERSION.match(lines[0]):
        raise RasError("%s answered STATUS with text that is not its status (it begins %s)"
                       % (where, _quoted(lines[0] if lines else "")))
    comms, order = {}, []
    found = {"version": VERSION.match(lines[0]).group(1)[:MAX_TEXT], "dead": [], "unreachable": [], "timeouts": 0}
    block, comm, op, group, reported = None, None, None, None, None
    for line in lines[1:]:
        header = HEADER.match(line)
        if line in ("INCOMPLETE", "DEAD", "TIMEOUT") or header:
            block, op, group, reported = (header.group(2) if header else line), None, None, None
            comm = None
            if header:
                key = "0x%x" % int(header.group(1), 16)
                if key not in comms:
                    comms[key] = {"hash": key, "size": None, "ranks_count": None, "missing_count": None,
                                  "launched": None, "usual": {}, "ops": {}, "missing": [], "errors": []}
                    order.append(key)
                comm = comms[key]
            continue
        if not line.strip():  # a blank line also parts the ops of one MISMATCH
            continue
        if not line.startswith("  "):
            block = comm = None
            continue
        if comm is None:
            process, timeouts = PROCESS.match(line), TIMEOUTS.match(line)
            if process and block in ("INCOMPLETE", "DEAD"):
                kept = found["unreachable" if block == "INCOMPLETE" else "dead"]
                if len(kept) < MAX_RANKS:
                    kept.append([int(process.group(1)), process.group(2)[:MAX_TEXT]])
            elif timeouts and block == "TIMEOUT":
                found["timeouts"] = int(timeouts.group(1))
            continue
        if line == "  Communicator ranks have different status":
            op = group = None  # its ranks are listed by status, not by count
            continue
        ops, rank, many, numbers, errors = OPS.match(line), RANK.match(line), GROUP.match(line), \
            MISSING.match(line), ERRORS.match(line)
        if ops and block == "MISMATCH":
            op, group = ops.group(1)[:MAX_TEXT], None
            comm["ops"].setdefault(op, [])
        elif many and op is not None:
            group = {"value": int(many.group(2) or 0), "count": int(many.group(1)), "ranks": None}
            comm["ops"][op].append(group)
        elif errors and block == "ERROR":
            reported = errors.group(2)[:MAX_TEXT]
        elif numbers and block == "INCOMPLETE":
            for n in re.findall(r"\d+", numbers.group(1))[:MAX_RANKS]:
                comm["missing"].append({"rank": int(n), "pid": None, "host": None, "unresponsive": True, "dead": False})
        elif rank:
            who = {"rank": int(rank.group(1)), "pid": int(rank.group(5)) if rank.group(5) else None,
                   "host": rank.group(6)[:MAX_TEXT] if rank.group(6) else None}
            if block == "INCOMPLETE" and len(comm["missing"]) < MAX_RANKS:
                comm["missing"].append(dict(who, unresponsive=True, dead=False))  # listed: RAS got no answer
            elif block == "ERROR" and len(comm["errors"]) < MAX_RANKS and (rank.group(4) or reported):
                comm["errors"].append(dict(who, error=(rank.group(4) or reported)[:MAX_TEXT]))
            elif block == "MISMATCH" and op is not None:
                if rank.group(2) is not None or rank.group(3):
                    group = {"value": int(rank.group(2) or 0), "count": 1, "ranks": []}
                    comm["ops"][op].append(group)
                if group is not None and len(group["ranks"] or ()) < MAX_RANKS:
                    group["ranks"] = (group["ranks"] or []) + [who]
    dead = set((pid, host) for pid, host in found["dead"])
    for key in order:
        for m in comms[key]["missing"]:
            m["dead"] = (m["pid"], m["host"]) in dead
        comms[key]["ops"] = dict((o, _kept(sorted(g, key=lambda g: g["value"])))
                                 for o, g in comms[key]["ops"].items() if g)
    kept = [comms[k] for k in order]
    found.update(communicators=None, comms=_budget(kept[:MAX_COMMS]), comms_dropped=max(0, len(kept) - MAX_COMMS))
    return found
