"""PKG008 over the known-defects table with the real releases: each row's affected, fixed and clean releases
staged with their own METADATA (Requires-Dist lines, markers and extras as published; fetched once by
scripts/fetch_defect_metadata.py into tests/fixtures/known_defects/releases.json), read by the real collector,
and the job's conditions staged on, off and unknown through the configs and node facts PKG008 reads. And the
healthy stacks of the last year: every release of torch, DeepSpeed, accelerate, transformers, peft and trl of
the year before the fetch, with the newest of the others, under a job that meets no row's condition."""
import copy
import json
import re
import sys
from pathlib import Path

import pytest

from node_facts import BASE, NODES, run
from preflight.inputs.configs import load_accelerate_config, load_deepspeed_config
from preflight.inputs.models import Inputs, Model
from preflight.inputs.versions import CONDITIONS, known_defects, meets, within
from preflight.node import packages
from preflight.plan import Plan
from preflight.result import Status

RELEASES = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "known_defects" / "releases.json")
                      .read_text())
META = RELEASES["metadata"]
ROWS = known_defects()
DISTRIBUTION = {"torch": "torch", "nccl": "nvidia-nccl-cu12", "deepspeed": "deepspeed", "accelerate": "accelerate",
                "transformers": "transformers", "peft": "peft", "trl": "trl", "flash-attn": "flash-attn",
                "bitsandbytes": "bitsandbytes"}
DEEPSPEED_CONDITIONS = ("precision", "zero_stage", "offload_optimizer", "offload_param", "gradient_clipping",
                        "optimizer")
NODE_CONDITIONS = ("machine", "container", "sys_nice", "deepspeed_env", "net_plugin")
# Values a row's list of choices may leave out, for the conditions whose choices are open (CONDITIONS: str).
OTHER_VALUES = {"optimizer": ("lamb", "adamw"), "machine": ("x86_64", "aarch64"), "net_plugin": (),
                "rdzv_backend": ("static", "c10d")}
# A job that meets no row's condition: fp32 DeepSpeed at stage 0 with LAMB and no clipping, started by torchrun
# (static rendezvous), a dense model, on x86_64 outside a container, one .deepspeed_env, no net plugin.
NONE_MET = {"precision": "fp32", "zero_stage": 0, "offload_optimizer": False, "offload_param": False,
            "gradient_clipping": False, "optimizer": "lamb", "launcher": "torchrun", "rdzv_backend": "static",
            "moe": False,
            "machine": "x86_64", "container": False, "sys_nice": True, "deepspeed_env": "one", "net_plugin": ()}


# --- staging ---------------------------------------------------------------------------------------------

def stage_released(folder, dists):
    """Installed distributions as published: a .dist-info per (name, version) with the release's own METADATA
    (an NCCL release that never reached PyPI, with none: the nvidia-nccl wheels declare no requirements)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, version in dists.items():
        assert version in META.get(name, {}) or name == "nvidia-nccl-cu12", \
            f"{name} {version}: not in the fixture (scripts/fetch_defect_metadata.py)"
        meta = META.get(name, {}).get(version, {"requires_dist": []})
        info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        lines += [f"Requires-Python: {meta['requires_python']}"] if meta.get("requires_python") else []
        lines += [f"Requires-Dist: {r}" for r in meta["requires_dist"]]
        (info / "METADATA").write_text("\n".join(lines) + "\n\nThe description.\n")
    return folder


def nccl_pin(torch):
    """The nvidia-nccl wheel and version a torch release's metadata pins on Linux, or None."""
    for line in META["torch"][torch]["requires_dist"]:
        found = re.match(r"(nvidia-nccl-cu\d+)\s*==\s*([\d.]+)", line)
        if found:
            return found.groups()
    return None


def torch_pinning(nccl):
    """A torch release of the fixture whose metadata pins NCCL release NCCL, else the newest torch."""
    pinning = [t for t in META["torch"] if nccl_pin(t) == ("nvidia-nccl-cu12", nccl)]
    return pinning[0] if pinning else RELEASES["newest"]["torch"]


def inside(spec):
    """A version inside SPEC for what PyPI does not hold (the driver, torch's CUDA build, Python)."""
    for candidate in ("3.12.3", "3.11.9", "3.10.14", "13.0", "12.8", "12.6", "12.4", "12.2", "580.65.06",
                      "570.133.20", "550.54.15", "535.104.05", "2.2.1"):
        if within(candidate, spec):
            return candidate
    raise AssertionError(f"no version found inside {spec}")


def inside_nccl(spec):
    found = [f"2.{minor}.{patch}" for minor in range(14, 33) for patch in range(1, 10) if within(f"2.{minor}.{patch}", spec)]
    assert found, spec
    return found[-1]


def releases_of(row, which):
    """(the versions each package of the row stands at, the distributions to stage) for WHICH release of the
    row's package: "affected", "fixed" or "clean", the row's pairs inside their ranges."""
    picks = RELEASES["rows"][row.id]
    wanted = {row.package: picks[which] if row.package in DISTRIBUTION else inside(row.affected)}
    if row.package == "nccl" and which == "affected" and not picks[which]:
        wanted["nccl"] = inside_nccl(row.affected)  # a release NVIDIA shipped in its containers, not on PyPI
    for package, spec in row.with_:
        wanted[package] = picks["with"].get(package) if package in DISTRIBUTION else inside(spec)
    assert all(wanted.values()), f"{row.id}: no release for {which} in the fixture: {picks}"
    dists = {DISTRIBUTION[p]: v for p, v in wanted.items() if p in DISTRIBUTION}
    if "nvidia-nccl-cu12" in dists and "torch" not in dists:
        dists["torch"] = torch_pinning(dists["nvidia-nccl-cu12"])
    return wanted, dists


def condition_value(name, wanted, met):
    """A value of condition NAME that meets the row's WANTED (met) or does not."""
    if isinstance(wanted, bool):
        return wanted if met else not wanted
    if met:
        return wanted[0]
    if name == "net_plugin":
        return ()
    choices = CONDITIONS[name]
    # None where every choice is the row's: fsdp_version [1, 2] is off for a job without FSDP
    return next((c for c in (choices if isinstance(choices, tuple) else OTHER_VALUES[name]) if c not in wanted), None)


def plan_for(tmp_path, job):
    """The plan whose configs and launch give the job's conditions in JOB (absent ones stay unknown)."""
    plan = {"nodes": NODES, "remote": True}
    if any(name in job for name in DEEPSPEED_CONDITIONS) and "fsdp_version" not in job:
        stage = job.get("zero_stage", 3 if job.get("offload_param") else 2)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
        for block in ("offload_optimizer", "offload_param"):
            config["zero_optimization"][block] = {"device": "cpu" if job.get(block) else "none"}
        if job.get("precision") in ("fp16", "bf16"):
            config[job["precision"]] = {"enabled": True}
        config["gradient_clipping"] = 1.0 if job.get("gradient_clipping") else 0.0
        if job.get("optimizer"):
            config["optimizer"] = {"type": job["optimizer"], "params": {"lr": 1e-4}}
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(config))
        plan["deepspeed"] = load_deepspeed_config(str(path))
    if "fsdp_version" in job:
        path = tmp_path / "accelerate.yaml"
        precision = {"fp32": "no"}.get(job.get("precision"), job.get("precision", "no"))
        path.write_text(f"distributed_type: {'FSDP' if job['fsdp_version'] else 'MULTI_GPU'}\n"
                        f"mixed_precision: {precision}\nnum_machines: 2\nnum_processes: 16\n"
                        f"fsdp_config:\n  fsdp_version: {job['fsdp_version'] or 1}\n")
        plan["accelerate"] = load_accelerate_config(str(path))
    if "deepspeed_multinode_launcher" in job:
        path = tmp_path / "accelerate.yaml"
        path.write_text("distributed_type: DEEPSPEED\nnum_machines: 2\nnum_processes: 16\nmain_process_ip: 10.0.0.1\n"
                        f"deepspeed_config:\n  zero_stage: 2\n  deepspeed_multinode_launcher: "
                        f"{job['deepspeed_multinode_launcher'] or 'standard'}\n")
        plan["accelerate"] = load_accelerate_config(str(path))
    if "launcher" in job or "rdzv_backend" in job:
        plan["command"] = (job.get("launcher", "torchrun"),) + ((f"--rdzv_backend={job['rdzv_backend']}",)
                                                                if job.get("rdzv_backend") else ()) + ("train.py",)
    if "moe" in job:
        plan["memory"] = Inputs(model=Model(7 * 10 ** 9, 10 ** 8, "config.json", "from the config",
                                            experts=8 if job["moe"] else 1))
    return Plan(**plan)


def node_state(tmp_path, monkeypatch, dists, row=None, job=(), env=None):
    """One node with DISTS installed as released, the row's driver and Python, and the node's side of JOB."""
    monkeypatch.setattr(sys, "path", [str(stage_released(tmp_path / "site", dists))] + sys.path)
    doc = copy.deepcopy(BASE)
    doc["packages"] = packages.facts()
    doc["env"] = dict(row.env if row else {}, **(env or {}))
    wanted = dict(row.with_) if row else {}
    doc["gpus"] = {"available": True, "driver_version": inside(wanted["nvidia-driver"]) if "nvidia-driver" in wanted
                   else "580.65.06", "cuda_driver_version": inside(wanted["cuda-driver"]) if "cuda-driver" in wanted
                   else "13.0"}
    if row is not None and row.python:
        doc["python"]["version"] = inside(row.python)
    job = dict(job)
    for name in ("machine", "container", "sys_nice"):
        if name in job:
            doc["host"][name] = job[name] if name != "container" else ("/.dockerenv" if job[name] else None)
        else:
            doc["host"].pop(name, None)
    doc["job"] = {"deepspeed_env": {"both": ["/root/.deepspeed_env", "/job/.deepspeed_env"], "one": ["/job/.deepspeed_env"],
                                    "none": []}[job["deepspeed_env"]]} if "deepspeed_env" in job else None
    if "net_plugin" in job:
        plugins = [{"name": "libnccl-net-ofi.so", "bytes": 1 << 20}] if job["net_plugin"] else []
        doc["fabric"] = {"nccl": {"plugins": plugins, "libraries": []}}
    else:
        doc["fabric"] = {"error": "not collected in this test"}
    return {"n01": {"facts": doc, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}}


def row_job(row, met=True, flip=None):
    """Each of the row's job conditions met (code aside), but FLIP, which is not."""
    return {name: condition_value(name, wanted, met and name != flip) for name, wanted in row.when if name != "code"}


def judged(tmp_path, monkeypatch, row, which="affected", job=None, env=None):
    job = row_job(row) if job is None else job
    _, dists = releases_of(row, which)
    state = node_state(tmp_path, monkeypatch, dists, row, job, env)
    return run("PKG008", state, plan=plan_for(tmp_path, job))


def named(results):
    return {r.evidence.get("defect") for r in results if r.status in (Status.WARN, Status.FAIL)}


def not_judged(results):
    return {d: r.message for r in results if r.status == Status.SKIP for d in r.evidence.get("defects", ())}


def has_code(row):
    return any(name == "code" for name, _ in row.when)


# --- each row, as released -------------------------------------------------------------------------------

@pytest.mark.parametrize("row", [r for r in ROWS if not has_code(r)], ids=lambda r: r.id)
def test_each_row_is_named_where_the_job_meets_it(tmp_path, monkeypatch, row):
    found = judged(tmp_path, monkeypatch, row)
    [result] = [r for r in found if r.evidence.get("defect") == row.id]
    assert result.status == (Status.FAIL if row.status == "fail" else Status.WARN)
    assert row.source in result.message and row.symptom in result.message
    assert (row.fixed or row.fix) in result.remediation
    assert set(result.evidence["conditions"]) == {name for name, _ in row.when}


@pytest.mark.parametrize("row", [r for r in ROWS if has_code(r)], ids=lambda r: r.id)
def test_a_row_the_training_code_decides_is_not_judged_and_says_what_it_needs(tmp_path, monkeypatch, row):
    found = judged(tmp_path, monkeypatch, row)
    code = dict(row.when)["code"]
    assert row.id not in named(found)
    assert f"only the training code tells whether it {code}" in not_judged(found)[row.id]


CONDITIONAL = [(row, name) for row in ROWS for name, _ in row.when if name != "code"]


@pytest.mark.parametrize("row,name", CONDITIONAL, ids=lambda x: getattr(x, "id", x))
def test_a_condition_the_job_does_not_meet_silences_the_row(tmp_path, monkeypatch, row, name):
    found = judged(tmp_path, monkeypatch, row, job=row_job(row, flip=name))
    assert row.id not in named(found) and row.id not in not_judged(found), [r.message for r in found]


@pytest.mark.parametrize("row", [r for r in ROWS if any(n != "code" for n, _ in r.when)], ids=lambda r: r.id)
def test_a_condition_nothing_tells_is_said_as_not_judged_with_the_missing_fact(tmp_path, monkeypatch, row):
    found = judged(tmp_path, monkeypatch, row, job={})
    assert row.id not in named(found)
    reason = not_judged(found)[row.id]
    assert "not known" in reason or "did not report" in reason, reason


@pytest.mark.parametrize("row", [r for r in ROWS if RELEASES["rows"][r.id]["fixed"] and r.package in DISTRIBUTION],
                         ids=lambda r: r.id)
def test_each_row_stays_quiet_with_its_fixed_release(tmp_path, monkeypatch, row):
    found = judged(tmp_path, monkeypatch, row, which="fixed")
    assert row.id not in named(found) and row.id not in not_judged(found), [r.message for r in found]


@pytest.mark.parametrize("row", [r for r in ROWS if RELEASES["rows"][r.id]["clean"] and r.package in DISTRIBUTION],
                         ids=lambda r: r.id)
def test_each_row_stays_quiet_with_the_release_before_its_range(tmp_path, monkeypatch, row):
    found = judged(tmp_path, monkeypatch, row, which="clean")
    assert row.id not in named(found) and row.id not in not_judged(found), [r.message for r in found]


@pytest.mark.parametrize("row", [r for r in ROWS if r.workaround and not has_code(r)], ids=lambda r: r.id)
def test_a_row_with_its_workaround_set_is_a_pass_note(tmp_path, monkeypatch, row):
    found = judged(tmp_path, monkeypatch, row, env=dict(row.workaround))
    assert row.id not in named(found)
    [note] = [r for r in found if r.evidence.get("defect") == row.id]
    assert note.status == Status.PASS and "worked around" in note.message


def test_every_row_has_an_affected_release_in_the_fixture():
    missing = [r.id for r in ROWS if r.package in DISTRIBUTION and not RELEASES["rows"].get(r.id, {}).get("affected")]
    # NCCL 2.20.3 shipped in NVIDIA's containers only: PyPI's nvidia-nccl-cu12 went from 2.19.3 to 2.20.5
    assert missing == ["nccl-2.20.3-commsplit-uds"], \
        f"rows without a real affected release (run scripts/fetch_defect_metadata.py): {missing}"


def test_the_job_that_meets_nothing_meets_no_rows_condition():
    values = dict(NONE_MET, fsdp_version=None, deepspeed_multinode_launcher=None)  # DeepSpeed's JSON, torchrun
    for row in ROWS:
        asked = [(name, wanted) for name, wanted in row.when if name != "code"]
        if asked:
            assert any(not meets(values[name], wanted) for name, wanted in asked), row.id


# --- the healthy stacks of the last year -----------------------------------------------------------------

def stack(dist, version):
    """DIST at VERSION with the newest release of each other library and the NCCL its torch pins."""
    dists = {d: v for d, v in RELEASES["newest"].items() if d in ("torch", "deepspeed", "accelerate",
                                                                   "transformers", "peft", "trl")}
    dists[dist] = version
    pin = nccl_pin(dists["torch"])
    if pin and pin[1] in META.get(pin[0], {}):
        dists[pin[0]] = pin[1]
    return dists


RECENT = [(d, v) for d, versions in sorted(RELEASES["recent"].items()) for v in versions]


def test_the_last_year_holds_releases_of_each_library():
    assert {d for d, _ in RECENT} == {"torch", "deepspeed", "accelerate", "transformers", "peft", "trl"}
    assert len(RECENT) >= 30


@pytest.mark.parametrize("dist,version", RECENT, ids=lambda x: str(x))
def test_a_healthy_stack_of_the_last_year_raises_only_what_its_versions_alone_carry(tmp_path, monkeypatch, dist,
                                                                                      version):
    state = node_state(tmp_path, monkeypatch, stack(dist, version), job=NONE_MET)
    found = run("PKG008", state, plan=plan_for(tmp_path, NONE_MET))
    assert found and not [r for r in found if r.status == Status.ERROR], [r.message for r in found]
    assert state["n01"]["facts"]["packages"]["distributions"][dist] == version
    by_id = {r.id: r for r in ROWS}
    for result in found:
        if result.status in (Status.WARN, Status.FAIL) and result.evidence.get("defect"):
            row = by_id[result.evidence["defect"]]
            assert not row.when and not row.env, f"{row.id} fires on a job that does not meet {row.shown()}"
