"""The terminal report reads at a glance: failures, errors and warnings first with their fixes, a line per check
that passed (its nodes folded), the skips as one line counted by reason, the verdict last; `-v` lists every
result; `--json` keeps every result."""
import io
import json
import re
import subprocess
import sys

from conftest import run_cli
from test_registry_and_runner import run_on_a_terminal
from preflight.report import render
from preflight.result import Result, Status

NODES = [f"n{i:02d}" for i in range(1, 65)]


def R(id_, status, nodes=(), message="ok", fix=None, name=None):
    return Result(id_, name or id_.lower(), Status(status), tuple(nodes), message, fix, {}, 0.0)


# A 64-node run: one node's clock off, a check that raised, a warning everywhere, passes on every node (one
# check with a message per node), and skips for several reasons.
RESULTS = (
    [R("NET001", "pass", (n,), f"hostname {n!r} resolves to 10.0.0.{i}") for i, n in enumerate(NODES)]
    + [R("CLK001", "pass", (n,), "within 1 ms") for n in NODES if n != "n07"]
    + [R("CLK001", "fail", ("n07",), "clock is +5 s from the head's", "synchronise this node's clock")]
    + [R("GPU001", "error", ("n03",), "check GPU001 raised KeyError: 'x'", "report it")]
    + [R("CLK002", "warn", tuple(NODES), "the clock is unsynchronised", "start chrony")]
    + [R("GPU003", "skip", (n,), f"no GPU facts on this node: NVML cannot start on {n}") for n in NODES]
    + [R(f"RUN00{i}", "skip", (), "no census of a running job (run `preflight doctor`)") for i in range(1, 4)]
    + [R("CFG091", "skip", (), "accelerate is not importable here (No module named 'x': really); install it")]
)


def report(results=RESULTS, verdict="fail", verbose=False):
    stream = io.StringIO()  # not a terminal: plain text
    render.terminal(results, verdict, 1.0, stream=stream, verbose=verbose)
    return stream.getvalue().splitlines()


def test_problems_first_with_fixes_then_a_line_per_passing_check_then_the_skips_then_the_verdict():
    lines = report()
    assert lines == [
        "FAIL  CLK001 clk001 [n07]  clock is +5 s from the head's",
        "      fix: synchronise this node's clock",
        "ERROR GPU001 gpu001 [n03]  check GPU001 raised KeyError: 'x'",
        "      fix: report it",
        "WARN  CLK002 clk002 [n[01-64]]  the clock is unsynchronised",
        "      fix: start chrony",
        "PASS  CLK001 clk001 [n[01-06,08-64]]  within 1 ms",
        "PASS  NET001 net001 [n[01-64]]  passed with 64 different messages (-v lists them)",
        "68 skipped: 64 no GPU facts on this node, 3 no census of a running job (run `preflight doctor`), "
        "1 accelerate is not importable here (No module named 'x': really); install it",
        "verdict: FAIL  1 failed, 1 error, 64 warnings, 127 passed, 68 skipped in 1.00 s",  # a result per node
    ]


def test_verbose_lists_every_result_folded_by_finding():
    lines = report(verbose=True)
    assert lines[-1].startswith("verdict: FAIL")
    assert not any("skipped:" in line for line in lines)
    assert sum(line.startswith("SKIP  GPU003") for line in lines) == 64  # a message per node: a line each
    assert "SKIP  RUN001 run001  no census of a running job (run `preflight doctor`)" in lines
    assert sum(line.startswith("PASS  NET001") for line in lines) == 64
    assert "PASS  CLK001 clk001 [n[01-06,08-64]]  within 1 ms" in lines
    # worst first, as without -v
    order = [line.split()[0] for line in lines if not line.startswith((" ", "verdict"))]
    assert order == sorted(order, key=["FAIL", "ERROR", "WARN", "SKIP", "PASS"].index)


def test_many_skip_reasons_stay_one_line_naming_the_commonest():
    skips = [R(f"X{i:03d}", "skip", (), f"reason {i}") for i in range(8) for _ in range(i + 1)]
    lines = report(skips, "pass")
    assert lines[:-1] == ["36 skipped: 8 reason 7, 7 reason 6, 6 reason 5, 5 reason 4, 4 reason 3; "
                          "6 more for 3 other reasons (-v lists every skip)"]
    assert report([R("A001", "pass")], "pass") == ["PASS  A001 a001  ok", "verdict: PASS  1 passed in 1.00 s"]


def test_the_skip_reason_is_the_statement_before_its_explanation():
    assert render.skip_reason("this machine alone: no other node's launch to compare") == "this machine alone"
    assert render.skip_reason("no --model given (nor model in the profile's [memory]): the estimate needs it") == \
        "no --model given (nor model in the profile's [memory])"
    assert render.skip_reason("deepspeed is not importable here (No module named 'deepspeed': x)") == \
        "deepspeed is not importable here (No module named 'deepspeed': x)"
    assert render.skip_reason("no --shared-dir given") == "no --shared-dir given"


def test_the_skip_reason_of_a_message_about_a_file_is_its_statement_not_the_file():
    assert render.skip_reason("job.yaml:3: no pod asks for RDMA (no NCCL_IB_HCA): x") == \
        "no pod asks for RDMA (no NCCL_IB_HCA)"
    assert render.skip_reason("/ckpt/global_step1: saved without DeepSpeed") == "saved without DeepSpeed"
    assert render.skip_reason("deepspeed: not importable") == "deepspeed"
    assert render.skip_reason("a.b: " * 20000 + "no x") == "no x"  # a node's path of any length: no recursion


def on_a_terminal(args):
    """`preflight ARGS` with stdout on a pseudo-terminal, as a person runs it: (the text without its colours,
    whether it was coloured)."""
    text = run_on_a_terminal(args, {"TERM": "xterm-256color"})
    return re.sub(r"\x1b\[[0-9;]*m", "", text).replace("\r\n", "\n"), "\x1b[" in text


def test_check_on_this_machine_on_a_terminal_folds_and_v_lists(tmp_path):
    """The real `preflight check` on this machine: dozens of skips become one line; -v lists them; --json and
    the report files keep every result."""
    out, coloured = on_a_terminal(["check", "--junit", tmp_path / "j.xml"])
    lines = out.strip().splitlines()
    assert coloured
    assert lines[-1].startswith("verdict: ")
    skipped = int(re.search(r"(\d+) skipped in", lines[-1]).group(1))
    assert skipped > 10  # a machine without GPUs, a job or a cluster: most checks do not apply
    assert not any(line.startswith("SKIP ") for line in lines)
    assert lines[-2].startswith(f"{skipped} skipped: ") and "this machine alone" in lines[-2]
    passing = [line.split()[1] for line in lines if line.startswith("PASS ")]
    assert passing and len(passing) == len(set(passing))  # one line per check

    proc = subprocess.run([sys.executable, "-m", "preflight", "check", "--json"], capture_output=True, text=True,
                          timeout=120)
    doc = json.loads(proc.stdout)
    assert sum(r["status"] == "skip" for r in doc["results"]) == skipped  # every skip kept, one result each
    import xml.etree.ElementTree as ET

    cases = list(ET.parse(tmp_path / "j.xml").getroot().iter("testcase"))
    assert sum(c.find("skipped") is not None for c in cases) == skipped

    verbose, _ = on_a_terminal(["check", "-v"])
    listed = {line.split()[1] for line in verbose.splitlines() if line.startswith("SKIP ")}
    assert verbose.strip().splitlines()[-1].split()[:2] == lines[-1].split()[:2]  # the same verdict
    assert "skipped:" not in verbose
    assert listed == {r["id"] for r in doc["results"] if r["status"] == "skip"}


def test_lint_report_and_verbose(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}')
    code, out, _ = run_cli(capsys, "lint", "--deepspeed", ds, "--world-size", "16")
    lines = out.splitlines()
    assert code == 1 and lines[0].startswith("FAIL  CFG030 batch-size") and lines[1].startswith("      fix: ")
    assert lines[-1].startswith("verdict: FAIL") and "skipped:" in lines[-2]
    assert not any(line.startswith("SKIP ") for line in lines)
    code, out_v, _ = run_cli(capsys, "lint", "--deepspeed", ds, "--world-size", "16", "--verbose")
    assert code == 1 and any(line.startswith("SKIP ") for line in out_v.splitlines())
