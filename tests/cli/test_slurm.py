"""`preflight node` under a real SLURM (tests/slurm_cluster.py): on every node through srun, as the example
prolog (preflight/gate/slurm_scripts/prolog.sh, as `preflight slurm-scripts` writes it, configured as Prolog= with PrologFlags=Alloc) and as the example
HealthCheckProgram (healthcheck.sh: run the way slurmd runs it, on the node with an empty
environment, and fired by slurmd itself through HealthCheckProgram= and HealthCheckInterval=)."""
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import transcripts
from cluster import cluster, cluster_up  # noqa: F401
from slurm_cluster import make_slurm_fixtures

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "preflight" / "gate" / "slurm_scripts"  # what `preflight slurm-scripts` writes
BIN = Path(sys.executable).parent
PREFLIGHT = str(BIN / "preflight")
slurm_up, slurm = make_slurm_fixtures(prolog=str(SCRIPTS / "prolog.sh"),
                                      prolog_env={"PREFLIGHT": PREFLIGHT})
# A SLURM per test, beside the first (its own ports and daemons), whose slurmd fires the example health
# check every HC_INTERVAL seconds (slurmctld asks for it at a granularity of about 1 s).
HC_INTERVAL = 2
slurm_hc_up, slurm_hc = make_slurm_fixtures(
    name="slurm_hc", scope="function", ports=(6927, 6928), health_check_interval=HC_INTERVAL,
    health_check=str(SCRIPTS / "healthcheck.sh"), health_check_env={"PREFLIGHT": PREFLIGHT})


def healthcheck(slurm, node):
    """healthcheck.sh on the node as slurmd runs it: an empty environment (SLURM_CONF is
    given here only because the test's slurm.conf is not at /etc/slurm/slurm.conf)."""
    return slurm.node_exec(node, ["env", "-i", f"SLURM_CONF={slurm.conf}", f"PREFLIGHT={PREFLIGHT}",
                                  f"PREFLIGHT_LOG={slurm.dir / 'healthcheck.log'}",
                                  str(SCRIPTS / "healthcheck.sh")])


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


# The recorded 8 x H100 of tests/fixtures/nvml in place of NVML for a preflight that srun starts (this machine has
# no GPU): a sitecustomize on its PYTHONPATH.
RECORDED_GPUS = """import sys
sys.path.insert(0, {tests!r})
from nvml_fake import fake
from preflight.node import gpus
gpus.Nvml = fake("h100x8.json")
"""


def test_the_docs_gate_line_passes_on_healthy_nodes(slurm, tmp_path):
    """docs/examples/train.slurm's gate as the docs write it, in the folder with the example's accelerate.yaml, on
    two healthy nodes of 8 GPUs: exit 0 on each, so `|| exit 1` lets the job go on. The launch line that follows
    gives --main_process_ip, which the gate cannot know: the config's lack of it is not a failure."""
    examples = ROOT / "docs" / "examples"
    [gate] = [line for line in (examples / "train.slurm").read_text().splitlines() if " preflight node " in line]
    command, _, otherwise = gate.partition("||")
    assert otherwise.strip() == "exit 1", gate
    words = [PREFLIGHT if w == "preflight" else w for w in shlex.split(command)]
    shutil.copy(examples / "accelerate.yaml", tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDED_GPUS.format(tests=str(ROOT / "tests")))
    # srun -N2 for the script's `#SBATCH --nodes=2`; --json to read each node's results (same exit code)
    proc = subprocess.run([words[0], "-N2", f"--output={tmp_path}/%N.json", *words[1:], "--json"], cwd=tmp_path,
                          env=dict(slurm.env, PYTHONPATH=str(site)), capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    docs = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("node01", "node02")}
    bad = {n: [(r["id"], r["message"]) for r in d["results"] if r["status"] in ("fail", "error")]
           for n, d in docs.items()}
    assert proc.returncode == 0 and not any(bad.values()), (proc.stderr, bad)
    for node, doc in docs.items():
        by_id = {r["id"]: r for r in doc["results"]}
        assert by_id["GPU001"]["status"] == "pass" and "8" in by_id["GPU001"]["message"], by_id["GPU001"]
        assert by_id["CFG010"]["status"] == "skip" and "--main_process_ip" in by_id["CFG010"]["message"]
        assert by_id["FS001"]["status"] == "pass" and doc["nodes"] == [node]


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
    healthcheck.sh), fired by slurmd itself every HealthCheckInterval seconds."""
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


# ---- a batch script judged against its real allocation (CFG075) ------------------------------------------------
# A SLURM beside the first, whose nodes have 2 GPUs each as a GRES without hardware (tests/slurm_cluster.py, gpus=2),
# and no prolog: its jobs start at once.
slurm_gpu_up, slurm_gpu = make_slurm_fixtures(name="slurm_gpu", ports=(6937, 6938), gpus=2)

TRAIN = """import os, socket
import torch.distributed as dist
dist.init_process_group("gloo", rank=int(os.environ["SLURM_NODEID"]), world_size=2)  # at MASTER_ADDR:MASTER_PORT
dist.barrier()
open(os.path.join({out!r}, "trained-" + socket.gethostname()), "w").write(str(dist.get_rank()))
"""

# The batch script as users write it: the head's address, preflight as the gate in the batch step, the training step.
JOB = """#!/bin/bash
#SBATCH --nodes=2
{tasks}#SBATCH --gpus-per-node={gpus}
#SBATCH --time=3
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
{shown}{preflight} check --slurm --sbatch "$0" --python {python} --timeout 20 {select} --json >{out}/check.json || exit 1
srun {srun} bash -c "{accelerate} launch --num_machines 2 --num_processes {procs} --machine_rank \\$SLURM_NODEID \\
    --main_process_ip $MASTER_ADDR --main_process_port 29631 {train}"
"""


def submit(slurm, tmp_path, *sbatch, srun="--ntasks-per-node=1", gpus=1, procs=2, select="--skip COL",
           tasks="#SBATCH --ntasks-per-node=1\n", transcript=""):
    """The batch script, submitted with `sbatch --wait [OPTIONS]`: (exit code, CFG075's results, the output). With
    a transcript's name, the batch step first runs its command as the transcript shows it, into transcript.txt."""
    shown = ""
    if transcript:
        shown = f"{shlex.join([PREFLIGHT, *transcripts.command(transcript)])} >{tmp_path}/transcript.txt 2>&1\n"
        shown = shown.replace("'$0'", '"$0"')
    (tmp_path / "train.py").write_text(TRAIN.format(out=str(tmp_path)))
    job = tmp_path / "job.sh"
    job.write_text(JOB.format(shown=shown, preflight=PREFLIGHT, python=sys.executable, out=tmp_path, select=select, srun=srun,
                              tasks=tasks, gpus=gpus, procs=procs, accelerate=BIN / "accelerate",
                              train=tmp_path / "train.py"))
    proc = slurm.run(["sbatch", "--wait", "--parsable", f"--output={tmp_path}/job.out", *sbatch, str(job)],
                     timeout=240, check=False)
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert "Traceback" not in output, output
    doc = json.loads((tmp_path / "check.json").read_text())
    return proc.returncode, doc, output


def cfg075(doc):
    return [(r["status"], r["message"]) for r in doc["results"] if r["id"] == "CFG075"]


def test_the_gate_in_a_batch_script_names_srun_starting_two_launchers_per_node(slurm_gpu, tmp_path):
    # Without a task count in the job (no --ntasks, no --ntasks-per-node), srun honours its own --ntasks-per-node
    # (on whole nodes, as GPU jobs take them: a node's one allocated CPU would refuse a second task):
    two = slurm_gpu.run(["salloc", "-N2", "--exclusive", "srun", "--ntasks-per-node=2", "hostname"],
                        timeout=60).stdout.split()
    assert sorted(two) == ["node01", "node01", "node02", "node02"], two
    code, doc, output = submit(slurm_gpu, tmp_path, srun="--ntasks-per-node=2", select="--only slurm,SSH",
                               tasks="#SBATCH --exclusive\n")
    assert code != 0, output  # the job stopped at the gate
    [(status, message)] = cfg075(doc)
    assert status == "fail" and "srun starts 2(x2) tasks on node[01-02]" in message, message
    assert "srun --ntasks-per-node=2" in message and "accelerate launch" in message
    assert not list(tmp_path.glob("trained-*")), "the training step ran"


def test_a_batch_script_that_fits_its_allocation_passes_the_gate_and_trains(slurm_gpu, tmp_path):
    code, doc, output = submit(slurm_gpu, tmp_path)
    assert code == 0, (output, [(r["id"], r["nodes"], r["message"]) for r in doc["results"]
                                if r["status"] in ("fail", "error")])
    [(status, message)] = cfg075(doc)
    assert status == "pass", message
    assert "job " in message and "2 nodes node[01-02]" in message and "1(x2) GPUs per node" in message, message
    assert doc["verdict"] != "fail" and doc["nodes"] == ["node01", "node02"]
    assert sorted(p.name for p in tmp_path.glob("trained-*")) == ["trained-node01", "trained-node02"], output
    assert (tmp_path / "trained-node01").read_text() == "0"  # rank 0 on the first node, at MASTER_ADDR


def test_an_allocation_changed_on_the_sbatch_command_line_is_judged_as_slurm_gave_it(slurm_gpu, tmp_path):
    """The script is clean as written (lint --sbatch passes it); `sbatch --ntasks-per-node=2 --gpus-per-node=1`
    gives the job two tasks and one GPU per node, and the gate inside the allocation names both."""
    code, doc, output = submit(slurm_gpu, tmp_path, "--ntasks-per-node=2", "--gpus-per-node=1", srun="", gpus=2,
                               procs=4, select="--only slurm,SSH", transcript="slurm-allocation")
    assert code != 0, output
    said = (transcripts.TRANSCRIPTS / "slurm-allocation.txt").read_text().splitlines()[0] + "\n" + \
        (tmp_path / "transcript.txt").read_text().replace(str(transcripts.VENV), "/venv")
    transcripts.held("slurm-allocation", re.sub(r"/\S+/slurm_script", ".../slurm_script", said))
    found = cfg075(doc)
    assert [s for s, _ in found] == ["fail", "fail"], found
    assert "srun starts 2(x2) tasks on node[01-02] in this allocation (SLURM_NTASKS=4, SLURM_NTASKS_PER_NODE=2)" \
        in found[0][1], found
    assert "starts 4 processes on node[01-02] (num_processes 4 / num_machines 2), which have 1 GPU in" in found[1][1]
    lint = subprocess.run([PREFLIGHT, "lint", "--sbatch", str(tmp_path / "job.sh"), "--json", "--only",
                           "CFG071,CFG074"], capture_output=True, text=True, timeout=60,
                          env={"PATH": str(BIN) + ":/usr/bin:/bin"})
    assert [r["status"] for r in json.loads(lint.stdout)["results"]] == ["pass", "pass"], lint.stdout
    assert not list(tmp_path.glob("trained-*"))
