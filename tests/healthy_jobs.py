"""Healthy multi-node jobs as users write them, run for real on the test cluster (tests/cluster.py), and the
three looks preflight takes at them: `preflight check` before the start, the verdict of `preflight launch`
(the gate), and `preflight doctor` on the running job.

A job is a folder (shared by every node, or one private folder per node at the same path, as without a
shared filesystem), its files, and the processes started for it. Every rank writes its PID (and its
DataLoader workers theirs) into the job's marks folder, so that `stop` ends every process of the job by PID.
`start_on`, `end` and `tails` are how any test starts, ends and reads the processes of a job on the cluster
(checks/test_run.py's stuck jobs too).
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

VENV = Path(sys.executable).parent
ACCELERATE, TORCHRUN, DEEPSPEED = (str(VENV / name) for name in ("accelerate", "torchrun", "deepspeed"))
PATH = f"{VENV}:/usr/local/bin:/usr/bin:/bin"  # a session with the training environment activated
# CLK002 warns truthfully on every node here (tests/cluster_check.py); the all-reduce smoke test has its own tests.
# The test cluster has no GPU: a MULTI_GPU or DeepSpeed config truthfully fails GPU001 there (the jobs run gloo on
# the CPU, which needs none).
SKIP = "deep,CLK002,COL,GPU"

# The job: rendezvous, one all_reduce, then small collectives for ever (healthy and progressing).
# argv: MARKS [WORKERS]; DeepSpeed's runner puts --local_rank=N first, which the script ignores.
TRAIN = '''
import datetime, os, pathlib, sys, time
args = [a for a in sys.argv[1:] if not a.startswith("--")]
marks, workers = pathlib.Path(args[0]), int(args[1]) if len(args) > 1 else 0
rank = int(os.environ["RANK"])
(marks / f"{rank}.pid").write_text(str(os.getpid()))
with open(marks / f"{rank}.starts", "a") as starts:
    starts.write(f"{os.getpid()}\\n")
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
t = torch.ones(1)
dist.all_reduce(t)
batches = None
if workers:
    from torch.utils.data import DataLoader, TensorDataset

    def mark_worker(worker_id):
        (marks / f"{rank}-worker{worker_id}.pid").write_text(str(os.getpid()))

    loader = DataLoader(TensorDataset(torch.ones(1 << 16, 1)), batch_size=1, num_workers=workers,
                        persistent_workers=True, worker_init_fn=mark_worker)
    batches = iter(loader)
(marks / f"{rank}-loop").touch()
while True:
    if batches is not None:
        next(batches)
    dist.all_reduce(t)
    time.sleep(0.05)
'''


def start_on(cluster, node: str, argv: Sequence[str], log: Path, cwd: Optional[Path] = None,
             err: Optional[Path] = None, **env: str) -> subprocess.Popen:
    """A process on a node as a session there runs it (from `cwd`), in a process group of its own, its output in
    `log` (its stderr in `err`, when given); `env` on top of this process's environment."""
    if cwd is not None:
        argv = ["sh", "-c", f"cd {shlex.quote(str(cwd))} && exec {shlex.join(argv)}"]
    with open(log, "wb") as out, open(err, "wb") if err else contextlib.nullcontext(subprocess.STDOUT) as errors:
        return cluster.node_popen(node, list(argv), stdout=out, stderr=errors, env=dict(os.environ, **env))


def end(started: Sequence[subprocess.Popen], pids: Sequence[int]) -> None:
    """End a job: its launchers' process groups (SIGTERM, which a launcher passes on to its ranks, then SIGKILL),
    then every rank and worker left, by the PIDs they wrote (the job's own, not found by name)."""
    for proc in started:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in started:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def tails(folder: Path, pattern: str = "*", size: int = 800) -> Dict[str, str]:
    """The end of each log in the folder, by name."""
    return {p.name: p.read_bytes()[-size:].decode(errors="replace") for p in sorted(folder.glob(pattern))}


def accelerate_config(machines: int, machine_rank: int, main: str, port: int, **changes) -> str:
    """An accelerate config as `accelerate config` writes it: MULTI_GPU without use_cpu, so that accelerate
    starts its torchrun launcher (accelerate/commands/launch.py, launch_command: use_cpu would pick the simple
    launcher, one plain process per node); gloo needs no GPU."""
    import yaml

    data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "downcast_bf16": "no",
            "machine_rank": machine_rank, "main_process_ip": main, "main_process_port": port,
            "main_training_function": "main", "mixed_precision": "no", "num_machines": machines,
            "num_processes": machines, "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    data.update(changes)
    return yaml.safe_dump({k: v for k, v in data.items() if v is not None}, sort_keys=False)


DEEPSPEED_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                    "zero_optimization": {"stage": 1}}


class Job:
    """One healthy job on `nodes`: its folder, its files, its processes; `stop` ends them all by PID."""

    def __init__(self, cluster, root: Path, name: str, nodes: Sequence[str], port: int, per_node: bool = False):
        self.cluster, self.name, self.nodes, self.port = cluster, name, list(nodes), port
        self.folder = root / name
        self.folder.mkdir(parents=True)
        self.marks = root / f"{name}-marks"
        self.marks.mkdir()
        self.logs = root / f"{name}-logs"
        self.logs.mkdir()
        # Per node: the same path holds each node's own files on that node; here (the head's view: preflight
        # runs here) it holds the head's.
        self.copies = {n: cluster.bind_dir(n, str(self.folder)) for n in self.nodes} if per_node else {}
        self.started: List[subprocess.Popen] = []
        self.retired: List[subprocess.Popen] = []  # launchers that were meant to end (a refused launch)
        self.write("train.py", TRAIN)

    def write(self, name: str, text: str, node: Optional[str] = None) -> Path:
        """The file on one node, or on every node (the same text)."""
        for n in [node] if node else self.nodes:
            if n in self.copies:
                (self.copies[n] / name).write_text(text)
        if node in (None, self.nodes[0]):
            (self.folder / name).write_text(text)
        return self.folder / name

    def hostfile(self, slots: int = 1) -> str:
        return "".join(f"{n} slots={slots}\n" for n in self.nodes)

    def target(self) -> List[str]:
        return ["--hosts", ",".join(self.nodes), "--ssh-config", str(self.cluster.ssh_config),
                "--python", sys.executable]

    # --- the three looks ----------------------------------------------------------------------------

    def check(self, command: Sequence[str] = (), options: Sequence[str] = ()) -> dict:
        """`preflight check` from the job's folder before the job starts."""
        proc = subprocess.run([sys.executable, "-m", "preflight", "check", *self.target(), "--skip", SKIP,
                               "--timeout", "20", *options, "--json", *(["--", *command] if command else [])],
                              capture_output=True, text=True, timeout=180, cwd=self.folder)
        return _look("check", proc.returncode, proc.stdout, proc.stderr)

    def gate(self, command: Sequence[str], options: Sequence[str] = (), on: Optional[str] = None, **env: str) -> dict:
        """`preflight launch --json -- COMMAND` from the job's folder: here (it starts `accelerate launch` on
        every node), or on node `on` (it runs any other launcher there, as that node's own, by exec). The
        verdict comes first on stdout; the job's output follows. Waits for the verdict, leaves the job running."""
        argv = [sys.executable, "-m", "preflight", "launch", *self.target(), "--skip", SKIP, "--timeout", "20",
                *options, "--json", "--", *command]
        out = self.logs / f"gate-{len(self.started)}.out"
        err = self.logs / f"gate-{len(self.started)}.err"
        if on:
            proc = start_on(self.cluster, on, argv, out, cwd=self.folder, err=err, **{"PATH": PATH, **env})
        else:
            with open(out, "wb") as stdout, open(err, "wb") as stderr:
                proc = subprocess.Popen(argv, cwd=self.folder, stdout=stdout, stderr=stderr, start_new_session=True,
                                        stdin=subprocess.DEVNULL)
        self.started.append(proc)
        deadline = time.monotonic() + 120
        while True:
            doc = _first_json(out.read_bytes().decode(errors="replace"))
            if doc is not None or proc.poll() is not None:
                break
            assert time.monotonic() < deadline, f"no verdict from the gate: {err.read_text()[-2000:]}"
            time.sleep(0.2)
        time.sleep(0.3)
        text = err.read_text(errors="replace")
        if doc is None:
            doc = _first_json(out.read_bytes().decode(errors="replace"))
        code = proc.poll()
        return {"look": "launch", "code": code, "doc": doc, "stderr": text,
                "refused": "not launching" in text, "proc": proc}

    def doctor(self, *options: str) -> dict:
        """`preflight doctor` on the running job."""
        proc = subprocess.run([sys.executable, "-m", "preflight", "doctor", *self.target(), "--json", *options],
                              capture_output=True, text=True, timeout=120)
        return _look("doctor", proc.returncode, proc.stdout, proc.stderr)

    # --- processes ----------------------------------------------------------------------------------

    def start(self, node: str, argv: Sequence[str], **env: str) -> subprocess.Popen:
        """A launcher on a node, as a session there runs it, from the job's folder."""
        proc = start_on(self.cluster, node, argv, self.logs / f"{node}-{len(self.started)}.log", cwd=self.folder,
                        **{"PATH": PATH, **env})
        self.started.append(proc)
        return proc

    def wait_running(self, world: int, timeout: float = 150, head=None, instead=None) -> None:
        """Until every rank loops over its collectives (every launcher gone: fail with the logs). When `head`
        (a launcher) exits first, `instead()` is called once, to start it another way."""
        deadline = time.monotonic() + timeout
        names = [f"{rank}-loop" for rank in range(world)]
        while not all((self.marks / n).exists() for n in names):
            if head is not None and head.poll() is not None:
                head = None
                instead()
            assert any(p.poll() is None for p in self.started), f"every launcher exited: {self.tail()}"
            assert time.monotonic() < deadline, f"{self.name}: the ranks did not all reach the loop: {self.tail()}"
            time.sleep(0.3)
        time.sleep(0.5)  # a few collectives in: every rank has blocked and woken since

    def problems(self) -> List[str]:
        """What went wrong with the running job itself: a rank started more than once, a launcher that exited."""
        out = []
        for starts in sorted(self.marks.glob("*.starts")):
            pids = starts.read_text().split()
            if len(pids) > 1:
                out.append(f"{self.name}: rank {starts.stem} was started {len(pids)} times (pids {', '.join(pids)})")
        for proc in self.started:
            if proc not in self.retired and proc.poll() is not None:
                out.append(f"{self.name}: a launcher exited with {proc.returncode}: {self.tail()}")
                break
        return out

    def tail(self) -> Dict[str, str]:
        return tails(self.logs)

    def pids(self) -> List[int]:
        return [int(p.read_text()) for p in self.marks.glob("*.pid") if p.read_text().strip().isdigit()]

    def stop(self) -> None:
        """End the job: its launchers (the gate's SIGTERM stops every node it started) and what is left of it."""
        end(self.started, self.pids())


def _first_json(text: str) -> Optional[dict]:
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(text[start:])[0]
    except ValueError:
        return None


def _look(look: str, code: int, stdout: str, stderr: str) -> dict:
    try:
        doc = json.loads(stdout)
    except ValueError:
        doc = None
    return {"look": look, "code": code, "doc": doc, "stderr": stderr}


def alarms(look: dict) -> List[str]:
    """What a look at a healthy job must not say, one line each: ID [nodes] status: message for every fail,
    error and warning (a look may narrow that in look["statuses"]); a bad exit code, no document, a traceback,
    a refused launch, or a PID to stop are alarms too."""
    statuses = look.get("statuses", ("fail", "error", "warn"))
    out = []
    doc = look["doc"]
    if doc is None:
        out.append(f"{look['look']}: no JSON document (exit {look['code']}): {look['stderr'][-600:]}")
        return out
    for r in doc["results"]:
        if r["status"] in statuses:
            out.append(f"{look['look']}: {r['id']} [{','.join(r['nodes'])}] {r['status']}: {r['message']}")
    if "Traceback" in look["stderr"]:
        out.append(f"{look['look']}: a traceback: {look['stderr'][-600:]}")
    if look["look"] == "launch":
        if look["refused"]:
            out.append("launch: not launching")
        elif look.get("exited"):
            out.append(f"launch: the launched command exited at once: {look['exited']}")
    elif look["code"] != 0:
        out.append(f"{look['look']}: exit {look['code']}")
    if look["look"] == "doctor":
        for r in doc["results"]:
            text = f"{r['message']} {r.get('remediation') or ''}"
            if "stop pid" in text.lower():
                out.append(f"doctor: {r['id']} [{','.join(r['nodes'])}] says to stop a pid: {text}")
    return out
