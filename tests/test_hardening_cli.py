"""Hardening of the command line and the head's side (issue 15): numbers and selectors refused as bad input,
a skip that would hide a failure, signals, relative paths, non-UTF-8 words, and `launch`'s streaming."""
import json
import os
import subprocess
import sys

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from conftest import preflight_json, results

PREFLIGHT = [sys.executable, "-m", "preflight"]


def run(*args, **kwargs):
    kwargs.setdefault("timeout", 120)
    return subprocess.run([*PREFLIGHT, *map(str, args)], capture_output=True, text=True, **kwargs)


# --- bad numbers and selectors: exit 2, one line, before anything starts --------------------------------------

@pytest.mark.parametrize("args", [
    ["check", "--timeout", "inf"], ["check", "--timeout", "nan"], ["check", "--timeout", "1e300"],
    ["check", "--timeout", "-1"], ["doctor", "--timeout", "1e300"], ["node", "--budget", "1e300"],
    ["node", "--budget", "inf"], ["check", "--clock-warn", "inf"], ["check", "--clock-fail", "1e300"],
    ["check", "--min-busbw", "inf"], ["check", "--min-busbw", "nan"],
    ["check", "--fanout", "99999999999999999999"], ["check", "--world-size", "1" * 5000],
    ["check", "--col-procs-per-node", "100000"], ["doctor", "--pid", "99999999999"], ["check", "--port", "70000"],
    ["check", "--only", ","], ["check", "--only", ""], ["check", "--only", "CLK,"], ["check", "--skip", ""],
    ["check", "--skip", "CLK,,NET"], ["node", "--only", " "], ["doctor", "--skip", ","], ["lint", "--only", ","],
])
def test_unbounded_numbers_and_empty_selectors_are_bad_input(args):
    proc = run(*args, "--hosts" if args[0] in ("check", "doctor") else "--json",
               *(["nohost.invalid"] if args[0] in ("check", "doctor") else []))
    assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preflight: error:"), proc.stderr
    assert proc.stdout == ""


def test_a_host_twice_in_the_hostfile_is_said(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nohost1.invalid slots=1\nnohost1.invalid slots=2\n")
    proc = run("check", "--hostfile", hostfile, "--only", "SSH001", "--timeout", "2", "--json")
    assert f"{hostfile}:2: host 'nohost1.invalid' is listed again (first on line 1)" in proc.stderr
    assert json.loads(proc.stdout)["nodes"] == ["nohost1.invalid"]


def test_a_host_twice_in_hosts_is_bad_input():
    proc = run("check", "--hosts", "nohost1.invalid,nohost1.invalid", "--only", "SSH001")
    assert proc.returncode == 2 and "listed twice" in proc.stderr, proc.stderr


# --- a skip that hides a failure is not a pass (the real test cluster) ----------------------------------------

def check(cluster, *extra):
    return preflight_json("check", "--hosts", ",".join(cluster.nodes), "--ssh-config", cluster.ssh_config,
                          "--python", sys.executable, "--timeout", "5", *extra)


@pytest.mark.cluster
def test_col_alone_with_the_heads_port_dropped_is_not_a_pass(cluster):
    head = cluster.nodes[0]
    with cluster.dropped_port(head, 29500):
        doc, _ = check(cluster, "--only", "COL")
    assert doc["verdict"] == "fail", doc["results"]
    for r in doc["results"]:  # COL001 and COL002 could not run: an error that names NET004, which saw why
        assert r["status"] == "error" and "NET004" in r["message"] and "not selected" in r["message"], r
    with cluster.dropped_port(head, 29500):  # with NET004 selected, it fails and the COL skips point at it
        doc, _ = check(cluster, "--only", "COL,NET004")
    statuses = {(r["id"], r["status"]) for r in doc["results"]}
    assert ("NET004", "fail") in statuses and ("COL001", "skip") in statuses and ("COL002", "skip") in statuses


@pytest.mark.cluster
def test_net004_alone_with_the_port_taken_on_the_head_is_not_a_pass(cluster):
    head = cluster.nodes[0]
    holder = cluster.node_popen(head, [sys.executable, "-c", "import socket, time; s = socket.socket(); "
                                       "s.bind(('0.0.0.0', 29500)); s.listen(); time.sleep(60)"])
    try:
        for _ in range(50):
            if ":29500 " in cluster.netns_exec(head, ["ss", "-ltn"]).stdout:
                break
            import time
            time.sleep(0.1)
        doc, _ = check(cluster, "--only", "NET004")
    finally:
        os.killpg(holder.pid, 9)
        holder.wait()
    (r,) = doc["results"]
    assert r["status"] == "error" and "NET003" in r["message"], r


@pytest.mark.cluster
def test_an_unreached_node_is_not_a_pass_without_ssh001(cluster):
    down = cluster.nodes[2]
    with cluster.stopped_sshd(down):
        doc, _ = check(cluster, "--only", "CLK001,NET002")
        assert doc["verdict"] == "fail"
        for check_id in ("CLK001", "NET002"):
            r = results(doc, check_id)[down]
            assert r["status"] == "error" and "SSH001" in r["message"] and "refused" in r["message"], r
        doc, _ = check(cluster, "--only", "CLK")  # CLK002 (a node check) errs on it; CLK001 need not repeat it
        assert results(doc, "CLK002")[down]["status"] == "error"
        assert down not in results(doc, "CLK001")
        doc, _ = check(cluster, "--only", "SSH001,CLK")  # SSH001 says why: the others skip, as before
        assert results(doc, "SSH001")[down]["status"] == "fail"
        assert results(doc, "CLK002")[down]["status"] == "skip"


# --- SIGTERM and SIGHUP are interruptions: exit 130, every cleanup done ---------------------------------------

# A node whose filesystem hangs on reading the shared folder's token (a stale NFS mount): node03's sessions
# import this (PYTHONPATH), which says when the read has begun (so the token is on the shared folder) and hangs.
HANGING_READ = """
import builtins, os, time
_open = builtins.open
def open(file, mode="r", *args, **kwargs):
    if ".preflight-" in str(file) and "r" in mode:
        _open(os.environ["PF_TEST_MARKER"], "w").close()
        time.sleep(120)
    return _open(file, mode, *args, **kwargs)
builtins.open = open
"""


def preflight_processes(cluster) -> list:
    """The processes preflight started on the nodes (the shipped bootstrap), by their namespaces' lists."""
    from preflight.remote.shipping import BOOTSTRAP

    found = []
    for node in cluster.nodes:
        for pid in cluster_pids(cluster, node):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if BOOTSTRAP.encode() in cmdline:
                found.append((node, pid, cmdline[:80]))
    return found


def session_processes(cluster, node) -> list:
    """The SSH sessions on the node (sshd's per-connection processes): none once preflight has closed its own."""
    found = []
    for pid in cluster_pids(cluster, node):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").strip()
        except OSError:
            continue
        if cmdline.startswith(b"sshd:") and b"@" in cmdline:
            found.append((pid, cmdline))
    return found


def cluster_pids(cluster, node):
    from cluster import testcluster

    return testcluster.netns_pids(cluster.netns(node))


def wait_for(predicate, seconds: float, what: str, proc=None):
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        assert proc is None or proc.poll() is None, (what, proc.communicate())
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.cluster
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_during_check_is_an_interruption_that_cleans_up(cluster, tmp_path, sig):
    import signal
    import time

    shared, site, marker = tmp_path / "shared", tmp_path / "site", tmp_path / "reading"
    shared.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(HANGING_READ)
    slow = cluster.nodes[2]
    with cluster.env(slow, PYTHONPATH=str(site), PF_TEST_MARKER=str(marker)):
        proc = subprocess.Popen([*PREFLIGHT, "check", "--hosts", ",".join(cluster.nodes), "--ssh-config",
                                 str(cluster.ssh_config), "--python", sys.executable, "--timeout", "60",
                                 "--shared-dir", str(shared), "--only", "FS004"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(marker.exists, 60, "node03 reading the token", proc)
            assert list(shared.glob(".preflight-*"))  # the token is there: its removal is pending
            assert session_processes(cluster, slow)  # and the sessions are open
            sent = time.monotonic()
            proc.send_signal(getattr(signal, sig))
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert time.monotonic() - sent < 15
    assert proc.returncode == 130, (out, err)
    assert "preflight: interrupted" in err and "Traceback" not in err
    assert list(shared.iterdir()) == []  # the head removed its token
    for node in cluster.nodes:  # the head's sessions are closed, and the hung collector with its session
        wait_for(lambda: session_processes(cluster, node) == [], 10, f"the sessions on {node} to close")
    wait_for(lambda: not preflight_processes(cluster), 10, "no preflight process left on the nodes")


@pytest.mark.cluster
def test_sigterm_during_doctor_is_an_interruption(cluster, tmp_path):
    import signal

    site, marker = tmp_path / "site", tmp_path / "census"
    site.mkdir()
    # the census reads /proc: hang there on node03, once it has begun
    (site / "sitecustomize.py").write_text(HANGING_READ.replace('".preflight-" in str(file) and "r" in mode',
                                                                '"/proc/" in str(file) and "r" in mode'))
    slow = cluster.nodes[2]
    with cluster.env(slow, PYTHONPATH=str(site), PF_TEST_MARKER=str(marker)):
        proc = subprocess.Popen([*PREFLIGHT, "doctor", "--hosts", ",".join(cluster.nodes), "--ssh-config",
                                 str(cluster.ssh_config), "--python", sys.executable, "--timeout", "60"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(marker.exists, 60, "node03 taking its census", proc)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, (out, err)
    for node in cluster.nodes:
        wait_for(lambda: session_processes(cluster, node) == [], 10, f"the sessions on {node} to close")
    wait_for(lambda: not preflight_processes(cluster), 10, "no preflight process left on the nodes")


def test_sigterm_and_sighup_during_node_are_interruptions(tmp_path):
    import signal

    site, marker = tmp_path / "site", tmp_path / "storage"
    site.mkdir()
    # `node` gathers in-process: a checkpoint folder whose filesystem hangs (statvfs of a stale mount)
    (site / "sitecustomize.py").write_text(
        "import os, time\n_statvfs = os.statvfs\n"
        "def statvfs(path):\n"
        "    if str(path).endswith('hung-mount'):\n"
        "        open(os.environ['PF_TEST_MARKER'], 'w').close()\n"
        "        time.sleep(120)\n"
        "    return _statvfs(path)\n"
        "os.statvfs = statvfs\n")
    (tmp_path / "hung-mount").mkdir()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        marker.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONPATH=str(site), PF_TEST_MARKER=str(marker))
        proc = subprocess.Popen([*PREFLIGHT, "node", "--checkpoint-dir", str(tmp_path / "hung-mount")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(marker.exists, 60, "the checkpoint folder's statvfs", proc)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 130, (sig, out, err)
        assert err.strip().endswith("preflight: interrupted") and "Traceback" not in err


# --- relative paths are the job's: from its working directory on every node -----------------------------------

@pytest.mark.cluster
def test_relative_folders_are_read_from_the_jobs_working_directory_on_every_node(cluster, tmp_path):
    import uuid

    run_dir = tmp_path / "run"
    names = {what: f"{what}-{uuid.uuid4().hex[:8]}" for what in ("ckpt", "shared", "nvme")}
    for name in names.values():  # nowhere but in the job's directory (not in the sessions' home)
        (run_dir / name).mkdir(parents=True)
    (run_dir / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": names["nvme"]}}}))
    proc = subprocess.run([*PREFLIGHT, "check", "--hosts", ",".join(cluster.nodes), "--ssh-config",
                           str(cluster.ssh_config), "--python", sys.executable, "--timeout", "10",
                           "--checkpoint-dir", names["ckpt"], "--shared-dir", names["shared"], "--deepspeed", "ds.json",
                           "--only", "FS002,FS003,FS004", "--json"], cwd=run_dir, capture_output=True, text=True,
                          timeout=120)
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "pass", doc["results"]
    for check_id, name in (("FS002", "ckpt"), ("FS003", "nvme")):
        by_node = results(doc, check_id)
        assert set(by_node) == set(cluster.nodes)
        for r in by_node.values():
            assert r["status"] == "pass" and r["evidence"]["path"] == str(run_dir / names[name]), r
    assert results(doc, "FS004")[cluster.nodes[1]]["message"] == f"{run_dir / names['shared']} is shared"
    assert list((run_dir / names["shared"]).iterdir()) == []


# --- a working directory or an argument that is not UTF-8 ------------------------------------------------------

@pytest.mark.cluster
def test_launch_from_a_non_utf8_directory_with_a_non_utf8_argument(cluster, tmp_path):
    from test_launch import ACCELERATE, QUIET

    workdir = os.path.join(os.fsencode(tmp_path), b"caf\xe9-run")  # Latin-1: not UTF-8
    os.mkdir(workdir)
    with open(os.path.join(workdir, b"show.py"), "w") as script:
        script.write("import os, socket, sys\nprint('ARGS', socket.gethostname(), os.fsencode(os.getcwd()).hex(), "
                     "os.fsencode(sys.argv[1]).hex(), flush=True)\n")
    argv = [os.fsencode(sys.executable), b"-m", b"preflight", b"launch", b"--hosts", ",".join(cluster.nodes).encode(),
            b"--ssh-config", os.fsencode(cluster.ssh_config), b"--python", os.fsencode(sys.executable), b"--skip",
            b"deep,CLK002,COL", b"--timeout", b"10", b"--", os.fsencode(ACCELERATE), b"launch", b"--cpu",
            b"--num_processes", b"1", *[w.encode() for w in QUIET], b"show.py", b"\xff\xfeoctets"]
    proc = subprocess.run(argv, cwd=workdir, capture_output=True, timeout=180)
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    arg = b"\xff\xfeoctets".hex()
    for node in cluster.nodes:  # every node ran in that directory, with that argument, byte for byte
        assert f"[{node}] ARGS {node} {workdir.hex()} {arg}" in out, out[-3000:]


@pytest.mark.cluster
def test_check_from_a_non_utf8_directory_never_fails_on_our_side(cluster, tmp_path):
    workdir = os.path.join(os.fsencode(tmp_path), b"caf\xe9-check")
    os.mkdir(workdir)
    argv = [os.fsencode(sys.executable), b"-m", b"preflight", b"check", b"--hosts", ",".join(cluster.nodes).encode(),
            b"--ssh-config", os.fsencode(cluster.ssh_config), b"--python", os.fsencode(sys.executable), b"--skip",
            b"deep,CLK002,COL", b"--timeout", b"10", b"--checkpoint-dir", b"ckpt\xff"]
    for extra in ([], [b"--json"]):
        proc = subprocess.run(argv + extra, cwd=workdir, capture_output=True, timeout=180)
        err = proc.stderr.decode(errors="replace")
        assert proc.returncode in (0, 1), err[-3000:]
        assert "Traceback" not in err and "internal error" not in err
