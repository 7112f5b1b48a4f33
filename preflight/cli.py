"""The command line: `preflight lint|check|node|launch|list|explain` (see the contract in the README)."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from typing import List, Optional, Sequence

from preflight import __version__
from preflight.documents import InputError
from preflight.result import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NOT_READY, exit_code, verdict


class UsageError(Exception):
    """A bad invocation: printed as one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def build_parser() -> Parser:
    parser = Parser(prog="preflight", description="Will this multi-node Accelerate + DeepSpeed job start and run?")
    parser.add_argument("--version", action="version", version=f"preflight {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    def inputs(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="ACCEL_YAML", help="accelerate config file (YAML or JSON)")
        p.add_argument("--deepspeed", metavar="DS_CONFIG", help="DeepSpeed config (JSON)")
        p.add_argument("--hostfile", metavar="FILE", help="DeepSpeed hostfile (`host slots=N` a line)")
        p.add_argument("--world-size", type=positive_int, metavar="N",
                       help="processes of the whole job, for the batch arithmetic (default: from the configs)")
        p.add_argument("--only", metavar="SEL", help="run only these checks: IDs, ID prefixes, names or tags")
        p.add_argument("--skip", metavar="SEL", help="do not run these checks")
        p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        p.add_argument("--strict", action="store_true", help="warnings make the verdict not ready (exit 1)")

    lint = commands.add_parser("lint", help="lint the accelerate and DeepSpeed configs and the hostfile")
    inputs(lint)
    lint.add_argument("--deep", action="store_true",
                      help="also run accelerate's and DeepSpeed's own validators (when importable; ~2 s each)")
    for name, text in (("check", "check the job before it starts (with no target: on this machine)"),
                       ("node", "check this node, as in a SLURM prolog"),
                       ("launch", "check, then run COMMAND only when the job is ready")):
        sub = commands.add_parser(name, help=text)
        inputs(sub)
        if name != "node":
            sub.add_argument("--timeout", type=positive_float, default=30.0, metavar="S",
                             help="deadline in seconds for each remote step (default 30)")
        if name == "launch":
            sub.add_argument("launch_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                             help="the launch command, after `--`")
    listing = commands.add_parser("list", help="list every registered check")
    listing.add_argument("--json", action="store_true", help="print the checks as JSON")
    listing.add_argument("--markdown", action="store_true", help="print the table of checks as Markdown")
    explain = commands.add_parser("explain", help="explain one check: what, why, how to fix")
    explain.add_argument("id", metavar="ID")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except (InputError, UsageError) as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("preflight: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `preflight list | head`: the reader has gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_NOT_READY
    except Exception as exc:  # the last resort: a defect of ours, said in one line
        if os.environ.get("PREFLIGHT_DEBUG"):
            raise
        print(f"preflight: internal error: {type(exc).__name__}: {exc} (PREFLIGHT_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


def _main(argv: List[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help(sys.stderr)
        return EXIT_BAD_INPUT
    from preflight import registry

    reg = registry.load()
    for problem in reg.problems:
        print(f"preflight: warning: {problem}", file=sys.stderr)
    if args.command == "list":
        return _list(reg, args)
    if args.command == "explain":
        return _explain(reg, args.id)
    return _run(reg, args)


def _run(reg, args) -> int:
    from preflight import registry, render, runner
    from preflight.plan import build_plan, default_accelerate_config

    if args.command == "launch":
        command = args.launch_command[1:] if args.launch_command[:1] == ["--"] else args.launch_command
        if not command:
            raise UsageError("launch needs the command to run after `--`, e.g. preflight launch -- accelerate launch train.py")
    try:
        only, skip = registry.parse_selectors(args.only), registry.parse_selectors(args.skip)
        scopes = ("config",) if args.command == "lint" else ("config", "node")
        specs = registry.select([c for c in reg.checks if c.scope in scopes], only, skip)
    except registry.SelectionError as exc:
        raise UsageError(str(exc)) from None
    started = time.perf_counter()
    node = os.uname().nodename
    config = args.config
    if config is None and default_accelerate_config():
        config = default_accelerate_config()  # what `accelerate launch` uses without --config_file
        print(f"preflight: using accelerate's default config {config}", file=sys.stderr)
    plan = build_plan(
        config=config,
        deepspeed=args.deepspeed,
        hostfile=args.hostfile,
        world_size=args.world_size,
        deep=getattr(args, "deep", False) or args.command != "lint",
        nodes=() if args.command == "lint" else (node,),
    )
    results = runner.run(specs, runner.CheckContext(plan))
    elapsed = time.perf_counter() - started
    outcome = verdict(results)
    if args.json:
        print(render.to_json(results, outcome, plan.nodes, elapsed))
    else:
        render.terminal(results, outcome, elapsed)
    code = exit_code(outcome, args.strict)
    if args.command == "launch" and code == 0:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvp(command[0], command)  # the job keeps our PID, signals and exit code
        except OSError as exc:
            raise UsageError(f"cannot run {command[0]!r}: {exc.strerror}") from None
    if args.command == "launch":
        print("preflight: not launching: the job is not ready (see the report above)", file=sys.stderr)
    return code if code == 0 else EXIT_NOT_READY


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
