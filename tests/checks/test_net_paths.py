"""NET007-NET011: the data path between every pair of nodes. The interface MTU across nodes (NET007), what
each path carries with do-not-fragment (NET008), a listener on an ephemeral port dialled from the others
(NET009), the route each node takes to every other (NET010), every node's resolution of the others' names
(NET011): recorded probes first, the node side on this machine's loopback, then the real test cluster with
each fault planted (MTU and gso_max_segs, an nft rule, a second interface with a more specific route, a
per-node hosts file)."""
import copy
import socket
import threading
import time

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check
from node_facts import NODES, facts, run
from preflight.node import paths
from preflight.remote import gather
from preflight.remote.shapes import PATHS_PROBE, problem
from preflight.result import Status

ADDRESS = {n: f"10.0.0.{k + 1}" for k, n in enumerate(NODES)}


def peer_result(node, peer, **change):
    found = {"address": ADDRESS[peer], "source": ADDRESS[node], "device": "eth0", "names": {peer: [ADDRESS[peer]]},
             "tcp": {"ok": True, "seconds": 0.001}, "mtu": {"size": 1500, "ok": True, "carried": 1500}}
    found.update(change)
    return found


def probe(changes=None, mtu=None):
    """The data-path probe of three healthy nodes; changes[(node, peer)] alters what node found of peer."""
    changes = changes or {}
    peers = {n: {p: peer_result(n, p, **changes.get((n, p), {})) for p in NODES if p != n} for n in NODES}
    return {"paths": {"peers": peers, "address": dict(ADDRESS), "mtu": dict({n: 1500 for n in NODES}, **(mtu or {})),
                      "opened": {n: {"open": True, "tcp_port": 40000, "udp_port": 40001, "port_range": [32768, 60999]}
                                 for n in NODES}, "seconds": 0.01}}


def statuses(results):
    return {(r.status, tuple(r.nodes)) for r in results}


def test_every_path_check_passes_a_healthy_cluster():
    for check_id in ("NET007", "NET008", "NET009", "NET010", "NET011"):
        found = run(check_id, facts(), probe())
        assert [r.status for r in found] == [Status.PASS], (check_id, [r.message for r in found])
        assert set(found[0].nodes) == set(NODES)


def test_path_checks_skip_without_the_probe_and_say_why():
    for check_id in ("NET007", "NET008", "NET009", "NET010", "NET011"):
        found = run(check_id, facts(), {})
        assert [r.status for r in found] == [Status.SKIP] and "did not run" in found[0].message


def test_a_jumbo_mtu_on_two_nodes_warns_on_those_two_and_the_black_hole_names_the_pair():
    jumbo = {"size": 9000, "ok": False, "carried": 1500}
    p = probe({("n02", "n03"): {"mtu": jumbo}, ("n03", "n02"): {"mtu": jumbo}}, mtu={"n02": 9000, "n03": 9000})
    mtu = run("NET007", facts(), p)
    assert statuses(mtu) == {(Status.WARN, ("n02",)), (Status.WARN, ("n03",)), (Status.PASS, ("n01",))}
    assert "is 9000, not the 1500 that the paths carry" in mtu[0].message
    path = run("NET008", facts(), p)
    failed = [r for r in path if r.status == Status.FAIL]
    assert [r.nodes for r in failed] == [("n02", "n03")]
    assert "packets of 9000 bytes" in failed[0].message and "the path carries 1500" in failed[0].message
    assert "both ways" in failed[0].message and failed[0].evidence["carried"] == 1500
    assert statuses(path) - {(Status.FAIL, ("n02", "n03"))} == {(Status.PASS, ("n01",))}


def test_a_node_no_other_node_can_dial_on_an_ephemeral_port_is_named_alone():
    refused = {"tcp": {"ok": False, "error": "timed out after 5s"}}
    found = run("NET009", facts(), probe({("n01", "n03"): refused, ("n02", "n03"): refused}))
    assert statuses(found) == {(Status.FAIL, ("n03",)), (Status.PASS, ("n01", "n02"))}
    fail = next(r for r in found if r.status == Status.FAIL)
    assert "no other node can connect to n03 on an ephemeral port" in fail.message
    assert "32768-60999" in fail.message and "NCCL_COMM_ID" in fail.message
    assert "open TCP ports 32768-60999 on n03" in fail.remediation


def test_one_pair_that_cannot_connect_names_the_pair():
    refused = {"tcp": {"ok": False, "error": "Connection refused"}}
    found = run("NET009", facts(), probe({("n02", "n03"): refused}))
    assert (Status.FAIL, ("n02", "n03")) in statuses(found)
    assert not any(r.status == Status.FAIL and r.nodes == ("n03",) for r in found)


def test_a_pair_that_cannot_connect_either_way_is_one_result_that_names_each_end_once():
    refused = {"tcp": {"ok": False, "error": "Connection refused"}}
    found = run("NET009", facts(), probe({("n02", "n03"): refused, ("n03", "n02"): refused}))
    assert sorted(statuses(found)) == sorted({(Status.FAIL, ("n02", "n03")), (Status.PASS, ("n01",))})
    [failed] = [r for r in found if r.status == Status.FAIL]
    assert "(both ways)" in failed.message and failed.evidence["both_ways"] is True


def test_a_captured_route_fails_the_node_that_has_it_and_no_probe_blames_its_peer():
    lost = {"device": "cap0", "tcp": {"ok": False, "error": "timed out after 5s"},
            "mtu": {"size": 1500, "ok": False, "carried": None, "error": "no datagram came back"}}
    back = {"tcp": {"ok": False, "error": "timed out after 5s"}}
    p = probe({("n02", "n03"): lost, ("n03", "n02"): back})
    routes = run("NET010", facts(), p)
    assert statuses(routes) == {(Status.FAIL, ("n02",)), (Status.PASS, ("n01", "n03"))}
    fail = next(r for r in routes if r.status == Status.FAIL)
    assert "routes to n03 (10.0.0.3) over cap0, not over eth0" in fail.message
    assert "ip route get 10.0.0.3" in fail.remediation  # a node that did not say which route: ip route get tells
    p = probe({("n02", "n03"): dict(lost, route="10.0.0.3/32 dev cap0"), ("n03", "n02"): back})
    fail = next(r for r in run("NET010", facts(), p) if r.status == Status.FAIL)
    assert "over cap0 (the route 10.0.0.3/32 dev cap0), not over eth0" in fail.message
    assert fail.remediation == ("on n02: delete the route that captures it (ip route del 10.0.0.3/32 dev cap0), or "
                                "take cap0 off the training subnet")
    for check_id in ("NET008", "NET009"):
        assert not any(r.status in (Status.FAIL, Status.WARN) for r in run(check_id, facts(), p)), check_id


def test_a_device_without_the_source_address_is_a_captured_route():
    lost = {"device": "cap0", "tcp": {"ok": False, "error": "timed out after 5s"}}
    p = probe({("n02", "n03"): lost, ("n02", "n01"): dict(lost)})
    found = run("NET010", facts(), p)  # every peer over cap0: the route to the head over eth0 still says so
    assert (Status.FAIL, ("n02",)) in statuses(found)


def test_another_way_out_to_a_peer_that_still_answers_warns_and_refuses_nothing():
    # two rails, or a second routed network: the peer answers over the other interface, so the job may run
    p = probe({("n02", "n03"): {"device": "ib1"}})
    found = run("NET010", facts(), p)
    assert statuses(found) == {(Status.WARN, ("n02",)), (Status.PASS, ("n01", "n03"))}
    warned = next(r for r in found if r.status == Status.WARN)
    assert "routes to n03 (10.0.0.3) over ib1, not over eth0" in warned.message and "it answers there" in warned.message


def test_a_wrong_hosts_entry_fails_the_node_that_has_it():
    found = run("NET011", facts(), probe({("n02", "n03"): {"names": {"n03": ["10.0.0.99"]}}}))
    assert statuses(found) == {(Status.FAIL, ("n02",)), (Status.PASS, ("n01", "n03"))}
    fail = next(r for r in found if r.status == Status.FAIL)
    assert "resolves 'n03' to 10.0.0.99, which is not an address of n03 (10.0.0.3)" in fail.message
    assert "n03 in /etc/hosts (or DNS) on n02" in fail.remediation


def test_an_unresolvable_peer_hostname_warns_and_an_ssh_alias_does_not():
    def alias(state):
        state["facts"]["host"]["hostname"] = "gpu-3.example"

    states = facts(n03=alias)
    found = run("NET011", states, probe({("n01", "n03"): {"names": {"n03": {"error": "Name or service not known"},
                                                                      "gpu-3.example": ["10.0.0.3"]}},
                                           ("n02", "n03"): {"names": {"n03": [ADDRESS["n03"]],
                                                                      "gpu-3.example": {"error": "no answer"}}}}))
    assert statuses(found) == {(Status.WARN, ("n02",)), (Status.PASS, ("n01", "n03"))}


def test_the_schedule_is_every_pair_up_to_its_bound_and_a_ring_above():
    assert gather.path_schedule(3) == [[1, 2], [2, 0], [0, 1]]
    big = gather.path_schedule(100, most=4)
    assert big[0] == [1, 2, 3, 4] and big[99] == [0, 1, 2, 3]
    assert all(sum(i in peers for peers in big) == 4 for i in range(100))  # every node dialled as often


def test_a_peer_answer_of_another_shape_is_refused():
    assert problem({"paths": {"n02": {"tcp": {"ok": "yes"}}}}, PATHS_PROBE, "it") == "it.paths['n02'].tcp.ok is a string"
    assert problem({"paths": {"n02": peer_result("n01", "n02")}}, PATHS_PROBE, "it") is None


# --- the node side, on this machine -----------------------------------------------------------------------

def test_the_responder_answers_a_probe_of_every_kind_on_loopback():
    responder = paths.Responder()
    try:
        ports = responder.ports()
        assert paths.port_range()[0] <= ports["tcp_port"] <= paths.port_range()[1]
        started = time.monotonic()
        found = paths.probe([{"name": "me", "address": "127.0.0.1", "names": ["localhost"], "tcp_port": ports["tcp_port"],
                              "udp_port": ports["udp_port"], "mtu": 1500}], 2.0, 0.5)["me"]
        assert time.monotonic() - started < 2.0
    finally:
        responder.stop()
    assert found["tcp"]["ok"] is True, found["tcp"]
    assert found["mtu"] == {"size": 1500, "ok": True, "carried": 1500}
    assert "127.0.0.1" in found["names"]["localhost"]


def test_a_closed_port_is_said_within_the_deadline():
    responder = paths.Responder()
    port = responder.ports()["tcp_port"]
    responder.stop()
    found = paths.probe([{"name": "me", "address": "127.0.0.1", "tcp_port": port}], 1.0, 0.2)["me"]
    assert found["tcp"]["ok"] is False and found["tcp"]["error"]


def loopback_peers(responders, **change):
    return [dict({"name": f"n{k:02d}", "address": "127.0.0.1", "names": [], "tcp_port": r.ports()["tcp_port"],
                  "udp_port": r.ports()["udp_port"], "mtu": 1500}, **change) for k, r in enumerate(responders)]


def test_healthy_peers_are_probed_at_once_without_a_thread_each(monkeypatch):
    responders = [paths.Responder() for _ in range(8)]
    started, real = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self) or real(self))
    try:
        found = paths.probe(loopback_peers(responders), 2.0, 0.5)
    finally:
        for responder in responders:
            responder.stop()
    assert all(f["tcp"]["ok"] and f["mtu"] == {"size": 1500, "ok": True, "carried": 1500} for f in found.values())
    assert len(started) <= 1, started  # the resolver's, at most: nothing to search on a healthy path


def test_a_closed_peer_among_healthy_ones_fails_alone():
    responders = [paths.Responder() for _ in range(3)]
    closed = paths.Responder()
    peers = loopback_peers(responders) + loopback_peers([closed], name="shut")
    closed.stop()
    try:
        found = paths.probe(peers, 1.0, 0.2)
    finally:
        for responder in responders:
            responder.stop()
    assert found["shut"]["tcp"]["ok"] is False and found["shut"]["mtu"]["ok"] is False
    assert "no datagram came back" in found["shut"]["mtu"]["error"]
    assert all(found[f"n{k:02d}"]["tcp"]["ok"] and found[f"n{k:02d}"]["mtu"]["ok"] for k in range(3))


def test_a_name_several_peers_share_is_looked_up_once_and_lookups_are_bounded(monkeypatch):
    calls, running, most, lock = [], [0], [0], threading.Lock()

    def lookup(name, *args):
        with lock:
            calls.append(name)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return [(2, 1, 6, "", ("10.0.0.9", 0))]

    monkeypatch.setattr(paths.socket, "getaddrinfo", lookup)
    peers = [{"name": f"p{k}", "address": "127.0.0.1", "names": [f"p{k}", "shared"]} for k in range(24)]
    found = paths.probe(peers, 2.0, 0.2)
    assert sorted(calls) == sorted([f"p{k}" for k in range(24)] + ["shared"])
    assert 1 < most[0] <= paths.RESOLVERS
    assert found["p3"]["names"] == {"p3": ["10.0.0.9"], "shared": ["10.0.0.9"]}


def test_a_responder_stops_at_once_while_it_serves():
    responder = paths.Responder()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.settimeout(2.0)
        sock.sendto(paths.ANSWER.pack(7, 600), ("127.0.0.1", responder.ports()["udp_port"]))
        assert sock.recv(64) == paths.ANSWER.pack(7, 600)  # its thread has just gone back to waiting
        started = time.monotonic()
        responder.stop()
        assert time.monotonic() - started < 0.1
        assert not responder.thread.is_alive()
    finally:
        sock.close()
        responder.stop()


def test_the_search_names_the_largest_size_a_path_carries(monkeypatch):
    def path_of_1500(address, port, sizes, wait_s):
        return {s for s in sizes if s <= 1500}, []

    monkeypatch.setattr(paths, "_datagrams", path_of_1500)
    assert paths.path_mtu("10.0.0.2", 1, 9000, 0.1) == {"size": 9000, "ok": False, "carried": 1500}


def test_a_path_that_drops_every_datagram_is_not_called_an_mtu(monkeypatch):
    monkeypatch.setattr(paths, "_datagrams", lambda *a: (set(), []))
    found = paths.path_mtu("10.0.0.2", 1, 9000, 0.1)
    assert found["ok"] is False and found["carried"] is None and "no datagram came back" in found["error"]


def test_the_most_specific_route_wins_and_is_named_as_ip_route_writes_it():
    table = [(0, 0, 0, "eth0", 0x0A4D0001), (0x0A4D0000, 0xFFFFFF00, 0, "eth0", 0),
             (0x0A4D000D, 0xFFFFFFFF, 0, "cap0", 0)]
    assert paths.route_to("10.77.0.13", table) == ("cap0", "10.77.0.13/32 dev cap0")
    assert paths.route_to("10.77.0.12", table) == ("eth0", "10.77.0.0/24 dev eth0")
    assert paths.route_to("192.168.1.1", table) == ("eth0", "default via 10.77.0.1 dev eth0")
    assert paths.route_to("not an address", table) == (None, None)


# --- the real test cluster --------------------------------------------------------------------------------

PATH_CHECKS = "NET007,NET008,NET009,NET010,NET011"


def _by_id(doc):
    found = {}
    for r in doc["results"]:
        found.setdefault(r["id"], []).append((r["status"], tuple(r["nodes"])))
    return found


@pytest.mark.cluster
def test_the_healthy_cluster_passes_every_path_check(cluster):
    doc, elapsed = check(cluster, "--only", PATH_CHECKS)
    found = _by_id(doc)
    for check_id in PATH_CHECKS.split(","):
        assert [s for s, _ in found[check_id]] == ["pass"], (check_id, doc["results"])
    assert elapsed < 30


@pytest.mark.cluster
def test_jumbo_frames_on_two_nodes_behind_a_1500_bridge_name_the_pair(cluster):
    with cluster.jumbo_mtu_fault("node02"), cluster.jumbo_mtu_fault("node03"):
        doc, _ = check(cluster, "--only", PATH_CHECKS, "--timeout", "10")
    found = _by_id(doc)
    assert ("fail", ("node02", "node03")) in found["NET008"], found["NET008"]
    assert not any(s == "fail" and "node01" in n for s, n in found["NET008"])
    assert {("warn", ("node02",)), ("warn", ("node03",))} <= set(found["NET007"])
    result = next(r for r in doc["results"] if r["id"] == "NET008" and r["status"] == "fail")
    assert result["evidence"]["carried"] == 1500 and result["evidence"]["size"] == 9000
    for check_id in ("NET009", "NET010", "NET011"):
        assert [s for s, _ in found[check_id]] == ["pass"], (check_id, found[check_id])


@pytest.mark.cluster
def test_a_firewall_open_for_ssh_and_the_main_port_only_is_named_on_that_node(cluster):
    with cluster.blocked_incoming("node03", 29500):
        doc, elapsed = check(cluster, "--only", PATH_CHECKS + ",NET004", "--timeout", "5")
    found = _by_id(doc)
    assert found["NET009"][0] == ("fail", ("node03",)), found["NET009"]
    assert [s for s, n in found["NET009"] if s == "fail"] == ["fail"]
    result = next(r for r in doc["results"] if r["id"] == "NET009" and r["status"] == "fail")
    assert "NCCL and gloo also listen on ports 32768-60999" in result["message"]
    assert [s for s, _ in found["NET004"]] == ["pass"]
    assert elapsed < 30


@pytest.mark.cluster
def test_a_second_interface_with_a_more_specific_route_is_named_on_its_node(cluster):
    with cluster.captured_route("node02", "node03"):
        doc, _ = check(cluster, "--only", PATH_CHECKS, "--timeout", "5")
    found = _by_id(doc)
    assert ("fail", ("node02",)) in found["NET010"] and len([s for s, _ in found["NET010"] if s == "fail"]) == 1
    failed = next(r for r in doc["results"] if r["id"] == "NET010" and r["status"] == "fail")
    target = cluster.ip("node03")
    assert f"(the route {target}/32 dev cap0)" in failed["message"], failed["message"]
    assert f"ip route del {target}/32 dev cap0" in failed["remediation"]
    for check_id in ("NET008", "NET009", "NET011"):
        assert not any(s in ("fail", "warn") for s, _ in found[check_id]), (check_id, found[check_id])


@pytest.mark.cluster
def test_a_hosts_file_that_maps_another_node_wrongly_is_named_on_its_node(cluster):
    with cluster.wrong_hosts_entry_fault("node02", "node03", "10.77.0.99"):
        doc, _ = check(cluster, "--only", PATH_CHECKS, "--timeout", "5")
    found = _by_id(doc)
    assert found["NET011"][0] == ("fail", ("node02",)), found["NET011"]
    result = next(r for r in doc["results"] if r["id"] == "NET011" and r["status"] == "fail")
    assert "resolves 'node03' to 10.77.0.99" in result["message"]


def test_the_host_facts_carry_each_links_mtu_and_the_port_range_and_another_shape_is_refused():
    doc = copy.deepcopy(facts()["n01"]["facts"])
    assert gather.checked_facts(copy.deepcopy(doc))["host"] == doc["host"]
    assert all(isinstance(link["mtu"], int) for link in doc["host"]["links"].values())
    doc["host"]["links"]["lo"]["mtu"] = "big"
    assert "host.links['lo'].mtu is a string" in gather.checked_facts(doc)["host"]["error"]


def test_a_path_that_loses_the_full_size_once_is_not_a_black_hole(monkeypatch):
    calls = []

    def lossy(address, port, sizes, wait_s):  # the first two bursts lose their largest datagram (a full queue)
        calls.append(sizes)
        return ({s for s in sizes if s < 9000} if len(calls) <= 2 else set(sizes)), []

    monkeypatch.setattr(paths, "_datagrams", lossy)
    found = paths.path_mtu("10.0.0.2", 1, 9000, 0.1)
    assert found["ok"] is True and found["carried"] == 9000 and found["lossy"] is True


def test_the_probed_address_is_the_one_the_jobs_traffic_uses():
    # A node reaching the head over its management network, with NCCL told to use the training fabric: the
    # peers probe the fabric's address (a firewall open there only must not read as closed).
    from preflight.remote.gather import own_address

    host = {"interfaces": {"lo": ["127.0.0.1"], "eth0": ["192.168.1.2"], "ib0": ["10.10.0.2"]},
            "route_to_head": {"head": "n01", "source": "192.168.1.2", "interface": "eth0"},
            "resolves_to": ["192.168.1.2"]}
    with_gpus = {"host": host, "env": {"NCCL_SOCKET_IFNAME": "ib0"}, "gpus": {"available": True}}
    assert own_address(with_gpus) == "10.10.0.2"
    assert own_address({"host": host, "env": {"GLOO_SOCKET_IFNAME": "ib0"}, "gpus": {}}) == "10.10.0.2"
    assert own_address({"host": host, "env": {}, "gpus": {}}) == "192.168.1.2"  # gloo's default: the hostname's
    assert own_address({"host": host, "env": {"NCCL_SOCKET_IFNAME": "ens9"}, "gpus": {"available": True}}) == \
        "192.168.1.2"  # a selection that matches nothing (NET005 says so): the route to the head
