"""The one rule for a name that looks secret (preflight.node.secret), as the facts, the census of a running job
and every report apply it: a value under such a name never leaves the node, and never reaches a report."""
import os
import subprocess
import sys
import time

import pytest

from preflight.node import census, host
from preflight.node.secret import REDACTED, secret_name
from preflight.report import redact

SECRET = ["HF_TOKEN", "WANDB_API_KEY", "DB_PASSWD", "NCCL_AUTH", "--password", "trainer.hf_token", "aws_secret",
          "MY_CREDENTIALS", "api-key"]
NOT_SECRET = ["KEYBOARD", "TOKENIZERS_PARALLELISM", "NCCL_IB_HCA", "NCCL_IB_PKEY", "PWD", "OLDPWD", "MONKEY_PATCH"]


@pytest.mark.parametrize("name", SECRET)
def test_names_that_look_secret(name):
    assert secret_name(name)


@pytest.mark.parametrize("name", NOT_SECRET)
def test_names_that_do_not(name):
    assert not secret_name(name)


def test_the_facts_the_census_and_the_reports_redact_by_the_same_rule(monkeypatch):
    env = {"NCCL_SOCKET_TOKEN": "s3cret", "NCCL_IB_PKEY": "0x8001", "TORCH_NCCL_AUTH_KEY": "s3cret",
           "NCCL_DEBUG": "INFO"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    facts = host.environment()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=dict(os.environ, **env))
    try:
        for _ in range(100):  # until the child's environment is readable
            seen = census._job_env(proc.pid)
            if seen and "NCCL_DEBUG" in seen:
                break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    for name, value in env.items():
        expected = REDACTED if secret_name(name) else value
        assert facts[name] == expected, (name, facts[name])
        assert seen[name] == expected, (name, seen[name])
        assert redact.value(name, value) == expected
    assert seen["NCCL_IB_PKEY"] == "0x8001"  # a partition key is no secret: doctor shows it
