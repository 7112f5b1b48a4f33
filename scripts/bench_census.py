"""How the cost of `preflight doctor` grows with the job, without a network: the census of a running job on N
synthetic nodes of 8 GPUs goes through what doctor runs after gathering it (running.build, the RUN checks, the
reports).

What is timed (wall_s, peak_mb) is what `preflight doctor` itself produces once the nodes' censuses are in: the
job across the nodes (`running.build`, as `engine.census_for` makes it), the checks (`engine.evaluate` for
`doctor`, the gathering replaced by the synthetic census), the terminal report and the JSON document (`--json`).
With --files, the report files asked for by option (`--junit`, `--prometheus`, `--html`) are timed after it,
apart. (They once repeated RUN001's census table for every node, N x 9N rows: 38 s and 4.4 GB for JUnit, 81 s
and 13.8 GB for HTML at 1,024 nodes; evidence that large is now written once.)

The shape is real: the script starts a small job on this machine (torchrun, 2 processes, gloo: rank 0 waits in
all_reduce, rank 1 sleeps in its data loading) and takes its census with the real collector (py-spy's stacks,
/proc's sockets and job variables). Each synthetic node is that census made a node of an N-node job: one
torchrun launcher (its flags: --nnodes N --nproc_per_node 8 --node_rank i --master_addr HEAD), 8 ranks with
their RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, MASTER_ADDR, ... (rank 0's stack: in all_reduce), their sockets
(the head's launcher holds the store: it listens, the others connect), pids, ages and CPU times of their own,
and the GPUs (the recorded answers of an 8 x H100 node, each rank's pid on its GPU). Each node's facts are sent
through JSON and decoded as gather decodes them (gather.facts_decoder). A few nodes are made odd (PLANTED) so
that doctor has causes to name: tests/bench/test_bench_census.py checks that it names them, and no healthy node.

    .venv/bin/python scripts/bench_census.py --nodes 1024 4096 16384 --repeat 3

Each run is a fresh interpreter (`--one N`); the real job's census is taken once (by the parent) and handed
to the runs as a file (`--template`).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scale  # noqa: E402  (the cluster's names and addresses, the recorded GPUs, peak RSS: one definition)

GPUS_PER_NODE = 8
PORT = 29500
name_of, address_of, peak_mb = bench_scale.name_of, bench_scale.address_of, bench_scale.peak_mb
DESCRIPTION = (
    "The census of a running job on N nodes of 8 GPUs goes through what `preflight doctor` runs once the nodes "
    "have answered: the job across the nodes (`running.build`), the RUN checks (`engine.evaluate` for `doctor`) "
    "and both of its reports, the terminal text (with the census table) and the `--json` document. *build + "
    "checks + report* and *peak RSS* are that path, from the censuses in memory to both reports written, and "
    "the process's peak RSS by then (VmHWM, facts included); the opt-in report files (`--junit`, `--prometheus`, "
    "`--html`) are left out (`--files` times them apart). The shape is a real census: a 2-process gloo torchrun job "
    "started on this machine and read by the real collector (py-spy stacks, /proc sockets and job variables), "
    "made each node of an N-node job (one torchrun launcher, 8 ranks with their variables, sockets, pids, ages, "
    "stacks in all_reduce, the recorded GPUs of an 8 x H100 node), sent through JSON once per node and decoded as "
    "gather decodes it. A few nodes are made odd (two nodes with one node rank, a wrong master address, a "
    "firewalled master, a rank elsewhere, a rank in another collective, a dead rank, an old job on the port) "
    "so that doctor has causes to name. Each run is a fresh interpreter; medians of the runs."
)

# The job started to take a real census: rank 0 waits in all_reduce for rank 1, which sleeps in its loader.
JOB = '''import os, sys, time
import torch
import torch.distributed as dist


def load_batch():
    time.sleep(3600)


def step():
    dist.all_reduce(torch.ones(4))


dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], "ready%d" % dist.get_rank()), "w").close()
if dist.get_rank() == 0:
    step()
else:
    load_batch()
'''
WRONG_MASTER = "10.255.0.1"  # no node has it


# --- the real census -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_census(folder: str, timeout: float = 120.0) -> dict:
    """The facts (census included) the real collector takes on this machine of a running 2-process gloo
    torchrun job, decoded from JSON: {"facts", "port"}."""
    from preflight.node import collector

    script, port = os.path.join(folder, "train.py"), _free_port()
    with open(script, "w") as f:
        f.write(JOB)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    launcher = [torchrun] if os.path.exists(torchrun) else [sys.executable, "-m", "torch.distributed.run"]
    command = launcher + ["--nnodes", "1", "--nproc_per_node", "2", "--node_rank", "0", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), script, folder]
    with open(os.path.join(folder, "job.log"), "w") as log:
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(os.path.join(folder, f"ready{r}")) for r in (0, 1)):
            if job.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(folder, "job.log")) as f:
                    raise RuntimeError(f"the job to take a census of did not start: {f.read()[-2000:]}")
            time.sleep(0.2)
        time.sleep(0.5)  # each rank in its last call
        for _ in range(3):  # py-spy may miss a stack on a loaded machine: read again
            facts = json.loads(json.dumps(collector.collect(
                {"head": "127.0.0.1", "port": port, "census": {"port": port, "deadline_s": 10, "interval_s": 0.3}})))
            # Other jobs on this machine (tests, other users) are not this one: its launcher and its ranks only.
            census = facts["census"]
            census["processes"] = [p for p in census["processes"] if job.pid in (p["pid"], p["ppid"])]
            if _whole(census):
                break
    finally:
        os.killpg(job.pid, signal.SIGTERM)  # the launcher's session: its ranks too
        try:
            job.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    if not _whole(facts["census"]):
        said = [(p["kind"], p.get("env", {}).get("RANK"), bool(p.get("threads")), p.get("stable"))
                for p in facts["census"]["processes"]]
        raise RuntimeError(f"the census of the job is not whole: (kind, rank, stack read, still) {said}; "
                           f"stacks {facts['census']['stacks']}")
    return {"facts": facts, "port": port}


def _whole(census: dict) -> bool:
    """The launcher and both ranks, each with its stack read twice and the ranks still."""
    ranks = [p for p in census["processes"] if p["kind"] == "rank"]
    return len(ranks) == 2 and len(census["processes"]) == 3 and all(p.get("threads") for p in census["processes"]) \
        and all(p.get("stable") is True for p in ranks)


# --- what is made odd, and on which nodes ------------------------------------------------------------

# (what, how many nodes): the check that must name it is in tests/bench/test_bench_census.py.
PLANTED = (
    ("duplicate-node-rank", 1),  # its launcher (and so its ranks) took the node rank of the node after it
    ("wrong-master", 1),  # launched with another master address: its launcher hangs connecting, no rank yet
    ("master-unreachable", 1),  # the master's port is dropped on the way: its launcher hangs, no rank yet
    ("rank-elsewhere", 1),  # one rank sleeps in its data loading while the others wait in all_reduce
    ("other-collective", 1),  # one rank waits in broadcast
    ("dead-rank", 1),  # one rank exited: its launcher has 7
    ("old-job-on-port", 1),  # a process of an older job holds the port on that node
)


def planted_nodes(n: int) -> dict:
    """what -> the node names made odd that way: spread over the job, never the head."""
    step, placed = max(1, n // (len(PLANTED) + 2)), {}
    for k, (what, count) in enumerate(PLANTED):
        first = step * (k + 1)
        placed[what] = [name_of(i) for i in range(first, first + count)]
    return placed


def duplicated_rank(n: int) -> int:
    """The node rank the planted node takes: its neighbour's (that node is named too, by RUN002)."""
    return int(planted_nodes(n)["duplicate-node-rank"][0][4:])  # node0042 is node rank 41: the next one's


def missing_ranks(n: int) -> list:
    """The global ranks that run nowhere: the dead one, the nodes that never started theirs, and those of
    the node whose ranks took its neighbour's numbers."""
    placed = {what: int(names[0][4:]) - 1 for what, names in planted_nodes(n).items()}
    missing = [GPUS_PER_NODE * placed["dead-rank"] + GPUS_PER_NODE - 1]
    for what in ("wrong-master", "master-unreachable", "duplicate-node-rank"):
        missing += range(GPUS_PER_NODE * placed[what], GPUS_PER_NODE * (placed[what] + 1))
    return sorted(missing)


# --- the synthetic job -----------------------------------------------------------------------------

def _socket(local, local_port, remote, remote_port, state):
    return {"local": local, "local_port": local_port, "remote": remote, "remote_port": remote_port, "state": state}


def _with_flags(argv: list, values: dict) -> list:
    """The launcher's command line with these flags' values in place of the real job's."""
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word in values:
            out[i + 1] = values[word]
    return out


def _renamed(threads: list, old: str, new: str) -> list:
    return [dict(t, frames=[[new if f[0] == old else f[0], f[1], f[2]] for f in t["frames"]]) for t in threads]


class Job:
    """The N-node job made from the real census: each node's facts document, as its agent would send it."""

    def __init__(self, n: int, template: dict):
        self.n, self.port = n, PORT
        facts = copy.deepcopy(template["facts"])
        census = facts.pop("census")
        self.base = facts
        self.base["gpus"] = bench_scale.recorded_gpus("h100x8.json")
        self.launcher = next(p for p in census["processes"] if p["kind"] == "launcher")
        ranks = sorted((p for p in census["processes"] if p["kind"] == "rank"), key=lambda p: int(p["env"]["RANK"]))
        self.waiting, self.loading = ranks  # rank 0 in all_reduce, rank 1 in its loader
        self.census = census
        self.real_port = template["port"]
        self.odd = {names[0]: what for what, names in planted_nodes(n).items()}
        self.head = address_of(0)

    def _pids(self, i: int) -> tuple:
        rng = random.Random(i)
        launcher = rng.randrange(2000, 3_000_000)
        return launcher, [launcher + 30 + 2 * k for k in range(GPUS_PER_NODE)]

    def node_facts(self, i: int) -> dict:
        """Node i's facts, census included (Python objects, before JSON)."""
        name, address, n = name_of(i), address_of(i), self.n
        odd = self.odd.get(name)
        rng = random.Random(n * 7919 + i)
        node_rank = duplicated_rank(n) if odd == "duplicate-node-rank" else i
        master = WRONG_MASTER if odd == "wrong-master" else self.head
        launcher_pid, rank_pids = self._pids(i)
        started = odd not in ("wrong-master", "master-unreachable")  # a launcher stuck connecting starts no rank
        if odd == "dead-rank":
            rank_pids = rank_pids[:-1]
        if not started:
            rank_pids = []
        age = round(900 + rng.uniform(0, 5), 1)
        launcher = dict(self.launcher, pid=launcher_pid, ppid=launcher_pid - 1, children=rank_pids,
                        age_s=age, cpu_s=round(rng.uniform(1, 3), 2), cpu_percent=round(rng.uniform(0, 2), 1),
                        argv=_with_flags(self.launcher["argv"], {
                            "--nnodes": str(n), "--nproc_per_node": str(GPUS_PER_NODE), "--node_rank": str(node_rank),
                            "--master_addr": master, "--master_port": str(self.port)}))
        if i == 0:  # the store: listening, a connection from each process of the job (the census keeps 64)
            held = [_socket("::", self.port, "::", 0, "LISTEN")] + self._store_guests(63)
            launcher.update(sockets=held, sockets_dropped=self._store_connections() - 63)
        else:
            state = "SYN_SENT" if not started else "ESTABLISHED"
            launcher.update(sockets=[_socket(address, 40000 + rng.randrange(20000), master, self.port, state)],
                            sockets_dropped=0)
        processes = [launcher]
        for k, pid in enumerate(rank_pids):
            rank = GPUS_PER_NODE * node_rank + k
            model = self.loading if odd == "rank-elsewhere" and k == 3 else self.waiting
            threads = model["threads"]
            if odd == "other-collective" and k == 5:
                threads = _renamed(threads, "all_reduce", "broadcast")
            env = dict(model["env"], RANK=str(rank), LOCAL_RANK=str(k), ROLE_RANK=str(rank), GROUP_RANK=str(node_rank),
                       WORLD_SIZE=str(GPUS_PER_NODE * n), LOCAL_WORLD_SIZE=str(GPUS_PER_NODE),
                       GROUP_WORLD_SIZE=str(n), MASTER_ADDR=master, MASTER_PORT=str(self.port))
            gloo = 30000 + rng.randrange(20000)
            peer = address_of((i + 1) % n)
            processes.append(dict(
                model, pid=pid, ppid=launcher_pid, env=env, threads=threads, children=[],
                age_s=round(age - 18 - rng.uniform(0, 1), 1), cpu_s=round(rng.uniform(60, 90), 2),
                cpu_percent=round(rng.uniform(0, 1.5), 1),
                sockets=[_socket(address, gloo, "0.0.0.0", 0, "LISTEN"),
                         _socket(address, 40000 + rng.randrange(20000), self.head, self.port, "ESTABLISHED"),
                         _socket(address, 40000 + rng.randrange(20000), peer, 30000 + rng.randrange(20000),
                                 "ESTABLISHED")], sockets_dropped=0))
        listeners = []
        if odd == "old-job-on-port":
            listeners.append({"pid": launcher_pid - 900, "argv": _with_flags(self.launcher["argv"], {
                "--nnodes": "2", "--nproc_per_node": str(GPUS_PER_NODE), "--node_rank": "1",
                "--master_addr": address, "--master_port": str(self.port)}), "argv_dropped": 0,
                "age_s": round(86400 + rng.uniform(0, 600), 1), "env": {}})
        census = dict(self.census, processes=processes, listeners=listeners, port=self.port,
                      stacks=dict(self.census["stacks"], read=len(processes)),
                      seconds=round(rng.uniform(1.2, 1.6), 3))
        gpus = copy.deepcopy(self.base["gpus"])
        for device, pid in zip(gpus["devices"], rank_pids):
            device["processes"] = [{"pid": pid, "used_memory_bytes": 61 * 2**30 + rng.randrange(2**28)}]
        host = dict(self.base["host"], hostname=name, fqdn=f"{name}.cluster", resolves_to=[address],
                    interfaces={"lo": ["127.0.0.1", "::1"], "eth0": [address]}, head_resolves_to=[self.head],
                    route_to_head={"head": self.head, "source": address, "interface": "eth0"})
        return dict(self.base, host=host, gpus=gpus, census=census)

    def _store_connections(self) -> int:
        """The connections the head's store holds: each launcher's and each rank's that reached it."""
        return sum(len(self._pids(i)[1]) + 1 for i in range(self.n)
                   if self.odd.get(name_of(i)) not in ("wrong-master", "master-unreachable")) \
            - len(planted_nodes(self.n)["dead-rank"])

    def _store_guests(self, count: int) -> list:
        """The first `count` of them, as /proc lists them (node by node here)."""
        guests, rng = [], random.Random(self.n)
        for i in range(self.n):
            for _ in range(GPUS_PER_NODE + 1):
                if len(guests) == count:
                    return guests
                guests.append(_socket(self.head, self.port, address_of(i), 40000 + rng.randrange(20000),
                                      "ESTABLISHED"))
        return guests


def write_inputs(n: int, folder: str) -> dict:
    """The job's hostfile, and the report paths."""
    paths = {name: os.path.join(folder, name) for name in
             ("hostfile", "report.txt", "report.json", "junit.xml", "preflight.prom", "report.html")}
    with open(paths["hostfile"], "w") as f:
        f.writelines(f"{name_of(i)} slots={GPUS_PER_NODE}\n" for i in range(n))
    return paths


def synthesize(n: int, template: dict) -> dict:
    """The nodes' states as gather returns them for doctor: each node's facts line decoded as gather decodes it."""
    from preflight.remote import gather

    job, decode = Job(n, template), gather.facts_decoder()
    facts = {}
    for i in range(n):
        doc = decode(json.dumps(job.node_facts(i)))  # each node's own line, from the wire
        doc["session"] = {"stdout": ""}
        facts[name_of(i)] = {"facts": doc, "error": None, "clock": None}
    return facts


# --- one run, in this interpreter -------------------------------------------------------------------

def run_once(n: int, folder: str, template: dict, files: bool = False) -> dict:
    """Imports, synthesis, then running.build, the RUN checks and doctor's reports (terminal, JSON), then (with
    `files`) the opt-in report files, timed apart (seconds); peak RSS in MB after each stage."""
    started = time.perf_counter()
    from preflight import cli, engine, registry, runner
    from preflight.report import render
    from preflight.report import files as reports
    from preflight.result import verdict

    reg = registry.load()
    for lazy in ("prometheus_client",):  # imported on the way by the reports: count it here
        importlib.import_module(lazy)
    imported = time.perf_counter()

    paths = write_inputs(n, folder)
    facts = synthesize(n, template)
    synthesized = time.perf_counter()
    peak_before = peak_mb()

    asked = ["--junit", paths["junit.xml"], "--prometheus", paths["preflight.prom"], "--html", paths["report.html"]]
    args = cli.build_parser().parse_args(["doctor", "--hostfile", paths["hostfile"], "--port", str(PORT), "--json"]
                                         + (asked if files else []))
    stages, peaks, built = {}, {}, {}

    def synthetic(plan, args, specs):  # census_for's place: the nodes have answered; the job across them is built
        mark = time.perf_counter()
        built["census"] = engine.job_census(plan.nodes, facts, args.port)  # as census_for makes it
        built["s"] = time.perf_counter() - mark
        return runner.CheckContext(plan, facts, {"head": {"name": plan.nodes[0], "address": address_of(0)},
                                                 "census": built["census"]})

    mark = begun = time.perf_counter()  # the path timed: from here (the arguments parsed) to both reports
    plan, _, results, _ = engine.evaluate(reg, args, gather=synthetic)
    stages["build_s"] = built["s"]
    stages["checks_s"], peaks["checks"], mark = time.perf_counter() - mark - built["s"], peak_mb(), time.perf_counter()
    outcome, elapsed = verdict(results), time.perf_counter() - synthesized
    with open(paths["report.json"], "w") as f:
        print(render.to_json(results, outcome, plan.nodes, elapsed), file=f)  # as `preflight doctor --json`
    stages["json_s"], peaks["json"], mark = time.perf_counter() - mark, peak_mb(), time.perf_counter()
    with open(paths["report.txt"], "w") as f:  # a file is no terminal: plain text, as with a pipe
        render.terminal(results, outcome, elapsed, stream=f)
    stages["terminal_s"], peaks["terminal"], mark = time.perf_counter() - mark, peak_mb(), time.perf_counter()
    checked = time.perf_counter()
    for attr, _, writer in reports.WRITERS if files else ():  # what reports.write_all does, one writer at a time
        writer(getattr(args, attr), results, outcome, plan.nodes, elapsed)
        stages[f"{attr}_s"], peaks[attr], mark = time.perf_counter() - mark, peak_mb(), time.perf_counter()
    done = time.perf_counter()
    census = built["census"]
    return dict(nodes=n, processes=len(census.procs), results=len(results), verdict=outcome,
                import_s=imported - started, synthesis_s=synthesized - imported, peak_before_mb=peak_before,
                wall_s=checked - begun, peak_mb=peaks["terminal"],  # `preflight doctor`: build, checks, terminal, JSON
                every_report_s=done - begun, every_report_peak_mb=peak_mb(),  # and the three report files
                **stages, peaks_mb=peaks, paths=paths)


# --- many runs, each in a fresh interpreter --------------------------------------------------------

def _child(n: int, template_path: str, files: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="pf-bench-census-") as folder:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(n), "--dir", folder,
                               "--template", template_path] + (["--files"] if files else []),
                              cwd=folder, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"bench_census --one {n} failed: {done.stderr.strip()[-2000:]}")
        return json.loads(done.stdout.splitlines()[-1])


def measure_sizes(sizes, repeat: int = 3, template: dict = None, files: bool = False) -> dict:
    """n -> medians, the sizes interleaved run by run so that machine noise falls on all of them alike. The
    real job's census is taken once, here (template: one taken already). `files`: the opt-in report files too
    (apart, after the reports of the path timed)."""
    with tempfile.TemporaryDirectory(prefix="pf-bench-census-") as folder:
        template = template or real_census(folder)
        template_path = os.path.join(folder, "template.json")
        with open(template_path, "w") as f:
            json.dump(template, f)
        runs = {n: [] for n in sizes}
        for _ in range(repeat):
            for n in sizes:
                runs[n].append(_child(n, template_path, files))
    return {n: dict(bench_scale._medians(r), processes=r[0]["processes"]) for n, r in runs.items()}


def table(by_size: dict) -> str:
    extra = [s for s in ("junit_s", "prometheus_s", "html_s") if all(s in m for m in by_size.values())]
    files = ["with every report", *(s[:-2] for s in extra)] if extra else []
    rows = ["| " + " | ".join(["nodes", "processes", "results", "build + checks + report: median (min-max)",
                               "peak RSS", "of it, before", "build", "checks", "json", "terminal", *files,
                               "synthesis"]) + " |", "|---" * (11 + len(files)) + "|"]
    for n, m in by_size.items():
        cells = [f"{n:,}", f"{m['processes']:,}", f"{m['results']:,}",
                 f"{m['wall_s']:.2f} s ({m['wall_min_s']:.2f}-{m['wall_max_s']:.2f})", f"{m['peak_mb']:.0f} MB",
                 f"{m['peak_before_mb']:.0f} MB", *(f"{m[k]:.2f} s" for k in ("build_s", "checks_s", "json_s", "terminal_s"))]
        if extra:
            cells += [f"{m['every_report_s']:.2f} s", *(f"{m[k]:.2f} s" for k in extra)]
        rows.append("| " + " | ".join(cells + [f"{m['synthesis_s']:.2f} s"]) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeat", type=int, default=3, help="fresh interpreters per size (medians)")
    parser.add_argument("--one", type=int, metavar="N", help=argparse.SUPPRESS)  # a child: one run, one JSON line
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--template", help=argparse.SUPPRESS)  # the real job's census, taken by the parent
    parser.add_argument("--files", action="store_true", help="time the opt-in report files too (--junit, "
                        "--prometheus, --html)")
    args = parser.parse_args()
    if args.one:
        with open(args.template) as f:
            template = json.load(f)
        result = run_once(args.one, args.dir, template, args.files)
        print(json.dumps({k: v for k, v in result.items() if k != "paths"}))
        return
    by_size = measure_sizes(args.nodes, args.repeat, files=args.files)
    print(table(by_size))
    print(f"\n(medians of {args.repeat} runs each, sizes interleaved)\n\n{DESCRIPTION}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # run from a checkout as well as from an installed preflight
    main()
