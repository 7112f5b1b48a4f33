"""GPU009 nvswitch-fabric: NVSwitch nodes' GPU fabric (NVML's fabric state, status and health, recorded as the NVML
API documents them: tests/fixtures/nvml) and Fabric Manager (its process and its dpkg package, in recorded sysfs,
procfs and /var trees) against the driver's version."""
import pytest

from fabric_nodes import node, run_on
from preflight.node import fabric
from preflight.result import Status
from sysfs_tree import lay_out

NVSWITCHES = {f"sys/bus/pci/devices/0000:{bus}:00.0/{attr}": text for bus in ("05", "06", "07", "08")
              for attr, text in (("vendor", "0x10de\n"), ("class", "0x068000\n"))}
FM_RUNNING = {"proc/1/comm": "systemd\n", "proc/2417/comm": "nv-fabricmanage\n"}
FM_STOPPED = {"proc/1/comm": "systemd\n"}


def dpkg(version, package="nvidia-fabricmanager-550"):
    return {"var/lib/dpkg/status": "Package: bash\nStatus: install ok installed\nVersion: 5.1-6\n\n"
                                   f"Package: {package}\nStatus: install ok installed\nArchitecture: amd64\n"
                                   f"Version: {version}-1\nDescription: Fabric Manager for NVSwitch based systems.\n"}


def gpu009(tmp_path, nvml="h100x8.json", change=None, container=None):
    state = node(tmp_path, "gpu01", "ib-node", change, nvml=nvml)
    state["facts"]["host"]["container"] = container
    return run_on("GPU009", {"gpu01": state}, tmp_path)


def test_the_collector_reads_nvswitches_fabric_manager_and_its_package(tmp_path):
    root = lay_out(tmp_path, "ib-node", {**NVSWITCHES, **FM_RUNNING, **dpkg("550.54.15")})
    facts = fabric.facts(str(root))
    assert sorted(n for n, d in facts["pci"]["devices"].items() if d["kind"] == "nvswitch") == [
        "0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"]
    assert facts["fabric_manager"] == {"running": True, "version": "550.54.15", "package": "nvidia-fabricmanager-550"}
    assert "fabric_manager" not in fabric.facts(str(lay_out(tmp_path / "plain", "ib-node")))  # no NVSwitch: not read


def test_registered_gpus_and_fabric_manager_at_the_drivers_version_pass(tmp_path):
    [result] = gpu009(tmp_path, change={**NVSWITCHES, **FM_RUNNING, **dpkg("550.54.15")})
    assert result.status is Status.PASS, result
    assert result.message == ("GPUs 0-7 registered with the NVSwitch fabric (NVML: completed), Fabric Manager "
                              "550.54.15 running, as the driver")


def test_gpus_waiting_for_a_stopped_fabric_manager_fail_with_cudas_own_words(tmp_path):
    [result] = gpu009(tmp_path, "fabric-pending.json", {**NVSWITCHES, **FM_STOPPED, **dpkg("550.54.15")})
    assert result.status is Status.FAIL
    assert result.message.startswith("GPUs 0-7 not registered with the NVSwitch fabric (NVML: in_progress): CUDA "
                                     "stops with 'system not yet initialized' (802)")
    assert "nv-fabricmanager is not running" in result.message
    assert result.remediation.startswith("install nvidia-fabricmanager 550.54.15 and start it")


def test_a_fabric_manager_of_another_version_than_the_driver(tmp_path):
    [result] = gpu009(tmp_path, change={**NVSWITCHES, **FM_RUNNING, **dpkg("550.54.14")})
    assert result.status is Status.WARN and "Fabric Manager 550.54.14 (nvidia-fabricmanager-550) is not the " \
        "driver's 550.54.15" in result.message, result
    [result] = gpu009(tmp_path / "p", "fabric-pending.json", {**NVSWITCHES, **FM_RUNNING, **dpkg("550.54.14")})
    assert result.status is Status.FAIL and "is not the driver's 550.54.15" in result.message


def test_a_flagged_fabric_warns_naming_the_gpu(tmp_path):
    [result] = gpu009(tmp_path, "fabric-degraded.json", {**NVSWITCHES, **FM_RUNNING, **dpkg("550.54.15")})
    assert result.status is Status.WARN and result.message.startswith(
        "GPU 3: NVML flags the fabric's health: its bandwidth is degraded"), result


def test_before_hopper_fabric_managers_process_decides_and_a_container_does_not_see_it(tmp_path):
    [result] = gpu009(tmp_path, "a100x8.json", {**NVSWITCHES, **FM_STOPPED})
    assert result.status is Status.FAIL and result.message.startswith(
        "4 NVSwitches and nv-fabricmanager is not running: CUDA stops"), result
    [result] = gpu009(tmp_path / "c", "a100x8.json", {**NVSWITCHES, **FM_STOPPED}, container="docker")
    assert result.status is Status.PASS, result
    assert result.message.startswith("4 NVSwitches; whether nv-fabricmanager runs is not known"), result


@pytest.mark.parametrize("nvml", ["v100.json", "a100x8.json"])
def test_a_node_without_nvswitches_is_skipped(tmp_path, nvml):
    [result] = gpu009(tmp_path, nvml)
    assert result.status is Status.SKIP and result.message.startswith("no NVSwitch on this node"), result


def test_a_node_without_gpu_facts_is_skipped(tmp_path):
    [result] = gpu009(tmp_path, nvml=None)
    assert result.status is Status.SKIP and result.message.startswith("no GPU facts on this node")


def test_a_registration_that_failed_is_named_with_nvmls_status(tmp_path):
    state = node(tmp_path, "gpu01", "ib-node", {**NVSWITCHES, **FM_RUNNING, **dpkg("550.54.15")})
    state["facts"]["gpus"]["devices"][2]["fabric"]["status"] = 999  # an nvmlReturn_t other than NVML_SUCCESS
    [result] = run_on("GPU009", {"gpu01": state}, tmp_path)
    assert result.status is Status.FAIL and result.message.startswith(
        "GPU 2: registration failed (NVML status 999): CUDA stops"), result


def test_where_this_user_sees_no_other_users_processes_fabric_manager_is_not_said_to_be_stopped(tmp_path):
    """/proc mounted with hidepid: PID 1 is not there to read, nor Fabric Manager, which runs as root."""
    root = lay_out(tmp_path, "ib-node", {**NVSWITCHES, "proc/2417/comm": "python\n", **dpkg("550.54.15")})
    assert fabric.facts(str(root))["fabric_manager"]["running"] is None
    [result] = gpu009(tmp_path / "n", "a100x8.json", {**NVSWITCHES, "proc/2417/comm": "python\n"})
    assert result.status is Status.PASS, result
    assert result.message.startswith("4 NVSwitches; whether nv-fabricmanager runs is not known"), result
