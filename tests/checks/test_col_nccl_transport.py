"""COL003: which transport NCCL chose, from its INFO lines (preflight.collective.nccllog on the recorded logs in
tests/fixtures/nccl), the worker's part that runs without a GPU (its NCCL_DEBUG, its line filter, the lines it
sends, with a stand-in torch that prints as NCCL does), and the check over probe documents built as
preflight.collective.allreduce builds them, with the nodes' fabric facts from recorded sysfs trees."""
import pathlib

import pytest

from fabric_nodes import node
from preflight import runner
from preflight.collective import nccllog
from preflight.node import allreduce as colworker
from preflight.plan import Plan
from preflight.remote import shapes
from preflight.result import Status
from test_col import MIB, RESULT, SPECS, drive, finish, probe, rank, start_worker

LOGS = pathlib.Path(__file__).parents[1] / "fixtures" / "nccl"
NODES = ("n01", "n02", "n03")


def log(name):
    return (LOGS / f"{name}.log").read_text()


# --- what NCCL says, parsed on the head -------------------------------------------------------------

def test_infiniband_with_gpudirect_rdma():
    found = nccllog.summary(log("ib"))
    assert found["network"] == "IB" and found["channels"] == ["NET/IB"] and found["gdr"] is True
    assert found["ib_devices"] and all(d.startswith("mlx5_") for d in found["ib_devices"])
    assert found["version"].startswith("2.") and not nccllog.over_sockets(found)


def test_no_device_found_falls_back_to_sockets():
    found = nccllog.summary(log("socket-fallback"))
    assert found["network"] == "Socket" and nccllog.over_sockets(found) and found["ib_devices"] == []
    assert any("NET/IB : No device found." in line for line in found["lines"])


def test_a_net_plugin_over_roce_without_gpudirect_rdma():
    found = nccllog.summary(log("roce-plugin-no-gdr"))
    assert found["network"] == "IBext_v8" and found["gdr"] is False and not nccllog.over_sockets(found)
    assert found["ib_devices"] == ["mlx5_0:1", "mlx5_1:1"]


def test_no_info_lines_say_nothing():
    found = nccllog.summary("NCCL WARN something\nplain output\n")
    assert found["network"] is None and found["channels"] == [] and found["gdr"] is None


# --- the worker: its filter, its environment, the lines it sends ------------------------------------

NOISE = ("[W1201 socket.cpp:469] [c10d] waitForInput: poll returned 0\n"
         "node02:1:1 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 busId 18000 - Init START\n"
         "node02:1:1 [0] NCCL INFO Connected all rings\n")


@pytest.mark.parametrize("name", ["ib", "socket-fallback", "roce-plugin-no-gdr"])
def test_the_worker_keeps_every_line_the_head_reads(tmp_path, name):
    path = tmp_path / "rank0.log"
    path.write_text(NOISE + log(name) + NOISE)
    kept = colworker.nccl_lines(str(path))
    assert not any("Init START" in line or "Connected all rings" in line or "c10d" in line for line in kept)
    whole = nccllog.summary(log(name))
    assert nccllog.summary("\n".join(kept)) == whole


def test_the_worker_sends_few_short_lines(tmp_path):
    path = tmp_path / "rank0.log"
    path.write_text("".join(f"n:1:1 [0] NCCL INFO Channel {i:02d}/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA "
                            + "x" * 1000 + "\n" for i in range(100)))
    kept = colworker.nccl_lines(str(path))
    assert len(kept) == colworker.NCCL_MAX_LINES and all(len(line) == colworker.NCCL_LINE_CHARS for line in kept)
    assert colworker.nccl_lines(str(tmp_path / "missing.log")) == []


# A stand-in torch: it prints through the C library, as NCCL does, what NCCL prints and the NCCL variables it
# was given, then fails to import.
FAKE_TORCH = '''
import ctypes, os
text = open(os.environ["FAKE_NCCL_LOG"]).read()
text += "env NCCL_DEBUG=%s NCCL_DEBUG_SUBSYS=%s NCCL_DEBUG_FILE=%s\\n" % tuple(
    os.environ.get(k) for k in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"))
ctypes.CDLL(None).printf(b"%s", text.encode())
raise ImportError("no GPU here (preflight test)")
'''


def fake_worker(tmp_path, backend, **env):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (tmp_path / "nccl.log").write_text(NOISE + log("ib"))
    proc = start_worker([0, 1], 2, backend=backend, env=dict(env, PYTHONPATH=str(tmp_path),
                                                              FAKE_NCCL_LOG=str(tmp_path / "nccl.log")))
    return finish(proc)["ranks"]


def test_with_nccl_the_ranks_print_init_and_net_info_and_local_rank_0_sends_the_lines(tmp_path):
    first, second = fake_worker(tmp_path, "nccl", NCCL_DEBUG_FILE="/tmp/elsewhere.%h.%p")
    for r in (first, second):
        assert "env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE=None" in r["tail"]
    assert first["nccl"] == {"lines": colworker.nccl_lines(str(tmp_path / "nccl.log")), "debug": None}
    assert nccllog.summary("\n".join(first["nccl"]["lines"]))["network"] == "IB"
    assert "nccl" not in second  # one node, one set of lines
    assert shapes.worker_report_problem({"ok": False, "ranks": [first, second]}, [0, 1]) is None


def test_the_users_nccl_debug_is_kept_and_said(tmp_path):
    first, _ = fake_worker(tmp_path, "nccl", NCCL_DEBUG="WARN", NCCL_DEBUG_FILE="/dev/null")
    assert "env NCCL_DEBUG=WARN NCCL_DEBUG_SUBSYS=None NCCL_DEBUG_FILE=/dev/null" in first["tail"]
    assert first["nccl"]["debug"] == "WARN"


def test_gloo_ranks_get_no_nccl_setting(tmp_path):
    first, second = fake_worker(tmp_path, "gloo")
    assert "env NCCL_DEBUG=None NCCL_DEBUG_SUBSYS=None" in first["tail"]
    assert "nccl" not in first and "nccl" not in second


@pytest.mark.parametrize("nccl", ["IB", [], {"lines": "x"}, {"lines": [1]}, {"lines": [], "debug": 3},
                                  # more or longer lines than the worker sends: the head's parser is not made to
                                  # chew on them (one 700 kB line of repeated channel heads took it 30 s)
                                  {"lines": ["NCCL INFO Channel a : " * 32000]},
                                  {"lines": ["NCCL INFO NET/IB : Using [0]mlx5_0:1/IB"] * 41}])
def test_a_report_with_wrong_nccl_lines_is_the_nodes_protocol_failure(nccl):
    report = {"ok": True, "ranks": [dict(rank(0), sizes=[], skipped_sizes=[MIB], nccl=nccl)]}
    said = shapes.worker_report_problem(report, [0])
    assert said.startswith("the report.ranks[0].nccl is ") and said.endswith(", not null or an object of lines (at most "
                                                                            "40, of 300 characters each) and a debug text")


# --- COL003 over probe documents built as preflight.collective.allreduce builds them --------------------------

def nccl_probe(logs, debug=None):
    """The all-reduce's probe after a passing NCCL run whose local ranks 0 printed these logs."""
    def outcome(names):
        return [[dict(rank(i), nccl={"lines": logs[n].splitlines(), "debug": debug.get(n) if debug else None})]
                for i, n in enumerate(names)]

    doc, _ = drive(outcome)
    return probe(backend="nccl", result=dict(RESULT, nccl=doc["result"]["nccl"]))


def col003(tmp_path, doc, recordings=None, env=None, changes=None):
    recordings = recordings or {}
    states = {n: node(tmp_path, n, recordings.get(n, "ib-node"), (changes or {}).get(n), (env or {}).get(n))
              for n in NODES}
    context = runner.CheckContext(Plan(nodes=NODES, remote=True), states, {"collective": doc})
    return {(r.status, r.nodes): r for r in runner.run_check(SPECS["COL003"], context)}


def test_infiniband_everywhere_passes_with_the_network_named(tmp_path):
    results = col003(tmp_path, nccl_probe({n: log("ib") for n in NODES}))
    [(key, result)] = results.items()
    assert key == (Status.PASS, NODES) and result.message == "NCCL network IB with GPUDirect RDMA"


def test_a_node_that_fell_back_to_sockets_with_hcas_is_warned_with_the_lines(tmp_path):
    doc = nccl_probe(dict({n: log("ib") for n in NODES}, n02=log("socket-fallback")))
    results = col003(tmp_path, doc)
    warned = results[(Status.WARN, ("n02",))]
    assert "TCP sockets" in warned.message and "mlx5_0, mlx5_1" in warned.message
    assert "NET/IB : No device found." in " ".join(warned.evidence["lines"])
    assert "RDMA001" in warned.remediation and "NCCL_IB_HCA" in warned.remediation
    assert (Status.PASS, ("n01", "n03")) in results


@pytest.mark.parametrize("recording,env", [
    ("no-rdma", None),  # no HCA: sockets is all there is
    ("ib-node", {"NCCL_IB_DISABLE": "1"}),  # told not to use them
    ("ib-node", {"NCCL_IB_HCA": "=mlx5_7"}),  # selects no HCA (NET005)
])
def test_sockets_without_an_hca_nccl_may_use_is_no_finding(tmp_path, recording, env):
    doc = nccl_probe(dict({n: log("ib") for n in NODES}, n02=log("socket-fallback")))
    results = col003(tmp_path, doc, {"n02": recording}, {"n02": env})
    assert {s for s, _ in results} == {Status.PASS}, results
    assert "TCP sockets" in results[(Status.PASS, ("n02",))].message


def test_a_plugin_without_gpudirect_rdma_on_nodes_with_hcas_warns_and_points_to_rdma004(tmp_path):
    doc = nccl_probe({n: log("roce-plugin-no-gdr") for n in NODES})
    results = col003(tmp_path, doc, {n: "roce-node" for n in NODES})
    assert sorted(results) == [(Status.WARN, (n,)) for n in NODES], results
    for (_, (node,)), result in results.items():
        assert result.message.startswith(f"NCCL network IBext_v8 without GPUDirect RDMA on {node}, which has HCAs")
        assert "RDMA004" in result.remediation and result.evidence["rdma_devices"]


def test_the_users_nccl_debug_without_the_lines_is_a_skip_that_says_so(tmp_path):
    doc = nccl_probe(dict({n: log("ib") for n in NODES}, n03=""), debug={"n03": "WARN"})
    results = col003(tmp_path, doc)
    skipped = results[(Status.SKIP, ("n03",))]
    assert "NCCL_DEBUG=WARN" in skipped.message and "may be missing" in skipped.message
    assert (Status.PASS, ("n01", "n02")) in results


def test_gloo_skips_with_the_reason_and_a_failed_nccl_run_waits_for_col001(tmp_path):
    [gloo] = col003(tmp_path, probe()).values()
    assert gloo.status == Status.SKIP and "gloo, not NCCL" in gloo.message
    blamed = {"n03": {"kind": "import", "stage": "import", "error": "cannot import torch"}}
    [failed] = col003(tmp_path / "nccl", probe(backend="nccl", result=None, passed=[], blamed=blamed)).values()
    assert failed.status == Status.SKIP and failed.evidence["blocked_by"] == "COL001"
