"""`preflight lint --json` in-process, its results by check ID, and an environment without the SLURM variables of
the shell that runs the tests: what the batch-script and manifest tests share (tests/checks/test_batch_scripts.py,
test_k8s_manifests.py, test_orchestrator_examples.py, tests/cli/test_lint_sbatch.py)."""
from __future__ import annotations

import os
import time

import pytest

from conftest import run_cli
from preflight.inputs.documents import InputError


def lint(capsys, *args):
    """`preflight lint --json ARGS`: (exit code, {check id: [results in order]})."""
    code, doc, err = run_cli(capsys, "lint", "--json", *args)
    assert isinstance(doc, dict), err
    found = {}
    for r in doc["results"]:
        found.setdefault(r["id"], []).append(r)
    return code, found


def statuses(found, check_id):
    return [r["status"] for r in found.get(check_id, [])]


def without_slurm_environment(monkeypatch):
    """sbatch takes SBATCH_* from the environment and the reader knows SLURM_* from it: neither may come from the
    shell the tests run in."""
    for name in list(os.environ):
        if name.startswith(("SBATCH_", "SLURM_")) or name in ("MASTER_ADDR", "MASTER_PORT", "ACCELERATE_DIR"):
            monkeypatch.delenv(name)


def unreadable_files(tmp_path, suffix, max_bytes, text_start=b""):
    """Files no reader may take, each with what its one-line error says: binary data, past max_bytes, a FIFO (a
    read could block), a folder, a missing file."""
    binary, huge, fifo = (tmp_path / f"{name}{suffix}" for name in ("binary", "huge", "pipe"))
    binary.write_bytes(text_start + b"\x00\x01")
    with open(huge, "wb") as handle:
        handle.truncate(max_bytes + 1)
    os.mkfifo(fifo)
    return {binary: "binary data", huge: f"larger than {max_bytes // 2**20} MiB", fifo: "not a regular file",
            tmp_path: "is a directory", tmp_path / f"missing{suffix}": "cannot be read"}


def assert_refused_in_one_line(load, cases):
    """load refuses each path, within seconds, with an InputError of one line that names it and says the problem."""
    for path, problem in cases.items():
        started = time.monotonic()
        with pytest.raises(InputError) as raised:
            load(str(path))
        assert time.monotonic() - started < 5, path
        message = str(raised.value)
        assert message.startswith(str(path)) and problem in message and "\n" not in message, (path, message)


def assert_exit_2_in_one_line(capsys, option, path, problem):
    """`preflight lint OPTION PATH` exits 2 with one line on stderr that names the file and the problem."""
    code, out, err = run_cli(capsys, "lint", option, path)
    assert code == 2
    assert err.count("\n") == 1 and str(path) in err and problem in err, err
    assert "Traceback" not in err
