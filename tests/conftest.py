import json
import os
import subprocess
import sys

import pytest

from preflight.cli import main


@pytest.fixture(autouse=True)
def no_default_accelerate_config(tmp_path_factory, monkeypatch):
    """Keep a developer's ~/.cache/huggingface/accelerate/default_config.yaml out of the tests."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


def run_cli(capsys, *args):
    """The CLI in-process: (exit code, parsed JSON document or stdout text, stderr)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in args else out), err


def run_subprocess(*args, env=None, **kwargs):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "preflight", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=full_env, **kwargs)
