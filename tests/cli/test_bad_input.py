"""Bad input, through the real command line: exit 2, one line on stderr that names the file (and the
line where the parser knows it) and the problem, never a traceback, never a hang (docs/contract.md).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import run_cli
from lint_results import assert_exit_2_in_one_line

PREFIX = "preflight: error: "
OPTIONS = {  # option -> the words the message uses for that input, and a good file's name and content
    "--config": ("accelerate config", "accelerate.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\n"),
    "--deepspeed": ("DeepSpeed config", "ds.json", '{"train_micro_batch_size_per_gpu": 1}\n'),
    "--hostfile": ("hostfile", "hostfile", "worker-1 slots=2\n"),
}


def preflight(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFLIGHT_DEBUG"}
    env["NO_COLOR"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "preflight", *args],
        capture_output=True, encoding="utf-8", errors="backslashreplace", timeout=30, cwd=cwd, env=env,
        stdin=subprocess.DEVNULL,
    )


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The single line on stderr of a run that must exit 2."""
    shown = f"rc={proc.returncode}\nstderr={proc.stderr!r}\nstdout={proc.stdout[:2000]!r}"
    assert proc.returncode == 2, shown
    assert "Traceback" not in proc.stderr, shown
    assert proc.stderr.endswith("\n") and proc.stderr.count("\n") == 1, shown
    assert len(proc.stderr.splitlines()) == 1, shown  # no \r, \x85, \u2028 ... either
    line = proc.stderr.rstrip("\n")
    assert line.startswith(PREFIX), shown
    return line


def assert_bad_input(proc, path, line, *words) -> str:
    """exit 2; `path:line: ` (or `path: ` when line is None) right after the prefix; every word in it."""
    message = one_line(proc)
    where = f"{path}:{line}: " if line is not None else f"{path}: "
    assert message.startswith(PREFIX + where), f"expected {where!r} in {message!r}"
    for word in words:
        assert word.lower() in message.lower(), f"expected {word!r} in {message!r}"
    assert proc.stdout == "", proc.stdout  # no partial report
    return message


def lint_one(tmp_path, option, name, content, mode="w"):
    """Lint one input file, given with `option`; return (process, path)."""
    path = tmp_path / name
    if mode == "wb":
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", newline="")
    return preflight("lint", option, str(path)), str(path)


# --- the file itself: missing, a folder, empty, binary, not UTF-8, too large, not a file --------------

@pytest.mark.parametrize("option", OPTIONS)
def test_missing_file(tmp_path, option):
    path = tmp_path / "nope" / "missing.cfg"
    assert_bad_input(preflight("lint", option, str(path)), path, None, OPTIONS[option][0], "not found")


@pytest.mark.parametrize("option", OPTIONS)
def test_folder(tmp_path, option):
    assert_bad_input(preflight("lint", option, str(tmp_path)), tmp_path, None, OPTIONS[option][0], "directory")


@pytest.mark.parametrize("content", [b"", b"   \n\n\t\n", b"\xef\xbb\xbf\n"], ids=["empty", "blank", "bom-only"])
@pytest.mark.parametrize("option", OPTIONS)
def test_empty_file(tmp_path, option, content):
    proc, path = lint_one(tmp_path, option, OPTIONS[option][1], content, "wb")
    assert_bad_input(proc, path, None, OPTIONS[option][0], "empty")


@pytest.mark.parametrize("content, words", [
    (bytes(range(256)) * 4, ("binary",)),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", ("binary",)),
    ("num_processes: 2\n".encode("utf-16"), ("binary",)),
], ids=["all-bytes", "elf", "utf-16"])
@pytest.mark.parametrize("option", OPTIONS)
def test_binary(tmp_path, option, content, words):
    proc, path = lint_one(tmp_path, option, OPTIONS[option][1], content, "wb")
    assert_bad_input(proc, path, None, OPTIONS[option][0], *words)


@pytest.mark.parametrize("content, line, words", [
    (b"distributed_type: MULTI_GPU\nmain_process_ip: caf\xe9\n", 2, ("0xe9", "offset 48")),
    (b"\xff\xfe\xfd", 1, ("0xff", "offset 0")),
    (b"a\n\n\nb\xc3(\n", 4, ("0xc3", "offset 5")),
], ids=["latin-1", "invalid-start", "truncated-sequence"])
@pytest.mark.parametrize("option", OPTIONS)
def test_not_utf8(tmp_path, option, content, line, words):
    proc, path = lint_one(tmp_path, option, OPTIONS[option][1], content, "wb")
    assert_bad_input(proc, path, line, OPTIONS[option][0], "not UTF-8", *words)


@pytest.mark.parametrize("option", OPTIONS)
def test_too_large(tmp_path, option):
    proc, path = lint_one(tmp_path, option, OPTIONS[option][1], b"# padding\n" * (1700 * 1024), "wb")
    assert_bad_input(proc, path, None, "16 MiB")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
@pytest.mark.parametrize("option", OPTIONS)
def test_named_pipe_without_writer_does_not_hang(tmp_path, option):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    assert_bad_input(preflight("lint", option, str(path)), path, None, "empty")


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
@pytest.mark.parametrize("option", OPTIONS)
def test_device(option):
    assert_bad_input(preflight("lint", option, "/dev/null"), "/dev/null", None, "not a regular file")


@pytest.mark.parametrize("option", OPTIONS)
def test_unreadable(option):
    """A file this user may not read. Root reads any file, so as root the run drops to `nobody`."""
    _, name, content = OPTIONS[option]
    folder = tempfile.mkdtemp(prefix="preflight-unreadable-")
    os.chmod(folder, 0o755)  # traversable by nobody, as the path itself must be found
    path = os.path.join(folder, name)
    with open(path, "w") as handle:
        handle.write(content)
    os.chmod(path, 0)
    try:
        if os.geteuid() == 0:
            as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable]
            env = dict(os.environ, NO_COLOR="1", HF_HOME=folder)
            if subprocess.run(as_nobody + ["-c", "import preflight.cli"], env=env, capture_output=True,
                              timeout=30).returncode != 0:
                pytest.skip("this checkout's interpreter cannot be run by `nobody` (a folder above it is private)")
            proc = subprocess.run(as_nobody + ["-m", "preflight", "lint", option, path], capture_output=True,
                                  encoding="utf-8", timeout=30, stdin=subprocess.DEVNULL, env=env)
        else:
            proc = preflight("lint", option, path)
        assert_bad_input(proc, path, None, "cannot read", "permission denied")
    finally:
        os.chmod(path, 0o600)
        shutil.rmtree(folder)


def test_relative_path_is_named_as_given(tmp_path):
    (tmp_path / "accelerate.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: four\n")
    message = assert_bad_input(preflight("lint", "--config", "accelerate.yaml", cwd=tmp_path), "accelerate.yaml", 2)
    assert message == PREFIX + "accelerate.yaml:2: num_processes must be an integer or null, found 'four'"


# --- YAML: the accelerate config (and a DeepSpeed config written in YAML) ---------------------------

def nested(depth: int) -> str:
    """`a:` and then `depth` flow sequences, one `[` a line: the one at depth 101 is on line 102."""
    return "a:\n" + "  [\n" * depth + "  " + "]" * depth + "\n"


BILLION_LAUGHS = "\n".join(
    ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
) + "\n"

YAML_CASES = [
    # id, text, line, words
    ("unclosed-flow", "a: 1\nb: [1, 2\nc: 3\n", 3, ["malformed YAML", "on line 2"]),
    ("bad-indent", "a: 1\n b: 2\n", 2, ["malformed YAML", "mapping values are not allowed"]),
    ("tab-indent", "a:\n\tb: 1\n", 2, ["malformed YAML", "cannot start any token"]),
    ("unclosed-quote", 'a: 1\nb: "abc\n', 3, ["malformed YAML", "end of stream", "on line 2"]),
    ("two-documents", "a: 1\n---\nb: 2\n", 2, ["malformed YAML", "another document"]),
    ("undefined-alias", "a: 1\nb: *nope\n", 2, ["malformed YAML", "undefined alias"]),
    ("control-char", "a: 1\nb: \x07\n", 2, ["malformed YAML", "#x0007"]),
    ("list", "- distributed_type: MULTI_GPU\n- num_processes: 2\n", None, ["must be a YAML mapping", "list"]),
    ("scalar", "just some text\n", None, ["must be a YAML mapping", "str"]),
    ("number", "42\n", None, ["must be a YAML mapping", "int"]),
    ("null", "~\n", None, ["must be a YAML mapping", "nothing"]),
    ("only-marker", "---\n", None, ["must be a YAML mapping", "nothing"]),
    ("recursive-mapping", "a: 1\nb: &x\n  c: *x\n", 3, ["recursive YAML alias"]),
    ("recursive-sequence", "a: 1\nb: &x [1, *x]\n", 2, ["recursive YAML alias"]),
    ("recursive-merge", "a: &x\n  <<: *x\n", 2, ["recursive YAML alias"]),
    ("recursive-deep", "a: 1\nb:\n  - 1\n  - &x\n    - [1, 2,\n       *x]\n", 6, ["recursive YAML alias"]),
    ("billion-laughs", BILLION_LAUGHS, 5, ["100000 values", "alias"]),
    ("deep-nesting", nested(150), 102, ["deeper than 100 levels"]),
    ("deep-through-aliases", "a: &a " + "[" * 60 + "]" * 60 + "\nb: " + "[" * 60 + "*a" + "]" * 60 + "\n", 2,
     ["deeper than 100 levels", "alias"]),
    ("very-deep-nesting", "a: " + "[" * 50000 + "]" * 50000 + "\n", None, ["nesting is too deep"]),
    ("very-deep-mappings", "a: " + "{b: " * 50000 + "1" + "}" * 50000 + "\n", None, ["nesting is too deep"]),
    ("int-key", "distributed_type: MULTI_GPU\n1: a\n", 2, ["key '1'", "int", "not a string"]),
    ("bool-key", "distributed_type: MULTI_GPU\ntrue: a\n", 2, ["key 'true'", "bool"]),
    ("null-key", "distributed_type: MULTI_GPU\n~: a\n", 2, ["key '~'", "null"]),
    ("float-key", "distributed_type: MULTI_GPU\n1.5: a\n", 2, ["key '1.5'", "float"]),
    ("date-key", "distributed_type: MULTI_GPU\n2024-01-01: a\n", 2, ["key '2024-01-01'", "timestamp"]),
    ("sequence-key", "distributed_type: MULTI_GPU\n? [a, b]\n: c\n", 2, ["a key is a sequence"]),
    ("mapping-key", "distributed_type: MULTI_GPU\n? {a: 1}\n: c\n", 2, ["a key is a mapping"]),
    ("nested-int-key", "distributed_type: FSDP\nfsdp_config:\n  3: x\n", 3, ["key '3'", "int"]),
    ("python-object", "a: !!python/object:os.system {}\n", 1, ["malformed YAML", "python/object"]),
    ("python-apply", "a: !!python/object/apply:os.system ['true']\n", 1, ["malformed YAML", "python/object/apply"]),
    ("python-name", "a: !!python/name:os.system\n", 1, ["malformed YAML", "python/name"]),
    ("custom-tag", "a: 1\nb: !vault x\n", 2, ["malformed YAML", "!vault"]),
    ("tag-with-newline", "a: !<tag:%0Afoo> 1\n", 1, ["malformed YAML", "tag:\\nfoo"]),
    ("bad-date", "a: 1\nb: 2001-13-45\n", 2, ["malformed YAML", "2001-13-45"]),
    ("bad-int-tag", "a: !!int twelve\n", 1, ["malformed YAML", "twelve"]),
    ("bad-bool-tag", "a: !!bool maybe\n", 1, ["malformed YAML", "maybe"]),
]
ACCELERATE_TYPE_CASES = [
    ("num_processes-word", "distributed_type: MULTI_GPU\nnum_processes: four\n", 2, ["num_processes", "'four'"]),
    ("num_machines-list", "num_machines: [2]\n", 1, ["num_machines", "an integer"]),
    ("use_cpu-string", "distributed_type: MULTI_CPU\nuse_cpu: maybe\n", 2, ["use_cpu", "true or false"]),
    ("deepspeed_config-scalar", "distributed_type: DEEPSPEED\ndeepspeed_config: 5\n", 2, ["deepspeed_config", "mapping"]),
    ("zero_stage-word", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: three\n", 3,
     ["deepspeed_config.zero_stage", "'three'"]),
    ("port-float", "main_process_port: 29500.5\n", 1, ["main_process_port", "29500.5"]),
    ("long-value-is-cut", "num_processes: [" + ", ".join(["1"] * 5000) + "]\n", 1, ["num_processes", "..."]),
]


@pytest.mark.parametrize("text, line, words", [c[1:] for c in YAML_CASES + ACCELERATE_TYPE_CASES],
                         ids=[c[0] for c in YAML_CASES + ACCELERATE_TYPE_CASES])
def test_accelerate_config_yaml(tmp_path, text, line, words):
    proc, path = lint_one(tmp_path, "--config", "accelerate.yaml", text)
    message = assert_bad_input(proc, path, line, *words)
    assert len(message) < 400, message


@pytest.mark.parametrize("text, line, words", [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES])
def test_deepspeed_config_yaml(tmp_path, text, line, words):
    proc, path = lint_one(tmp_path, "--deepspeed", "ds.yaml", text)
    assert_bad_input(proc, path, line, *[w.replace("must be a YAML mapping", "DeepSpeed config must be") for w in words])


# --- JSON: the DeepSpeed config (and an accelerate config written in JSON) --------------------------

def nested_json(depth: int) -> str:
    """`{"a":` and then `depth` arrays, one `[` a line: the one 101 levels deep is on line 102."""
    return '{"a":\n' + "[\n" * depth + "]" * depth + "}\n"


JSON_CASES = [
    ("missing-colon", '{\n  "train_batch_size": 8,\n  "fp16": {"enabled" true}\n}\n', 3, ["malformed JSON"]),
    ("missing-brace", '{\n  "train_batch_size": 8\n', 3, ["malformed JSON"]),
    ("missing-comma", '{\n  "a": 1\n  "b": 2\n}\n', 3, ["malformed JSON", "delimiter"]),
    ("extra-document", '{"a": 1}\n{"b": 2}\n', 2, ["malformed JSON", "extra data"]),
    ("single-quotes", "{'a': 1}\n", 1, ["malformed JSON"]),
    ("yaml-in-json", "train_batch_size: 8\n", 1, ["malformed JSON"]),
    ("list", "[1, 2]\n", None, ["must be a JSON mapping", "list"]),
    ("string", '"train_batch_size"\n', None, ["must be a JSON mapping", "str"]),
    ("number", "5\n", None, ["must be a JSON mapping", "int"]),
    ("null", "null\n", None, ["must be a JSON mapping", "nothing"]),
    ("deep-nesting", nested_json(150), 102, ["deeper than 100 levels"]),
    ("very-deep-nesting", '{"a": ' + "[" * 100000 + "]" * 100000 + "}\n", None, ["nesting is too deep"]),
]
DEEPSPEED_TYPE_CASES = [
    ("train_batch_size-word", '{\n  "train_batch_size": "sixteen"\n}\n', 2, ["train_batch_size", "'sixteen'"]),
    ("micro-batch-list", '{"train_micro_batch_size_per_gpu": [1]}\n', 1, ["train_micro_batch_size_per_gpu"]),
    ("gradient_clipping-bool", '{"gradient_clipping": true}\n', 1, ["gradient_clipping", "a number"]),
    ("zero_optimization-number", '{\n  "train_batch_size": 8,\n  "zero_optimization": 5\n}\n', 3,
     ["zero_optimization", "mapping", "5"]),
    ("zero_optimization-list", '{"zero_optimization": [3]}\n', 1, ["zero_optimization", "mapping"]),
    ("zero-stage-word", '{\n  "zero_optimization": {\n    "stage": "three"\n  }\n}\n', 3,
     ["zero_optimization.stage", "'three'"]),
    ("fp16-string", '{"fp16": "yes"}\n', 1, ["fp16", "mapping"]),
    ("bf16-number", '{"bf16": 1}\n', 1, ["bf16", "mapping"]),
    ("optimizer-list", '{"optimizer": []}\n', 1, ["optimizer", "mapping"]),
    ("lr-word", '{"optimizer": {"type": "AdamW", "params": {\n"lr": "fast"}}}\n', 2, ["optimizer.params.lr", "'fast'"]),
    ("loss_scale_window-float", '{"fp16": {"loss_scale_window": 1.5}}\n', 1, ["fp16.loss_scale_window", "1.5"]),
]


@pytest.mark.parametrize("text, line, words", [c[1:] for c in JSON_CASES + DEEPSPEED_TYPE_CASES],
                         ids=[c[0] for c in JSON_CASES + DEEPSPEED_TYPE_CASES])
def test_deepspeed_config_json(tmp_path, text, line, words):
    proc, path = lint_one(tmp_path, "--deepspeed", "ds.json", text)
    assert_bad_input(proc, path, line, *[w.replace("must be a JSON mapping", "DeepSpeed config must be") for w in words])


@pytest.mark.parametrize("text, line", [
    ('{\n  // ZeRO-2\n  "train_batch_size": 8\n  "zero_optimization": {"stage": 2}\n}\n', 4),  # past the comment
    ('{"a": 1, /* ' + "/*" * 130000, 1), ('{"a": 1, // x\n' + '"\\' * 130000, 2), ("#" * 260000, 1),
], ids=["error-after-a-comment", "unclosed-comments", "unclosed-backslashed-strings", "hashes"])
def test_deepspeed_config_json_with_comments_and_an_error(tmp_path, text, line):
    """Comments are DeepSpeed's (CFG008); an error past them is still bad input, at its own line, and a text made of
    unclosed comments and strings is read in one pass (it took minutes in a first version)."""
    started = time.monotonic()
    proc, path = lint_one(tmp_path, "--deepspeed", "ds.json", text)
    assert_bad_input(proc, path, line, "malformed JSON")
    assert time.monotonic() - started < 20


# accelerate reads its JSON config with json.load: a comment is malformed there (DeepSpeed's hjson takes it: CFG008)
ACCELERATE_JSON_CASES = JSON_CASES + [("comment", '{\n  // ZeRO\n  "a": 1\n}\n', 2, ["malformed JSON"]),
                                      ("unclosed-comment", '{"a": 1 /* ZeRO\n}\n', 1, ["malformed JSON"])]


@pytest.mark.parametrize("text, line, words", [c[1:] for c in ACCELERATE_JSON_CASES],
                         ids=[c[0] for c in ACCELERATE_JSON_CASES])
def test_accelerate_config_json(tmp_path, text, line, words):
    proc, path = lint_one(tmp_path, "--config", "accelerate.json", text)
    assert_bad_input(proc, path, line, *[w.replace("must be a JSON mapping", "accelerate config must be") for w in words])


def test_accelerate_config_json_wrong_type(tmp_path):
    proc, path = lint_one(tmp_path, "--config", "accelerate.json", '{\n"distributed_type": "MULTI_GPU",\n"num_processes": "four"\n}')
    assert_bad_input(proc, path, 3, "num_processes", "'four'")


def test_deepspeed_file_named_by_the_accelerate_config(tmp_path):
    """The DeepSpeed JSON found through deepspeed_config_file is checked the same way, and named."""
    (tmp_path / "ds.json").write_text('{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage" 2}\n}\n')
    config = tmp_path / "accelerate.yaml"
    config.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n")
    proc = preflight("lint", "--config", str(config), cwd=tmp_path.parent)
    assert_bad_input(proc, tmp_path / "ds.json", 3, "malformed JSON")


# --- the hostfile --------------------------------------------------------------------------------

HOSTFILE_CASES = [
    ("misspelt-slots", "worker-1 slots=8\nworker-2 slot=8\n", 2, ["expected 'HOSTNAME slots=N'", "slot=8"]),
    ("slots-zero", "worker-1 slots=8\nworker-2 slots=0\n", 2, ["worker-2", "slots=0", "at least 1"]),
    ("slots-negative", "worker-1 slots=-1\n", 1, ["expected 'HOSTNAME slots=N'"]),
    ("slots-word", "worker-1 slots=eight\n", 1, ["expected 'HOSTNAME slots=N'"]),
    ("host-only", "# the job\nworker-1\n", 2, ["expected 'HOSTNAME slots=N'", "worker-1"]),
    ("json", '{"worker-1": 8}\n', 1, ["expected 'HOSTNAME slots=N'"]),
    ("only-comments", "# nobody\n\n   # here\n", None, ["lists no hosts"]),
    ("crlf", "worker-1 slots=8\r\nworker-2 slots=8\r\nworker-3 slots\r\n", 3, ["expected 'HOSTNAME slots=N'"]),
    ("old-mac-cr", "worker-1 slots=8\rworker-2 slots=8\rworker-3\r", 3, ["expected 'HOSTNAME slots=N'"]),
    # a form feed is no line break for DeepSpeed: one bad line, shown escaped on one line
    ("form-feed", "worker-1 slots=8\x0cworker-2 slots=8\n", 1, ["expected 'HOSTNAME slots=N'", "\\x0c"]),
    ("line-separator", "worker-1 slots=8\u2028worker-2 slots=8\n", 1, ["expected 'HOSTNAME slots=N'", "\\u2028"]),
    ("very-long-line", "worker-1 " + "x" * 100000 + "\n", 1, ["expected 'HOSTNAME slots=N'"]),
]


@pytest.mark.parametrize("text, line, words", [c[1:] for c in HOSTFILE_CASES], ids=[c[0] for c in HOSTFILE_CASES])
def test_hostfile(tmp_path, text, line, words):
    proc, path = lint_one(tmp_path, "--hostfile", "hostfile", text)
    message = assert_bad_input(proc, path, line, *words)
    assert len(message) < 400, message


# --- several inputs: the bad one is named, whatever the order ---------------------------------------

@pytest.mark.parametrize("bad", OPTIONS)
def test_bad_one_among_good_ones(tmp_path, bad):
    args = []
    for option, (_, name, content) in OPTIONS.items():
        path = tmp_path / name
        path.write_text(content if option != bad else "\x00\x01\x02")
        args += [option, str(path)]
    assert_bad_input(preflight("lint", *args), tmp_path / OPTIONS[bad][1], None, OPTIONS[bad][0], "binary")


@pytest.mark.parametrize("option", OPTIONS)
def test_bad_input_with_json_flag(tmp_path, option):
    path = tmp_path / OPTIONS[option][1]
    path.write_bytes(b"\xff\xfe\x00\x00garbage")
    proc = preflight("lint", option, str(path), "--json")
    assert_bad_input(proc, path, None, "binary")


# --- bad invocations ----------------------------------------------------------------------------

BAD_INVOCATIONS = [
    (["lint", "--nope"], ["--nope"]),
    (["lint", "--config"], ["--config", "expected one argument"]),
    (["lint", "--world-size", "0"], ["--world-size", "0"]),
    (["lint", "--world-size", "-3"], ["--world-size"]),
    (["lint", "--world-size", "four"], ["--world-size", "four"]),
    (["lint", "--only", "NOSUCH"], ["NOSUCH"]),
    (["lint", "--skip", "NOSUCH"], ["NOSUCH"]),
    (["lint", "--only", "CFG001,NOSUCH"], ["NOSUCH"]),
    (["explain", "NOPE"], ["NOPE"]),
    (["explain"], ["ID"]),
    (["nosuchcommand"], ["nosuchcommand"]),
]


@pytest.mark.parametrize("args, words", BAD_INVOCATIONS, ids=[" ".join(a) for a, _ in BAD_INVOCATIONS])
def test_bad_invocation(args, words):
    message = one_line(preflight(*args))
    assert "usage:" not in message.lower()
    for word in words:
        assert word in message, f"expected {word!r} in {message!r}"


# --- good input with defects: results, never exit 2 or 3 ----------------------------------------

def case(id, codes, **files):
    """Input files by option (config=(name, text), ...), and the exit codes allowed."""
    return pytest.param({f"--{k}": v for k, v in files.items()}, codes, id=id)


GOOD_WITH_DEFECTS = [
    case("procs-not-divisible", {1},
         config=("accelerate.yaml", "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 3\n")),
    case("yaml-no-is-false", {1}, config=("accelerate.yaml", "distributed_type: NO\nmixed_precision: no\n")),
    case("numbers-as-strings", {1},
         config=("accelerate.yaml", "distributed_type: MULTI_GPU\nnum_processes: 5e8\ngpu_ids: 0\n")),
    case("quoted-batch-bad-stage", {1},
         deepspeed=("ds.json", '{"train_batch_size": "16", "zero_optimization": {"stage": 7}}')),
    case("zero-optimization-true", {0, 1},
         deepspeed=("ds.json", '{"zero_optimization": true, "train_micro_batch_size_per_gpu": 1}')),
    case("duplicate-nan-both-precisions", {1},
         deepspeed=("ds.json", '{"a": 1, "a": 2, "\\ud800": NaN, "fp16": {"enabled": true}, "bf16": {"enabled": true}}')),
    case("merge-keys", {1}, config=("accelerate.yaml", "base: &base {zero_stage: 2}\ndistributed_type: DEEPSPEED\n"
                                                        "deepspeed_config:\n  <<: *base\n  offload_param_device: cpu\n")),
    case("missing-ds-file-duplicate-host", {1},
         config=("accelerate.yaml", "distributed_type: DEEPSPEED\nnum_processes: 4\nnum_machines: 2\n"
                                    "deepspeed_config:\n  deepspeed_config_file: missing.json\n  zero_stage: 2\n"),
         hostfile=("hostfile", "a slots=4\na slots=4\nb slots=1\n")),
    case("line-breaks-in-values", {1},
         config=("accelerate.yaml", 'distributed_type: "MULTI_GPU\\u2028x"\nmain_process_ip: "a\\nb"\n')),
    # keys no UTF-8 terminal can show (JSON's and YAML's "\ud800"), where the checks name them
    case("surrogate-key-in-zero-block", {1},
         deepspeed=("ds.json", '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"\\ud800": null}}')),
    case("surrogate-key-in-deepspeed-section", {0, 1},
         config=("accelerate.yaml", 'distributed_type: DEEPSPEED\ndeepspeed_config:\n  "\\ud800": 1\n')),
]


@pytest.mark.parametrize("files, codes", GOOD_WITH_DEFECTS)
@pytest.mark.parametrize("as_json", [False, True], ids=["terminal", "json"])
def test_defects_are_results(tmp_path, files, codes, as_json):
    args = ["lint"]
    for option, (name, content) in files.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
        args += [option, str(tmp_path / name)]
    proc = preflight(*args, *(["--json"] if as_json else []))
    assert proc.returncode in codes, f"rc={proc.returncode}\n{proc.stderr}\n{proc.stdout}"
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    if as_json:
        report = json.loads(proc.stdout)  # exactly one document: anything more is "Extra data"
        assert report["schema"] == 1, report
        assert report["verdict"] in (("pass", "warn") if proc.returncode == 0 else ("fail",)), report
        assert all(r["status"] != "error" for r in report["results"]), report["results"]


def run(*args, **kwargs):
    kwargs.setdefault("timeout", 120)
    return subprocess.run([sys.executable, "-m", "preflight", *map(str, args)], capture_output=True, text=True, **kwargs)


@pytest.mark.parametrize("args", [
    ["check", "--timeout", "inf"], ["check", "--timeout", "nan"], ["check", "--timeout", "1e300"],
    ["check", "--timeout", "-1"], ["doctor", "--timeout", "1e300"], ["node", "--budget", "1e300"],
    ["node", "--budget", "inf"], ["check", "--clock-warn", "inf"], ["check", "--clock-fail", "1e300"],
    ["check", "--min-busbw", "inf"], ["check", "--min-busbw", "nan"],
    ["check", "--fanout", "99999999999999999999"], ["check", "--world-size", "1" * 5000],
    ["check", "--col-procs-per-node", "100000"], ["doctor", "--pid", "99999999999"], ["check", "--port", "70000"],
    ["check", "--only", ","], ["check", "--only", ""], ["check", "--only", "CLK,"], ["check", "--skip", ""],
    ["check", "--skip", "CLK,,NET"], ["node", "--only", " "], ["doctor", "--skip", ","], ["lint", "--only", ","],
])
def test_unbounded_numbers_and_empty_selectors_are_bad_input(args):
    proc = run(*args, "--hosts" if args[0] in ("check", "doctor") else "--json",
               *(["nohost.invalid"] if args[0] in ("check", "doctor") else []))
    assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preflight: error:"), proc.stderr
    assert proc.stdout == ""


def test_a_host_twice_in_the_hostfile_is_said(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nohost1.invalid slots=1\nnohost1.invalid slots=2\n")
    proc = run("check", "--hostfile", hostfile, "--only", "SSH001", "--timeout", "2", "--json")
    assert f"{hostfile}:2: host 'nohost1.invalid' is listed again (first on line 1)" in proc.stderr
    assert json.loads(proc.stdout)["nodes"] == ["nohost1.invalid"]


def test_a_host_twice_in_hosts_is_bad_input():
    proc = run("check", "--hosts", "nohost1.invalid,nohost1.invalid", "--only", "SSH001")
    assert proc.returncode == 2 and "listed twice" in proc.stderr, proc.stderr


BAD_INPUTS = {  # name -> (option, file name, content, words of the one-line message)
    "json-integer": ("--deepspeed", "ds.json", '{"train_micro_batch_size_per_gpu": 1,\n "steps_per_print": '
                     + "9" * 5000 + "}", ("ds.json:2:", "5000 digits")),
    "yaml-integer": ("--config", "accel.yaml", "distributed_type: MULTI_GPU\nnum_processes: " + "9" * 5000,
                     ("accel.yaml:2:", "5000 digits")),
    "json-nan": ("--deepspeed", "ds.json", '{"train_micro_batch_size_per_gpu": 1,\n"gradient_clipping": NaN}',
                 ("ds.json:2:", "gradient_clipping", "finite")),
    "json-infinity": ("--deepspeed", "ds.json", '{"zero_optimization": {"reduce_bucket_size": -Infinity}}',
                      ("ds.json:1:", "reduce_bucket_size", "-inf")),
    "json-overflow": ("--deepspeed", "ds.json", '{"gradient_clipping": 1e999}', ("ds.json:1:", "finite")),
    "yaml-nan": ("--deepspeed", "ds.yaml", "train_micro_batch_size_per_gpu: 1\ngradient_clipping: .nan\n",
                 ("ds.yaml:2:", "finite")),
    "hostfile-slots": ("--hostfile", "hostfile", "n1 slots=" + "9" * 5000 + "\n", ("hostfile:1:", "slots=")),
    "hostfile-slots-large": ("--hostfile", "hostfile", "n1 slots=1\nn2 slots=99999999\n", ("hostfile:2:", "65536")),
    "profile-inf": ("--profile", "p.toml", "[thresholds]\nclock_warn_s = inf\n", ("p.toml:2:", "clock_warn_s")),
    "profile-1e308": ("--profile", "p.toml", "[thresholds]\ndisk_warn_gib = 1e308\n", ("p.toml:2:", "disk_warn_gib")),
    "profile-deep": ("--profile", "p.toml", "x = " + "[" * 5000 + "]" * 5000 + "\n", ("p.toml:", "too deep")),
    "profile-integer": ("--profile", "p.toml", "x = " + "9" * 5000 + "\n", ("p.toml:", "digits")),
}


def preflight_quiet(*args, cwd=None):
    """preflight's run of the CLI, without the warnings of plugins that do not load (not this test's matter)."""
    proc = preflight(*args, cwd=cwd)
    proc.stderr = "".join(line for line in proc.stderr.splitlines(True) if not line.startswith("preflight: warning: plugin"))
    return proc


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    option, name, content, words = BAD_INPUTS[case]
    (tmp_path / name).write_text(content)
    started = time.monotonic()
    message = one_line(preflight_quiet("lint", option, name, cwd=tmp_path))
    assert time.monotonic() - started < 20
    for word in words:
        assert word in message, message
    assert "set_int_max_str_digits" not in message


@pytest.mark.parametrize("content", ["x = " + "[" * 5000 + "]" * 5000 + "\n", "[tool.preflight\n",
                                     "x = " + "9" * 5000 + "\n[tool.preflight]\n"])
def test_a_pyproject_we_cannot_read_is_not_a_profile(tmp_path, content):
    (tmp_path / "pyproject.toml").write_text(content)
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    proc = preflight_quiet("lint", "--deepspeed", "ds.json", cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "pyproject.toml" in line]
    assert len(said) == ("tool.preflight" in content), proc.stderr  # a profile meant for us, not read: one warning


def test_host_patterns_match_without_expanding(tmp_path):
    import tracemalloc

    from preflight.inputs import profile

    path = tmp_path / "preflight.toml"
    path.write_text('[[hosts]]\nhosts = "node[0-99999999],login[001-100]x*"\ngpus = 8\n'
                    '[[hosts]]\nhosts = "' + ",".join(f"r{i}n[0-99999]" for i in range(20)) + '"\ngpus = 4\n')
    tracemalloc.start()
    loaded = profile.load(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 40_000_000, peak  # reading takes a 16 MiB buffer; two million names would be hundreds of MB
    assert loaded.expectation("node12345678").gpus == 8 and loaded.expectation("node12345678.example.org").gpus == 8
    assert loaded.expectation("login042x-ib").gpus == 8 and loaded.expectation("login42x") is None
    assert loaded.expectation("r7n99999").gpus == 4 and loaded.expectation("node100000000") is None


def test_a_host_list_of_millions_is_exit_2_before_it_is_expanded(tmp_path):
    started = time.monotonic()
    message = one_line(preflight_quiet("check", "--hosts", ",".join(f"r{i}n[0-99999]" for i in range(30))))
    assert "3000000 hosts" in message and time.monotonic() - started < 20


def test_tens_of_thousands_of_unknown_keys_take_linear_time(tmp_path, capsys):
    import json

    data = {"train_micro_batch_size_per_gpu": 1, **{f"unknown_key_{i:05d}": 1 for i in range(20000)},
            "zero_optimization": {"stage": 2, **{f"zz_{i:05d}": 1 for i in range(20000)}}}
    (tmp_path / "ds.json").write_text(json.dumps(data))
    started = time.monotonic()
    code, doc, _ = run_cli(capsys, "lint", "--deepspeed", tmp_path / "ds.json", "--only", "CFG060", "--json")
    assert time.monotonic() - started < 15
    messages = [r["message"] for r in doc["results"]]
    assert code == 1 and len(messages) < 100
    assert any("keys DeepSpeed does not read, ignored" in m and "and more" in m for m in messages), messages
    assert any("19980 more unknown keys" in m and "refuses them" in m for m in messages), messages


def test_a_long_run_of_digits_that_is_no_number_takes_linear_time(tmp_path, capsys):
    """The number pattern once let a run of digits split two ways: 16,000 digits and an x took 13 s, quadratic."""
    (tmp_path / "accelerate.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n"
                                              f"num_machines: 1\nnum_processes: '{'1' * 100_000}x'\n")
    started = time.monotonic()
    code, _, err = run_cli(capsys, "lint", "--config", tmp_path / "accelerate.yaml")
    assert time.monotonic() - started < 5
    assert code == 2 and "num_processes must be an integer" in err, err


def test_a_nul_byte_in_a_named_path_is_a_finding_not_an_internal_error(tmp_path, capsys, monkeypatch):
    # YAML's "\0" escape: no file can have that name; the node's read of it says so instead of raising
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "accelerate.yaml"
    config.write_text('compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n'
                      '  deepspeed_config_file: "ds\\0.json"\nnum_machines: 1\nnum_processes: 1\nmachine_rank: 0\n')
    code, doc, err = run_cli(capsys, "check", "--config", config, "--only", "JOB,CFG005", "--skip", "deep", "--json")
    assert code == 1, err
    assert any("the path holds a NUL byte" in r["message"] for r in doc["results"] if r["id"].startswith("JOB")), \
        [r["message"] for r in doc["results"]]


@pytest.mark.parametrize("option,text,words", [
    ("--config", '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}',
     "a DeepSpeed config (train_micro_batch_size_per_gpu, zero_optimization), given as the accelerate config: give "
     "it with --deepspeed"),
    ("--deepspeed", "distributed_type: MULTI_GPU\nnum_processes: 8\n",
     "an accelerate config (distributed_type, num_processes), given as the DeepSpeed config: give it with --config"),
])
def test_a_config_given_to_the_other_option_is_said_in_one_line(capsys, tmp_path, option, text, words):
    path = tmp_path / ("c.json" if option == "--config" else "c.yaml")
    path.write_text(text)
    assert_exit_2_in_one_line(capsys, option, path, words)
