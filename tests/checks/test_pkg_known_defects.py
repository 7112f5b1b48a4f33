"""PKG008 over the known-defects table: every row seen on a node staged with its affected versions (fake .dist-info
metadata first on the path, read by the real collector) and not seen with its fixed release; versions compared as
pip compares them; rows that need NVML skipped with the reason; the requirements the installed libraries declare;
the table's own validation; and one row end to end on the real test cluster."""
import copy
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check
from node_facts import BASE, run
from preflight.inputs import versions
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


# --- every row -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_each_row_is_named_on_a_node_with_its_affected_versions(tmp_path, monkeypatch, row):
    found = run("PKG008", staged_node(tmp_path, monkeypatch, row, inside(row.affected)))
    [result] = [r for r in found if r.evidence.get("defect") == row.id]
    assert result.status == (Status.FAIL if row.status == "fail" else Status.WARN)
    assert row.source in result.message and row.symptom in result.message
    assert (row.fixed or row.fix) in result.remediation


@pytest.mark.parametrize("row", [r for r in ROWS if r.fixed], ids=lambda r: r.id)
def test_each_row_stays_clean_with_its_fixed_release(tmp_path, monkeypatch, row):
    found = run("PKG008", staged_node(tmp_path, monkeypatch, row, row.fixed))
    assert row.id not in flagged(found), [r.message for r in found]


@pytest.mark.parametrize("row", [r for r in ROWS if r.with_ and not r.fixed], ids=lambda r: r.id)
def test_a_pair_stays_clean_when_the_other_side_is_outside_its_range(tmp_path, monkeypatch, row):
    (other, spec), = row.with_
    outside = next(v for v in ("2.2.2", "2.4.0", "1.0.0", "0.1.0") if not within(v, spec))
    state = staged_node(tmp_path, monkeypatch, row, inside(row.affected))
    state["n01"]["facts"]["packages"]["versions"][other] = outside
    assert row.id not in flagged(run("PKG008", state))


@pytest.mark.parametrize("row", [r for r in ROWS if r.workaround], ids=lambda r: r.id)
def test_a_row_with_its_workaround_in_place_is_not_reported(tmp_path, monkeypatch, row):
    state = staged_node(tmp_path, monkeypatch, row, inside(row.affected))
    state["n01"]["facts"]["env"].update(row.workaround)
    assert row.id not in flagged(run("PKG008", state))


def test_a_worked_around_row_is_said_in_the_pass(tmp_path, monkeypatch):
    row = next(r for r in ROWS if r.id == "torch-2.7.0-nonblocking-hang")
    state = staged_node(tmp_path, monkeypatch, row, "2.7.0+cu126")
    state["n01"]["facts"]["env"]["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "0"
    [ok] = run("PKG008", state)
    assert ok.status == Status.PASS and "worked around: torch-2.7.0-nonblocking-hang" in ok.message


def test_the_table_has_thirty_sourced_rows():
    assert len(ROWS) >= 30
    for row in ROWS:
        assert row.source.startswith("https://"), row.id
        assert row.confirmed.split(" (")[0] in ("maintainer comment", "release notes") or \
            row.confirmed.startswith("merged PR"), row.id
        assert row.fixed or row.fix, f"{row.id}: says neither the release to move to nor what else to do"


# --- healthy nodes ---------------------------------------------------------------------------------------

def test_this_projects_environment_raises_nothing():
    found = run("PKG008")
    assert {r.status for r in found} == {Status.PASS}, [r.message for r in found]
    assert "none of" in found[0].message and "known defects applies" in found[0].message


def test_the_fixed_releases_together_raise_nothing(tmp_path, monkeypatch):
    dists = {"torch": "2.7.1+cu126", "nvidia-nccl-cu12": "2.26.5", "deepspeed": "0.19.2", "accelerate": "1.10.1",
             "transformers": "4.56.2", "peft": "0.16.0", "flash-attn": "2.8.3"}
    facts = collected(stage(tmp_path, dists, {"torch": ['nvidia-nccl-cu12==2.26.5; platform_system == "Linux"']}),
                      monkeypatch)
    gpus = {"available": True, "driver_version": "570.133.20", "cuda_driver_version": "12.8"}
    found = run("PKG008", node_state(facts, gpus=gpus))
    assert {r.status for r in found} == {Status.PASS}, [r.message for r in found]


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
    row = next(r for r in ROWS if r.id == "torch-2.7.0-nonblocking-hang")
    ngc = staged_node(tmp_path / "a", monkeypatch, row, "2.7.0a0+79aa17489c.nv25.04")
    assert row.id not in flagged(run("PKG008", ngc))
    assert row.id in flagged(run("PKG008", staged_node(tmp_path / "b", monkeypatch, row, "2.7.0+cu128")))


# --- what the node did not report -------------------------------------------------------------------------

def test_a_row_that_needs_nvml_is_skipped_with_the_reason_on_a_node_without_it(tmp_path, monkeypatch):
    row = next(r for r in ROWS if any(p in versions.FROM_NVML for p, _ in r.with_))
    state = staged_node(tmp_path, monkeypatch, row, inside(row.affected))
    state["n01"]["facts"]["gpus"] = {"available": False, "reason": "libnvidia-ml.so.1 not found"}
    found = run("PKG008", state)
    [skipped] = [r for r in found if r.status == Status.SKIP]
    assert row.id in skipped.message and "NVML" in skipped.message
    assert row.id not in flagged(found)


def test_the_nccl_judged_is_the_wheel_torch_depends_on_and_a_preloaded_one_is_said(tmp_path, monkeypatch):
    dists = {"torch": "2.10.0", "nvidia-nccl-cu12": "2.29.2", "nvidia-nccl-cu13": "2.28.9"}
    facts = collected(stage(tmp_path, dists, {"torch": ['nvidia-nccl-cu12==2.29.2; platform_system == "Linux"']}),
                      monkeypatch)
    assert facts["versions"]["nccl"] == "2.28.9"  # PKG001's NCCL: the first wheel found
    state = node_state(facts, env={"LD_PRELOAD": "/opt/nccl/lib/libnccl.so.2"})
    [hang] = [r for r in run("PKG008", state) if r.evidence.get("defect") == "nccl-2.29.2-hang"]
    assert "nvidia-nccl-cu12, the wheel torch depends on" in hang.message
    assert "LD_PRELOAD loads /opt/nccl/lib/libnccl.so.2" in hang.message
    assert "torch loads its own" not in hang.message
    bundled = "/env/lib/python3.11/site-packages/torch/lib/libnccl.so.2"
    state["n01"]["facts"]["fabric"] = {"nccl": {"libraries": [bundled]}}
    [hang] = [r for r in run("PKG008", state) if r.evidence.get("defect") == "nccl-2.29.2-hang"]
    assert f"torch loads its own {bundled} first" in hang.message


# --- what the installed libraries declare -----------------------------------------------------------------

def test_a_declared_minimum_the_node_does_not_meet_fails(tmp_path, monkeypatch):
    dists = {"transformers": "5.24.0", "accelerate": "1.0.1"}
    requires = {"transformers": ['accelerate>=1.1.0; extra == "torch"', 'deepspeed>=0.9.3; extra == "deepspeed"']}
    found = run("PKG008", node_state(collected(stage(tmp_path, dists, requires), monkeypatch)))
    [unmet] = [r for r in found if r.status == Status.FAIL]
    assert "transformers 5.24.0 requires accelerate>=1.1.0" in unmet.message and "accelerate 1.0.1" in unmet.message


def test_declared_requirements_that_are_met_or_belong_to_other_extras_raise_nothing(tmp_path, monkeypatch):
    dists = {"transformers": "5.24.0", "accelerate": "1.1.0", "peft": "0.10.0"}
    requires = {"transformers": ['accelerate>=1.1.0; extra == "torch"', 'peft>=0.18.0; extra == "peft"'],
                "accelerate": ["torch>=2.0.0"]}
    found = run("PKG008", node_state(collected(stage(tmp_path, dists, requires), monkeypatch)))
    assert {r.status for r in found} == {Status.PASS}, [r.message for r in found]


# --- the collector ----------------------------------------------------------------------------------------

def test_the_nccl_version_comes_from_the_first_wheel_that_has_one(tmp_path, monkeypatch):
    first = stage(tmp_path / "first", {"nvidia-nccl-cu13": None, "nvidia-nccl-cu12": None})
    second = stage(tmp_path / "second", {"nvidia-nccl-cu12": "2.27.5"})
    monkeypatch.setattr(sys, "path", [str(first), str(second)] + sys.path)
    assert packages.facts()["versions"]["nccl"] == "2.27.5"


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
def test_a_known_bad_peft_on_one_node_is_named_there(cluster):
    with cluster.shadowed_package("node03", "peft", "0.15.0"):
        doc, _ = check(cluster, "--only", "PKG008")
    found = [r for r in doc["results"] if r["id"] == "PKG008"]
    named = {r["evidence"]["defect"] for r in found if r["nodes"] == ["node03"] and r["status"] == "warn"}
    assert named == {"peft-0.15.0-zero3-modules-to-save", "peft-trainable-tokens-zero3"}
    assert all(r["status"] == "pass" for r in found if "node03" not in r["nodes"])
    assert "node01" in [n for r in found if r["status"] == "pass" for n in r["nodes"]]
