#!/usr/bin/env python3
"""preflight against what users would run instead, on this machine, in one run (run it as scripts/bench).

Every comparison runs its contenders interleaved (round-robin, starting one further each round; where wall
time is compared, after one untimed warm-up each) and reports medians of --repeat rounds (the collective,
the noisiest, at least 7). Sections:

  local    preflight lint / node against ds_report and accelerate env
  fanout   preflight check (no collective) over N test hosts against clush and pdsh -R ssh running
           preflight's own fact collector on the same hosts; the scaling curve as a PNG; with --profile DIR,
           the CPU of the head and of the hosts at each size, and py-spy flame graphs of the head and of a node
  hang     time to a verdict with one node's sshd frozen (--timeout 5) against a plain torch.distributed
           rendezvous missing that node (measured at a 5 s timeout; its default timeout computed)
  col      busbw of preflight's all-reduce against a plain torch.distributed loop, same hosts and sizes
  scale    synthetic facts for 1,024, 4,096 and 16,384 nodes through the checks and every renderer; doctor's
           census of 16,384 synthetic nodes
  startup  import time of the preflight command (python -X importtime)
  datapath the path probes (NET007-NET011) and the pairwise phase (COL004) at 4, 16 and 32 test hosts, and the
           verdict with one slow link (scripts/bench_datapath.py)

The test hosts are the test cluster of scripts/testcluster.py (root, ip netns, OpenSSH server). A full,
error-free run rewrites the generated part of BENCHMARKS.md; a partial or failed one only prints.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import testcluster  # noqa: E402
from preflight import DISTRIBUTION  # noqa: E402

BIN = Path(sys.executable).parent
PREFLIGHT = str(BIN / "preflight")
AGENT = "preflight.node.agent"  # the program preflight ships to each node: its facts, then its answers
GOLDEN = ROOT / "tests" / "fixtures" / "config" / "golden" / "two-machines"
BENCHMARKS = ROOT / "BENCHMARKS.md"
PNG = ROOT / "BENCHMARKS-fanout.png"
BEGIN, END = "<!-- scripts/bench: begin -->", "<!-- scripts/bench: end -->"
SECTIONS = ("local", "fanout", "hang", "col", "scale", "startup", "doctor", "datapath")
DOCTOR_HOSTS = 3
HANG_TIMEOUT_S = 5
COL_HOSTS = 4
HANG_HOSTS = 4
COL_MIN_ROUNDS = 7  # one busbw figure varies by +-20% here (gloo, 4 ranks on 2 shared cores): more pairs
HEAVY_MODULES = ("torch", "accelerate", "deepspeed", "numpy")


class BenchError(Exception):
    """A contender failed or gave a wrong answer: its times would mean nothing."""


@dataclass
class Target:
    text: str
    measured: str
    met: bool


@dataclass
class Section:
    title: str
    table: List[List[str]] = field(default_factory=list)  # header row first
    targets: List[Target] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""


# --- measuring ------------------------------------------------------------------------------------

def run(argv: Sequence[str], ok: Sequence[int] = (0,), timeout: float = 300, env: Optional[dict] = None):
    """(wall seconds, stdout) of one command; a return code outside `ok` is a BenchError."""
    started = time.perf_counter()
    try:
        proc = subprocess.run([str(a) for a in argv], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        raise BenchError(f"{Path(str(argv[0])).name}: no answer in {timeout} s") from None
    elapsed = time.perf_counter() - started
    if proc.returncode not in ok:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-400:]
        raise BenchError(f"{shlex.join(map(str, argv))[:200]}: exit {proc.returncode}: {tail}")
    return elapsed, proc.stdout


def interleaved(contenders: Dict[str, Callable[[], float]], repeat: int, warm_up: bool = True) -> Dict[str, List[float]]:
    """Each contender's times over `repeat` rounds; each round starts one contender further, so none is
    always first (cold) or last; one untimed warm-up each fills the page cache and ssh's known state."""
    names = list(contenders)
    for name in names if warm_up else ():
        contenders[name]()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_ in range(repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(contenders[name]())
    return times


def secs(value: float) -> str:
    return f"{value:.2f} s" if value >= 0.995 else f"{value * 1000:.0f} ms"


def spread(values: Sequence[float]) -> str:
    return f"{secs(median(values))} ({secs(min(values))}-{secs(max(values))})"


# --- 1. local speed -------------------------------------------------------------------------------

def bench_local(section: Section, repeat: int, **_):
    commands = {
        "preflight lint": [PREFLIGHT, "lint", "--config", GOLDEN / "accelerate.yaml", "--deepspeed", GOLDEN / "ds.json"],
        "preflight node": [PREFLIGHT, "node"],
        "ds_report": [BIN / "ds_report"],
        "accelerate env": [BIN / "accelerate", "env"],
    }
    # preflight exits 1 on a fail verdict (this machine may well have one): that is still a complete run.
    times = interleaved({name: (lambda argv=argv: run(argv, ok=(0, 1))[0]) for name, argv in commands.items()},
                        repeat)
    ds = median(times["ds_report"])
    section.table.append(["command", "median (min-max)", "ds_report / this"])
    for name, values in times.items():
        section.table.append([f"`{name}`", spread(values), f"{ds / median(values):.1f}x"])
    for name in ("preflight lint", "preflight node"):
        ratio = ds / median(times[name])
        section.targets.append(Target(f"`{name}` at least 10x faster than `ds_report`", f"{ratio:.1f}x", ratio >= 10))
    section.notes.append(f"lint reads `{GOLDEN.relative_to(ROOT)}/accelerate.yaml` and `ds.json`; `preflight node` "
                         "runs every node-scope check on this machine.")
    bench_lint_sbatch(section, repeat)


BATCH_SCRIPT = ROOT / "tests" / "fixtures" / "sbatch" / "torchtitan_multinode_trainer.slurm"
BIG_LINE = 'srun torchrun --nnodes 2 --nproc_per_node 8 train.py --a "$X" \'b c\' $(hostname) \\\n  --x y\n'


def peak(argv: Sequence[str]) -> tuple:
    """(wall seconds, peak resident MB) of one run of a command (its own rusage: os.wait4)."""
    started = time.perf_counter()
    child = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - started, usage.ru_maxrss / 1024


def bench_lint_sbatch(section: Section, repeat: int) -> None:
    """`lint --sbatch`: a published script (start-up to verdict), and one of 1 MiB, sbatch's and lint's bound."""
    small = [peak([PREFLIGHT, "lint", "--sbatch", BATCH_SCRIPT])[0] for _ in range(repeat + 1)][1:]
    with tempfile.TemporaryDirectory() as folder:
        big = Path(folder) / "big.sbatch"
        head = "#!/bin/bash\n#SBATCH --nodes=2\n"
        big.write_text(head + BIG_LINE * ((2**20 - len(head)) // len(BIG_LINE)))
        large = [peak([PREFLIGHT, "lint", "--sbatch", big]) for _ in range(repeat)]
    walls, mbs = [w for w, _ in large], [m for _, m in large]
    section.table.append([f"`preflight lint --sbatch` ({BATCH_SCRIPT.name})", spread(small), ""])
    section.table.append(["`preflight lint --sbatch` (a script of 1 MiB)", spread(walls), f"{max(mbs):.0f} MB peak"])
    section.targets.append(Target("`lint --sbatch` of a published script in under 0.3 s", secs(median(small)),
                                  median(small) < 0.3))
    section.targets.append(Target("`lint --sbatch` of a 1 MiB script in under 2 s and 200 MB",
                                  f"{secs(median(walls))}, {max(mbs):.0f} MB", median(walls) < 2 and max(mbs) < 200))


# --- the test cluster -----------------------------------------------------------------------------

@contextlib.contextmanager
def test_cluster(nodes: int):
    reason = "; ".join(testcluster.requirements(probe=True))
    if reason:
        raise BenchError(f"no test cluster here: {reason}")
    with testcluster.cluster_lock(), tempfile.TemporaryDirectory(prefix="preflight-bench-") as folder:
        testcluster.clean_stale("bench")
        cluster = testcluster.Cluster(folder, nodes=nodes, prefix="bench")
        try:
            cluster.up()
            yield cluster
        finally:
            cluster.down()


def check_argv(cluster, hosts: Sequence[str], *extra) -> List[str]:
    return [PREFLIGHT, "check", "--hosts", ",".join(hosts), "--ssh-config", cluster.ssh_config,
            "--python", sys.executable, "--json", *extra]


def result(doc: dict, check_id: str) -> dict:
    return next(r for r in doc["results"] if r["id"] == check_id)


def reached_every_host(out: str, what: str) -> None:
    """A `preflight check --json` run counts only when it reached every host (SSH001 passed)."""
    try:
        reach = result(json.loads(out), "SSH001")
    except (ValueError, KeyError, StopIteration) as exc:
        raise BenchError(f"{what}: no JSON document with SSH001: {exc!r}") from None
    if reach["status"] != "pass":
        raise BenchError(f"{what}: SSH001 {reach['status']}: {reach['message']}")


# --- 2. fan-out -----------------------------------------------------------------------------------

def fanout_contenders(cluster, hosts: Sequence[str]) -> Dict[str, Callable[[], float]]:
    # The same agent preflight ships, here from the installed package; after the facts it would serve
    # requests until its input ends, and pdsh keeps ssh's input open.
    collector = f"{shlex.quote(sys.executable)} -m {AGENT} </dev/null"

    def facts_from_every_host(stdout: str, tool: str):
        seen = {line.split(":", 1)[0].strip() for line in stdout.splitlines() if ": {" in line}
        if seen != set(hosts):
            raise BenchError(f"{tool}: facts from {sorted(seen)}, expected {list(hosts)}")

    def preflight():
        elapsed, out = run(check_argv(cluster, hosts, "--skip", "COL"), ok=(0, 1), timeout=60)
        reached_every_host(out, "preflight")
        return elapsed

    def paramiko():
        elapsed, out = run(check_argv(cluster, hosts, "--skip", "COL", "--ssh", "paramiko"), ok=(0, 1), timeout=60)
        reached_every_host(out, "preflight --ssh paramiko")
        return elapsed

    def clush():
        elapsed, out = run([BIN / "clush", "-w", ",".join(hosts), "-f", "64", "--nostdin",
                            "-o", f"-F {cluster.ssh_config}", collector], timeout=60)
        facts_from_every_host(out, "clush")
        return elapsed

    def pdsh():
        elapsed, out = run(["pdsh", "-R", "ssh", "-f", "64", "-w", ",".join(hosts), collector],
                           env={"PDSH_SSH_ARGS_APPEND": f"-F {cluster.ssh_config}"}, timeout=60)
        facts_from_every_host(out, "pdsh")
        return elapsed

    return {"preflight check": preflight, "clush": clush, "pdsh -R ssh": pdsh, "preflight --ssh paramiko": paramiko}


FANOUT_SIZES = (1, 16, 64, 96)


def fanout_limit(n: int) -> float:
    """preflight check's time at most this times the faster of clush and pdsh: 1.1 for one host (it does more
    than they do: clock samples, the port probe, every check), 1.0 from 16 hosts on."""
    return 1.1 if n == 1 else 1.0


def bench_fanout(section: Section, repeat: int, cluster, sizes: Sequence[int], png: Path,
                 profile: Optional[Path] = None, **_):
    medians: Dict[str, Dict[int, float]] = {}
    section.table.append(["hosts", "preflight check", "clush", "pdsh -R ssh", "preflight --ssh paramiko",
                          "preflight / the faster of the two"])
    for n in sizes:
        times = interleaved(fanout_contenders(cluster, cluster.nodes[:n]), repeat, warm_up=n == sizes[0])
        for name, values in times.items():
            medians.setdefault(name, {})[n] = median(values)
        faster = min(("clush", "pdsh -R ssh"), key=lambda name: medians[name][n])
        ratio = medians["preflight check"][n] / medians[faster][n]
        section.table.append([str(n)] + [spread(v) for v in times.values()] + [f"{ratio:.2f} ({faster})"])
        if n in FANOUT_SIZES:
            limit = fanout_limit(n)
            section.targets.append(Target(f"fan-out at N = {n} at most {limit:.1f}x the faster of clush and pdsh",
                                          f"{ratio:.2f}x {faster}'s time", ratio <= limit))
    section.notes.append("preflight check reaches the hosts with the system's OpenSSH client (its default), as clush "
                         "and pdsh do; `--ssh paramiko`, its fallback where no ssh is installed, is timed beside it. "
                         "preflight asks ssh for the curve25519-sha256 key exchange first (docs/ssh.md; the test "
                         "hosts' ssh_config sets none); clush and pdsh run ssh with its own order, whose "
                         "post-quantum sntrup761x25519 exchange costs about 140 ms of this machine's CPU per "
                         "connection.")
    section.notes.append("preflight also takes clock samples, probes the main port and runs every check; clush and "
                         f"pdsh only run `python -m {AGENT}` (the same facts, no verdict). Fan-out 64 "
                         "for all three; each run is verified to bring back every host's facts. The test hosts' sessions "
                         "run none of this machine's shell start-up files (scripts/testcluster.py "
                         "`NO_SHELL_START_UP`): a pyenv init there rehashes under one lock that all the test hosts "
                         "share, and 96 sessions at once would queue for it, whichever tool starts them.")
    plot_fanout(medians, png)
    section.notes.append(f"Scaling curve: [{png.name}]({png.name}).")
    if profile is not None:
        table, *graphs = profile_fanout(cluster, sizes, profile)
        print(f"scripts/bench: {table}:\n{table.read_text()}scripts/bench: flame graphs "
              + ", ".join(map(str, graphs)), file=sys.stderr, flush=True)


PY_SPY = BIN / "py-spy"  # a core dependency of preflight (doctor runs it on the nodes)
PROFILE_RATE = 1000  # samples a second: a node's agent runs for some 40 ms, the head at one host for 0.3 s
NODE_PROFILE_TRIES = 5


def profile_fanout(cluster, sizes: Sequence[int], folder: Path) -> List[Path]:
    """Where the fan-out's time goes, for a person to read (--profile), each from one more run outside the timings:
    - what the CPU went to at each size: the head's (its own rusage) and the rest of the machine's, that is the
      test hosts' sshd and agents (/proc/stat), beside the wall time (fanout-cpu.md);
    - py-spy's flame graph of the head's `preflight check` at each size, and of one node's agent (every node runs
      the same program). The head is sampled without being stopped (--nonblocking): stopping a head of 100
      threads 1,000 times a second doubles its time; the agent, one thread for some 40 ms, is stopped to be
      sampled (py-spy's non-blocking reads of it often find no stack at all). A flame graph draws CPU, not waiting:
      at one host most of the wall time is the node's, and at 96 hosts on two cores the nodes' CPU, which the
      first table shows."""
    def record(path: Path, *flags: str) -> List[str]:
        return [str(PY_SPY), "record", *flags, "--rate", str(PROFILE_RATE), "--format", "flamegraph", "-o", str(path)]

    folder.mkdir(parents=True, exist_ok=True)
    rows, written = [["hosts", "wall", "the head's CPU", "the rest of the machine's CPU (the hosts' sshd, agents)"]], []
    for n in sizes:
        argv = check_argv(cluster, cluster.nodes[:n], "--skip", "COL")
        head, busy = resource.getrusage(resource.RUSAGE_CHILDREN), machine_busy_s()
        wall, out = run(argv, ok=(0, 1), timeout=120)
        busy, after = machine_busy_s() - busy, resource.getrusage(resource.RUSAGE_CHILDREN)
        reached_every_host(out, f"preflight at {n} hosts")
        head = after.ru_utime + after.ru_stime - head.ru_utime - head.ru_stime
        rows.append([str(n), secs(wall), secs(head), secs(max(0.0, busy - head))])
        path, answer = folder / f"fanout-head-{n}.svg", folder / f"fanout-head-{n}.json"
        # py-spy exits 0 whatever its program did (the program's answer says whether the run counts) and writes
        # its own lines, warnings included, into the program's stdout: the program's goes to a file (the shell
        # execs it, so py-spy samples the same process)
        run(record(path, "--nonblocking") + ["--", "sh", "-c", 'exec "$0" "$@" > ' + shlex.quote(str(answer)), *argv],
            timeout=120)
        try:
            text = answer.read_text()
        except OSError as exc:
            raise BenchError(f"profiled preflight at {n} hosts: {exc}") from None
        reached_every_host(text, f"profiled preflight at {n} hosts")
        written.append(path)
    path = folder / "fanout-node.svg"
    command = shlex.join(record(path) + ["--", sys.executable, "-m", AGENT]) + " </dev/null"
    # py-spy finds a program's interpreter only after it has started; on a busy machine the agent (some 40 ms) can
    # be done by then, and py-spy exits 1 with no samples: another run, a few at most
    for _ in range(NODE_PROFILE_TRIES):
        proc = cluster.ssh(cluster.nodes[0], command, timeout=60)
        if proc.returncode == 0 and "\n{" in proc.stdout:
            break
    else:
        raise BenchError(f"profiled agent on {cluster.nodes[0]}, {NODE_PROFILE_TRIES} runs: exit {proc.returncode}: "
                         f"{(proc.stderr.strip() or proc.stdout.strip())[-400:]}")
    table = folder / "fanout-cpu.md"
    table.write_text(markdown_table(rows) + "\n")
    return [table] + written + [path]


def machine_busy_s() -> float:
    """CPU seconds this machine's cores have been busy since boot (/proc/stat: all but idle and iowait)."""
    user, nice, system, idle, iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def plot_fanout(medians: Dict[str, Dict[int, float]], png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_n in medians.items():
        ax.plot(list(by_n), list(by_n.values()), marker="o", label=name)
    ax.set_xlabel("test hosts")
    ax.set_ylabel("wall time, median (s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(next(iter(medians.values()))))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("facts from N hosts over SSH (fan-out 64)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# --- 3. a hung node -------------------------------------------------------------------------------

RENDEZVOUS = textwrap.dedent("""
    import datetime, sys, time
    import torch.distributed as dist
    rank, world, address, timeout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    start = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method="tcp://" + address, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:
        print("gave up after %.1f s: %s" % (time.monotonic() - start, type(exc).__name__))
        sys.exit(3)
    print("joined")
""")


def bench_hang(section: Section, repeat: int, cluster, folder: Path, **_):
    import torch.distributed.constants as constants

    hosts = cluster.nodes[:HANG_HOSTS]
    hung = hosts[-1]
    script = folder / "rendezvous.py"
    script.write_text(RENDEZVOUS)
    ports = iter(range(29700, 29800))  # a fresh port each time: no TIME_WAIT from the last round in the way

    def preflight():
        elapsed, out = run(check_argv(cluster, hosts, "--timeout", str(HANG_TIMEOUT_S)), ok=(1,), timeout=60)
        reach = result(json.loads(out), "SSH001")
        if reach["status"] != "fail" or reach.get("nodes") != [hung]:
            raise BenchError(f"preflight with {hung} frozen: SSH001 {reach['status']} on {reach.get('nodes')}")
        return elapsed

    def plain_rendezvous():
        """Every rank but the hung node's, started over ssh; done when the last one gives up."""
        address = f"{cluster.ip(hosts[0])}:{next(ports)}"
        started = time.perf_counter()
        procs = [subprocess.Popen(cluster.ssh_argv(host, sys.executable, str(script), str(rank), str(len(hosts)),
                                                   address, str(HANG_TIMEOUT_S)),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank, host in enumerate(hosts[:-1])]
        outs = [p.communicate(timeout=120) for p in procs]
        elapsed = time.perf_counter() - started
        if any(p.returncode != 3 for p in procs):
            raise BenchError(f"plain rendezvous without {hung} did not time out: {[o[0] + o[1][-200:] for o in outs]}")
        return elapsed

    with cluster.frozen_sshd(hung):
        times = interleaved({"preflight": preflight, "plain": plain_rendezvous}, repeat)
    verdict, plain = times["preflight"], times["plain"]
    gloo_default = constants.default_pg_timeout.total_seconds()
    section.table.append(["what", f"{len(hosts)} hosts, {hung}'s sshd frozen", "median (min-max)"])
    section.table.append(["`preflight check --timeout 5`", "verdict: fail, SSH001 names " + hung, spread(verdict)])
    section.table.append([f"plain `init_process_group`, timeout {HANG_TIMEOUT_S} s", "the 3 others give up",
                          spread(plain)])
    section.table.append(["plain `init_process_group`, default timeout",
                          "computed: torch's `default_pg_timeout` (gloo)", f"{gloo_default / 60:.0f} min"])
    section.table.append(["", "NCCL's default (torch documentation; this CPU build has no NCCL)", "10 min"])
    section.targets.append(Target(f"verdict with a hung node within the timeout + 1 s ({HANG_TIMEOUT_S + 1} s)",
                                  f"{secs(median(verdict))} median, {secs(max(verdict))} at most",
                                  max(verdict) <= HANG_TIMEOUT_S + 1))
    section.notes.append(f"A job started on these hosts with the defaults waits {gloo_default / 60:.0f} min (gloo) or "
                         f"10 min (NCCL) before saying anything: {gloo_default / median(verdict):.0f}x and "
                         f"{600 / median(verdict):.0f}x preflight's time to a verdict.")


# --- 4. the collective ----------------------------------------------------------------------------

PLAIN_LOOP = textwrap.dedent("""
    import datetime, json, sys, time
    import torch, torch.distributed as dist
    rank, world, address, sizes, iters = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                          [int(s) for s in sys.argv[4].split(",")], int(sys.argv[5]))
    dist.init_process_group("gloo", init_method="tcp://" + address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    busbw = {}
    for size in sizes:
        buf = torch.ones(size // 4)
        dist.all_reduce(buf)  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        per_iter = (time.perf_counter() - start) / iters
        busbw[size] = size / per_iter / 1e9 * 2 * (world - 1) / world
    if rank == 0:
        print(json.dumps(busbw))
    dist.destroy_process_group()
""")
PLAIN_ITERS = 5


def bench_col(section: Section, repeat: int, cluster, folder: Path, **_):
    from preflight.collective.options import DEFAULT_SIZES

    hosts = cluster.nodes[:COL_HOSTS]
    script = folder / "plain_allreduce.py"
    script.write_text(PLAIN_LOOP)
    ports = iter(range(29800, 29900))
    sizes = ",".join(str(s) for s in DEFAULT_SIZES)
    figures: Dict[str, List[Dict[int, float]]] = {"preflight": [], "plain": []}

    def preflight():
        elapsed, out = run(check_argv(cluster, hosts, "--only", "COL", "--timeout", "120"), timeout=300)
        evidence = result(json.loads(out), "COL002")["evidence"]
        figures["preflight"].append({s["bytes"]: s["busbw_gbps"] for s in evidence["per_size"]})
        return elapsed

    def plain():
        address = f"{cluster.ip(hosts[0])}:{next(ports)}"
        started = time.perf_counter()
        procs = [subprocess.Popen(cluster.ssh_argv(host, sys.executable, str(script), str(rank), str(len(hosts)),
                                                   address, sizes, str(PLAIN_ITERS)),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank, host in enumerate(hosts)]
        outs = [p.communicate(timeout=300) for p in procs]
        if any(p.returncode for p in procs):
            raise BenchError(f"plain all-reduce loop failed: {[o[1][-300:] for o in outs]}")
        figures["plain"].append({int(k): v for k, v in json.loads(outs[0][0].strip().splitlines()[-1]).items()})
        return time.perf_counter() - started

    rounds = max(repeat, COL_MIN_ROUNDS)
    interleaved({"preflight": preflight, "plain": plain}, rounds, warm_up=False)  # figures, not wall times
    section.table.append(["message", "preflight busbw, median (min-max)", "plain loop busbw",
                          "preflight / plain, per round: median (min-max)"])
    ratios = {}
    for size in DEFAULT_SIZES:
        ours = [f[size] for f in figures["preflight"]]
        theirs = [f[size] for f in figures["plain"]]
        # Paired by round: the two ran back to back, so the machine's slow spells fall on both alike.
        per_round = [a / b for a, b in zip(ours, theirs)]
        ratios[size] = median(per_round)
        section.table.append([f"{size >> 20} MiB", gbps(ours), gbps(theirs),
                              f"{ratios[size]:.2f} ({min(per_round):.2f}-{max(per_round):.2f})"])
    largest = max(DEFAULT_SIZES)
    section.targets.append(Target(f"busbw within 10% of the plain torch.distributed loop ({largest >> 20} MiB)",
                                  f"{ratios[largest]:.2f} of the loop's", abs(ratios[largest] - 1) <= 0.10))
    section.notes.append(f"gloo over the test cluster's veth bridge, {len(hosts)} hosts, one rank each; busbw = algbw x "
                         "2(n-1)/n as nccl-tests. preflight times each size for about 0.5 s (3-20 iterations), the "
                         f"loop for {PLAIN_ITERS} iterations after one warm-up. {rounds} rounds, each preflight then "
                         "the loop or the other way round; the ratio is the median of the rounds' ratios.")


def gbps(values: Sequence[float]) -> str:
    return f"{median(values):.3f} GB/s ({min(values):.3f}-{max(values):.3f})"


# --- 5. scale and 6. start-up ---------------------------------------------------------------------

SCALE_SIZES = (1024, 4096, 16384)


def bench_scale_section(section: Section, repeat: int, **_):
    import bench_scale

    section.table.append(["nodes", "results", "checks + report, median (min-max)", "peak RSS", "checks", "JSON",
                          "terminal", "with every report", "its peak RSS"])
    measured = bench_scale.measure_sizes(SCALE_SIZES, repeat)
    for n, m in measured.items():
        section.table.append([f"{n:,}", f"{m['results']:,}", f"{secs(m['wall_s'])} ({secs(m['wall_min_s'])}-"
                              f"{secs(m['wall_max_s'])})", f"{m['peak_mb']:.0f} MB", secs(m["checks_s"]),
                              secs(m["json_s"]), secs(m["terminal_s"]), secs(m["every_report_s"]),
                              f"{m['every_report_peak_mb']:.0f} MB"])
    big, largest = measured[4096], measured[16384]
    section.targets.append(Target("4,096 synthetic nodes through checks and report in under 2 s and 300 MB",
                                  f"{secs(big['wall_s'])}, {big['peak_mb']:.0f} MB",
                                  big["wall_s"] < 2 and big["peak_mb"] < 300))
    section.targets.append(Target("16,384 synthetic nodes through checks and report in under 4 s and 500 MB",
                                  f"{secs(largest['wall_s'])}, {largest['peak_mb']:.0f} MB",
                                  largest["wall_s"] < 4 and largest["peak_mb"] < 500))
    section.targets.append(Target("16,384 synthetic nodes with every report (JUnit, Prometheus, HTML) in under 8 s",
                                  secs(largest["every_report_s"]), largest["every_report_s"] < 8))
    section.notes.append(bench_scale.DESCRIPTION)
    import bench_census

    census = bench_census.measure_sizes((16384,), min(repeat, 3))[16384]
    section.targets.append(Target("the doctor census of 16,384 synthetic nodes judged in under 4 s",
                                  f"{secs(census['wall_s'])}, {census['peak_mb']:.0f} MB", census["wall_s"] < 4))
    section.notes.append(f"doctor at 16,384 nodes ({census['processes']:,} processes), medians of "
                         f"{min(repeat, 3)}: {secs(census['wall_s'])} ({secs(census['wall_min_s'])}-"
                         f"{secs(census['wall_max_s'])}), of it the job across the nodes {secs(census['build_s'])}, "
                         f"the checks {secs(census['checks_s'])}, JSON {secs(census['json_s'])}, terminal "
                         f"{secs(census['terminal_s'])}; peak RSS {census['peak_mb']:.0f} MB. {bench_census.DESCRIPTION}")


def bench_startup(section: Section, repeat: int, **_):
    argv = [sys.executable, "-X", "importtime", "-m", "preflight", "node"]
    runs, heavy = [], set()
    for _ in range(repeat + 1):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        top_level = {}  # module imported at top level -> its cumulative microseconds
        for line in proc.stderr.splitlines():
            match = re.match(r"import time:\s+\d+ \|\s+(\d+) \| ( *)(\S+)", line)
            if not match:
                continue
            microseconds, indent, module = match.groups()
            if module.split(".")[0] in HEAVY_MODULES:
                heavy.add(module.split(".")[0])
            if not indent:
                top_level[module] = int(microseconds) / 1e6
        runs.append(top_level)
    runs = runs[1:]  # the first fills the page cache
    slowest = sorted(runs[-1], key=runs[-1].get, reverse=True)[:4]
    section.table.append(["imports of `preflight node` (`-X importtime`)", "median (min-max)"])
    section.table.append(["all, top-level cumulative", spread([sum(r.values()) for r in runs])])
    for name in slowest:
        section.table.append([f"`{name}`", spread([r.get(name, 0.0) for r in runs])])
    section.table.append(["torch, accelerate, deepspeed or numpy", ", ".join(sorted(heavy)) or "not imported"])
    section.targets.append(Target("torch, deepspeed and accelerate off the start-up path",
                                  ", ".join(sorted(heavy)) or "none imported", not heavy))



# --- 7. doctor ------------------------------------------------------------------------------------

STUCK = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"


def bench_doctor(section: Section, repeat: int, cluster, folder: Path, **_):
    """A real stuck job (torchrun, gloo): node rank 0 on two of three hosts. doctor's time to name them,
    against the time the job itself takes to say anything."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
    import torch.distributed.constants as constants

    hosts, port = cluster.nodes[:DOCTOR_HOSTS], 29850
    script = folder / "stuck.py"
    script.write_text(STUCK)
    job = [cluster.node_popen(host, [str(BIN / "torchrun"), "--nnodes", str(len(hosts)), "--node_rank",
                                     str(0 if i < 2 else i), "--master_addr", hosts[0], "--master_port", str(port),
                                     "--nproc-per-node", "1", str(script)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i, host in enumerate(hosts)]
    try:
        deadline = time.monotonic() + 60
        while not all(f":{port} " in cluster.netns_exec(h, ["ss", "-Hltn"]).stdout for h in hosts[:2]):
            if time.monotonic() > deadline or any(p.poll() is not None for p in job):
                raise BenchError("the stuck job did not start on the test hosts")
            time.sleep(0.2)

        def doctor():
            elapsed, out = run([PREFLIGHT, "doctor", "--hosts", ",".join(hosts), "--ssh-config", str(cluster.ssh_config),
                                "--python", sys.executable, "--port", str(port), "--json"], ok=(1,), timeout=60)
            found = result(json.loads(out), "RUN002")
            if found["status"] != "fail" or found.get("nodes") != hosts[:2]:
                raise BenchError(f"doctor did not name {hosts[:2]}: RUN002 {found['status']} on {found.get('nodes')}")
            return elapsed

        times = interleaved({"doctor": doctor}, repeat)["doctor"]
    finally:
        for proc in job:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    rendezvous = static_tcp_rendezvous._default_timeout_seconds
    group = constants.default_pg_timeout.total_seconds()
    section.table.append(["what", f"{len(hosts)} hosts, node rank 0 on two of them", "median (min-max)"])
    section.table.append(["`preflight doctor --port N`", "RUN002 names both nodes", spread(times)])
    section.table.append(["the job itself", "computed: torch's static rendezvous timeout", f"{rendezvous / 60:.0f} min"])
    section.table.append(["", "computed: torch's `default_pg_timeout` (gloo)", f"{group / 60:.0f} min"])
    section.targets.append(Target("a stuck job diagnosed within 10 s on 3 nodes", f"{secs(median(times))} median, "
                                  f"{secs(max(times))} at most", max(times) <= 10))
    section.notes.append(f"The stack samples are one second apart (a stack seen at the same place twice is stuck): "
                         f"that second is part of each figure. The job says nothing for {rendezvous / 60:.0f} min "
                         f"({rendezvous / median(times):.0f}x doctor's time).")


def bench_datapath_section(section: Section, repeat: int, cluster, **_):
    import bench_datapath

    try:
        measured = bench_datapath.measure(run, lambda hosts, *extra: check_argv(cluster, hosts, *extra), cluster,
                                          repeat=repeat)
    except bench_datapath.DataPathError as exc:
        raise BenchError(str(exc)) from None
    section.table = bench_datapath.table(measured)
    largest = max(measured["paths"])
    probe = median(measured["paths"][largest]["probe_s"])
    section.targets.append(Target(f"the path probes between every pair of {largest} healthy hosts in under 2 s",
                                  secs(probe), probe < 2))
    section.notes.append(bench_datapath.DESCRIPTION)


BENCHES = {"local": ("1. Local speed", bench_local), "fanout": ("2. Fan-out", bench_fanout),
           "hang": ("3. Time to a verdict with a hung node", bench_hang), "col": ("4. Collective", bench_col),
           "scale": ("5. Scale beyond this machine", bench_scale_section), "startup": ("6. Start-up", bench_startup),
           "doctor": ("7. Time to a diagnosis of a stuck job", bench_doctor),
           "datapath": ("8. The data path between every pair", bench_datapath_section)}


# --- the report -----------------------------------------------------------------------------------

def markdown_table(rows: List[List[str]]) -> str:
    header, *body = rows
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def machine() -> List[List[str]]:
    def first(path, key):
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return line.split(":", 1)[-1].split("=", 1)[-1].strip().strip('"')
        return "?"

    def version(argv):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
            return (proc.stdout + proc.stderr).strip().splitlines()[0]
        return "not installed"

    from importlib.metadata import PackageNotFoundError, version as dist_version

    def dist(name):
        with contextlib.suppress(PackageNotFoundError):
            return dist_version(name)
        return "not installed"

    memory_kb = int(first("/proc/meminfo", "MemTotal").split()[0]) if first("/proc/meminfo", "MemTotal") != "?" else 0
    rows = [["machine", f"{first('/proc/cpuinfo', 'model name')}, {os.cpu_count()} cores, "
                        f"{memory_kb / 2**20:.0f} GiB, {first('/etc/os-release', 'PRETTY_NAME')}, "
                        f"kernel {platform.release()}"],
            ["python", platform.python_version()]]
    commit = version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    rows.append(["preflight", f"{dist(DISTRIBUTION)} (commit {commit})"])
    for name in ("torch", "accelerate", "deepspeed", "paramiko", "clustershell", "matplotlib"):
        rows.append([name, dist(name)])
    rows.append(["pdsh", version(["pdsh", "-V"])])
    rows.append(["OpenSSH", version(["ssh", "-V"])])
    return [["", "version"]] + rows


def report(sections: Dict[str, Section], argv: List[str], started: datetime.datetime, total_s: float) -> str:
    out = [BEGIN, f"Run {started:%Y-%m-%d %H:%M} UTC in {total_s / 60:.1f} min: `{shlex.join(argv)}`", "",
           markdown_table(machine()), "", "## Targets", ""]
    targets = [t for s in sections.values() for t in s.targets]
    out.append(markdown_table([["target", "measured", "met"]] +
                              [[t.text, t.measured, "yes" if t.met else "**no**"] for t in targets]))
    for s in sections.values():
        out += ["", f"## {s.title}", "", f"_{s.seconds:.0f} s_", ""]
        if s.error:
            out.append(f"Not measured: {s.error}")
            continue
        out.append(markdown_table(s.table))
        out += [""] + s.notes if s.notes else []
    out.append(END)
    return "\n".join(out) + "\n"


def write_benchmarks(text: str):
    """Replace the generated block of BENCHMARKS.md, keeping what people wrote around it."""
    old = BENCHMARKS.read_text() if BENCHMARKS.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    head, _, rest = old.partition(BEGIN)
    _, _, tail = rest.partition(END)
    BENCHMARKS.write_text(head + text.rstrip("\n") + tail)


# --- main -----------------------------------------------------------------------------------------

def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be 1 or more")
    return value


def on_sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")  # so that the test cluster comes down on `kill PID` too


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=positive, default=5, help="timed rounds per comparison (default 5; the collective at least 7)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                        help=f"run only these sections: {', '.join(SECTIONS)}")
    parser.add_argument("--hosts", nargs="+", type=positive, default=list(FANOUT_SIZES), metavar="N",
                        help=f"fan-out sizes (default {' '.join(map(str, FANOUT_SIZES))}; at most 99)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md as it is")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also write where the fan-out's time goes to DIR: the CPU of the head and of the hosts "
                             "at each size (fanout-cpu.md), py-spy flame graphs of the head's preflight check at each "
                             "size (fanout-head-N.svg) and of one node's agent (fanout-node.svg)")
    args = parser.parse_args(argv)
    if max(args.hosts) > 99:
        parser.error("--hosts: at most 99 test hosts")
    if args.profile is not None and "fanout" not in args.only:
        parser.error("--profile: it profiles the fanout section, which --only leaves out")
    started, clock = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    # Bytecode for the checkout, as pip writes it for an installed (not editable) preflight and as the tools
    # compared have it: with PYTHONDONTWRITEBYTECODE set, every run would compile preflight's sources again.
    for folder in ("preflight", "checks"):
        compileall.compile_dir(str(ROOT / folder), quiet=1)
    signal.signal(signal.SIGTERM, on_sigterm)
    sections = {name: Section(BENCHES[name][0]) for name in args.only}
    needs_cluster = [n for n in ("fanout", "hang", "col", "doctor", "datapath") if n in sections]
    cluster_nodes = max([COL_HOSTS, HANG_HOSTS] + (args.hosts if "fanout" in sections else []))
    if "datapath" in sections:
        import bench_datapath

        cluster_nodes = max(cluster_nodes, max(bench_datapath.SIZES))
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="preflight-bench-")))

        def run_section(name: str, cluster) -> None:
            section = sections[name]
            print(f"scripts/bench: {section.title} ...", file=sys.stderr, flush=True)
            t = time.monotonic()
            try:
                # --no-write leaves the plot as it is too: this run's goes to its temporary folder
                BENCHES[name][1](section, args.repeat, cluster=cluster, folder=folder, sizes=args.hosts,
                                 png=folder / PNG.name if args.no_write else PNG,
                                 profile=args.profile.resolve() if args.profile else None)
            except (BenchError, testcluster.ClusterError) as exc:
                section.error = str(exc)
            section.seconds = time.monotonic() - t
            print(f"scripts/bench: {section.title}: {section.error or 'done'} ({section.seconds:.0f} s)",
                  file=sys.stderr, flush=True)

        # The sections without test hosts first: a cluster's bridge ports and idle sessions would be this
        # machine's load and, for the scale section, interfaces in every synthetic node's facts.
        for name in [n for n in sections if n not in needs_cluster]:
            run_section(name, None)
        if needs_cluster:
            try:
                cluster = stack.enter_context(test_cluster(cluster_nodes))
            except (BenchError, testcluster.ClusterError) as exc:
                for name in needs_cluster:
                    sections[name].error = str(exc)
            else:
                for name in needs_cluster:
                    run_section(name, cluster)
    text = report(sections, ["scripts/bench"] + (argv if argv is not None else sys.argv[1:]), started,
                  time.monotonic() - clock)
    print(text)
    failed = [s.title for s in sections.values() if s.error]
    complete = not failed and set(sections) == set(SECTIONS) and args.repeat >= 5
    if complete and not args.no_write:
        write_benchmarks(text)
        print(f"scripts/bench: wrote {BENCHMARKS.name}", file=sys.stderr)
    elif not args.no_write:
        print(f"scripts/bench: {BENCHMARKS.name} left as it is (only a full run of every section, --repeat 5 or "
              "more, without errors is written)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
