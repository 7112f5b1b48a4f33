"""A node check that declares the facts it reads (registry.check's `reads`): evaluated once per distinct set of
those sections (the gathering shares identical ones among nodes), each node still with its own finding; held to
what it declares; and, on a real cluster's facts, the same results as evaluating it on every node."""
import dataclasses
import importlib.util
import json
import pathlib
import random

import pytest

from preflight import registry, runner
from preflight.plan import build_plan
from preflight.registry import CheckDefinitionError, CheckSpec, check
from preflight.remote.gather import SHARED_FORMS, facts_decoder, node_json
from preflight.remote.session import NodeError
from preflight.result import Finding, Status

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_scale.py"


def spec(func, reads):
    return CheckSpec("TST001", "test-check", "node", (), "w", "y", "f", func, "test", reads=tuple(reads))


def cluster(docs):
    """Nodes n0000... with these facts documents, decoded as gather decodes them (one decoder: shared sections)."""
    decode = facts_decoder()
    states = {f"n{i:04d}": {"error": None, "clock": None, "facts": decode(json.dumps(doc))} for i, doc in enumerate(docs)}
    return runner.CheckContext(build_plan(nodes=tuple(states)), states, {})


def test_nodes_with_the_same_declared_sections_share_one_evaluation_and_each_keeps_its_node():
    calls = []

    def versions(ctx):
        calls.append(1)
        torch = ctx.fact["packages"]["torch"]
        yield Finding(Status.FAIL if torch != "2.13.0" else Status.PASS, f"torch {torch}")

    docs = [{"packages": {"torch": "2.12.1" if i == 7 else "2.13.0"}, "host": {"hostname": f"n{i}"}} for i in range(50)]
    results = runner.run([spec(versions, ["packages"])], cluster(docs))
    assert len(calls) == 2  # one per distinct packages section, not one per node
    by_status = {r.status: r for r in results}
    assert by_status[Status.FAIL].nodes == ("n0007",) and by_status[Status.FAIL].message == "torch 2.12.1"
    assert by_status[Status.PASS].nodes == tuple(f"n{i:04d}" for i in range(50) if i != 7)


def test_a_check_that_reads_its_node_is_evaluated_on_every_node():
    calls = []

    def named(ctx):
        calls.append(1)
        if ctx.fact["packages"]["torch"] != "2.13.0":
            yield Finding(Status.FAIL, "old torch", f"install torch 2.13.0 on {ctx.node}")

    docs = [{"packages": {"torch": "2.12.1"}} for _ in range(5)]
    results = runner.run([spec(named, ["packages"])], cluster(docs))
    assert len(calls) == 5
    assert sorted(r.remediation for r in results) == [f"install torch 2.13.0 on n{i:04d}" for i in range(5)]


def test_what_a_check_does_not_declare_is_an_error_of_the_check_never_read_as_missing():
    def undeclared(ctx):
        yield Finding(Status.PASS, f"gpus {ctx.fact.get('gpus')}")

    def whole(ctx):
        yield Finding(Status.PASS, f"{len(dict(ctx.fact['host']))} host keys")

    docs = [{"packages": {}, "gpus": {"count": 8}, "host": {"hostname": "a", "machine": "x86_64"}}]
    [result] = runner.run([spec(undeclared, ["packages"])], cluster(docs))
    assert result.status is Status.ERROR and "read gpus of the facts, which its `reads` does not name" in result.message
    [result] = runner.run([spec(whole, ["host.machine"])], cluster(docs))
    assert result.status is Status.ERROR and "read all of host" in result.message
    # run_check, as the unit tests of the checks call it, holds a check to its declaration as well
    [result] = runner.run_check(spec(undeclared, ["packages"]), cluster(docs))
    assert result.status is Status.ERROR


def test_a_section_declared_by_its_keys_shares_across_nodes_whose_other_keys_differ():
    calls = []

    def machine(ctx):
        calls.append(1)
        host = ctx.fact.get("host") or {}
        yield Finding(Status.PASS, f"machine {host.get('machine')}, container {host.get('container')}")

    docs = [{"host": {"hostname": f"n{i}", "machine": "aarch64" if i % 2 else "x86_64"}} for i in range(10)]
    docs.append({"host": {}})  # an empty host: `host or {}` is read as empty, not shared with the others
    results = runner.run([spec(machine, ["host.machine", "host.container"])], cluster(docs))
    assert len(calls) == 3
    assert {r.message: len(r.nodes) for r in results} == {
        "machine x86_64, container None": 5, "machine aarch64, container None": 5, "machine None, container None": 1}


def test_sharing_gives_what_evaluating_on_every_node_gives_node_for_node_and_in_order():
    """Nodes whose sections alternate (a finding made on several parts names its nodes in the cluster's order), a
    check that reads its node on some nodes, findings that name other nodes or repeat, nodes not reached, a broken
    section: the results of run() are those of evaluating the check on every node, grouped."""
    def varied(ctx):
        torch = ctx.fact["packages"]["torch"]
        if torch == "own":
            yield Finding(Status.WARN, f"on {ctx.node}")
        if torch == "named":
            yield Finding(Status.FAIL, "seen from here", nodes=("n0001", "n0000"))
        if torch == "twice":
            yield Finding(Status.PASS, "fine")
        yield Finding(Status.PASS, "fine")

    kinds = ["a", "b", "a", "own", "b", "named", "a", "twice", "own", "named", "b", "a"]
    docs = [{"packages": {"torch": kind, "n": i % 2 if kind in "ab" else i}} for i, kind in enumerate(kinds * 3)]
    ctx = cluster(docs)
    down = {"facts": None, "clock": None, "error": {"kind": "timeout", "message": "no answer", "remediation": None}}
    facts = {**ctx.facts, "n0004": down, "n0020": dict(down, error=dict(down["error"], kind="budget")),
             "n0013": dict(ctx.facts["n0013"], facts={"packages": {"error": "collector section packages failed "
                                                                              "on the node: boom"}})}
    ctx = runner.CheckContext(ctx.plan, facts, {})
    shared = runner.run([spec(varied, ["packages"])], ctx)
    alone = runner.unhidden(runner.grouped(runner.run_check(spec(varied, ["packages"]), runner.guarded(ctx))),
                            [spec(varied, ["packages"])], ctx)

    def shown(results):
        return [(r.status, r.nodes, r.message, r.remediation, repr(r.evidence)) for r in results]

    assert shown(shared) == shown(alone)
    assert len({r.message for r in shared}) >= 6


def test_reads_is_for_node_checks_and_names_sections():
    def body(ctx):
        """What.

        Why.

        Fix."""
        return []

    with pytest.raises(CheckDefinitionError, match="reads names a node check"):
        check("TST002", "test-two", "cluster", reads=["packages"])(body)
    with pytest.raises(CheckDefinitionError, match="reads names a node check"):
        check("TST003", "test-three", "node", reads="packages")(body)
    with pytest.raises(CheckDefinitionError, match="reads names a node check"):
        check("TST005", "test-five", "node", reads=["host.addresses.0"])(body)
    assert check("TST004", "test-four", "node", reads=["host.machine"])(body).__preflight_check__.paths == {
        "host": ("machine",)}


# --- the decoder that shares identical sections ------------------------------------------------------

def random_value(rng, depth=0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, -5, 2**63 - 1, 2**64, 1.5, -0.0, 1e300])
    if kind == 2:
        return rng.choice(["", "x", "\u00e9", "a\"b", "\\", "\ud800", "2.13.0"])
    if kind == 3:
        return rng.randrange(3)
    if kind == 4:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice("abc"): random_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def decoded(decode, line):
    try:
        return "ok", decode(line, "x")
    except NodeError as exc:
        return "error", exc.message


def test_the_sharing_decoder_reads_every_line_as_json_does_and_refuses_what_it_refuses():
    """The same documents and the same errors as decoding the line whole (node_json), on random documents
    written with arbitrary spacing, repeated keys, and lines broken anywhere."""
    rng = random.Random(5)
    decode = facts_decoder()
    pool = [random_value(rng) for _ in range(12)] + [{}, [], {"a": [1, {"b": "]}"}]}, [[]], {"a": {}}]  # sent again and again
    for _ in range(3000):
        doc = {rng.choice(["packages", "env", "host", "gpus", "a"]): rng.choice(pool) if rng.random() < 0.6 else
               random_value(rng) for _ in range(rng.randrange(5))}
        line = json.dumps(doc, indent=rng.choice([None, 0, 1]), separators=rng.choice([None, (",", ":"), (" ,", " : ")]))
        if rng.random() < 0.2:
            line = line.replace("{", '{"a": 1, ', 1) if line.startswith("{") and len(doc) else line  # a repeated key
        if rng.random() < 0.2:
            cut = rng.randrange(len(line) + 1)
            line = line[:cut] + rng.choice(["", ",", "}", " x", "\n"]) + line[cut + 1:]
        if rng.random() < 0.05:
            line = rng.choice(["[1]", "1", "", " ", "{} {}", '{"a": NaN}', '{"a": 1e999}', "{,}", '{"a" 1}'])
        expected = decoded(lambda text, what: node_json(text, what), line)
        assert decoded(decode, line) == expected, line


def test_identical_sections_are_one_object_and_the_nodes_own_never_shared():
    decode = facts_decoder()
    one = decode(json.dumps({"packages": {"torch": "2.13.0"}, "host": {"hostname": "a"}, "job": {"cwd": "/x"}}))
    two = decode(json.dumps({"packages": {"torch": "2.13.0"}, "host": {"hostname": "a"}, "job": {"cwd": "/x"}}))
    assert one == two and one["packages"] is two["packages"]
    assert one["host"] is not two["host"] and one["job"] is not two["job"]  # gather adds the files a job names
    forms = [decode(json.dumps({"gpus": {"uuid": str(i)}}))["gpus"] for i in range(SHARED_FORMS + 5)]
    again = [decode(json.dumps({"gpus": {"uuid": str(i)}}))["gpus"] for i in range(SHARED_FORMS + 5)]
    assert all(a is b for a, b in zip(forms[:SHARED_FORMS], again)) and forms[-1] is not again[-1]
    assert again[-1] == {"uuid": str(SHARED_FORMS + 4)}


# --- on the facts of a real cluster ------------------------------------------------------------------

def test_on_a_real_clusters_facts_sharing_gives_every_check_the_results_of_evaluating_it_on_every_node(tmp_path,
                                                                                                  monkeypatch):
    """scripts/bench_scale.py's 64 nodes (this machine's facts, a few made odd): the node checks that declare
    their reads give the same results, node for node, as when each is evaluated on every node."""
    loaded = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    bench_scale = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(bench_scale)
    monkeypatch.chdir(tmp_path)
    facts, probes = bench_scale.synthesize(64, str(tmp_path))
    plan = build_plan(nodes=tuple(facts))
    declared = [s for s in registry.load().checks if s.reads is not None]
    assert len(declared) >= 15

    def shown(results):
        return sorted((r.id, r.status.value, r.nodes, r.message, r.remediation, json.dumps(r.evidence, sort_keys=True,
                                                                                            default=str))
                      for r in results)

    shared = runner.run(declared, runner.CheckContext(plan, facts, probes))
    alone = runner.run([dataclasses.replace(s, reads=None) for s in declared], runner.CheckContext(plan, facts, probes))
    assert shown(shared) == shown(alone)
    assert not [r.message for r in shared if " raised " in r.message]  # (the node that timed out: SSH001 not run)


def test_a_declared_key_of_a_nodes_own_section_shares_by_its_value_and_keeps_types_apart():
    calls = []

    def devices(ctx):
        calls.append(1)
        yield Finding(Status.PASS, f"{ctx.fact['host'].get('rdma_devices')!r} {ctx.fact['host'].get('load')!r}")

    values = [["mlx5_0"], ["mlx5_0"], ["mlx5_1"], [], None, 1, True, 1.0, "1", 0.0, -0.0, [1], [True]]
    docs = [{"host": {"hostname": f"n{i}", "rdma_devices": v, "load": 0}} for i, v in enumerate(values)]
    results = runner.run([spec(devices, ["host.rdma_devices", "host.load"])], cluster(docs))
    assert len(calls) == len(values) - 1  # only the two ["mlx5_0"] are alike
    assert sorted(r.message for r in results) == sorted({f"{v!r} 0" for v in values})


def test_a_section_larger_than_the_decoder_keeps_is_decoded_for_its_node_alone(monkeypatch):
    """A hostile node's huge section is not kept as a text to recognise (64 of them at the longest line each)."""
    from preflight.remote import gather

    monkeypatch.setattr(gather, "SHARED_TEXT", 100)
    decode = facts_decoder()
    big = {"packages": {"versions": {f"p{i}": "1.0" for i in range(20)}}}
    one, two = decode(json.dumps(big)), decode(json.dumps(big))
    assert one == two == big and one["packages"] is not two["packages"]
    small = [decode(json.dumps({"packages": {"torch": "2.13.0"}}))["packages"] for _ in range(2)]
    assert small[0] is small[1]
