"""`preflight check --json` against the test cluster (tests/cluster.py) as the family tests run it."""
import json
import subprocess
import sys

from conftest import preflight_json

# This machine's kernel clock is not disciplined by any time daemon, and the test hosts share its kernel:
# CLK002 warns on every node here, truthfully. The healthy runs leave it out and check it separately.
# The all-reduce (COL, seconds per run) has its own tests in checks/test_col.py.
HEALTHY_SKIP = "deep,CLK002,COL"


def check(cluster, *extra, skip=HEALTHY_SKIP, hosts=None):
    """(the JSON document, seconds) of `preflight check` over the cluster's nodes (or `hosts`)."""
    args = ["check", "--hosts", hosts or ",".join(cluster.nodes), "--ssh-config", cluster.ssh_config,
            "--python", sys.executable, *extra]
    return preflight_json(*args, *(["--skip", skip] if skip else []))


def not_passing(doc):
    return sorted((r["id"], r["status"], tuple(r["nodes"]), r["message"]) for r in doc["results"]
                  if r["status"] not in ("pass", "skip"))


def check_code(cluster, *extra, python=sys.executable, timeout="20", nodes=None):
    """`preflight check --json` as a user runs it: (exit code, document, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "preflight", "check", "--hosts", ",".join(nodes or cluster.nodes),
                           "--ssh-config", str(cluster.ssh_config), "--python", str(python), "--timeout", timeout,
                           *extra, "--json"], capture_output=True, text=True, timeout=240)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def clean(stderr):
    assert "Traceback" not in stderr and "Exception in thread" not in stderr, stderr
