"""What a run over thousands of nodes must not pay per node and check: a Result per node before they are grouped,
the GPU selection once per check, the redaction walk of a result with nothing secret-looking in it, hostlist's
general walk for a numbered cluster, the plan's paths per node. Each shortcut gives what the long way gives."""
import importlib
import random

import hostlist
import pytest

from preflight import runner
from preflight.inputs import inventory
from preflight.job import gpus as job_gpus
from preflight.plan import Plan
from preflight.registry import check
from preflight.report import redact
from preflight.result import Finding, Result, Status, fail, passed, skip

NODES = tuple(f"node{i:04d}" for i in range(1, 1025))


def states(nodes=NODES, down=(), budget=()):
    out = {}
    for n in nodes:
        if n in down:
            out[n] = {"facts": None, "clock": None, "error": {"kind": "timeout", "message": "no answer",
                                                              "remediation": "start sshd"}}
        elif n in budget:
            out[n] = {"facts": None, "clock": None, "error": {"kind": "budget", "message": "budget of 5 s spent",
                                                              "remediation": None}}
        else:
            out[n] = {"facts": {"n": n}, "clock": None, "error": None}
    return out


def spec_of(func):
    def body(ctx):
        """W.\n\nW.\n\nF."""
        yield from func(ctx)
    return check("TST020", "costs", "node")(body).__preflight_check__


# --- the runner ----------------------------------------------------------------------------------

def test_a_node_check_over_a_thousand_nodes_makes_a_result_per_finding_not_per_node(monkeypatch):
    made = []

    class Counted(Result):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runner, "Result", Counted)
    facts = states()
    results = runner.run([spec_of(lambda ctx: [passed("fine", size=1)])],
                         runner.CheckContext(Plan(nodes=tuple(facts)), facts, {}))
    assert [(r.status, r.nodes, r.message) for r in results] == [(Status.PASS, NODES, "fine")]
    assert len(made) == 1


def test_every_run_of_a_node_check_goes_through_the_runners_one_evaluation(monkeypatch):
    """runner._run is where every check is evaluated (tests/check_outcomes.py records what checks gave there)."""
    seen = []
    original = runner._run

    def recording(spec, ctx, nodes=()):
        results = original(spec, ctx, nodes)
        seen.extend(results)
        return results

    monkeypatch.setattr(runner, "_run", recording)
    facts = states(down=NODES[:1])
    runner.run([spec_of(lambda ctx: [fail("small", "grow it")] if ctx.node == NODES[5] else [passed("fine")])],
               runner.CheckContext(Plan(nodes=tuple(facts)), facts, {}))
    evaluated = {(r.status, node) for r in seen for node in r.nodes}
    assert evaluated >= {(Status.FAIL, NODES[5])} | {(Status.PASS, node) for node in NODES[1:5] + NODES[6:]}


def varied(ctx):
    """Findings that group and findings that do not: by node, naming other nodes, unprintable text, a raise."""
    number = int(ctx.node[4:])
    if number % 97 == 0:
        raise ValueError("odd node")
    if number % 7 == 0:
        yield fail(f"small on\n{'a' if number % 2 else 'b'}", "grow\tit", size=number % 3)
    if number % 11 == 0:
        yield Finding(Status.WARN, "seen from here", None, nodes=("node0001", ctx.node), evidence={"v": [1, 2]})
    if number % 13 == 0:
        yield skip("not here", blocked_by=None)
    if number % 5 == 0:
        yield Finding(Status.PASS, "same", "fix", evidence={"v": 1 if number % 2 else 1.0})


@pytest.mark.parametrize("facts", [
    states(),
    states(down=NODES[3:9], budget=NODES[20:22]),
], ids=["every node reached", "some unreachable, some past the budget"])
def test_results_as_run_records_them_are_the_per_node_results_grouped(facts):
    spec = spec_of(varied)
    ctx = runner.CheckContext(Plan(nodes=tuple(facts)), facts, {})
    recorded = runner.run([spec], ctx)
    expected = runner.unhidden(runner.grouped(runner.run_check(spec, ctx)), [spec], ctx)

    def shown(results):
        return [(r.id, r.name, r.status, r.nodes, r.message, r.remediation, repr(r.evidence)) for r in results]

    assert shown(recorded) == shown(expected)
    assert len(recorded) < len(runner.run_check(spec, ctx)) / 10


def test_what_several_checks_declare_of_a_nodes_own_section_is_read_once_per_node(monkeypatch):
    """A declared key of the host section (a node's own: never shared) is worked out once per node for all the
    checks that declare it, not once per check and node (16,384 nodes x 25 checks)."""
    calls = []
    real = runner._value_identity
    monkeypatch.setattr(runner, "_value_identity", lambda value: calls.append(1) or real(value))
    facts = {n: {"facts": {"host": {"hostname": n, "machine": "x86_64"}}, "clock": None, "error": None}
             for n in NODES[:64]}

    def declared(number):
        def body(ctx):
            """W.\n\nW.\n\nF."""
            yield passed(f"machine {ctx.fact['host']['machine']}")
        return check(f"TST{number:03d}", f"machine-{number}", "node", reads=["host.machine"])(body).__preflight_check__

    results = runner.run([declared(30), declared(31), declared(32)],
                         runner.CheckContext(Plan(nodes=tuple(facts)), facts, {}))
    assert [(r.id, r.nodes) for r in results] == [(f"TST0{n}", NODES[:64]) for n in (30, 31, 32)]
    assert len(calls) == 64


def test_the_collector_is_paused_while_the_checks_run(monkeypatch, tmp_path):
    """The checks leave no cycles, and the cyclic collector's walks cost a tenth of their time at 16,384 nodes."""
    import gc

    from preflight import cli, engine, registry

    seen = []

    def body(ctx):
        """W.\n\nW.\n\nF."""
        seen.append(gc.isenabled())
        yield passed("fine")

    spec = check("TST033", "collector", "node")(body).__preflight_check__
    facts = states(NODES[:2])
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{n} slots=1\n" for n in facts))
    reg = registry.Registry((spec,), ())
    args = cli.build_parser().parse_args(["check", "--hostfile", str(hostfile), "--only", "TST033"])
    assert gc.isenabled()
    _, _, results, _ = engine.evaluate(reg, args, gather=lambda plan, a, s: runner.CheckContext(plan, facts, {}))
    assert seen == [False, False] and gc.isenabled()
    assert [(r.status, r.nodes) for r in results] == [(Status.PASS, NODES[:2])]


def test_a_version_text_is_parsed_once_however_many_nodes_send_it(monkeypatch):
    from preflight.inputs import versions

    parsed = []
    real = versions.Version
    monkeypatch.setattr(versions, "Version", lambda text: parsed.append(text) or real(text))
    found = [versions.version("2.13.0.post77+costs") for _ in NODES]
    assert parsed == ["2.13.0.post77+costs"] and found[0] == real("2.13.0.post77+costs")
    assert versions.version(["2.13.0"]) is None and versions.version(None) is None  # what a hostile node sends
    assert versions.version(b"2.13.0") is None and versions.version(2) == real("2")


def test_the_variables_nccl_reads_on_a_node_are_worked_out_once_per_node_for_every_check(tmp_path, monkeypatch):
    """nccl_env of a node (its environment and NCCL's files) is asked by NET005, PKG004 and the RDMA checks once per
    node, not once per check (scripts/bench_scale.py's 64 nodes, the checks `check` runs)."""
    import pathlib

    from preflight import cli, engine, registry
    from preflight.job import nccl

    loaded = importlib.util.spec_from_file_location(
        "bench_scale", pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_scale.py")
    bench_scale = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(bench_scale)
    monkeypatch.chdir(tmp_path)
    paths = bench_scale.write_inputs(64, str(tmp_path))
    facts, probes = bench_scale.synthesize(64, str(tmp_path))
    calls = []
    real = nccl._environment
    monkeypatch.setattr(nccl, "_environment", lambda facts, job_env: calls.append(1) or real(facts, job_env))
    args = cli.build_parser().parse_args(["check", "--hostfile", paths["hostfile"], "--config",
                                          paths["accelerate.yaml"], "--skip", "deep"])
    _, _, results, _ = engine.evaluate(registry.load(), args, gather=lambda p, a, s: runner.CheckContext(p, facts, probes))
    assert {"NET005", "PKG004", "PKG008", "RDMA002", "GPU010", "JOB012"} <= {r.id for r in results}
    assert 2 * 64 <= len(calls) < 3 * 64  # a node: 1, and 1 with the job's settings (JOB012); 7 before


# --- the GPUs the job uses on a node -------------------------------------------------------------

def test_the_gpu_selection_is_made_once_per_node_however_many_checks_read_it(monkeypatch):
    calls = []
    real = job_gpus.gpu_id_list
    monkeypatch.setattr(job_gpus, "gpu_id_list", lambda raw: calls.append(raw) or real(raw))
    devices = [{"index": i, "name": "H100", "uuid": f"GPU-{i}", "pci_bus_id": f"0000:{i:02x}:00.0"} for i in range(8)]
    facts = {n: {"facts": {"gpus": {"available": True, "count": 8, "devices": [dict(d) for d in devices]},
                           "env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}}, "clock": None, "error": None}
             for n in NODES[:16]}
    ctx = runner.CheckContext(Plan(nodes=tuple(facts)), facts, {})
    seen = []
    for _ in range(3):  # three checks that read the node's GPUs
        seen.append([[d["index"] for d in job_gpus.job_gpus(ctx.on_node[n])[0]] for n in facts])
    assert seen[0] == [[0, 1, 2, 3]] * 16 and seen[0] == seen[1] == seen[2]
    assert len(calls) == 16
    other = {"available": True, "devices": devices[:2]}  # not the node's own GPUs: not the node's answer
    assert [d["index"] for d in job_gpus.selection(ctx.on_node[NODES[0]], other)[0]] == [0, 1]


def test_the_pcie_tree_of_a_node_is_read_once_for_the_checks_that_judge_it(monkeypatch):
    rdma = importlib.import_module("preflight.checks.rdma")
    calls = []
    real = rdma.fabric_of
    monkeypatch.setattr(rdma, "fabric_of", lambda facts: calls.append(1) or real(facts))
    facts = {n: {"facts": {"fabric": {"pci": "not a tree"}}, "clock": None, "error": None} for n in NODES[:4]}
    ctx = runner.CheckContext(Plan(nodes=tuple(facts)), facts, {})
    for _ in range(3):  # RDMA008, RDMA009, RDMA010
        answers = [rdma._pci_of(ctx.on_node[n]) for n in facts]
    assert len(calls) == 4
    assert all(a[:3] == ({}, {}, {}) and a[3].status is Status.SKIP for a in answers)


# --- redaction -----------------------------------------------------------------------------------

def result(message, remediation=None, **evidence):
    return Result("TST020", "costs", Status.FAIL, ("n1",), message, remediation, evidence, 0.0)


def test_a_result_with_nothing_secret_looking_is_not_walked(monkeypatch):
    plain = [result(f"eth0 on node{i:04d} (10.1.0.{i % 250}) is not on 10.2.0.0/16", "ip link set eth0 up",
                    interfaces=["eth0"], network="10.2.0.0/16", nested={"mtu": [1500, 9000]}) for i in range(100)]
    monkeypatch.setattr(redact, "_evidence", lambda *a: pytest.fail("walked a result with nothing to hide"))
    assert all(a is b for a, b in zip(redact.results(plain), plain))


@pytest.mark.parametrize("r, hidden", [
    (result("HF_TOKEN is set", None, variable="HF_TOKEN", value="abcd1234"), "abcd1234"),
    (result("run it", None, argv=["train.py", "--api-key", "s3cr3t-value"]), "s3cr3t-value"),
    (result("clone https://me:pw1234@example.org/x", None), "pw1234"),
    (result("ok", "export X=1", settings={"WANDB_API_KEY": "k-99999"}), "k-99999"),
    (result("ok", None, settings={"API_\u212aEY": "kelvin-secret"}), "kelvin-secret"),  # K: the Kelvin sign
    (result("uses hf_" + "a" * 34, None), "hf_" + "a" * 34),
], ids=["setting", "argv", "url", "key", "kelvin sign", "hf token"])
def test_a_result_with_a_secret_is_still_redacted(r, hidden):
    [shown] = redact.results([r])
    assert hidden not in f"{shown.message} {shown.remediation} {shown.evidence!r}"
    assert redact.REDACTED in f"{shown.message} {shown.remediation} {shown.evidence!r}"


def census_rows(n):
    return [{"node": f"node{i:05d}", "pid": 1000 + i, "kind": "rank", "master": "10.1.0.1:29500", "cpu": "1%",
             "where": "in all_reduce at train.py:11 (step)"} for i in range(n)]


def test_a_table_with_nothing_secret_looking_is_not_walked(monkeypatch):
    plain = [result("16384 launcher(s)", None, census=census_rows(3000))]
    monkeypatch.setattr(redact, "_evidence", lambda *a: pytest.fail("walked a table with nothing to hide"))
    assert redact.results(plain)[0] is plain[0]


@pytest.mark.parametrize("cell, hidden", [
    ({"where": "in all_reduce at fetch.py:3 (get_token)"}, None),  # a suspect word: walked, nothing to hide
    ({"master": "https://me:pw1234@example.org:29500"}, "pw1234"),
    ({"HF_TOKEN": "abcd1234"}, "abcd1234"),  # a secret name as a key of one row
    ({"args": ["--api-key", "s3cr3t-value"]}, "s3cr3t-value"),  # a list in a row: no table of plain values
], ids=["suspect word", "url", "secret key", "list in a row"])
def test_a_table_is_looked_at_by_each_of_its_values(cell, hidden):
    rows = census_rows(3000)
    rows[1234] = dict(rows[1234], **cell)
    [shown] = redact.results([result("16384 launcher(s)", None, census=rows)])
    said = repr(shown.evidence)
    assert (hidden is None) == (redact.REDACTED not in said)
    assert hidden is None or hidden not in said
    assert shown.evidence["census"][:1234] == rows[:1234]


def test_the_quick_look_finds_what_the_search_finds():
    rng = random.Random(3)
    pieces = ["tok", "en", "TOKEN", "pa", "ss", "Pwd", "au", "th", "k", "ey", "\u212a", "ey", "cred", "ential", "@",
              "hf", "_", "HF_", "x", " ", "\u017f", "10.0.0.1", "\u0131"]
    for _ in range(5000):
        said = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        assert redact.suspect(said) == bool(redact.SUSPECT.search(said)), said


# --- folding node names --------------------------------------------------------------------------

def test_a_numbered_cluster_is_folded_without_hostlists_walk(monkeypatch):
    monkeypatch.setattr(hostlist, "collect_hostlist", lambda *a, **k: pytest.fail("hostlist's walk"))
    names = [n for n in NODES if n not in ("node0007", "node0500")]
    assert inventory.fold(names) == "node[0001-0006,0008-0499,0501-1024]"
    assert inventory.fold(["node0003"]) == "node0003"
    wider = [f"node{i:04d}" for i in range(1, 16385)]  # node9999 runs on to node10000, as hostlist runs it
    assert inventory.fold(wider) == "node[0001-16384]"
    assert inventory.fold([f"n{i}" for i in range(1, 12)] + ["n01", "n02"]) == "n[1-11,01-02]"


def test_folded_names_are_as_hostlist_folds_them():
    rng = random.Random(7)
    odd = ["head", "node01x", "n 1", " n1", "n[1]", "10.0.0.1", "n\u00b2", "n\u0663", "a,b", ""]
    for _ in range(3000):
        prefix = rng.choice(["node", "n", "gpu-a100-", "r1n", "", "x_", "node1a", "a.b-", "n0"])
        width = rng.choice([1, 2, 3, 4])
        names = [f"{prefix}{rng.randint(0, 10 ** width - 1):0{width}d}" for _ in range(rng.randint(1, 30))]
        names += names[:rng.randint(0, 3)]  # duplicates
        if rng.random() < 0.1:
            names.append(rng.choice(odd))
        if rng.random() < 0.1:
            names.append(f"{prefix}{rng.randint(0, 10 ** (width + 1) - 1):0{width + 1}d}")  # another width
        if rng.random() < 0.3:  # a run across a power of ten, unpadded or padded
            start = 10 ** width - rng.randint(1, 5)
            names += [f"{prefix}{i:0{rng.choice([1, width])}d}" for i in range(start, start + rng.randint(1, 12))]
        rng.shuffle(names)
        try:
            expected = hostlist.collect_hostlist(list(names))
        except Exception:
            expected = ",".join(names)
        assert inventory.fold(names) == expected, names


# --- the plan ------------------------------------------------------------------------------------

def test_the_plans_paths_are_worked_out_once():
    plan = Plan(nodes=("n1",), checkpoint_dir="ckpt", workdir="/job")
    assert plan.paths == {"checkpoint_dir": "/job/ckpt"}
    assert plan.paths is plan.paths


def test_doctor_pauses_the_collector_while_it_makes_what_lives_until_exit():
    """engine.collector_paused (the census, doctor's checks): no collection meanwhile, what was made frozen out of
    the later ones, and the collector on again."""
    import gc

    from preflight import engine

    before = gc.get_freeze_count()
    try:
        with engine.collector_paused():
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)
    finally:
        gc.unfreeze()
