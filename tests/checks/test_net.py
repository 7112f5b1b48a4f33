"""NET: names, interfaces, ports and reachability. Hostname resolution (NET001, NET002), the main port held
by another process or a running job (NET003 names the job's launcher, node rank and what to do), the main
port reached from every worker (NET004), what NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME and NCCL_IB_HCA select
on each node (NET005): recorded node facts first, then the real test cluster."""
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check
from conftest import preflight_json, results
from node_facts import NODES, both, by_node, env, facts, linked_facts, run
from preflight.checks.net import classify_holder, launch_of, redact_argv
from preflight.job.nccl import nccl_list, selected_ports, socket_interface
from preflight.plan import Plan
from preflight.result import Status

VENV = os.path.dirname(sys.executable)


# --- NET005: what the per-node selection means on each node -------------------------------------------

def test_a_selection_that_differs_per_node_but_is_right_everywhere_passes():
    def ens5(state):  # n02 names its training interface ens5
        host = state["facts"]["host"]
        host["interfaces"]["ens5"] = host["interfaces"].pop("eth0")
        host["links"]["ens5"] = host["links"].pop("eth0")
        host["route_to_head"]["interface"] = "ens5"
        state["facts"]["env"]["NCCL_SOCKET_IFNAME"] = "=ens5"

    found = by_node(run("NET005", linked_facts(n01=env(NCCL_SOCKET_IFNAME="=eth0"), n02=ens5,
                                         n03=env(NCCL_SOCKET_IFNAME="eth0"))))
    assert {n: r.status for n, r in found.items()} == {n: Status.PASS for n in NODES}
    assert "ens5 (10.0.0.2)" in found["n02"].message and "on 10.0.0.0/24" in found["n02"].message
    assert found["n02"].evidence["network"] == "10.0.0.0/24" and found["n02"].evidence["route_interface"] == "ens5"


def test_a_selected_interface_that_is_down_fails_on_that_node_only():
    def down(state):
        state["facts"]["host"]["links"]["eth0"]["up"] = False

    states = linked_facts(n01=env(GLOO_SOCKET_IFNAME="eth0"), n02=both(env(GLOO_SOCKET_IFNAME="eth0"), down))
    found = by_node(run("NET005", states))
    assert found["n02"].status == Status.FAIL and "eth0 is DOWN" in found["n02"].message
    assert "ip link set eth0 up" in found["n02"].remediation and "n02" in found["n02"].remediation
    assert found["n01"].status == Status.PASS and found["n03"].status == Status.SKIP


def test_a_selected_interface_without_carrier_fails():
    def no_carrier(state):
        state["facts"]["host"]["links"]["eth0"]["running"] = False

    found = by_node(run("NET005", linked_facts(n03=both(env(NCCL_SOCKET_IFNAME="=eth0"), no_carrier))))
    assert found["n03"].status == Status.FAIL and "eth0 is UP but has no carrier (NO-CARRIER)" in found["n03"].message
    assert found["n03"].remediation.startswith("restore the link of eth0") and found["n03"].nodes == ("n03",)


@pytest.mark.parametrize("var,spec", [
    ("GLOO_SOCKET_IFNAME", "eth1"),  # gloo uses exactly that interface
    ("NCCL_SOCKET_IFNAME", "=eth1"),  # NCCL: only that one, off the head's network
    ("NCCL_SOCKET_IFNAME", "eth"),  # NCCL: eth0 is right, eth1 is selected too
    ("GLOO_SOCKET_IFNAME", "eth0,eth1"),  # gloo uses each one it names
])
def test_a_selected_interface_off_the_heads_network_warns(var, spec):
    """UP, but not on the network to the head: the ranks exchange the addresses they bind through the store,
    so a second network (IPoIB, a dedicated fabric) works when every node has it: a warning, not a refusal."""
    found = by_node(run("NET005", linked_facts(n02=env(**{var: spec}))))
    result = found["n02"]
    assert result.status == Status.WARN, result.message
    assert "eth1 (192.168.9.2/24) is not on 10.0.0.0/24" in result.message
    assert "not on the network this node reaches the head over" in result.message
    assert "the other nodes reach n02 on" in result.remediation
    assert found["n01"].status == Status.SKIP


def test_old_facts_without_links_still_check_the_names_and_say_what_is_not_checked():
    def old(state):
        del state["facts"]["host"]["links"]

    found = by_node(run("NET005", linked_facts(n01=both(old, env(NCCL_SOCKET_IFNAME="=eth1")),
                                         n02=both(old, env(NCCL_SOCKET_IFNAME="bogus")))))
    assert found["n01"].status == Status.PASS and "no host.links" in found["n01"].message
    assert "not checked" in found["n01"].message
    assert found["n02"].status == Status.FAIL and "selects no interface" in found["n02"].message


@pytest.mark.parametrize("route,why", [
    (None, "the route to the head is not known"),
    ({"head": "127.0.0.1", "source": "127.0.0.1", "interface": "lo"}, "over loopback"),
    ({"head": "10.0.0.1", "source": "10.0.0.99", "interface": "eth0"}, "has no netmask"),
])
def test_an_unknown_heads_network_checks_only_the_link_state(route, why):
    def change(state):
        state["facts"]["host"]["route_to_head"] = route
        state["facts"]["env"]["NCCL_SOCKET_IFNAME"] = "=eth1"

    result = by_node(run("NET005", linked_facts(n02=change)))["n02"]
    assert result.status == Status.PASS and why in result.message and "not checked" in result.message

    def down(state):
        change(state)
        state["facts"]["host"]["links"]["eth1"]["up"] = False

    assert by_node(run("NET005", linked_facts(n02=down)))["n02"].status == Status.FAIL


@pytest.mark.parametrize("spec,expected", [
    ("mlx5_0:1,mlx5_1:1", (False, False, [("mlx5_0", 1), ("mlx5_1", 1)])),
    ("=mlx5_0", (False, True, [("mlx5_0", None)])),
    ("^=mlx5_3:1", (True, True, [("mlx5_3", 1)])),
    ("^mlx5_3", (True, False, [("mlx5_3", None)])),
    (" mlx5 , ", (False, False, [("mlx5", None)])),
    ("mlx5_0:x,,:2", (False, False, [("mlx5_0", 0)])),  # atoi("x") is 0; an item without a name is dropped
    ("", (False, False, [])),
])
def test_nccl_list_syntax(spec, expected):
    exclude, exact, entries = expected
    assert nccl_list(spec) == (exclude, exact, tuple(entries))


@pytest.mark.parametrize("spec,expected", [
    ("", ["mlx5_0:1", "mlx5_0:2", "mlx5_1:1"]),  # set but empty: NCCL's matchIfList takes every port
    ("^mlx5_0:1", ["mlx5_0:2", "mlx5_1:1"]),  # a port after ^ drops that port only
    ("mlx5_0:2", ["mlx5_0:2"]),
    ("^", []),  # an empty exclusion list excludes everything
])
def test_nccl_ib_hca_selects_ports_as_nccl_does(spec, expected):
    devices = {"mlx5_0": {"ports": {"1": {}, "2": {}}}, "mlx5_1": {"ports": {"1": {}}}}
    assert [f"{d}:{p}" for d, p, _ in selected_ports({"NCCL_IB_HCA": spec}, devices)] == expected


@pytest.mark.parametrize("spec,devices,status,phrase", [
    ("mlx5_0:1,mlx5_1:1", ["mlx5_0", "mlx5_1"], Status.PASS, "selects mlx5_0, mlx5_1"),
    ("mlx5", ["mlx5_0", "mlx5_1"], Status.PASS, "selects mlx5_0, mlx5_1"),
    ("^=mlx5_1", ["mlx5_0", "mlx5_1"], Status.PASS, "selects mlx5_0"),
    ("mlx5_0:1,mlx5_2:1", ["mlx5_0", "mlx5_1"], Status.WARN, "names mlx5_2:1, which is not an RDMA device"),
    ("=mlx5", ["mlx5_0"], Status.FAIL, "NCCL finds no HCA it may use here"),
    ("mlx5_0", [], Status.WARN, "no RDMA device"),
    ("^mlx5", ["mlx5_0", "mlx5_1"], Status.WARN, "excludes every RDMA device"),
    ("", ["mlx5_0", "mlx5_1"], Status.PASS, "selects mlx5_0, mlx5_1"),  # empty: every HCA, as unset
    ("^mlx5_0:1", ["mlx5_0", "mlx5_1"], Status.PASS, "selects mlx5_0, mlx5_1"),  # port 1 only is dropped
    ("^mlx5_0:1,mlx5_1", ["mlx5_0", "mlx5_1"], Status.PASS, "selects mlx5_0 "),
])
def test_nccl_ib_hca_names_this_nodes_devices(spec, devices, status, phrase):
    def change(state):
        state["facts"]["env"]["NCCL_IB_HCA"] = spec
        state["facts"]["host"]["rdma_devices"] = devices

    found = by_node(run("NET005", linked_facts(n03=change)))
    assert found["n03"].status == status and phrase in found["n03"].message, found["n03"].message
    assert found["n03"].evidence["variable"] == "NCCL_IB_HCA"
    if status != Status.PASS:
        assert "n03" in found["n03"].remediation
    assert found["n01"].status == Status.SKIP and "NCCL_IB_HCA" in found["n01"].message


# --- NET003: who holds the main port ------------------------------------------------------------------

def port_taken(*holders_, port=29511):
    return {"port": {"head": "n01", "listen": {"bound": False, "error": "Address already in use",
                                               "holders": list(holders_)}}}


def holder(pid, argv, ppid=1, parent_argv=("/sbin/init",), children=0, env=None):
    return {"pid": pid, "command": " ".join(argv)[:200], "argv": list(argv), "ppid": ppid,
            "parent_argv": list(parent_argv), "children": children, "env": env or {}}


def net003(probes, port=29511):
    [result] = run("NET003", linked_facts(), probes=probes, plan=Plan(nodes=NODES, remote=True, port=port))
    assert result.status == Status.FAIL and result.nodes == ("n01",)
    return result


TORCHRUN = [f"{VENV}/python", f"{VENV}/torchrun", "--nnodes", "3", "--node_rank", "0", "--master_addr", "n01",
            "--master_port", "29511", "--nproc-per-node", "8", "train.py", "--lr", "1e-4"]


def test_a_torchrun_agent_waiting_for_nodes_that_never_joined_is_named():
    result = net003(port_taken(holder(1234, TORCHRUN, children=0)))
    assert result.message.startswith("port 29511 on the head n01 is held by a running job: torchrun --nnodes 3 "
                                      "--node_rank 0 --master_addr n01 --master_port 29511")
    assert "(pid 1234, node rank 0 of 3 nodes)" in result.message
    assert "it has started no ranks: it waits for the other 2 nodes of the job, which never joined" in result.message
    assert "kill 1234 (the torchrun launcher" in result.remediation
    assert "waiting for nodes that never joined: start the job on the other node(s) (node ranks 1, 2), or stop it" \
        in result.remediation
    assert "another main_process_port" in result.remediation
    job = result.evidence["job"]
    assert job["launcher"] == "torchrun" and job["node_rank"] == 0 and job["nnodes"] == "3"
    assert job["waiting_for_nodes"] is True and job["master"] == "n01:29511"


def test_a_torchrun_agent_whose_ranks_run_is_not_called_waiting():
    result = net003(port_taken(holder(1234, TORCHRUN, children=8)))
    assert "held by a running job: torchrun" in result.message and "it runs 8 process(es)" in result.message
    assert "never joined" not in result.message and "never joined" not in result.remediation
    assert result.evidence["job"]["waiting_for_nodes"] is False


@pytest.mark.parametrize("argv,launcher,where", [
    (["accelerate", "launch", "--num_machines", "2", "--machine_rank", "0", "--main_process_port", "29511",
      "train.py"], "accelerate", "node rank 0 of 2 nodes"),
    ([f"{VENV}/python", f"{VENV}/accelerate", "launch", "--num-machines=4", "--machine-rank=0", "train.py"],
     "accelerate", "node rank 0 of 4 nodes"),
    (["python3", "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=0", "train.py"], "torchrun",
     "node rank 0 of 2 nodes"),
    (["env", "NCCL_DEBUG=INFO", "torchrun", "--nnodes", "2", "train.py"], "torchrun",
     "node rank not on its command line of 2 nodes"),
])
def test_each_launcher_is_recognised_with_its_node_rank(argv, launcher, where):
    result = net003(port_taken(holder(77, argv, children=0)))
    assert "held by a running job" in result.message and f"(pid 77, {where})" in result.message
    assert f"kill 77 (the {launcher} launcher" in result.remediation
    assert result.evidence["job"]["launcher"] == launcher


def test_a_deepspeed_rank_is_named_with_the_launcher_that_started_it():
    world = base64.urlsafe_b64encode(json.dumps({"n01": [0, 1], "n02": [0, 1]}).encode()).decode()
    parent = ["/usr/bin/python3", "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
              "--node_rank=0", "--master_addr=10.0.0.1", "--master_port=29511", "train.py", "--deepspeed"]
    rank = holder(4321, ["/usr/bin/python3", "-u", "train.py", "--local_rank=0", "--deepspeed"], ppid=4300,
                  parent_argv=parent, env={"RANK": "0", "MASTER_PORT": "29511"})
    result = net003(port_taken(rank))
    assert "held by a running job: rank 0 (/usr/bin/python3 -u train.py --local_rank=0 --deepspeed, pid 4321)" \
        in result.message
    assert "started by python3 -u -m deepspeed.launcher.launch" in result.message
    assert "(pid 4300, node rank 0 of 2 nodes)" in result.message
    assert "kill 4300 (its launcher, deepspeed.launcher.launch" in result.remediation
    assert "if it waits for other nodes, they never joined" in result.remediation
    assert result.evidence["job"]["kind"] == "rank" and result.evidence["job"]["launcher_pid"] == 4300


@pytest.mark.parametrize("env_,argv_extra,known_by", [
    ({"RANK": "3", "WORLD_SIZE": "16"}, [], "its environment has the RANK"),
    ({"MASTER_PORT": "29511"}, [], "its environment has MASTER_PORT=29511"),
    ({}, ["--local_rank", "0"], "it was given --local_rank"),
])
def test_a_rank_process_is_only_called_one_when_something_says_so(env_, argv_extra, known_by):
    rank = holder(555, ["python", "train.py", *argv_extra], ppid=500, parent_argv=["bash", "run.sh"], env=env_)
    result = net003(port_taken(rank))
    assert "held by a running job" in result.message and known_by in result.message and "pid 555" in result.message
    assert "kill 555, and the launcher that started it" in result.remediation


def test_a_process_nothing_says_is_a_job_is_not_called_one():
    plain = holder(999, ["python", "serve.py", "--port", "29511"], ppid=1, parent_argv=["/sbin/init"],
                   env={"MASTER_PORT": "29500"})  # another port: not this job's
    result = net003(port_taken(plain))
    assert "running job" not in result.message
    assert "is taken (Address already in use): held by pid 999 (python serve.py --port 29511)" in result.message
    assert result.remediation.startswith("stop pid 999")
    old = net003(port_taken({"pid": 4242, "command": "python old_job.py"}))  # an older collector's holder
    assert "pid 4242 (python old_job.py)" in old.message and "running job" not in old.message


def test_a_launcher_and_another_holder_are_both_named():
    other = holder(2000, ["nginx", "-g", "daemon off;"])
    result = net003(port_taken(other, holder(1234, TORCHRUN)))
    assert "held by a running job: torchrun" in result.message and "also held by pid 2000 (nginx" in result.message


def test_secrets_on_a_holders_command_line_are_never_shown():
    argv = ["env", "HF_TOKEN=hf_sekrit1", "torchrun", "--nnodes", "2", "--node_rank", "0", "train.py",
            "--hf_token", "hf_sekrit2", "--password=sekrit3", "--api-key", "sekrit4",
            "--data", "https://alice:sekrit5@data.example.com/set", "--tokenizer_name", "gpt2"]
    rank = holder(321, ["python", "train.py", "--token", "sekrit6", "--local_rank=0"], parent_argv=argv, ppid=320)
    other = holder(9, ["x", "--secret", "sekrit7"])
    for probes in (port_taken(holder(1234, argv)), port_taken(rank), port_taken(other)):
        result = net003(probes)
        shown = json.dumps({"message": result.message, "remediation": result.remediation, "evidence": result.evidence})
        assert "sekrit" not in shown, shown
        assert "<redacted>" in shown
    assert "--tokenizer_name gpt2" in net003(port_taken(holder(1234, argv))).message


@pytest.mark.parametrize("argv,expected", [
    (["--token", "t"], ["--token", "<redacted>"]),
    (["--hf_token=t"], ["--hf_token=<redacted>"]),
    (["--password", "p", "--next"], ["--password", "<redacted>", "--next"]),
    (["--api-key", "k"], ["--api-key", "<redacted>"]),
    (["--use_auth_token", "--output_dir", "out"], ["--use_auth_token", "--output_dir", "out"]),  # a flag
    (["WANDB_API_KEY=k", "python"], ["WANDB_API_KEY=<redacted>", "python"]),
    (["s3://user:pw@bucket/x"], ["s3://<redacted>@bucket/x"]),
    (["--tokenizer_name", "gpt2", "--max_tokens", "5", "--keep", "3"],
     ["--tokenizer_name", "gpt2", "--max_tokens", "5", "--keep", "3"]),
])
def test_redact_argv(argv, expected):
    assert redact_argv(argv) == expected


def test_launch_of_is_none_for_what_is_no_launcher():
    assert launch_of(["python", "train.py"]) is None and launch_of([]) is None
    assert launch_of([f"{VENV}/python", f"{VENV}/accelerate", "config"]) is None
    assert launch_of(["python", "-m", "http.server", "29511"]) is None
    assert classify_holder({"pid": 1, "command": ""}, 29511).of_a_job is False


STUCK_SCRIPT = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"


# --- NET001-NET005 over recorded facts -----------------------------------------------------------------------

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
    ("eth0:1", True, ["eth0"]),  # NCCL's list cuts each item at ':' (a port, ignored for interfaces)
    ("^lo:0,ib", True, ["eth0", "eth1"]),
    ("eth1,ib0", False, ["eth1", "ib0"]),
])
def test_socket_ifname_selection_rules(spec, nccl, expected):
    from preflight.job.nccl import selected_interfaces

    assert selected_interfaces(spec, ["lo", "eth0", "eth1", "ib0"], nccl) == expected


@pytest.mark.parametrize("value", ["", "e", "^"])
def test_socket_ifname_of_one_character_or_none_is_the_default_not_a_selection(value):
    # NCCL (ncclFindInterfaces) and torch's gloo both ignore a value unless strlen > 1
    def short(state):
        state["facts"]["env"].update(NCCL_SOCKET_IFNAME=value, GLOO_SOCKET_IFNAME=value)

    results = by_node(run("NET005", linked_facts(n02=short)))
    assert results["n02"].status == Status.SKIP, results["n02"].message
    view = {"host": {"interfaces": {"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}, "resolves_to": ["10.0.0.2"]},
            "env": {"GLOO_SOCKET_IFNAME": value, "NCCL_SOCKET_IFNAME": value}, "gpus": {}}
    assert socket_interface(view) == "eth0 10.0.0.2"
    view["gpus"] = {"available": True}
    assert socket_interface(view) == "eth0 10.0.0.2"


def test_nccl_default_interface_skips_virtual_bridges_as_nccl_does():
    view = {"host": {"interfaces": {"lo": ["127.0.0.1"], "virbr0": ["192.168.122.1"], "docker0": ["172.17.0.1"],
                                    "eth0": ["10.0.0.2"]}}, "env": {}, "gpus": {"available": True},
            "packages": {"versions": {"nccl": "2.28.9"}}}  # virbr* set apart since 2.28.3 (not known: not judged)
    assert socket_interface(view) == "eth0 10.0.0.2"
    del view["host"]["interfaces"]["eth0"]
    assert socket_interface(view) == "docker0 172.17.0.1"


def test_socket_ifname_selecting_nothing_fails():
    def typo(state):
        state["facts"]["env"]["NCCL_SOCKET_IFNAME"] = "ens5"

    results = by_node(run("NET005", facts(n02=typo)))
    assert results["n02"].status == Status.FAIL and "ens5" in results["n02"].message
    assert results["n01"].status == Status.SKIP


# --- the real test cluster -----------------------------------------------------------------------------------

def cluster_check(cluster, *extra, hosts=None):
    return preflight_json("check", "--hosts", hosts or ",".join(cluster.nodes), "--ssh-config", cluster.ssh_config,
                          "--python", sys.executable, *extra)


def _listening(cluster, node, port):
    return cluster.netns_exec(node, ["ss", "-ltn", f"sport = :{port}"]).stdout.count("LISTEN") > 0


@pytest.mark.cluster
def test_a_stuck_torchrun_job_on_the_head_is_named(cluster, tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_SCRIPT)
    # In node01's network, mount (its /etc/hosts: node01 resolves) and hostname: the job a user left there.
    inside = ["nsenter", "--target", str(cluster.sshd_pid("node01")), "--mount", "--uts", "--"]
    job = cluster.netns_popen("node01", inside + [os.path.join(VENV, "torchrun"), "--nnodes", "2", "--node_rank", "0",
                                                  "--master_addr", "node01", "--master_port", "29511",
                                                  "--nproc-per-node", "1", str(script)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not _listening(cluster, "node01", 29511):
            assert job.poll() is None, f"torchrun exited {job.returncode}: {job.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "torchrun never listened on 29511"
            time.sleep(0.2)
        doc, _ = cluster_check(cluster, "--port", "29511", "--only", "NET003", hosts="node01,node02")
    finally:
        try:
            os.killpg(job.pid, signal.SIGTERM)  # its own session (netns_popen): only the PIDs this test started
            job.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=10)
        except ProcessLookupError:
            pass
    taken = results(doc, "NET003")["node01"]
    assert taken["status"] == "fail" and doc["verdict"] == "fail"
    assert taken["message"].startswith("port 29511 on the head node01 is held by a running job: torchrun --nnodes 2 "
                                       "--node_rank 0 --master_addr node01 --master_port 29511")
    assert f"(pid {job.pid}, node rank 0 of 2 nodes)" in taken["message"]
    assert "it waits for the other node of the job, which never joined" in taken["message"]
    assert f"kill {job.pid} (the torchrun launcher" in taken["remediation"]
    assert "preflight doctor --port 29511" in taken["remediation"]
    assert "start the job on the other node(s) (node rank 1), or stop it" in taken["remediation"]
    assert taken["evidence"]["job"]["launcher"] == "torchrun" and taken["evidence"]["job"]["node_rank"] == 0
    assert not _listening(cluster, "node01", 29511)


@pytest.mark.cluster
def test_socket_ifname_differing_per_node_is_judged_by_meaning(cluster):
    with cluster.env("node02", NCCL_SOCKET_IFNAME="eth0"), cluster.env("node03", NCCL_SOCKET_IFNAME="bogus0"):
        doc, _ = cluster_check(cluster, "--only", "NET005,PKG004")
    env_results = [r for r in doc["results"] if r["id"] == "PKG004"]
    assert [r["status"] for r in env_results] == ["pass"], env_results
    assert "NCCL_SOCKET_IFNAME checked by meaning in NET005" in env_results[0]["message"]
    ifname = results(doc, "NET005")
    assert ifname["node03"]["status"] == "fail" and "bogus0" in ifname["node03"]["message"]
    assert ifname["node02"]["status"] == "pass" and "on 10.77.0.0/24" in ifname["node02"]["message"]
    assert ifname["node01"]["status"] == "skip"
    assert [r["nodes"] for r in doc["results"] if r["status"] == "fail"] == [["node03"]]


@pytest.mark.cluster
def test_a_dropped_main_port_fails_every_worker_within_the_timeout(cluster):
    with cluster.dropped_port("node01", 29500):
        doc, elapsed = check(cluster, "--timeout", "5")
    reach = results(doc, "NET004")
    assert reach["node02"]["status"] == "fail" and reach["node03"]["status"] == "fail"
    assert "timed out" in reach["node02"]["message"]
    assert results(doc, "NET003")["node01"]["status"] == "pass"  # free, only unreachable
    assert elapsed < 5 + 5, elapsed


@pytest.mark.cluster
def test_a_hostname_resolving_to_loopback_is_named(cluster):
    with cluster.loopback_hostname_fault("node02"):
        doc, _ = check(cluster)
    names = results(doc, "NET001")
    assert names["node02"]["status"] == "fail" and "127.0.1.1" in names["node02"]["message"]
    assert names["node03"]["status"] == "pass"


@pytest.mark.cluster
def test_main_port_taken_on_the_head_names_the_process(cluster):
    # Bound as torch's TCPStore binds (SO_REUSEADDR): a connection of an earlier test on the run's cluster may
    # still be in TIME_WAIT on the port, which a job's store (and preflight's probe) binds over.
    holder = cluster.netns_popen("node01", [sys.executable, "-c", "import socket, time; old_job = socket.socket();"
                                            "old_job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                                            "old_job.bind(('0.0.0.0', 29500)); old_job.listen(); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while cluster.netns_exec("node01", ["ss", "-ltn", "sport = :29500"]).stdout.count("LISTEN") == 0:
            assert time.monotonic() < deadline, "the holder never listened"
            time.sleep(0.1)
        doc, _ = check(cluster, "--only", "NET003,NET004")
    finally:
        holder.kill()
        holder.wait(timeout=10)
    taken = results(doc, "NET003")["node01"]
    assert taken["status"] == "fail" and str(holder.pid) in taken["message"] and "old_job" in taken["message"]


@pytest.mark.cluster
def test_socket_ifname_and_environment_differences(cluster):
    with cluster.env("node02", NCCL_SOCKET_IFNAME="ib", NCCL_IB_DISABLE="1"):
        doc, _ = check(cluster, "--only", "NET005,PKG004")
    ifname = results(doc, "NET005")
    assert ifname["node02"]["status"] == "fail" and "ib" in ifname["node02"]["message"]
    assert ifname["node01"]["status"] == "skip"
    env = [r for r in doc["results"] if r["id"] == "PKG004" and r["status"] == "fail"]
    assert {r["nodes"][0] for r in env} == {"node02"}
    assert {r["evidence"]["variable"] for r in env} == {"NCCL_IB_DISABLE"}  # NCCL_SOCKET_IFNAME: by meaning, NET005
    with cluster.env("node02", NCCL_SOCKET_IFNAME="eth"), cluster.env("node01", NCCL_SOCKET_IFNAME="eth"), \
            cluster.env("node03", NCCL_SOCKET_IFNAME="eth"):
        doc, _ = check(cluster, "--only", "NET005,PKG004")
    assert doc["verdict"] == "pass"
    assert "eth0" in results(doc, "NET005")["node02"]["message"]


@pytest.mark.cluster
@pytest.mark.parametrize("where", ["torchrun's --master_port", "each node's own accelerate config"])
def test_the_main_port_judged_is_the_one_the_job_uses_where_only_the_launch_or_the_nodes_name_it(cluster, tmp_path,
                                                                                                   where):
    """Neither --port nor a config on the head names the port: the job's own is judged, not 29500."""
    (tmp_path / "train.py").write_text("")
    holder = cluster.netns_popen("node01", [sys.executable, "-c", "import socket, time; old_job = socket.socket();"
                                            "old_job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                                            "old_job.bind(('0.0.0.0', 29512)); old_job.listen(); time.sleep(60)"])
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: (holder.kill(), holder.wait(timeout=10)))
        deadline = time.monotonic() + 10
        while cluster.netns_exec("node01", ["ss", "-ltn", "sport = :29512"]).stdout.count("LISTEN") == 0:
            assert time.monotonic() < deadline, "the holder never listened"
            time.sleep(0.1)
        if where.startswith("torchrun"):
            command = [os.path.join(VENV, "torchrun"), "--nnodes", "3", "--master_addr", "node01", "--master_port",
                       "29512", "--node_rank", "$NODE_RANK", "train.py"]
        else:
            for rank, node in enumerate(cluster.nodes):
                home = tmp_path / f"hf-{node}"
                (home / "accelerate").mkdir(parents=True)
                (home / "accelerate" / "default_config.yaml").write_text(yaml.safe_dump({
                    "distributed_type": "MULTI_GPU", "use_cpu": True, "num_machines": 3, "num_processes": 3,
                    "machine_rank": rank, "main_process_ip": "node01", "main_process_port": 29512}))
                stack.enter_context(cluster.env(node, HF_HOME=str(home)))
            command = [os.path.join(VENV, "accelerate"), "launch", "train.py"]
        proc = subprocess.run([sys.executable, "-m", "preflight", "check", "--hosts", ",".join(cluster.nodes),
                               "--ssh-config", str(cluster.ssh_config), "--only", "NET003,NET004", "--json", "--",
                               *command], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    doc = json.loads(proc.stdout)
    taken = results(doc, "NET003")["node01"]
    assert taken["status"] == "fail" and "port 29512 on the head node01 is taken" in taken["message"], taken
