"""The shape of each facts section (preflight.remote.shapes), held when a node's facts arrive (gather.checked_facts).

Two sides: what the collector really writes (this machine, every NVML recording, every sysfs tree, the census
of a real rank process) is never refused, since a refused section is a node's checks not run; and a value of
another shape anywhere in a node's facts (every key replaced by a value of each other kind, or taken away) is
that node's failed section, reported as such, and never read by a check as a value: no check raises, none
reports a defect of its own, and doctor's census of the job never breaks."""
import copy
import json
import os
import subprocess
import sys
import time
from unittest import mock

import pytest
import yaml

from node_facts import TAKEN, changed, leaves
from nvml_fake import FIXTURES as NVML_FIXTURES
from own_network import own_network
from nvml_fake import fake
from ras_server import RasServer, recorded
from sysfs_tree import FIXTURES as SYSFS_FIXTURES
from sysfs_tree import fabric_facts
from preflight import registry, runner
from preflight.remote import gather
from preflight.job import running as jobcensus
from preflight.job import view as jobview
from preflight.remote import shapes
from preflight.inputs import models
from preflight.node import collector, host, launchfiles
from preflight.node import gpus as gpu_facts
from preflight.plan import build_plan
from preflight.result import Status

SPECS = registry.load().checks
PORT = 29731


def trip(doc):
    return json.loads(json.dumps(doc))  # as it comes from the node


def gpus(recording):
    with mock.patch.object(gpu_facts, "Nvml", fake(recording)):
        return trip(gpu_facts.facts())


@pytest.fixture(scope="module")
def census():
    """The census of a real process with a rank's variables, listening on the job's port, stacks read, and what
    NCCL's RAS at its NCCL_RAS_ADDR answers (a recorded answer: ranks apart in two ops)."""
    code = ("import socket, time\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('127.0.0.1', {PORT})); s.listen()\ntime.sleep(60)\n")
    with own_network(), RasServer(recorded("mismatch", "2.29.7")) as ras_server:  # no other job on this machine
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT),
                   PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
                   NCCL_RAS_ADDR=ras_server.address)
        rank = subprocess.Popen([sys.executable, "-c", code], env=env)
        try:
            time.sleep(1.0)
            with mock.patch.dict(os.environ, {"PATH": env["PATH"]}):
                found = trip(collector.census({"port": PORT, "stacks": True, "deadline_s": 10}))
        finally:
            rank.kill()
            rank.wait()
    assert len(found["nccl_ras"]["answers"][0]["snapshots"]) == 2, found["nccl_ras"]
    # the node's census keeps every launcher on it (the head picks the job): other jobs on this machine stay out
    found["processes"] = [p for p in found["processes"] if p["pid"] == rank.pid]
    assert found["processes"], found
    assert found["processes"][0].get("threads"), found["stacks"]  # py-spy read its stack
    launcher = dict(copy.deepcopy(found["processes"][0]), pid=rank.pid + 100000, ppid=1, kind="launcher",
                    children=[rank.pid], argv=["python", "-m", "torch.distributed.run", "--nnodes", "2",
                                               "--master_port", str(PORT), "train.py"])
    found["processes"].append(launcher)
    return found


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A plan of a DeepSpeed job with its launch command, and the job facts the collector reads for it."""
    tmp = tmp_path_factory.mktemp("job")
    (tmp / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp)}}}))
    (tmp / "acc.yaml").write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "machine_rank": 0, "num_machines": 2,
        "num_processes": 16, "main_process_ip": "10.0.0.1", "main_process_port": PORT, "mixed_precision": "bf16",
        "deepspeed_config": {"deepspeed_config_file": str(tmp / "ds.json"), "zero3_init_flag": True}}))
    (tmp / "train.py").write_text("print('train')\n")
    command = ("accelerate", "launch", "--config_file", str(tmp / "acc.yaml"), str(tmp / "train.py"))
    plan = build_plan(config=str(tmp / "acc.yaml"), nodes=("n01", "n02"), command=command, checkpoint_dir=str(tmp),
                      memory=models.Inputs(model=models.resolve("7B")))
    return plan, trip(launchfiles.facts(jobview.request(plan))), tmp


@pytest.fixture(scope="module")
def node_facts(job, census, tmp_path_factory):
    """A full node's facts: this machine's, with 8 recorded H100s, a recorded InfiniBand fabric, the job
    and a census."""
    plan, job_facts, tmp = job
    doc = trip(collector.collect({"head": "127.0.0.1", "port": PORT, "paths": {"checkpoint": str(tmp)}}))
    doc["fabric"] = trip(fabric_facts(tmp_path_factory.mktemp("sys"), "ib-node"))
    doc["host"]["rdma_devices"] = sorted(doc["fabric"]["rdma"])
    doc["env"] = {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "eth0", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    doc["gpus"] = gpus("h100x8.json")
    doc["job"], doc["census"] = job_facts, census
    return doc


# --- what the collector writes is never refused -------------------------------------------------------

def untouched(doc):
    assert gather.checked_facts(copy.deepcopy(doc)) == doc
    assert runner.failed_sections(doc) == []


@pytest.mark.parametrize("recording", sorted(p.name for p in NVML_FIXTURES.glob("*.json")))
def test_the_gpus_of_every_nvml_recording_are_of_their_shape(node_facts, recording):
    untouched(dict(copy.deepcopy(node_facts), gpus=gpus(recording)))


@pytest.mark.parametrize("recording", sorted(p.stem for p in SYSFS_FIXTURES.glob("*.json")))
def test_the_fabric_of_every_sysfs_tree_is_of_its_shape(node_facts, tmp_path, recording):
    untouched(dict(copy.deepcopy(node_facts), fabric=trip(fabric_facts(tmp_path, recording))))


def test_this_machines_facts_a_job_and_a_real_census_are_of_their_shape(node_facts):
    untouched(node_facts)
    bare = trip(collector.collect({"head": "no-such-host.invalid", "port": PORT, "paths": {"gone": "/no/such/dir"}}))
    untouched(bare)  # a head that does not resolve, a path that does not exist, no GPU driver
    assert bare["storage"]["gone"] == {"path": "/no/such/dir", "exists": False}


def test_an_interpreter_that_does_not_know_its_own_path_is_of_its_shape(node_facts):
    """sys.executable is None where Python cannot tell its own path (documented): the python section holds it."""
    with mock.patch.object(sys, "executable", None):
        python = trip(host.python())
    assert python["executable"] is None
    untouched(dict(copy.deepcopy(node_facts), python=python))


# --- a value of another shape anywhere ----------------------------------------------------------------

OTHER_VALUES = ("text", 7, True, None, [], {"x": 1})
def run_all(plan, states):
    """Every check (doctor's RUN checks with the census built from the facts, as doctor builds it)."""
    census = jobcensus.build(tuple(states), states, None)
    ctx = runner.CheckContext(plan, states, {"census": census})
    return runner.run(SPECS, ctx)


@pytest.mark.parametrize("section", sorted(set(shapes.SECTIONS) | {"job"}))
def test_a_value_of_another_shape_is_the_nodes_failed_section_never_a_defect(job, node_facts, section):
    plan = job[0]
    good = {"n01": {"facts": node_facts, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}}
    defects, refused = [], 0
    for path in leaves(node_facts[section], (section,)):
        for value in OTHER_VALUES + (TAKEN,):
            try:
                facts = gather.checked_facts(changed(node_facts, path, value))
            except Exception as exc:  # only a NodeError, for the top level: that node's failure
                assert isinstance(exc, gather.NodeError) and len(path) == 1, (path, value, exc)
                continue
            refused += bool(runner.failed_sections(facts))
            states = dict(good, n02=dict(good["n01"], facts=facts))
            try:
                results = run_all(plan, states)
            except Exception as exc:
                defects.append((path, value, f"raised {type(exc).__name__}: {exc}"))
                continue
            defects += [(path, value, r.id, r.message) for r in results
                        if (r.remediation or "").startswith("this is a defect in the check") or "raised" in r.message]
    assert not defects, defects[:5]
    if section in shapes.SECTIONS:  # (the job section is read key by key where it is used: preflight.job.view)
        assert refused, "no value of another shape was refused: the shapes do not cover this section"


def test_a_refused_section_is_named_by_pkg003_and_the_checks_that_read_it(job, node_facts):
    plan = job[0]
    bad = changed(node_facts, ("gpus", "devices", 3, "name"), 80)
    facts = gather.checked_facts(bad)
    state = {"error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}
    states = {"n01": dict(state, facts=node_facts), "n02": dict(state, facts=facts)}
    results = run_all(plan, states)
    pkg003 = [r for r in results if r.id == "PKG003" and r.status is Status.ERROR]
    assert [r.nodes for r in pkg003] == [("n02",)]
    assert "gpus.devices[3].name is a number" in pkg003[0].message and "not the collector's" in pkg003[0].message
    gpu001 = {r.nodes: r for r in results if r.id == "GPU001"}
    assert gpu001[("n02",)].status is Status.ERROR and "not evaluated on n02" in gpu001[("n02",)].message
    assert gpu001[("n01",)].status is Status.PASS  # the other node is checked as usual
    assert {r.status for r in results if r.id == "PKG001"} == {Status.PASS}  # the node's other sections too


@pytest.mark.parametrize("section,value,expected", [
    ("gpus", {"available": True, "devices": [{"index": 0, "name": 80}]}, "gpus.devices[0].name is a number"),
    ("gpus", {"available": True, "devices": [{"name": "H100"}]}, "gpus.devices[0] has no 'index'"),
    ("gpus", {"available": "yes"}, "gpus.available is a string"),
    ("host", {"route_to_head": {"head": "10.0.0.1", "source": 5, "interface": "eth0"}}, "host.route_to_head.source is a number"),
    ("host", {"route_to_head": {"error": ["unreachable"], "head": "10.0.0.1"}}, "host.route_to_head has no 'source'"),
    ("host", {"resolves_to": {"addresses": []}}, "host.resolves_to has no 'error'"),
    ("storage", {"shm": {"path": "/dev/shm", "exists": True, "total_bytes": 1}}, "storage['shm'] has no 'free_bytes'"),
    ("storage", {"shm": {"path": "/dev/shm", "exists": "no"}}, "storage['shm'].exists is not True"),
    ("limits", {"nofile": [1024, None, 3]}, "limits['nofile'] has 3 items, not 2"),
    ("env", {"NCCL_IB_HCA": ["mlx5_0"]}, "env['NCCL_IB_HCA'] is a list"),
    ("memory", {"total_bytes": True}, "memory.total_bytes is a boolean"),
    ("fabric", {"rdma": {"mlx5_0": {"ports": {"1": {"counters": {"link_downed": "0"}}}}}},
     "fabric.rdma['mlx5_0'].ports['1'].counters['link_downed'] is a string"),
    ("fabric", {"rdma": {"mlx5_0": {"ports": {"1": {"gids": [{}]}}}}}, "fabric.rdma['mlx5_0'].ports['1'].gids[0] has no 'index'"),
    ("fabric", {"rdma": {"mlx5_0": {"ports": {"1": {"gids": [{"index": 3}]}}}}},
     "fabric.rdma['mlx5_0'].ports['1'].gids[0] has no 'gid'"),
    ("census", {"processes": [{"pid": 7, "threads": [{"frames": [["f", "x.py"]]}]}]},
     "census.processes[0].threads[0].frames[0] has 2 items, not 3"),
    ("census", {"processes": [{"pid": n} for n in range(257)]},
     "census.processes has 257 items, more than the 256 the collector sends"),
])
def test_what_is_wrong_is_said_with_its_path(section, value, expected):
    assert shapes.problem(value, shapes.SECTIONS[section], section) == expected


def test_a_value_of_the_right_shape_has_no_problem():
    assert shapes.problem({"route_to_head": {"error": "unreachable", "head": "10.0.0.1"}, "resolves_to": ["10.0.0.2"]},
                          shapes.SECTIONS["host"], "host") is None
    assert shapes.problem({"shm": {"path": "/dev/shm", "exists": False}}, shapes.SECTIONS["storage"], "storage") is None
    assert shapes.problem(None, shapes.SECTIONS["fabric"], "fabric") is None


def test_a_census_of_more_processes_than_the_collector_lists_is_refused_not_paired_up(job, node_facts):
    """The collector lists at most census.MAX_PROCESSES processes; a node that sends 5,000 is that node's failed
    census, refused before the RUN checks compare each process with the others (seconds per thousand)."""
    many = [dict(node_facts["census"]["processes"][0], pid=100000 + n) for n in range(5000)]
    facts = gather.checked_facts(trip(changed(node_facts, ("census", "processes"), many)))
    assert runner.failed_sections(facts) == ["collector section census failed on the node: what the node sent is not "
                                             "the collector's: census.processes has 5000 items, more than the 256 the "
                                             "collector sends"]
    state = {"error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}
    started = time.perf_counter()
    run_all(job[0], {"n01": dict(state, facts=node_facts), "n02": dict(state, facts=facts)})
    assert time.perf_counter() - started < 5
