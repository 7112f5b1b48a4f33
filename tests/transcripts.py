"""The transcripts the docs show (docs/transcripts/NAME.txt: `$ preflight ...`, then what it printed) are what
preflight prints today: the tests that own a transcript run its command again and hand the output to `held`,
which fails when it differs from the file. Only what a run measures may differ (MEASURED). With
PREFLIGHT_WRITE_TRANSCRIPTS=1 `held` writes the file from the run where it differs (then `python
scripts/make_docs.py --write` puts it in the pages)."""
import difflib
import os
import pathlib
import re
import shlex
import subprocess
import sys

TRANSCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "transcripts"
VENV = pathlib.Path(sys.executable).parent.parent  # shown as /venv
WRITE = os.environ.get("PREFLIGHT_WRITE_TRANSCRIPTS") == "1"
# what differs from run to run: durations; free memory, which the nodes measure each at its moment; a clock's
# offset and its error; the all-reduce's bandwidths; the test environment's own distributions and their versions
# (a developer's venv holds a few more than CI's fresh one); a table's columns, as wide as what they hold
MEASURED = [(re.compile(r"(SYS003 free-memory \S+  ).*"), r"\1(measured)"),
            (re.compile(r"the same \d+ distributions"), "the same N distributions"),
            (re.compile(r"\b(python|torch|deepspeed|accelerate|transformers) \d+\.\d+(\.\d+)?(\+\w+)?"), r"\1 V"),
            (re.compile(r"\b(busbw|algbw|MiB) \d+(\.\d+)?\b"), r"\1 X"),
            (re.compile(r"\d+(\.\d+)?(-\d+(\.\d+)?)? GB/s"), "X GB/s"),
            (re.compile(r"[+-]\d+\.\d+ s \(± [\d.]+ [mµ]?s\)"), "+T s (± E)"),
            (re.compile(r" in \d+(\.\d+)? s\b"), " in N s"), (re.compile(r"(?<=\S) {2,}(?=\S)"), "  ")]
# sizes, where a run measures them (varies=SIZES): a machine's /dev/shm and memory, files that hold measured values
# (a Trainer's trainer_state.json holds its losses); an estimate's sizes are held as they are
SIZES = [(r"\b\d+(\.\d+)? (B|KiB|MiB|GiB)\b", "N B")]


def names(prefix: str) -> list:
    return sorted(p.stem for p in TRANSCRIPTS.glob(f"{prefix}*.txt"))


def command(name: str) -> list:
    """The transcript's command as preflight's argv (after `preflight`)."""
    first = (TRANSCRIPTS / f"{name}.txt").read_text().splitlines()[0]
    assert first.startswith("$ preflight "), f"{name}.txt: its first line is not `$ preflight ...`"
    return shlex.split(first[len("$ preflight "):])


def run(name: str, cwd, shown=None, timeout: float = 120, via=None, env=None, python=sys.executable) -> tuple:
    """(what the transcript's command prints now, as the transcript shows it; its exit code): the command run by
    `python` (this interpreter, or one preflight is installed in) in cwd (on another host: `via` turns a shell
    command line into the argv that runs it there), its output and errors as one stream (`env`: variables to add),
    with each real path in `shown` (real: shown) written as the transcript shows it (and the other way round in
    the command)."""
    shown = {str(real): str(as_shown) for real, as_shown in (shown or {}).items()}
    order = sorted(shown, key=len, reverse=True)

    def real(arg):
        for path in sorted(shown, key=lambda r: len(shown[r]), reverse=True):
            arg = arg.replace(shown[path], path)
        return arg

    argv = [str(python), "-m", "preflight", *map(real, command(name))]
    variables = {"COLUMNS": "120", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if via:
        line = shlex.join(["env", *(f"{k}={v}" for k, v in variables.items()), *argv])
        argv, variables = via(f"cd {shlex.quote(str(cwd))} && {line}"), {}
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          cwd=cwd, env=dict(os.environ, **variables))
    assert "Traceback" not in proc.stdout and proc.returncode != 3, proc.stdout  # 3: our own bug
    said = (TRANSCRIPTS / f"{name}.txt").read_text().splitlines()[0] + "\n" + proc.stdout
    for path in order:
        said = said.replace(path, shown[path])
    return realigned(said), proc.returncode


def realigned(text: str) -> str:
    """text with each table (the indented lines of cells under a line that ends with ':') padded again, as
    the report pads them, once shown paths have replaced the real ones."""
    lines, out = text.split("\n"), []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        i += 1
        if not out[-1].endswith(":") or out[-1].startswith(" "):
            continue
        table = []
        while i < len(lines) and lines[i].startswith("  ") and re.search(r"\S {2,}\S", lines[i]):
            table.append(re.split(r" {2,}", lines[i].strip()))
            i += 1
        widths = [max(len(row[c]) for row in table if c < len(row)) for c in range(max(map(len, table), default=0))]
        out += ["  " + "  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip() for row in table]
    return "\n".join(out)


def held(name: str, said: str, varies=(), write: bool = WRITE) -> None:
    """said (the command line, then what the run printed) is the transcript, but for what a run measures and
    what `varies` ((pattern, shown) pairs: process IDs, ages) says differs from one run to the next."""
    path = TRANSCRIPTS / f"{name}.txt"
    now, then = measured(said, varies), measured(path.read_text(), varies)
    if write and now != then:  # only what changed: a rerun that measured other durations leaves the docs alone
        path.write_text(said)
        then = now
    assert now == then, "".join(difflib.unified_diff(then.splitlines(True), now.splitlines(True), f"{name}.txt",
                                                     "this run"))


def measured(text: str, varies=()) -> str:
    for pattern, shown in [*MEASURED, *((re.compile(p), s) for p, s in varies)]:
        text = pattern.sub(shown, text)
    return text
