"""scripts/bench_scale.py at a small size: its synthetic cluster goes through the real checks and reports,
and what it makes odd is found, on the odd nodes and no others (so that the benchmark cannot rot)."""
import importlib.util
import json
import pathlib
import xml.etree.ElementTree as ET

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_scale.py"
spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
bench_scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_scale)

N = 64
# what was made odd -> (check, status) that must name exactly those nodes
EXPECTED = {
    "older-torch": ("PKG001", "fail"),
    "clock-fail": ("CLK001", "fail"),
    "clock-warn": ("CLK001", "warn"),
    "nccl-env": ("PKG004", "fail"),
    "small-shm": ("FS001", "fail"),
    "gpu-lost": ("GPU004", "fail"),
    "stale-hosts": ("NET002", "fail"),
    "ssh-timeout": ("SSH001", "fail"),
    "port-blocked": ("NET004", "fail"),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)  # no preflight.toml or pyproject.toml of the checkout is taken for a profile
        measured = bench_scale.run_once(N, str(folder))
    with open(measured["paths"]["report.json"]) as f:
        return measured, json.load(f)


def nodes_of(document, check_id, status):
    return sorted(n for r in document["results"] if r["id"] == check_id and r["status"] == status for n in r["nodes"])


def test_every_node_is_in_the_report(run):
    measured, document = run
    names = [bench_scale.name_of(i) for i in range(N)]
    assert document["nodes"] == names
    assert {n for r in document["results"] for n in r["nodes"]} == set(names)
    assert measured["results"] == len(document["results"]) and measured["peak_mb"] > 0


def test_what_was_made_odd_is_found_on_those_nodes_only(run):
    _, document = run
    planted = bench_scale.planted_nodes(N)
    assert set(planted) == set(EXPECTED)
    for what, (check_id, status) in EXPECTED.items():
        assert nodes_of(document, check_id, status) == planted[what], what
    flagged = {n for r in document["results"] if r["status"] in ("fail", "warn", "error") for n in r["nodes"]}
    assert flagged == {n for nodes in planted.values() for n in nodes}  # the healthy nodes pass
    torch = next(r for r in document["results"] if r["id"] == "PKG001" and r["status"] == "fail")
    assert "torch differs" in torch["message"] and "2.12.1" in torch["message"]


def test_the_unreachable_node_is_skipped_and_the_collective_did_not_run(run):
    _, document = run
    (down,) = bench_scale.planted_nodes(N)["ssh-timeout"]
    for r in document["results"]:
        if down in r["nodes"] and r["id"] != "SSH001":
            assert r["status"] == "skip" and "node not checked" in r["message"]
    assert {r["status"] for r in document["results"] if r["id"].startswith("COL")} == {"skip"}


def test_every_report_was_written(run):
    measured, _ = run
    paths = measured["paths"]
    suite = ET.parse(paths["junit.xml"]).getroot()
    failed = {case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None}
    assert set(bench_scale.planted_nodes(N)["older-torch"]) <= failed
    (old,) = bench_scale.planted_nodes(N)["older-torch"][:1]
    prom = pathlib.Path(paths["preflight.prom"]).read_text()
    assert f'preflight_check_status{{check="PKG001",name="key-versions",node="{old}",status="fail"}} 1.0' in prom
    page = pathlib.Path(paths["report.html"]).read_text()
    assert all(f'data-node="{bench_scale.name_of(i)}"' in page for i in range(N))
    assert pathlib.Path(paths["report.txt"]).read_text().splitlines()[-1].startswith("verdict: FAIL")


def test_the_json_document_has_one_result_per_line(run):
    measured, document = run
    lines = pathlib.Path(measured["paths"]["report.json"]).read_text().splitlines()
    assert lines[0].endswith('"results": [') and lines[-1] == "]}"
    assert [json.loads(line.rstrip(",")) for line in lines[1:-1]] == document["results"]


def test_facts_are_decoded_as_gather_decodes_them_with_strings_shared_across_nodes():
    from preflight.remote.gather import facts_decoder

    line = json.dumps({"env": {"NCCL_DEBUG": "WARN"}, "versions": ["2.13.0", {"cuda": "12.8"}], "n": 1, "x": None})
    decode = facts_decoder()
    first, second = decode(line), decode(line)
    assert first == second == json.loads(line)
    assert first["env"]["NCCL_DEBUG"] is second["env"]["NCCL_DEBUG"]
    assert first["versions"][0] is second["versions"][0] and first["versions"][1]["cuda"] is second["versions"][1]["cuda"]
    assert [k for k in first["env"]][0] is [k for k in second["env"]][0]


def test_measure_runs_fresh_interpreters():
    measured = bench_scale.measure(16, repeat=1)
    assert measured["nodes"] == 16 and measured["runs"] == 1 and measured["verdict"] == "fail"
    assert measured["wall_s"] > 0 and measured["import_s"] > 0 and measured["peak_mb"] > 0
    # The target path (checks, terminal, JSON) and, after it, the opt-in report files.
    assert measured["wall_s"] == pytest.approx(measured["checks_s"] + measured["json_s"] + measured["terminal_s"], abs=0.01)
    assert measured["every_report_s"] > measured["wall_s"] and measured["every_report_peak_mb"] >= measured["peak_mb"]
    assert all(measured[k] > 0 for k in ("junit_s", "prometheus_s", "html_s", "synthesis_s"))
    assert "--json" in bench_scale.DESCRIPTION and "\n" not in bench_scale.DESCRIPTION


def test_the_same_finding_of_a_node_check_on_many_nodes_is_one_result(run):
    _, document = run
    planted = bench_scale.planted_nodes(N)
    odd = set(planted["small-shm"] + planted["ssh-timeout"])
    (passing,) = [r for r in document["results"] if r["id"] == "FS001" and r["status"] == "pass"]
    assert passing["nodes"] == [bench_scale.name_of(i) for i in range(N) if bench_scale.name_of(i) not in odd]
    assert len(document["results"]) < 6 * N  # a result per check and node would be over 25 a node
