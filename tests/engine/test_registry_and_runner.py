"""The engine: registry, plugins, selection, runner, results, renderers, CLI contract."""
import json
import os
import pty
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import transcripts
from conftest import run_cli, run_subprocess
import preflight
from preflight import registry, runner
from preflight.report import render
from preflight.plan import Plan
from preflight.registry import CheckDefinitionError, check
from preflight.result import Result, Status, exit_code, passed, verdict

GOOD_ACCELERATE = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
mixed_precision: bf16
num_machines: 1
num_processes: 2
machine_rank: 0
"""
# two machines, the head's address given, and a port no machine can bind: the file alone is proof of it
BAD_ACCELERATE = GOOD_ACCELERATE.replace("num_machines: 1", "num_machines: 2") + \
    "main_process_ip: 10.0.0.1\nmain_process_port: 70000\n"


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(GOOD_ACCELERATE)
    return path


@pytest.fixture
def bad(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_ACCELERATE)
    return path


DOC = "What.\n\nWhy.\n\nFix."


def declared(**overrides):
    args = dict(id="TST001", name="test-check", scope="config")
    args.update(overrides)

    def func(ctx):
        yield passed("ok")

    func.__doc__ = overrides.pop("doc", DOC)
    return check(**{k: v for k, v in args.items() if k != "doc"})(func)


# --- registry ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,problem", [
    ("id", "cfg001", "upper-case family prefix"),
    ("id", "CFG01", "upper-case family prefix"),
    ("id", "CFG0001", "upper-case family prefix"),
    ("name", "Batch_Size", "kebab-case"),
    ("scope", "cluster-wide", "scope"),
    ("tags", ["Bad Tag"], "tag"),
])
def test_malformed_declarations_are_rejected_naming_the_module(field, value, problem):
    with pytest.raises(CheckDefinitionError) as err:
        declared(**{field: value})
    assert problem in str(err.value)
    assert __name__ in str(err.value)


def test_docstring_must_have_what_why_fix():
    with pytest.raises(CheckDefinitionError, match="three paragraphs"):
        declared(doc="Only what.")


def test_duplicate_ids_are_rejected_naming_both_modules():
    first = types.ModuleType("first_mod")
    second = types.ModuleType("second_mod")
    first.a = declared()
    second.b = declared(name="other-name")
    second.b.__preflight_check__ = second.b.__preflight_check__.__class__(
        **{**second.b.__preflight_check__.__dict__, "module": "second_mod"})
    first.a.__preflight_check__ = first.a.__preflight_check__.__class__(
        **{**first.a.__preflight_check__.__dict__, "module": "first_mod"})
    reg = registry.build([("dist-one", first), ("dist-two", second)])
    assert [c.module for c in reg.checks] == ["first_mod"]
    assert len(reg.problems) == 1
    assert "second_mod" in reg.problems[0] and "first_mod" in reg.problems[0] and "dist-two" in reg.problems[0]


def test_builtin_checks_are_found_through_the_entry_point_group():
    reg = registry.load()
    assert reg.problems == ()
    ids = [c.id for c in reg.checks]
    assert "CFG001" in ids and "CFG030" in ids
    assert all(c.module == "preflight.checks.config" for c in reg.checks if c.id.startswith("CFG"))
    for spec in reg.checks:
        assert spec.what and spec.why and spec.fix


def test_the_doctor_checks_run_only_in_doctor_unless_named(capsys):
    """RUN reads a running job's census, which only `doctor` takes: `node` and `check` leave it out instead of
    adding a skip per RUN check to every report; `--only RUN001` still asks for it."""
    code, doc, _ = run_cli(capsys, "node", "--json")
    assert not [r for r in doc["results"] if r["id"].startswith("RUN")]
    code, doc, _ = run_cli(capsys, "node", "--only", "RUN001", "--json")
    assert [(r["id"], r["status"]) for r in doc["results"]] == [("RUN001", "skip")]


def test_every_family_loads_outside_the_source_tree(tmp_path):
    """As installed: the repository's checks/ folder is not on sys.path there (a family importing `checks.x`
    instead of `preflight.checks.x` loaded only from the source tree)."""
    code = "from preflight import registry; r = registry.load(); print(len(r.checks)); print(r.problems)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines()[1] == "()", proc.stdout + proc.stderr
    assert int(proc.stdout.split()[0]) == len(registry.load().checks)


# --- third-party plugins, through real entry points -----------------------------------------------

def make_plugin(root, dist, module, source, entry=None):
    """A distribution as pip installs one: a module and a .dist-info folder with entry_points.txt."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[preflight.checks]\n{entry or module} = {module}\n")


PLUGIN = '''
from preflight.api import check, warn

@check("ACME001", "acme-rule", "config", tags=["acme"])
def acme(ctx):
    """Checks something of Acme's.

    Because Acme needs it.

    Do what Acme says.
    """
    yield warn("acme says no", "ask acme")
'''


def test_a_third_party_plugin_registers_and_runs(tmp_path, good):
    make_plugin(tmp_path, "acme-checks", "acme_checks", PLUGIN)
    env = {"PYTHONPATH": str(tmp_path)}
    listed = json.loads(run_subprocess("list", "--json", env=env).stdout)
    assert {"id": "ACME001", "module": "acme_checks"}.items() <= next(c for c in listed if c["id"] == "ACME001").items()
    proc = run_subprocess("lint", "--config", good, "--only", "acme", "--json", env=env)
    doc = json.loads(proc.stdout)
    assert [(r["id"], r["status"], r["message"]) for r in doc["results"]] == [("ACME001", "warn", "acme says no")]
    assert proc.returncode == 0
    assert run_subprocess("lint", "--config", good, "--only", "acme", "--strict", env=env).returncode == 1


def test_the_plugin_example_of_the_docs_is_the_readmes():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-check.md").read_text()
    assert readme_plugin().split("\n", 1)[1] in docs


def readme_plugin():
    """The plugin example of the README, as a user copies it."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Add your own check"):]
    return section[section.index("```python\n") + 10:section.index("```\n", section.index("```python\n") + 10)]


def test_the_readmes_plugin_example_runs_as_written_on_the_public_api(tmp_path):
    source = readme_plugin()
    assert "from preflight.api import" in source
    make_plugin(tmp_path, "acme-checks", "acme_checks", source, entry="acme")
    env = {"PYTHONPATH": str(tmp_path)}
    for nvme, status in (("/home/me/offload", "fail"), ("/scratch/offload", "pass")):
        ds = tmp_path / f"ds-{status}.json"
        ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme}}}))
        doc = json.loads(run_subprocess("lint", "--deepspeed", str(ds), "--only", "ACME001", "--json", env=env).stdout)
        assert [(r["id"], r["status"]) for r in doc["results"]] == [("ACME001", status)], doc
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/home/alice/offload"}}}, indent=2))
    said, code = transcripts.run("plugin-acme", tmp_path, env=env)
    assert code == 1
    transcripts.held("plugin-acme", said)


def test_a_broken_plugin_is_reported_and_the_run_goes_on(tmp_path, good):
    make_plugin(tmp_path, "broken-checks", "broken_checks", "raise ImportError('no module named acme_sdk')\n")
    proc = run_subprocess("lint", "--config", good, "--json", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0
    assert "broken-checks" in proc.stderr and "no module named acme_sdk" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert any(r["id"] == "CFG001" for r in json.loads(proc.stdout)["results"])


def test_a_plugin_cannot_take_over_a_builtin_id(tmp_path, good):
    make_plugin(tmp_path, "thief-checks", "thief_checks", PLUGIN.replace("ACME001", "CFG001"))
    proc = run_subprocess("list", "--json", env={"PYTHONPATH": str(tmp_path)})
    assert "thief-checks" in proc.stderr and "CFG001" in proc.stderr
    cfg001 = next(c for c in json.loads(proc.stdout) if c["id"] == "CFG001")
    assert cfg001["module"] == "preflight.checks.config"


def test_a_malformed_plugin_id_is_reported_naming_the_distribution(tmp_path):
    make_plugin(tmp_path, "sloppy-checks", "sloppy_checks", PLUGIN.replace("ACME001", "acme-1"))
    proc = run_subprocess("list", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0
    assert "sloppy-checks" in proc.stderr and "acme-1" in proc.stderr and "sloppy_checks" in proc.stderr


def test_installed_distributions_are_those_importlib_metadata_finds(tmp_path, monkeypatch):
    """The collector's own walk of sys.path (no importlib.metadata: 70 ms a run) finds the distributions, versions
    and entry points importlib.metadata does, the first of a name on sys.path winning as for import."""
    from importlib import metadata

    from preflight.node import packages

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    make_plugin(first, "acme-checks", "acme_checks", PLUGIN)
    make_plugin(second, "acme-checks", "acme_shadowed", PLUGIN.replace("ACME001", "ACME002"))
    (second / "old_style.egg-info").write_text("Metadata-Version: 1.0\nName: old-style\nVersion: 0.3\n")
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    theirs = {}
    for dist in metadata.distributions():
        theirs.setdefault(dist.metadata["Name"].lower().replace("_", "-"), dist.version)
    assert packages.facts()["distributions"] == theirs
    assert theirs["acme-checks"] == "1.0" and theirs["old-style"] == "0.3" and len(theirs) > 20
    ours = [(ep.name, ep.value) for _, ep in registry.entry_points()]
    assert sorted(ours) == sorted((ep.name, ep.value) for ep in metadata.entry_points(group=registry.ENTRY_POINT_GROUP))
    assert ("acme_checks", "acme_checks") in ours and ("acme_shadowed", "acme_shadowed") not in ours


def test_a_fifo_in_a_distributions_metadata_does_not_stall_the_run(tmp_path, good):
    """A node's environment may hold anything: a FIFO named METADATA or entry_points.txt is not read (importlib's
    read_text would wait on it for ever)."""
    info = tmp_path / "stalled-1.0.dist-info"
    info.mkdir()
    os.mkfifo(info / "METADATA")
    os.mkfifo(info / "entry_points.txt")
    proc = run_subprocess("lint", "--config", good, "--json", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    sys.path.insert(0, str(tmp_path))
    try:
        from preflight.node import packages

        assert "stalled" not in packages.facts()["distributions"]
    finally:
        sys.path.remove(str(tmp_path))


def test_hostile_distributions_on_the_path(tmp_path, good):
    """A broken torch-*.dist-info (no Name) earlier on the path does not hide the real
    torch; a plugin past the first 64 KiB of entry_points.txt is found; a single-file .egg-info is no
    entry_points.txt; an entry point that names no module, or a plugin that exits on import, is a plugin problem:
    `list` still lists, exit 0."""
    from preflight.node import packages

    shadow = tmp_path / "shadow"
    (shadow / "torch-9.9.dist-info").mkdir(parents=True)
    (shadow / "torch-9.9.dist-info" / "METADATA").write_text("Summary: not a distribution\n")
    sys.path.insert(0, str(shadow))
    try:
        assert packages.facts()["versions"]["torch"] not in (None, "9.9")
    finally:
        sys.path.remove(str(shadow))
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    make_plugin(plugins, "big-checks", "big_checks", PLUGIN)
    entry = plugins / "big_checks-1.0.dist-info" / "entry_points.txt"
    entry.write_text("[console_scripts]\n" + "".join(f"tool{i} = big_checks:main\n" for i in range(4000))
                     + entry.read_text())
    assert entry.stat().st_size > 65536
    (plugins / "old_style.egg-info").write_text("Metadata-Version: 1.0\nName: old-style\nVersion: 0.3\n\n"
                                                "[preflight.checks]\nmine = not_a_module\n")
    make_plugin(plugins, "sep-checks", "sep_checks", "", entry="sep = os:sep")
    (plugins / "sep_checks-1.0.dist-info" / "entry_points.txt").write_text("[preflight.checks]\nsep = os:sep\n")
    make_plugin(plugins, "exit-checks", "exit_checks", "import sys\nsys.exit(0)\n")
    proc = run_subprocess("list", "--json", env={"PYTHONPATH": str(plugins)})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "ACME001" in {c["id"] for c in json.loads(proc.stdout)}
    assert "names str, not a module" in proc.stderr and "exit-checks" in proc.stderr and "SystemExit" in proc.stderr
    assert "not_a_module" not in proc.stderr


# --- selection -------------------------------------------------------------------------------------

def specs():
    return registry.load().checks


@pytest.mark.parametrize("only,skip,expected", [
    (["CFG030"], [], ["CFG030"]),
    (["CFG04"], [], ["CFG040", "CFG041"]),
    (["zero"], [], ["CFG040", "CFG041", "CKPT003", "MEM001"]),
    (["batch-size", "CFG011"], [], ["CFG011", "CFG030"]),
    (["CFG0"], ["deepspeed", "slurm", "kubernetes"], ["CFG001", "CFG002", "CFG010", "CFG011", "CFG020", "CFG090"]),
    (["CFG07", "kubernetes"], ["multinode"], ["CFG070", "CFG076", "CFG080", "CFG082", "CFG083", "CFG086"]),
])
def test_selection_by_id_prefix_tag_and_name(only, skip, expected):
    assert [s.id for s in registry.select(specs(), only, skip)] == expected


def test_an_unknown_selector_is_a_bad_invocation(capsys, good):
    code, _, err = run_cli(capsys, "lint", "--config", good, "--only", "NOPE9")
    assert code == 2 and "NOPE9" in err and err.count("\n") == 1


# --- runner, results, verdict ----------------------------------------------------------------------

def test_a_check_that_raises_becomes_an_error_result():
    @check("TST002", "raises", "config")
    def broken(ctx):
        """W.\n\nW.\n\nF."""
        raise KeyError("zero_optimization")
        yield  # pragma: no cover

    results = runner.run([broken.__preflight_check__], runner.CheckContext(Plan()))
    assert [(r.status, r.id) for r in results] == [(Status.ERROR, "TST002")]
    assert "KeyError" in results[0].message and "zero_optimization" in results[0].message
    assert verdict(results) == "fail"


def test_a_check_yielding_nothing_passes_and_one_yielding_junk_errors():
    @check("TST003", "silent", "config")
    def silent(ctx):
        """W.\n\nW.\n\nF."""
        return iter(())

    @check("TST004", "junk", "config")
    def junk(ctx):
        """W.\n\nW.\n\nF."""
        yield "not a finding"

    results = runner.run([silent.__preflight_check__, junk.__preflight_check__], runner.CheckContext(Plan()))
    assert [r.status for r in results] == [Status.PASS, Status.ERROR]


def result(status):
    return Result("TST001", "t", status, (), "m", None, {}, 0.0)


@pytest.mark.parametrize("statuses,expected", [
    ([], "pass"),
    ([Status.PASS, Status.SKIP], "pass"),
    ([Status.PASS, Status.WARN], "warn"),
    ([Status.WARN, Status.FAIL], "fail"),
    ([Status.PASS, Status.ERROR], "fail"),
])
def test_verdict(statuses, expected):
    assert verdict([result(s) for s in statuses]) == expected


def test_exit_codes():
    assert (exit_code("pass", False), exit_code("warn", False), exit_code("fail", False)) == (0, 0, 1)
    assert (exit_code("pass", True), exit_code("warn", True)) == (0, 1)


# --- the JSON document and the terminal report -----------------------------------------------------

def test_json_document_follows_the_contract(bad):
    proc = run_subprocess("lint", "--config", bad, "--json")
    doc = json.loads(proc.stdout)  # stdout holds exactly one JSON document
    assert proc.returncode == 1
    assert set(doc) == {"schema", "preflight", "verdict", "duration_s", "nodes", "results"}
    assert doc["schema"] == 1 and doc["verdict"] == "fail" and doc["nodes"] == []
    assert doc["preflight"] == preflight.__version__  # the build that wrote it
    assert isinstance(doc["duration_s"], float)
    for r in doc["results"]:
        assert set(r) == {"id", "name", "status", "nodes", "message", "remediation", "evidence", "duration_s"}
        assert r["status"] in ("pass", "warn", "fail", "skip", "error") and r["nodes"] == []
    failed = [r for r in doc["results"] if r["status"] == "fail"]
    assert {r["id"] for r in failed} == {"CFG010"}
    assert all(r["remediation"] for r in failed)


def test_terminal_report_lists_failures_first_with_fixes_and_ends_with_the_verdict(capsys, bad):
    code, out, _ = run_cli(capsys, "lint", "--config", bad)
    lines = out.splitlines()
    assert code == 1
    assert lines[0].startswith("FAIL  CFG010 main-process-address")
    assert lines[1].strip().startswith("fix: set main_process_port")
    assert lines[-1].startswith("verdict: FAIL") and "1 failed," in lines[-1]
    assert "\x1b[" not in out  # not a terminal: plain text


def run_on_a_terminal(args, env):
    """Run the CLI with its stdout on a pseudo-terminal; return what it wrote there."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "preflight", *map(str, args)], stdout=follower,
                            stderr=subprocess.DEVNULL, env=dict(os.environ, **env))
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode()


def test_colour_on_a_terminal_and_none_with_no_color(bad):
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    coloured = run_on_a_terminal(["lint", "--config", bad], dict(env, TERM="xterm-256color"))
    assert "\x1b[" in coloured and "CFG010" in coloured
    plain = run_on_a_terminal(["lint", "--config", bad], dict(env, TERM="xterm-256color", NO_COLOR="1"))
    assert "\x1b[" not in plain and "CFG010" in plain


def test_identical_findings_on_several_nodes_fold_into_a_range():
    rows = [Result("NET001", "n", Status.FAIL, (f"n{i:02d}",), "same", "fix", {}, 0.0) for i in (1, 2, 3)]
    rows.append(Result("NET001", "n", Status.FAIL, ("n04",), "other", "fix", {}, 0.0))
    folded = render.fold(rows)
    assert [(r.message, render.fold_nodes(nodes)) for r, nodes in folded] == [("same", "n[01-03]"), ("other", "n04")]


# --- commands --------------------------------------------------------------------------------------

def test_list_and_explain(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "CFG030" in out and "batch-size" in out
    code, out, _ = run_cli(capsys, "explain", "cfg030")
    assert code == 0
    assert out.startswith("CFG030 batch-size") and "What:" in out and "Why:" in out and "Fix:" in out
    code, _, err = run_cli(capsys, "explain", "CFG999")
    assert code == 2 and "CFG999" in err


def _make_docs():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    try:
        import make_docs
    finally:
        sys.path.pop(0)
    return make_docs


def test_the_generated_docs_match_the_registry_and_the_parser():
    """docs/checks/ (one page per family), the --help blocks of docs/commands.md and the transcripts in the
    family pages and README.md are what scripts/make_docs.py makes from the registry, the parser and
    docs/transcripts/ now (tests/checks/test_transcripts.py holds the transcripts to real runs)."""
    make_docs = _make_docs()
    pages = make_docs.expected()
    stale = make_docs.stale_files(pages)
    assert not stale, f"stale: {[str(p) for p in stale]}: run python scripts/make_docs.py --write"
    # The pages say what the registry says: every built-in check, its docstring's three parts, on its
    # family's page; every command's --help in the command reference.
    for spec in make_docs.builtin_checks():
        page = pages[make_docs.CHECKS_DIR / make_docs.family_page_name(spec.family)]
        assert f"## {spec.id} {spec.name}" in page and spec.why in page and spec.fix in page, spec.id
        assert f"| {spec.id}" in pages[make_docs.CHECKS_DIR / "README.md"] or f"[{spec.id}]" in page
    for command, usage in make_docs.commands_help().items():
        assert usage in pages[make_docs.COMMANDS], f"docs/commands.md has no --help block for {command}"
    for family, shown in make_docs.FAMILY_TRANSCRIPTS.items():
        for name, caption in shown:
            assert make_docs.transcript(name) in pages[make_docs.CHECKS_DIR / make_docs.family_page_name(family)]


def test_the_docs_check_fails_when_a_page_is_stale(tmp_path, monkeypatch):
    make_docs = _make_docs()
    pages = make_docs.expected()
    family_page = next(p for p in pages if p.name == "cfg.md")
    changed = tmp_path / "cfg.md"
    changed.write_text(pages[family_page].replace("CFG030", "CFG031", 1))
    missing = tmp_path / "gone.md"
    stale = make_docs.stale_files({changed: pages[family_page], missing: "", tmp_path / "x.md": ""})
    assert changed in stale and missing in stale
    monkeypatch.setattr(make_docs, "CHECKS_DIR", tmp_path)  # a page no family has any more
    (tmp_path / "old.md").write_text("")
    assert tmp_path / "old.md" in make_docs.stale_files({})


def test_check_without_a_target_runs_on_this_machine(capsys, good):
    # GPU: a MULTI_GPU job fails GPU001 on a machine without GPUs (tests/checks/test_gpu.py checks that)
    code, doc, _ = run_cli(capsys, "check", "--config", good, "--skip", "deep,GPU", "--json")
    assert code == 0 and doc["nodes"] == [os.uname().nodename]


def test_accelerates_default_config_is_used_when_none_is_given(capsys, monkeypatch, tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text(BAD_ACCELERATE)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    code, doc, err = run_cli(capsys, "lint", "--json")
    assert code == 1 and "default_config.yaml" in err
    assert any(r["id"] == "CFG010" and r["status"] == "fail" for r in doc["results"])


def test_launch_runs_the_command_only_when_ready(tmp_path, good, bad):
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w'); raise SystemExit(7)"]
    refused = run_subprocess("launch", "--config", bad, "--skip", "deep", "--", *command)
    assert refused.returncode == 1 and not marker.exists() and "not launching" in refused.stderr
    ran = run_subprocess("launch", "--config", good, "--skip", "deep,GPU", "--", *command)
    assert ran.returncode == 7 and marker.exists()  # exec: the command's own exit code


def test_launch_without_a_command_is_a_bad_invocation(capsys, good):
    code, _, err = run_cli(capsys, "launch", "--config", good)
    assert code == 2 and "after `--`" in err


def test_lint_imports_no_training_library(good):
    code = ("import sys; from preflight.cli import main; main(['lint', '--config', sys.argv[1]]);"
            "heavy = [m for m in ('torch', 'deepspeed', 'accelerate') if m in sys.modules];"
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_cluster_check_that_reached_no_node_skips_rather_than_passes():
    # a pass needs evidence: with every node unreachable, a cluster check that found nothing saw nothing
    def body(ctx):
        """W.\n\nW.\n\nF."""
        return iter(())
    spec = check("TST030", "nothing-seen", "cluster")(body).__preflight_check__
    unreachable = {"n01": {"facts": None, "clock": None, "error": {"kind": "ssh", "message": "refused"}}}
    (result,) = runner.run_check(spec, runner.CheckContext(Plan(nodes=("n01",)), unreachable, {}))
    assert result.status == Status.SKIP and "no node was reached" in result.message
    reached = {"n01": {"facts": {"host": {}}, "clock": None, "error": None}}
    (result,) = runner.run_check(spec, runner.CheckContext(Plan(nodes=("n01",)), reached, {}))
    assert result.status == Status.PASS


def another_interpreter(tmp_path) -> str:
    """A Python of this machine that is not the one the tests run in: Debian's, else a copy of this one."""
    if Path("/usr/bin/python3").exists() and \
            os.path.realpath("/usr/bin/python3") != os.path.realpath(sys.executable):
        return "/usr/bin/python3"
    copy = tmp_path / "python3"
    copy.write_bytes(Path(os.path.realpath(sys.executable)).read_bytes())
    copy.chmod(0o755)
    return str(copy)


def test_check_on_this_machine_reads_the_facts_with_the_interpreter_python_names(capsys, tmp_path):
    # local mode runs the collector in-process; --python naming another interpreter is that one's facts, not these
    python = another_interpreter(tmp_path)
    code, doc, err = run_cli(capsys, "check", "--python", python, "--only", "PKG001,PKG003", "--json")
    facts_python = [r for r in doc["results"] if r["id"] == "PKG003"]
    assert [r["status"] for r in facts_python] == ["pass"], doc
    code, doc, err = run_cli(capsys, "check", "--python", str(tmp_path / "no-such-python"), "--only", "PKG003",
                             "--json")
    (missing,) = [r for r in doc["results"] if r["id"] == "PKG003"]
    assert missing["status"] == "fail" and "no-such-python does not exist or cannot run here" in missing["message"]


def test_the_local_facts_are_the_named_interpreters(tmp_path):
    from preflight.remote import gather

    python = another_interpreter(tmp_path)
    options = gather.GatherOptions(python=python, timeout=30)
    facts, _ = gather.gather_local("here", options)
    assert facts["here"]["facts"]["python"]["executable"] in (python, os.path.realpath(python))
    options = gather.GatherOptions(python=sys.executable, timeout=30)
    facts, _ = gather.gather_local("here", options)
    assert facts["here"]["facts"]["python"]["executable"] == sys.executable  # this one: in-process


# Interpreters that are not what --python promised: each answer is a node error naming the problem, within
# --timeout, and nothing they started is left running. $PIDS collects the PIDs of what each starts.
HOSTILE_INTERPRETERS = {
    "reads nothing": ("sleep 60 & echo $! >>\"$PIDS\"; wait", "took no input"),
    "not JSON": ("exec 3<&0; cat <&3 >/dev/null & echo $! >>\"$PIDS\"; echo '{\"schema\": 1, \"x\": [}'; "
                 "sleep 60 & echo $! >>\"$PIDS\"; wait", "is not JSON"),
    "an endless line": ("exec 3<&0; cat <&3 >/dev/null & echo $! >>\"$PIDS\"; "
                        "exec python3 -c 'import sys; [sys.stdout.write(\"x\" * 65536) for _ in iter(int, 1)]'",
                        "longer than 64 MiB"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_INTERPRETERS))
def test_an_interpreter_that_answers_wrongly_is_an_error_and_leaves_nothing(kind, tmp_path, monkeypatch):
    import time

    from preflight.remote import gather

    body, said = HOSTILE_INTERPRETERS[kind]
    python, pids = tmp_path / "python", tmp_path / "pids"
    python.write_text(f"#!/bin/sh\n{body}\n")
    python.chmod(0o755)
    monkeypatch.setenv("PIDS", str(pids))
    started = time.monotonic()
    facts, _ = gather.gather_local("here", gather.GatherOptions(python=str(python), timeout=3))
    error = facts["here"]["error"]
    assert error is not None and said in error["message"], error
    assert time.monotonic() - started < 3 * 2 + 1 + 6  # the deadline, and close's wait for the keeper
    def running(pid):  # a killed process waits as a zombie for init to reap it: ended
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
        except OSError:
            return False
    left = [pid for pid in pids.read_text().split() if running(pid)]
    assert not left, (kind, left)
