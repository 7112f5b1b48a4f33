"""The oldest Python pyproject.toml allows (3.9): the core installs there and runs, and profiles are read with
tomli (tomllib is 3.11+), the one dependency only older Pythons take."""
import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

OLDEST = "python3.9"


def oldest_python():
    """python3.9 on PATH, else one that pyenv installed but did not select (its shim then refuses to run)."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    for python in [shutil.which(OLDEST)] + sorted(glob.glob(str(pyenv / "versions" / "3.9*" / "bin" / OLDEST))):
        if python and subprocess.run([python, "-c", "pass"], capture_output=True).returncode == 0:
            return python
    return None


@pytest.fixture(scope="module")
def old_preflight(dist, tmp_path_factory):
    """The `preflight` command of a fresh virtual environment of the oldest Python, the wheel installed."""
    python = oldest_python()
    if python is None:
        pytest.skip(f"no {OLDEST} here (on PATH or installed by pyenv)")
    venv = tmp_path_factory.mktemp("py39") / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                              "--disable-pip-version-check", str(dist[0])], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    return venv / "bin" / "preflight"


def test_the_core_runs_and_reads_a_profile_with_tomli(old_preflight, tmp_path):
    profile = tmp_path / "preflight.toml"
    profile.write_text("[thresholds]\nshm_warn_mib = 100000000\n")
    proc = subprocess.run([str(old_preflight), "node", "--json", "--profile", str(profile)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    doc = json.loads(proc.stdout)
    [shm] = [r for r in doc["results"] if r["id"] == "FS001"]
    assert shm["status"] == "warn", shm  # the profile's threshold, read by tomli, took effect
    assert "Traceback" not in proc.stderr


def test_a_bad_profile_is_one_line_naming_file_line_and_key(old_preflight, tmp_path):
    profile = tmp_path / "preflight.toml"
    profile.write_text("[thresholds]\nclock_warn_s = 0.1\nno_such_key = 1\n")
    proc = subprocess.run([str(old_preflight), "node", "--profile", str(profile)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and str(profile) in proc.stderr and "no_such_key" in proc.stderr
    assert ":3" in proc.stderr  # the line, found in tomli's text the same way as in tomllib's
