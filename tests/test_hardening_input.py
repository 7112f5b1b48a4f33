"""Hardening (issue 15): report paths written into what they are, bad input that is exit 2 in bounded time,
secrets kept out of every output."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from conftest import run_cli
from preflight import reports
from test_reports import bad_config  # noqa: F401  (a fixture: pytest finds it by module attribute)

# --- report files: written into what the path is ------------------------------------------------------


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
