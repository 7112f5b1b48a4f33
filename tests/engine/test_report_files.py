"""The report files: --junit (JUnit XML), --prometheus (textfile collector), --html (one page), and a
screenshot of the page in headless Chromium."""
import json
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
import zlib
from html.parser import HTMLParser

import pytest
from hypothesis import given, settings, strategies as st

from conftest import run_cli
import preflight
from preflight import engine
from preflight.report import files as reports
from preflight.result import Result, Status

HOSTILE = "<script>alert(1)</script>"


def R(id_, status, nodes=(), message="ok", fix=None, evidence=None, name=None, duration=0.25):
    return Result(id_, name or id_.lower(), Status(status), tuple(nodes), message, fix, evidence or {}, duration)


RESULTS = [
    R("CFG001", "fail", (), "unknown key 'foo' & <bar>", "remove the key 'foo'", {"file": "a.yaml", "line": 3},
      name="accelerate-keys"),
    R("CFG030", "pass", (), "batch sizes agree", name="batch-size"),
    R("CLK001", "pass", ("n1", "n2"), "within 1 ms", evidence={"offset_s": 0.001, "bound_s": 0.0002},
      name="clock-skew"),
    R("CLK001", "warn", ("n3",), "0.3 s ahead", "run chrony", {"offset_s": -0.3, "bound_s": 0.001},
      name="clock-skew"),
    R("COL001", "pass", ("n1", "n2", "n3"), "busbw 12.5 GB/s", evidence={"busbw_gbps": 12.5, "algbw_gbps": 9.4},
      name="allreduce"),
    R("GPU001", "pass", ("n1",), "8 GPUs", evidence={"count": 8, "usable": 8}, name="gpu-count"),
    R("GPU001", "fail", ("n2",), "4 GPU(s) usable", "lower num_processes", {"count": 4, "usable": 4},
      name="gpu-count"),
    R("GPU001", "error", ("n3",), "check GPU001 raised KeyError: 'x'", "report it", name="gpu-count"),
    R("SSH001", "skip", ("n3",), "not reached", name="ssh-reachable"),
]
NODES = ("n1", "n2", "n3")


# --- JUnit ----------------------------------------------------------------------------------------

def test_junit_has_one_testcase_per_check_and_node(tmp_path):
    path = tmp_path / "out.xml"
    reports.write_junit(str(path), RESULTS, "fail", NODES, 1.5)
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite" and suite.get("name") == "preflight"
    cases = suite.findall("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("CFG001 accelerate-keys", "config"), ("CFG030 batch-size", "config"),
        ("CLK001 clock-skew", "n1"), ("CLK001 clock-skew", "n2"), ("CLK001 clock-skew", "n3"),
        ("COL001 allreduce", "n1"), ("COL001 allreduce", "n2"), ("COL001 allreduce", "n3"),
        ("GPU001 gpu-count", "n1"), ("GPU001 gpu-count", "n2"), ("GPU001 gpu-count", "n3"),
        ("SSH001 ssh-reachable", "n3"),
    ]
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("12", "2", "1", "1")
    assert float(suite.get("time")) == pytest.approx(1.5)
    assert all(float(c.get("time")) == pytest.approx(0.25) for c in cases)
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props == {"preflight": preflight.__version__, "verdict": "fail", "nodes": "n1,n2,n3"}  # the build that wrote it

    failures = [(c.get("classname"), c.get("name"), c.find("failure")) for c in cases if c.find("failure") is not None]
    assert [(cls, node) for cls, node, _ in failures] == [("CFG001 accelerate-keys", "config"), ("GPU001 gpu-count", "n2")]
    assert failures[0][2].get("message") == "unknown key 'foo' & <bar>"  # escaped on write, intact on read
    assert failures[0][2].text == "remove the key 'foo'"
    error = cases[10].find("error")
    assert error.get("message") == "check GPU001 raised KeyError: 'x'" and error.text == "report it"
    skipped = cases[11].find("skipped")
    assert skipped.get("message") == "not reached"
    for passing in (cases[1], cases[2], cases[8]):
        assert passing.find("failure") is None and passing.find("error") is None and passing.find("skipped") is None
    assert "WARN 0.3 s ahead" in cases[4].find("system-out").text
    assert json.loads(cases[0].find("system-err").text.split(": ", 1)[1]) == {"file": "a.yaml", "line": 3}


def test_junit_survives_control_characters(tmp_path):
    path = tmp_path / "out.xml"
    reports.write_junit(str(path), [R("CFG003", "fail", (), "tag \x00\x1b[31m here", "fix \x07 it")], "fail", (), 0.1)
    failure = ET.parse(path).getroot().find("testcase/failure")
    assert failure.get("message") == "tag \\x00\\x1b[31m here" and failure.text == "fix \\x07 it"


# --- Prometheus -----------------------------------------------------------------------------------

def parse_prom(path):
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(path.read_text())}


def samples(family):
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def test_prometheus_textfile(tmp_path):
    path = tmp_path / "preflight.prom"
    before = time.time()
    reports.write_prometheus(str(path), RESULTS, "fail", NODES, 2.5)
    families = parse_prom(path)
    assert {f.type for f in families.values()} == {"gauge"}
    status = samples(families["preflight_check_status"])
    assert samples(families["preflight_info"]) == {(("version", preflight.__version__),): 1}
    lbl = lambda check, name, node, s: (("check", check), ("name", name), ("node", node), ("status", s))  # noqa: E731
    assert status[lbl("GPU001", "gpu-count", "n2", "fail")] == 1
    assert status[lbl("GPU001", "gpu-count", "n2", "pass")] == 0
    assert status[lbl("GPU001", "gpu-count", "n3", "error")] == 1
    assert status[lbl("CFG001", "accelerate-keys", "config", "fail")] == 1
    assert status[lbl("CLK001", "clock-skew", "n3", "warn")] == 1
    # one sample per status for each check and node, exactly one of them 1
    pairs = {(k[0][1], k[2][1]) for k in status}
    assert len(pairs) == 12 and len(status) == 12 * 5
    for check, node in pairs:
        assert sum(v for k, v in status.items() if (k[0][1], k[2][1]) == (check, node)) == 1

    assert samples(families["preflight_verdict"]) == {(("verdict", "pass"),): 0, (("verdict", "warn"),): 0,
                                                      (("verdict", "fail"),): 1}
    stamp = families["preflight_last_run_timestamp_seconds"].samples[0].value
    assert before - 1 <= stamp <= time.time() + 1
    assert families["preflight_duration_seconds"].samples[0].value == 2.5
    assert samples(families["preflight_clock_offset_seconds"]) == {
        (("check", "CLK001"), ("node", "n1")): 0.001, (("check", "CLK001"), ("node", "n2")): 0.001,
        (("check", "CLK001"), ("node", "n3")): -0.3}
    assert samples(families["preflight_collective_busbw_gbps"]) == {
        (("check", "COL001"), ("node", n)): 12.5 for n in NODES}
    assert samples(families["preflight_gpu_count"]) == {(("node", "n1"),): 8, (("node", "n2"),): 4}
    assert [p.name for p in tmp_path.iterdir()] == ["preflight.prom"]  # no temporary file left behind


def test_prometheus_fresh_registry_and_no_gpu_metric_without_gpu_evidence(tmp_path):
    path = tmp_path / "a.prom"
    reports.write_prometheus(str(path), RESULTS, "fail", NODES, 1.0)
    # a second run in the same process: no "Duplicated timeseries" from a shared registry, and it
    # replaces the file with this run's figures only
    reports.write_prometheus(str(path), [R("CFG030", "pass", name="batch-size")], "pass", (), 0.5)
    families = parse_prom(path)
    assert "preflight_gpu_count" not in families and "preflight_clock_offset_seconds" not in families
    assert samples(families["preflight_verdict"])[(("verdict", "pass"),)] == 1
    assert len(families["preflight_check_status"].samples) == 5


def test_the_values_per_node_are_written_as_prometheus_client_writes_them():
    """gauge_lines writes the gauges per node itself (a Gauge child per node costs most of a second at 16,384
    nodes): the same text as a prometheus_client Gauge of those samples, odd node names and values included."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    nodes = ["n1", 'a"b', "back\\slash", "new\nline", "\u00e9t\u00e9", "config", "n2"]
    values = [0.001, -0.3, float("nan"), float("inf"), -float("inf"), -0.0, 1e22, 123456789.5, 2.5e-7, 8.0, 1e300]
    for labelnames in (("check", "node"), ("node",)):
        samples = {(*(("CLK001",) if len(labelnames) == 2 else ()), node): values[i % len(values)]
                   for i, node in enumerate(nodes * 2)}
        registry = CollectorRegistry()
        gauge = Gauge("preflight_x", "what it is (CLK evidence)", list(labelnames), registry=registry)
        for labels, value in samples.items():
            gauge.labels(*labels).set(value)
        written = "".join(reports.gauge_lines("preflight_x", "what it is (CLK evidence)", labelnames, samples))
        assert written == generate_latest(registry).decode()
    assert list(reports.gauge_lines("preflight_x", "none", ("node",), {})) == []


def test_prometheus_worst_status_wins_for_one_check_on_one_node(tmp_path):
    path = tmp_path / "a.prom"
    results = [R("GPU001", "pass", ("n1",)), R("GPU001", "fail", ("n1",), "lost"), R("GPU001", "warn", ("n1",))]
    reports.write_prometheus(str(path), results, "fail", ("n1",), 1.0)
    status = {s.labels["status"]: s.value for s in parse_prom(path)["preflight_check_status"].samples}
    assert status == {"pass": 0, "warn": 0, "fail": 1, "skip": 0, "error": 0}


# --- HTML -----------------------------------------------------------------------------------------

class Page(HTMLParser):
    """The matrix (header, rows of (check, [(cell class, text)])), every tag seen, and all text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.header, self.rows, self.tags, self.text, self.details = [], [], [], [], {}
        self._cell = self._detail = None
        self._in_head = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "thead":
            self._in_head = True
        elif tag == "tr" and not self._in_head:
            self.rows.append([attrs.get("data-check"), []])
        elif tag in ("th", "td"):
            self._cell = [attrs.get("class"), "", None]
        elif tag == "button" and self._cell is not None:  # a cell with a result: its status and details
            self._cell[0], self._cell[2] = attrs.get("class"), attrs.get("data-details")
        elif tag == "div" and "detail" in (attrs.get("class") or "").split():
            self._detail = attrs["id"]
            self.details[self._detail] = ""

    def handle_endtag(self, tag):
        if tag == "thead":
            self._in_head = False
        elif tag in ("th", "td") and self._cell is not None:
            if self._in_head:
                self.header.append(self._cell[1].strip())
            elif tag == "td":
                self.rows[-1][1].append(tuple(self._cell))
            self._cell = None
        elif tag == "div" and self._detail:
            self._detail = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell[1] += data
        if self._detail:
            self.details[self._detail] += data


def parse_html(text):
    page = Page()
    page.feed(text)
    page.close()
    return page


def test_html_matrix(tmp_path):
    path = tmp_path / "report.html"
    reports.write_html(str(path), RESULTS, "fail", NODES, 1.0)
    page = parse_html(path.read_text())
    assert page.header == ["check", "config", "n1", "n2", "n3"]
    assert f"preflight-multinode {preflight.__version__}</div>" in path.read_text()  # the build that wrote it
    # failures first (CFG001, GPU001), then warnings, then skips, then passes
    assert [row[0] for row in page.rows] == ["CFG001", "GPU001", "CLK001", "SSH001", "CFG030", "COL001"]
    cells = {row[0]: [(c[0], c[1].strip()) for c in row[1]] for row in page.rows}
    assert cells["GPU001"] == [("none", "\u2013"), ("pass", "pass"), ("fail", "fail"), ("error", "error")]
    assert cells["CFG001"] == [("fail", "fail"), ("none", "\u2013"), ("none", "\u2013"), ("none", "\u2013")]
    assert cells["CLK001"] == [("none", "\u2013"), ("pass", "pass"), ("pass", "pass"), ("warn", "warn")]
    # the n2 GPU001 cell opens the detail with its message, remediation and evidence
    n2 = [c for c in page.rows[1][1] if c[0] == "fail"][0]
    detail = page.details[n2[2]]
    assert "4 GPU(s) usable" in detail and "lower num_processes" in detail and '"usable": 4' in detail
    # distinct colours per status
    styles = {a["class"]: a["style"] for t, a in page.tags if t == "button"}
    assert len({styles[s] for s in ("fail", "error", "warn", "skip", "pass")}) == 5


def test_html_escapes_everything_and_loads_nothing(tmp_path):
    path = tmp_path / "report.html"
    results = [R("CFG001", "fail", (), HOSTILE, f"fix {HOSTILE}", {"key": HOSTILE}, name=f"n{HOSTILE}"),
               R("NET001", "warn", ('"><img src=x onerror=alert(1)>',), HOSTILE)]
    reports.write_html(str(path), results, "fail", ('"><img src=x onerror=alert(1)>',), 1.0)
    text = path.read_text()
    page = parse_html(text)
    assert [t for t, _ in page.tags].count("script") == 1  # ours only
    assert not any(t == "img" for t, _ in page.tags)
    assert HOSTILE in "".join(page.text)  # shown as text
    assert page.header == ["check", "config", '"><img src=x onerror=alert(1)>']
    for tag, attrs in page.tags:  # self-contained: nothing fetched
        assert tag not in ("link", "img", "iframe"), tag
        for name, value in attrs.items():
            assert not (name in ("src", "href") and value), (tag, attrs)
    assert "http://" not in text and "https://" not in text


class Problems(HTMLParser):
    """The entries of the failures-and-warnings section: (status, check, nodes, message, fix), and its counts
    of the rest."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.entries, self.more, self._entry, self._part = [], [], None, None

    def handle_starttag(self, tag, attrs):
        cls = (dict(attrs).get("class") or "").split()
        if tag == "div" and "problem" in cls:
            self._entry = {"status": cls[1], "check": "", "nodes": "", "message": "", "fix": ""}
        elif tag == "p" and "more" in cls:
            self.more.append("")
            self._part = "more"
        elif self._entry is not None and tag in ("span", "p"):
            self._part = cls[0] if cls else None  # badge, nodes, message, fix
        elif self._entry is not None and tag == "b" and self._part is None:  # the check ID, in the heading
            self._part = "check"

    def handle_endtag(self, tag):
        if tag == "div" and self._entry is not None:
            self.entries.append(tuple(self._entry[k].strip() for k in ("status", "check", "nodes", "message", "fix")))
            self._entry = None
        if tag in ("span", "p") or (tag == "b" and self._part == "check"):
            self._part = None

    def handle_data(self, data):
        if self._part == "more":
            self.more[-1] += data
        elif self._entry is not None and self._part in self._entry:
            self._entry[self._part] += data


def problems_of(text):
    page = Problems()
    page.feed(text)
    page.close()
    return page


def test_html_failures_and_warnings_above_the_matrix_without_a_click():
    text = reports.html_report(RESULTS, "fail", NODES, 1.0)
    assert 0 < text.index("<h2>Failures and warnings</h2>") < text.index('class="matrix"')
    page = problems_of(text)
    assert page.entries == [
        ("fail", "CFG001", "", "unknown key 'foo' & <bar>", "fix: remove the key 'foo'"),
        ("fail", "GPU001", "on n2", "4 GPU(s) usable", "fix: lower num_processes"),
        ("error", "GPU001", "on n3", "check GPU001 raised KeyError: 'x'", "fix: report it"),
        ("warn", "CLK001", "on n3", "0.3 s ahead", "fix: run chrony"),
    ]
    assert page.more == []
    # shown, not hidden until a click: no entry inside a .detail (display:none)
    assert ".problem{" in text and ".problems{" in text and "display:none" not in text.split(".problems{")[1].split("}")[0]
    clean = reports.html_report([R("CFG030", "pass", (), "fine")], "pass", (), 1.0)
    assert problems_of(clean).entries == [] and "No check failed or warned." in clean


def big_run(n_nodes):
    """A run on n_nodes nodes: the same failure on three nodes, a warning on all, a measured value per node
    that warns on every node (a message each), a check that errors on one, passes and skips everywhere."""
    nodes = [f"gpu{i:04d}" for i in range(1, n_nodes + 1)]
    bad = set(nodes[1:4]) if n_nodes > 1 else set(nodes)
    results = [R("FS001", "fail" if n in bad else "pass", (n,),
                 "/dev/shm is 64 MiB, expected at least 512 MiB" if n in bad else "/dev/shm is 16 GiB",
                 "mount -o remount,size=16G /dev/shm" if n in bad else None, name="dev-shm") for n in nodes]
    results.append(R("CLK002", "warn", nodes, "the kernel reports the clock unsynchronised", "start chrony",
                     name="clock-synchronised"))
    results += [R("CLK001", "warn", (n,), f"clock is +{0.1 + i / 1e4:.4f} s from the head's", "run chrony",
                  name="clock-skew") for i, n in enumerate(nodes)]
    results.append(R("GPU004", "error", nodes[-1:], "check GPU004 raised KeyError: 'temp'", "report it",
                     name="gpu-health"))
    for c in range(12):
        results += [R(f"SYS{c:03d}", "pass" if c % 3 else "skip", (n,), "ok" if c % 3 else "no GPU facts",
                      name="sys") for n in nodes]
    return results, nodes


def test_html_problems_stay_short_on_1024_nodes():
    results, nodes = big_run(1024)
    page = problems_of(reports.html_report(results, "fail", nodes, 1.0))
    assert [(s, c, n) for s, c, n, _, _ in page.entries[:2]] == [("fail", "FS001", "on gpu[0002-0004]"),
                                                                 ("error", "GPU004", "on gpu1024")]
    assert page.entries[0][3:] == ("/dev/shm is 64 MiB, expected at least 512 MiB",
                                   "fix: mount -o remount,size=16G /dev/shm")
    clocks = [e for e in page.entries if e[1] == "CLK001"]
    assert len(clocks) == reports.PROBLEMS_PER_CHECK  # a message per node: the first few, and a count
    assert page.more == ["CLK001: 1019 more warn finding(s) on 1019 node(s): see its row in the matrix"]
    assert ("warn", "CLK002", "on gpu[0001-1024]", "the kernel reports the clock unsynchronised",
            "fix: start chrony") in page.entries
    assert len(page.entries) == 2 + reports.PROBLEMS_PER_CHECK + 1


def browse(browser, page, tmp_path, name, size=(1200, 800)):
    """Chromium on the page: its screenshot (PNG bytes) and the DOM after load, with the page's layout measured
    by one script added to a copy of it (the page itself loads nothing)."""
    shot, probe = tmp_path / f"{name}.png", tmp_path / f"{name}-measured.html"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={size[0]},{size[1]}"]
    proc = subprocess.run(flags + [f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                          timeout=180)
    assert shot.exists(), proc.stderr[-2000:]
    measure = ("<script>window.addEventListener('load', function () { var d = document.documentElement, "
               "p = document.querySelector('.problems, .allclear').getBoundingClientRect(), "
               "m = document.querySelector('table.matrix').getBoundingClientRect(); "
               "document.body.setAttribute('data-layout', [d.scrollWidth, d.scrollHeight, Math.round(p.bottom), "
               "Math.round(m.top)].join(' ')); });</script>")
    probe.write_text(page.read_text().replace("</body>", measure + "</body>"))
    proc = subprocess.run(flags + ["--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=180)
    found = re.search(r'data-layout="(\d+) (\d+) (-?\d+) (-?\d+)"', proc.stdout)
    assert found, proc.stderr[-2000:]
    return shot.read_bytes(), proc.stdout, tuple(int(x) for x in found.groups())


def colours(data):
    width, height, channels, rows = png_pixels(data)
    counts = {}
    for row in rows:
        for i in range(0, len(row), channels):
            px = row[i:i + 3]
            counts[px] = counts.get(px, 0) + 1
    return (width, height), counts


@pytest.mark.parametrize("n_nodes", [1, 1024])
def test_html_failures_readable_in_chromium_at_1_and_1024_nodes(tmp_path, n_nodes):
    """Headless Chromium on the real page: the failure, its fix and its nodes are in the rendered DOM and on the
    first screen, above the matrix; the page is no wider than the window (the matrix scrolls in its box) and
    its height stays bounded at 1,024 nodes."""
    browser = chromium()
    results, nodes = big_run(n_nodes)
    page = tmp_path / "report.html"
    reports.write_html(str(page), results, "fail", nodes, 1.0)
    shot, dom, (width, height, problems_bottom, matrix_top) = browse(browser, page, tmp_path, f"{n_nodes}-nodes")
    where = "gpu0001" if n_nodes == 1 else "gpu[0002-0004]"
    entries = problems_of(dom).entries
    assert ("fail", "FS001", f"on {where}", "/dev/shm is 64 MiB, expected at least 512 MiB",
            "fix: mount -o remount,size=16G /dev/shm") == entries[0]
    assert width <= 1200, width  # 1,024 columns scroll inside the matrix's box, the page stays readable
    assert problems_bottom <= matrix_top  # the problems above the matrix
    assert problems_bottom < 1500, problems_bottom  # a few screens at most, however many nodes
    assert height < (1500 if n_nodes == 1 else 4000), height  # the rows of the matrix, not the nodes, set it
    size, painted = colours(shot)
    assert size == (1200, 800) and len(painted) > 20  # not blank: text, borders, badges
    fail_red = bytes.fromhex(reports.COLORS[Status.FAIL][0][1:])
    assert painted.get(fail_red, 0) > 300, painted.get(fail_red, 0)  # the failure's badge and border on screen


# --- the command line -----------------------------------------------------------------------------

@pytest.fixture
def bad_config(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n"
                    "no_such_key: 1\n")
    return path


def test_lint_writes_all_three_with_the_terminal_report(tmp_path, capsys, bad_config):
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, _ = run_cli(capsys, "lint", "--config", bad_config, "--junit", out / "j.xml",
                              "--prometheus", out / "m.prom", "--html", out / "r.html")
    assert code == 1 and "verdict: FAIL" in stdout
    suite = ET.parse(out / "j.xml").getroot()
    assert int(suite.get("failures")) >= 1 and {c.get("name") for c in suite.iter("testcase")} == {"config"}
    assert samples(parse_prom(out / "m.prom")["preflight_verdict"])[(("verdict", "fail"),)] == 1
    assert parse_html((out / "r.html").read_text()).header == ["check", "config"]
    assert sorted(p.name for p in out.iterdir()) == ["j.xml", "m.prom", "r.html"]


def test_json_stays_one_document_with_reports(tmp_path, capsys, bad_config):
    code, doc, _ = run_cli(capsys, "lint", "--config", bad_config, "--json", "--junit", tmp_path / "j.xml")
    assert doc["verdict"] == "fail"
    assert int(ET.parse(tmp_path / "j.xml").getroot().get("tests")) == len(doc["results"])


@pytest.mark.parametrize("option", ["--junit", "--prometheus", "--html"])
@pytest.mark.parametrize("where", ["missing-folder", "directory"])
def test_unwritable_report_is_exit_2_before_any_check(tmp_path, capsys, monkeypatch, option, where):
    target = tmp_path / "nope" / "r.out" if where == "missing-folder" else tmp_path
    monkeypatch.setattr(engine, "gather_for", lambda *a, **k: pytest.fail("gathered before checking the report path"))
    from preflight import runner

    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("ran checks before checking the report path"))
    code, out, err = run_cli(capsys, "check", option, target)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(target) in lines[0] and option in lines[0], err
    assert "Traceback" not in err


def test_node_and_launch_accept_the_options(tmp_path):
    from conftest import run_subprocess

    for command in (["node"], ["launch", "--strict"]):
        proc = run_subprocess(*command, "--only", "SYS001", "--junit", tmp_path / "j.xml",
                              *(["--", "true"] if command[0] == "launch" else []))
        assert proc.returncode == 0, proc.stderr
        cases = ET.parse(tmp_path / "j.xml").getroot().findall("testcase")
        assert [c.get("classname") for c in cases] == ["SYS001 open-files"]
        (tmp_path / "j.xml").unlink()


# --- a screenshot in headless Chromium ------------------------------------------------------------

def png_pixels(data):
    """Decode an 8-bit RGB or RGBA PNG (what Chromium writes): (width, height, channels, rows of bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    channels = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 1:
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif kind == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
        elif kind == 3:
            for i in range(stride):
                line[i] = (line[i] + ((line[i - channels] if i >= channels else 0) + prev[i]) // 2) & 0xFF
        elif kind == 4:
            for i in range(stride):
                a = line[i - channels] if i >= channels else 0
                b, c = prev[i], prev[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows


def chromium():
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if os.geteuid() == 0:
        pytest.fail("chromium is not installed: scripts/test installs it (apt-get install chromium)")
    pytest.skip("chromium is not installed and this is not root: apt-get install --no-install-recommends chromium")


def test_html_screenshot_shows_the_matrix(tmp_path):
    browser = chromium()
    report = tmp_path / "report.html"
    reports.write_html(str(report), RESULTS, "fail", NODES, 1.0)
    data, _, _ = browse(browser, report, tmp_path, "shot")
    assert len(data) > 10_000
    size, pixels = colours(data)
    assert size == (1200, 800)
    assert len(pixels) > 20  # not one colour: text, borders, cells
    # the status colours of the cells are painted (each cell is at least 64 x 30 pixels)
    for status in (Status.FAIL, Status.ERROR, Status.WARN, Status.PASS):
        rgb = bytes.fromhex(reports.COLORS[status][0][1:])
        assert pixels.get(rgb, 0) > 1000, (status, pixels.get(rgb, 0))


@settings(derandomize=True, max_examples=300)
@given(st.text(alphabet='&<>"\r\n\t a\'é\x00\U0001f600', max_size=20))
def test_xml_escaping_is_the_standard_librarys(text):
    """reports.escape stands in for xml.sax.saxutils.escape (which costs 20 ms of imports at start-up)."""
    from xml.sax.saxutils import escape as standard

    assert reports.escape(text) == standard(text)
    assert reports.escape(text, reports._ATTRIBUTE) == standard(text, reports._ATTRIBUTE)


def lint_to(capsys, config, *report):
    code, out, err = run_cli(capsys, "lint", "--config", config, *report)
    return code, out, err


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_symlinks_are_followed_and_modes_kept(tmp_path, capsys, bad_config, umask_027):
    target = tmp_path / "real.xml"
    target.write_text("old")
    os.chmod(target, 0o600)
    link = tmp_path / "link.xml"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.prom"
    dangling.symlink_to(tmp_path / "made.prom")
    code, _, err = lint_to(capsys, bad_config, "--junit", link, "--prometheus", dangling, "--html", tmp_path / "new.html")
    assert code == 1, err
    assert link.is_symlink() and dangling.is_symlink()  # the links stay links: their targets are written
    assert target.read_text().startswith("<?xml") and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert "preflight_verdict" in (tmp_path / "made.prom").read_text()
    assert stat.S_IMODE((tmp_path / "made.prom").stat().st_mode) == 0o640  # 0666 less the umask
    assert stat.S_IMODE((tmp_path / "new.html").stat().st_mode) == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_fifo_is_written_in_place(tmp_path, capsys, bad_config):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got = {}

    def reader():
        with open(fifo, "rb") as f:
            got["data"] = f.read()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    code, _, err = lint_to(capsys, bad_config, "--junit", fifo)
    thread.join(10)
    assert code == 1, err
    assert got["data"].startswith(b"<?xml") and got["data"].endswith(b"</testsuite>\n")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_fifo_nobody_reads_is_exit_2_in_bounded_time(tmp_path, capsys, bad_config, monkeypatch):
    monkeypatch.setattr(reports, "FIFO_WAIT_S", 0.5)
    fifo = tmp_path / "nobody.fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    code, _, err = lint_to(capsys, bad_config, "--junit", fifo, "--html", tmp_path / "r.html")
    assert code == 2 and time.monotonic() - started < 5
    assert err.count("\n") == 1 and str(fifo) in err and "FIFO" in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (tmp_path / "r.html").exists()  # the other report is written


def test_character_devices_are_written_in_place(tmp_path, capsys, bad_config):
    null = tmp_path / "null"  # our own node for /dev/null's device: the real /dev is never touched
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    code, _, err = lint_to(capsys, bad_config, "--junit", null, "--prometheus", null, "--html", null)
    assert code == 1, err
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.lstat(null).st_rdev == os.makedev(1, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accelerate.yaml", "null"]


def test_own_stdout_is_written_in_place(tmp_path, bad_config):
    """/dev/fd/1 (as /dev/stdout, which is never touched here): the report follows the terminal's, in the
    pipe or in the file that `>` opened."""
    argv = [sys.executable, "-m", "preflight", "lint", "--config", str(bad_config), "--junit", "/dev/fd/1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "verdict: FAIL" in proc.stdout and proc.stdout.rstrip().endswith("</testsuite>")
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.PIPE, text=True, timeout=60)
    text = out.read_text()
    assert proc.returncode == 1 and text.index("verdict: FAIL") < text.index("<?xml"), text


@pytest.mark.parametrize("kind", ["directory", "socket", "loop"])
def test_other_file_types_are_exit_2_before_any_check(tmp_path, capsys, kind):
    path = tmp_path / "r.xml"
    if kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    else:
        path.symlink_to(tmp_path / "other")
        (tmp_path / "other").symlink_to(path)
    code, out, err = run_cli(capsys, "lint", "--junit", path)
    assert code == 2 and out == "" and err.count("\n") == 1 and str(path) in err, err
    assert os.path.lexists(path) and not (os.path.exists(path) and stat.S_ISREG(os.lstat(path).st_mode))


def test_the_matrix_of_more_nodes_than_a_page_can_show_folds_the_nodes_alike_into_one_column():
    """Above MATRIX_FOLD_ABOVE nodes, the nodes whose status is the same in every row are one column headed by
    their range; each of their results is shown once, on the nodes it concerns; an odd node keeps its column."""
    n = reports.MATRIX_FOLD_ABOVE + 76
    names = [f"node{i:04d}" for i in range(1, n + 1)]
    healthy = [x for x in names if x != "node0500"]
    results = [R("CFG001", "pass"), R("FS001", "pass", tuple(healthy), "room"),
               R("FS001", "fail", ("node0500",), "64 MiB", "give it room"),
               *[R("NET001", "pass", (x,), f"{x} resolves") for x in names]]
    page = reports.html_report(results, "fail", names, 1.0)
    headings = re.findall(r'<th class="node" scope="col">([^<]*)</th>', page)
    assert headings == ["config", "node[0001-0499,0501-1100]", "node0500"]
    cells = re.findall(r'<td class="cell (\w+)" data-node="([^"]*)"', page)
    assert ("fail", "node0500") in cells and ("pass", "node[0001-0499,0501-1100]") in cells
    assert page.count('class="detail"') == 2 + 1 + n  # each result once: CFG001, both FS001, each NET001
    assert "<h3>PASS FS001 fs001 on node[0001-0499,0501-1100]</h3>" in page
    assert '<h3>PASS NET001 net001 on node0042</h3><p class="message">node0042 resolves</p>' in page
    small = reports.html_report(results[:1] + [R("NET001", "pass", (x,)) for x in names[:reports.MATRIX_FOLD_ABOVE]],
                                "pass", names[:reports.MATRIX_FOLD_ABOVE], 1.0)
    assert len(re.findall(r'<th class="node"', small)) == reports.MATRIX_FOLD_ABOVE + 1  # config and every node


def test_a_terminal_table_of_more_rows_than_a_screen_shows_those_that_differ_and_counts_the_rest():
    from preflight.report import render

    rows = [{"node": f"n{i:05d}", "machine_rank": i, "config_sha": "b" if i in (3, 5000) else "a"} for i in range(6000)]
    [table] = render.evidence_tables([R("JOB001", "pass", evidence={"launch_plan": rows})])
    text = "\n".join("".join(part for part, _ in line) for line in render.table_lines(table, color=False))
    shown = [line for line in text.splitlines() if line.strip().startswith("n0")]
    assert len(shown) == render.TABLE_ROWS and shown[0].split()[0] == "n00000"
    assert any(line.startswith("  n05000") and line.rstrip().endswith("b*") for line in shown)  # past the first rows
    assert f"... and {6000 - render.TABLE_ROWS:,} more rows (the JSON report, --json, has every row)" in text
    small = render.evidence_tables([R("JOB001", "pass", evidence={"launch_plan": rows[:render.TABLE_ROWS]})])[0]
    assert "more rows" not in "".join(p for line in render.table_lines(small, False) for p, _ in line)


def test_large_evidence_of_a_result_on_many_nodes_is_written_once_in_junit_and_html():
    """doctor's census table is RUN001's evidence on every node: in each node's test case and cell it made the
    files nodes x census (gigabytes at a few hundred nodes). Written once, on the first node; small evidence stays
    on every node as it was."""
    nodes = tuple(f"n{i:03d}" for i in range(300))
    census = [{"node": n, "pid": 1000 + k, "kind": "rank", "rank": k} for k, n in enumerate(nodes * 3)]
    results = [R("RUN001", "pass", nodes, "900 processes", evidence={"census": census}),
               R("FS001", "pass", nodes, "room", evidence={"free_bytes": 1})]
    xml = reports.junit(results, "pass", nodes, 1.0).decode()
    assert xml.count('"rank": 899') == 1 and xml.count("evidence: as in the test case of n000") == 299
    assert xml.count('evidence: {"free_bytes": 1}') == 300
    assert len(xml) < 40 * len(json.dumps(census))
    page = reports.html_report(results, "pass", nodes, 1.0)
    assert page.count('&quot;rank&quot;: 899') == 1 and page.count("evidence: as on n000</p>") == 299
    assert page.count("&quot;free_bytes&quot;: 1") == 300


SCALAR = st.one_of(st.text(max_size=8), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                   st.none())


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.dictionaries(st.text(max_size=6), st.one_of(SCALAR, st.lists(SCALAR, max_size=3),
                                                      st.dictionaries(st.text(max_size=3), SCALAR, max_size=2)),
                       max_size=6))
def test_evidence_is_indented_as_json_indents_it(evidence):
    """The HTML report's evidence: a flat mapping (scalars, lists of scalars) through the C encoder item by item,
    anything else through json.dumps; the same text either way (NaN, infinities, -0.0, non-ASCII keys and values,
    nesting)."""
    assert reports.indented_json(evidence) == json.dumps(evidence, indent=2, default=str, sort_keys=True)
