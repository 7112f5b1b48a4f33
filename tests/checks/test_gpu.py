"""GPU facts and checks over recorded NVML answers: a fake adapter built from a recording
(tests/fixtures/nvml) stands where gpus.Nvml stands; the collector's _gpus, the JSON trip from
the node, the checks, the runner and the CLI run for real. GPU008 (Xid errors) over recorded kernel logs
(tests/fixtures/sysfs)."""
import copy
import ctypes.util
import json
import os
import subprocess
import sys
import types
from unittest import mock

import pynvml
import pytest
import yaml

import sysfs_tree
from conftest import run_cli
from fabric_nodes import recorded_nodes, run_on, statuses_by_nodes
from nvml_fake import FIXTURES, Recorder, fake, load
from preflight import registry, runner
from preflight.node import collector, fabric, gpus
from preflight.plan import build_plan
from preflight.remote import shipping
from preflight.result import Status
from sysfs_tree import lay_out, fabric_facts

NODES = ("n01", "n02")
BASE = collector.collect({"head": "127.0.0.1", "port": 29500, "paths": {}})
SPECS = {c.id: c for c in registry.load().checks}
H100 = "NVIDIA H100 80GB HBM3"


def gpu_facts(recording):
    """The gpus fact as a node sends it: built by the collector from the recording, through JSON."""
    with mock.patch.object(gpus, "Nvml", fake(recording)):
        return json.loads(json.dumps(gpus.facts()))


def node(recording, env=None, change=None):
    doc = copy.deepcopy(BASE)
    doc["env"] = dict({k: v for k, v in doc["env"].items() if k != "CUDA_VISIBLE_DEVICES"}, **(env or {}))
    doc["gpus"] = gpu_facts(recording)
    if change:
        change(doc["gpus"])
    return {"facts": doc, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}


def plan(tmp_path, nodes=NODES, deepspeed=None, **accelerate):
    """A real plan from an accelerate config (8 processes per node, MULTI_GPU, unless told otherwise)."""
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "machine_rank": 0,
              "num_machines": len(nodes), "num_processes": 8 * len(nodes), "main_process_ip": "10.0.0.1",
              "main_process_port": 29500, "mixed_precision": "no"}
    config.update(accelerate)
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in config.items() if v is not None}))
    ds_path = None
    if deepspeed is not None:
        ds_path = tmp_path / "ds_config.json"
        ds_path.write_text(json.dumps(deepspeed))
    return build_plan(config=str(path), deepspeed=str(ds_path) if ds_path else None, nodes=nodes)


def run(check_id, the_plan, states):
    return runner.run_check(SPECS[check_id], runner.CheckContext(the_plan, states, {}))


def on(results, name):
    return [r for r in results if name in r.nodes]


def statuses(results, name="n01"):
    return sorted(r.status.value for r in on(results, name))


# --- the facts ----------------------------------------------------------------------------------

def test_the_real_adapter_on_this_machine_never_raises():
    facts = gpus.facts()
    if ctypes.util.find_library("nvidia-ml") or os.path.exists("/proc/driver/nvidia/version"):
        assert facts["available"] is True and facts["count"] == len(facts["devices"]) > 0
    else:  # no driver here: the fact says so
        assert facts["available"] is False and "LibraryNotFound" in facts["reason"], facts
    assert BASE["gpus"] == json.loads(json.dumps(facts)) and BASE["memory"]["total_bytes"] > 0


def test_the_shipped_collector_runs_without_pynvml(tmp_path):
    """The node's interpreter may lack nvidia-ml-py: the collector, stdlib only, says so and goes on."""
    python = tmp_path / "python"  # the training interpreter, with pynvml made unimportable; "$@" is -u -c BOOTSTRAP
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import sys; sys.modules['pynvml'] = None; "
                      "exec(sys.argv[1])\" \"$3\"\n")
    python.chmod(0o755)
    proc = subprocess.run(["sh", "-c", shipping.shipped_command(str(python))], capture_output=True, text=True,
                          input=shipping.shipped_input(shipping.AGENT, {}) + "done\n", timeout=60)
    facts = json.loads(proc.stdout.splitlines()[0])
    assert facts["gpus"]["available"] is False and "install nvidia-ml-py" in facts["gpus"]["reason"]
    assert facts["python"]["executable"] == sys.executable and "error" not in facts["memory"]


def test_collect_asks_the_adapter_class(monkeypatch):
    monkeypatch.setattr(gpus, "Nvml", fake("v100.json"))
    facts = collector.collect({})
    assert facts["gpus"]["count"] == 4 and facts["gpus"]["devices"][3]["name"] == "Tesla V100-PCIE-32GB"


def test_recordings_answer_exactly_the_adapters_methods():
    methods = {m for m in vars(gpus.Nvml) if not m.startswith("_")} - {"close"}
    system = {"driver_version", "cuda_driver_version", "count"}
    for path in FIXTURES.glob("*.json"):
        record = load(path.name)
        if "init_error" in record:
            continue
        assert system <= set(record), path.name
        for gpu in record["gpus"]:
            if "nvml_error" not in gpu:
                assert set(gpu) == methods - system, (path.name, set(gpu) ^ (methods - system))


@pytest.mark.parametrize("recording,count,name,memory,cc", [
    ("h100x8.json", 8, H100, 85520809984, [9, 0]),
    ("a100x8.json", 8, "NVIDIA A100-SXM4-80GB", 85899345920, [8, 0]),
    ("v100.json", 4, "Tesla V100-PCIE-32GB", 34057748480, [7, 0]),
])
def test_the_gpus_fact_from_recordings(recording, count, name, memory, cc):
    facts = gpu_facts(recording)
    assert facts["available"] is True and facts["count"] == count == len(facts["devices"])
    gpu = facts["devices"][-1]
    assert (gpu["index"], gpu["name"], gpu["memory_total_bytes"], gpu["compute_capability"]) == (count - 1, name,
                                                                                                  memory, cc)
    assert gpu["uuid"].startswith("GPU-") and gpu["pci_bus_id"].startswith("00000000:")
    assert gpu["ecc_enabled"] is True and gpu["ecc_uncorrected_volatile"] == 0 and "errors" not in gpu
    assert gpu["clock_event_reasons"] == ["gpu_idle"] and gpu["compute_mode"] == "default" and gpu["processes"] == []


@pytest.mark.parametrize("recording", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_every_recording_goes_through_every_gpu_check(tmp_path, recording):
    """Recordings made on real GPUs (scripts/device_gpu_check.sh) are replayed here as they are added."""
    the_plan = plan(tmp_path, mixed_precision="bf16")
    states = {"n01": node(recording), "n02": node(recording)}
    for check_id in ("GPU001", "GPU002", "GPU003", "GPU004", "GPU005", "GPU006", "GPU009"):
        results = run(check_id, the_plan, states)
        assert results and not [r.message for r in results if r.status == Status.ERROR], (check_id, recording)


def test_an_unsupported_call_leaves_its_field_none():
    h100, v100 = gpu_facts("h100x8.json"), gpu_facts("v100.json")
    assert h100["driver_version"] == "550.54.15" and h100["cuda_driver_version"] == "12.4"
    assert v100["cuda_driver_version"] == "11.4"
    hopper, volta = h100["devices"][0], v100["devices"][0]
    assert hopper["retired_pages_double_bit"] is None and hopper["remapped_rows_pending"] is False
    assert hopper["nvlink_active"] == [True] * 18 and hopper["mig_enabled"] is False
    assert volta["retired_pages_double_bit"] == 0 and volta["remapped_rows_pending"] is None
    assert volta["nvlink_active"] is None and volta["mig_enabled"] is None and volta["persistence_mode"] is False


def test_a_lost_gpu_is_recorded_and_the_others_kept():
    facts = gpu_facts("gpu-lost.json")
    lost, fine = facts["devices"][5], facts["devices"][4]
    assert lost["name"] is None and "GpuIsLost" in lost["errors"]["name"]
    assert "ecc_uncorrected volatile" in lost["errors"]
    assert fine["name"] == H100 and "errors" not in fine


def test_no_driver_says_why():
    facts = gpu_facts("no-driver.json")
    assert facts == {"available": False, "reason": facts["reason"]} and "LibraryNotFound" in facts["reason"]


def test_the_real_adapter_maps_nvml_answers():
    """The real adapter's own logic over pynvml's real error classes (a stand-in for the NVML library,
    which this machine lacks): NotSupported, a function the driver lacks, the NVLink link count."""
    def raises(error):
        def call(*args):
            raise error()
        return call

    def link_state(handle, link):
        if link >= 18:
            raise pynvml.NVMLError_InvalidArgument()
        return int(link != 7)

    nv = types.SimpleNamespace(
        NVMLError_FunctionNotFound=pynvml.NVMLError_FunctionNotFound,
        NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
        NVMLError_InvalidArgument=pynvml.NVMLError_InvalidArgument, NVML_NVLINK_MAX_LINKS=36,
        nvmlDeviceGetHandleByIndex=lambda i: "handle%d" % i, nvmlDeviceGetNvLinkState=link_state,
        nvmlDeviceGetMigMode=raises(pynvml.NVMLError_NotSupported),
        nvmlDeviceGetComputeRunningProcesses_v3=raises(pynvml.NVMLError_FunctionNotFound),
        nvmlDeviceGetComputeRunningProcesses_v2=lambda h: [types.SimpleNamespace(pid=7, usedGpuMemory=2**30)],
        nvmlDeviceGetCurrentClocksEventReasons=raises(pynvml.NVMLError_FunctionNotFound),
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x41,
        nvmlDeviceGetName=lambda h: b"Tesla V100-PCIE-32GB")
    adapter = gpus.Nvml.__new__(gpus.Nvml)
    adapter.nv, adapter.handles = nv, {}
    with pytest.raises(gpus.NvmlUnsupported):
        adapter.mig_mode(0)
    with pytest.raises(gpus.NvmlUnsupported):
        adapter.persistence_mode(0)  # a function this pynvml does not have
    assert adapter.processes(0, "compute") == [[7, 2**30]]
    assert adapter.nvlink_states(0) == [True] * 7 + [False] + [True] * 10
    assert adapter.clock_event_reasons(0) == 0x41 and adapter.name(0) == "Tesla V100-PCIE-32GB"


def test_the_real_adapter_reads_the_gpu_fabric_with_pynvmls_own_structures():
    """nvmlDeviceGetGpuFabricInfoV fills pynvml's c_nvmlGpuFabricInfoV_t (its health mask, the cluster UUID); a driver
    without it falls back to the first version, and a GPU before Hopper (NotSupported) has no fabric to tell of."""
    def fill(cluster=bytes(16), **fields):
        def call(handle, ref):
            for name, value in fields.items():
                setattr(ref._obj, name, value)
            ctypes.memmove(ctypes.addressof(ref._obj) + type(ref._obj).clusterUuid.offset, cluster, 16)
        return call

    def raises(error):
        def call(*args):
            raise error()
        return call

    base = dict(NVMLError=pynvml.NVMLError, NVMLError_GpuIsLost=pynvml.NVMLError_GpuIsLost,
                NVMLError_FunctionNotFound=pynvml.NVMLError_FunctionNotFound,
                NVMLError_NotSupported=pynvml.NVMLError_NotSupported, nvmlDeviceGetHandleByIndex=lambda i: i,
                c_nvmlGpuFabricInfoV_t=pynvml.c_nvmlGpuFabricInfoV_t,
                c_nvmlGpuFabricInfo_t=pynvml.c_nvmlGpuFabricInfo_t)
    rack = bytes.fromhex("009b7c3e1a4f2d4c8e9a612b5d7e0f1c")  # a leading zero byte: c_char would give b""
    cases = [(dict(nvmlDeviceGetGpuFabricInfoV=fill(rack, state=3, status=0, cliqueId=5, healthMask=0x11)),
              [3, 0, 5, 0x11, "009b7c3e-1a4f-2d4c-8e9a-612b5d7e0f1c"]),
             (dict(nvmlDeviceGetGpuFabricInfoV=raises(pynvml.NVMLError_FunctionNotFound),
                   nvmlDeviceGetGpuFabricInfo=fill(state=2, status=0, cliqueId=0)),
              [2, 0, 0, None, "00000000-0000-0000-0000-000000000000"])]
    for calls, answer in cases:
        adapter = gpus.Nvml.__new__(gpus.Nvml)
        adapter.nv, adapter.handles = types.SimpleNamespace(**base, **calls), {}
        assert adapter.fabric(0) == answer
    adapter.nv = types.SimpleNamespace(**base, nvmlDeviceGetGpuFabricInfoV=raises(pynvml.NVMLError_NotSupported),
                                       nvmlDeviceGetGpuFabricInfo=raises(pynvml.NVMLError_NotSupported))
    with pytest.raises(gpus.NvmlUnsupported):
        adapter.fabric(0)
    adapter.nv = types.SimpleNamespace(**base, nvmlDeviceGetGpuFabricInfoV=raises(pynvml.NVMLError_GpuIsLost))
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        adapter.fabric(0)
    facts = gpu_facts("fabric-degraded.json")
    assert facts["devices"][3]["fabric"] == {"state": "completed", "status": 0, "clique": 0,
                                             "health": ["degraded_bandwidth"],
                                             "cluster_uuid": "00000000-0000-0000-0000-000000000000"}


def test_the_cluster_uuid_is_read_whole_whatever_type_pynvml_gives_the_field():
    """pynvml declares clusterUuid as c_uint8 * 16 today and as c_char * 16 in older releases, whose value ctypes
    cuts at the first zero byte: the adapter reads the 16 bytes from the structure's memory."""
    class OldInfo(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_char * 16), ("status", ctypes.c_uint)]

    raw = bytes.fromhex("00ff00000000000000000000000000aa")
    for kind in (OldInfo, pynvml.c_nvmlGpuFabricInfoV_t, pynvml.c_nvmlGpuFabricInfo_t):
        info = kind()
        ctypes.memmove(ctypes.addressof(info) + kind.clusterUuid.offset, raw, 16)
        assert gpus.cluster_uuid(info) == "00ff0000-0000-0000-0000-0000000000aa", kind
    assert OldInfo.from_buffer_copy(bytes(4) + raw + bytes(4)).clusterUuid == b""  # what ctypes alone gives


def test_the_recorder_writes_what_the_fake_replays():
    recorder = Recorder(fake("v100.json")())
    facts = gpus.facts(recorder)
    record = json.loads(json.dumps(recorder.record))
    assert record["gpus"][0]["nvlink_states"] == "NotSupported"
    assert record["gpus"] == load("v100.json")["gpus"] and facts == gpus.facts(fake("v100.json")())


# --- GPU001: enough GPUs, gpu_ids and CUDA_VISIBLE_DEVICES ----------------------------------------

def test_enough_gpus_on_every_node(tmp_path):
    results = run("GPU001", plan(tmp_path), {"n01": node("h100x8.json"), "n02": node("h100x8.json")})
    assert statuses(results, "n01") == statuses(results, "n02") == ["pass"]
    assert "8 GPU(s) usable" in on(results, "n01")[0].message and "8 process(es)" in on(results, "n01")[0].message


def test_too_few_gpus_names_the_node_and_both_numbers(tmp_path):
    results = run("GPU001", plan(tmp_path), {"n01": node("h100x8.json"), "n02": node("v100.json")})
    [bad] = on(results, "n02")
    assert bad.status == Status.FAIL and "4 GPU(s) usable" in bad.message and "expected at least 8" in bad.message
    assert "num_processes 16 / num_machines 2" in bad.message and statuses(results, "n01") == ["pass"]


def test_gpu_ids_that_do_not_exist(tmp_path):
    results = run("GPU001", plan(tmp_path, num_processes=4, gpu_ids="0,9"), {"n01": node("v100.json")})
    messages = [r.message for r in results if r.status == Status.FAIL]
    assert any("names GPU 9" in m and "4 GPU(s) (0-3)" in m for m in messages)
    assert any("1 GPU(s) usable" in m and "expected at least 2" in m for m in messages)


def test_cuda_visible_devices_against_nvml(tmp_path):
    uuid = gpu_facts("h100x8.json")["devices"][5]["uuid"]
    one = plan(tmp_path, nodes=("n01",), num_processes=2)
    ok = run("GPU001", one, {"n01": node("h100x8.json", {"CUDA_VISIBLE_DEVICES": f"3,{uuid[:12]}"})})
    assert statuses(ok) == ["pass"] and "CUDA_VISIBLE_DEVICES=3,GPU-" in ok[0].message
    slurm = run("GPU001", one, {"n01": node("h100x8.json", {"CUDA_VISIBLE_DEVICES": "NoDevFiles"})})
    assert statuses(slurm) == ["fail", "fail"] and "'NoDevFiles'" in slurm[0].message
    typo = run("GPU001", one, {"n01": node("h100x8.json", {"CUDA_VISIBLE_DEVICES": "0,8,1"})})
    assert "names '8'" in typo[0].message and "every entry after it" in typo[0].message
    assert "1 GPU(s) usable" in typo[1].message


def test_gpu_ids_replace_cuda_visible_devices(tmp_path):
    the_plan = plan(tmp_path, nodes=("n01",), num_processes=2, gpu_ids="0,1")
    results = run("GPU001", the_plan, {"n01": node("h100x8.json", {"CUDA_VISIBLE_DEVICES": "4,5"})})
    [finding] = results
    assert finding.status == Status.WARN and "'4,5'" in finding.message and "gpu_ids '0,1'" in finding.message
    same = run("GPU001", the_plan, {"n01": node("h100x8.json", {"CUDA_VISIBLE_DEVICES": "0,1"})})
    assert statuses(same) == ["pass"]


def test_no_nvml_fails_only_when_the_job_needs_gpus(tmp_path):
    states = {"n01": node("h100x8.json"), "n02": node("no-driver.json")}
    results = run("GPU001", plan(tmp_path), states)
    [bad] = on(results, "n02")
    assert bad.status == Status.FAIL and "LibraryNotFound" in bad.message and "MULTI_GPU" in bad.message
    cpu = run("GPU001", plan(tmp_path, distributed_type="MULTI_CPU"), states)
    assert statuses(cpu, "n02") == ["skip"] and statuses(cpu, "n01") == ["pass"]
    use_cpu = run("GPU001", plan(tmp_path, use_cpu=True), states)
    assert statuses(use_cpu, "n02") == ["skip"]
    deepspeed = run("GPU001", plan(tmp_path, distributed_type="MULTI_CPU", deepspeed={"train_batch_size": 16}), states)
    assert statuses(deepspeed, "n02") == ["fail"] and "DeepSpeed config" in on(deepspeed, "n02")[0].message
    for check_id in ("GPU003", "GPU004", "GPU005", "GPU006"):
        [skipped] = on(run(check_id, plan(tmp_path, mixed_precision="bf16"), states), "n02")
        assert skipped.status == Status.SKIP and "LibraryNotFound" in skipped.message and "GPU001" in skipped.message


# --- GPU002: the same GPUs and driver everywhere -------------------------------------------------

def test_the_odd_node_out_by_majority(tmp_path):
    def old_driver(gpus):
        gpus["driver_version"] = "550.90.07"

    nodes = ("n01", "n02", "n03", "n04")
    states = {"n01": node("h100x8.json"), "n02": node("h100x8.json", change=old_driver),
              "n03": node("a100x8.json"), "n04": node("h100x8.json")}
    results = run("GPU002", plan(tmp_path, nodes=nodes), states)
    model, driver_too = on(results, "n03")
    assert model.status == Status.FAIL and "n03 has 8 x NVIDIA A100-SXM4-80GB (80.0 GiB)" in model.message
    assert "have 8 x NVIDIA H100 80GB HBM3 (79.6 GiB)" in model.message
    assert driver_too.status == Status.FAIL and "535.161.08 (CUDA 12.2)" in driver_too.message
    [driver] = on(results, "n02")
    assert driver.status == Status.FAIL and "n02 has 550.90.07" in driver.message
    assert "n[01,04] have 550.54.15 (CUDA 12.4)" in driver.message
    assert [r.nodes for r in results if r.status == Status.PASS] == [("n01", "n04")]


def test_a_node_missing_a_gpu_differs(tmp_path):
    def lost_one(gpus):
        gpus["devices"].pop()

    states = {"n01": node("h100x8.json"), "n02": node("h100x8.json"), "n03": node("h100x8.json", change=lost_one)}
    results = run("GPU002", plan(tmp_path, nodes=("n01", "n02", "n03")), states)
    assert statuses(results, "n03") == ["fail"] and "7 x NVIDIA H100" in on(results, "n03")[0].message
    states["n03"] = node("gpu-lost.json")  # NVML cannot read GPU 5's name or memory
    [lost] = [r for r in run("GPU002", plan(tmp_path, nodes=("n01", "n02", "n03")), states) if r.nodes == ("n03",)]
    assert lost.message == ("GPUs differ: n03 has 7 x NVIDIA H100 80GB HBM3 (79.6 GiB), 1 x unreadable (lost); "
                            "n[01-02] have 8 x NVIDIA H100 80GB HBM3 (79.6 GiB)")
    [alone] = run("GPU002", plan(tmp_path), {"n01": node("h100x8.json"), "n02": node("no-driver.json")})
    assert alone.status == Status.SKIP and "fewer than two nodes" in alone.message


# --- GPU003: precision against compute capability -------------------------------------------------

@pytest.mark.parametrize("recording,precision,deepspeed,status", [
    ("v100.json", "bf16", None, "fail"),
    ("v100.json", "fp16", None, "pass"),
    ("v100.json", "no", {"bf16": {"enabled": True}, "train_batch_size": 16}, "fail"),
    ("v100.json", "no", {"bf16": {"enabled": False}, "train_batch_size": 16}, "skip"),
    ("a100x8.json", "bf16", None, "pass"),
    ("a100x8.json", "fp8", None, "fail"),
    ("h100x8.json", "fp8", None, "pass"),
])
def test_precision_against_compute_capability(tmp_path, recording, precision, deepspeed, status):
    the_plan = plan(tmp_path, nodes=("n01",), num_processes=4, mixed_precision=precision, deepspeed=deepspeed)
    results = run("GPU003", the_plan, {"n01": node(recording)})
    assert statuses(results) == [status]
    if status == "fail":
        assert "expected at least" in results[0].message and "compute capability" in results[0].message


def test_fp16_before_volta_warns(tmp_path):
    def pascal(gpus):
        for gpu in gpus["devices"]:
            gpu.update(name="Tesla P100-PCIE-16GB", compute_capability=[6, 0])

    results = run("GPU003", plan(tmp_path, nodes=("n01",), num_processes=4, mixed_precision="fp16"),
                  {"n01": node("v100.json", change=pascal)})
    assert statuses(results) == ["warn"] and "GPUs 0-3 (Tesla P100-PCIE-16GB)" in results[0].message
    assert "6.0, expected at least 7.0" in results[0].message


# --- GPU004: health ------------------------------------------------------------------------------

def health(tmp_path, recording, **accelerate):
    return run("GPU004", plan(tmp_path, nodes=("n01",), **accelerate), {"n01": node(recording)})


@pytest.mark.parametrize("recording", ["h100x8.json", "a100x8.json", "v100.json"])
def test_healthy_recordings_pass(tmp_path, recording):
    results = health(tmp_path, recording, num_processes=4)
    assert statuses(results) == ["pass"], [r.message for r in results]


def test_degraded_pcie(tmp_path):
    results = health(tmp_path, "degraded-pcie.json")
    by_gpu = {r.evidence["gpu"]: r for r in results}
    assert sorted(by_gpu) == [3, 6]
    assert by_gpu[3].status == Status.FAIL and "x8, expected x16" in by_gpu[3].message
    assert "00000000:5D:00.0" in by_gpu[3].message
    assert by_gpu[6].status == Status.WARN and "gen 3 while the GPU is not idle, expected gen 5" in by_gpu[6].message


def test_pending_remaps_and_ecc_errors(tmp_path):
    results = health(tmp_path, "pending-remaps.json")
    assert {r.evidence["gpu"] for r in results} == {2} and statuses(results) == ["fail", "fail"]
    text = " ".join(r.message for r in results)
    assert "1 uncorrectable ECC error(s) since the driver loaded, expected 0" in text
    assert "row remapping is pending" in text


def test_busy_gpus_name_the_processes_unless_the_job_uses_others(tmp_path):
    results = health(tmp_path, "busy.json")
    assert {r.evidence["gpu"] for r in results} == {0, 1} and statuses(results) == ["fail", "fail"]
    assert "pid 48213 (40.0 GiB)" in results[0].message
    others = health(tmp_path, "busy.json", num_processes=4, gpu_ids="2,3,4,5")
    assert statuses(others) == ["pass"]


def test_nvlink_down(tmp_path):
    [result] = health(tmp_path, "nvlink-down.json")
    assert result.status == Status.FAIL and result.evidence["gpu"] == 4
    assert "16 of 18 NVLink links active, expected 18" in result.message and "down: 6, 7" in result.message


def test_a_lost_gpu_fails(tmp_path):
    [result] = health(tmp_path, "gpu-lost.json")
    assert result.status == Status.FAIL and result.evidence["gpu"] == 5 and "GpuIsLost" in result.message
    assert result.message.startswith("GPU 5: NVML could not read") and "and 21 more" in result.message
    [count] = run("GPU001", plan(tmp_path, nodes=("n01",)), {"n01": node("gpu-lost.json")})
    assert count.status == Status.FAIL and "7 GPU(s) usable" in count.message and "GPU 5 not answering" in count.message


def test_hardware_slowdown_warns(tmp_path):
    def hot(gpus):
        gpus["devices"][2]["clock_event_reasons"] = ["sw_power_cap", "hw_thermal_slowdown"]

    results = run("GPU004", plan(tmp_path, nodes=("n01",)), {"n01": node("h100x8.json", change=hot)})
    assert statuses(results) == ["warn"] and "hw_thermal_slowdown" in results[0].message


# --- GPU005 and GPU006: compute mode and MIG -------------------------------------------------------

def test_compute_modes(tmp_path):
    def mode(name):
        def change(gpus):
            for gpu in gpus["devices"]:
                gpu["compute_mode"] = name
        return change

    one = plan(tmp_path, nodes=("n01",))
    assert statuses(run("GPU005", one, {"n01": node("h100x8.json")})) == ["pass"]
    assert statuses(run("GPU005", one, {"n01": node("h100x8.json", change=mode("exclusive_process"))})) == ["pass"]
    two_per_gpu = plan(tmp_path, nodes=("n01",), num_processes=16)
    [result] = run("GPU005", two_per_gpu, {"n01": node("h100x8.json", change=mode("exclusive_process"))})
    assert result.status == Status.FAIL and "puts 2 processes on each GPU" in result.message
    [result] = run("GPU005", one, {"n01": node("h100x8.json", change=mode("prohibited"))})
    assert result.status == Status.FAIL and "prohibited, expected default" in result.message


def test_mig_mode(tmp_path):
    results = run("GPU006", plan(tmp_path, nodes=("n01",)), {"n01": node("mig.json")})
    assert statuses(results) == ["fail", "warn"]
    assert "GPUs 0-6: MIG mode is on, expected off" in results[0].message and "GPU 7:" in results[1].message
    mig_job = node("mig.json", {"CUDA_VISIBLE_DEVICES": "MIG-3b4b3a6c-7f2d-5b2e-9d6a-0c1f7e2a9b11"})
    [expected] = run("GPU006", plan(tmp_path, nodes=("n01",), num_processes=1), {"n01": mig_job})
    assert expected.status == Status.PASS and "GPUs 0-6: MIG on, as CUDA_VISIBLE_DEVICES expects" in expected.message
    assert statuses(run("GPU006", plan(tmp_path, nodes=("n01",)), {"n01": node("a100x8.json")})) == ["pass"]
    [v100] = run("GPU006", plan(tmp_path, nodes=("n01",), num_processes=4), {"n01": node("v100.json")})
    assert "not supported" in v100.message


# --- the whole path: collector in-process, checks, report ------------------------------------------

def test_check_reports_gpu_findings(tmp_path, capsys, monkeypatch):
    config = tmp_path / "accelerate.yaml"
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
                                      "num_machines": 1, "num_processes": 8, "mixed_precision": "bf16"}))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpus, "Nvml", fake("h100x8.json"))
    monkeypatch.setattr(fabric, "SYSROOT", str(lay_out(tmp_path / "root", "ib-node")))  # its kernel log for GPU008
    code, doc, _ = run_cli(capsys, "check", "--config", config, "--only", "GPU", "--json")
    assert code == 0 and {r["id"]: r["status"] for r in doc["results"]} == {
        "GPU001": "pass", "GPU002": "skip", "GPU003": "pass", "GPU004": "pass", "GPU005": "pass", "GPU006": "pass",
        "GPU007": "skip", "GPU008": "pass", "GPU009": "pass", "GPU010": "skip"}
    monkeypatch.setattr(gpus, "Nvml", fake("busy.json"))
    code, doc, _ = run_cli(capsys, "check", "--config", config, "--only", "GPU004", "--json")
    assert code == 1 and doc["verdict"] == "fail" and "pid 48214" in doc["results"][1]["message"]
    monkeypatch.setattr(gpus, "Nvml", fake("v100.json"))
    code, text, _ = run_cli(capsys, "check", "--config", config, "--only", "GPU")
    assert code == 1 and "FAIL  GPU001" in text and "FAIL  GPU003" in text and "compute capability 7.0" in text


XID_79 = "4,2001,91234567,-;NVRM: Xid (PCI:0000:2a:00): 79, pid=0, name=, GPU has fallen off the bus.\n"


XID_13 = "4,2002,91234999,-;NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics Exception\n"


def test_xid_errors_on_the_job_gpus(tmp_path):
    kmsg = json.loads((sysfs_tree.FIXTURES / "ib-node.json").read_text())["files"]["dev/kmsg"]
    results = run_on("GPU008", recorded_nodes(tmp_path, "ib-node", {"n02": {"dev/kmsg": kmsg + XID_79 + XID_13}}), tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.FAIL)}
    failed = next(r for r in results if r.status == Status.FAIL)
    assert "GPU 1 (0000:2a:00): Xid 79 GPU has fallen off the bus" in failed.message
    only_program = run_on("GPU008", recorded_nodes(tmp_path / "p", "ib-node", {"n02": {"dev/kmsg": kmsg + XID_13}}), tmp_path)
    assert {r.status for r in only_program} == {Status.PASS}
    assert "program errors only: GPU 0 (0000:18:00): Xid 13" in [r for r in only_program if r.nodes == ("n02",)][0].message


def test_xid_on_machines_with_a_pci_domain_per_gpu(tmp_path):
    """Azure ND H100 v5, GH200: every GPU on bus 00 of its own PCI domain; the domain tells them apart."""
    states = recorded_nodes(tmp_path, "ib-node", {"n02": {"dev/kmsg": XID_79.replace("0000:2a:00", "0003:00:00")}},
                     env={"CUDA_VISIBLE_DEVICES": "2,3"})
    for i, gpu in enumerate(states["n02"]["facts"]["gpus"]["devices"]):
        gpu["pci_bus_id"] = f"0000000{i}:00:00.0"
    results = run_on("GPU008", states, tmp_path)
    failed = [r for r in results if r.status == Status.FAIL]
    assert [r.nodes for r in failed] == [("n02",)] and "GPU 3 (0003:00:00): Xid 79" in failed[0].message
    states["n02"]["facts"]["env"]["CUDA_VISIBLE_DEVICES"] = "0,1"  # the job does not use GPU 3
    assert {r.status for r in run_on("GPU008", states, tmp_path)} == {Status.PASS}


def test_xid_before_the_driver_was_reloaded_is_over(tmp_path):
    reload = "4,2100,95000000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.161.08  Tue Mar  5 22:42:15 UTC 2024\n"
    fabric = fabric_facts(tmp_path, "ib-node", {"dev/kmsg": XID_79 + reload + XID_13})
    assert [e["xid"] for e in fabric["xid"]["events"]] == [13]


def test_xid_unreadable_kernel_log_skips_with_the_reason(tmp_path):
    results = run_on("GPU008", recorded_nodes(tmp_path, "ib-node", {"n02": {"dev/kmsg": None}}), tmp_path)
    skipped = [r for r in results if r.status == Status.SKIP]
    assert [r.nodes for r in skipped] == [("n02",)] and "kernel log is not readable" in skipped[0].message


def test_the_real_kernel_log_is_read_without_blocking():
    xid = fabric.xid_events("/")
    assert xid["readable"] is True or "kmsg" in xid["reason"]


def test_the_device_machines_p2p_probe_says_when_there_is_no_pair_to_probe():
    """scripts/p2p_probe.py copies between every GPU pair on a lent GPU machine; here torch has no CUDA."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "p2p_probe.py"
    proc = subprocess.run([sys.executable, str(script), "--timeout", "5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and json.loads(proc.stdout) == {"probed": False,
                                                                "reason": "0 CUDA GPU(s) here: no pair to probe"}


def test_peer_to_peer_status_per_pair_as_nvml_reports_it():
    """nvmlDeviceGetP2PStatus for read, write and NVLink (caps indexes 0, 1, 2), each other GPU by its index; a
    pair NVML cannot answer for (a lost peer) is left out, never this GPU's own error."""
    calls = []

    def status(a, b, caps):
        calls.append((a, b, caps))
        if b == "handle2":
            raise pynvml.NVMLError_GpuIsLost()
        return {0: 0, 1: 0, 2: 5}[caps]

    adapter = gpus.Nvml.__new__(gpus.Nvml)
    adapter.nv = types.SimpleNamespace(NVMLError_FunctionNotFound=pynvml.NVMLError_FunctionNotFound,
                                       NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
                                       nvmlDeviceGetHandleByIndex=lambda i: "handle%d" % i,
                                       nvmlDeviceGetP2PStatus=status)
    adapter.handles = {}
    assert adapter.p2p(0, "1") == {"read": 0, "write": 0, "nvlink": 5}
    assert calls == [("handle0", "handle1", 0), ("handle0", "handle1", 1), ("handle0", "handle1", 2)]
    v100 = gpu_facts("v100.json")["devices"][0]
    assert v100["p2p"] == {"1": {"read": "ok", "write": "ok", "nvlink": "not_supported"},
                           "2": {"read": "ioh_topology_not_supported", "write": "ioh_topology_not_supported",
                                 "nvlink": "not_supported"},
                           "3": {"read": "ioh_topology_not_supported", "write": "ioh_topology_not_supported",
                                 "nvlink": "not_supported"}}
    lost = gpu_facts("gpu-lost.json")
    assert "errors" not in lost["devices"][4] and lost["devices"][5]["p2p"] is None
