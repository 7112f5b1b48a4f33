"""The engine: the one pipeline every command that runs checks follows (lint, check, node, launch, doctor).

    arguments -> profile -> selected checks -> Plan -> facts (a fact source) -> checks -> redacted Results
    -> report -> what the verdict decides (drain, launch) -> exit code

lint reads no node; check, node and launch gather each node's facts and the probes (gather_for); doctor's
fact source is the census of the running job (census_for). preflight.cli parses and dispatches only.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from dataclasses import replace
from typing import List, Optional

from preflight import registry, runner
from preflight.inputs import inventory, launchcmd, models, profile
from preflight.inputs.configs import load_hostfile
from preflight.inputs.documents import InputError
from preflight.node.launchfiles import accelerate_default_config
from preflight.plan import Limits, build_plan, default_accelerate_config
from preflight.progress import for_stderr
from preflight.report import redact, render
from preflight.report import files as report_files
from preflight.result import EXIT_NOT_READY, UsageError, exit_code, verdict


def evaluate(reg, args, gather=None):
    """Parsed arguments to Results, the one pipeline of every command that runs checks: report paths, profile,
    selection, plan, facts, checks, redaction. gather(plan, args, specs) gives the CheckContext (default: the
    command's fact source, gather_for or census_for); scripts/bench_scale.py gives synthetic facts.
    Returns (plan, ctx, results, started: time.perf_counter() when the run began)."""
    report_files.check_paths(args)  # an unwritable report file is exit 2 before any check runs
    if args.command == "doctor":
        return _evaluate_running_job(reg, args, gather or census_for)
    gather = gather or gather_for
    profile = _profile(args, reg)
    only, skip = selectors(args)
    try:
        scopes = ("config",) if args.command == "lint" else ("config", "node", "cluster")
        # The RUN checks read a running job's census, which only `doctor` takes: elsewhere they would only add
        # a skip each, unless asked for by name.
        candidates = [c for c in reg.checks if c.scope in scopes and (only or c.family != "RUN")]
        specs = registry.select(candidates, only, skip + list(profile.skip if profile else ()), known=reg.checks)
    except registry.SelectionError as exc:
        raise UsageError(str(exc)) from None
    started = time.perf_counter()
    budget = getattr(args, "budget", None)
    deadline = time.monotonic() + budget - min(1.0, budget * 0.1) if budget else None  # room to report/drain
    if (getattr(args, "drain", False) or getattr(args, "undrain", False)):
        from preflight.gate import slurm

        if slurm.scontrol_path() is None:
            raise UsageError("--drain/--undrain need SLURM's scontrol, which is not on PATH")
    batch = sbatch_script(args)
    words = launch_command(args)
    if batch is not None and not words and batch.main is not None:
        words = list(batch.main.command.argv)  # the script's launch line, as the lines after `--` are judged
    manifest = k8s_manifest(args)
    if manifest is not None and not words and manifest.main is not None:
        words = list(manifest.main[2].launch.command.argv)  # the container's launch, judged as `-- COMMAND` is
    command = launchcmd.parse(words)
    config, deepspeed = args.config, args.deepspeed
    if batch is not None and deepspeed is None:
        deepspeed = batch_deepspeed_file(command)
    # The files the command names, when this machine has them too, are the ones the CFG checks lint
    # (each node reads its own for the JOB checks).
    named = command.get("config_file") if command.launcher == "accelerate" else None
    if config is None and isinstance(named, str) and os.path.isfile(named):
        config = named
    named_elsewhere = config is None and isinstance(named, str)  # only the nodes have it: not this default
    named = command.get("deepspeed_config_file")
    if deepspeed is None and isinstance(named, str) and os.path.isfile(named):
        deepspeed = named
    named = command.get("hostfile") if command.launcher == "deepspeed" else None
    hostfile = args.hostfile or (named if isinstance(named, str) and os.path.isfile(named) else None)
    if config is None and not named_elsewhere and default_accelerate_config():
        config = default_accelerate_config()  # what `accelerate launch` uses without --config_file
        print(f"preflight: using accelerate's default config {config}", file=sys.stderr)
    plan = build_plan(
        config=config,
        deepspeed=deepspeed,
        hostfile=hostfile,
        world_size=args.world_size,
        deep=getattr(args, "deep", False) or args.command != "lint",
        nodes=None if args.command == "lint" else _target(args),
        # The port the job will use: --port, else the command's own flag, else the config's.
        port=getattr(args, "port", None) or command.integer("main_process_port") or command.integer("master_port"),
        limits=_limits(args, profile),
        checkpoint_dir=getattr(args, "checkpoint_dir", None),
        resume_from=getattr(args, "resume_from", None) or (command.resume_flag or (None, None))[1],
        resume_named_by=None if getattr(args, "resume_from", None) else (command.resume_flag or (None,))[0],
        profile=profile,
        command=command.argv,
        config_path=args.config,
        launching=args.command == "launch",
        python=getattr(args, "python", None),
        memory=models.inputs(args, profile),
        batch=batch,
        manifest=manifest,
    )
    given = config or deepspeed or args.hostfile or command.argv or getattr(plan.memory, "model", None) or batch \
        or manifest or plan.resume_from
    if args.command == "lint" and not given:  # a PASS of nothing would be a verdict without evidence
        raise UsageError("nothing to lint: give --config, --deepspeed, --sbatch, --k8s, --hostfile or --model (and "
                         f"no accelerate default config is at {accelerate_default_config()})")
    ctx = runner.CheckContext(plan)
    if args.command != "lint":
        if deadline is None:
            ctx = gather(plan, args, specs)
        else:
            ctx = _gather_bounded(plan, args, specs, deadline, budget, gather)
        gc.freeze()  # the facts live until exit: the collections that the checks and reports set off skip them
    with collector_paused():  # a tenth of the checks' time at 16,384 nodes; they leave no cycles to collect
        results = runner.run(specs, ctx, deadline, budget)
    # Secrets out of every output (terminal, JSON, report files, a drain reason): preflight.report.redact.
    return plan, ctx, redact.results(results), started


def _evaluate_running_job(reg, args, gather):
    """`preflight doctor`: the same pipeline over a second fact source, the census of the running job on every
    node (read only), and the RUN checks (with SSH: a node not reached)."""
    if args.hostfile == "":
        raise UsageError("--hostfile is an empty path")
    if getattr(args, "flight_recorder", None) == "":
        raise UsageError("--flight-recorder is an empty prefix (give PATH/PREFIX: the files are PREFIX<rank>)")
    try:
        specs = registry.select([c for c in reg.checks if c.family in ("RUN", "SSH")], *selectors(args),
                                known=reg.checks)
    except registry.SelectionError as exc:
        raise UsageError(str(exc)) from None
    started = time.perf_counter()
    if args.slurm_job:
        from preflight.gate import slurm

        nodes = tuple(slurm.job_nodes(args.slurm_job, args.timeout))
    else:
        nodes = _target(args)
    plan = build_plan(nodes=nodes, port=args.port)
    ctx = gather(plan, args, specs)
    with collector_paused():
        return plan, ctx, redact.results(runner.run(specs, ctx)), started


RAS_EVERYWHERE = 8  # nodes up to which doctor asks NCCL's RAS on every node


def census_for(plan, args, specs=()):
    """The running job's census on every node (doctor's fact source), and the job it makes across them."""
    from preflight.remote import early, gather

    census = {"port": args.port, "pids": args.pid, "stacks": not args.no_stacks, "deadline_s": args.timeout * 0.6,
              "flight_recorder": getattr(args, "flight_recorder", None),
              # NCCL's RAS answers for the whole job from any node: asked everywhere on a few nodes, else only
              # where the job's first two nodes' ranks run (not 16,384 job-wide RAS queries at once)
              "ras": "all" if len(plan.nodes) <= RAS_EVERYWHERE else "first"}
    transport = "srun" if args.slurm_job else early.transport_for(args)
    options = gather.GatherOptions(python=args.python, timeout=args.timeout, fanout=args.fanout,
                                   ssh_config=args.ssh_config, accept_new=args.ssh_accept_new, ssh_client=args.ssh,
                                   port=plan.port,
                                   progress=for_stderr(args.json), transport=transport,
                                   census=census, slurm_job=args.slurm_job)
    facts, probes = gather.gather(list(plan.nodes), plan.remote, options)
    # Without --port, the port of the one job found (several jobs: RUN001 says so and asks for --port).
    probes["census"] = job_census(plan.nodes, facts, args.port)
    return runner.CheckContext(plan, facts, probes)


def job_census(nodes, facts, port):
    """running.build with the cyclic collector paused (collector_paused): the facts and the census it makes
    (150,000 processes at 16,384 nodes) live until exit."""
    from preflight.job import running

    with collector_paused():
        return running.build(nodes, facts, port)


@contextlib.contextmanager
def collector_paused():
    """The cyclic collector paused while doctor makes what lives until exit (the census, the checks' results with
    its table of every process): each collection it would set off meanwhile walks all of it again, a third of the
    time at 16,384 nodes. What was made is then frozen out of the collector's later walks."""
    was = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


def run(reg, args) -> int:
    """Every command that runs checks: the pipeline, the report, then what the verdict decides (a SLURM node
    drained or returned, the job launched); the exit code."""
    command = launch_command(args)
    if args.command == "launch":
        if not command:
            raise UsageError("launch needs the command to run after `--`, e.g. preflight launch -- accelerate launch train.py")
    plan, ctx, results, started = evaluate(reg, args)
    budget = getattr(args, "budget", None)
    outcome = report(args, plan, results, time.perf_counter() - started)
    if getattr(args, "drain", False) or getattr(args, "undrain", False):
        _slurm_state(args, results, outcome, started, budget)
    code = exit_code(outcome, args.strict)
    if args.command == "launch" and code == 0:
        sys.stdout.flush()
        sys.stderr.flush()
        from preflight.gate import launcher

        if plan.remote and launchcmd.is_accelerate_launch(command):  # every node, with its rank (README)
            return launcher.run(plan.nodes, ctx.probes["head"]["address"], plan.port, command,
                                ssh_config=args.ssh_config, accept_new=args.ssh_accept_new, ssh_client=args.ssh,
                                timeout=args.timeout,
                                progress=for_stderr(args.json),
                                runner=launcher.head_runner(ctx.probes.get("job"), plan.head))
        command = launcher.here_command(command)
        try:
            os.execvp(command[0], command)  # the job keeps our PID, signals and exit code
        except OSError as exc:
            raise UsageError(f"cannot run {command[0]!r}: {exc.strerror}") from None
    if args.command == "launch":
        print("preflight: not launching: the job is not ready (see the report above)", file=sys.stderr)
    return code if code == 0 else EXIT_NOT_READY


def report(args, plan, results, elapsed: float) -> str:
    """The terminal report or the JSON document, then the report files asked for; the verdict."""
    outcome = verdict(results)
    if args.json:
        print(render.to_json(results, outcome, plan.nodes, elapsed))
    else:
        render.terminal(results, outcome, elapsed, verbose=args.verbose)
    report_files.write_all(args, results, outcome, plan.nodes, elapsed)
    return outcome


def selectors(args) -> tuple:
    """--only and --skip as lists; an empty one (`--only ','`, `--skip ''`: often an unset shell variable) is
    exit 2, never read as "every check" or "none"."""
    for option in ("only", "skip"):
        text = getattr(args, option)
        if text is not None and (not text.strip() or any(not part.strip() for part in text.split(","))):
            raise UsageError(f"--{option} {text!r} has an empty selector: give check IDs, ID prefixes, names or "
                             "tags, separated by commas")
    return registry.parse_selectors(args.only), registry.parse_selectors(args.skip)


def sbatch_script(args):
    """--sbatch SCRIPT, read as sbatch and the shell will (preflight.inputs.batchscript), or None."""
    path = getattr(args, "sbatch", None)
    if path is None:
        return None
    from preflight.inputs import batchscript

    if path == "":
        raise UsageError("--sbatch is an empty path")
    return batchscript.load(path)


def k8s_manifest(args):
    """--k8s MANIFEST, read as the cluster will run it (preflight.inputs.manifests), or None."""
    path = getattr(args, "k8s", None)
    if path is None:
        return None
    from preflight.inputs import manifests

    if path == "":
        raise UsageError("--k8s is an empty path")
    return manifests.load(path)


def batch_deepspeed_file(command) -> Optional[str]:
    """The DeepSpeed JSON a batch script's launch names to the training script (--deepspeed FILE, the HF Trainer's;
    --deepspeed_config FILE, DeepSpeed's), when this machine has it: linted as --deepspeed would be."""
    args = list(command.script_args)
    for k, word in enumerate(args):
        name, eq, value = word.partition("=")
        if name in ("--deepspeed", "--deepspeed_config"):
            path = value if eq else (args[k + 1] if k + 1 < len(args) else "")
            if path and "$" not in path and os.path.isfile(path):
                return path
    return None


def launch_command(args) -> List[str]:
    """The words after `--` (the job's launch command), or none."""
    words = list(getattr(args, "launch_command", None) or [])
    if words and words[0] != "--":
        raise UsageError(f"unexpected argument {words[0]!r}; put the launch command after `--`")
    return words[1:]


def _profile(args, reg):
    """--profile FILE, else ./preflight.toml, else [tool.preflight] of ./pyproject.toml, else None."""
    path = args.profile if args.profile is not None else profile.find()
    if path is None:
        return None
    if path == "":
        raise UsageError("--profile is an empty path")
    loaded = profile.load(path)
    try:
        registry.select(reg.checks, (), loaded.skip)
    except registry.SelectionError as exc:
        raise InputError(path, f"checks.skip: {exc}", loaded.skip_line) from None
    print(f"preflight: using profile {path}", file=sys.stderr)
    return loaded


def _limits(args, profile):
    """Defaults, then the profile's [thresholds], then the flags given on the command line."""
    limits = profile.limits(Limits()) if profile else Limits()
    given = {"clock_warn_s": getattr(args, "clock_warn", None), "clock_fail_s": getattr(args, "clock_fail", None),
             "min_busbw_gbps": getattr(args, "min_busbw", None)}
    return replace(limits, **{k: v for k, v in given.items() if v is not None})


def _target(args) -> tuple:
    """The nodes: --hosts, --slurm, or (for check and launch) the hostfile; none means this machine."""
    if getattr(args, "hosts", None) is not None:
        return tuple(inventory.validate(inventory.expand(args.hosts, "--hosts"), "--hosts"))
    if getattr(args, "slurm", False):
        return tuple(inventory.from_slurm())
    if args.command in ("check", "launch", "doctor") and args.hostfile:
        entries, first = load_hostfile(args.hostfile).entries, {}
        for entry in entries:
            if first.setdefault(entry.host, entry.line) != entry.line:  # DeepSpeed refuses it: CFG021 fails it
                print(f"preflight: warning: {args.hostfile}:{entry.line}: host {entry.host!r} is listed again (first "
                      f"on line {first[entry.host]}); it is checked once", file=sys.stderr)
        return tuple(inventory.validate(list(first), args.hostfile))
    return ()


def _gather_bounded(plan, args, specs, deadline: float, budget: float, gather):
    """gather(plan, args, specs) within the budget: past it, no facts, and every node check is an error (a deadline)."""
    from preflight.remote.session import NodeError, run_with_deadline

    try:
        return run_with_deadline(lambda: gather(plan, args, specs), max(0.0, deadline - time.monotonic()))
    except NodeError:
        print(f"preflight: gathering facts did not fit the budget of {budget:g} s", file=sys.stderr)
        error = {"kind": "budget", "message": f"the facts were not gathered within the budget of {budget:g} s",
                 "remediation": "find what hangs on this node (a stale NFS mount, DNS, the NTP server), or raise --budget"}
        return runner.CheckContext(plan, {name: {"facts": None, "error": error, "clock": None}
                                          for name in plan.nodes}, {})


def _slurm_state(args, results, outcome: str, started: float, budget) -> None:
    """--drain / --undrain: this node's SLURM state after the verdict (messages on stderr)."""
    from preflight.gate import slurm

    name = slurm.node_name()
    timeout = 10.0 if not budget else max(0.5, budget - (time.perf_counter() - started))
    try:
        if outcome == "fail" and args.drain:
            reason = slurm.drain_reason(slurm.first_failure(results))
            slurm.drain(name, reason, timeout)
            print(f"preflight: drained SLURM node {name}: {reason}", file=sys.stderr)
        elif outcome == "fail" and args.undrain:
            print(f"preflight: not returning SLURM node {name} to service: the verdict is fail", file=sys.stderr)
        elif outcome != "fail" and args.undrain:
            _, said = slurm.undrain(name, timeout)
            print(f"preflight: {said}", file=sys.stderr)
    except slurm.SlurmError as exc:
        print(f"preflight: error: SLURM node {name}: {exc}", file=sys.stderr)


DATA_PATH_CHECKS = frozenset(("NET007", "NET008", "NET009", "NET010", "NET011"))  # read the pairwise path probes


def gather_for(plan, args, specs=()):
    """Facts and probes: over SSH for a target, in-process for this machine alone. The all-reduce (the slow
    part) runs only over SSH, and only when a COL check is selected."""
    from preflight.job import view
    from preflight.remote import early, gather

    collective = None
    if plan.remote and any(s.family == "COL" for s in specs):  # its module (and transport) only then
        from preflight.collective.allreduce import options_from_args

        collective = options_from_args(plan, args)
    options = gather.GatherOptions(
        **early.reaching(args),
        port=plan.port,
        main_address=plan.main_address,
        # The job starts in this directory on every node: each node says whether it has it.
        paths=dict(plan.paths, workdir=plan.workdir) if plan.remote else plan.paths,
        shared_dir=plan.job_path(args.shared_dir) if getattr(args, "shared_dir", None) else None,
        ntp_server=getattr(args, "ntp_server", None),
        progress=for_stderr(args.json),
        collective=collective,
        # the probes between every pair of nodes, only when a check that reads them is selected
        data_paths=any(s.id in DATA_PATH_CHECKS for s in specs),
        job=view.request(plan),
        job_files=view.named_files,
        job_port=None if plan.port_named else lambda head: view.head_port(plan, head),
        early=getattr(args, "early_start", None),
    )
    facts, probes = gather.gather(list(plan.nodes), plan.remote, options)
    probes["job"] = view.launches(plan, facts, (probes.get("head") or {}).get("address"))
    probes["allocation"] = allocation_for(plan, args)
    return runner.CheckContext(plan, facts, probes)


def allocation_for(plan, args):
    """Inside a SLURM allocation, given `--slurm` or `--sbatch`: the allocation as SLURM reports it, its SLURM_*
    variables and `scontrol show job` (CFG075 judges the launch against it); else None."""
    from preflight.gate import slurm
    from preflight.inputs import allocation

    if not (getattr(args, "slurm", False) or plan.batch is not None):
        return None
    jobid = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID") or ""
    text, problem = None, None
    if jobid and slurm.scontrol_path() is not None:
        try:
            text = slurm.job_details(jobid, min(10.0, getattr(args, "timeout", 10.0)))
        except slurm.SlurmError as exc:
            problem = str(exc)
    elif jobid:
        problem = "scontrol is not on PATH"
    return allocation.read(os.environ, text, problem)
