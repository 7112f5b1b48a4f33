"""scripts/bench_datapath.py's harness without a cluster: what it reads from preflight's JSON, that a run which
is not the healthy (or the planted) answer is an error and not a time, and its table."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def datapath():
    spec = importlib.util.spec_from_file_location("bench_datapath", ROOT / "scripts" / "bench_datapath.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def doc(*results):
    return json.dumps({"results": [dict(id=i, status=s, nodes=n, message=m, evidence=e) for i, s, n, m, e in results]})


def healthy_paths(probe_s=0.3):
    return doc(*[(i, "pass", ["node01"], "fine", {"probe_s": probe_s}) for i in ("NET007", "NET008", "NET009",
                                                                              "NET010", "NET011")])


def test_the_path_probes_time_is_the_probes_own_and_a_finding_is_an_error(datapath):
    found = datapath.path_probes(lambda argv, **_: (2.5, healthy_paths()), lambda hosts, *extra: list(extra),
                                 ["node01", "node02", "node03", "node04"], 2)
    assert found == {"probe_s": [0.3, 0.3], "check_s": [2.5, 2.5], "pairs": 12}
    lost = json.loads(healthy_paths())
    lost["results"][2].update(status="fail", message="node02 cannot connect to node03")
    with pytest.raises(datapath.DataPathError, match="NET009 is not a pass"):
        datapath.path_probes(lambda argv, **_: (2.5, json.dumps(lost)), lambda hosts, *extra: [], ["a", "b"], 1)


def test_the_pairwise_phase_is_read_from_col004s_matrix_and_a_straggler_is_an_error(datapath):
    matrix = {"elapsed_s": 0.8, "pairs_measured": 120, "rounds": 15,
              "retested": [["node02", "node03", 0.01, 0.01], ["node04", "node05", 0.01, 1.0]]}
    out = doc(("COL004", "pass", ["node01"], "fine", {"matrix": matrix}),
              ("COL004", "warn", ["node02", "node03"], "the link node02 - node03 moves", {}))
    assert datapath.pairwise_phase(lambda argv, **_: (30.0, out), lambda hosts, *extra: [], ["a"] * 16) == \
        {"phase_s": 0.8, "check_s": 30.0, "pairs": 120, "rounds": 15, "slow_links": 1, "retested": 2}
    straggler = doc(("COL004", "fail", ["node02"], "a straggler", {"matrix": matrix}))
    with pytest.raises(datapath.DataPathError, match="a straggler"):
        datapath.pairwise_phase(lambda argv, **_: (30.0, straggler), lambda hosts, *extra: [], ["a"] * 16)


def test_the_table_has_a_row_per_size_and_the_slow_link(datapath):
    measured = {"paths": {4: {"probe_s": [0.2, 0.3], "check_s": [2.0, 2.2], "pairs": 12}},
                "pairwise": {4: {"phase_s": 0.4, "check_s": 9.0, "pairs": 6, "rounds": 3, "slow_links": 0,
                                 "retested": 1}},
                "slow": {"check_s": [10.0, 12.0], "probe_s": [0.9]}}
    rows = datapath.table(measured)
    assert rows[1] == ["4", "12", "250 ms (200 ms-300 ms)", "2.10 s (2.00 s-2.20 s)", "400 ms (6, 3)", "9.00 s",
                       "0 (1 measured again alone)"]
    assert rows[2][0] == "4, one slow link" and rows[2][3] == "verdict 11.00 s (10.00 s-12.00 s)"


def test_scripts_bench_offers_the_section():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    assert "datapath" in out
