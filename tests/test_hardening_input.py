"""Hardening (issue 15): report paths written into what they are, bad input that is exit 2 in bounded time,
secrets kept out of every output."""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from conftest import run_cli
from preflight.report import files as reports
from test_reports import bad_config  # noqa: F401  (a fixture: pytest finds it by module attribute)

# --- report files: written into what the path is ------------------------------------------------------


def lint_to(capsys, config, *report):
    code, out, err = run_cli(capsys, "lint", "--config", config, *report)
    return code, out, err


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_symlinks_are_followed_and_modes_kept(tmp_path, capsys, bad_config, umask_027):
    target = tmp_path / "real.xml"
    target.write_text("old")
    os.chmod(target, 0o600)
    link = tmp_path / "link.xml"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.prom"
    dangling.symlink_to(tmp_path / "made.prom")
    code, _, err = lint_to(capsys, bad_config, "--junit", link, "--prometheus", dangling, "--html", tmp_path / "new.html")
    assert code == 1, err
    assert link.is_symlink() and dangling.is_symlink()  # the links stay links: their targets are written
    assert target.read_text().startswith("<?xml") and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert "preflight_verdict" in (tmp_path / "made.prom").read_text()
    assert stat.S_IMODE((tmp_path / "made.prom").stat().st_mode) == 0o640  # 0666 less the umask
    assert stat.S_IMODE((tmp_path / "new.html").stat().st_mode) == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_fifo_is_written_in_place(tmp_path, capsys, bad_config):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got = {}

    def reader():
        with open(fifo, "rb") as f:
            got["data"] = f.read()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    code, _, err = lint_to(capsys, bad_config, "--junit", fifo)
    thread.join(10)
    assert code == 1, err
    assert got["data"].startswith(b"<?xml") and got["data"].endswith(b"</testsuite>\n")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_fifo_nobody_reads_is_exit_2_in_bounded_time(tmp_path, capsys, bad_config, monkeypatch):
    monkeypatch.setattr(reports, "FIFO_WAIT_S", 0.5)
    fifo = tmp_path / "nobody.fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    code, _, err = lint_to(capsys, bad_config, "--junit", fifo, "--html", tmp_path / "r.html")
    assert code == 2 and time.monotonic() - started < 5
    assert err.count("\n") == 1 and str(fifo) in err and "FIFO" in err, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (tmp_path / "r.html").exists()  # the other report is written


def test_character_devices_are_written_in_place(tmp_path, capsys, bad_config):
    null = tmp_path / "null"  # our own node for /dev/null's device: the real /dev is never touched
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    code, _, err = lint_to(capsys, bad_config, "--junit", null, "--prometheus", null, "--html", null)
    assert code == 1, err
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.lstat(null).st_rdev == os.makedev(1, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accelerate.yaml", "null"]


def test_own_stdout_is_written_in_place(tmp_path, bad_config):
    """/dev/fd/1 (as /dev/stdout, which is never touched here): the report follows the terminal's, in the
    pipe or in the file that `>` opened."""
    argv = [sys.executable, "-m", "preflight", "lint", "--config", str(bad_config), "--junit", "/dev/fd/1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "verdict: FAIL" in proc.stdout and proc.stdout.rstrip().endswith("</testsuite>")
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.PIPE, text=True, timeout=60)
    text = out.read_text()
    assert proc.returncode == 1 and text.index("verdict: FAIL") < text.index("<?xml"), text


@pytest.mark.parametrize("kind", ["directory", "socket", "loop"])
def test_other_file_types_are_exit_2_before_any_check(tmp_path, capsys, kind):
    path = tmp_path / "r.xml"
    if kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    else:
        path.symlink_to(tmp_path / "other")
        (tmp_path / "other").symlink_to(path)
    code, out, err = run_cli(capsys, "lint", "--junit", path)
    assert code == 2 and out == "" and err.count("\n") == 1 and str(path) in err, err
    assert os.path.lexists(path) and not (os.path.exists(path) and stat.S_ISREG(os.lstat(path).st_mode))


# --- bad input: exit 2, in bounded time -----------------------------------------------------------------

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


def preflight(*args, cwd=None):
    """test_bad_input's run of the CLI, without the warnings of plugins that do not load (not this test's matter)."""
    import test_bad_input

    proc = test_bad_input.preflight(*args, cwd=cwd)
    proc.stderr = "".join(line for line in proc.stderr.splitlines(True) if not line.startswith("preflight: warning: plugin"))
    return proc


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    from test_bad_input import one_line

    option, name, content, words = BAD_INPUTS[case]
    (tmp_path / name).write_text(content)
    started = time.monotonic()
    message = one_line(preflight("lint", option, name, cwd=tmp_path))
    assert time.monotonic() - started < 20
    for word in words:
        assert word in message, message
    assert "set_int_max_str_digits" not in message


@pytest.mark.parametrize("content", ["x = " + "[" * 5000 + "]" * 5000 + "\n", "[tool.preflight\n",
                                     "x = " + "9" * 5000 + "\n[tool.preflight]\n"])
def test_a_pyproject_we_cannot_read_is_not_a_profile(tmp_path, content):
    (tmp_path / "pyproject.toml").write_text(content)
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    proc = preflight("lint", "--deepspeed", "ds.json", cwd=tmp_path)
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
    from test_bad_input import one_line

    started = time.monotonic()
    message = one_line(preflight("check", "--hosts", ",".join(f"r{i}n[0-99999]" for i in range(30))))
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
    assert any("19980 more unknown keys" in m and "DeepSpeed ignores them" in m for m in messages), messages
    assert any("19980 more unknown keys" in m and "refuses them" in m for m in messages), messages


def test_a_long_run_of_digits_that_is_no_number_takes_linear_time(tmp_path, capsys):
    """The number pattern once let a run of digits split two ways: 16,000 digits and an x took 13 s, quadratic."""
    (tmp_path / "accelerate.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n"
                                              f"num_machines: 1\nnum_processes: '{'1' * 100_000}x'\n")
    started = time.monotonic()
    code, _, err = run_cli(capsys, "lint", "--config", tmp_path / "accelerate.yaml")
    assert time.monotonic() - started < 5
    assert code == 2 and "num_processes must be an integer" in err, err


# --- secrets: in no output ----------------------------------------------------------------------------

HF = "hf_" + "Q7x" * 12
SECRETS = {  # set in node02's sessions: each value must be in no output
    "HF_TOKEN": HF,
    "WANDB_BASE_URL": "https://alice:wandbpass123@wandb.example.org",
    "TORCH_HUB_MIRROR": "https://bob:hubpass456@mirror.example.org/hub",  # compared by PKG004: shown in its message
    "TORCH_DB_PASSWD": "passwd789secret",  # compared by PKG004: a name that looks secret
}
SHOWN_NOT = ("wandbpass123", "hubpass456", "passwd789secret", HF, "cmdsecret111", "wandbkey222")


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


def test_unit_redaction_by_name_parts():
    from preflight.report import redact

    secret = ["HF_TOKEN", "WANDB_API_KEY", "DB_PASSWD", "NCCL_AUTH", "AWS_SECRET_ACCESS_KEY", "--api-key", "--password",
              "GOOGLE_APPLICATION_CREDENTIALS", "trainer.hf_token"]
    plain = ["KEYBOARD", "NCCL_IB_HCA", "HF_HUB_ENABLE_HF_TRANSFER", "TOKENIZERS_PARALLELISM", "PWD", "--max_tokens"]
    assert [n for n in secret + plain if redact.secret_name(n)] == secret
    line = f"env WANDB_API_KEY=k1 python t.py --token a --password=b {HF} https://u:p@h/x KEYBOARD=us --max_tokens 5"
    assert redact.text(line) == ("env WANDB_API_KEY=<redacted> python t.py --token <redacted> --password=<redacted> "
                                 "<redacted> https://<redacted>@h/x KEYBOARD=us --max_tokens 5")


def test_the_node_keeps_secret_values_by_the_same_rule(monkeypatch):
    """The collector redacts on the node what the head would: a secret never leaves the node, and a name that
    only contains a secret word (TORCH_KEYBOARD_LAYOUT, HF_HUB_TOKENIZERS_DIR) keeps its value to be compared."""
    from preflight.node import host

    secret = {"HF_TOKEN": HF, "TORCH_DB_PASSWD": "p1", "NCCL_AUTH_FILE": "p2", "HF_API_KEY": "p3"}
    plain = {"TORCH_KEYBOARD_LAYOUT": "us", "HF_HUB_TOKENIZERS_DIR": "/t", "HF_HUB_ENABLE_HF_TRANSFER": "1"}
    for name, value in {**secret, **plain}.items():
        monkeypatch.setenv(name, value)
    env = host.environment()
    assert {n: env[n] for n in secret} == dict.fromkeys(secret, "<redacted>")
    assert {n: env[n] for n in plain} == plain


@pytest.mark.cluster
def test_secrets_are_in_no_output(cluster, tmp_path):
    command = ["--", "env", "WANDB_API_KEY=wandbkey222", "accelerate", "launch", "--num_machines", "3", "train.py",
               "--hf_token", "cmdsecret111"]
    target = ["--hosts", ",".join(cluster.nodes), "--ssh-config", str(cluster.ssh_config), "--python", sys.executable,
              "--only", "PKG,JOB", "--timeout", "20"]
    reports_ = ["--junit", tmp_path / "j.xml", "--html", tmp_path / "r.html", "--prometheus", tmp_path / "m.prom"]
    with cluster.env(cluster.nodes[1], **SECRETS):
        as_json = subprocess.run([sys.executable, "-m", "preflight", "check", *target, "--json", *map(str, reports_),
                                  *command], capture_output=True, text=True, timeout=180)
        terminal = subprocess.run([sys.executable, "-m", "preflight", "check", *target, *command],
                                  capture_output=True, text=True, timeout=180, env=dict(os.environ, NO_COLOR="1"))
    doc = json.loads(as_json.stdout)
    pkg004 = [r for r in doc["results"] if r["id"] == "PKG004" and r["status"] != "pass"]
    assert {r["evidence"]["variable"] for r in pkg004} >= {"TORCH_HUB_MIRROR", "TORCH_DB_PASSWD"}, doc["results"]
    assert any("https://<redacted>@mirror.example.org/hub" in r["message"] for r in pkg004), pkg004
    outputs = {"json": as_json.stdout, "json-stderr": as_json.stderr, "terminal": terminal.stdout,
               "terminal-stderr": terminal.stderr, **{p.name: p.read_text() for p in tmp_path.iterdir()}}
    assert "TORCH_DB_PASSWD" in outputs["terminal"] and "r.html" in outputs
    for name, text in outputs.items():
        for secret in SHOWN_NOT:
            assert secret not in text, f"{secret} in the {name} output"
