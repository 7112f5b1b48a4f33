"""JOB012: what a hang of the job would leave to read. `lint` over real batch scripts, manifests and launch
commands; torch's own reading of the flight recorder's size, over real gloo process groups of the installed torch;
`check` over this machine's real facts (the collector in-process, or in a process without CAP_SYS_PTRACE or
without py-spy), with Yama's sysctl (this kernel has none) given through preflight.node.procfs.PTRACE_SCOPE."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import node_facts
from conftest import run_cli
from lint_results import lint, without_slurm_environment
from preflight.plan import Plan
from preflight.result import Status
from test_pkg_known_defects import stage

REPO = Path(__file__).resolve().parents[2]
JOB_VARIABLES = ("NCCL_", "TORCH_FR_", "TORCH_NCCL_")


@pytest.fixture(autouse=True)
def quiet_environment(tmp_path, monkeypatch):
    """No variable of the shell that runs the tests may stand for the job's."""
    without_slurm_environment(monkeypatch)
    for name in list(os.environ):
        if name.startswith(JOB_VARIABLES):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def job012(found):
    return [(r["status"], r["message"], r["remediation"], r["evidence"]) for r in found.get("JOB012", [])]


def sbatch(tmp_path, exports, launch="srun torchrun --nnodes 2 --nproc_per_node 8 train.py"):
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --gpus-per-node=8\n" + exports + launch + "\n")
    return path


# ---- NCCL_DEBUG_FILE ----------------------------------------------------------------------------------------

def test_an_nccl_log_without_pid_shared_by_the_ranks_of_a_node_warns(capsys, tmp_path):
    _, found = lint(capsys, "--sbatch", sbatch(tmp_path, "export NCCL_DEBUG=INFO\n"
                                                         "export NCCL_DEBUG_FILE=/scratch/logs/nccl.%h.log\n"))
    [(status, message, fix, evidence), (after, said, _, _)] = job012(found)
    assert status == "warn" and "has no %p: the 8 ranks on a node write the same file" in message, message
    assert fix == "name each process's log: NCCL_DEBUG_FILE=/scratch/logs/nccl.%h.%p.log"
    assert evidence["processes_per_node"] == 8 and after == "pass" and "a hang leaves" in said


def test_an_nccl_log_per_process_passes_and_says_so(capsys, tmp_path):
    _, found = lint(capsys, "--sbatch", sbatch(tmp_path, "export NCCL_DEBUG_FILE=/scratch/logs/nccl.%h.%p.log\n"))
    [(status, message, _, evidence)] = job012(found)
    assert status == "pass" and "NCCL's log in /scratch/logs/nccl.%h.%p.log (per process)" in message, message
    assert evidence["nccl_debug_file"] == "/scratch/logs/nccl.%h.%p.log"


def test_a_literal_percent_is_not_the_pid_nccl_puts_in(capsys, tmp_path):
    """src/debug.cc: %% is a %, so nccl.%%p.log names one file for every rank of the node."""
    _, found = lint(capsys, "--sbatch", sbatch(tmp_path, "export NCCL_DEBUG_FILE=/logs/nccl.%h.%%p.log\n"))
    assert [s for s, *_ in job012(found)] == ["warn", "pass"], job012(found)


def test_one_process_per_node_with_the_host_in_the_name_passes(capsys, tmp_path):
    _, found = lint(capsys, "--sbatch", sbatch(tmp_path, "export NCCL_DEBUG_FILE=/logs/nccl.%h.log\n",
                                               "srun torchrun --nnodes 2 --nproc_per_node 1 train.py"))
    [(status, message, _, _)] = job012(found)
    assert status == "pass" and "per node (%h; one process per node)" in message, message


def test_an_nccl_log_name_set_at_run_time_is_named_not_judged(capsys, tmp_path):
    script = sbatch(tmp_path, "export NCCL_DEBUG_FILE=/logs/nccl_${RUN_NAME}.log\n")
    _, found = lint(capsys, "--sbatch", script)
    [(status, message, _, evidence)] = job012(found)
    assert status == "pass" and "(set at run time)" in message and evidence["at_run_time"] == ["NCCL_DEBUG_FILE"]


def test_the_batch_steps_task_id_names_one_file_for_every_rank(capsys, tmp_path):
    """The batch script runs once, as task 0: an export there expands $SLURM_PROCID to 0 for every task srun starts."""
    _, found = lint(capsys, "--sbatch", sbatch(tmp_path, "export NCCL_DEBUG_FILE=/logs/nccl_${SLURM_PROCID}.log\n"))
    [(status, message, _, _), _] = job012(found)
    assert status == "warn" and message.startswith("NCCL_DEBUG_FILE=/logs/nccl_0.log has no %p"), message


def test_a_run_time_folder_does_not_hide_a_file_name_without_pid(capsys, tmp_path):
    _, found = lint(capsys, "--sbatch", sbatch(tmp_path, "export NCCL_DEBUG_FILE=$LOGDIR/nccl.log\n"))
    [(status, message, fix, _), _] = job012(found)
    assert status == "warn" and message.startswith("NCCL_DEBUG_FILE=$LOGDIR/nccl.log has no %p"), message
    assert fix.endswith("NCCL_DEBUG_FILE=$LOGDIR/nccl.%h.%p.log")


def test_no_log_file_is_written_at_nccl_debug_version(capsys, tmp_path):
    _, found = lint(capsys, "--sbatch", sbatch(tmp_path, "export NCCL_DEBUG=VERSION\nexport NCCL_DEBUG_FILE=/l/x\n"))
    [(status, message, _, _)] = job012(found)
    assert status == "pass" and "NCCL_DEBUG=VERSION writes none" in message, message


# ---- the flight recorder's dump in a Kubernetes container ---------------------------------------------------

def manifest(tmp_path, env, mounts="", volumes="", gpus="8"):
    path = tmp_path / "job.yaml"
    path.write_text(f"""apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {{name: train}}
spec:
  pytorchReplicaSpecs:
    Worker:
      replicas: 2
      template:
        spec:
          volumes: [{volumes}]
          containers:
          - name: pytorch
            image: nvcr.io/nvidia/pytorch:25.01-py3
            command: ["torchrun", "--nproc_per_node=8", "train.py"]
            resources: {{limits: {{nvidia.com/gpu: {gpus}}}}}
            env: [{env}]
            volumeMounts: [{mounts}]
""")
    return path


def test_a_dump_prefix_in_the_containers_own_filesystem_warns(capsys, tmp_path):
    path = manifest(tmp_path, '{name: TORCH_FR_DUMP_TEMP_FILE, value: "/tmp/fr/rank_"}')
    _, found = lint(capsys, "--k8s", path)
    [(status, message, fix, evidence), (after, _, _, _)] = job012(found)
    assert status == "warn" and message.startswith("TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/rank_: /tmp/fr is on no volume of "
                                                   "container pytorch"), message
    assert "hostPath or a persistent volume claim" in fix and evidence["prefix"] == "/tmp/fr/rank_"
    assert after == "pass"


def test_a_dump_prefix_on_a_host_folder_passes_naming_the_volume(capsys, tmp_path):
    """As awsome-distributed-training's FSDP manifests do it: /local, a hostPath."""
    path = manifest(tmp_path, '{name: TORCH_NCCL_DEBUG_INFO_TEMP_FILE, value: "/local/nccl_trace_rank_"}',
                    "{name: local, mountPath: /local}", "{name: local, hostPath: {path: /mnt/k8s-disks/0}}")
    _, found = lint(capsys, "--k8s", path)
    [(status, message, _, evidence)] = job012(found)
    assert status == "pass" and "to /local/nccl_trace_rank_<rank> (TORCH_NCCL_DEBUG_INFO_TEMP_FILE; on volume local, " \
        "a hostPath, at /local)" in message, message
    assert evidence["dump_prefix"] == "/local/nccl_trace_rank_" and evidence["dump_on_timeout"] is True


def test_an_empty_dir_keeps_the_dump_while_the_pod_lives(capsys, tmp_path):
    path = manifest(tmp_path, '{name: TORCH_FR_DUMP_TEMP_FILE, value: "/dumps/fr_"}',
                    "{name: d, mountPath: /dumps}", "{name: d, emptyDir: {}}")
    _, found = lint(capsys, "--k8s", path)
    [(status, message, _, _)] = job012(found)
    assert status == "pass" and "a emptyDir, at /dumps: kept while the pod lives" in message, message


def test_a_container_without_gpus_dumps_nothing_so_its_prefix_is_not_judged(capsys, tmp_path):
    """awsome-distributed-training's Trainium manifest sets the prefix to /local without mounting it: no NCCL."""
    path = manifest(tmp_path, '{name: TORCH_NCCL_DEBUG_INFO_TEMP_FILE, value: "/local/nccl_trace_rank_"}', gpus="0")
    _, found = lint(capsys, "--k8s", path)
    [(status, message, _, _)] = job012(found)
    assert status == "pass" and "not dumped: container pytorch asks for no GPU" in message, message


def test_no_dump_on_timeout_leaves_the_prefix_unjudged(capsys, tmp_path):
    path = manifest(tmp_path, '{name: TORCH_NCCL_DUMP_ON_TIMEOUT, value: "false"}, '
                              '{name: TORCH_FR_DUMP_TEMP_FILE, value: "/tmp/fr_"}')
    _, found = lint(capsys, "--k8s", path)
    [(status, message, _, evidence)] = job012(found)
    assert status == "pass" and "not dumped on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT=false)" in message, message
    assert evidence["dump_on_timeout"] is False


def test_a_dump_switch_torch_cannot_read_warns(capsys, tmp_path):
    _, found = lint(capsys, "--", "TORCH_NCCL_DUMP_ON_TIMEOUT=maybe", "torchrun", "--nproc_per_node", "2", "t.py")
    [(status, message, _, _), _] = job012(found)
    assert status == "warn" and "is neither true nor false" in message, message


# ---- the flight recorder's size, as torch 2.13 reads it -----------------------------------------------------

RECORD = """import os, pickle, sys, torch, torch.distributed as dist
sys.stderr.write("imported\\n"); sys.stderr.flush()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
for _ in range(5):
    dist.all_reduce(torch.ones(2))
sys.stdout.write(str(len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace()).get("entries", []))))
"""


def recorded(tmp_path, **env):
    """The entries torch's flight recorder holds after 5 all_reduces of a real gloo group, or the process's end.
    The import of torch may take long on a loaded machine; a group of one is made in well under a second, so
    the time for it starts once the script says torch is imported."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(JOB_VARIABLES)}
    with subprocess.Popen([sys.executable, "-c", RECORD % port], env=dict(clean, **env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=tmp_path) as proc:
        try:
            while proc.stderr.readline() not in ("imported\n", ""):  # a warning of torch's import may come first
                pass
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:  # past init_process_group neither: torch hangs there as often as it aborts
            proc.kill()
            return "no process group"
    return int(out) if proc.returncode == 0 and out else "no process group"


@pytest.mark.parametrize("variable, value, entries, status", [
    (None, None, 5, "pass"),  # the default, 2000, holds all five
    ("TORCH_FR_BUFFER_SIZE", "2", 2, "pass"),
    ("TORCH_FR_BUFFER_SIZE", "0", 0, "pass"),
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "0", 0, "pass"),  # the older name still read
    ("TORCH_FR_BUFFER_SIZE", "-1", 5, "warn"),  # a size_t: the ring never wraps
    ("TORCH_FR_BUFFER_SIZE", "x1", "no process group", "warn"),
])
def test_the_flight_recorders_size_is_read_as_torch_reads_it(capsys, tmp_path, variable, value, entries, status):
    env = {variable: value} if variable else {}
    assert recorded(tmp_path, **env) == entries
    words = [f"{variable}={value}"] if variable else []
    _, found = lint(capsys, "--", *words, "torchrun", "--nproc_per_node", "2", "train.py")
    results = job012(found)
    assert results[0][0] == status and results[-1][0] == "pass", results
    if entries == 0:
        assert f"no flight recorder ({variable}=0)" in results[-1][1]
    elif entries == 2:
        assert "the flight recorder (2 entries per rank, TORCH_FR_BUFFER_SIZE=2)" in results[-1][1]


def test_a_config_alone_gives_no_variables_to_judge(capsys, tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 16\n")
    _, found = lint(capsys, "--config", config)
    [(status, message, _, _)] = job012(found)
    assert status == "skip" and message.startswith("no launch given"), message


# ---- check: this machine's real facts -----------------------------------------------------------------------

def check_here(capsys, *command):
    code, doc, err = run_cli(capsys, "check", "--json", "--only", "JOB012", *(("--",) + command if command else ()))
    assert code in (0, 1), err
    return [(r["status"], r["message"], r["remediation"], r["evidence"]) for r in doc["results"]]


def scope_file(tmp_path, value, monkeypatch=None):
    path = tmp_path / "ptrace_scope"
    path.write_text(f"{value}\n")
    if monkeypatch is not None:
        from preflight.node import procfs
        monkeypatch.setattr(procfs, "PTRACE_SCOPE", str(path))
    return str(path)


def test_the_node_says_where_a_hang_leaves_its_records_and_who_reads_the_stacks(capsys):
    results = check_here(capsys)
    assert [s for s, *_ in results] == ["pass", "pass"], results
    stacks = next(r for r in results if r[1].startswith("py-spy ("))
    assert stacks[3]["py_spy"] and os.access(stacks[3]["py_spy"], os.X_OK)
    assert stacks[3]["uid"] == os.getuid() and stacks[3]["ptrace_scope"] is None  # no Yama on this kernel
    assert any("dumped by NCCL's watchdog on a timeout to ~/.cache/torch/comm_lib_trace_rank_<rank>" in r[1]
               for r in results), results


def test_the_nodes_own_variables_are_judged_under_the_jobs(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/tmp/nccl.log")
    [(status, message, _, _), *rest] = check_here(capsys, "torchrun", "--nproc_per_node", "4", "train.py")
    assert status == "warn" and message.startswith("NCCL_DEBUG_FILE=/tmp/nccl.log has no %p: the 4 ranks"), message
    results = check_here(capsys, "NCCL_DEBUG_FILE=/tmp/nccl.%h.%p", "torchrun", "--nproc_per_node", "4", "train.py")
    assert [s for s, *_ in results] == ["pass", "pass"], results


def test_ptrace_scope_three_warns_that_no_one_can_read_the_stacks(capsys, tmp_path, monkeypatch):
    scope_file(tmp_path, 3, monkeypatch)
    [stacks] = [r for r in check_here(capsys) if "ptrace_scope" in r[1] or r[1].startswith("py-spy")]
    assert stacks[0] == "warn" and stacks[1].startswith("kernel.yama.ptrace_scope is 3: no process may attach"), stacks
    scope_file(tmp_path, 1, monkeypatch)  # root, holding CAP_SYS_PTRACE: it may attach
    [stacks] = [r for r in check_here(capsys) if "ptrace_scope" in r[1] or r[1].startswith("py-spy")]
    assert stacks[0] == "pass" and stacks[1].endswith("as this user"), stacks


CHECK_WITH_SCOPE = ("import sys; from preflight.node import procfs; procfs.PTRACE_SCOPE = sys.argv[1]; "
                    "from preflight.cli import main; sys.exit(main(sys.argv[2:]))")


def check_in(tmp_path, scope, prefix=(), python=sys.executable, env=None):
    """`preflight check --only JOB012 --json` in a process of its own (prefix: setpriv ...), ptrace_scope SCOPE."""
    argv = list(prefix) + [sys.executable, "-c", CHECK_WITH_SCOPE, scope_file(tmp_path, scope), "check", "--json",
                           "--only", "JOB012", "--python", python]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(JOB_VARIABLES)}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(clean, PYTHONPATH=str(REPO), **(env or {})))
    assert "Traceback" not in proc.stderr, proc.stderr
    return [r for r in json.loads(proc.stdout)["results"] if "ptrace_scope" in r["evidence"]]


def need_root():
    if os.getuid() != 0 or not os.path.exists("/usr/bin/setpriv"):
        pytest.skip("needs root and setpriv to drop CAP_SYS_PTRACE")


def test_root_without_cap_sys_ptrace_under_ptrace_scope_one_warns(tmp_path):
    """A process whose capabilities lack SYS_PTRACE, as in a container started without it: real /proc/self/status."""
    need_root()
    [stacks] = check_in(tmp_path, 1, ["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace"])
    assert stacks["status"] == "warn" and stacks["evidence"]["sys_ptrace"] is False, stacks
    assert stacks["message"].startswith("root here lacks CAP_SYS_PTRACE"), stacks["message"]
    assert "SYS_PTRACE" in stacks["remediation"]
    [stacks] = check_in(tmp_path, 0, ["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace"])
    assert stacks["status"] == "pass" and stacks["message"].endswith("as root or the job's user"), stacks


def test_a_user_without_the_capability_is_told_that_doctor_needs_root(tmp_path):
    """ptrace_scope 1 lets a process attach to its descendants only, unless it holds CAP_SYS_PTRACE (Yama): doctor's
    py-spy is no rank's ancestor. Ubuntu's default, so a pass that says it, not a warning. The collector runs as
    nobody under the system's python3 (stdlib only, as on a node); JOB012 judges the facts it printed."""
    need_root()
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs a system python3 that nobody may run")
    shared = Path(tempfile.mkdtemp(prefix="pf-job012-"))  # pytest's own folders are root's alone
    os.chmod(shared, 0o755)
    code = ("import json, sys; sys.path.insert(0, sys.argv[2]); from preflight.node import collector, procfs; "
            "procfs.PTRACE_SCOPE = sys.argv[1]; print(json.dumps(collector.collect({})))")
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                           code, scope_file(shared, 1), str(REPO)], capture_output=True, text=True, timeout=60,
                          cwd=shared, env={"PATH": "/usr/bin:/bin", "HOME": str(shared)})
    shutil.rmtree(shared)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["host"]["uid"] == 65534 and facts["host"]["sys_ptrace"] is False and facts["host"]["ptrace_scope"] == 1
    states = {"n01": {"facts": facts, "error": None, "clock": None}}
    [stacks] = [r for r in node_facts.run("JOB012", states, plan=Plan(nodes=("n01",), remote=True))
                if "ptrace_scope" in r.evidence]
    assert stacks.status == Status.PASS and stacks.message.endswith("as root only (sudo; ptrace_scope 1)"), stacks
    facts["host"]["ptrace_scope"] = 0  # the same user may attach under the classic rules
    [stacks] = [r for r in node_facts.run("JOB012", states, plan=Plan(nodes=("n01",), remote=True))
                if "ptrace_scope" in r.evidence]
    assert stacks.message.endswith("as root or the job's user"), stacks


def test_a_node_without_py_spy_is_told_to_install_it(tmp_path):
    """The training interpreter is the system's python3: no py-spy beside it, none on PATH."""
    system = "/usr/bin/python3"
    if not os.path.exists(system) or os.path.exists("/usr/bin/py-spy"):
        pytest.skip("needs a system python3 without py-spy beside it")
    [stacks] = check_in(tmp_path, 0, env={"PATH": "/usr/bin:/bin"}, python=system)
    assert stacks["status"] == "pass" and stacks["evidence"]["py_spy"] is None, stacks
    assert stacks["message"].startswith("py-spy is not installed (pip install py-spy"), stacks["message"]


def test_a_ras_address_another_job_listens_on_warns(capsys, tmp_path, monkeypatch):
    """NCCL 2.24+ listens for RAS clients on NCCL_RAS_ADDR with SO_REUSEPORT: a listener there before the job starts
    is another NCCL job on the node. The node's NCCL is a real (staged) nvidia-nccl-cu12 wheel's metadata."""
    monkeypatch.setattr(sys, "path", [str(stage(tmp_path / "site", {"nvidia-nccl-cu12": "2.27.3"}))] + sys.path)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        results = check_here(capsys, f"NCCL_RAS_ADDR=localhost:{port}", "torchrun", "train.py")
        [(status, message, fix, evidence)] = [r for r in results if "address" in r[3]]
        assert status == "warn" and message.startswith(f"localhost:{port}, where NCCL 2.27.3's RAS listens"), message
        assert evidence["port"] == port and "NCCL_RAS_ADDR=localhost:" in fix
    finally:
        listener.close()
    results = check_here(capsys, f"NCCL_RAS_ADDR=localhost:{port}", "torchrun", "train.py")
    assert [s for s, *_ in results] == ["pass", "pass"], results


def test_an_nccl_before_ras_takes_no_address(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(stage(tmp_path / "site", {"nvidia-nccl-cu12": "2.21.5"}))] + sys.path)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        results = check_here(capsys, f"NCCL_RAS_ADDR=localhost:{port}", "torchrun", "train.py")
    assert [s for s, *_ in results] == ["pass", "pass"], results
