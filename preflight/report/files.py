"""Report files written next to the terminal or JSON output: JUnit XML (`--junit`), the node_exporter
textfile-collector format (`--prometheus`) and one self-contained HTML page (`--html`).

Each writer takes the same (results, verdict, nodes, duration_s) as the renderers and writes its file
with write_file: into what the path is (a FIFO, a device or our stdout in place), a regular file atomically.
"""
from __future__ import annotations

import errno
import html
import itertools
import json
import os
import re
import select
import socket
import stat
import sys
import time
from collections import Counter
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from preflight import DISTRIBUTION, __version__
from preflight.inputs.documents import InputError
from preflight.inputs.numbers import float_or_none
from preflight.result import SEVERITY, Result, Status, counted

CONFIG = "config"  # the node name of results that concern no node (config lint, cluster-wide skips)
STATUSES = (Status.PASS, Status.WARN, Status.FAIL, Status.SKIP, Status.ERROR)
VERDICTS = ("pass", "warn", "fail")


# --- checking and writing files -----------------------------------------------------------------
# A report goes into what its path is (README, Guarantees): a symlink is followed (a dangling one creates its
# target); a FIFO, a character device (a terminal, /dev/null) or this run's own stdout/stderr (/dev/stdout,
# /dev/fd/2) is written in place, never replaced; only a regular file, or a new one, is replaced atomically (a
# temporary file beside it, then os.replace), keeping the old file's mode, else the umask's. Anything else
# (a folder, a socket, a block device) is refused.

FIFO_WAIT_S = 10.0  # how long a FIFO may go without a reader (opened) or without reading (full), then exit 2


def _kind(mode: int) -> Optional[str]:
    """None for what a report can go into (a regular file, a FIFO, a character device), else what it is."""
    if stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        return None
    return {stat.S_IFDIR: "is a directory", stat.S_IFSOCK: "is a socket", stat.S_IFBLK: "is a block device"}.get(
        stat.S_IFMT(mode), "is not a file")


def _own_stream(st: os.stat_result) -> Optional[int]:
    """1 or 2 when `st` is this process's stdout or stderr (/dev/stdout, /dev/fd/2, or the file `>` opened)."""
    for fd in (1, 2):
        try:
            mine = os.fstat(fd)
        except OSError:
            continue
        if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino) and not stat.S_ISDIR(st.st_mode):
            return fd
    return None


def _stat(path: str) -> Optional[os.stat_result]:
    """The stat of what `path` names, through symlinks; None when nothing is there (a dangling link too)."""
    try:
        return os.stat(path)
    except FileNotFoundError:  # (ELOOP, a loop of symlinks, and ENOTDIR are raised: the path cannot be)
        return None


def unwritable(path: str) -> Optional[str]:
    """Why `path` cannot be written (checked before the checks run), or None. A FIFO's reader is not
    asked for here (opening its write end would end a reader's input): the write waits FIFO_WAIT_S for one."""
    if not path:
        return "an empty path"
    try:
        st = _stat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    if st is not None:
        problem = _kind(st.st_mode)
        if problem:
            return problem
        if _own_stream(st) is not None:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None if os.access(path, os.W_OK) else "no permission to write it"
    folder = os.path.dirname(os.path.realpath(path))  # a symlink's file is written in its target's folder
    if not os.path.isdir(folder):
        return f"no such folder {folder}" if not os.path.exists(folder) else f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write in the folder {folder}"
    return None


def check_writable(option: str, path: Optional[str]) -> None:
    """Raise InputError (one line, exit 2) naming the file when `path` cannot be written."""
    if path is None:
        return
    problem = unwritable(path)
    if problem:
        raise InputError(path or '""', f"{option}: cannot write the report: {problem}")


def write_file(path: str, pieces: Iterable[bytes]) -> None:
    """The pieces, one after the other (a report of thousands of nodes need not be one string), into what
    `path` is (see above)."""
    st = _stat(path)
    if st is not None and _kind(st.st_mode):
        raise OSError(0, _kind(st.st_mode))
    own = _own_stream(st) if st is not None else None
    if own is not None:
        for stream in (sys.stdout, sys.stderr):  # what the run printed comes first
            stream.flush()
        for piece in pieces:
            _write_all(own, piece)
    elif st is not None and not stat.S_ISREG(st.st_mode):
        _write_in_place(path, pieces)
    else:
        _replace(os.path.realpath(path), pieces, st)


def _replace(path: str, pieces: Iterable[bytes], old: Optional[os.stat_result]) -> None:
    """A temporary file in the same folder, then os.replace: a reader (a CI system, node_exporter) never
    sees half a report. Created 0666 less the umask (as any program creates a file), then given the old
    file's mode and, where allowed, its owner."""
    folder, name = os.path.split(path)
    while True:
        tmp = os.path.join(folder, f".{name}.{os.urandom(4).hex()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.writelines(pieces)
            if old is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode))
                if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                    try:
                        os.fchown(f.fileno(), old.st_uid, old.st_gid)
                    except OSError:
                        pass  # not ours to give away: the report is still written
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _write_in_place(path: str, pieces: Iterable[bytes]) -> None:
    """A FIFO or a character device: opened for writing, never truncated nor replaced. Non-blocking, so that a
    FIFO nobody opens (ENXIO) or nobody reads (full) costs at most FIFO_WAIT_S, then an error."""
    deadline = time.monotonic() + FIFO_WAIT_S
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                if exc.errno == errno.ENXIO:
                    raise OSError(exc.errno, f"no process opened the FIFO for reading within {FIFO_WAIT_S:g} s") from None
                raise
            time.sleep(0.05)
    try:
        for piece in pieces:
            _write_all(fd, piece, deadline_s=FIFO_WAIT_S)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, deadline_s: Optional[float] = None) -> None:
    """All of `data`; on a non-blocking fd, waiting at most deadline_s for each stall of the reader."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            if not select.select([], [fd], [], deadline_s)[1]:
                raise OSError(errno.ETIMEDOUT, f"the reader took nothing for {deadline_s:g} s") from None


# What XML 1.0 excludes, listed rather than as the complement of what it allows: the same code points, and
# compiled in 0.7 ms instead of 7 at every start-up.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml(text: str) -> str:
    """XML 1.0 cannot hold most control characters, even escaped: they are shown as \\xNN."""
    return _XML_INVALID.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def batched(lines: Iterable[str], size: int = 4096) -> Iterator[bytes]:
    """The lines a few thousand to a piece, as UTF-8: a piece (a write) per line, at 16,384 nodes millions of
    them, cost more than the report."""
    lines = iter(lines)
    while True:
        piece = list(itertools.islice(lines, size))
        if not piece:
            return
        yield "".join(piece).encode("utf-8")


def _worst(statuses: Iterable[Status]) -> Status:
    return min(statuses, key=SEVERITY.__getitem__)


# --- JUnit XML ------------------------------------------------------------------------------------

def junit(results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float) -> bytes:
    """One <testsuite name="preflight">, one <testcase> per check and node."""
    return b"".join(junit_pieces(results, verdict, nodes, duration_s))


# Attribute values escaped as ElementTree escapes them (the report was once built as a tree, indented by
# ET.indent: the same bytes, without a tree of 70,000 elements at 4,096 nodes).
_ATTRIBUTE = {'"': "&quot;", "\r": "&#13;", "\n": "&#10;", "\t": "&#09;"}
_OUTCOME = {Status.FAIL: "failure", Status.ERROR: "error", Status.SKIP: "skipped"}
EVIDENCE_ONCE = 4096  # characters: larger evidence of a result on several nodes is written once, on its first


def escape(text: str, entities: Optional[Dict[str, str]] = None) -> str:
    """xml.sax.saxutils.escape, which imports urllib.request and http.client: 20 ms at every start-up."""
    text = text.replace("&", "&amp;").replace(">", "&gt;").replace("<", "&lt;")
    for char, entity in (entities or {}).items():
        text = text.replace(char, entity)
    return text


_SCALARS = frozenset((str, int, float, bool, type(None)))
_COMPACT = json.JSONEncoder(default=str)  # CPython's C encoder; `indent` would make json take its Python one


def indented_json(value: Mapping) -> str:
    """json.dumps(value, indent=2, default=str, sort_keys=True), the same text; a flat mapping of str keys to scalars
    or lists of scalars (most evidence: 49,000 details in the HTML report at 16,384 nodes, a third of them with a
    list of addresses or interfaces) item by item through the C encoder."""
    if not value or not all(type(k) is str and (type(v) in _SCALARS or type(v) is list and
                                                all(type(x) in _SCALARS for x in v)) for k, v in value.items()):
        return json.dumps(value, indent=2, default=str, sort_keys=True)
    encode = _COMPACT.encode

    def shown(v) -> str:  # a list as json's indent=2 writes it one level down
        if type(v) is not list:
            return encode(v)
        return "[\n" + ",\n".join(f"    {encode(x)}" for x in v) + "\n  ]" if v else "[]"
    return "{\n" + ",\n".join(f"  {encode(k)}: {shown(v)}" for k, v in sorted(value.items())) + "\n}"


def _element(tag: str, attributes: Iterable[Tuple[str, str]], text: Optional[str] = None) -> str:
    opening = tag + "".join(f' {name}="{escape(value, _ATTRIBUTE)}"' for name, value in attributes)
    return f"<{opening}>{escape(text)}</{tag}>" if text else f"<{opening} />"


def junit_pieces(results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float) -> Iterator[bytes]:
    """junit's document, a testcase at a time."""
    counts = Counter()  # status -> test cases: one pass over the results, not one per attribute
    for r in results:
        counts[r.status] += counted(r)
    suite = _element("testsuite", [
        ("name", "preflight"), ("tests", str(sum(counts.values()))), ("failures", str(counts[Status.FAIL])),
        ("errors", str(counts[Status.ERROR])), ("skipped", str(counts[Status.SKIP])), ("time", f"{duration_s:.6f}"),
        ("timestamp", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())), ("hostname", socket.gethostname())])
    yield _utf8("<?xml version='1.0' encoding='utf-8'?>\n" + suite[:-len(" />")] + ">\n  <properties>\n"
                f"    {_element('property', [('name', 'preflight'), ('value', _xml(__version__))])}\n"
                f"    {_element('property', [('name', 'verdict'), ('value', verdict)])}\n"
                f"    {_element('property', [('name', 'nodes'), ('value', _xml(','.join(nodes)))])}\n"
                "  </properties>\n")
    named: Dict[str, str] = {}  # node -> its name attribute, escaped: the same nodes in every check
    for r in results:  # a result's test case is the same on each of its nodes but for the name: made once
        inside = []
        tag = _OUTCOME.get(r.status)
        if tag:
            text = _xml(r.remediation) if r.remediation and tag != "skipped" else None
            inside.append(_element(tag, [("message", _xml(r.message)), ("type", r.status.value)], text))
        elif r.status is Status.WARN:  # JUnit has no warning: the test passes, the output says why
            inside.append(_element("system-out", (), _xml(f"WARN {r.message}" + (f"\nfix: {r.remediation}"
                                                                                  if r.remediation else ""))))
        nodes = r.nodes or (CONFIG,)
        evidence = json.dumps(dict(r.evidence), default=str, sort_keys=True) if r.evidence else None
        # Large evidence (doctor's census of every process) once, in the first node's test case: in each of
        # thousands it would make the file nodes x evidence
        again = evidence is not None and len(nodes) > 1 and len(evidence) > EVIDENCE_ONCE
        classname = escape(_xml(f"{r.id} {r.name}"), _ATTRIBUTE)

        def end(evidence_text: Optional[str]) -> str:
            parts = inside + ([_element("system-err", (), evidence_text)] if evidence_text else [])
            return f' time="{r.duration_s:.6f}"' + (
                ">" + "".join(f"\n    {x}" for x in parts) + "\n  </testcase>" if parts else " />")

        first = end(f"evidence: {evidence}" if evidence is not None else None)
        rest = end(f"evidence: as in the test case of {nodes[0]}") if again else first
        for node in set(nodes).difference(named):  # (a set: no Python step per node already named)
            named[node] = escape(_xml(node), _ATTRIBUTE)
        opening = f'  <testcase classname="{classname}" name="'
        text = f'{opening}{named[nodes[0]]}"{first}\n'
        if len(nodes) > 1:  # one join for the nodes after the first (16,384 of them: no Python step per node)
            closing = f'"{rest}\n'
            text += opening + (closing + opening).join(map(named.__getitem__, nodes[1:])) + closing
        yield _utf8(text)
    yield b"</testsuite>\n"


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "xmlcharrefreplace")  # as ElementTree writes


def write_junit(path: str, results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float) -> None:
    write_file(path, junit_pieces(results, verdict, nodes, duration_s))


# --- Prometheus (node_exporter textfile collector) -----------------------------------------------

STATUS_METRIC = "preflight_check_status"
STATUS_HELP = "1 for the check's status on the node, 0 for the other statuses"


def _label(value: str) -> str:
    """A label value escaped as prometheus_client escapes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def check_status_lines(results: Sequence[Result]) -> Iterator[str]:
    """preflight_check_status{check,name,node,status}: 1 for the check's status on that node, 0 for the other
    four (pass, warn, fail, skip, error); the worst when a check has several results on one node;
    node="config" for results that concern no node. In the text format, as a prometheus_client Gauge writes
    it, but written here: five samples per check and node are 350,000 at 4,096 nodes, where a Gauge child
    per sample and generate_latest take seconds (scripts/bench_scale.py)."""
    worst: Dict[Tuple[str, str, str], Status] = {}
    found = worst.get
    for r in results:
        rank = SEVERITY[r.status]
        for node in r.nodes or (CONFIG,):
            key = (r.id, r.name, node)
            before = found(key)
            if before is None or rank < SEVERITY[before]:
                worst[key] = r.status
    yield f"# HELP {STATUS_METRIC} {STATUS_HELP}\n"
    yield f"# TYPE {STATUS_METRIC} gauge\n"
    # What follows `status="` in each of the five samples, for each status the node may have: made once.
    samples = {c: [f'{s.value}"}} {"1.0" if s is c else "0.0"}\n' for s in STATUSES] for c in STATUSES}
    checks: Dict[Tuple[str, str], str] = {}
    labelled: Dict[str, str] = {}  # node -> its label value: the same nodes in every check
    for (check_id, name, node), current in worst.items():
        check = checks.get((check_id, name))
        if check is None:
            check = checks[(check_id, name)] = f'{STATUS_METRIC}{{check="{_label(check_id)}",name="{_label(name)}",node="'
        shown = labelled.get(node)
        if shown is None:
            shown = labelled[node] = _label(node)
        labels = f'{check}{shown}",status="'
        yield labels + labels.join(samples[current])  # labels before each sample


def prometheus_registry(results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float,
                        now: Optional[float] = None):
    """The run's own metrics, in a fresh CollectorRegistry (no global state):

    preflight_verdict{verdict}                      1 for this run's verdict, 0 for the other two
    preflight_last_run_timestamp_seconds            when the report was written (Unix time)
    preflight_duration_seconds                      how long the run took
    preflight_nodes                                 the nodes checked
    preflight_info{version}                         1, labelled with the preflight version that wrote it

    The metrics per check and node follow them in the file: check_status_lines, node_gauge_lines."""
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry(auto_describe=True)
    verdict_gauge = Gauge("preflight_verdict", "1 for this run's verdict (pass, warn, fail), 0 for the others",
                          ["verdict"], registry=registry)
    for v in VERDICTS:
        verdict_gauge.labels(v).set(1 if v == verdict else 0)
    Gauge("preflight_last_run_timestamp_seconds", "when preflight last ran (Unix time)",
          registry=registry).set(time.time() if now is None else now)
    Gauge("preflight_duration_seconds", "how long the preflight run took", registry=registry).set(duration_s)
    Gauge("preflight_nodes", "nodes checked", registry=registry).set(len(nodes))
    Gauge("preflight_info", "the preflight build that wrote the report", ["version"],
          registry=registry).labels(__version__).set(1)
    return registry


def node_gauge_lines(results: Sequence[Result]) -> Iterator[str]:
    """The values the results carry per node:

    preflight_clock_offset_seconds{check,node}      CLK evidence offset_s (node minus reference); a result
        that covers several nodes carries its largest offset, which each of them gets
    preflight_collective_busbw_gbps{check,node}     COL evidence busbw_gbps (GB/s), the lowest per node
    preflight_gpu_count{node}                       GPU evidence `count`, where the GPU checks report it

    Each as a prometheus_client Gauge writes it (gauge_lines), where a Gauge child per node (16,384 of each at
    16,384 nodes) and generate_latest cost most of a second."""
    offsets: Dict[Tuple[str, str], float] = {}
    busbw: Dict[Tuple[str, str], float] = {}
    gpus: Dict[Tuple[str], float] = {}
    for r in results:  # the value a result carries, then each of its nodes
        if r.id.startswith("CLK"):
            value = float_or_none(r.evidence.get("offset_s"))
            for node in r.nodes or (CONFIG,):
                if value is not None and abs(value) >= abs(offsets.get((r.id, node), 0.0)):
                    offsets[(r.id, node)] = value
        elif r.id.startswith("COL"):
            value = float_or_none(r.evidence.get("busbw_gbps"))
            for node in r.nodes or (CONFIG,):
                if value is not None and value < busbw.get((r.id, node), float("inf")):
                    busbw[(r.id, node)] = value
        elif r.id.startswith("GPU"):
            value = float_or_none(r.evidence.get("count"))
            for node in r.nodes:
                if value is not None and node != CONFIG:
                    gpus[(node,)] = value
    yield from gauge_lines("preflight_clock_offset_seconds", "clock offset of the node from the reference (CLK "
                           "evidence)", ("check", "node"), offsets)
    yield from gauge_lines("preflight_collective_busbw_gbps", "all-reduce bus bandwidth in GB/s (COL evidence)",
                           ("check", "node"), busbw)
    yield from gauge_lines("preflight_gpu_count", "GPUs the node has (GPU evidence)", ("node",), gpus)


def gauge_lines(name: str, documentation: str, labelnames: Tuple[str, ...], values: Mapping[tuple, float]
                ) -> Iterator[str]:
    """A Gauge's text as prometheus_client's generate_latest writes it (exposition.py: HELP, TYPE, then a sample a
    line, its labels in the order of their names, each value escaped as _label does, the value as
    floatToGoString writes it), nothing without a value. `labelnames` in that order."""
    from prometheus_client.utils import floatToGoString

    if not values:
        return
    yield f"# HELP {name} {documentation}\n# TYPE {name} gauge\n"
    for labels, value in values.items():
        shown = ",".join(f'{label}="{_label(v)}"' for label, v in zip(labelnames, labels))
        yield f"{name}{{{shown}}} {floatToGoString(value)}\n"


def write_prometheus(path: str, results: Sequence[Result], verdict: str, nodes: Sequence[str],
                     duration_s: float) -> None:
    """preflight_check_status first, then the run's metrics as prometheus_client writes them, then the values per
    node."""
    from prometheus_client import generate_latest

    registry = prometheus_registry(results, verdict, nodes, duration_s)
    write_file(path, itertools.chain(batched(check_status_lines(results)), [generate_latest(registry)],
                                     batched(node_gauge_lines(results))))


# --- HTML -----------------------------------------------------------------------------------------

COLORS = {  # background, text
    Status.FAIL: ("#d9363e", "#fff"),
    Status.ERROR: ("#8e44ad", "#fff"),
    Status.WARN: ("#f0b429", "#222"),
    Status.SKIP: ("#d5d8dc", "#444"),
    Status.PASS: ("#2e9e5b", "#fff"),
}

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 4px} .meta{color:#555;margin-bottom:16px}
.verdict{display:inline-block;padding:2px 10px;border-radius:4px;font-weight:bold;text-transform:uppercase}
table.matrix{border-collapse:collapse;background:#fff}
.matrix th,.matrix td{border:1px solid #ccc;padding:0;text-align:center;font-size:13px}
.matrix thead th{padding:6px 10px;background:#eef0f3;white-space:nowrap}
.matrix th.check{text-align:left;padding:6px 10px;white-space:nowrap;font-weight:normal}
.matrix th.check b{font-family:ui-monospace,monospace;margin-right:6px}
.matrix td button{border:0;width:100%;min-width:64px;padding:8px 6px;font:inherit;font-weight:bold;cursor:pointer}
.matrix td.none{color:#aaa;padding:8px 6px}
.matrix td button.selected{outline:3px solid #1f6feb;outline-offset:-3px}
.legend span{display:inline-block;padding:2px 8px;margin-right:6px;border-radius:3px;font-size:12px}
#panel{margin-top:16px;max-width:1100px} .detail{display:none;background:#fff;border:1px solid #ccc;
border-left-width:6px;padding:10px 14px;margin-bottom:8px} .detail.shown{display:block}
.detail h3{margin:0 0 6px;font-size:15px} .detail pre{background:#f4f4f4;padding:8px;overflow:auto;font-size:12px}
.detail .fix{margin:6px 0}
h2{font-size:17px;margin:16px 0 6px}
.problems{max-width:1100px} .problem{background:#fff;border:1px solid #ccc;border-left-width:6px;padding:8px 14px;
margin-bottom:8px} .problem h3{margin:0 0 4px;font-size:15px} .problem h3 b{font-family:ui-monospace,monospace}
.problem .badge{display:inline-block;padding:1px 8px;border-radius:3px;font-size:12px;text-transform:uppercase;
margin-right:6px} .problem .nodes{font-weight:normal;color:#555;overflow-wrap:anywhere}
.problem p{margin:4px 0} .problem .more{color:#555;font-style:italic} .allclear{color:#2e9e5b;font-weight:bold}
.scroll{overflow-x:auto;max-width:100%}
table.plan{border-collapse:collapse;background:#fff;margin-bottom:16px}
.plan th,.plan td{border:1px solid #ccc;padding:4px 8px;text-align:left;font-size:13px;white-space:nowrap}
.plan thead th{background:#eef0f3} .plan td{font-family:ui-monospace,monospace}
.plan td.differs{background:#d9363e;color:#fff;font-weight:bold}
table.links{border-collapse:collapse;background:#fff;margin-bottom:8px}
.links th,.links td{border:1px solid #ccc;padding:3px 6px;text-align:center;font-size:12px;white-space:nowrap;
min-width:44px} .links thead th,.links th.node{background:#eef0f3} .links th.named{background:#d9363e;color:#fff}
.links td.self{background:#eee} .links td.none,.legend span.none{color:#999;border:1px solid #ccc}
.links td.fast,.legend span.fast{background:#2e9e5b;color:#fff}
.links td.slow,.legend span.slow{background:#f0b429;color:#222}
.links td.straggler,.legend span.straggler{background:#e8743b;color:#fff}
.links td.failed,.legend span.failed{background:#d9363e;color:#fff;font-weight:bold}
"""

SCRIPT = """
document.querySelectorAll('table.matrix td button').forEach(function (b) {
  b.addEventListener('click', function () {
    document.querySelectorAll('.detail.shown').forEach(function (d) { d.classList.remove('shown'); });
    document.querySelectorAll('button.selected').forEach(function (x) { x.classList.remove('selected'); });
    b.classList.add('selected');
    b.getAttribute('data-details').split(' ').forEach(function (id) {
      var d = document.getElementById(id); if (d) { d.classList.add('shown'); }
    });
    var first = document.getElementById(b.getAttribute('data-details').split(' ')[0]);
    if (first) { first.scrollIntoView({block: 'nearest'}); }
  });
});
"""


def _style(status: Status) -> str:
    bg, fg = COLORS[status]
    return f"background:{bg};color:{fg}"


# Above this many nodes, the matrix folds the nodes whose every row has the same status into one column
# headed by their range (node[0001-0412,0414-16384]), as the terminal folds identical findings: a page of
# 16,384 columns and as many cells a row helps nobody, and costs seconds and hundreds of megabytes.
MATRIX_FOLD_ABOVE = 1024


class Matrix(NamedTuple):
    """The check x node matrix: check ID -> node -> the check's results there (CONFIG for a result that concerns
    no node), and check ID -> node -> the worst of their statuses."""
    cells: Dict[str, Dict[str, Tuple[Result, ...]]]
    statuses: Dict[str, Dict[str, Status]]


def matrix(results: Sequence[Result]) -> Matrix:
    """The results in their cells. A result's nodes go in at once, sharing one tuple (dict.fromkeys: no Python step
    per node, where 16,384 nodes make 720,000 cells); a node that already has a result of the check (or is named
    twice) gets a tuple of its own."""
    cells: Dict[str, Dict[str, Tuple[Result, ...]]] = {}
    statuses: Dict[str, Dict[str, Status]] = {}
    for r in results:
        row, status = cells.setdefault(r.id, {}), statuses.setdefault(r.id, {})
        nodes = r.nodes or (CONFIG,)
        each = dict.fromkeys(nodes, (r,))
        if len(each) == len(nodes) and row.keys().isdisjoint(each):
            row.update(each)
            status.update(dict.fromkeys(nodes, r.status))
            continue
        for node in nodes:
            row[node] = row.get(node, ()) + (r,)
            status[node] = _worst((status.get(node, r.status), r.status))
    return Matrix(cells, statuses)


def folded_columns(cols: List[str], rows: List[str], found: Matrix) -> List[Tuple[str, List[str]]]:
    """The matrix's columns as (heading, nodes): each column alone up to MATRIX_FOLD_ABOVE nodes, else the
    columns whose status is the same in every row together, in the order of their first."""
    from preflight.report.render import fold_nodes

    if len(cols) - (CONFIG in cols) <= MATRIX_FOLD_ABOVE:
        return [(col, [col]) for col in cols]
    alike: Dict[tuple, List[str]] = {}
    # Each column's statuses, row by row (None: no result there), made by map and zip: no Python step per cell
    by_column = zip(*[map(found.statuses[cid].get, cols) for cid in rows]) if rows else ((),) * len(cols)
    for col, row_statuses in zip(cols, by_column):
        alike.setdefault(row_statuses, []).append(col)
    return [(fold_nodes(members) if len(members) > 1 else members[0], members) for members in alike.values()]


def columns(results: Sequence[Result], nodes: Sequence[str]) -> List[str]:
    """The matrix's columns: CONFIG when some result concerns no node, then the nodes in their order."""
    cols = list(dict.fromkeys(nodes))
    known = set(cols)  # a list's `in` made this quadratic in the nodes
    for r in results:
        if not known.issuperset(r.nodes):  # (nearly every result: no Python step per node)
            for node in r.nodes:
                if node not in known:
                    cols.append(node)
                    known.add(node)
    if any(not r.nodes for r in results):
        cols.insert(0, CONFIG)
    return cols


_DIFFERS = ' class="differs" title="differs from the other nodes"'


def table_html(results: Sequence[Result], e: Callable[[object], str]) -> List[str]:
    """A section for each table in the results' evidence (the launch plan, the census, the checkpoint's files),
    none without one: the cells unlike the other nodes' in red, as in the terminal. `e` escapes, as for the rest
    of the page."""
    from preflight.report.render import evidence_tables, table_cell

    out = []
    for plan in evidence_tables(results):
        out += [f"<h2>{e(plan.title.capitalize())}</h2>", '<table class="plan"><thead><tr>'
                + "".join(f'<th scope="col">{e(c.replace("_", " "))}</th>' for c in plan.columns)
                + "</tr></thead><tbody>"]
        for i, row in enumerate(plan.rows):
            cells = (f'<td{_DIFFERS if (i, j) in plan.differs else ""}>{e(table_cell(v))}</td>'
                     for j, v in enumerate(row))
            out.append(f"<tr>{''.join(cells)}</tr>")
        out.append("</tbody></table>")
    return out


LINK_LEGEND = (("fast", "fast"), ("slow", "slow link"), ("straggler", "a straggler's link"), ("failed", "failed"),
               ("none", "not measured"))


def links_html(results: Sequence[Result], e: Callable[[object], str]) -> List[str]:
    """COL004's node x node matrix as a heat map (render.link_matrix): GB/s in each cell, failed pairs red,
    a straggler's row and column orange, a slow link amber, the nodes COL004 names in red headers."""
    from preflight.report.render import link_matrix

    found = link_matrix(results)
    if not found:
        return []
    out = ["<h2>Links between the nodes (COL004, GB/s point to point)</h2>",
           '<p class="legend">' + "".join(f'<span class="{k}">{e(t)}</span>' for k, t in LINK_LEGEND) + "</p>",
           '<div class="scroll"><table class="links"><thead><tr><th></th>'
           + "".join(f'<th scope="col" class="{"named" if n in found.named else "node"}">{e(n)}</th>'
                     for n in found.nodes) + "</tr></thead><tbody>"]
    for node, row in zip(found.nodes, found.cells):
        head = f'<th scope="row" class="{"named" if node in found.named else "node"}">{e(node)}</th>'
        out.append(f'<tr data-node="{e(node)}">{head}' + "".join(
            f'<td class="{kind}" title="{e(title)}">{e(text)}</td>' for kind, text, title in row) + "</tr>")
    out.append("</tbody></table></div>")
    return out


PROBLEMS_PER_CHECK = 5  # findings of one check listed above the matrix; the rest are in its row


def problems_html(results: Sequence[Result], e: Callable[[object], str]) -> List[str]:
    """The failures, errors and warnings, worst first, each with its message, fix and nodes, readable without a
    click: identical findings on several nodes are one entry with a node range; a check with more than
    PROBLEMS_PER_CHECK different findings (a measured value per node) lists that many and counts the rest."""
    from preflight.report.render import fold, fold_nodes

    problems = fold([r for r in results if r.status in (Status.FAIL, Status.ERROR, Status.WARN)])
    if not problems:
        return ["<h2>Failures and warnings</h2>", '<p class="allclear">No check failed or warned.</p>']
    checks: Dict[Tuple[str, Status], List[Tuple[Result, Tuple[str, ...]]]] = {}  # in fold's order: worst first
    for r, nodes in problems:
        checks.setdefault((r.id, r.status), []).append((r, nodes))
    out = ["<h2>Failures and warnings</h2>", '<div class="problems">']
    for (cid, status), findings in checks.items():
        for r, nodes in findings[:PROBLEMS_PER_CHECK]:
            where = f' <span class="nodes">on {e(fold_nodes(nodes))}</span>' if nodes else ""
            fix = f'<p class="fix"><b>fix:</b> {e(r.remediation)}</p>' if r.remediation else ""
            out.append(f'<div class="problem {status.value}" style="border-left-color:{COLORS[status][0]}">'
                       f'<h3><span class="badge" style="{_style(status)}">{e(status.value)}</span><b>{e(cid)}</b> '
                       f'{e(r.name)}{where}</h3><p class="message">{e(r.message)}</p>{fix}</div>')
        rest = findings[PROBLEMS_PER_CHECK:]
        if rest:
            out.append(f'<p class="more">{e(cid)}: {len(rest)} more {status.value} finding(s) on '
                       f"{sum(len(nodes) for _, nodes in rest)} node(s): see its row in the matrix</p>")
    out.append("</div>")
    return out


def html_report(results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float) -> str:
    """One self-contained page: the failures and warnings with their fixes, then the check x node matrix,
    worst checks first; a click on a cell shows its message, remediation and evidence. Every string from the
    run is escaped."""
    return "\n".join(html_lines(results, verdict, nodes, duration_s)) + "\n"


def html_lines(results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float) -> List[str]:
    """html_report's page, line by line."""
    from preflight.report.render import fold_nodes, summary

    memo: Dict[str, str] = {}  # the same IDs, names, statuses and messages come back on every node

    def e(text) -> str:
        text = str(text)
        found = memo.get(text)
        if found is None:
            found = memo[text] = html.escape(text, quote=True)
        return found

    cols = columns(results, nodes)
    found_in = matrix(results)
    cells = found_in.cells
    names: Dict[str, str] = {}
    worst: Dict[str, Status] = {}  # check ID -> the worst status of its results
    for r in results:
        names.setdefault(r.id, r.name)
        worst[r.id] = _worst((worst.get(r.id, r.status), r.status))
    rows = sorted(cells, key=lambda cid: (SEVERITY[worst[cid]], cid))

    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>preflight: {e(verdict.upper())}</title>", f"<style>{CSS}</style>",
           "<noscript><style>.detail{display:block}</style></noscript></head><body>",
           f'<h1>preflight <span class="verdict" style="{_style(Status(verdict))}">{e(verdict)}</span></h1>',
           f'<div class="meta">{e(summary(results))} in {duration_s:.2f} s; {len(list(dict.fromkeys(nodes)))} node(s); '
           f'{e(time.strftime("%Y-%m-%d %H:%M:%S %Z"))}; {e(DISTRIBUTION)} {e(__version__)}</div>',
           *problems_html(results, e),
           *table_html(results, e),
           *links_html(results, e),
           '<p class="legend">' + "".join(f'<span style="{_style(s)}">{s.value}</span>' for s in
                                          sorted(STATUSES, key=SEVERITY.get)) + " click a cell for the details</p>",
           '<div class="scroll"><table class="matrix"><thead><tr><th>check</th>']
    folded = folded_columns(cols, rows, found_in)  # (its heading, its nodes): one node each, or nodes alike folded
    out += [f'<th class="node" scope="col">{e(label)}</th>' for label, _ in folded]
    out.append("</tr></thead><tbody>")
    details: List[str] = []
    shown: Dict[int, Tuple[str, str]] = {}  # id(result) -> its detail's head and body: the same on each of its nodes

    folded_names: Dict[tuple, str] = {}  # the nodes of a result in a folded column: the same set in many rows

    def folds(nodes: List[str]) -> str:
        if len(nodes) == 1:
            return nodes[0]
        key = tuple(nodes)
        if key not in folded_names:
            folded_names[key] = fold_nodes(nodes)
        return folded_names[key]

    def detail(r: Result, where: str) -> Tuple[str, str]:
        """Its detail's head and body; large evidence (doctor's census) in full only in its first cell's: in each
        of a thousand nodes' cells it would make the page nodes x evidence."""
        if id(r) not in shown:
            fix = f'<p class="fix"><b>fix:</b> {e(r.remediation)}</p>' if r.remediation else ""
            text = indented_json(dict(r.evidence)) if r.evidence else ""
            evidence = f"<pre>{html.escape(text)}</pre>" if text else ""
            again = f'<p class="evidence">evidence: as on {e(where)}</p>' if len(text) > EVIDENCE_ONCE else evidence
            head = f'style="border-left-color:{COLORS[r.status][0]}"><h3>{e(r.status.value.upper())} {e(r.id)} {e(r.name)} on '
            body = f'</h3><p class="message">{e(r.message)}</p>{fix}'
            shown[id(r)] = (head, f"{body}{again}</div>")
            return head, f"{body}{evidence}</div>"
        return shown[id(r)]

    for cid in rows:
        out.append(f'<tr data-check="{e(cid)}"><th class="check" scope="row"><b>{e(cid)}</b>{e(names[cid])}</th>')
        for col, members in folded:
            if len(members) == 1:
                found = cells[cid].get(col)
                on = None
            else:  # each result once, on the nodes of the column it concerns
                there = list(map(cells[cid].get, members))
                if len(set(map(id, there))) == 1:  # the same results (one tuple) on every node of the column
                    on = {id(r): (r, members) for r in there[0] or ()}
                else:
                    on = {}
                    for node, rs in zip(members, there):
                        for r in rs or ():
                            on.setdefault(id(r), (r, []))[1].append(node)
                found = [r for r, _ in on.values()]
            if not found:
                out.append('<td class="none">&ndash;</td>')
                continue
            status = found[0].status if len(found) == 1 else _worst(r.status for r in found)
            ids = []
            for r in sorted(found, key=lambda x: SEVERITY[x.status]) if len(found) > 1 else found:
                ids.append(f"d{len(details)}")
                where = col if on is None else folds(on[id(r)][1])
                head, body = detail(r, where)
                details.append(f'<div class="detail" id="{ids[-1]}" {head}{e(where)}{body}')
            title = f"{e(cid)} on {e(col)}: {e(found[0].message)}"  # escaped in parts: each part repeats
            out.append(f'<td class="cell {status.value}" data-node="{e(col)}"><button type="button" '
                       f'class="{status.value}" style="{_style(status)}" title="{title}" '
                       f'data-details="{" ".join(ids)}">{e(status.value)}</button></td>')
        out.append("</tr>")
    out.append('</tbody></table></div><div id="panel">')
    out += details
    out.append(f"</div><script>{SCRIPT}</script></body></html>")
    return out


def write_html(path: str, results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float) -> None:
    write_file(path, batched(f"{line}\n" for line in html_lines(results, verdict, nodes, duration_s)))


WRITERS = (("junit", "--junit", write_junit), ("prometheus", "--prometheus", write_prometheus),
           ("html", "--html", write_html))


def check_paths(args) -> None:
    """Before the checks run: every report file asked for can be written (else exit 2 naming it)."""
    for attr, option, _ in WRITERS:
        check_writable(option, getattr(args, attr, None))


def write_all(args, results: Sequence[Result], verdict: str, nodes: Sequence[str], duration_s: float) -> None:
    """Every report asked for; one that cannot be written does not keep the others from being written (the
    first problem is then raised: exit 2)."""
    problems = []
    for attr, option, writer in WRITERS:
        path = getattr(args, attr, None)
        if path is None:
            continue
        try:
            writer(path, results, verdict, nodes, duration_s)
        except OSError as exc:
            problems.append(InputError(path, f"{option}: cannot write the report: {exc.strerror or exc}"))
    if problems:
        raise problems[0]
