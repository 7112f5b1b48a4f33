"""The command line: `preflight lint|check|node|launch|list|explain` (see the contract in the README)."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import json
import os
import re
import shutil
import signal
import sys
import threading
from typing import List, Optional, Sequence

from preflight import DISTRIBUTION, __version__
from preflight.inputs.documents import InputError
from preflight.inputs.launchcmd import DEFAULT_PORT
from preflight.result import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NOT_READY, UsageError


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# Upper bounds of the numeric options: past them a number is a typo, and 1e300 s would overflow the timers
# (select, socket and thread timeouts raise OverflowError deep inside, far from the option that caused it).
MAX_SECONDS = 1e6  # about 11 days
MAX_COUNT = 1_000_000  # --world-size, --fanout
MAX_PROCS_PER_NODE = 1024
MAX_PID = 2**22  # Linux's largest pid_max


def whole(limit: int, what: str = "a whole number"):
    """An argparse type: a whole number from 1 to `limit`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
        if not 1 <= value <= limit:
            raise argparse.ArgumentTypeError(f"expected {what} from 1 to {limit}, got {text[:40]}")
        return value

    return parse


positive_int = whole(MAX_COUNT)


def positive(unit: str, limit: float = float("inf")):
    """An argparse type: a finite number above 0 (and at most `limit`), of `unit` (seconds, GB/s)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text[:40]!r}") from None
        if not 0 < value < float("inf") or value > limit:  # nan and inf fail the first test
            bound = f" up to {limit:.0f}" if limit < float("inf") else ""
            raise argparse.ArgumentTypeError(f"expected a positive number of {unit}{bound}, got {text[:40]}")
        return value

    return parse


positive_float = positive("seconds", MAX_SECONDS)


port_number = whole(65535, "a port")


def unrecognized(parser: Parser, command: Optional[str], words: List[str]) -> str:
    """One line for options the command does not take, each with the spelling it may have meant, pointing at
    the command's own --help (`preflight lint --confg x`: did you mean --config?)."""
    commands = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
    sub = commands.get(command, parser)
    options = [o for action in sub._actions for o in action.option_strings if o.startswith("--")]
    shown = []
    for word in words:
        close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1) if word.startswith("--") else []
        shown.append(word + (f" (did you mean {close[0]}?)" if close else ""))
    return f"unrecognized arguments: {' '.join(shown)} (see `{sub.prog} --help`)"


def build_parser() -> Parser:
    parser = Parser(prog="preflight", description="Will this multi-node Accelerate + DeepSpeed job start and run?")
    parser.add_argument("--version", action="version", version=f"{DISTRIBUTION} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    def inputs(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="ACCEL_YAML", help="accelerate config file (YAML or JSON)")
        p.add_argument("--deepspeed", metavar="DS_CONFIG", help="DeepSpeed config (JSON)")
        p.add_argument("--hostfile", metavar="FILE", help="DeepSpeed hostfile (`host slots=N` a line)")
        p.add_argument("--world-size", type=positive_int, metavar="N",
                       help="processes of the whole job, for the batch arithmetic (default: from the configs)")
        p.add_argument("--only", metavar="SEL", help="run only these checks: IDs, ID prefixes, names or tags")
        p.add_argument("--skip", metavar="SEL", help="do not run these checks")
        p.add_argument("--profile", metavar="FILE",
                       help="thresholds, pins, skips and per-host expectations (default: ./preflight.toml, "
                            "else [tool.preflight] of ./pyproject.toml)")
        p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        p.add_argument("--strict", action="store_true", help="warnings make the verdict not ready (exit 1)")
        p.add_argument("-v", "--verbose", action="store_true", help="list every result, passes and skips too")
        p.add_argument("--junit", metavar="FILE", help="also write the results as JUnit XML to FILE")
        p.add_argument("--prometheus", metavar="FILE",
                       help="also write metrics to FILE in node_exporter's textfile-collector format (*.prom)")
        p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page (check x node matrix)")
        p.add_argument("--resume-from", metavar="PATH", help="the checkpoint the job resumes from: DeepSpeed's (the "
                       "folder save_checkpoint wrote, with `latest`, or a tag folder), a DCP folder, accelerate's "
                       "save_state folder or a Trainer's checkpoint-N (a folder of those: its newest), judged against "
                       "the planned job; without it, the training script's --resume_from_checkpoint, --load or "
                       "--resume in the launch command")
        memory_options(p)

    def launch_command(p: argparse.ArgumentParser, text: str) -> None:
        p.add_argument("launch_command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help=text)

    lint = commands.add_parser("lint", help="lint the accelerate and DeepSpeed configs and the hostfile")
    inputs(lint)
    launch_command(lint, "the launch command, after `--`: its flags override the config files")
    lint.add_argument("--sbatch", metavar="SCRIPT", help="a SLURM batch script: its #SBATCH directives and launch "
                      "line, judged as sbatch, srun and the launcher run them")
    lint.add_argument("--k8s", metavar="MANIFEST", help="a Kubernetes manifest: its training resources (PyTorchJob, "
                      "TrainJob, JobSet, LeaderWorkerSet, Volcano Job, an Indexed Job or StatefulSet) judged as the "
                      "cluster and the launcher run them")
    lint.add_argument("--deep", action="store_true",
                      help="also run accelerate's and DeepSpeed's own validators (when importable; ~2 s each)")
    for name, text in (("check", "check the job on its nodes before it starts (no target: this machine)"),
                       ("node", "check this node, as in a SLURM prolog"),
                       ("launch", "check, then run COMMAND only when the job is ready")):
        sub = commands.add_parser(name, help=text)
        inputs(sub)
        sub.add_argument("--checkpoint-dir", metavar="DIR", help="where checkpoints go: must exist with free space")
        sub.add_argument("--ntp-server", metavar="HOST", help="also measure every node's clock against this NTP server")
        sub.add_argument("--clock-warn", type=positive_float, metavar="S",
                         help="clock offset from the head that warns (default 0.1 s)")
        sub.add_argument("--clock-fail", type=positive_float, metavar="S",
                         help="clock offset from the head that fails (default 1 s)")
        sub.add_argument("--port", type=port_number, metavar="N",
                         help=f"main process port (default: main_process_port of the config, else {DEFAULT_PORT})")
        sub.add_argument("--sbatch", metavar="SCRIPT", help="a SLURM batch script: its directives and launch line, "
                         "as lint judges them and, inside its allocation, against what SLURM gave the job")
        if name == "node":
            slurm_options(sub)
        if name != "node":
            target = sub.add_mutually_exclusive_group()
            target.add_argument("--hosts", metavar="LIST", help="nodes, first the head: n1,n2 or gpu[001-004]")
            target.add_argument("--slurm", action="store_true", help="the nodes of this SLURM job (SLURM_JOB_NODELIST)")
            sub.add_argument("--shared-dir", metavar="DIR",
                             help="a folder on the shared filesystem: a token the head writes must be read by all")
            sub.add_argument("--ssh-config", metavar="FILE", help=SSH_CONFIG_HELP)
            sub.add_argument("--ssh-accept-new", action="store_true", help="trust (and remember) unknown host keys")
            ssh_client_option(sub)
            sub.add_argument("--python", metavar="PATH", default=sys.executable,
                             help=f"the training interpreter on the nodes (default {sys.executable})")
            sub.add_argument("--fanout", type=positive_int, default=64, metavar="N",
                             help="nodes reached at once (default 64)")
            sub.add_argument("--timeout", type=positive_float, default=30.0, metavar="S",
                             help="deadline in seconds for each remote step (default 30)")
            collective_options(sub)
        if name == "launch":
            launch_command(sub, "the launch command, after `--`")
        if name == "check":
            launch_command(sub, "the launch command each node will run, after `--`: its flags override the files "
                                "and $VAR in it is each node's")
    doctor = commands.add_parser("doctor", help="say why a running job is stuck: its launchers and ranks on every node")
    doctor_options(doctor)
    listing = commands.add_parser("list", help="list every registered check")
    listing.add_argument("--json", action="store_true", help="print the checks as JSON")
    listing.add_argument("--markdown", action="store_true", help="print the table of checks as Markdown")
    explain = commands.add_parser("explain", help="explain one check: what, why, how to fix")
    explain.add_argument("id", metavar="ID")
    scripts = commands.add_parser("slurm-scripts", help="write the SLURM prolog, health check and epilog that run "
                                  "`preflight node` to a folder (docs/slurm.md)")
    scripts.add_argument("folder", metavar="DIR", help="where to write preflight-prolog.sh, "
                         "preflight-healthcheck.sh and preflight-epilog.sh (such as /etc/slurm)")
    scripts.add_argument("--preflight", metavar="PATH", help="the training environment's preflight the scripts "
                         "run (default: this one)")
    return parser


SSH_CONFIG_HELP = "the ssh_config to read, alone, as ssh -F (default: ~/.ssh/config and /etc/ssh/ssh_config)"


def ssh_client_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssh", choices=("openssh", "paramiko"), default=None,
                   help="the SSH client: openssh (the system's ssh, the default where it is installed) or paramiko")


def memory_options(p: argparse.ArgumentParser) -> None:
    """Will it fit (the MEM checks; preflight.job.memory)."""
    p.add_argument("--model", metavar="MODEL",
                   help="the model: a parameter count (7B, 7e9), a config.json or model folder, or a model id in "
                        "the local Hugging Face cache (never downloaded); enables the MEM checks")
    p.add_argument("--gpu-memory", metavar="SIZE", help="memory of each GPU for lint to compare against: 80GB, 80GiB "
                   "and 80 all mean 80 GiB, as memory is sold; 85520809984B is bytes")
    p.add_argument("--host-memory", metavar="SIZE", help="host memory of each node for lint to compare against "
                   "(the same units: 512GB is 512 GiB)")
    p.add_argument("--seq-len", metavar="N", help="tokens per sample: with the micro-batch, the activation margin")


def doctor_options(sub: argparse.ArgumentParser) -> None:
    """`preflight doctor`: the same targets, transports and reports as `check`; read only."""
    target = sub.add_mutually_exclusive_group()
    target.add_argument("--hosts", metavar="LIST", help="the job's nodes, first the head: n1,n2 or gpu[001-004]")
    target.add_argument("--slurm", action="store_true", help="the nodes of this SLURM job (SLURM_JOB_NODELIST)")
    target.add_argument("--slurm-job", metavar="JOBID", help="the nodes of that SLURM job, reached with srun --overlap")
    sub.add_argument("--hostfile", metavar="FILE", help="DeepSpeed hostfile: the job's nodes")
    sub.add_argument("--port", type=port_number, metavar="N",
                     help="the job's master port: picks one job when several run (default: every job found)")
    sub.add_argument("--pid", type=whole(MAX_PID), action="append", metavar="PID",
                     help="only this process and its children (repeatable)")
    sub.add_argument("--ssh-config", metavar="FILE", help=SSH_CONFIG_HELP)
    sub.add_argument("--ssh-accept-new", action="store_true", help="trust (and remember) unknown host keys")
    ssh_client_option(sub)
    sub.add_argument("--python", metavar="PATH", default=sys.executable,
                     help=f"the interpreter on the nodes that runs the census (default {sys.executable})")
    sub.add_argument("--fanout", type=positive_int, default=64, metavar="N", help="nodes reached at once (default 64)")
    sub.add_argument("--timeout", type=positive_float, default=10.0, metavar="S",
                     help="deadline in seconds for each node (default 10)")
    sub.add_argument("--no-stacks", action="store_true", help="do not read the Python stacks (py-spy)")
    sub.add_argument("--flight-recorder", metavar="PREFIX",
                     help="torch flight-recorder dumps PREFIX<rank>, read on every node, live or after the job died "
                     "(default: where each running rank writes them, its TORCH_FR_DUMP_TEMP_FILE)")
    sub.add_argument("--only", metavar="SEL", help="run only these checks")
    sub.add_argument("--skip", metavar="SEL", help="do not run these checks")
    sub.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    sub.add_argument("--strict", action="store_true", help="warnings make the exit code 1")
    sub.add_argument("-v", "--verbose", action="store_true", help="list every result, passes and skips too")
    sub.add_argument("--junit", metavar="FILE", help="also write the results as JUnit XML to FILE")
    sub.add_argument("--prometheus", metavar="FILE", help="also write metrics to FILE (*.prom)")
    sub.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page")


def slurm_options(sub: argparse.ArgumentParser) -> None:
    """`preflight node` in a SLURM prolog or HealthCheckProgram (preflight.gate.slurm; its scripts:
    preflight/gate/slurm_scripts/, written out by `preflight slurm-scripts`)."""
    sub.add_argument("--budget", type=positive_float, metavar="S",
                     help="finish within S seconds: what does not fit is skipped (\"budget of S s spent\")")
    sub.add_argument("--drain", action="store_true",
                     help="when the verdict is fail, drain this SLURM node with a `preflight: ...` reason")
    sub.add_argument("--undrain", action="store_true",
                     help="when the verdict is not fail, resume this node if (only if) preflight drained it")


def collective_options(sub: argparse.ArgumentParser) -> None:
    """The all-reduce smoke test's options (the COL checks; preflight.collective.allreduce)."""
    from preflight.collective.options import BACKENDS, parse_sizes

    sub.add_argument("--backend", choices=BACKENDS, default="auto",
                     help="all-reduce backend (default auto: nccl when every node has GPUs, else gloo)")
    sub.add_argument("--col-procs-per-node", type=whole(MAX_PROCS_PER_NODE), metavar="N",
                     help="all-reduce processes per node (default: 1 with gloo, one per planned GPU with nccl)")
    sub.add_argument("--col-sizes", type=parse_sizes, metavar="LIST",
                     help="all-reduce message sizes (default 1M,64M,256M; K, M, G are KiB, MiB, GiB)")
    sub.add_argument("--col-port", type=port_number, metavar="N",
                     help="the all-reduce's rendezvous port on the head (default: the main port)")
    sub.add_argument("--min-busbw", type=positive("GB/s"), metavar="GBPS",
                     help="all-reduce bus bandwidth (GB/s) below which COL002 fails (default: none)")


@contextlib.contextmanager
def interruptible():
    """SIGTERM (a scheduler, `timeout`, `kill`), SIGINT (Ctrl-C) and SIGHUP (a closed terminal) end the run. The
    first is a KeyboardInterrupt in the main thread, so every cleanup runs (the shared folder's token, the head's
    listener, the remote processes and sessions) and the exit is 130. A second ends the process at once, with 130:
    whoever sent it will not wait for the cleanups, and the first may have been lost: a library that catches every
    Python error swallows the KeyboardInterrupt too (inside `import deepspeed`, torch's C++ start-up imports numpy
    and goes on without it when that fails: "Failed to initialize NumPy", torch/csrc/utils/tensor_numpy.cpp). A
    run that goes on to its end after a lost first signal still exits 130. A signal already ignored (SIGHUP under
    nohup) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def on_signal(signum, frame):
        if fired:
            try:
                os.write(2, b"preflight: interrupted\n")
            finally:
                os._exit(EXIT_INTERRUPTED)
        fired.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {}
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    if fired:  # the run ended without the interruption it was sent: it is still one
        raise KeyboardInterrupt(signal.Signals(fired[0]).name)


def command() -> None:
    """The `preflight` program (its console script, and `python -m preflight`): main(), then the process ends at
    once. Every file is written and closed by then, and every connection; the interpreter's teardown would only
    free the modules and objects of a process that is ending (30-80 ms of a one-node `check`) and wait for the
    threads of a node that never answered."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader has gone (`preflight list | head`), or it was closed
            pass
    os._exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        with interruptible():
            return _main(list(sys.argv[1:] if argv is None else argv))
    except (InputError, UsageError) as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("preflight: interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # Connections are closed by now; threads still waiting on a hung node must not hold the exit.
        os._exit(EXIT_INTERRUPTED)
    except BrokenPipeError:  # `preflight list | head`: the reader has gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_NOT_READY
    except Exception as exc:  # the last resort: a defect of ours, said in one line
        if os.environ.get("PREFLIGHT_DEBUG"):
            raise
        print(f"preflight: internal error: {type(exc).__name__}: {exc} (PREFLIGHT_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        gc.unfreeze()  # evaluate froze this run's facts: a caller running main again must get them collected


def _main(argv: List[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        raise UsageError(unrecognized(parser, args.command, extra))
    if args.command is None:
        raise UsageError("a command is needed: lint, check, node, launch, doctor, list, explain or slurm-scripts "
                         "(see `preflight --help`)")
    for option in ("config", "deepspeed", "hostfile", "checkpoint_dir", "shared_dir", "resume_from"):
        if getattr(args, option, None) == "":
            raise UsageError(f"--{option.replace('_', '-')} is an empty path")
    if args.command == "slurm-scripts":
        return _slurm_scripts(args)
    if args.command in ("check", "launch"):
        from preflight.remote import early

        # The first nodes are reached, and their programs started, while the SSH config is validated, the checks
        # load and the plan is built; a run that stops on bad input ends them (below).
        args.early_start = early.start(args)
    from preflight import registry

    try:
        if getattr(args, "ssh_config", None) is not None:
            _check_ssh_config(args.ssh_config, getattr(args, "hosts", None), getattr(args, "timeout", 10.0))
        reg = registry.load()
        for problem in reg.problems:
            print(f"preflight: warning: {problem}", file=sys.stderr)
        if args.command == "list":
            return _list(reg, args)
        if args.command == "explain":
            return _explain(reg, args.id)
        from preflight import engine  # the pipeline's imports cost only the commands that run checks

        return engine.run(reg, args)
    finally:
        if getattr(args, "early_start", None) is not None:
            args.early_start.close()  # what a run that stopped early (bad input) did not take


def _check_ssh_config(path: str, hosts: Optional[str], timeout: float) -> None:
    """--ssh-config names a file OpenSSH takes, or the run stops here (exit 2) with ssh's own words: not a false
    'node unreachable' on every node later."""
    from preflight.remote.openssh import refused_config

    if path == "" or not os.path.exists(path):
        raise InputError(path or "--ssh-config", "SSH config (--ssh-config) not found")
    if not os.path.isfile(path):
        raise InputError(path, "SSH config (--ssh-config) is not a regular file")
    first = re.split(r"[,\[\s]", hosts or "", maxsplit=1)[0].split("@")[-1]
    first = first if first and not first.startswith("-") else "localhost"  # a name ssh could read as an option
    said = refused_config(path, first, min(timeout, 10.0))  # a Match exec that hangs: --timeout bounds it too
    if said is not None:
        raise InputError(path, f"OpenSSH refuses this SSH config (ssh -G -F {path} {first}): {said}")


def _slurm_scripts(args) -> int:
    from preflight.gate import slurm

    beside = os.path.join(os.path.dirname(sys.executable), "preflight")  # this environment's command
    preflight = args.preflight or shutil.which("preflight") or (beside if os.path.exists(beside) else None) or \
        slurm.SCRIPT_DEFAULT
    if not re.fullmatch(r"[A-Za-z0-9/._+-]+", preflight):  # it goes into ${PREFLIGHT:-...} of a shell script
        raise UsageError(f"--preflight {preflight!r}: a path of letters, digits and / . _ + - only")
    for path in slurm.write_scripts(args.folder, preflight):
        print(path)
    print(f"preflight: the scripts run {preflight}; slurm.conf: Prolog=, PrologFlags=Alloc, HealthCheckProgram= "
          "(docs/slurm.md)", file=sys.stderr)
    return 0


def _list(reg, args) -> int:
    if args.json:
        print(json.dumps([
            {"id": c.id, "name": c.name, "scope": c.scope, "tags": list(c.tags), "what": c.what, "why": c.why,
             "fix": c.fix, "module": c.module}
            for c in reg.checks
        ], indent=2))
    elif args.markdown:
        print(checks_table(reg.checks))
    else:
        width = max((len(c.name) for c in reg.checks), default=4)
        for c in reg.checks:
            print(f"{c.id:8} {c.name:{width}}  {c.scope:7}  {c.what}")
    return 0


def checks_table(checks) -> str:
    """The README's table of checks, generated from the registry."""
    rows = ["| ID | name | scope | tags | what it checks |", "|---|---|---|---|---|"]
    for c in checks:
        rows.append(f"| {c.id} | {c.name} | {c.scope} | {', '.join(c.tags)} | {c.what.replace('|', '/')} |")
    return "\n".join(rows)


def _explain(reg, check_id: str) -> int:
    spec = reg.get(check_id) or next((c for c in reg.checks if c.name == check_id), None)
    if spec is None:
        close = difflib.get_close_matches(check_id.upper(), [c.id for c in reg.checks] + [c.name for c in reg.checks], 3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `preflight list` shows them all"
        raise UsageError(f"no check has the ID {check_id!r}{hint}")
    print(f"{spec.id} {spec.name}  (scope: {spec.scope}; tags: {', '.join(spec.tags) or 'none'})\n")
    print(f"What: {spec.what}\n\nWhy: {spec.why}\n\nFix: {spec.fix}")
    return 0
