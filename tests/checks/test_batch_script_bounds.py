"""The batch script reader on input that would make an unbounded one hang, run out of memory or crash: values that
double, syntax nested hundreds deep, scripts of a megabyte, numbers of thousands of digits, files of /proc. Each is
read in bounded work (preflight.inputs.shell: MAX_TEXT, MAX_PARTS, MAX_NESTING, WORK; shellwalker: MAX_WORDS,
MAX_STATEMENT_NESTING; pieces of PIECE bytes), and what was not followed is unknown and said, never guessed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import run_cli
from preflight.inputs import batchscript, shell

HEAD = "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8\n"
LAUNCH = "srun torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint h:29500 train.py\n"


def read(body: str) -> batchscript.BatchScript:
    return batchscript.parse("job.sh", HEAD + body, {})


@pytest.mark.parametrize("body", [
    'A=x\n' + 'A="$A$A"\n' * 40,  # 2^40 characters
    'A=x\nf() { A="$A$A"; }\n' + 'f\n' * 40,  # the same through a function's 64 calls
    'A=(x)\n' + 'A+=("${A[@]}" "${A[@]}" "${A[@]}")\n' * 20,  # 3^20 elements
])
def test_a_value_that_doubles_is_followed_to_a_bound_then_unknown(body):
    script = read(body + LAUNCH)
    value = script.variables["A"]
    assert shell.TOO_LARGE in value.value or value.array is None and "$A" in shell.Field(value.value).text, value
    assert [s.command.launcher for s in script.steps] == ["torchrun"]  # the rest of the script is read as ever


@pytest.mark.parametrize("nest", [
    lambda n: "for i in 1; do\n" * n + LAUNCH + "done\n" * n,
    lambda n: "case $RANDOM in\n*)\n" * n + LAUNCH + ";;\nesac\n" * n,
    lambda n: "if [ -z \"$A\" ]; then\n" * n + LAUNCH + "fi\n" * n,
    lambda n: "{ " * n + LAUNCH.strip() + "; }" * n + "\n",
    lambda n: "( " * n + LAUNCH.strip() + " )" * n + "\n",
    lambda n: "{ " * n + ":" + " ; } >/dev/null" * n + "\n" + LAUNCH,
    lambda n: "echo " + "${X:-" * n + "d" + "}" * n + "\n" + LAUNCH,
    lambda n: 'echo "' + '${X:-"' * n + "d" + '"}' * n + '"\n' + LAUNCH,
    lambda n: "if [[ " + "( " * n + "-n x" + " )" * n + " ]]; then :; fi\n" + LAUNCH,
    lambda n: "X=" + "$( echo " * n + "hi" + " )" * n + "\n" + LAUNCH,
], ids=["for", "case", "if", "brace", "subshell", "redirected", "parameter", "quoted-parameter", "test", "substitution"])
def test_syntax_nested_500_deep_is_read_to_a_depth_and_said(nest, capsys, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(HEAD + nest(500))
    script = batchscript.load(str(path))  # no RecursionError
    if script.stopped is not None:  # the statements past MAX_STATEMENT_NESTING: not read, so not judged
        assert script.main is None and "are not read: what the script does is not judged" in script.unread[0][1]
    code, doc, err = run_cli(capsys, "lint", "--sbatch", path, "--json")
    assert code in (0, 1) and "internal error" not in err, err


def test_a_chain_of_thousands_of_commands_is_read_whole():
    # `a && b && ...` nests to the left in the grammar: read as the flat chain it is, the launch after it is found
    script = read(" && ".join(["true"] * 5000) + "\n" + LAUNCH)
    assert script.stopped is None and script.main is not None and script.main.line == 6


def test_a_script_past_the_work_of_one_reading_stops_and_judges_nothing_it_did_not_read(capsys, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(HEAD + "python prep.py --a b\n" * 30_000 + LAUNCH)
    script = batchscript.load(str(path))
    assert script.stopped is not None and script.main is None
    assert f"past {shell.WORK} statements and words read" in dict(script.unread)[script.stopped]
    code, doc, err = run_cli(capsys, "lint", "--sbatch", path, "--json")
    assert {r["status"] for r in doc["results"] if r["id"] in ("CFG071", "CFG072", "CFG074")} == {"skip"}


def test_a_function_called_fifty_thousand_times_is_said_once():
    script = read("f() { :; }\n" + "f\n" * 50_000)
    assert [line for line, why in script.unread if "calls past 64" in why] == [6 + 64]  # calls on lines 6 to 69 read


def test_a_statement_longer_than_the_reader_follows_stops_it():
    script = read("srun torchrun " + "a " * 100_000 + "\n" + LAUNCH)
    assert script.stopped == 5 and script.main is None
    assert "a statement longer than 128 KiB starts here" in dict(script.unread)[5]


def test_a_script_of_many_pieces_reads_as_one():
    # 70 KiB before an `if` and a heredoc that cross where a piece of 64 KiB ends: the same steps, on the same lines
    filler = "".join(f"V{k}=value{k}\n" for k in range(5500))
    body = filler + 'if [ -z "$UNSET" ]; then\n  export HEAD=h1\nfi\ncat > ds.json <<EOF\n{"train_batch_size": 8}\n' \
        'EOF\nsrun torchrun --nnodes 2 --rdzv_endpoint $HEAD:29500 --rdzv_backend c10d train.py --deepspeed ds.json\n'
    assert len(HEAD + filler) > shell.PIECE
    script = read(body)
    whole = HEAD.count("\n") + body.count("\n")
    assert script.stopped is None and script.main.line == whole
    assert script.main.value_of("rdzv_endpoint").text == "h1:29500"
    assert script.heredocs["ds.json"].text == '{"train_batch_size": 8}' and script.variables["V5499"].value == \
        ("value5499",)


@pytest.mark.parametrize("body", [
    "echo ${A[" + "9" * 5000 + "]}\n",  # more digits than int() takes
    "echo ${A[\u00b2]}\n",  # a digit to isdigit(), none to int()
    "X=" + "9" * 5000 + '\nif [ "$X" -eq 1 ]; then :; fi\n',
    "echo \ue000" + "1" * 5000 + "\ue001\n",  # what a placeholder of the reader looks like
    "srun bash -c $'\\ud800 torchrun train.py'\n",  # half a surrogate pair
])
def test_words_no_number_or_string_can_be_made_of_are_unknown_not_a_crash(body, capsys, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(HEAD + body + LAUNCH)
    code, doc, err = run_cli(capsys, "lint", "--sbatch", path)
    assert code in (0, 1) and "internal error" not in err, err


def test_text_a_script_writes_cannot_pass_for_the_readers_placeholder():
    # the run-time $UNSET_X travels into the task's shell as a placeholder; what looks like one in the text stays text
    script = read('srun bash -c "torchrun --nnodes 2 train.py $UNSET_X \ue0000\ue001"\n')
    assert script.main.command.script_args == ("$UNSET_X", "\ue0000\ue001")


@pytest.mark.parametrize("first, interpreter, reads", [
    ("#!/bin/bash -l", "bash", True), ("#!/bin/bash -ex", "bash", True), ("#!/usr/bin/env bash", "bash", True),
    ("#!/usr/bin/env -S bash -e", "bash", True), ("#!/usr/bin/env -u HOME bash", "bash", True),
    ("#!/usr/bin/python3 -u", "python3", False),
])
def test_the_interpreter_is_the_first_word_of_the_hash_bang_line(first, interpreter, reads):
    script = batchscript.parse("job.sh", first + "\n#SBATCH --nodes=2\n" + LAUNCH, {})
    assert script.interpreter == interpreter and bool(script.steps) == reads


def test_line_breaks_of_a_carriage_return_alone_are_refused():
    script = batchscript.parse("job.sh", (HEAD + LAUNCH).replace("\n", "\r"), {})
    assert script.refused and "line breaks of \\r alone" in script.refused[0][1]


def test_hundreds_of_directives_after_the_first_command_are_said_a_few_at_a_time():
    script = read("echo start\n" + "#SBATCH --time=1\n" * 80_000)
    assert len(script.ignored) == batchscript.MAX_IGNORED


def test_a_file_of_proc_that_waits_for_data_is_refused_not_waited_for():
    # /proc/kmsg is a regular file of size 0 whose read waits for the next kernel message; when one is there
    # it reads, else it is refused at once. Either way in a child with a deadline: the old read waited forever.
    if not os.access("/proc/kmsg", os.R_OK):
        pytest.skip("/proc/kmsg is not readable here (it needs root)")
    probe = ("from preflight.inputs.documents import InputError, read_regular\n"
             "try:\n    read_regular('/proc/kmsg', 'batch script', 1 << 20)\n    print('read')\n"
             "except InputError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip()
    assert said == "read" or "waits for data" in said or "binary" in said or "UTF-8" in said, said
    script = read("source /proc/kmsg\n" + LAUNCH)
    assert script.main is not None and script.sourced == ("/proc/kmsg",)


def test_a_run_time_word_of_a_megabyte_is_quoted_short(capsys, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(HEAD + "ARGS=$(cat args.txt)\nsrun torchrun $ARGS" + "x" * 100_000 + " train.py\n")
    code, doc, err = run_cli(capsys, "lint", "--sbatch", path, "--json")
    assert max(len(r["message"]) for r in doc["results"]) < 2000
