"""RDMA: InfiniBand and RoCE ports, rates, GIDs, GPUDirect RDMA, firmware and link errors (RDMA001-006)
over recorded sysfs / procfs trees (tests/fixtures/sysfs) and recorded NVML answers: the collector reads the
tree, its facts make the JSON trip from the node, and the checks, the runner and the CLI run for real."""
import json
import os

import pytest

import transcripts
from conftest import run_cli
from fabric_nodes import IB0, IB1, SPECS, recorded_nodes, run_on, statuses_by_nodes
from preflight import runner
from preflight.plan import build_plan
from preflight.remote import gather, shapes
from preflight.result import Status
from sysfs_tree import fabric_facts

# --- healthy nodes: no false alarm -------------------------------------------------------------------

def test_the_collector_reads_a_recorded_infiniband_node(tmp_path):
    fabric = fabric_facts(tmp_path, "ib-node")
    port = fabric["rdma"]["mlx5_0"]["ports"]["1"]
    assert (port["state"], port["phys_state"], port["rate_gbps"], port["link_layer"]) == ("ACTIVE", "LinkUp", 400.0, "InfiniBand")
    assert port["gids"] == [{"index": 0, "gid": "fe80:0000:0000:0000:a088:c203:0012:3456", "type": None, "ndev": None}]
    assert port["counters"]["link_downed"] == 0
    assert fabric["rdma"]["mlx5_0"]["fw_ver"] == "28.39.1002" and fabric["rdma"]["mlx5_0"]["netdevs"] == ["ibp24s0"]
    assert fabric["rdma"]["mlx5_0"]["pci"] == "0000:18:00.0"
    assert "nvidia_peermem" in fabric["modules"] and "ext4" not in fabric["modules"]
    assert fabric["xid"] == {"readable": True, "events": [], "count": 0, "cut": False}


def test_the_collector_reads_a_roce_gid_table_and_skips_empty_entries(tmp_path):
    port = fabric_facts(tmp_path, "roce-node")["rdma"]["mlx5_0"]["ports"]["1"]
    assert [(g["index"], g["type"]) for g in port["gids"]] == [(0, "IB/RoCE v1"), (1, "RoCE v2"), (2, "IB/RoCE v1"), (3, "RoCE v2")]
    assert port["gids"][3]["gid"].endswith("ffff:0a00:010b") and port["gids"][3]["ndev"] == "ens1f0np0"


@pytest.mark.parametrize("recording,env", [("ib-node", {}), ("roce-node", {"NCCL_IB_GID_INDEX": "3"}),
                                           ("roce-node", {})])
def test_healthy_nodes_give_no_false_alarm(tmp_path, recording, env):
    states = recorded_nodes(tmp_path, recording, env=env)
    for check_id in ("RDMA001", "RDMA002", "RDMA004", "RDMA005", "RDMA006", "GPU008", "PKG006"):
        results = run_on(check_id, states, tmp_path)
        assert {r.status for r in results} == {Status.PASS}, (check_id, [r.message for r in results])
    roce = run_on("RDMA003", states, tmp_path)
    assert {r.status for r in roce} == ({Status.PASS} if recording == "roce-node" else {Status.SKIP})


def test_a_node_without_rdma_devices_skips_with_the_reason(tmp_path):
    states = recorded_nodes(tmp_path, "no-rdma", nvml=None)
    for check_id in ("RDMA001", "RDMA003", "RDMA004", "RDMA006"):
        results = run_on(check_id, states, tmp_path)
        assert {r.status for r in results} == {Status.SKIP}, check_id
        assert "RDMA device" in results[0].message or "no RDMA" in results[0].message, results[0].message
    assert [r.status for r in run_on("RDMA002", states, tmp_path)] == [Status.SKIP]
    assert [r.status for r in run_on("RDMA005", states, tmp_path)] == [Status.SKIP]


# --- each fault, planted in a tree, named with the node and the device ---------------------------------

def test_a_port_down_on_one_node(tmp_path):
    down = {IB1 + "state": "1: DOWN\n", IB1 + "phys_state": "3: Disabled\n"}
    results = run_on("RDMA001", recorded_nodes(tmp_path, "ib-node", {"n02": down}), tmp_path)
    bad = [r for r in results if r.status == Status.WARN]
    assert [r.nodes for r in bad] == [("n02",)] and "mlx5_1:1 is DOWN, Disabled" in bad[0].message
    every = dict(down, **{IB0 + "state": "1: DOWN\n", IB0 + "phys_state": "2: Polling\n"})
    results = run_on("RDMA001", recorded_nodes(tmp_path / "all", "ib-node", {"n02": every}), tmp_path)
    failed = [r for r in results if r.status == Status.FAIL]
    assert [r.nodes for r in failed] == [("n02",)] and "falls back to TCP sockets" in failed[0].message


def test_nccl_ib_hca_names_a_port_that_is_down(tmp_path):
    down = {IB1 + "state": "1: DOWN\n", IB1 + "phys_state": "3: Disabled\n"}
    states = recorded_nodes(tmp_path, "ib-node", {"n02": down}, env={"NCCL_IB_HCA": "=mlx5_1"})
    failed = [r for r in run_on("RDMA001", states, tmp_path) if r.status == Status.FAIL]
    assert [r.nodes for r in failed] == [("n02",)] and "mlx5_1:1" in failed[0].message


def test_nccl_ib_hca_names_a_device_that_does_not_exist(tmp_path):
    states = recorded_nodes(tmp_path, "ib-node", env={"NCCL_IB_HCA": "mlx5_7"})
    results = [r for r in run_on("NET005", states, tmp_path) if "NCCL_IB_HCA" in r.message]  # not NCCL's interface
    assert {r.status for r in results} == {Status.FAIL} and len(results) == 2 and "mlx5_7" in results[0].message
    assert [r.status for r in run_on("RDMA001", states, tmp_path)] == [Status.SKIP] * 2


def test_a_port_at_the_wrong_rate(tmp_path):
    results = run_on("RDMA002", recorded_nodes(tmp_path, "ib-node", {"n02": {IB0 + "rate": "200 Gb/sec (4X HDR)\n"}}), tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}
    warned = next(r for r in results if r.status == Status.WARN)
    assert "mlx5_0:1 at 200 Gb/s (elsewhere 400)" in warned.message


def test_hcas_at_different_rates_by_design_are_compared_port_by_port(tmp_path):
    storage = {IB1 + "rate": "200 Gb/sec (4X HDR)\n"}  # on every node: a slower storage HCA beside the compute one
    results = run_on("RDMA002", recorded_nodes(tmp_path, "ib-node", {"n01": storage, "n02": storage}), tmp_path)
    assert {r.status for r in results} == {Status.PASS}
    unread = run_on("RDMA002", recorded_nodes(tmp_path / "u", "ib-node", {"n01": {IB0 + "rate": "\n"}}), tmp_path)
    warned = [r for r in unread if r.status == Status.WARN]
    assert [r.nodes for r in warned] == [("n01",)] and "rate of mlx5_0:1 cannot be read" in warned[0].message


@pytest.mark.parametrize("rate", [2**63, 0, -400])
def test_an_implausible_rate_is_unreadable_not_the_rate_the_others_are_held_to(tmp_path, rate):
    states = recorded_nodes(tmp_path, "ib-node")
    states["n02"]["facts"]["fabric"]["rdma"]["mlx5_0"]["ports"]["1"]["rate_gbps"] = rate  # a tie of two nodes
    results = run_on("RDMA002", states, tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}, [r.message for r in results]
    assert "the rate of mlx5_0:1 cannot be read" in next(r for r in results if r.status == Status.WARN).message


def test_roce_gid_index_that_is_roce_v1_on_one_node(tmp_path):
    swapped = {"sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/3": "IB/RoCE v1\n",
               "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/2": "RoCE v2\n"}
    states = recorded_nodes(tmp_path, "roce-node", {"n02": swapped}, env={"NCCL_IB_GID_INDEX": "3"})
    results = run_on("RDMA003", states, tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.FAIL)}
    failed = next(r for r in results if r.status == Status.FAIL)
    assert "mlx5_0:1's GID 3 (NCCL_IB_GID_INDEX=3) is IB/RoCE v1 IPv4, where the other nodes use RoCE v2 IPv4" \
        in failed.message and "NCCL_IB_GID_INDEX=2 on n02" in failed.remediation


def test_roce_gid_index_past_the_table_and_differing_address_kinds(tmp_path):
    states = recorded_nodes(tmp_path, "roce-node", env={"NCCL_IB_GID_INDEX": "5"})
    results = run_on("RDMA003", states, tmp_path)
    assert {r.status for r in results} == {Status.FAIL} and "no GID at index 5" in results[0].message
    # Index 1 is link-local RoCE v2 on both: the same kind everywhere is still not routed (NVIDIA/nccl#769).
    results = run_on("RDMA003", recorded_nodes(tmp_path / "ll", "roce-node", env={"NCCL_IB_GID_INDEX": "1"}), tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.FAIL), (("n02",), Status.FAIL)}
    assert "mlx5_0:1's GID 1 (NCCL_IB_GID_INDEX=1) is the link-local fe80:" in results[0].message
    assert "not routed" in results[0].message and "NCCL_IB_GID_INDEX=3 on" in results[0].remediation
    ipv4_at_1 = {"sys/class/infiniband/mlx5_0/ports/1/gids/1": "0000:0000:0000:0000:0000:ffff:0a00:010c\n"}
    results = run_on("RDMA003", recorded_nodes(tmp_path / "mixed", "roce-node", {"n02": ipv4_at_1, "n03": ipv4_at_1},
                                     env={"NCCL_IB_GID_INDEX": "1", "NCCL_IB_HCA": "=mlx5_0"},
                                     names=("n01", "n02", "n03")), tmp_path)
    failed = [r for r in results if r.status == Status.FAIL]
    assert [r.nodes for r in failed] == [("n01",)] and "link-local" in failed[0].message


def test_nccl_chooses_the_gid_when_the_index_is_negative_or_unset(tmp_path):
    """NCCL_IB_GID_INDEX=-1 is NCCL's own default: it chooses (ncclIbGetGidIndex)."""
    results = run_on("RDMA003", recorded_nodes(tmp_path, "roce-node", env={"NCCL_IB_GID_INDEX": "-1"}), tmp_path)
    assert {r.status for r in results} == {Status.PASS} and "GID 3" in results[0].message


def test_ipv6_roce_v2_gids_with_nccl_ib_addr_family(tmp_path):
    v6 = {"sys/class/infiniband/mlx5_0/ports/1/gids/4": "fd00:0000:0000:0000:0000:0000:0000:0011\n",
          "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/4": "RoCE v2\n",
          "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/ndevs/4": "ens1f0np0\n"}
    env = {"NCCL_IB_GID_INDEX": "4", "NCCL_IB_HCA": "=mlx5_0"}
    assert {r.status for r in run_on("RDMA003", recorded_nodes(tmp_path, "roce-node", {"n01": v6, "n02": v6}, env=env),
                                  tmp_path)} == {Status.PASS}


def test_an_odd_gid_folder_entry_loses_nothing(tmp_path):
    odd = {"sys/class/infiniband/mlx5_0/ports/1/gids/foo": "fe80::1\n"}
    fabric = fabric_facts(tmp_path, "roce-node", odd)
    assert [g["index"] for g in fabric["rdma"]["mlx5_0"]["ports"]["1"]["gids"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("value,used", [("1", False), ("0", True), ("false", True), ("00", True), ("2", False)])
def test_nccl_ib_disable_as_nccl_reads_it(tmp_path, value, used):
    results = run_on("RDMA001", recorded_nodes(tmp_path, "ib-node", env={"NCCL_IB_DISABLE": value}), tmp_path)
    assert {r.status for r in results} == ({Status.PASS} if used else {Status.SKIP})


def test_gpudirect_rdma_off_without_peermem(tmp_path):
    no_peermem = {"proc/modules": "nvidia 56463360 0 - Live 0x0\nmlx5_ib 446464 0 - Live 0x0\n",
                  "sys/module/nvidia_peermem/version": None, "sys/kernel/mm/memory_peers/nv_mem/version": None}
    results = run_on("RDMA004", recorded_nodes(tmp_path, "ib-node", {"n02": no_peermem}), tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}
    assert "modprobe nvidia_peermem on n02" in next(r for r in results if r.status == Status.WARN).remediation


def test_hca_firmware_differs(tmp_path):
    old = {"sys/class/infiniband/mlx5_0/fw_ver": "28.35.2000\n", "sys/class/infiniband/mlx5_1/fw_ver": "28.35.2000\n"}
    results = run_on("RDMA005", recorded_nodes(tmp_path, "ib-node", {"n02": old}), tmp_path)
    assert [(r.status, r.nodes) for r in results] == [(Status.WARN, ("n02",))]
    assert "28.35.2000" in results[0].message and "28.39.1002" in results[0].remediation


def test_link_error_counters(tmp_path):
    errors = {IB0 + "counters/link_downed": "3\n", IB0 + "counters/symbol_error": "1187\n"}
    results = run_on("RDMA006", recorded_nodes(tmp_path, "ib-node", {"n02": errors}), tmp_path)
    assert statuses_by_nodes(results) == {(("n01",), Status.PASS), (("n02",), Status.WARN)}
    assert "mlx5_0:1: link_downed 3, symbol_error 1187" in next(r for r in results if r.status == Status.WARN).message


def test_explain_covers_the_fabric_and_driver_checks(capsys):
    for check_id in RDMA_CHECKS + ("PKG006", "PKG007", "PKG008", "GPU008"):
        code, out, _ = run_cli(capsys, "explain", check_id)
        spec = SPECS[check_id]
        assert code == 0 and check_id in out and spec.name in out and len(out.split("\n\n")) >= 3, out


@pytest.mark.parametrize("fabric", [
    {"rdma": [], "modules": 5, "nccl": "x", "xid": []},
    {"rdma": {"mlx5_0": "x"}, "nccl": {}},
    {"rdma": {"mlx5_0": {"ports": {"1": {"gids": "x", "counters": [], "rate_gbps": "x"}}}}, "nccl": {}},
    {"rdma": {}, "nccl": {}, "xid": {"readable": True, "events": ["x", {"pci": 5}]}},
], ids=["lists-and-strings", "device-a-string", "port-fields", "xid-events"])
def test_fabric_facts_of_the_wrong_shape_are_the_nodes_error_not_a_check_defect(tmp_path, fabric):
    """A node (or what answers for it) that sends another shape: each fabric check says so, naming the node,
    and the cluster checks still compare the other nodes."""
    states = recorded_nodes(tmp_path, "ib-node", names=("n01", "n02", "n03"))
    states["n02"]["facts"]["fabric"] = fabric
    states["n02"]["facts"] = gather.checked_facts(json.loads(json.dumps(states["n02"]["facts"])))
    for check_id in ("RDMA001", "RDMA004", "RDMA006", "GPU008", "PKG006", "RDMA002", "RDMA005"):  # (PKG007: no CUDA torch)
        results = runner.run([SPECS[check_id]], runner.CheckContext(build_plan(nodes=tuple(states)), states, {}))
        assert not [r for r in results if "raised" in r.message], (check_id, [r.message for r in results])
        errors = [r for r in results if r.status == Status.ERROR]
        assert [r.nodes for r in errors] == [("n02",)] and "not the collector's" in errors[0].message, check_id
        assert {r.status for r in results} - {Status.ERROR} == {Status.PASS}, (check_id, [r.message for r in results])


# --- hostile values in every fabric fact: refused by the shapes, or judged; never a check's defect ------------

def _shipped(states, node, fabric):
    """states, with `node`'s fabric replaced and its facts held to the shapes as they arrive from a node."""
    facts = dict(states[node]["facts"], fabric=fabric)
    states[node] = dict(states[node], facts=gather.checked_facts(json.loads(json.dumps(facts))))
    return states


def test_an_empty_gid_entry_is_the_nodes_malformed_fact_not_a_check_defect(tmp_path):
    states = recorded_nodes(tmp_path, "roce-node", env={"NCCL_IB_GID_INDEX": "3"})
    fabric = json.loads(json.dumps(states["n02"]["facts"]["fabric"]))
    fabric["rdma"]["mlx5_0"]["ports"]["1"]["gids"].append({})
    _shipped(states, "n02", fabric)
    assert runner.failed_sections(states["n02"]["facts"]) == [
        "collector section fabric failed on the node: what the node sent is not the collector's: "
        "fabric.rdma['mlx5_0'].ports['1'].gids[4] has no 'index'"]
    results = runner.run([SPECS["RDMA003"], SPECS["PKG003"]], runner.CheckContext(build_plan(nodes=tuple(states)),
                                                                                   states, {}))
    assert not [r for r in results if "raised" in r.message], [r.message for r in results]
    rdma = {r.nodes: r for r in results if r.id == "RDMA003"}
    assert rdma[("n02",)].status is Status.ERROR and "not evaluated on n02" in rdma[("n02",)].message
    assert rdma[("n01",)].status is Status.PASS  # the healthy node is still judged
    [pkg] = [r for r in results if r.id == "PKG003" and r.status is Status.ERROR]
    assert pkg.nodes == ("n02",) and "gids[4] has no 'index'" in pkg.message and "\n" not in pkg.message


HOSTILE = ({}, [], None, "x", "", float("inf"), float("nan"), -1, 0, 2**63, True, [{}], [None], {"x": {}},
           [[[]]], {"": {"": [{}]}})
HOSTILE_TEXT = ("", " ", "x", "-1", "-99", "2", "999999999999999999999999", "9" * 5000, "1e9", " 3 ", "^", "=", ",,:",
                "^=mlx5_0:99999999999999999999", "mlx5_0:-1", "AF_INET6", "\x00")
NCCL_IB_VARIABLES = ("NCCL_IB_GID_INDEX", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_ROCE_VERSION_NUM",
                     "NCCL_IB_ADDR_FAMILY")
RDMA_CHECKS = ("RDMA001", "RDMA002", "RDMA003", "RDMA004", "RDMA005", "RDMA006", "RDMA007", "RDMA008", "RDMA009",
               "RDMA010")


def _fields(value, path=()):
    """Every path into the fabric facts: each key of an object, each item of a list."""
    if path:
        yield path
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _fields(inner, path + (key,))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from _fields(inner, path + (index,))


def _replaced(doc, path, value):
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


@pytest.mark.parametrize("recording,env", [("roce-node", {}), ("roce-node", {"NCCL_IB_GID_INDEX": "3"}),
                                           ("ib-node", {}), ("hgx-node", {})])
def test_hostile_values_in_every_fabric_field_never_make_an_rdma_check_raise(tmp_path, recording, env):
    """Each field of a node's fabric facts (device, port, GID entry, counter, module list) replaced by each
    hostile value, and NCCL's IB variables set to text NCCL would not expect: what the shapes let through, every
    RDMA check judges without raising (inf and nan too, which only the in-process collector could hand over;
    JSON from a node refuses them); the healthy node beside it is still judged as before."""
    states = recorded_nodes(tmp_path, recording, env=env)
    healthy = json.loads(json.dumps(states["n02"]["facts"]["fabric"]))
    plan = build_plan(nodes=tuple(states))
    let_through = 0
    defects = []
    variants = [(path, value, _replaced(healthy, path, value), env) for path in _fields(healthy) for value in HOSTILE]
    # NCCL's variables are text (the shapes hold env to strings): text NCCL does not read as it expects
    variants += [(("env", name), text, healthy, dict(env, **{name: text})) for name in NCCL_IB_VARIABLES
                 for text in HOSTILE_TEXT]
    for path, value, fabric, node_env in variants:
        if shapes.problem(fabric, shapes.SECTIONS["fabric"], "fabric") is not None:
            continue  # refused when it arrives: that node's failed section (the tests above)
        let_through += 1
        states["n02"] = dict(states["n02"], facts=dict(states["n02"]["facts"], fabric=fabric, env=node_env))
        for check_id in RDMA_CHECKS:
            for r in runner.run([SPECS[check_id]], runner.CheckContext(plan, states, {})):
                if "raised" in r.message or (r.remediation or "").startswith("this is a defect"):
                    defects.append((path, value, r.message))
                elif r.nodes == ("n01",) and r.status not in (Status.PASS, Status.SKIP):
                    defects.append((path, value, "the healthy node", r.message))
    assert not defects, defects[:5]
    assert let_through > 50  # what the shapes let through was judged, not only refused


def test_the_fabric_pages_transcript_is_what_node_prints_on_a_recorded_node(tmp_path, monkeypatch, capsys):
    """docs/fabric.md: `preflight node` on a recorded InfiniBand node (its sysfs, procfs and kernel log, NVML's
    answers) whose second HCA lost its link, without nvidia_peermem, with link errors and GPU 1 fallen off the bus."""
    import socket

    from nvml_fake import fake
    from preflight.node import fabric, gpus
    from sysfs_tree import FIXTURES, lay_out
    from test_gpu import XID_79

    kmsg = json.loads((FIXTURES / "ib-node.json").read_text())["files"]["dev/kmsg"]
    faults = {IB1 + "state": "1: DOWN\n", IB1 + "phys_state": "3: Disabled\n", IB0 + "counters/link_downed": "2\n",
              "proc/modules": "nvidia 56463360 0 - Live 0x0\nmlx5_ib 446464 0 - Live 0x0\n",
              "sys/module/nvidia_peermem/version": None, "sys/kernel/mm/memory_peers/nv_mem/version": None,
              "dev/kmsg": kmsg + XID_79}
    monkeypatch.setattr(fabric, "SYSROOT", str(lay_out(tmp_path / "root", "ib-node", faults)))
    monkeypatch.setattr(gpus, "Nvml", fake("h100x8.json"))
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu01")  # the node's name, as the page shows it
    monkeypatch.setenv("COLUMNS", "120")
    for name in [n for n in os.environ if n.startswith(("NCCL_", "CUDA_VISIBLE"))]:
        monkeypatch.delenv(name)
    code, out, err = run_cli(capsys, *transcripts.command("fabric-node"))
    assert code == 1
    transcripts.held("fabric-node", "$ preflight " + " ".join(transcripts.command("fabric-node")) + "\n" + err + out)
