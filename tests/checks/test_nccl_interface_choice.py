"""The interface NCCL picks when NCCL_SOCKET_IFNAME is unset (preflight.job.nccl.nccl_interfaces), as NCCL's own
ncclFindInterfaces walks getifaddrs (src/misc/socket.cc, src/os/linux.cc of NVIDIA/nccl): ib* first, then every
interface but docker*, lo and virbr*, IPv4 before IPv6, only those with carrier since 2.28.3; and NET005 on a
node with GPUs, where that choice is the address every other rank connects to."""
import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from preflight import registry, runner
from preflight.job.nccl import nccl_interfaces, socket_interface
from preflight.plan import build_plan
from preflight.result import Status


def node(interfaces, links=None, env=None, nccl="2.28.9", gpus=True, route=("eth0", "10.0.0.2")):
    """Facts of a node: interfaces {name: [addresses]} in index order, links {name: {...}} (default: UP with
    carrier, /24 IPv4), the NCCL torch loads."""
    links = links if links is not None else {
        name: {"up": True, "running": True, "ipv4": [f"{a}/24" for a in addrs if "." in a],
               "ipv6": [f"{a}/64" for a in addrs if ":" in a], "mtu": 1500} for name, addrs in interfaces.items()}
    host = {"interfaces": interfaces, "links": links,
            "route_to_head": {"head": "10.0.0.1", "source": route[1], "interface": route[0]}}
    return {"host": host, "env": env or {}, "gpus": {"available": gpus},
            "packages": {"versions": {"nccl": nccl}, "distributions": {}, "requires": {}}}


def picked(facts):
    chosen, rule = nccl_interfaces(facts)
    return (chosen[0] if chosen else None), rule


ETH = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2", "fe80::1"]}


def test_an_ib_interface_comes_first_even_with_only_a_link_local_address():
    facts = node({**ETH, "ib0": ["fe80::9"]})
    assert picked(facts) == (("ib0", "fe80::9"), "its default: an ib* interface")


def test_without_ib_the_first_interface_in_the_kernels_order_but_docker_lo_and_virbr():
    facts = node({"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "virbr0": ["192.168.122.1"], "eno1": ["192.168.1.5"],
                  "eth0": ["10.0.0.2"]})
    assert picked(facts) == (("eno1", "192.168.1.5"), "its default: the first interface but docker*, lo and virbr*")


def test_ipv4_addresses_come_before_ipv6_ones_whatever_the_interface_order():
    facts = node({"lo": ["127.0.0.1"], "ens1": ["fd00::5"], "eth0": ["10.0.0.2", "fe80::1"]})
    assert picked(facts)[0] == ("eth0", "10.0.0.2")
    assert picked(node(facts["host"]["interfaces"], env={"NCCL_SOCKET_FAMILY": "AF_INET6"}))[0] == ("ens1", "fd00::5")


def test_an_interface_without_carrier_is_skipped_since_nccl_2_28_3_and_taken_before():
    interfaces = {"lo": ["127.0.0.1"], "ens1": ["192.168.9.9"], "eth0": ["10.0.0.2"]}
    links = {"ens1": {"up": True, "running": False, "ipv4": ["192.168.9.9/24"]},
             "eth0": {"up": True, "running": True, "ipv4": ["10.0.0.2/24"]}}
    assert picked(node(interfaces, links))[0] == ("eth0", "10.0.0.2")
    assert picked(node(interfaces, links, nccl="2.27.7"))[0] == ("ens1", "192.168.9.9")


def test_where_the_nodes_nccl_is_not_known_a_choice_its_releases_make_differently_is_not_judged():
    """NCCL 2.28.3 changed the default (carrier, virbr*): with the node's release not known, NET005 judges the
    interface only where both rules pick the same, and the launch plan shows none rather than a guess."""
    interfaces = {"lo": ["127.0.0.1"], "virbr0": ["192.168.122.1"], "eth0": ["10.0.0.2"]}
    [result] = net005(node(interfaces, nccl=None))
    assert result.status is Status.SKIP and "NCCL 2.28.3 and newer pick eth0, older releases virbr0" in result.message
    assert socket_interface(node(interfaces, nccl=None)) is None
    assert socket_interface(node(interfaces, nccl="2.21.5")) == "virbr0 192.168.122.1"
    [result] = net005(node({"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}, nccl=None))  # both rules pick eth0
    assert result.status is Status.PASS and "bootstraps over eth0" in result.message


def test_virbr_is_set_apart_only_since_nccl_2_28_3():
    interfaces = {"lo": ["127.0.0.1"], "virbr0": ["192.168.122.1"], "eth0": ["10.0.0.2"]}
    assert picked(node(interfaces))[0] == ("eth0", "10.0.0.2")
    assert picked(node(interfaces, nccl="2.21.5"))[0] == ("virbr0", "192.168.122.1")


def test_nccl_comm_id_picks_the_interface_on_its_subnet_and_a_set_ifname_wins():
    interfaces = {"lo": ["127.0.0.1"], "eno1": ["192.168.1.5"], "eth0": ["10.0.0.2"]}
    assert picked(node(interfaces, env={"NCCL_COMM_ID": "10.0.0.1:29600"})) == (
        ("eth0", "10.0.0.2"), "its default: the subnet of NCCL_COMM_ID (10.0.0.1)")
    assert picked(node(interfaces, env={"NCCL_SOCKET_IFNAME": "=eth0"}))[0] == ("eth0", "10.0.0.2")
    # an exclusion list replaces the default's too: lo is no longer set apart, and comes first
    assert picked(node(interfaces, env={"NCCL_SOCKET_IFNAME": "^eno"}))[0] == ("lo", "127.0.0.1")
    assert picked(node({"lo": ["127.0.0.1", "::1"]}))[0] == ("lo", "127.0.0.1")  # loopback last; never ::1


def net005(facts, check_id="NET005"):
    plan = build_plan(nodes=("n1",))
    plan = plan.__class__(**{**plan.__dict__, "remote": True})
    ctx = runner.CheckContext(plan, {"n1": {"facts": facts, "error": None}}, {})
    return runner.run_check(registry.load().get(check_id), ctx)


def test_net005_warns_where_nccls_choice_is_not_on_the_network_to_the_head_and_names_the_fix():
    [result] = net005(node({**ETH, "ib0": ["fe80::9"]}))
    assert result.status is Status.WARN, result
    assert result.message.startswith("NCCL_SOCKET_IFNAME is unset: NCCL bootstraps over ib0 (fe80::9), its default: "
                                     "an ib* interface, which is not on 10.0.0.0/24")
    assert "link-local" in result.message and result.remediation.startswith("set NCCL_SOCKET_IFNAME==eth0 on n1")
    [result] = net005(node({"lo": ["127.0.0.1"], "cni0": ["10.244.0.1"], "eth0": ["10.0.0.2"]}))
    assert result.status is Status.WARN and "over cni0 (10.244.0.1)" in result.message
    assert "a container network's bridge" in result.message


def test_a_second_network_nccl_picks_first_passes_and_is_left_to_the_path_probes():
    """IPoIB or a dedicated fabric on every node works: whether the others reach it is NET009's to probe."""
    [result] = net005(node({"lo": ["127.0.0.1"], "eno1": ["192.168.1.5"], "eth0": ["10.0.0.2"]}))
    assert result.status is Status.PASS and "over eno1 (192.168.1.5)" in result.message, result
    assert "NET009 probes it" in result.message


@pytest.mark.parametrize("extra", [{}, {"docker0": ["172.17.0.1"]}, {"virbr0": ["192.168.122.1"]},
                                   {"cni0": ["10.244.0.1"], "flannel.1": ["10.244.0.0"]}])
def test_healthy_nodes_with_a_bridge_or_a_second_network_after_the_training_one_pass(extra):
    [result] = net005(node({**ETH, **extra}))
    assert result.status is Status.PASS and "over eth0 (10.0.0.2)" in result.message, result


def test_without_gpus_nccl_is_not_judged_and_with_no_interface_it_fails():
    [result] = net005(node({**ETH, "ib0": ["fe80::9"]}, gpus=False))
    assert result.status is Status.SKIP
    links = {"eth0": {"up": True, "running": False, "ipv4": ["10.0.0.2/24"]}}
    [result] = net005(node({"eth0": ["10.0.0.2"]}, links))
    assert result.status is Status.FAIL and "no socket interface found" in result.message


# --- on the test cluster: interfaces planted for real in a node's namespace, its GPUs recorded (NVML) ---------

COLLECT = ("import json, sys; from preflight.node import collector; print(json.dumps(collector.collect({'head': "
           "sys.argv[1], 'port': 29500, 'paths': {}, 'job': json.loads(sys.argv[2])})))")


def planted(cluster, node, home=None, job=None, nccl=None, check_id="NET005"):
    """(NET005's result, the node's interfaces in the kernel's order) on the facts the collector reads in the node's
    own namespace (as a user whose home is `home`, when given; for the job `job`, what the head sends), with a
    recorded GPU node's NVML answers and the NCCL `nccl` its torch loads (this machine has neither)."""
    import json
    import sys

    from fabric_nodes import gpus

    user = ["env", f"HOME={home}"] if home else []
    proc = cluster.netns_exec(node, [*user, sys.executable, "-c", COLLECT, cluster.ip(cluster.nodes[0]),
                                     json.dumps(job)])
    facts = json.loads(proc.stdout)
    facts["gpus"] = gpus()
    facts["packages"]["versions"]["nccl"] = nccl
    [result] = net005(facts, check_id)
    return result, list(facts["host"]["interfaces"])


@pytest.mark.cluster
def test_an_ipoib_interface_on_another_network_is_named_and_left_to_the_path_probes(cluster):
    with cluster.extra_interface("node02", "ib0", "192.168.77.2/24"):
        result, _ = planted(cluster, "node02")
    assert result.status is Status.PASS, result
    assert "NCCL bootstraps over ib0 (192.168.77.2), its default: an ib* interface" in result.message
    assert "NET009 probes it" in result.message


@pytest.mark.cluster
def test_an_ib_interface_with_only_its_link_local_address_is_said_to_be_one(cluster):
    with cluster.extra_interface("node02", "ib0"):
        result, _ = planted(cluster, "node02")
    assert result.status is Status.WARN and "over ib0 (fe80:" in result.message and "link-local" in result.message


@pytest.mark.cluster
def test_excluded_bridges_and_an_ib_interface_without_carrier_leave_the_training_interface_chosen(cluster):
    with cluster.extra_interface("node02", "docker0", "172.17.0.1/16"), \
            cluster.extra_interface("node02", "virbr0", "192.168.122.1/24"), \
            cluster.extra_interface("node02", "ib0", "192.168.77.2/24", carrier=False):
        result, _ = planted(cluster, "node02", nccl="2.28.9")
        unknown, _ = planted(cluster, "node02")  # before 2.28.3 NCCL takes ib0 without carrier: not judged
    assert result.status is Status.PASS and "over eth0" in result.message, result
    assert unknown.status is Status.SKIP and "2.28.3 and newer pick eth0, older releases ib0" in unknown.message


@pytest.mark.cluster
def test_a_container_bridge_is_named_where_the_kernel_lists_it_before_the_training_interface(cluster):
    """A veth made in the namespace takes a free low index, and eth0 (moved in) keeps its own: the kernel lists
    cni0 first here, as a CNI bridge made at boot comes before a NIC renamed later."""
    with cluster.extra_interface("node02", "cni0", "10.244.0.1/24"):
        result, order = planted(cluster, "node02")
    if order.index("cni0") < order.index("eth0"):
        assert result.status is Status.WARN and "over cni0 (10.244.0.1)" in result.message, result
        assert result.remediation.startswith("set NCCL_SOCKET_IFNAME==eth0")
    else:
        assert result.status is Status.PASS and "over eth0" in result.message, (order, result)


@pytest.mark.cluster
def test_a_users_nccl_conf_on_one_node_is_what_nccl_picks_by_and_named_with_its_line(cluster, tmp_path):
    """NCCL reads ~/.nccl.conf of the user running the rank (src/misc/param.cc): the collector on the node reads it,
    and NET005 judges the interface it selects, naming the file and line to change; a node without it is judged
    by NCCL's default."""
    (tmp_path / ".nccl.conf").write_text("# the training network\nNCCL_SOCKET_IFNAME=ib\n")
    with cluster.extra_interface("node02", "ib0", "192.168.77.2/24"):
        result, _ = planted(cluster, "node02", home=tmp_path, nccl="2.30.3")
        unknown, _ = planted(cluster, "node02", home=tmp_path)  # before 2.30: the home of the password database
        (tmp_path / ".nccl.conf").write_text("NCCL_SOCKET_IFNAME==eth1\n")
        missing, _ = planted(cluster, "node02", home=tmp_path, nccl="2.30.3")
    assert result.status is Status.WARN, result  # up, but not on the network to the head: every node must reach it
    assert result.message.startswith(f"NCCL_SOCKET_IFNAME=ib (from {tmp_path}/.nccl.conf line 2) selects ib0 "
                                     "(192.168.77.2), which is not on the network"), result
    assert f"comes from {tmp_path}/.nccl.conf line 2: change it there" in result.remediation
    assert missing.status is Status.FAIL and missing.message.startswith(
        f"NCCL_SOCKET_IFNAME==eth1 (from {tmp_path}/.nccl.conf line 1) selects no interface"), missing
    assert unknown.status is Status.SKIP and "NCCL_SOCKET_IFNAME unset or NCCL_SOCKET_IFNAME=ib (" in unknown.message \
        and "by the NCCL release, which is not known here" in unknown.message, unknown


@pytest.mark.cluster
def test_the_nccl_conf_file_a_batch_script_exports_is_read_on_the_node_and_one_set_when_it_runs_is_not(
        cluster, tmp_path):
    """`export NCCL_CONF_FILE=...` in the batch script (check --sbatch): the node reads that file, as NCCL in the job
    will; a value the script computes when it runs is not known, and NCCL's default choice is not judged."""
    from preflight.inputs import batchscript
    from preflight.job.view import request

    (tmp_path / "job.conf").write_text("NCCL_SOCKET_IFNAME==eth1\n")

    def job(value):
        batch = batchscript.parse(str(tmp_path / "job.sh"), f"#!/bin/bash\n#SBATCH --nodes=2\nexport NCCL_CONF_FILE="
                                  f"{value}\nsrun python train.py\n", {})
        return request(build_plan(command=tuple(batch.main.command.argv), batch=batch))
    named, _ = planted(cluster, "node02", job=job(tmp_path / "job.conf"), nccl="2.23.4")
    later, _ = planted(cluster, "node02", job=job("$SLURM_SUBMIT_DIR/job.conf"), nccl="2.23.4")
    (tmp_path / "job.conf").write_text("NCCL_SOCKET_IFNAME==eth0\nexport NCCL_IB_DISABLE=1\n")  # PKG009
    misread, _ = planted(cluster, "node02", job=job(tmp_path / "job.conf"), nccl="2.23.4", check_id="PKG009")
    assert misread.status is Status.WARN and misread.message.startswith(
        f"{tmp_path}/job.conf line 2: `export NCCL_IB_DISABLE=1`: NCCL sets a variable named"), misread
    assert misread.remediation == f"write `NCCL_IB_DISABLE=1` without `export` in {tmp_path}/job.conf line 2"
    assert named.status is Status.FAIL and named.message.startswith(
        f"NCCL_SOCKET_IFNAME==eth1 (from {tmp_path}/job.conf line 1) selects no interface"), named
    assert later.status is Status.SKIP and "NCCL_CONF_FILE: the job sets it when it runs ($SLURM_SUBMIT_DIR/job.conf)" \
        in later.message, later


@pytest.mark.parametrize("interfaces", [{"eth0": ["not-an-address"]}, {"eth0": ["10.0.0.2/33"]}, {}, {"eth0": [""]},
                                        {"ib0": ["fe80::1%eth0"], "eth0": ["10.0.0.2"]}, {"ib0": ["::"]}])
def test_a_hostile_node_s_interfaces_never_make_net005_raise(interfaces):
    """Whatever text a node sends where its addresses go (the facts' shapes are held on arrival: lists of text)."""
    facts = node({"eth0": ["10.0.0.2"]})
    facts["host"]["interfaces"] = interfaces
    facts["env"] = {"NCCL_SOCKET_FAMILY": "AF_UNIX", "NCCL_COMM_ID": "[::1"}
    for result in net005(facts):
        assert result.status is not Status.ERROR, result


def test_nccl_comm_ids_subnet_match_walks_every_entry_as_ncclfindinterfacematchsubnet_does():
    """It tests no carrier and no NCCL_SOCKET_FAMILY (src/os/linux.cc): an interface without carrier on the
    subnet is chosen there, where the default rules would skip it."""
    interfaces = {"lo": ["127.0.0.1"], "eno1": ["192.168.1.5"], "eth0": ["10.0.0.2"]}
    links = {"eno1": {"up": True, "running": True, "ipv4": ["192.168.1.5/24"]},
             "eth0": {"up": True, "running": False, "ipv4": ["10.0.0.2/24"]}}
    assert picked(node(interfaces, links, env={"NCCL_COMM_ID": "10.0.0.1:29600"}))[0] == ("eth0", "10.0.0.2")
    assert picked(node(interfaces, links))[0] == ("eno1", "192.168.1.5")
