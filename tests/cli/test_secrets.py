"""Secrets kept out of every output: names that look secret (by their parts) have their values redacted by
one rule on the head and on the node, and on the real test cluster no secret set in a node's sessions reaches
stdout, stderr, the JSON document or a report file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)

# --- secrets: in no output ----------------------------------------------------------------------------

HF = "hf_" + "Q7x" * 12
SECRETS = {  # set in node02's sessions: each value must be in no output
    "HF_TOKEN": HF,
    "WANDB_BASE_URL": "https://alice:wandbpass123@wandb.example.org",
    "TORCH_HUB_MIRROR": "https://bob:hubpass456@mirror.example.org/hub",  # compared by PKG004: shown in its message
    "TORCH_DB_PASSWD": "passwd789secret",  # compared by PKG004: a name that looks secret
}
SHOWN_NOT = ("wandbpass123", "hubpass456", "passwd789secret", HF, "cmdsecret111", "wandbkey222")


def test_unit_redaction_by_name_parts():
    from preflight.report import redact

    secret = ["HF_TOKEN", "WANDB_API_KEY", "DB_PASSWD", "NCCL_AUTH", "AWS_SECRET_ACCESS_KEY", "--api-key", "--password",
              "GOOGLE_APPLICATION_CREDENTIALS", "trainer.hf_token"]
    plain = ["KEYBOARD", "NCCL_IB_HCA", "HF_HUB_ENABLE_HF_TRANSFER", "TOKENIZERS_PARALLELISM", "PWD", "--max_tokens"]
    assert [n for n in secret + plain if redact.secret_name(n)] == secret
    line = f"env WANDB_API_KEY=k1 python t.py --token a --password=b {HF} https://u:p@h/x KEYBOARD=us --max_tokens 5"
    assert redact.text(line) == ("env WANDB_API_KEY=<redacted> python t.py --token <redacted> --password=<redacted> "
                                 "<redacted> https://<redacted>@h/x KEYBOARD=us --max_tokens 5")


def test_secrets_in_comma_joined_lists_and_http_credentials_are_redacted():
    from preflight.report import redact

    assert redact.text("srun --export=ALL,WANDB_API_KEY=k1,OMP_NUM_THREADS=8 --env A=1,HF_TOKEN=k2 t.py") == \
        "srun --export=ALL,WANDB_API_KEY=<redacted>,OMP_NUM_THREADS=8 --env A=1,HF_TOKEN=<redacted> t.py"
    assert redact.text("HF_TOKEN=k2,A=1") == "HF_TOKEN=<redacted>"  # a shell assignment: all of it is the value
    assert redact.text('curl -H "Authorization: Bearer eyJhbGciOi.x-y_z" -H "Authorization: Basic dXNlcjpw"') == \
        'curl -H "Authorization: Bearer <redacted>" -H "Authorization: Basic <redacted>"'
    assert redact.argv(["curl", "-H", "Authorization: Bearer", "eyJhbGciOi", "u"]) == \
        ["curl", "-H", "Authorization: Bearer", "<redacted>", "u"]
    assert redact.text("the basic configuration, KEYBOARD=us,LANG=C") == "the basic configuration, KEYBOARD=us,LANG=C"


def test_a_secret_in_sbatchs_export_list_is_in_no_output(capsys, tmp_path, monkeypatch):
    # SBATCH_EXPORT overrides the script's --export: the warning that says so quotes both, and redacts the key
    from conftest import run_cli

    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --export=NONE\nsrun python train.py\n")
    monkeypatch.setenv("SBATCH_EXPORT", "ALL,WANDB_API_KEY=wandbkey333,HF_TOKEN=" + HF)
    for fmt in (["--json"], []):
        code, out, err = run_cli(capsys, "lint", "--sbatch", script, "-v", *fmt, "--junit", tmp_path / "j.xml",
                                 "--html", tmp_path / "r.html")
        text = json.dumps(out) + err + (tmp_path / "j.xml").read_text() + (tmp_path / "r.html").read_text()
        assert "SBATCH_EXPORT=ALL,WANDB_API_KEY=<redacted>" in text
        assert "wandbkey333" not in text and HF not in text


def test_the_node_keeps_secret_values_by_the_same_rule(monkeypatch):
    """The collector redacts on the node what the head would: a secret never leaves the node, and a name that
    only contains a secret word (TORCH_KEYBOARD_LAYOUT, HF_HUB_TOKENIZERS_DIR) keeps its value to be compared."""
    from preflight.node import host

    secret = {"HF_TOKEN": HF, "TORCH_DB_PASSWD": "p1", "NCCL_AUTH_FILE": "p2", "HF_API_KEY": "p3"}
    plain = {"TORCH_KEYBOARD_LAYOUT": "us", "HF_HUB_TOKENIZERS_DIR": "/t", "HF_HUB_ENABLE_HF_TRANSFER": "1"}
    for name, value in {**secret, **plain}.items():
        monkeypatch.setenv(name, value)
    env = host.environment()
    assert {n: env[n] for n in secret} == dict.fromkeys(secret, "<redacted>")
    assert {n: env[n] for n in plain} == plain


@pytest.mark.cluster
def test_secrets_are_in_no_output(cluster, tmp_path):
    command = ["--", "env", "WANDB_API_KEY=wandbkey222", "accelerate", "launch", "--num_machines", "3", "train.py",
               "--hf_token", "cmdsecret111"]
    target = ["--hosts", ",".join(cluster.nodes), "--ssh-config", str(cluster.ssh_config), "--python", sys.executable,
              "--only", "PKG,JOB", "--timeout", "20"]
    reports_ = ["--junit", tmp_path / "j.xml", "--html", tmp_path / "r.html", "--prometheus", tmp_path / "m.prom"]
    with cluster.env(cluster.nodes[1], **SECRETS):
        as_json = subprocess.run([sys.executable, "-m", "preflight", "check", *target, "--json", *map(str, reports_),
                                  *command], capture_output=True, text=True, timeout=180)
        terminal = subprocess.run([sys.executable, "-m", "preflight", "check", *target, *command],
                                  capture_output=True, text=True, timeout=180, env=dict(os.environ, NO_COLOR="1"))
    doc = json.loads(as_json.stdout)
    pkg004 = [r for r in doc["results"] if r["id"] == "PKG004" and r["status"] != "pass"]
    assert {r["evidence"]["variable"] for r in pkg004} >= {"TORCH_HUB_MIRROR", "TORCH_DB_PASSWD"}, doc["results"]
    assert any("https://<redacted>@mirror.example.org/hub" in r["message"] for r in pkg004), pkg004
    outputs = {"json": as_json.stdout, "json-stderr": as_json.stderr, "terminal": terminal.stdout,
               "terminal-stderr": terminal.stderr, **{p.name: p.read_text() for p in tmp_path.iterdir()}}
    assert "TORCH_DB_PASSWD" in outputs["terminal"] and "r.html" in outputs
    for name, text in outputs.items():
        for secret in SHOWN_NOT:
            assert secret not in text, f"{secret} in the {name} output"
