"""`preflight node` under a real SLURM (tests/slurm_cluster.py): on every node through srun, as the example
prolog (scripts/slurm/prolog.sh, configured as Prolog= with PrologFlags=Alloc) and as the example
HealthCheckProgram (scripts/slurm/healthcheck.sh: run the way slurmd runs it, on the node with an empty
environment, and fired by slurmd itself through HealthCheckProgram= and HealthCheckInterval=)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import cluster, cluster_up  # noqa: F401
from slurm_cluster import make_slurm_fixtures

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFLIGHT = str(BIN / "preflight")
slurm_up, slurm = make_slurm_fixtures(prolog=str(ROOT / "scripts" / "slurm" / "prolog.sh"),
                                      prolog_env={"PREFLIGHT": PREFLIGHT})
# A SLURM per test, beside the first (its own ports and daemons), whose slurmd fires the example health
# check every HC_INTERVAL seconds (slurmctld asks for it at a granularity of about 1 s).
HC_INTERVAL = 2
slurm_hc_up, slurm_hc = make_slurm_fixtures(
    name="slurm_hc", scope="function", ports=(6927, 6928), health_check_interval=HC_INTERVAL,
    health_check=str(ROOT / "scripts" / "slurm" / "healthcheck.sh"), health_check_env={"PREFLIGHT": PREFLIGHT})


def healthcheck(slurm, node):
    """scripts/slurm/healthcheck.sh on the node as slurmd runs it: an empty environment (SLURM_CONF is
    given here only because the test's slurm.conf is not at /etc/slurm/slurm.conf)."""
    return slurm.node_exec(node, ["env", "-i", f"SLURM_CONF={slurm.conf}", f"PREFLIGHT={PREFLIGHT}",
                                  f"PREFLIGHT_LOG={slurm.dir / 'healthcheck.log'}",
                                  str(ROOT / "scripts" / "slurm" / "healthcheck.sh")])


def wait_drained(slurm, node, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        drained = slurm.drained()
        if node in drained:
            return drained
        time.sleep(0.2)
    raise AssertionError(f"{node} not drained after {timeout} s: {slurm.drained()}; prolog log: "
                         f"{slurm.prolog_log.read_text()[-2000:] if slurm.prolog_log.exists() else '(none)'}")


def test_srun_runs_preflight_node_on_every_node(slurm, tmp_path):
    started = time.monotonic()
    slurm.run(["srun", "-N3", f"--output={tmp_path}/%N.json", PREFLIGHT, "node", "--budget", "20", "--json"],
              timeout=60, check=False)  # exit 1 would be a fail verdict: the documents say which
    assert time.monotonic() - started < 30
    docs = {node: json.loads((tmp_path / f"{node}.json").read_text()) for node in slurm.nodes}
    for node, doc in docs.items():
        assert doc["nodes"] == [node], doc["nodes"]  # each ran on its own node, under its hostname
        assert doc["verdict"] in ("pass", "warn"), [r for r in doc["results"] if r["status"] in ("fail", "error")]
        fs001 = [r for r in doc["results"] if r["id"] == "FS001"]
        assert fs001 and fs001[0]["status"] == "pass" and fs001[0]["nodes"] == [node]
    assert slurm.drained() == {}


def test_prolog_drains_the_faulty_node_only(slurm):
    log_start = slurm.ctld_log_size()
    slurm.small_shm("node02")
    job = subprocess.Popen(["srun", "-N3", "-t", "1", "hostname"], env=slurm.env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        drained = wait_drained(slurm, "node02")
    finally:
        slurm.run(["scancel", "--user=root"], check=False)
        out, err = job.communicate(timeout=30)
    assert drained["node02"].startswith("preflight: FS001 dev-shm: /dev/shm is 64 MiB"), drained
    assert len(drained["node02"]) <= 100
    assert set(drained) == {"node02"}, drained  # the healthy nodes stay in service
    assert job.returncode != 0 and "hostname" not in out  # no task ran on the broken allocation
    rows = slurm.run(["sinfo", "-R", "-h", "-o", "%E|%N"]).stdout
    assert "preflight: FS001" in rows and "node02" in rows
    # slurmd cancels the job itself when its prolog fails, and when slurmctld does not take its report of the
    # failed prolog then (the job is ending), slurmd retries it 15 s later (Slurm 22.05), followed at once by a
    # registration that drains the node again ("Prolog error"). Wait for both here, or the drain lands on a
    # later test, after this one's teardown returned the node to service, and that test's job waits forever.
    if until(lambda: "Retrying prolog complete RPC" in slurm.slurmd_log("node02"), 1):  # logged within ms
        slurm.wait_ctld_log(r"prolog_complete: invalid JobId=", log_start)
        time.sleep(2)  # the registration follows within milliseconds; it logs nothing on a drained node


def test_healthcheck_drains_then_returns_the_node(slurm):
    slurm.small_shm("node02")
    proc = healthcheck(slurm, "node02")
    assert proc.returncode == 1, proc.stderr
    info = slurm.node_info("node02")
    assert "DRAIN" in info["state"] and info["reason"].startswith("preflight: FS001 dev-shm:"), info
    healthy = healthcheck(slurm, "node01")
    assert healthy.returncode == 0, (healthy.stderr, (slurm.dir / "healthcheck.log").read_text()[-2000:])
    assert "DRAIN" not in slurm.node_info("node01")["state"]
    slurm.restore_shm("node02")  # fixed: the next health check returns it to service
    proc = healthcheck(slurm, "node02")
    assert proc.returncode == 0, (slurm.dir / "healthcheck.log").read_text()[-2000:]
    assert "DRAIN" not in slurm.node_info("node02")["state"]
    slurm.wait_idle(["node02"])
    assert "returned to service" in (slurm.dir / "healthcheck.log").read_text()


def test_undrain_leaves_a_node_someone_else_drained(slurm):
    slurm.run(["scontrol", "update", "NodeName=node03", "State=DRAIN", "Reason=disk swap, ticket 42"])
    proc = slurm.node_exec("node03", [PREFLIGHT, "node", "--budget", "20", "--undrain"])
    assert proc.returncode == 0, proc.stderr
    assert "stays drained" in proc.stderr and "disk swap, ticket 42" in proc.stderr
    info = slurm.node_info("node03")
    assert "DRAIN" in info["state"] and info["reason"].startswith("disk swap, ticket 42"), info


def test_drain_uses_slurmd_nodename(slurm):
    """In a job step, $SLURMD_NODENAME names the node (here the same as its hostname)."""
    slurm.small_shm("node01")
    proc = slurm.node_exec("node01", [PREFLIGHT, "node", "--budget", "20", "--drain", "--only", "FS001"],
                           env={"SLURMD_NODENAME": "node01"})
    assert proc.returncode == 1
    assert "drained SLURM node node01: preflight: FS001" in proc.stderr
    assert slurm.drained().get("node01", "").startswith("preflight: FS001 dev-shm")


def test_check_slurm_inside_an_allocation_uses_srun(slurm):
    """`preflight check --slurm` in an allocation reaches the nodes with srun steps: no SSH config given."""
    started = time.monotonic()
    # COL (the all-reduce: torch on 3 nodes at once, slow on a small machine) has its own test below.
    proc = slurm.run(["salloc", "-N3", PREFLIGHT, "check", "--slurm", "--python", sys.executable, "--json",
                      "--timeout", "20", "--skip", "COL"], timeout=120, check=False)
    elapsed = time.monotonic() - started
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["nodes"] == ["node01", "node02", "node03"]
    ssh001 = [r for r in doc["results"] if r["id"] == "SSH001"]
    assert ssh001 and all(r["status"] == "pass" for r in ssh001), ssh001
    failing = [(r["id"], r["nodes"], r["message"]) for r in doc["results"] if r["status"] in ("fail", "error")]
    assert doc["verdict"] != "fail", failing
    net004 = [r for r in doc["results"] if r["id"] == "NET004"]  # workers reached the head's main port
    assert net004 and all(r["status"] == "pass" for r in net004), net004
    assert elapsed < 60


def until(predicate, timeout):
    """Poll predicate until it is true or timeout seconds have passed; its last value."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.2)
    return predicate()


def test_slurmd_fires_the_healthcheck_and_it_drains_the_faulty_node_only(slurm_hc):
    """HealthCheckProgram (a wrapper that sets SLURM_CONF, PREFLIGHT and the log, then runs
    scripts/slurm/healthcheck.sh), fired by slurmd itself every HealthCheckInterval seconds."""
    slurm = slurm_hc
    assert all(slurm.health_checks(n) for n in slurm.nodes)  # slurmd runs it at its start, before registering
    assert slurm.drained() == {}
    slurm.small_shm("node02")
    planted = time.time()  # every run that starts from now on sees the 64 MiB /dev/shm

    def since(start):
        return {n: [r for r in slurm.health_checks(n) if r["started"] >= start] for n in slurm.nodes}

    assert until(lambda: all(since(planted).values()), 3 * HC_INTERVAL + 15), since(planted)
    runs = since(planted)
    drained = slurm.drained()
    assert set(drained) == {"node02"}, drained  # the healthy nodes stay in service
    assert drained["node02"].startswith("preflight: FS001 dev-shm: /dev/shm is 64 MiB"), drained
    assert len(drained["node02"]) <= 100
    assert runs["node02"][0]["status"] == 1
    assert all(r["status"] == 0 for n in ("node01", "node03") for r in runs[n]), runs
    assert all("DRAIN" not in slurm.node_info(n)["state"] for n in ("node01", "node03"))
    # What slurmd gives the program: SLURMD_NODENAME, but no PATH and no SLURM_CONF (set by the script,
    # and by the wrapper, since this slurm.conf is not /etc/slurm/slurm.conf).
    given = runs["node02"][0]["env"]
    assert "SLURMD_NODENAME=node02" in given and not [v for v in given if v.startswith(("PATH=", "SLURM_CONF="))]

    slurm.restore_shm("node02")  # fixed: a later health check returns it to service (--undrain)
    assert until(lambda: slurm.drained() == {}, 3 * HC_INTERVAL + 15), slurm.drained()
    assert "returned to service" in slurm.health_check_log.read_text()


def test_check_slurm_runs_the_all_reduce_through_srun(slurm):
    """The all-reduce's node processes start as srun steps too (one more per node, as the facts' agents):
    gloo across the allocation's nodes, rendezvous at the first node's main port."""
    proc = slurm.run(["salloc", "-N3", PREFLIGHT, "check", "--slurm", "--python", sys.executable, "--json",
                      "--timeout", "30", "--only", "COL", "--col-sizes", "1M"], timeout=150, check=False)
    assert "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    allreduce = [r for r in doc["results"] if r["id"] == "COL001"]
    assert [(r["status"], r["nodes"]) for r in allreduce] == [("pass", ["node01", "node02", "node03"])], \
        [(r["nodes"], r["message"], r["evidence"]) for r in allreduce]
    [bandwidth] = [r for r in doc["results"] if r["id"] == "COL002"]
    assert bandwidth["evidence"]["world_size"] == 3 and bandwidth["evidence"]["busbw_gbps"] > 0


def test_doctor_reaches_a_running_jobs_nodes_by_its_job_id(slurm, tmp_path):
    """From the login node: `doctor --slurm-job JOBID` finds the job's nodes with scontrol and reads them
    through `srun --overlap --jobid` steps; the job (node rank 0 on node01 and node02) keeps running."""
    script = tmp_path / "stuck.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    launch = (f"exec {BIN}/torchrun --nnodes 3 --node_rank $(( SLURM_NODEID == 1 ? 0 : SLURM_NODEID )) "
              f"--master_addr node01 --master_port 29671 --nproc-per-node 1 {script}")
    batch = tmp_path / "job.sh"
    batch.write_text(f"#!/bin/bash\nsrun -N3 --ntasks-per-node=1 bash -c '{launch}'\n")
    jobid = slurm.run(["sbatch", "-N3", "-t", "5", "--parsable", f"--output={tmp_path}/job-%j.out",
                       str(batch)]).stdout.strip().split(";")[0]
    try:
        listening = until(lambda: all(":29671 " in slurm.node_exec(n, ["ss", "-Hltn"]).stdout
                                       for n in ("node01", "node02")), 60)
        output = tmp_path / f"job-{jobid}.out"
        assert listening, output.read_text() if output.exists() else "the job wrote nothing"
        started = time.monotonic()
        proc = slurm.run([PREFLIGHT, "doctor", "--slurm-job", jobid, "--python", sys.executable, "--port", "29671",
                          "--json"], check=False, timeout=60)
        elapsed = time.monotonic() - started
        assert "Traceback" not in proc.stderr, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["nodes"] == ["node01", "node02", "node03"] and proc.returncode == 1
        [duplicate] = [r for r in doc["results"] if r["id"] == "RUN002" and r["status"] == "fail"]
        assert duplicate["nodes"] == ["node01", "node02"], duplicate
        assert elapsed < 15
        assert slurm.run(["squeue", "-h", "-j", jobid, "-o", "%T"]).stdout.strip() == "RUNNING"
    finally:
        slurm.run(["scancel", jobid], check=False)
        until(lambda: not slurm.run(["squeue", "-h", "-j", jobid], check=False).stdout.strip(), 30)


def test_doctor_refuses_a_job_id_that_is_not_running(slurm):
    proc = slurm.run([PREFLIGHT, "doctor", "--slurm-job", "999999"], check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("preflight: error: --slurm-job: job 999999")
    proc = slurm.run([PREFLIGHT, "doctor", "--slurm-job", "12;rm"], check=False)
    assert proc.returncode == 2 and "is not a SLURM job ID" in proc.stderr
