"""PKG008 beside the table-driven tests (test_pkg_known_defects_as_released.py): versions compared as pip compares
them; which NCCL is judged; the requirements the installed libraries declare, read as pip reads them (hard ones,
runtime extras, never [dev]); the table's own validation, its docs and explain; and one row end to end on the
real test cluster, judged against the DeepSpeed config given to check."""
import copy
import json
import os
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from cluster import cluster, cluster_up  # noqa: F401,F811  (fixtures)
from cluster_check import check
from node_facts import BASE, run
from preflight.inputs.versions import TableError, known_defects, parse_table, within
from preflight.node import packages
from preflight.result import Status

ROWS = known_defects()
DISTRIBUTION = {"nccl": "nvidia-nccl-cu12", "torch": "torch", "deepspeed": "deepspeed", "accelerate": "accelerate",
                "transformers": "transformers", "peft": "peft", "trl": "trl", "flash-attn": "flash-attn"}


def stage(folder, dists, requires=None):
    """Fake installed distributions: a .dist-info with METADATA per (name, version)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in dists.items():
        info = folder / f"{name.replace('-', '_')}-{version or 'x'}.dist-info"
        info.mkdir()
        lines = ["Metadata-Version: 2.1", f"Name: {name}"] + ([f"Version: {version}"] if version else [])
        lines += [f"Requires-Dist: {r}" for r in (requires or {}).get(name, ())]
        (info / "METADATA").write_text("\n".join(lines) + "\n\nA description.\n")
    return folder


def collected(folder, monkeypatch):
    """The collector's package facts with FOLDER first on the path, as a node reads them."""
    monkeypatch.setattr(sys, "path", [str(folder)] + sys.path)
    return packages.facts()


def node_state(package_facts, env=None, gpus=None, python=None):
    doc = copy.deepcopy(BASE)
    doc["packages"] = package_facts
    doc["env"] = dict(env or {})
    doc["gpus"] = gpus or {"available": False, "reason": "no NVIDIA driver"}
    if python:
        doc["python"]["version"] = python
    return {"n01": {"facts": doc, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}}


def inside(spec):
    """A version in the range SPEC: one of its bounds, or a step beside one."""
    for clause in SpecifierSet(spec):
        release = list(Version(clause.version).release)
        below = next(i for i in range(len(release) - 1, -1, -1) if release[i] or i == 0)
        candidates = [clause.version, ".".join(map(str, release[:-1] + [release[-1] + 1]))]
        candidates += [".".join(map(str, release[:below] + [release[below] - 1]))] if release[below] else []
        for candidate in candidates:
            if within(candidate, spec):
                return candidate
    raise AssertionError(f"no version found inside {spec}")


def staged_node(tmp_path, monkeypatch, row, version):
    """A node with ROW's package at VERSION and the row's other conditions met."""
    wanted = {row.package: version, **{p: inside(s) for p, s in row.with_}}
    dists = {DISTRIBUTION[p]: v for p, v in wanted.items() if p in DISTRIBUTION}
    requires = {"torch": [f"nvidia-nccl-cu12=={dists['nvidia-nccl-cu12']}; platform_system == \"Linux\""]
                } if "nvidia-nccl-cu12" in dists else {}
    if requires and "torch" not in dists:
        dists["torch"] = "2.13.0"
    facts = collected(stage(tmp_path / "site", dists, requires), monkeypatch)
    gpus = {"available": True, "driver_version": wanted.get("nvidia-driver", "580.65.06"),
            "cuda_driver_version": wanted.get("cuda-driver", "13.0")}
    return node_state(facts, env=dict(row.env), gpus=gpus, python=inside(row.python) if row.python else None)


def flagged(results):
    return {r.evidence.get("defect") for r in results if r.status in (Status.WARN, Status.FAIL)}


def test_the_table_has_eighty_sourced_rows():
    assert len(ROWS) >= 80
    for row in ROWS:
        assert row.source.startswith("https://"), row.id
        assert row.confirmed.startswith(("maintainer comment", "release notes", "merged PR")), row.id
        assert row.fixed or row.fix, f"{row.id}: says neither the release to move to nor what else to do"


# --- healthy nodes ---------------------------------------------------------------------------------------

def test_this_projects_environment_raises_nothing():
    found = run("PKG008")
    assert {r.status for r in found} <= {Status.PASS, Status.SKIP}, [r.message for r in found]
    ok = next(r for r in found if r.status == Status.PASS)
    assert "none of" in ok.message and "known defects applies to this job" in ok.message


def test_the_fixed_releases_together_raise_nothing(tmp_path, monkeypatch):
    dists = {"torch": "2.7.1+cu126", "nvidia-nccl-cu12": "2.26.5", "deepspeed": "0.19.2", "accelerate": "1.10.1",
             "transformers": "4.56.2", "peft": "0.16.0", "flash-attn": "2.8.3"}
    facts = collected(stage(tmp_path, dists, {"torch": ['nvidia-nccl-cu12==2.26.5; platform_system == "Linux"']}),
                      monkeypatch)
    gpus = {"available": True, "driver_version": "570.133.20", "cuda_driver_version": "12.8"}
    found = run("PKG008", node_state(facts, gpus=gpus))
    assert {r.status for r in found} <= {Status.PASS, Status.SKIP}, [r.message for r in found]


# --- versions as pip compares them ------------------------------------------------------------------------

@pytest.mark.parametrize("version,spec,inside_it", [
    ("0.15.4", "<0.9.3", False),  # as text 0.15.4 < 0.9.3
    ("0.9.3", "<0.15.4", True),
    ("2.5.1+cu121", "==2.5.1", True),  # a local label never hides the release
    ("2.7.0+cpu", "==2.7.0", True),
    ("2.5.1+rocm6.2", ">=2.5,<2.6", True),
    ("2.7.0a0+79aa17489c.nv25.04", "==2.7.0", False),  # NGC's pre-release is not the release
    ("2.8.0a0+5228986c39.nv25.05", ">=2.4.0a0", True),
    ("2.8.0.dev20250501+cu128", ">=2.6.0a0", True),
    ("2.29.2.post1", "==2.29.2", False),
    ("", "==2.29.2", False),
    ("not a version", ">=0", False),
])
def test_versions_are_compared_as_pip_compares_them(version, spec, inside_it):
    assert within(version, spec) is inside_it


def test_pre_releases_sort_below_their_release():
    assert Version("2.8.0a0+nv25.05") < Version("2.8.0") and Version("2.8.0.dev1") < Version("2.8.0a0")
    assert within("2.8.0a0+5228986c39.nv25.05", "<2.8.0.post0") and not within("2.8.0", "<2.8.0")


def test_a_row_decides_whether_a_post_release_keeps_the_defect():
    assert not within("2.29.2.post1", "==2.29.2", posts_affected=False)
    assert within("2.29.2.post1", "==2.29.2", posts_affected=True)
    assert not within("2.29.3.post1", "==2.29.2", posts_affected=True)


def test_an_ngc_torch_is_judged_by_its_release_not_its_text(tmp_path, monkeypatch):
    row = next(r for r in ROWS if r.id == "torch-nonblocking-watchdog-thread-safety")
    ngc = staged_node(tmp_path / "a", monkeypatch, row, "2.7.1a0+79aa17489c.nv25.04")
    assert row.id not in flagged(run("PKG008", ngc))
    assert row.id in flagged(run("PKG008", staged_node(tmp_path / "b", monkeypatch, row, "2.7.1+cu128")))


def test_the_nccl_judged_is_the_wheel_torch_depends_on_and_a_preloaded_one_is_said(tmp_path, monkeypatch):
    dists = {"torch": "2.10.0", "nvidia-nccl-cu12": "2.29.2", "nvidia-nccl-cu13": "2.28.9"}
    facts = collected(stage(tmp_path, dists, {"torch": ['nvidia-nccl-cu12==2.29.2; platform_system == "Linux"']}),
                      monkeypatch)
    assert facts["versions"]["nccl"] == "2.28.9"  # PKG001's NCCL: the first wheel found
    state = node_state(facts, env={"LD_PRELOAD": "/opt/nccl/lib/libnccl.so.2"})
    state["n01"]["facts"]["host"]["machine"] = "aarch64"
    [hang] = [r for r in run("PKG008", state) if r.evidence.get("defect") == "nccl-2.28.9-aarch64-proxy-hang"]
    assert "nvidia-nccl-cu12, the wheel torch depends on" in hang.message
    assert "LD_PRELOAD loads /opt/nccl/lib/libnccl.so.2" in hang.message
    assert "torch loads its own" not in hang.message
    bundled = "/env/lib/python3.11/site-packages/torch/lib/libnccl.so.2"
    state["n01"]["facts"]["fabric"] = {"nccl": {"libraries": [bundled]}}
    [hang] = [r for r in run("PKG008", state) if r.evidence.get("defect") == "nccl-2.28.9-aarch64-proxy-hang"]
    assert f"torch loads its own {bundled} first" in hang.message


# --- what the installed libraries declare -----------------------------------------------------------------

def test_a_hard_requirement_the_node_does_not_meet_fails_as_pip_check_does(tmp_path, monkeypatch):
    dists = {"trl": "0.24.0", "transformers": "4.45.2", "accelerate": "1.10.1"}
    requires = {"trl": ["accelerate>=1.4.0", "transformers>=4.56.1"]}
    found = run("PKG008", node_state(collected(stage(tmp_path, dists, requires), monkeypatch)))
    [unmet] = [r for r in found if r.status == Status.FAIL]
    assert "trl 0.24.0 requires transformers>=4.56.1 (its metadata), the node has transformers 4.45.2" in unmet.message
    assert unmet.evidence["extra"] is None


def test_a_lower_bound_of_a_runtime_extra_warns_naming_the_extra_and_who_enforces_it(tmp_path, monkeypatch):
    dists = {"transformers": "5.24.0", "accelerate": "1.0.1", "torch": "2.9.0"}
    requires = {"transformers": ['accelerate>=1.1.0; extra == "torch"', 'deepspeed>=0.9.3; extra == "deepspeed"']}
    found = run("PKG008", node_state(collected(stage(tmp_path, dists, requires), monkeypatch)))
    [unmet] = [r for r in found if r.status == Status.WARN and "requires" in r.message]
    assert "transformers 5.24.0 requires accelerate>=1.1.0 with its [torch] extra" in unmet.message
    assert "the node has accelerate 1.0.1" in unmet.message and "refuses it at import" in unmet.message
    assert not [r for r in found if r.status == Status.FAIL]


def test_an_upper_cap_of_a_runtime_extra_warns_that_pip_refuses_it_only_when_asked(tmp_path, monkeypatch):
    dists = {"accelerate": "1.10.1", "deepspeed": "0.16.4"}
    requires = {"accelerate": ['deepspeed<0.15; extra == "deepspeed"']}
    found = run("PKG008", node_state(collected(stage(tmp_path, dists, requires), monkeypatch)))
    [unmet] = [r for r in found if r.status == Status.WARN and "requires" in r.message]
    assert "[deepspeed] extra" in unmet.message and "accelerate[deepspeed] is installed by name" in unmet.message


def test_extras_of_tooling_or_of_what_is_not_installed_are_never_read(tmp_path, monkeypatch):
    dists = {"transformers": "5.24.0", "accelerate": "1.0.1", "peft": "0.10.0"}
    requires = {"transformers": ['accelerate>=1.1.0; extra == "sagemaker"', 'peft>=0.18.0; extra == "dev"',
                                 'accelerate>=2.0; extra == "deepspeed-testing"', 'peft>=0.18.0; extra == "all"'],
                "accelerate": ["torch>=2.0.0"]}
    found = run("PKG008", node_state(collected(stage(tmp_path, dists, requires), monkeypatch)))
    assert {r.status for r in found} <= {Status.PASS, Status.SKIP}, [r.message for r in found]


# --- the collector ----------------------------------------------------------------------------------------

def test_the_nccl_version_comes_from_the_first_wheel_that_has_one(tmp_path, monkeypatch):
    first = stage(tmp_path / "first", {"nvidia-nccl-cu13": None, "nvidia-nccl-cu12": None})
    second = stage(tmp_path / "second", {"nvidia-nccl-cu12": "2.27.5"})
    monkeypatch.setattr(sys, "path", [str(first), str(second)] + sys.path)
    assert packages.facts()["versions"]["nccl"] == "2.27.5"


def shared_object(path, *flags):
    """A real ELF shared object built by the C compiler (its soname and needed libraries from `flags`)."""
    source = path.parent / "empty.c"
    source.write_text("int preflight_test_symbol;\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(source), *flags], check=True, capture_output=True,
                   timeout=60)
    return path


def libnccl(folder, version):
    """libnccl.so.VERSION with the soname libnccl.so.2 and its link, as NCCL's packages install it."""
    folder.mkdir(parents=True, exist_ok=True)
    shared_object(folder / f"libnccl.so.{version}", "-Wl,-soname,libnccl.so.2")
    (folder / "libnccl.so.2").symlink_to(f"libnccl.so.{version}")
    return folder


def cuda_torch(site, *link):
    """A CUDA build of torch with no nvidia-nccl wheel (NGC, conda): its version.py and a libtorch_cuda.so
    linked by the compiler with `link`."""
    stage(site, {"torch": "2.5.0a0+e000cf0ad9.nv24.10"})
    (site / "torch" / "lib").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    (site / "torch" / "version.py").write_text("__version__ = '2.5.0a0'\ncuda = '12.6'\n")
    return shared_object(site / "torch" / "lib" / "libtorch_cuda.so", *link)


def loader_resolves(library, env):
    """Where the dynamic loader itself (ldd) resolves libnccl.so.2 for `library`."""
    out = subprocess.run(["ldd", str(library)], capture_output=True, text=True, env=env, timeout=30).stdout
    line = next(line for line in out.splitlines() if "libnccl.so.2" in line)
    return os.path.realpath(line.split("=>")[1].split("(")[0].strip())


def test_the_nccl_a_torch_without_the_wheel_loads_is_the_file_the_loader_finds(tmp_path, monkeypatch):
    """NGC and conda build torch against a libnccl.so.2 of their own (no nvidia-nccl wheel): the version judged is
    the file libtorch_cuda.so's libnccl.so.2 resolves to, in the dynamic loader's order (DT_RPATH before
    LD_LIBRARY_PATH, LD_LIBRARY_PATH before DT_RUNPATH), proven against the loader (ldd); PKG008 names that file.
    A torch that names no libnccl (NCCL linked into itself) is not given the system's."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # a node's collector has not imported torch
    system = libnccl(tmp_path / "system", "2.28.9")
    conda = libnccl(tmp_path / "conda" / "lib", "2.19.3")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(system))
    env = dict(os.environ)
    cases = {"runpath": (["-Wl,--enable-new-dtags", f"-Wl,-rpath,{conda}"], "2.28.9", system),
             "rpath": (["-Wl,--disable-new-dtags", f"-Wl,-rpath,{conda}"], "2.19.3", conda)}
    for name, (dtags, version, folder) in cases.items():
        site = tmp_path / name
        library = cuda_torch(site, *dtags, f"-L{system}", "-Wl,--no-as-needed", "-l:libnccl.so.2")
        facts = collected(site, monkeypatch)
        assert facts["versions"]["nccl"] == version, name
        assert facts["nccl_library"] == loader_resolves(library, env) == str(folder / f"libnccl.so.{version}")
    state = node_state(facts)
    state["n01"]["facts"]["host"]["machine"] = "aarch64"
    state["n01"]["facts"]["packages"]["versions"]["nccl"] = "2.28.9"
    state["n01"]["facts"]["packages"]["nccl_library"] = str(system / "libnccl.so.2.28.9")
    [hang] = [r for r in run("PKG008", state) if r.evidence.get("defect") == "nccl-2.28.9-aarch64-proxy-hang"]
    assert f"{system}/libnccl.so.2.28.9, the libnccl torch's libtorch_cuda.so loads" in hang.message
    static = tmp_path / "static"
    cuda_torch(static)
    facts = collected(static, monkeypatch)
    assert facts["versions"]["nccl"] is None and facts["nccl_library"] is None


def test_the_collector_keeps_only_the_requirements_it_judges(tmp_path, monkeypatch):
    requires = {"transformers": ["numpy>=1.17", 'accelerate>=1.1.0; extra == "torch"', "huggingface-hub>=0.34"],
                "torch": ['nvidia-nccl-cu12==2.27.5; platform_system == "Linux"', "filelock"]}
    facts = collected(stage(tmp_path, {"transformers": "5.24.0", "torch": "2.9.0"}, requires), monkeypatch)
    assert facts["requires"]["transformers"] == ['accelerate>=1.1.0; extra == "torch"']
    assert facts["requires"]["torch"] == ['nvidia-nccl-cu12==2.27.5; platform_system == "Linux"']


# --- the table itself -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,error", [
    ("[[defect]\n", "not TOML"),
    ('[[defect]]\nid = "a"\npackage = "numpy"\naffected = "<1"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n',
     "package 'numpy' is not one of"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "2.7.0"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n',
     "'2.7.0' is not a version range"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "<1"\nsymptom = "s"\nconfirmed = "c"\n', "source missing"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "<1"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n'
     'with = { numpy = ">=1" }\n', "with.numpy is not one of"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "<1"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n'
     'fixd = "1"\n', "unknown field(s) fixd"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "<1"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n'
     'when = { zero = [3] }\n', "when.zero is not one of"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "<1"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n'
     'when = { zero_stage = [4] }\n', "when.zero_stage must list 0, 1, 2, 3, not [4]"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "<1"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n'
     'when = { moe = "yes" }\n', "when.moe must be true or false"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "<1"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n'
     'when = { machine = [] }\n', "when.machine must list names"),
    ('[[defect]]\nid = "a"\npackage = "torch"\naffected = "<1"\nsymptom = "s"\nsource = "u"\nconfirmed = "c"\n'
     'when = { code = "" }\n', "when.code must be text"),
])
def test_a_malformed_table_is_one_line_naming_the_file_and_the_row(text, error):
    with pytest.raises(TableError) as raised:
        parse_table(text, "/x/known_defects.toml")
    assert str(raised.value).startswith("/x/known_defects.toml") and error in str(raised.value)
    assert "\n" not in str(raised.value)


def test_explain_lists_every_row_with_its_source():
    from preflight import registry

    spec = registry.load().get("PKG008")
    for row in ROWS:
        assert row.source in spec.why and row.shown() in spec.why


def test_the_docs_page_lists_every_row_with_its_source():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "make_docs.py"
    spec = importlib.util.spec_from_file_location("make_docs_for_known_defects", path)
    doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc)
    text = doc.known_defects_page("<!-- generated -->")
    assert text.startswith("<!-- generated -->\n") and f"these {len(ROWS)} rows" in text
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(table) == len(ROWS)
    for row, line in zip(ROWS, table):
        assert f"`{row.id}`" in line and f"({row.source})" in line and row.confirmed in line


# --- the real test cluster --------------------------------------------------------------------------------

@pytest.mark.cluster
def test_a_known_bad_accelerate_on_one_node_is_named_there_for_a_zero3_job_only(cluster, tmp_path):
    row = "accelerate-1.0.0-zero3-auto-batch-size"
    configs = {}
    for stage in (3, 2):
        configs[stage] = tmp_path / f"ds{stage}.json"
        configs[stage].write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                              "zero_optimization": {"stage": stage}}))
    with cluster.shadowed_package("node03", "accelerate", "1.0.0"):
        zero3, _ = check(cluster, "--only", "PKG008", "--deepspeed", str(configs[3]))
        zero2, _ = check(cluster, "--only", "PKG008", "--deepspeed", str(configs[2]))
        unknown, _ = check(cluster, "--only", "PKG008")
    found = [r for r in zero3["results"] if r["id"] == "PKG008"]
    named = {r["evidence"]["defect"] for r in found if r["status"] == "warn" and r["evidence"].get("defect")}
    assert named == {row} and [r["nodes"] for r in found if r["evidence"].get("defect") == row] == [["node03"]]
    assert "ZeRO stage 3" in next(r["message"] for r in found if r["evidence"].get("defect") == row)
    assert row not in {r["evidence"].get("defect") for r in zero2["results"] if r["id"] == "PKG008"}
    skipped = [r for r in unknown["results"] if r["id"] == "PKG008" and r["status"] == "skip" and
               row in r["evidence"].get("defects", [])]
    assert skipped and skipped[0]["nodes"] == ["node03"] and "not known" in skipped[0]["message"]


# --- the job's conditions, as its files and launch give them ---------------------------------------------

def conditions_of(tmp_path, deepspeed=None, accelerate=None, command=(), **plan):
    from preflight.inputs.configs import load_accelerate_config, load_deepspeed_config
    from preflight.plan import Plan

    if deepspeed is not None:
        (tmp_path / "ds.json").write_text(json.dumps(deepspeed))
        plan["deepspeed"] = load_deepspeed_config(str(tmp_path / "ds.json"))
    if accelerate is not None:
        (tmp_path / "accelerate.yaml").write_text(accelerate)
        plan["accelerate"] = load_accelerate_config(str(tmp_path / "accelerate.yaml"))
    return Plan(command=tuple(command), **plan).conditions


def test_deepspeeds_json_gives_stage_offload_precision_clipping_and_optimizer(tmp_path):
    known, unknown = conditions_of(tmp_path, {
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "CPU"}, "offload_param": {"device": "cpu"}},
        "optimizer": {"type": "AdamW"}}, command=("deepspeed", "train.py"))
    assert known == dict(known, zero_stage=2, offload_optimizer=True, precision="bf16", gradient_clipping=True,
                         optimizer="adamw", launcher=("deepspeed",), rdzv_backend=None, fsdp_version=None)
    assert known["offload_param"] is False  # DeepSpeed reads offload_param at stage 3 only
    assert "deepspeed_multinode_launcher" in unknown and "moe" in unknown


def test_what_the_hf_trainer_fills_in_is_not_known(tmp_path):
    known, unknown = conditions_of(tmp_path, {"fp16": {"enabled": "auto"}, "gradient_clipping": "auto",
                                              "zero_optimization": {"stage": "auto"}})
    for name in ("precision", "gradient_clipping", "zero_stage", "offload_optimizer", "optimizer"):
        assert name not in known and name in unknown, name
    assert "auto" in unknown["precision"] and "auto" in unknown["gradient_clipping"]


def test_accelerate_fills_deepspeeds_auto_precision_and_gives_its_own_defaults(tmp_path):
    known, _ = conditions_of(tmp_path, {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}},
                             "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_machines: 2\nnum_processes: 16\n"
                             "deepspeed_config:\n  deepspeed_config_file: ds.json\n",
                             command=("accelerate", "launch", "train.py"))
    assert known["precision"] == "bf16" and known["zero_stage"] == 3
    assert known["rdzv_backend"] == "static" and known["deepspeed_multinode_launcher"] == "pdsh"
    known, _ = conditions_of(tmp_path, accelerate="distributed_type: DEEPSPEED\nnum_machines: 1\n"
                             "deepspeed_config:\n  offload_optimizer_device: cpu\n")
    assert known["zero_stage"] == 2 and known["offload_optimizer"] is True and known["precision"] == "fp32"


def test_fsdp_and_the_rendezvous_backend_come_from_accelerate_and_its_flags(tmp_path):
    known, _ = conditions_of(tmp_path, accelerate="distributed_type: FSDP\nmixed_precision: fp16\n"
                             "fsdp_config:\n  fsdp_version: 2\n",
                             command=("accelerate", "launch", "--rdzv_backend", "c10d", "train.py"))
    assert known["fsdp_version"] == 2 and known["zero_stage"] is None and known["precision"] == "fp16"
    assert known["rdzv_backend"] == "c10d"
    known, _ = conditions_of(tmp_path, accelerate="distributed_type: MULTI_GPU\n")
    assert known["fsdp_version"] is None and known["offload_optimizer"] is False


def test_a_manifests_container_says_container_and_its_capabilities(tmp_path):
    from preflight.inputs import manifests

    path = tmp_path / "job.yaml"
    path.write_text("""apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: train}
spec:
  pytorchReplicaSpecs:
    Worker:
      replicas: 2
      template:
        spec:
          containers:
          - name: pytorch
            image: nvcr.io/nvidia/pytorch:25.01-py3
            command: ["torchrun", "--nproc_per_node=8", "train.py"]
            securityContext:
              capabilities: {add: ["SYS_PTRACE"]}
""")
    known, _ = conditions_of(tmp_path, manifest=manifests.load(str(path)), command=("torchrun", "train.py"))
    assert known["container"] is True and known["sys_nice"] is False
    path.write_text(path.read_text().replace("SYS_PTRACE", "SYS_NICE"))
    known, _ = conditions_of(tmp_path, manifest=manifests.load(str(path)), command=("torchrun", "train.py"))
    assert known["sys_nice"] is True


def test_a_workaround_the_manifest_sets_for_the_job_counts_as_set(tmp_path, monkeypatch):
    from preflight.inputs import manifests
    from preflight.plan import Plan

    facts = collected(stage(tmp_path / "site", {"nvidia-nccl-cu12": "2.19.3"}), monkeypatch)
    state = node_state(facts)
    manifest = tmp_path / "job.yaml"
    for env, expected in (("", Status.WARN), ('\n            env: [{name: NCCL_CUMEM_ENABLE, value: "0"}]', Status.PASS)):
        manifest.write_text("apiVersion: kubeflow.org/v1\nkind: PyTorchJob\nmetadata: {name: t}\nspec:\n"
                            "  pytorchReplicaSpecs:\n    Worker:\n      replicas: 2\n      template:\n        spec:\n"
                            "          containers:\n          - name: pytorch\n            image: img\n"
                            '            command: ["torchrun", "--nproc_per_node=8", "train.py"]' + env + "\n")
        plan = Plan(nodes=("n01",), remote=True, manifest=manifests.load(str(manifest)),
                    command=("torchrun", "--nproc_per_node=8", "train.py"))
        [row] = [r for r in run("PKG008", state, plan=plan)
                 if r.evidence.get("defect") == "nccl-2.19-cumem-alltoall-deadlock"]
        assert row.status == expected, row.message


def test_a_workaround_a_batch_script_exports_to_its_launch_counts_as_set(tmp_path, monkeypatch):
    from preflight.inputs import batchscript
    from preflight.plan import Plan

    state = node_state(collected(stage(tmp_path / "site", {"nvidia-nccl-cu12": "2.19.3"}), monkeypatch))
    script = tmp_path / "job.sh"
    for export, expected in (("", Status.WARN), ("export NCCL_CUMEM_ENABLE=0\n", Status.PASS),
                             ("NCCL_CUMEM_ENABLE=0\n", Status.WARN),  # not exported: srun's tasks never see it
                             ("export NCCL_CUMEM_ENABLE=0\n", Status.WARN)):  # srun --export=NONE below
        none = expected is Status.WARN and export.startswith("export")
        script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" + export +
                          f"srun{' --export=NONE' if none else ''} torchrun --nnodes 2 train.py\n")
        batch = batchscript.load(str(script))
        plan = Plan(nodes=("n01",), remote=True, batch=batch, command=tuple(batch.main.command.argv))
        [row] = [r for r in run("PKG008", state, plan=plan)
                 if r.evidence.get("defect") == "nccl-2.19-cumem-alltoall-deadlock"]
        assert row.status == expected, (export, row.message)


def test_one_requirement_repeated_in_several_extras_is_one_warning_naming_them(tmp_path, monkeypatch):
    dists = {"transformers": "5.24.0", "accelerate": "1.0.1", "torch": "2.9.0", "deepspeed": "0.19.8"}
    requires = {"transformers": ['accelerate>=1.1.0; extra == "torch"', 'accelerate>=1.1.0; extra == "accelerate"',
                                 'accelerate>=1.1.0; extra == "deepspeed"']}  # as transformers 5 declares it
    found = run("PKG008", node_state(collected(stage(tmp_path, dists, requires), monkeypatch)))
    [unmet] = [r for r in found if r.status == Status.WARN and "requires" in r.message]
    assert "accelerate>=1.1.0 with its [torch], [accelerate], [deepspeed] extras" in unmet.message
    assert unmet.evidence["extras"] == ["torch", "accelerate", "deepspeed"]
