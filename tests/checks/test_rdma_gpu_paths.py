"""RDMA: the layers between a GPU and the wire, over recorded sysfs / procfs trees (tests/fixtures/sysfs): the
peer-memory module the installed NCCL finds (RDMA004), the GID index it chooses (RDMA003), the RoCE active MTU
across nodes (RDMA007), ACS on the PCIe bridges (RDMA008), the IOMMU mode (RDMA009) and whether each GPU has an
HCA on its socket (RDMA010). The collector reads each tree, its facts make the JSON trip, the checks run."""
import json

import pytest

from fabric_nodes import SPECS, recorded_nodes, run_on, statuses_by_nodes
from preflight import runner
from preflight.node import fabric
from preflight.plan import build_plan
from preflight.remote import gather, shapes
from preflight.result import Status
from sysfs_tree import FIXTURES, binary, fabric_facts

HGX = json.loads((FIXTURES / "hgx-node.json").read_text())
# The switch port above GPU 0000:18:00.0 and the one above mlx5_0 beside it, on socket 0 (hgx-node's "binary").
GPU_PORT = "sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/config"
HCA_PORT = "sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/config"
SOCKET_0 = "=mlx5_0,mlx5_1,mlx5_2,mlx5_3"
GROUPS = [p for p in HGX["files"] if p.startswith("sys/kernel/iommu_groups/")]
ROCE_MTU = "sys/devices/pci0000:00/0000:3b:00.0/net/ens1f0np0/mtu"
NO_PEER_CLIENT = {"sys/kernel/mm/memory_peers/nv_mem/version": None}
NEW_CHECKS = ("RDMA007", "RDMA008", "RDMA009", "RDMA010")


def acs_config(ctl: int) -> bytes:
    """A switch port's config space as root reads it, its ACS Control set to `ctl`."""
    spec = json.loads(json.dumps(HGX["binary"][GPU_PORT]))
    spec["at"]["0x148"] = spec["at"]["0x148"][:12] + "%02x%02x" % (ctl & 0xFF, ctl >> 8)
    return binary(spec)


# --- the recorded trees, read as a node reads them ------------------------------------------------------------

def test_the_collector_reads_the_pcie_tree_of_an_hgx_node(tmp_path):
    facts = fabric_facts(tmp_path, "hgx-node")
    gpu, hca = facts["pci"]["devices"]["0000:18:00.0"], facts["pci"]["devices"]["0000:19:00.0"]
    assert gpu == {"kind": "gpu", "host_bridge": "pci0000:15", "bridges": ["0000:15:01.0", "0000:16:00.0", "0000:17:00.0"],
                   "numa_node": 0, "iommu_group": "identity"}
    assert hca["kind"] == "hca" and hca["bridges"][:2] == gpu["bridges"][:2] and facts["rdma"]["mlx5_0"]["pci"] == "0000:19:00.0"
    assert sorted(b for b, d in facts["pci"]["devices"].items() if d["kind"] == "gpu") == [
        "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0",
        "0000:db:00.0"]  # the NVML recording's GPUs
    assert facts["pci"]["devices"]["0000:9a:00.0"]["numa_node"] == 1
    # ACS Control as lspci prints it: the root port's 0x001d (SrcValid+ ReqRedir+ CmpltRedir+ UpstreamFwd+)
    assert facts["pci"]["acs"]["0000:15:01.0"] == {"config_bytes": 4096, "ctl": 0x1D}
    assert facts["pci"]["acs"]["0000:17:00.0"] == {"config_bytes": 4096, "ctl": 0}
    assert facts["pci"]["acs"]["0000:16:00.0"] == {"config_bytes": 4096, "ctl": None}  # an upstream port: no ACS
    assert facts["iommu"] == {"cmdline": ["intel_iommu=on", "iommu=pt"], "units": [f"dmar{n}" for n in range(8)]}
    assert facts["gpudirect"] == {"memory_peers": ["nv_mem"], "nvidia_peermem_version": "535.161.08"}
    assert shapes.problem(facts, shapes.SECTIONS["fabric"], "fabric") is None


def test_acs_is_not_readable_from_the_64_bytes_a_user_without_root_reads(tmp_path):
    header_only = {GPU_PORT: acs_config(0x1D)[:64]}
    facts = fabric_facts(tmp_path, "hgx-node", header_only)
    assert facts["pci"]["acs"]["0000:17:00.0"] == {"config_bytes": 64, "ctl": None}


@pytest.mark.parametrize("config,ctl", [(b"", None), (b"\xff" * 4096, None), (bytes(4096), None)])
def test_acs_control_of_config_space_without_an_acs_capability(config, ctl):
    assert fabric.acs_control(config) == ctl


def test_a_looping_capability_list_ends():
    looped = bytearray(4096)
    looped[0x100:0x104] = (0x0001 | 0x100 << 20).to_bytes(4, "little")  # AER whose next is itself
    assert fabric.acs_control(bytes(looped)) is None


def test_the_roce_active_mtu_as_the_kernel_derives_it():
    from checks.rdma import roce_active_mtu
    assert [roce_active_mtu(m) for m in (1500, 2200, 4200, 9000, 4100, 1000, 200, None)] == \
        [1024, 2048, 4096, 4096, 2048, 512, None, None]


# --- healthy: no false alarm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("nccl", [None, "2.21.5", "2.27.3"])
def test_a_healthy_hgx_node_passes_every_rdma_check(tmp_path, nccl):
    states = recorded_nodes(tmp_path, "hgx-node", versions={"nccl": nccl} if nccl else {})
    for check_id in ("RDMA001", "RDMA002", "RDMA004", "RDMA005", "RDMA006") + NEW_CHECKS[1:]:
        results = run_on(check_id, states, tmp_path)
        assert {r.status for r in results} == {Status.PASS}, (check_id, [r.message for r in results])
    assert [r.status for r in run_on("RDMA007", states, tmp_path)] == [Status.SKIP]  # InfiniBand: not in sysfs
    acs = run_on("RDMA008", states, tmp_path)[0]
    assert "0000:15:01.0" not in acs.evidence["bridges"]  # the root port above the switch carries no GPU-HCA traffic
    assert "the same PCIe switch" in run_on("RDMA010", states, tmp_path)[0].message


@pytest.mark.parametrize("recording", ["ib-node", "no-rdma"])
def test_nodes_without_a_pcie_tree_of_gpus_skip_the_path_checks_with_the_reason(tmp_path, recording):
    states = recorded_nodes(tmp_path, recording, nvml=None if recording == "no-rdma" else "h100x8.json")
    for check_id in NEW_CHECKS[1:]:
        results = run_on(check_id, states, tmp_path)
        assert {r.status for r in results} == {Status.SKIP}, check_id
        assert "no NVIDIA GPU" in results[0].message, results[0].message


def test_facts_from_an_older_collector_skip_the_path_checks(tmp_path):
    states = recorded_nodes(tmp_path, "hgx-node")
    for state in states.values():
        del state["facts"]["fabric"]["pci"]
    for check_id in NEW_CHECKS[1:]:
        results = run_on(check_id, states, tmp_path)
        assert {r.status for r in results} == {Status.SKIP} and "older preflight" in results[0].message


# --- GPUDirect RDMA: the module against the NCCL that looks for it ------------------------------------------------

def test_nvidia_peermem_without_a_peer_memory_client_is_invisible_to_nccl_before_2_23(tmp_path):
    """nvidia_peermem loaded, /sys/kernel/mm/memory_peers/nv_mem absent (no MOFED peer memory): NCCL 2.22.3 looks
    only there and turns GPUDirect RDMA off; NCCL 2.23.4 also finds /sys/module/nvidia_peermem."""
    states = recorded_nodes(tmp_path, "hgx-node", {"n01": NO_PEER_CLIENT, "n02": NO_PEER_CLIENT},
                            versions={"nccl": "2.22.3"})
    states["n02"]["facts"]["packages"]["versions"]["nccl"] = "2.23.4"
    results = run_on("RDMA004", states, tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.WARN), (("n02",), Status.PASS)}
    warned = next(r for r in results if r.status == Status.WARN)
    assert "nvidia_peermem is loaded, but NCCL 2.22.3 looks for GPUDirect RDMA only in" in warned.message
    assert "install NCCL 2.23 or newer on n01" in warned.remediation and warned.evidence["nccl"] == "2.22.3"
    assert "through nvidia_peermem" in next(r for r in results if r.status == Status.PASS).message


def test_the_nccl_torch_requires_is_the_one_judged(tmp_path):
    states = recorded_nodes(tmp_path, "hgx-node", {"n01": NO_PEER_CLIENT}, names=("n01",), versions={"nccl": "2.27.3"})
    packages = states["n01"]["facts"]["packages"]
    packages["requires"] = dict(packages.get("requires") or {}, torch=["nvidia-nccl-cu11==2.19.3; platform_system == 'Linux'"])
    packages["distributions"] = dict(packages.get("distributions") or {}, **{"nvidia-nccl-cu11": "2.19.3"})
    [result] = run_on("RDMA004", states, tmp_path)
    assert result.status == Status.WARN and "NCCL 2.19.3" in result.message


def test_a_peer_memory_client_is_found_by_every_nccl(tmp_path):
    states = recorded_nodes(tmp_path, "hgx-node", {"n01": {"sys/module/nvidia_peermem/version": None}},
                            versions={"nccl": "2.18.5"})
    assert {r.status for r in run_on("RDMA004", states, tmp_path)} == {Status.PASS}


# --- the GID index the installed NCCL chooses ---------------------------------------------------------------------

def test_nccl_before_2_21_uses_gid_index_0_the_link_local_roce_v1_entry(tmp_path):
    older = recorded_nodes(tmp_path, "roce-node", versions={"nccl": "2.18.5"})
    results = run_on("RDMA003", older, tmp_path)
    assert {r.status for r in results} == {Status.FAIL}, [r.message for r in results]
    assert "GID 0 (NCCL_IB_GID_INDEX unset: NCCL 2.18.5 uses index 0) is the link-local fe80:" in results[0].message
    assert "NCCL 2.21 or newer" in results[0].remediation
    newer = recorded_nodes(tmp_path / "new", "roce-node", versions={"nccl": "2.21.5"})
    assert {r.status for r in run_on("RDMA003", newer, tmp_path)} == {Status.PASS}
    told = recorded_nodes(tmp_path / "told", "roce-node", env={"NCCL_IB_GID_INDEX": "3"}, versions={"nccl": "2.18.5"})
    assert {r.status for r in run_on("RDMA003", told, tmp_path)} == {Status.PASS}
    negative = recorded_nodes(tmp_path / "neg", "roce-node", env={"NCCL_IB_GID_INDEX": "-1"}, versions={"nccl": "2.18.5"})
    results = run_on("RDMA003", negative, tmp_path)
    assert {r.status for r in results} == {Status.FAIL} and "chooses no GID itself" in results[0].message


# --- the RoCE MTU across nodes --------------------------------------------------------------------------------------

def test_a_roce_interface_at_mtu_1500_on_one_node(tmp_path):
    states = recorded_nodes(tmp_path, "roce-node", {"n02": {ROCE_MTU: "1500\n"}}, names=("n01", "n02", "n03"))
    results = run_on("RDMA007", states, tmp_path)
    assert statuses_by_nodes(results) == {(("n01", "n03"), Status.PASS), (("n02",), Status.FAIL)}
    failed = next(r for r in results if r.status == Status.FAIL)
    assert "mlx5_0:1 at 1024 (ens1f0np0 at MTU 1500; 4096 on the other nodes)" in failed.message
    assert "ens1f0np0 on n02" in failed.remediation
    older = recorded_nodes(tmp_path / "old", "roce-node", {"n02": {ROCE_MTU: "1500\n"}}, versions={"nccl": "2.19.3"})
    assert statuses_by_nodes(run_on("RDMA007", older, tmp_path)) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}


def test_roce_mtu_the_same_everywhere_passes_and_an_unreadable_one_is_said(tmp_path):
    results = run_on("RDMA007", recorded_nodes(tmp_path, "roce-node"), tmp_path)
    assert {r.status for r in results} == {Status.PASS} and "mlx5_0:1 4096" in results[0].message
    unread = recorded_nodes(tmp_path / "u", "roce-node", {"n02": {ROCE_MTU: None}})
    results = run_on("RDMA007", unread, tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}
    assert "MTU of mlx5_0:1 (ens1f0np0: MTU None) cannot be read" in next(r for r in results if r.status == Status.WARN).message


# --- ACS, IOMMU, locality ---------------------------------------------------------------------------------------------

def test_acs_redirecting_on_the_switch_port_above_a_gpu(tmp_path):
    states = recorded_nodes(tmp_path, "hgx-node", {"n02": {GPU_PORT: acs_config(0x1D)}})
    results = run_on("RDMA008", states, tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}
    warned = next(r for r in results if r.status == Status.WARN)
    assert ("0000:17:00.0 (ACSCtl SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-) "
            "between GPU 0000:18:00.0 - mlx5_0") in warned.message
    assert "setpci -s 0000:17:00.0 ECAP_ACS+6.w=0000" in warned.remediation
    # Source Validation alone (SrcValid+) moves no peer-to-peer traffic
    only_sv = recorded_nodes(tmp_path / "sv", "hgx-node", {"n01": {HCA_PORT: acs_config(0x01)}})
    assert {r.status for r in run_on("RDMA008", only_sv, tmp_path)} == {Status.PASS}


def test_acs_not_readable_without_root_is_a_skip_that_says_so(tmp_path):
    user = {GPU_PORT: acs_config(0)[:64], HCA_PORT: acs_config(0)[:64]}
    results = run_on("RDMA008", recorded_nodes(tmp_path, "hgx-node", {"n01": user, "n02": user}), tmp_path)
    assert {r.status for r in results} == {Status.SKIP} and "without root" in results[0].message
    # 256 bytes is a whole config space without the extended part (a conventional PCI bridge): it has no ACS
    short = {GPU_PORT: acs_config(0x1D)[:256], HCA_PORT: acs_config(0x1D)[:256]}
    assert {r.status for r in run_on("RDMA008", recorded_nodes(tmp_path / "pci", "hgx-node", {"n01": short}, names=("n01",)),
                                     tmp_path)} == {Status.PASS}


def test_the_iommu_translating_gpu_and_hca_dma(tmp_path):
    translated = dict({g: "DMA-FQ\n" for g in GROUPS}, **{"proc/cmdline": "BOOT_IMAGE=/boot/vmlinuz ro intel_iommu=on\n"})
    results = run_on("RDMA009", recorded_nodes(tmp_path, "hgx-node", {"n02": translated}), tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}
    warned = next(r for r in results if r.status == Status.WARN)
    assert ("the IOMMU translates the DMA of GPU 0000:18:00.0, GPU 0000:2a:00.0, GPU 0000:3a:00.0, GPU 0000:5d:00.0 "
            "and 12 more") in warned.message
    assert len(warned.evidence["groups"]) == 16
    assert "IOMMU group type DMA-FQ; kernel arguments: intel_iommu=on" in warned.message
    assert "iommu=pt" in warned.remediation
    # a kernel before 5.11 has groups without a type: iommu=pt on its command line decides
    untyped = {g: None for g in GROUPS}
    assert {r.status for r in run_on("RDMA009", recorded_nodes(tmp_path / "old", "hgx-node", {"n01": untyped}),
                                     tmp_path)} == {Status.PASS}
    untyped_translating = dict(untyped, **{"proc/cmdline": "ro intel_iommu=on\n"})
    assert {r.status for r in run_on("RDMA009", recorded_nodes(tmp_path / "old2", "hgx-node", {"n01": untyped_translating},
                                                               names=("n01",)), tmp_path)} == {Status.WARN}


def test_a_gpu_whose_hca_nccl_ib_hca_leaves_out_crosses_the_socket(tmp_path):
    states = recorded_nodes(tmp_path, "hgx-node", env={"NCCL_IB_HCA": SOCKET_0}, names=("n01",))
    [result] = run_on("RDMA010", states, tmp_path)
    assert result.status == Status.WARN
    assert "GPU 0000:9a:00.0 (NUMA node 1) reaches mlx5_0, mlx5_1, mlx5_2, mlx5_3 only across the sockets" in result.message
    assert "GPU 0000:5d:00.0" not in result.message and "let NCCL use mlx5_4, mlx5_5, mlx5_6, mlx5_7 on n01" in \
        result.remediation
    states = recorded_nodes(tmp_path / "gone", "hgx-node", names=("n01",))
    for hca in ("mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"):
        del states["n01"]["facts"]["fabric"]["rdma"][hca]  # as on a node whose socket-1 HCAs did not probe
    [result] = run_on("RDMA010", states, tmp_path)
    assert result.status == Status.WARN and "bring up an HCA on the GPU's socket" in result.remediation


def test_locality_is_judged_for_the_gpus_the_job_uses(tmp_path):
    """Ranks on socket 0 only (CUDA_VISIBLE_DEVICES=0-3) need only socket 0's HCAs; gpu_ids 4 does not."""
    env = {"NCCL_IB_HCA": SOCKET_0, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    [result] = run_on("RDMA010", recorded_nodes(tmp_path, "hgx-node", env=env, names=("n01",)), tmp_path)
    assert result.status == Status.PASS and "4 on the same PCIe switch" in result.message, result.message
    env = {"NCCL_IB_HCA": SOCKET_0, "CUDA_VISIBLE_DEVICES": "4"}
    [result] = run_on("RDMA010", recorded_nodes(tmp_path / "s1", "hgx-node", env=env, names=("n01",)), tmp_path)
    assert result.status == Status.WARN and list(result.evidence["nearest"]) == ["0000:9a:00.0"]


def test_hostile_pci_facts_never_make_a_path_check_raise(tmp_path):
    states = recorded_nodes(tmp_path, "hgx-node", names=("n01", "n02"))
    healthy = json.loads(json.dumps(states["n02"]["facts"]["fabric"]))
    plan = build_plan(nodes=tuple(states))
    hostile = ({}, [], None, "x", 0, -1, True, [None], {"x": {}})
    defects, judged = [], 0
    for key in ("pci", "iommu", "gpudirect"):
        for path in [(key,)] + [(key, k) for k in healthy[key]]:
            for value in hostile:
                fabric_doc = json.loads(json.dumps(healthy))
                parent = fabric_doc
                for part in path[:-1]:
                    parent = parent[part]
                parent[path[-1]] = value
                facts = gather.checked_facts(json.loads(json.dumps(dict(states["n02"]["facts"], fabric=fabric_doc))))
                judged += runner.failed_sections(facts) == []
                states["n02"] = dict(states["n02"], facts=facts)
                for check_id in ("RDMA004",) + NEW_CHECKS:
                    for r in runner.run([SPECS[check_id]], runner.CheckContext(plan, states, {})):
                        if "raised" in r.message or (r.remediation or "").startswith("this is a defect"):
                            defects.append((path, value, check_id, r.message))
    assert not defects, defects[:5]
    assert judged  # some hostile values pass the shapes and are judged, not only refused


# --- GPU peer-to-peer over PCIe, on a node without an HCA NCCL may use -----------------------------------------

NO_HCA = {"NCCL_IB_DISABLE": "1"}  # NCCL uses no HCA: the GPUs' own paths remain
# hgx-node with a second GPU (19:00.0) where mlx5_0 sits: two GPUs under one PCIe switch (ports 17:00.0, 17:01.0)
SWITCH = "sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0/"
TWO_GPUS = {SWITCH + "vendor": "0x10de\n", SWITCH + "class": "0x030200\n", SWITCH + "device": "0x2331\n",
            **{path: None for path in [*HGX["files"], *HGX["links"]] if path.startswith("sys/class/infiniband/mlx5_0/")}}


def test_acs_redirecting_above_a_gpu_of_a_pcie_server_is_named_for_gpu_peer_to_peer(tmp_path):
    states = recorded_nodes(tmp_path, "hgx-node", {"n01": TWO_GPUS, "n02": {**TWO_GPUS, GPU_PORT: acs_config(0x1D)}},
                            env=NO_HCA, nvml="pcie-x8.json")
    results = run_on("RDMA008", states, tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}, results
    warned = next(r for r in results if r.status == Status.WARN)
    assert "0000:17:00.0 (ACSCtl SrcValid+ TransBlk- ReqRedir+" in warned.message
    assert "between GPU 0000:18:00.0 - GPU 0000:19:00.0" in warned.message
    assert "GPU peer-to-peer goes through the root complex" in warned.message and "GPUDirect" not in warned.message
    passed = next(r for r in results if r.status == Status.PASS)
    assert "between the GPUs that reach each other over PCIe" in passed.message


def test_the_iommu_translating_a_pcie_servers_gpus_is_named_without_an_hca(tmp_path):
    translated = dict({g: "DMA-FQ\n" for g in GROUPS}, **{"proc/cmdline": "BOOT_IMAGE=/boot/vmlinuz ro intel_iommu=on\n"})
    states = recorded_nodes(tmp_path, "hgx-node", {"n01": {**TWO_GPUS, **translated}, "n02": TWO_GPUS}, env=NO_HCA,
                            nvml="pcie-x8.json")
    assert statuses_by_nodes(run_on("RDMA009", states, tmp_path)) == {(("n01",), Status.WARN),
                                                                     (("n02",), Status.PASS)}


@pytest.mark.parametrize("nvml", ["h100x8.json", "pcie-x8.json"])
def test_gpus_on_nvlink_or_under_different_root_ports_without_an_hca_have_no_pcie_path_to_judge(tmp_path, nvml):
    """NVLink carries the peer-to-peer traffic; GPUs under different root ports meet in the root complex."""
    states = recorded_nodes(tmp_path, "hgx-node", {"n02": {GPU_PORT: acs_config(0x1D)}}, env=NO_HCA, nvml=nvml)
    for check_id in ("RDMA008", "RDMA009", "RDMA010"):
        results = run_on(check_id, states, tmp_path)
        assert {r.status for r in results} == {Status.SKIP}, (check_id, results)
    assert "no GPUs that reach each other over PCIe" in run_on("RDMA008", states, tmp_path)[0].message


def test_a_pair_whose_peer_to_peer_the_driver_disables_is_not_judged_for_acs(tmp_path):
    """NVML says the driver does not let GPUs 0 and 1 read each other (a registry key): CUDA and NCCL copy
    through host memory, so ACS on their switch moves none of their traffic."""
    states = recorded_nodes(tmp_path, "hgx-node", {"n01": {**TWO_GPUS, GPU_PORT: acs_config(0x1D)}}, env=NO_HCA,
                            nvml="pcie-x8.json")
    for index, other in ((0, "1"), (1, "0")):
        states["n01"]["facts"]["gpus"]["devices"][index]["p2p"][other] = {
            "read": "disabled_by_regkey", "write": "disabled_by_regkey", "nvlink": "not_supported"}
    [result] = run_on("RDMA008", {"n01": states["n01"]}, tmp_path)
    assert result.status is Status.SKIP and "no GPUs that reach each other over PCIe" in result.message, result
