"""Node and cluster checks over facts: the real collector's document of this machine, altered per node."""
import copy
import json
import os
import shlex
import subprocess
import sys

import pytest

from preflight import registry, runner
from preflight.inputs import inventory
from preflight.remote import shipping
from preflight.node import collector
from preflight.inputs.documents import InputError
from preflight.plan import Limits, Plan
from preflight.result import Status

NODES = ("n01", "n02", "n03")
BASE = collector.collect({"head": "127.0.0.1", "port": 29500, "paths": {}})
SPECS = {c.id: c for c in registry.load().checks}


def facts(**per_node):
    """Three healthy nodes; per_node maps a node to a function that alters its facts state."""
    states = {}
    for node in NODES:
        doc = copy.deepcopy(BASE)
        doc["host"].update(hostname=node, resolves_to=["10.0.0.%d" % (NODES.index(node) + 1)],
                           head_resolves_to=["10.0.0.1"],
                           interfaces={"lo": ["127.0.0.1"], "eth0": ["10.0.0.%d" % (NODES.index(node) + 1)]},
                           route_to_head={"head": "10.0.0.1", "source": "10.0.0.%d" % (NODES.index(node) + 1),
                                          "interface": "eth0"}, rdma_devices=[])
        doc["clock"].update(synchronised=True, esterror_s=0.001)
        state = {"facts": doc, "error": None, "clock": {"offset_s": 0.0, "bound_s": 0.0005, "rtt_s": 0.001}}
        if node in per_node:
            per_node[node](state)
        states[node] = state
    return states


def run(check_id, states=None, probes=None, plan=None):
    plan = plan or Plan(nodes=NODES, remote=True)
    ctx = runner.CheckContext(plan, states if states is not None else facts(), probes or {})
    return runner.run_check(SPECS[check_id], ctx)


def by_node(results):
    return {node: r for r in results for node in r.nodes}


# --- SSH and unreachable nodes ---------------------------------------------------------------------

@pytest.mark.parametrize("kind,phrase", [("refused", "connection refused"), ("timeout", "timed out"),
                                         ("no-banner", "no SSH banner"), ("auth", "authentication failed"),
                                         ("host-key-unknown", "unknown host key"), ("unresolved", "name not resolved")])
def test_ssh_failure_names_the_reason(kind, phrase):
    def down(state):
        state.update(facts=None, error={"kind": kind, "message": "m", "remediation": "r"})

    results = by_node(run("SSH001", facts(n02=down)))
    assert results["n02"].status == Status.FAIL and phrase in results["n02"].message
    assert results["n01"].status == Status.PASS and results["n03"].status == Status.PASS


def test_an_unreachable_node_skips_its_node_checks_with_the_reason():
    def down(state):
        state.update(facts=None, error={"kind": "refused", "message": "10.0.0.2:22 refused", "remediation": "r"})

    results = by_node(run("FS001", facts(n02=down)))
    assert results["n02"].status == Status.SKIP and "10.0.0.2:22 refused" in results["n02"].message
    assert results["n01"].status == Status.PASS


# --- NET ---------------------------------------------------------------------------------------------

def test_hostname_resolving_to_loopback_fails_on_a_multi_node_job():
    def debian(state):
        state["facts"]["host"]["resolves_to"] = ["127.0.1.1"]

    results = by_node(run("NET001", facts(n02=debian)))
    assert results["n02"].status == Status.FAIL and "127.0.1.1" in results["n02"].message
    assert results["n01"].status == Status.PASS


def test_hostname_resolving_to_loopback_is_fine_for_this_machine_alone():
    def local(state):
        state["facts"]["host"]["resolves_to"] = ["127.0.0.1"]

    states = {"n01": facts(n01=local)["n01"]}
    [result] = run("NET001", states, plan=Plan(nodes=("n01",), remote=False))
    assert result.status == Status.PASS and "one-node" in result.message


def test_hostname_resolving_to_a_foreign_address_fails():
    def stale(state):
        state["facts"]["host"]["resolves_to"] = ["10.9.9.9"]

    assert by_node(run("NET001", facts(n03=stale)))["n03"].status == Status.FAIL


def test_a_node_resolving_the_head_elsewhere_is_named():
    def stale(state):
        state["facts"]["host"]["head_resolves_to"] = ["10.0.0.99"]

    results = by_node(run("NET002", facts(n03=stale)))
    assert results["n03"].status == Status.FAIL and "10.0.0.99" in results["n03"].message
    assert "10.0.0.1" in results["n03"].message and results["n02"].status == Status.PASS


def test_main_port_taken_names_the_holder():
    probes = {"port": {"head": "n01", "listen": {"bound": False, "error": "Address already in use",
                                                  "holders": [{"pid": 4242, "command": "python old_job.py"}]}}}
    [result] = run("NET003", probes=probes)
    assert result.status == Status.FAIL and "4242" in result.message and "old_job.py" in result.message
    probes["port"]["listen"] = {"bound": True}
    assert [r.status for r in run("NET003", probes=probes)] == [Status.PASS]


def test_main_port_unreachable_from_a_worker_is_named():
    probes = {"port": {"head": "n01", "listen": {"bound": True}, "workers": {
        "n02": {"ok": True, "address": "10.0.0.1"},
        "n03": {"ok": False, "error": "timed out after 10s", "address": "10.0.0.1"}}}}
    results = by_node(run("NET004", probes=probes))
    assert results["n03"].status == Status.FAIL and "timed out" in results["n03"].message
    assert results["n02"].status == Status.PASS


@pytest.mark.parametrize("spec,nccl,expected", [
    ("eth", True, ["eth0", "eth1"]),
    ("=eth0", True, ["eth0"]),
    ("^eth", True, ["lo", "ib0"]),
    ("^=eth0", True, ["lo", "eth1", "ib0"]),
    ("ib,eth1", True, ["eth1", "ib0"]),
    ("eth", False, []),  # gloo wants exact names
    ("eth1,ib0", False, ["eth1", "ib0"]),
])
def test_socket_ifname_selection_rules(spec, nccl, expected):
    from preflight.job.view import selected_interfaces

    assert selected_interfaces(spec, ["lo", "eth0", "eth1", "ib0"], nccl) == expected


def test_socket_ifname_selecting_nothing_fails():
    def typo(state):
        state["facts"]["env"]["NCCL_SOCKET_IFNAME"] = "ens5"

    results = by_node(run("NET005", facts(n02=typo)))
    assert results["n02"].status == Status.FAIL and "ens5" in results["n02"].message
    assert results["n01"].status == Status.SKIP


# --- CLK ---------------------------------------------------------------------------------------------

def test_clock_offsets_against_the_head():
    def ahead(seconds):
        def shift(state):
            state["clock"]["offset_s"] = seconds
        return shift

    results = by_node(run("CLK001", facts(n02=ahead(5.0), n03=ahead(0.25))))
    assert results["n02"].status == Status.FAIL and "+5.000 s" in results["n02"].message
    assert results["n02"].evidence["offset_s"] == pytest.approx(5.0)
    assert results["n02"].evidence["bound_s"] == pytest.approx(0.001)
    assert results["n03"].status == Status.WARN
    limits = Limits(clock_warn_s=0.5, clock_fail_s=10)
    results = by_node(run("CLK001", facts(n02=ahead(5.0), n03=ahead(0.25)), plan=Plan(nodes=NODES, remote=True,
                                                                                       limits=limits)))
    assert results["n02"].status == Status.WARN and results["n03"].status == Status.PASS


def test_unsynchronised_kernel_clock_warns():
    def unsync(state):
        state["facts"]["clock"]["synchronised"] = False

    results = by_node(run("CLK002", facts(n01=unsync)))
    assert results["n01"].status == Status.WARN and results["n02"].status == Status.PASS


# --- PKG ---------------------------------------------------------------------------------------------

def test_the_odd_version_is_named_by_majority():
    def old(state):
        state["facts"]["packages"]["versions"]["accelerate"] = "0.34.2"

    results = [r for r in run("PKG001", facts(n03=old)) if r.status == Status.FAIL]
    assert len(results) == 1 and results[0].nodes == ("n03",)
    assert "0.34.2" in results[0].message and BASE["packages"]["versions"]["accelerate"] in results[0].message


def test_other_distributions_that_differ_warn():
    def extra(state):
        state["facts"]["packages"]["distributions"]["flash-attn"] = "2.5.0"

    results = by_node(run("PKG002", facts(n02=extra)))
    assert results["n02"].status == Status.WARN and "flash-attn" in results["n02"].message


def test_missing_interpreter_and_workdir_fail():
    def no_python(state):
        state.update(facts=None, error={"kind": "python-missing", "message": "the interpreter /opt/py does not exist",
                                        "remediation": "pass --python"})

    def no_workdir(state):
        state["facts"]["storage"]["workdir"] = {"path": "/home/me/job", "exists": False}

    results = by_node(run("PKG003", facts(n02=no_python, n03=no_workdir)))
    assert results["n02"].status == Status.FAIL and "/opt/py" in results["n02"].message
    assert results["n03"].status == Status.FAIL and "/home/me/job" in results["n03"].message
    assert results["n01"].status == Status.PASS


def test_environment_differences():
    def nccl(state):
        state["facts"]["env"]["NCCL_IB_DISABLE"] = "1"

    def omp(state):
        state["facts"]["env"]["OMP_NUM_THREADS"] = "4"

    results = run("PKG004", facts(n02=nccl, n03=omp))
    statuses = {(r.nodes, r.status) for r in results}
    assert (("n02",), Status.FAIL) in statuses and (("n03",), Status.WARN) in statuses


# --- FS and SYS ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,status", [(64 * 2**20, Status.FAIL), (768 * 2**20, Status.WARN),
                                         (2 * 2**30, Status.PASS)])
def test_dev_shm_size(size, status):
    def shm(state):
        state["facts"]["storage"]["shm"].update(total_bytes=size, free_bytes=size)

    assert by_node(run("FS001", facts(n02=shm)))["n02"].status == status


def test_checkpoint_dir_missing_or_read_only_fails():
    def missing(state):
        state["facts"]["storage"]["checkpoint_dir"] = {"path": "/ckpt", "exists": False}

    def read_only(state):
        state["facts"]["storage"]["checkpoint_dir"] = {"path": "/ckpt", "exists": True, "writable": False,
                                                       "free_bytes": 2**40, "total_bytes": 2**40}

    def fine(state):
        state["facts"]["storage"]["checkpoint_dir"] = {"path": "/ckpt", "exists": True, "writable": True,
                                                       "free_bytes": 2**40, "total_bytes": 2**40}

    plan = Plan(nodes=NODES, remote=True, checkpoint_dir="/ckpt")
    results = by_node(run("FS002", facts(n01=fine, n02=missing, n03=read_only), plan=plan))
    assert [results[n].status for n in NODES] == [Status.PASS, Status.FAIL, Status.FAIL]


def test_limits_and_memory():
    def low_nofile(state):
        state["facts"]["limits"]["nofile"] = [1024, 4096]

    assert by_node(run("SYS001", facts(n02=low_nofile)))["n02"].status == Status.WARN

    def rdma(state):
        state["facts"]["host"]["rdma_devices"] = ["mlx5_0"]
        state["facts"]["limits"]["memlock"] = [65536, 65536]

    results = by_node(run("SYS002", facts(n03=rdma)))
    assert results["n03"].status == Status.WARN and results["n01"].status == Status.SKIP

    def starving(state):
        state["facts"]["memory"]["available_bytes"] = 2**29

    assert by_node(run("SYS003", facts(n01=starving)))["n01"].status == Status.FAIL


# --- the collector, inventory and quoting -------------------------------------------------------------

def test_collector_redacts_secrets_and_never_imports_torch():
    env = dict(os.environ, HF_TOKEN="hf_secret_value", NCCL_DEBUG="INFO", WANDB_API_KEY="k")
    code = ("import json, sys; from preflight.node import collector; f = collector.collect({});"
            "print(json.dumps({'env': f['env'], 'torch_imported': 'torch' in sys.modules,"
            "'versions': f['packages']['versions']}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    timeout=60, check=True).stdout)
    assert out["env"]["HF_TOKEN"] == "<redacted>" and out["env"]["NCCL_DEBUG"] == "INFO"
    assert "hf_secret_value" not in json.dumps(out)
    assert out["torch_imported"] is False
    assert out["versions"]["torch"] == BASE["packages"]["versions"]["torch"]


def test_the_shipped_agent_runs_from_stdin_and_answers_requests():
    stdin = shipping.shipped_input(shipping.AGENT, {"head": "127.0.0.1", "port": 29500}) + "{\"op\": \"time\"}\n{\"op\": \"time\"}\n{\"op\": \"nope\"}\ndone\n"
    command = shipping.shipped_command(sys.executable)
    proc = subprocess.run(["sh", "-c", command], input=stdin, capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    facts_doc = json.loads(lines[0])
    assert facts_doc["python"]["executable"] == sys.executable
    answers = [json.loads(line) for line in lines[1:]]
    assert len(answers) == 3 and all(abs(a["time"] - facts_doc["collected_at"]) < 60 for a in answers[:2])
    assert "unknown request" in answers[2]["error"]


def test_the_remote_command_quotes_the_interpreter_path():
    hostile = "/opt/py; touch /tmp/pwned"
    words = shlex.split(shipping.shipped_command(hostile))
    # the keeper wrapper gets it as one argument ($1) and runs it only as "$1" / "$2" (quoted in its script)
    assert words[:3] == ["exec", "/bin/sh", "-c"] and words[4:6] == ["preflight", hostile]
    assert '"$1" -u -c "$2"' in words[3] and '"$2" -u -c "$3"' in words[7]


def test_inventory():
    assert inventory.expand("gpu[001-003],gpu010", "--hosts") == ["gpu001", "gpu002", "gpu003", "gpu010"]
    for bad in (["a", "a"], [], ["n1;touch /tmp/pwned"], ["a", " "]):
        with pytest.raises(InputError):
            inventory.validate(bad, "--hosts")
    with pytest.raises(InputError, match="bad host list"):
        inventory.expand("gpu[1-", "--hosts")
    assert inventory.head_first(["a", "b", "c"], "b") == ["b", "a", "c"]
    assert inventory.head_first(["a", "b"], "10.0.0.1") == ["a", "b"]
