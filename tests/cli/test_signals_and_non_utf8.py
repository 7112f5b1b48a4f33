"""SIGTERM, SIGHUP and SIGINT are interruptions (exit 130, every cleanup done: on the nodes and here) during
check, doctor and node; and a working directory or an argument that is not UTF-8 never fails on preflight's
side (check and launch over the real test cluster)."""
import json
import os
import subprocess
import sys

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from conftest import signalled_child

PREFLIGHT = [sys.executable, "-m", "preflight"]




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
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=signalled_child)
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
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=signalled_child)
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



# --- a second signal ends the run at once, even when a library swallowed the first -------------------------------

# A `deepspeed` first on PYTHONPATH whose import is slow, and (SWALLOWS) catches the first KeyboardInterrupt the
# way torch's C++ start-up does with its numpy import inside the real `import deepspeed`: it goes on.
SLOW_IMPORT = """
import os, time
open(os.environ["PF_TEST_MARKER"], "w").close()
try:
    time.sleep(float(os.environ["PF_TEST_SLEEP"]))
except BaseException:
    if not SWALLOWS:
        raise
time.sleep(float(os.environ.get("PF_TEST_AFTER", "60")))
raise ImportError("the stand-in deepspeed has no engine")
"""


def slow_deepspeed_lint(tmp_path, swallows: bool, sleep: float = 60, after: float = 60, extra=()):
    """`preflight lint --deep` on a DeepSpeed config, started; with a `sleep`, it is importing the stand-in deepspeed
    on return."""
    site, marker = tmp_path / "site", tmp_path / "importing"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text(f"SWALLOWS = {swallows}\n" + SLOW_IMPORT)
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}')
    env = dict(os.environ, PYTHONPATH=str(site), PF_TEST_MARKER=str(marker), PF_TEST_SLEEP=str(sleep),
               PF_TEST_AFTER=str(after))
    proc = subprocess.Popen([*PREFLIGHT, "lint", "--deep", "--deepspeed", str(tmp_path / "ds.json"), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=signalled_child)
    if sleep:
        wait_for(marker.exists, 60, "the import of deepspeed", proc)
    return proc


def signalled(proc, *signals) -> tuple:
    """(exit code, stdout, stderr, seconds from the first signal to the exit)."""
    import time

    sent = time.monotonic()
    try:
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.5)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err, time.monotonic() - sent


@pytest.mark.parametrize("first,second", [("SIGTERM", "SIGTERM"), ("SIGINT", "SIGINT"), ("SIGINT", "SIGTERM")])
def test_a_second_signal_ends_the_run_when_the_import_swallowed_the_first(tmp_path, first, second):
    import signal

    proc = slow_deepspeed_lint(tmp_path, swallows=True)
    code, out, err, seconds = signalled(proc, getattr(signal, first), getattr(signal, second))
    assert code == 130 and seconds < 10, (code, seconds, out, err)
    assert out == "" and err.strip().endswith("preflight: interrupted") and "Traceback" not in err, (out, err)


def test_a_run_that_went_on_after_a_swallowed_signal_still_exits_130(tmp_path):
    import signal

    proc = slow_deepspeed_lint(tmp_path, swallows=True, after=0.5)
    code, out, err, _ = signalled(proc, signal.SIGTERM)
    assert code == 130 and err.strip().endswith("preflight: interrupted") and "Traceback" not in err, (code, err)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_one_signal_during_the_import_interrupts_it_at_once(tmp_path, sig):
    import signal

    proc = slow_deepspeed_lint(tmp_path, swallows=False)
    code, out, err, seconds = signalled(proc, getattr(signal, sig))
    assert code == 130 and seconds < 10 and out == "" and "Traceback" not in err, (code, seconds, out, err)


def test_the_same_lint_without_a_signal_runs_to_its_verdict(tmp_path):
    proc = slow_deepspeed_lint(tmp_path, swallows=True, sleep=0, after=0, extra=("--json",))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "interrupted" not in err, (out, err)
    [cfg091] = [r for r in json.loads(out)["results"] if r["id"] == "CFG091"]
    # lint --deep asked for DeepSpeed's validator, which the stand-in cannot run: said in the report, not skipped
    assert cfg091["status"] == "warn" and "the stand-in deepspeed has no engine" in cfg091["message"], cfg091


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
