"""How the cost of `preflight check` grows with the cluster, without a network: synthetic facts for N nodes
go through the same code as after a real gathering (engine.evaluate: selection, plan, every registered check)
and then through the reports.

What is timed (wall_s, peak_mb) is what `preflight check` itself produces: the checks, the terminal report
and the JSON document (`--json`). The report files that are asked for by option (`--junit`, `--prometheus`,
`--html`) are timed after it, in the same process, as separate figures (every_report_s, every_report_peak_mb).

The facts are this machine's, from the real collector, sent through JSON once per node and decoded as
gather decodes them (gather.facts_decoder: the sections nodes send alike are one object), with each node's own
host section: its name and address (node0001, 10.1.0.1, ...).
This machine has no GPU: the gpus fact is the collector's own, built from the recorded answers of an
8 x H100 node (tests/fixtures/nvml). A few nodes are made odd (PLANTED) so that the checks find something:
tests/bench/test_bench_scale.py checks that they do. The all-reduce needs a network: no collective probe, so the
COL checks skip as they do when it did not run. The libraries' validators (tag `deep`: importing accelerate
and deepspeed, seconds, the same for any N) are left out, as `--skip deep` does.

    .venv/bin/python scripts/bench_scale.py --nodes 1024 4096 16384 --repeat 5

Each run is a fresh interpreter (`--one N`), so imports and the peak RSS (VmHWM) are its own.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPUS_PER_NODE = 8
PORT = 29500
DESCRIPTION = (
    "Synthetic facts for N nodes go through what `preflight check` runs after gathering them: the real checks "
    "(`engine.evaluate`, every registered check but the `deep` validators, which import accelerate and DeepSpeed "
    "and cost the same for any N) and both of its reports, the terminal text and the `--json` document. "
    "*checks + report* and *peak RSS* are that path: wall time from the facts in memory to both reports "
    "written, and the process's peak RSS by then (VmHWM, facts included). The opt-in report files "
    "(`--junit`, `--prometheus`, `--html`) are written after it in the same process and timed apart "
    "(*with every report*). The facts are this machine's, from the real collector, sent through JSON once per "
    "node and decoded as gather decodes them (the sections nodes send alike are one object), each node with its "
    "own host section (name, address); the GPUs are the "
    "recorded answers of an 8 x H100 node, and a few nodes are made odd (an older torch, clock skew, a lost GPU, "
    "an unreachable node, ...) so that the checks have something to find. The all-reduce needs a network, so "
    "the COL checks skip as when it did not run. Each run is a fresh interpreter; medians of the runs."
)
# Clusters run with these set the same everywhere (PKG004 compares them).
JOB_ENV = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "0", "NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "8"}


def name_of(i: int) -> str:
    return f"node{i + 1:04d}"


def address_of(i: int) -> str:
    return f"10.1.{i // 250}.{i % 250 + 1}"


# --- what is made odd, and on which nodes -----------------------------------------------------------

def _older_torch(state, n):
    state["facts"]["packages"]["versions"]["torch"] = "2.12.1"


def _clock_ahead(seconds):
    def shift(state, n):
        state["clock"]["offset_s"] += seconds
    return shift


def _nccl_ib_disabled(state, n):
    state["facts"]["env"]["NCCL_IB_DISABLE"] = "1"


def _small_shm(state, n):
    state["facts"]["storage"]["shm"].update(total_bytes=64 * 2**20, free_bytes=64 * 2**20)


def _gpu_lost(state, n):
    state["facts"]["gpus"] = json.loads(json.dumps(recorded_gpus("gpu-lost.json")))  # as from the wire


def _stale_hosts_entry(state, n):
    state["facts"]["host"]["head_resolves_to"] = ["10.9.9.9"]


def _ssh_timeout(state, n):
    state.update(facts=None, clock=None, error={"kind": "timeout", "message": "no answer within 30 s",
                                                "remediation": "check that the node is up and sshd runs"})


# (what, how many nodes, change): the check that must notice it is in tests/bench/test_bench_scale.py.
PLANTED = (
    ("older-torch", 3, _older_torch),
    ("clock-fail", 1, _clock_ahead(2.5)),
    ("clock-warn", 1, _clock_ahead(0.3)),
    ("nccl-env", 1, _nccl_ib_disabled),
    ("small-shm", 1, _small_shm),
    ("gpu-lost", 1, _gpu_lost),
    ("stale-hosts", 1, _stale_hosts_entry),
    ("ssh-timeout", 1, _ssh_timeout),
    ("port-blocked", 1, None),  # a probe answer, not a fact: see synthesize
)


def planted_nodes(n: int) -> dict:
    """what -> the node names made odd that way: spread over the cluster, never the head."""
    step, placed = max(1, n // (len(PLANTED) + 1)), {}
    for k, (what, count, _) in enumerate(PLANTED):
        first = step * (k + 1)
        placed[what] = [name_of(i) for i in range(first, first + count)]
    return placed


# --- the synthetic cluster ------------------------------------------------------------------------

def recorded_gpus(recording: str) -> dict:
    """The gpus fact as the collector builds it from a recording of NVML's answers (no GPU here)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        from nvml_fake import fake
    finally:
        sys.path.remove(os.path.join(ROOT, "tests"))
    from preflight.node import gpus

    return gpus.facts(fake(recording)())


def write_inputs(n: int, folder: str) -> dict:
    """The job's accelerate config, DeepSpeed config and hostfile for n nodes of 8 GPUs; the report paths."""
    import yaml

    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "train_batch_size": 4 * 2 * GPUS_PER_NODE * n, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
          "gradient_clipping": 1.0}
    accelerate = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                  "deepspeed_config": {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": True},
                  "machine_rank": 0, "num_machines": n, "num_processes": GPUS_PER_NODE * n,
                  "main_process_ip": address_of(0), "main_process_port": PORT,
                  "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    paths = {name: os.path.join(folder, name) for name in
             ("accelerate.yaml", "ds_config.json", "hostfile", "report.txt", "report.json", "junit.xml",
              "preflight.prom", "report.html")}
    with open(paths["ds_config.json"], "w") as f:
        json.dump(ds, f, indent=2)
    with open(paths["accelerate.yaml"], "w") as f:
        yaml.safe_dump(accelerate, f)
    with open(paths["hostfile"], "w") as f:
        f.writelines(f"{name_of(i)} slots={GPUS_PER_NODE}\n" for i in range(n))
    return paths


def synthesize(n: int, folder: str) -> tuple:
    """(facts, probes) as gather_ssh returns them for n nodes, the planted variations included."""
    from preflight.remote import gather
    from preflight.node import collector

    base = collector.collect({"head": address_of(0), "port": PORT, "paths": {"workdir": folder}})
    base["env"].update(JOB_ENV)
    base["gpus"] = recorded_gpus("h100x8.json")
    base["clock"].update(synchronised=True, esterror_s=0.0005, maxerror_s=0.01)
    base["limits"]["memlock"] = [None, None]  # unlimited, as an RDMA node has it
    base["host"].update(rdma_devices=[f"mlx5_{k}" for k in range(GPUS_PER_NODE)], head_resolves_to=[address_of(0)])
    changes = {name: change for what, _, change in PLANTED if change for name in planted_nodes(n)[what]}
    jitter = random.Random(n)
    decode = gather.facts_decoder()
    # Each node's facts line as its agent would send it: the sections all nodes share, encoded once, and its own
    # host section; a node made odd is encoded whole after the change.
    pieces = {key: f"{json.dumps(key)}: {json.dumps(value)}" for key, value in base.items()}
    facts = {}
    for i in range(n):
        name, address = name_of(i), address_of(i)
        host = dict(base["host"], hostname=name, fqdn=f"{name}.cluster", resolves_to=[address],
                    resolves_to_own_interface=True, interfaces={"lo": ["127.0.0.1", "::1"], "eth0": [address]},
                    route_to_head={"head": address_of(0), "source": address, "interface": "eth0"})
        state = {"facts": dict(json.loads(json.dumps(base)) if name in changes else base, host=host), "error": None,
                 "clock": {"offset_s": jitter.uniform(-0.002, 0.002), "bound_s": 0.0002, "rtt_s": 0.0004}}
        if name in changes:
            changes[name](state, name)
        if state["facts"] is not None:
            doc = state["facts"]
            line = "{" + ", ".join(f"{json.dumps(key)}: {json.dumps(value)}" if key == "host" or name in changes
                                   else pieces[key] for key, value in doc.items()) + "}"
            state["facts"] = decode(line)  # as gather decodes it, sharing what other nodes sent alike
        facts[name] = state
    blocked = set(planted_nodes(n)["port-blocked"])
    workers = {name: ({"ok": False, "error": "[Errno 111] Connection refused", "address": address_of(0)}
                      if name in blocked else {"ok": True, "address": address_of(0)})
               for name, state in list(facts.items())[1:] if state["error"] is None}
    probes = {"port": {"head": name_of(0), "listen": {"bound": True}, "workers": workers},
              "head": {"name": name_of(0), "address": address_of(0)}}
    return facts, probes


# --- one run, in this interpreter -------------------------------------------------------------------

def peak_mb() -> float:
    """This process's peak RSS. VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a
    child of a big parent (scripts/bench has imported torch) would report the parent's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_once(n: int, folder: str) -> dict:
    """Imports, synthesis, then the checks and `preflight check`'s reports (terminal, JSON), then the opt-in
    report files, timed apart (seconds); peak RSS in MB after each stage."""
    started = time.perf_counter()
    from preflight import cli, engine, registry, runner
    from preflight.report import render
    from preflight.report import files as reports
    from preflight.result import verdict

    reg = registry.load()
    for lazy in ("prometheus_client", "yaml"):  # imported on the way by reports and the plan: count them here
        importlib.import_module(lazy)
    imported = time.perf_counter()

    paths = write_inputs(n, folder)
    facts, probes = synthesize(n, folder)
    synthesized = time.perf_counter()
    peak_before = peak_mb()

    args = cli.build_parser().parse_args([
        "check", "--hostfile", paths["hostfile"], "--config", paths["accelerate.yaml"], "--skip", "deep", "--json",
        "--junit", paths["junit.xml"], "--prometheus", paths["preflight.prom"], "--html", paths["report.html"]])
    stages, peaks = {}, {}  # seconds of each stage; the peak RSS once it is done (which stage raised it)
    mark = begun = time.perf_counter()  # the path timed: from here (the arguments parsed) to both reports
    synthetic = lambda plan, args, specs: runner.CheckContext(plan, facts, probes)  # noqa: E731  (gather_for's place)
    plan, _, results, _ = engine.evaluate(reg, args, gather=synthetic)
    stages["checks_s"], peaks["checks"], mark = time.perf_counter() - mark, peak_mb(), time.perf_counter()
    outcome, elapsed = verdict(results), time.perf_counter() - synthesized
    with open(paths["report.json"], "w") as f:
        print(render.to_json(results, outcome, plan.nodes, elapsed), file=f)  # as `preflight check --json`
    stages["json_s"], peaks["json"], mark = time.perf_counter() - mark, peak_mb(), time.perf_counter()
    with open(paths["report.txt"], "w") as f:  # a file is no terminal: plain text, as with a pipe
        render.terminal(results, outcome, elapsed, stream=f)
    stages["terminal_s"], peaks["terminal"], mark = time.perf_counter() - mark, peak_mb(), time.perf_counter()
    checked = time.perf_counter()
    for attr, _, writer in reports.WRITERS:  # what reports.write_all does, one writer at a time
        writer(getattr(args, attr), results, outcome, plan.nodes, elapsed)
        stages[f"{attr}_s"], peaks[attr], mark = time.perf_counter() - mark, peak_mb(), time.perf_counter()
    done = time.perf_counter()
    return dict(nodes=n, results=len(results), verdict=outcome, import_s=imported - started,
                synthesis_s=synthesized - imported, peak_before_mb=peak_before,
                wall_s=checked - begun, peak_mb=peaks["terminal"],  # `preflight check`: checks, terminal, JSON
                every_report_s=done - begun, every_report_peak_mb=peak_mb(),  # and the three report files
                **stages, peaks_mb=peaks, paths=paths)


# --- many runs, each in a fresh interpreter --------------------------------------------------------

def _child(n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="pf-bench-") as folder:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(n), "--dir", folder],
                              cwd=folder, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"bench_scale --one {n} failed: {done.stderr.strip()[-2000:]}")
        return json.loads(done.stdout.splitlines()[-1])


def measure(n: int, repeat: int = 5) -> dict:
    """Medians over `repeat` fresh interpreters for n nodes, with the spread of the wall time."""
    return _medians([_child(n) for _ in range(repeat)])


def measure_sizes(sizes, repeat: int = 5) -> dict:
    """n -> medians, the sizes interleaved run by run so that machine noise falls on all of them alike."""
    runs = {n: [] for n in sizes}
    for _ in range(repeat):
        for n in sizes:
            runs[n].append(_child(n))
    return {n: _medians(r) for n, r in runs.items()}


def _medians(runs: list) -> dict:
    numbers = [k for k, v in runs[0].items() if isinstance(v, float)]
    summary = {k: statistics.median(r[k] for r in runs) for k in numbers}
    walls = [r["wall_s"] for r in runs]
    summary.update(nodes=runs[0]["nodes"], results=runs[0]["results"], verdict=runs[0]["verdict"],
                   runs=len(runs), wall_min_s=min(walls), wall_max_s=max(walls))
    return summary


def table(by_size: dict) -> str:
    extra = ("junit_s", "prometheus_s", "html_s")
    rows = ["| nodes | results | checks + report: median (min-max) | peak RSS | of it, before the checks | checks "
            "| json | terminal | with every report | its peak RSS | " + " | ".join(s[:-2] for s in extra)
            + " | synthesis | import |", "|---" * (12 + len(extra)) + "|"]
    for n, m in by_size.items():
        rows.append(f"| {n:,} | {m['results']:,} | {m['wall_s']:.2f} s ({m['wall_min_s']:.2f}-{m['wall_max_s']:.2f}) "
                    f"| {m['peak_mb']:.0f} MB | {m['peak_before_mb']:.0f} MB | {m['checks_s']:.2f} s "
                    f"| {m['json_s']:.2f} s | {m['terminal_s']:.2f} s | {m['every_report_s']:.2f} s "
                    f"| {m['every_report_peak_mb']:.0f} MB | " + " | ".join(f"{m[s]:.2f} s" for s in extra)
                    + f" | {m['synthesis_s']:.2f} s | {m['import_s']:.2f} s |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeat", type=int, default=5, help="fresh interpreters per size (medians)")
    parser.add_argument("--one", type=int, metavar="N", help=argparse.SUPPRESS)  # a child: one run, one JSON line
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = run_once(args.one, args.dir)
        print(json.dumps({k: v for k, v in result.items() if k != "paths"}))
        return
    by_size = measure_sizes(args.nodes, args.repeat)
    print(table(by_size))
    print(f"\n(medians of {args.repeat} runs each, sizes interleaved)\n\n{DESCRIPTION}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # run from a checkout as well as from an installed preflight
    main()
