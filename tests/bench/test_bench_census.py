"""scripts/bench_census.py at a small size: the census of a real small job on this machine, made an N-node job,
goes through what `preflight doctor` runs after gathering (running.build, the RUN checks, the reports), and what
it makes odd is named, on the odd nodes and no others (so that the benchmark cannot rot)."""
import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_census.py"
spec = importlib.util.spec_from_file_location("bench_census", SCRIPT)
bench_census = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_census)

N = 32  # two planted nodes are never neighbours from 18 nodes on (the duplicate rank is its neighbour's)
# what was made odd -> (check, status) that must name exactly those nodes
EXPECTED = {
    "wrong-master": [("RUN003", "fail"), ("RUN004", "fail")],
    "master-unreachable": [("RUN004", "fail")],
    "rank-elsewhere": [("RUN006", "fail")],
    "other-collective": [("RUN006", "fail")],
    "old-job-on-port": [("RUN008", "fail")],
}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return bench_census.real_census(str(tmp_path_factory.mktemp("job")))


@pytest.fixture(scope="module")
def run(tmp_path_factory, template):
    folder = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)  # no preflight.toml or pyproject.toml of the checkout is taken for a profile
        measured = bench_census.run_once(N, str(folder), template, files=True)
    with open(measured["paths"]["report.json"]) as f:
        return measured, json.load(f)


def found(document, check_id, status):
    return [r for r in document["results"] if r["id"] == check_id and r["status"] == status]


def nodes_of(document, check_id, status):
    return sorted(n for r in found(document, check_id, status) for n in r["nodes"])


def test_the_real_census_has_the_shape_the_synthetic_nodes_copy(template):
    processes = template["facts"]["census"]["processes"]
    assert [p["kind"] for p in processes].count("rank") == 2
    (launcher,) = [p for p in processes if p["kind"] == "launcher"]
    assert "--node_rank" in launcher["argv"] and str(template["port"]) in launcher["argv"]
    assert any(s["state"] == "LISTEN" and s["local_port"] == template["port"] for s in launcher["sockets"])
    ranks = {p["env"]["RANK"]: p for p in processes if p["kind"] == "rank"}
    assert ranks["0"]["threads"][0]["frames"][0][0] == "all_reduce"  # py-spy's sample of a rank in gloo
    assert any(f[0] == "load_batch" for f in ranks["1"]["threads"][0]["frames"])
    assert {"LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"} <= set(ranks["1"]["env"])


def test_every_process_is_in_the_census_table(run):
    measured, document = run
    names = [bench_census.name_of(i) for i in range(N)]
    assert document["nodes"] == names
    (census,) = [r["evidence"]["census"] for r in found(document, "RUN001", "pass")]
    dead = len(bench_census.planted_nodes(N)["dead-rank"])
    no_rank = len(bench_census.planted_nodes(N)["wrong-master"] + bench_census.planted_nodes(N)["master-unreachable"])
    assert len(census) == measured["processes"] == N * 9 - dead - no_rank * 8
    assert {row["node"] for row in census} == set(names)


def test_what_was_made_odd_is_named_on_those_nodes_only(run):
    _, document = run
    planted = bench_census.planted_nodes(N)
    for what, checks in EXPECTED.items():
        for check_id, status in checks:
            assert set(planted[what]) <= set(nodes_of(document, check_id, status)), (what, check_id)
    assert nodes_of(document, "RUN004", "fail") == sorted(planted["wrong-master"] + planted["master-unreachable"])
    assert nodes_of(document, "RUN006", "fail") == sorted(planted["rank-elsewhere"] + planted["other-collective"])
    (dup,) = planted["duplicate-node-rank"]
    neighbour = bench_census.name_of(bench_census.duplicated_rank(N))
    (twice,) = found(document, "RUN002", "fail")
    assert twice["nodes"] == [dup, neighbour] and twice["evidence"]["node_rank"] == bench_census.duplicated_rank(N)
    (dead,) = found(document, "RUN007", "fail")
    assert dead["evidence"]["missing"] == bench_census.missing_ranks(N)
    (other,) = [r for r in found(document, "RUN006", "fail") if r["nodes"] == planted["other-collective"]]
    assert "is in broadcast" in other["message"] and "wait in all_reduce at train.py" in other["message"]
    (old,) = found(document, "RUN008", "fail")
    assert "--nnodes 2" in old["message"] and old["nodes"] == planted["old-job-on-port"]
    # The healthy nodes are blamed nowhere: RUN007's finding names the ranks waiting for the missing ones (every
    # node with a rank), not a cause.
    flagged = {n for r in document["results"] if r["status"] in ("fail", "warn", "error") and r is not dead
               for n in r["nodes"]}
    assert flagged == {n for what, nodes in planted.items() if what != "dead-rank" for n in nodes} | {neighbour}
    assert planted["dead-rank"][0] in dead["nodes"]


def test_the_store_too_full_to_read_is_said_not_blamed(run):
    _, document = run
    (skipped,) = found(document, "RUN005", "skip")
    assert "holds more connections than the census keeps" in skipped["message"]


def test_the_reports_were_written(run):
    measured, document = run
    paths = measured["paths"]
    text = pathlib.Path(paths["report.txt"]).read_text()
    assert text.splitlines()[-1].startswith("verdict: FAIL") and "census:" in text
    assert "in all_reduce at train.py" in text
    assert f'data-node="{bench_census.name_of(N - 1)}"' in pathlib.Path(paths["report.html"]).read_text()
    assert document["verdict"] == "fail"


def test_measure_runs_fresh_interpreters(template):
    measured = bench_census.measure_sizes([N], repeat=1, template=template)[N]
    assert measured["nodes"] == N and measured["runs"] == 1 and measured["verdict"] == "fail"
    # The target path (build, checks, terminal, JSON); the opt-in report files only when asked for (--files).
    parts = measured["build_s"] + measured["checks_s"] + measured["json_s"] + measured["terminal_s"]
    assert measured["wall_s"] == pytest.approx(parts, abs=0.01) and measured["build_s"] > 0
    assert measured["synthesis_s"] > 0 and "junit_s" not in measured
    assert "--json" in bench_census.DESCRIPTION and "\n" not in bench_census.DESCRIPTION
    shown = bench_census.table({N: measured}).splitlines()
    assert shown[2].startswith(f"| {N} | {measured['processes']:,} | {measured['results']} |") and "junit" not in shown[0]
    assert len(shown[0].split("|")) == len(shown[1].split("|")) == len(shown[2].split("|"))


def test_the_report_files_are_timed_apart_when_asked_for(run):
    measured, _ = run
    assert measured["every_report_s"] > measured["wall_s"] and measured["every_report_peak_mb"] >= measured["peak_mb"]
    assert all(measured[k] > 0 for k in ("junit_s", "prometheus_s", "html_s"))
    row = dict(measured, wall_min_s=measured["wall_s"], wall_max_s=measured["wall_s"])
    header, rule, line = bench_census.table({N: row}).splitlines()
    assert "with every report | junit | prometheus | html" in header
    assert len(header.split("|")) == len(rule.split("|")) == len(line.split("|"))
