"""What keeps `preflight doctor` linear in the job's size (scripts/bench_census.py times it): the nodes' names and
addresses are indexed once, each launcher's command is parsed once, the places of identical stacks are worked out
once; the answers are node_at's, _launch's and where's."""
import dataclasses
import sys
from collections import UserDict

import pytest

from preflight import registry, runner
from preflight.job import running
from preflight.plan import build_plan

FRAMES = [["all_reduce", "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 3252],
          ["step", "/job/train.py", 10], ["<module>", "/job/train.py", 14]]


def host(name, *addresses, **more):
    return {"facts": {"host": dict({"hostname": name, "fqdn": f"{name}.cluster",
                                    "interfaces": {"lo": ["127.0.0.1"], "eth0": list(addresses)}}, **more)},
            "error": None, "clock": None}


FACTS = {
    "a": host("host-a", "10.0.0.1", "10.9.0.1"),
    "b": host("host-b", "10.0.0.2", "10.9.0.1"),  # 10.9.0.1 on a too: the first node has it
    "c": {"facts": {"host": {"hostname": 7, "interfaces": {"eth0": "10.0.0.3", "ib0": [None, {"x": 1}, "10.1.0.3"]}}}},
    "d": {"facts": {"host": "broken"}},
    "e": {"facts": None, "error": {"message": "timed out"}},
    "f": host("host-f", "fd00::6"),
}


@pytest.mark.parametrize("address", ["a", "b", "host-a", "host-b.cluster", "10.0.0.2", "10.9.0.1", "10.0.0.3",
                                     "10.1.0.3", "fd00::6", "127.0.0.1", "127.0.0.5", "localhost", "::1", "[::1]",
                                     "10.7.7.7", "nowhere", "", None, 7, ["10.0.0.1"]])
def test_the_index_of_addresses_answers_as_node_at(address):
    def answer(ask):
        try:
            return ask()
        except Exception as exc:  # a value that is no address (hostile facts): the same error
            return type(exc)

    addresses = running.Addresses(FACTS)
    for seen_from in ("a", "f"):
        assert answer(lambda: addresses.node_at(address, seen_from)) == \
            answer(lambda: running.node_at(FACTS, address, seen_from)), address


class Counted(UserDict):
    """Facts that count how often every node is walked."""

    walks = 0

    def items(self):
        Counted.walks += 1
        return super().items()


def job(nodes, master="10.0.0.1", port=29500):
    """A torchrun launcher and two ranks on each node, every rank at the same place."""
    facts = {}
    for i, node in enumerate(nodes):
        threads = [{"name": "MainThread", "active": False, "frames": [list(f) for f in FRAMES]}]
        launcher = {"pid": 100, "kind": "launcher", "state": "S", "children": [101, 102],
                    "argv": ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes", str(len(nodes)), "--nproc_per_node",
                             "2", "--node_rank", str(i), "--master_addr", master, "--master_port", str(port), "t.py"],
                    "sockets": [{"local": "::", "local_port": port, "state": "LISTEN"}] if i == 0 else []}
        ranks = [{"pid": 101 + k, "ppid": 100, "kind": "rank", "state": "S", "argv": ["python", "t.py"],
                  "threads": threads, "stable": True,
                  "env": {"RANK": str(2 * i + k), "WORLD_SIZE": str(2 * len(nodes)), "GROUP_RANK": str(i),
                          "MASTER_ADDR": master, "MASTER_PORT": str(port)}} for k in range(2)]
        facts[node] = host(node, f"10.0.{i // 250}.{i % 250 + 1}")
        facts[node]["facts"]["census"] = {"processes": [launcher, *ranks], "stacks": {"read": 3}}
    return facts


def run_checks(nodes, facts, ids):
    plan = build_plan(nodes=tuple(nodes))
    census = running.build(plan.nodes, facts, 29500)
    ctx = runner.CheckContext(plan, facts, {"census": census})
    reg = registry.load()
    return {i: list(runner.run_check(reg.get(i), ctx)) for i in ids}


def test_the_master_address_of_every_process_is_found_without_walking_every_node_for_each():
    nodes = [f"n{i:03d}" for i in range(60)]
    for master in ("10.0.0.1", "head-alias"):  # the head's address, and a name no node has
        facts = Counted(job(nodes, master=master))
        Counted.walks = 0
        results = run_checks(nodes, facts, ("RUN003", "RUN004", "RUN005"))
        assert Counted.walks <= 1, master  # once for the checks together, not once a process (180 of them)
        assert [r.status.value for r in results["RUN003"]] == ["pass"]


def test_each_launchers_command_is_parsed_once(monkeypatch):
    calls = []
    parse = running._launch
    monkeypatch.setattr(running, "_launch", lambda argv, dropped=0: calls.append(1) or parse(argv, dropped))
    nodes = [f"n{i:03d}" for i in range(40)]
    results = run_checks(nodes, job(nodes), ("RUN001", "RUN002", "RUN008"))
    assert len(calls) == len(nodes)  # build, RUN001 (DeepSpeed's filter), RUN008 (older jobs) share it
    assert [r.status.value for r in results["RUN008"]] == ["pass"]


def test_ranks_at_the_same_place_are_placed_once_and_share_a_where_none_can_change(monkeypatch):
    calls = []
    place = running._where
    monkeypatch.setattr(running, "_where", lambda threads: calls.append(1) or place(threads))
    nodes = [f"n{i:03d}" for i in range(30)]
    census = running.build(nodes, job(nodes), 29500)
    assert len(calls) == 1  # 60 ranks, one stack
    ranks = census.ranks
    assert {(p.where.phase, p.where.op, p.where.at) for p in ranks} == {("collective", "all_reduce",
                                                                         "train.py:10 (step)")}
    assert len({id(p.where) for p in ranks}) == 1  # one object: 147,439 processes at 16,384 nodes, a few places
    with pytest.raises(dataclasses.FrozenInstanceError):  # so no check can move one rank by moving all
        ranks[0].where.op = "broadcast"
    assert {p.where.phase for p in census.launchers} == {"unknown"}  # no stack read


@pytest.mark.skipif(sys.version_info < (3, 10), reason="dataclass makes slots from Python 3.10")
def test_a_process_has_no_dict_of_its_own():
    """30 attributes are past a shared-key instance dict's 29: each Proc would take 1.6 kB, 230 MB at 16,384 nodes."""
    nodes = ["n000", "n001"]
    census = running.build(nodes, job(nodes), 29500)
    assert census.procs and not any(hasattr(p, "__dict__") for p in census.procs)


@pytest.mark.parametrize("threads", [
    None, "nonsense", [], [{"frames": [1, [None]]}], [{"name": "MainThread", "active": True, "frames": FRAMES[1:]}],
    [{"name": "Thread-1", "active": False, "frames": FRAMES[1:]}, {"name": "MainThread", "frames": FRAMES}],
    [{"name": "MainThread", "active": False, "frames": [["1", "/job/a.py", 1]]}],
    [{"name": "MainThread", "active": False, "frames": [[1, "/job/a.py", 1]]}],  # 1 and "1": not the same stack
])
def test_a_place_read_again_is_the_place_worked_out(threads):
    seen = {}
    for launcher in (False, True):
        assert running.where(threads, launcher, seen) == running.where(threads, launcher)
        assert running.where(threads, launcher, seen) == running.where(threads, launcher)  # from `seen`


def test_stacks_placed_with_one_memo_keep_their_own_places():
    """One `seen` for every stack of a census (as build keeps it): a stack never takes another's place, a value
    marshal cannot write included (its repr is the key)."""
    stacks = [None, "nonsense", [], [{"frames": [1, [None]]}], [{"name": "MainThread", "active": True, "frames": FRAMES}],
              [{"name": "MainThread", "active": True, "frames": FRAMES[1:]}],
              [{"name": "MainThread", "active": False, "frames": FRAMES[1:]}],
              [{"name": "MainThread", "active": 1, "frames": FRAMES[1:]}],
              [{"name": "MainThread", "frames": [["barrier", "/job/train.py", 10]]}],
              [{"name": "MainThread", "frames": [["barrier", "/job/train.py", "10"]]}],
              [{"name": "MainThread", "frames": [[object(), "/job/train.py", 3]]}]]
    seen = {}
    for _ in range(2):
        for threads in stacks:
            assert running.where(threads, False, seen) == running.where(threads, False), threads
    assert len(seen) == len(stacks)


def test_every_node_launched_as_node_rank_0_is_judged_in_one_pass_over_them():
    nodes = [f"n{i:04d}" for i in range(1500)]
    facts = job(nodes)
    for i, node in enumerate(nodes):  # the usual mistake: each node launched with the head's --node_rank 0
        launcher = facts[node]["facts"]["census"]["processes"][0]
        launcher["argv"][7] = "0"
        launcher["sockets"] = [{"local": "::", "local_port": 29500, "state": "LISTEN"}]
    results = run_checks(nodes, facts, ("RUN002", "RUN008"))
    [twice] = results["RUN002"]
    assert twice.status.value == "fail" and twice.nodes == tuple(nodes)
    assert "node rank 0 on 1500 nodes" in twice.message and "each host a rendezvous store" in twice.message
    assert [r.status.value for r in results["RUN008"]] == ["pass"]  # one job: the same command on every node


def test_the_processes_by_kind_and_node_follow_the_list_they_are_taken_from():
    """Census indexes its processes once for the checks that ask kind by kind and node by node (a census of
    16,384 nodes has 150,000 processes); a list put in or added to is indexed again."""
    census = running.Census(["a", "b"])
    launcher = running.Proc("a", 1, "launcher", [], "S", None, None, {}, [], [], running.Where("idle"))
    rank = running.Proc("a", 2, "rank", [], "S", None, None, {}, [], [], running.Where("idle"), ppid=1)
    census.procs.append(launcher)
    assert census.launchers == [launcher] and census.ranks == [] and census.on("a") == [launcher]
    census.procs.append(rank)
    assert census.ranks == [rank] and census.on("a", "rank") == [rank] and census.on("b") == []
    census.procs = [rank]
    assert census.launchers == [] and census.ranks == [rank]
    census.launchers.append(launcher)  # a copy: the census's own lists are not the caller's to change
    assert census.launchers == []
