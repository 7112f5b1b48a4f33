"""`preflight node --budget/--drain/--undrain` without a SLURM: the budget bounds the run, and scontrol is
called with a list of arguments (a fake scontrol on PATH records them). The real SLURM: tests/cli/test_slurm.py."""
import os
import sys
import socket
import time
from pathlib import Path

from conftest import run_cli, run_subprocess

from preflight import runner
from preflight.registry import CheckSpec
from preflight.result import Finding, Status


def test_budget_run_fits_and_reports(capsys):
    started = time.monotonic()
    code, doc, _ = run_cli(capsys, "node", "--budget", "10", "--json")
    assert time.monotonic() - started < 10
    assert doc["verdict"] in ("pass", "warn", "fail") and code in (0, 1)
    assert not [r for r in doc["results"] if "budget" in r["message"]]  # everything fitted


def test_gathering_past_the_budget_is_an_error_not_a_pass(capsys):
    # A real hang: an NTP "server" on loopback that never answers (ntplib waits up to 5 s for it).
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.2", 123))
    try:
        started = time.monotonic()
        code, doc, err = run_cli(capsys, "node", "--budget", "1", "--ntp-server", "127.0.0.2", "--json")
        elapsed = time.monotonic() - started
    finally:
        silent.close()
    assert elapsed < 1 + 0.3, elapsed
    node_results = [r for r in doc["results"] if r["nodes"]]
    assert node_results and all(r["status"] == "error" for r in node_results)
    assert all("not gathered within the budget of 1 s" in r["message"] for r in node_results)
    assert doc["verdict"] == "fail" and code == 1
    assert "did not fit the budget of 1 s" in err


def _spec(check_id, func, scope="config"):
    return CheckSpec(check_id, f"x-{check_id.lower()}", scope, (), "w", "y", "f", func, "test")


def test_a_check_past_the_budget_is_skipped_and_later_ones_too():
    def quick(ctx):
        yield Finding(Status.PASS, "quick")

    def slow(ctx):
        time.sleep(2)
        yield Finding(Status.PASS, "slow")

    ctx = runner.CheckContext(plan=None)
    started = time.monotonic()
    results = runner.run([_spec("TST001", quick), _spec("TST002", slow), _spec("TST003", quick)], ctx,
                         deadline=time.monotonic() + 0.3, budget_s=0.3)
    assert time.monotonic() - started < 0.5
    assert [(r.id, r.status.value) for r in results] == [("TST001", "pass"), ("TST002", "skip"), ("TST003", "skip")]
    assert results[1].message == "budget of 0.3 s spent"


def test_whole_command_within_budget_in_a_subprocess():
    started = time.monotonic()
    proc = run_subprocess("node", "--budget", "3", "--json")
    assert time.monotonic() - started < 3 + 1.0  # the interpreter's start-up is the slack
    assert proc.returncode in (0, 1), proc.stderr


# --- drain / undrain with a fake scontrol -------------------------------------------------------

FAKE = r'''#!/bin/sh
# records each argument on its own line, then answers `show node` from $FAKE_SHOW
for a in "$@"; do printf '%s\n' "$a"; done >> "$FAKE_LOG"
echo --- >> "$FAKE_LOG"
if [ "$1" = show ]; then cat "$FAKE_SHOW"; fi
'''


def fake_scontrol(tmp_path, show=""):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(FAKE)
    (bindir / "scontrol").chmod(0o755)
    (tmp_path / "show").write_text(show)
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "log"),
           "FAKE_SHOW": str(tmp_path / "show"), "SLURMD_NODENAME": "gpu07"}
    return env, tmp_path / "log"


def calls(log: Path):
    text = log.read_text() if log.exists() else ""
    return [c.strip("\n").split("\n") for c in text.split("---\n") if c.strip()]


def test_drain_on_fail_with_the_first_failure_as_reason(tmp_path):
    env, log = fake_scontrol(tmp_path)
    proc = run_subprocess("node", "--drain", "--only", "FS002", "--checkpoint-dir", str(tmp_path / "missing" / ("d" * 120)),
                          env=env)
    assert proc.returncode == 1
    [call] = calls(log)
    assert call[:3] == ["update", "NodeName=gpu07", "State=DRAIN"]
    assert call[3].startswith("Reason=preflight: FS002 checkpoint-dir: the checkpoint folder ")
    assert len(call[3]) - len("Reason=") <= 100 and len(call) == 4
    assert "drained SLURM node gpu07" in proc.stderr


def test_no_drain_when_the_node_is_fine(tmp_path):
    env, log = fake_scontrol(tmp_path)
    proc = run_subprocess("node", "--drain", "--only", "FS001", env=env)
    assert proc.returncode == 0, proc.stderr
    assert calls(log) == []


def test_undrain_only_what_preflight_drained(tmp_path):
    show = ("NodeName=gpu07 Arch=x86_64 CoresPerSocket=1\n   State=IDLE+DRAIN ThreadsPerCore=1\n"
            "   Reason=preflight: FS001 dev-shm: /dev/shm is 64 MiB [root@2026-01-01T00:00:00]\n")
    env, log = fake_scontrol(tmp_path, show)
    proc = run_subprocess("node", "--undrain", "--only", "FS001", env=env)
    assert proc.returncode == 0, proc.stderr
    assert calls(log) == [["show", "node", "gpu07"], ["update", "NodeName=gpu07", "State=RESUME"]]
    assert "returned to service" in proc.stderr

    (tmp_path / "show").write_text(show.replace("preflight: FS001 dev-shm", "maintenance by bob"))
    log.unlink()
    proc = run_subprocess("node", "--undrain", "--only", "FS001", env=env)
    assert proc.returncode == 0
    assert calls(log) == [["show", "node", "gpu07"]]  # looked, left it
    assert "stays drained" in proc.stderr and "maintenance by bob" in proc.stderr


def test_drain_without_scontrol_is_exit_2(tmp_path):
    env = {"PATH": str(tmp_path)}  # no scontrol anywhere
    for flag in ("--drain", "--undrain"):
        proc = subprocess_run(flag, env)
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "scontrol" in proc.stderr


def subprocess_run(flag, env):
    import subprocess

    return subprocess.run([sys.executable, "-m", "preflight", "node", flag], capture_output=True, text=True,
                          timeout=60, env=env)


def test_check_slurm_uses_srun_only_inside_an_allocation(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from preflight.remote.early import transport_for as _transport

    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    check = SimpleNamespace(command="check", slurm=True)
    assert _transport(check) == "ssh"  # not in an allocation
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert _transport(check) == "srun"
    assert _transport(SimpleNamespace(command="launch", slurm=True)) == "ssh"  # launch starts over SSH
    assert _transport(SimpleNamespace(command="check", slurm=False, hosts="a,b")) == "ssh"
