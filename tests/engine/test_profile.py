"""Profiles (preflight.toml or [tool.preflight] of pyproject.toml): loading, validation as exit-2 errors,
thresholds into the limits, pins (PKG005), skips, and per-host expectations (GPU007)."""
import copy
import json
import textwrap
from unittest import mock

import pytest

from conftest import run_cli
from nvml_fake import fake
from preflight import cli, engine, registry, runner
from preflight.inputs import profile
from preflight.node import collector
from preflight.node import gpus as gpu_facts
from preflight.inputs.documents import InputError
from preflight.plan import Limits, Plan
from preflight.result import Status

NODES = ("gpu001", "gpu002")
BASE = collector.collect({"head": "127.0.0.1", "port": 29500, "paths": {}})
SPECS = {c.id: c for c in registry.load().checks}

FULL = """\
# a whole profile
[thresholds]
clock_warn_s = 0.5
clock_fail_s = 5
shm_fail_mib = 256
shm_warn_mib = 4096
nofile_warn = 65536
disk_warn_gib = 50
min_busbw_gbps = 20.5

[pins]
torch = "2.13.0"
accelerate = ">=1.10,<2"

[checks]
skip = ["CLK002", "SYS"]

[[hosts]]
hosts = "gpu[001-064]"
gpus = 8
gpu_model = "H100"

[[hosts]]
hosts = "cpu*"
gpus = 0
"""


def write(tmp_path, text, name="preflight.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(tmp_path, text, name="preflight.toml"):
    return profile.load(str(write(tmp_path, text, name)))


def state(gpus=None, change=None):
    doc = copy.deepcopy(BASE)
    if gpus is not None:
        with mock.patch.object(gpu_facts, "Nvml", fake(gpus)):
            doc["gpus"] = json.loads(json.dumps(gpu_facts.facts()))
    if change:
        change(doc)
    return {"facts": doc, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}


def run(check_id, prof=None, states=None, limits=Limits()):
    plan = Plan(nodes=tuple(states), remote=True, limits=limits, profile=prof)
    return {n: r for r in runner.run_check(SPECS[check_id], runner.CheckContext(plan, states, {})) for n in r.nodes}


# --- loading ------------------------------------------------------------------------------------------

def test_a_preflight_toml_loads_every_section(tmp_path):
    prof = load(tmp_path, FULL)
    limits = prof.limits(Limits())
    assert (limits.clock_warn_s, limits.clock_fail_s, limits.nofile_warn) == (0.5, 5, 65536)
    assert (limits.shm_fail_bytes, limits.shm_warn_bytes) == (256 * 2**20, 4096 * 2**20)
    assert limits.disk_warn_bytes == 50 * 2**30 and limits.min_busbw_gbps == 20.5
    assert [(p.package, p.spec) for p in prof.pins] == [("torch", "2.13.0"), ("accelerate", ">=1.10,<2")]
    assert prof.skip == ("CLK002", "SYS")
    assert [(h.pattern, h.gpus, h.gpu_model) for h in prof.hosts] == [("gpu[001-064]", 8, "H100"), ("cpu*", 0, None)]
    assert prof.hosts[0].line == 18 and prof.skip_line == 16


def test_pyproject_tool_preflight_loads_the_same(tmp_path):
    text = "[project]\nname = 'x'\n\n" + FULL.replace("[thresholds]", "[tool.preflight.thresholds]").replace(
        "[pins]", "[tool.preflight.pins]").replace("[checks]", "[tool.preflight.checks]").replace(
        "[[hosts]]", "[[tool.preflight.hosts]]")
    prof = load(tmp_path, text, "pyproject.toml")
    assert prof == profile.Profile(**dict(vars(load(tmp_path, FULL)), path=prof.path, skip_line=prof.skip_line,
                                          hosts=prof.hosts))
    assert prof.hosts[0].pattern == "gpu[001-064]" and prof.skip_line == 19


def test_limits_are_defaults_then_profile_then_flags(tmp_path):
    prof = load(tmp_path, "[thresholds]\nclock_warn_s = 0.5\nclock_fail_s = 5\n")
    args = cli.build_parser().parse_args(["check", "--clock-fail", "9"])
    limits = engine._limits(args, prof)
    assert (limits.clock_warn_s, limits.clock_fail_s, limits.nofile_warn) == (0.5, 9, Limits().nofile_warn)
    assert engine._limits(cli.build_parser().parse_args(["check"]), None) == Limits()


# --- bad profiles: exit 2, one line, the file, the line and the key ----------------------------------------

@pytest.mark.parametrize("text,line,words", [
    ("colour = 1\n", 1, ["'colour'"]),
    ("[thresholds]\nnofile_warn = 10\n\n[shm]\nsize = 1\n", 4, ["'shm'"]),
    ("[thresholds]\nnofile_warn = 10\nclock_skew = 1\n", 3, ["'clock_skew'", "[thresholds]"]),
    ("[checks]\nskip = []\nonly = ['CLK']\n", 3, ["'only'", "[checks]"]),
    ('[[hosts]]\nhosts = "a"\n[[hosts]]\nhosts = "b"\ngpu = 8\n', 5, ["'gpu'", "[[hosts]] entry 2"]),
    ("thresholds = {nofile_warn = 1, bad = 2}\n", 1, ["'bad'"]),
])
def test_an_unknown_key_is_exit_2_naming_file_line_and_key(tmp_path, capsys, text, line, words):
    path = write(tmp_path, text, "p.toml")
    code, _, err = run_cli(capsys, "lint", "--profile", path)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"{path}:{line}: unknown key" in err and all(w in err for w in words), err


def test_an_unknown_key_in_pyproject_is_found_under_tool_preflight(tmp_path, capsys, monkeypatch):
    write(tmp_path, "[tool.other]\nbogus = 1\n\n[tool.preflight.thresholds]\nnofile_warn = 1\nbogus = 2\n",
          "pyproject.toml")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "lint")
    assert code == 2 and "pyproject.toml:6: unknown key 'bogus' in [thresholds]" in err


@pytest.mark.parametrize("text,words", [
    ('[thresholds]\nnofile_warn = "4096"\n', ["thresholds.nofile_warn", "whole number", "string"]),
    ("[thresholds]\nnofile_warn = 4096.5\n", ["thresholds.nofile_warn", "whole number"]),
    ("[thresholds]\nclock_warn_s = true\n", ["thresholds.clock_warn_s", "boolean"]),
    ("[thresholds]\nshm_fail_mib = -1\n", ["thresholds.shm_fail_mib", "positive"]),
    ("thresholds = 3\n", ["[thresholds]", "table"]),
    ("[pins]\ntorch = 2.13\n", ["pins.torch", "version string"]),
    ('[pins]\ntorch = "latest"\n', ["pins.torch", "'latest'", "not a version specifier"]),
    ('[pins]\ntorch = ">=2.4,,<3"\n', ["pins.torch", "not a version specifier"]),
    ('[checks]\nskip = "CLK002"\n', ["checks.skip", "list"]),
    ('[checks]\nskip = ["NOPE"]\n', ["checks.skip", "'NOPE'"]),
    ('[[hosts]]\ngpus = 8\n', ["[[hosts]] entry 1", "hosts ="]),
    ('[[hosts]]\nhosts = "gpu[001-"\n', ["hosts", "bad host list"]),
    ('[[hosts]]\nhosts = "g1"\ngpus = "8"\n', ["hosts.gpus", "whole number"]),
    ('[[hosts]]\nhosts = "g1"\ngpu_model = 100\n', ["hosts.gpu_model"]),
    ("[hosts]\nhosts = 'g1'\n", ["[[hosts]]", "array of tables"]),
    ("[thresholds\n", ["malformed TOML"]),
])
def test_a_wrong_value_is_exit_2_naming_file_and_key(tmp_path, capsys, text, words):
    path = write(tmp_path, text, "p.toml")
    code, _, err = run_cli(capsys, "check", "--profile", path, "--only", "SYS001")
    assert code == 2 and err.count("\n") == 1 and f"{path}:" in err
    assert all(w in err for w in words), err


def test_a_missing_profile_and_a_pyproject_without_the_table_are_exit_2(tmp_path, capsys):
    code, _, err = run_cli(capsys, "lint", "--profile", tmp_path / "nope.toml")
    assert code == 2 and "nope.toml: profile not found" in err
    path = write(tmp_path, "[project]\nname = 'x'\n", "pyproject.toml")
    code, _, err = run_cli(capsys, "lint", "--profile", path)
    assert code == 2 and f"{path}: has no [tool.preflight] table" in err


# --- finding the profile --------------------------------------------------------------------------------

def test_preflight_toml_then_pyproject_is_found_in_the_working_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "[project]\nname = 'x'\n", "pyproject.toml")
    assert profile.find() is None
    code, _, err = run_cli(capsys, "lint")
    assert "profile" not in err
    write(tmp_path, "[project]\nname = 'x'\n[tool.preflight.checks]\nskip = ['CFG001']\n", "pyproject.toml")
    config = write(tmp_path, "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\n", "a.yaml")
    code, _, err = run_cli(capsys, "lint", "--config", config, "--json")
    assert "using profile ./pyproject.toml" in err
    write(tmp_path, "[checks]\nskip = ['CFG002']\n")
    code, doc, err = run_cli(capsys, "lint", "--config", config, "--json")
    assert "using profile ./preflight.toml" in err
    ids = {r["id"] for r in doc["results"]}
    assert "CFG002" not in ids and "CFG001" in ids


# --- thresholds change outcomes --------------------------------------------------------------------------

def test_shm_thresholds_of_the_profile_change_fs001(tmp_path):
    def shm(size):
        return state(change=lambda d: d["storage"]["shm"].update(total_bytes=size, free_bytes=size))

    states = {"gpu001": shm(2 * 2**30), "gpu002": shm(300 * 2**20)}
    default = run("FS001", states=states)
    assert default["gpu001"].status == Status.PASS and default["gpu002"].status == Status.FAIL
    prof = load(tmp_path, "[thresholds]\nshm_warn_mib = 4096\nshm_fail_mib = 256\n")
    changed = run("FS001", states=states, limits=prof.limits(Limits()))
    assert changed["gpu001"].status == Status.WARN and changed["gpu002"].status == Status.WARN


def test_clock_thresholds_of_the_profile_change_clk001(tmp_path):
    def ahead(seconds):
        node = state()
        node["clock"]["offset_s"] = seconds
        return node

    states = {"gpu001": ahead(0.0), "gpu002": ahead(0.3)}
    assert run("CLK001", states=states)["gpu002"].status == Status.WARN
    prof = load(tmp_path, "[thresholds]\nclock_warn_s = 0.5\n")
    assert run("CLK001", states=states, limits=prof.limits(Limits()))["gpu002"].status == Status.PASS


def test_nofile_threshold_through_the_cli_on_this_machine(tmp_path, capsys):
    high = write(tmp_path, "[thresholds]\nnofile_warn = 1000000000\n", "high.toml")
    low = write(tmp_path, "[thresholds]\nnofile_warn = 1\n", "low.toml")
    code, doc, err = run_cli(capsys, "check", "--profile", high, "--only", "SYS001", "--json")
    assert f"using profile {high}" in err
    assert [r["status"] for r in doc["results"]] == ["warn"] and "under 1000000000" in doc["results"][0]["message"]
    code, doc, _ = run_cli(capsys, "check", "--profile", low, "--only", "SYS001", "--json")
    assert [r["status"] for r in doc["results"]] == ["pass"] and code == 0


def test_the_skip_list_is_merged_with_skip(tmp_path, capsys):
    path = write(tmp_path, "[checks]\nskip = ['SYS001']\n")
    code, doc, _ = run_cli(capsys, "check", "--profile", path, "--only", "SYS,FS001", "--skip", "SYS002", "--json")
    assert {r["id"] for r in doc["results"]} == {"SYS003", "FS001"}


# --- pins (PKG005) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,version,allowed", [
    ("2.13.0", "2.13.0", True), ("2.13.0", "2.13.0+cu124", True), ("2.13.0", "2.13.1", False),
    ("==2.13", "2.13.0", True), ("2.13.0+cpu", "2.13.0+cu124", False), ("2.13.0+cpu", "2.13.0+cpu", True),
    (">=1.10", "1.9.9", False), (">=1.10", "1.10.0", True), (">=1.10,<2", "2.0.0", False), (">1.0", "1.0", False),
    ("<=0.15", "0.15.0", True), ("!=0.15.1", "0.15.1", False), ("!=0.15.1", "0.15.2", True),
    (">=0.15.1", "0.15.1rc1", False), (">=0.15.1", "0.15.1.post1", True), ("==2.13.*", "2.13.7", True),
    ("==2.1.*", "2.13.0", False), (">=1", "dev-build", False), ("~=2.13.0", "2.13.4", True), ("~=2.13.0", "2.14.0", False),
    ("2.8.0", "2.8.0a0+5228986c39.nv25.05", False), (">=2.4", "2.8.0a0+5228986c39.nv25.05", True),
])
def test_the_pin_comparator(spec, version, allowed):
    assert profile.parse_pin("x", spec).allows(version) is allowed


def test_pins_pass_and_fail_on_each_node(tmp_path):
    def versions(torch, accelerate=None):
        def change(doc):
            doc["packages"]["versions"].update(torch=torch, accelerate=accelerate)
            doc["packages"]["distributions"].update(torch=torch, accelerate=accelerate)
            doc["packages"]["distributions"]["nvidia-nccl-cu12"] = "2.21.5"
        return state(change=change)

    prof = load(tmp_path, '[pins]\ntorch = "2.13.0"\naccelerate = ">=1.10"\nnvidia_nccl_cu12 = ">=2.20"\n')
    results = run("PKG005", prof, {"gpu001": versions("2.13.0+cu124", "1.10.1"), "gpu002": versions("2.12.0")})
    assert results["gpu001"].status == Status.PASS and "torch 2.13.0+cu124" in results["gpu001"].message
    bad = [r for r in runner.run_check(SPECS["PKG005"], runner.CheckContext(
        Plan(nodes=NODES, remote=True, profile=prof),
        {"gpu001": versions("2.13.0"), "gpu002": versions("2.12.0")}, {})) if r.nodes == ("gpu002",)]
    assert sorted(r.status for r in bad) == [Status.FAIL, Status.FAIL, Status.PASS]
    messages = " | ".join(r.message for r in bad)
    assert "torch is 2.12.0, the profile pins 2.13.0" in messages
    assert "accelerate is not installed" in messages and "nvidia-nccl-cu12 2.21.5" in messages
    assert any(r.remediation and "pip install 'torch==2.13.0'" in r.remediation for r in bad)


def test_no_pins_skip_pkg005():
    assert run("PKG005", None, {"gpu001": state()})["gpu001"].status == Status.SKIP


# --- per-host expectations (GPU007) ----------------------------------------------------------------------

HOSTS = '[[hosts]]\nhosts = "gpu[001-064]"\ngpus = 8\ngpu_model = "H100"\n\n[[hosts]]\nhosts = "cpu*"\ngpus = 0\n'


def test_a_node_matching_the_pattern_meets_the_expectations(tmp_path):
    prof = load(tmp_path, HOSTS)
    results = run("GPU007", prof, {"gpu001": state("h100x8.json"), "gpu064": state("a100x8.json"),
                                   "gpu065": state("a100x8.json"), "cpu7": state("no-driver.json")})
    assert results["gpu001"].status == Status.PASS and "8 GPU(s)" in results["gpu001"].message
    assert results["gpu064"].status == Status.FAIL and "expected H100" in results["gpu064"].message
    assert results["gpu065"].status == Status.SKIP and "no [[hosts]] entry" in results["gpu065"].message
    assert results["cpu7"].status == Status.PASS


def test_a_wrong_gpu_count_fails(tmp_path):
    prof = load(tmp_path, HOSTS.replace("gpus = 8", "gpus = 4"))
    result = run("GPU007", prof, {"gpu002": state("h100x8.json")})["gpu002"]
    assert result.status == Status.FAIL and "8 GPU(s) here, expected 4" in result.message
    assert result.evidence["count"] == 8 and result.evidence["expected_count"] == 4


def test_expected_gpus_without_nvml_fail(tmp_path):
    prof = load(tmp_path, HOSTS)
    result = run("GPU007", prof, {"gpu003": state("no-driver.json")})["gpu003"]
    assert result.status == Status.FAIL and "no GPU facts" in result.message and "expected 8 H100" in result.message


def test_a_fully_qualified_node_name_matches_by_its_short_name(tmp_path):
    prof = load(tmp_path, HOSTS)
    assert prof.expectation("gpu010.cluster.example") is prof.hosts[0]
    assert prof.expectation("gpu100") is None and prof.expectation("10.0.0.1") is None


def test_no_hosts_in_the_profile_skips_gpu007():
    assert run("GPU007", None, {"gpu001": state("h100x8.json")})["gpu001"].status == Status.SKIP


def test_input_error_is_one_line_with_the_line():
    error = InputError("p.toml", "unknown key 'x'", 3)
    assert str(error) == "p.toml:3: unknown key 'x'"


def test_the_readme_example_profile_loads(tmp_path):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    example = re.search(r"```toml\n(# preflight.toml\n.*?)```", readme, re.S).group(1)
    prof = load(tmp_path, example)
    assert prof.limits(Limits()).min_busbw_gbps == 20 and prof.skip == ("CLK002", "SYS")
    assert {p.package for p in prof.pins} == {"torch", "accelerate", "python"} and len(prof.hosts) == 2
