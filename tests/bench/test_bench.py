"""scripts/bench.py's harness: the interleaving, the BENCHMARKS.md block, and a real run of its two
network-free sections (their figures are not asserted: timing belongs to the benchmark, not the tests)."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench"]


def test_contenders_take_turns_after_one_warm_up_each(bench):
    calls = []
    contenders = {name: (lambda name=name: calls.append(name) or float(len(calls))) for name in "abc"}
    times = bench.interleaved(contenders, repeat=3)
    assert "".join(calls) == "abc" + "abc" + "bca" + "cab"  # no contender always first
    assert times == {"a": [4.0, 9.0, 11.0], "b": [5.0, 7.0, 12.0], "c": [6.0, 8.0, 10.0]}


def test_a_failing_contender_is_an_error_not_a_time(bench):
    with pytest.raises(bench.BenchError, match="exit 3"):
        bench.run([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_the_generated_block_is_replaced_and_the_rest_kept(bench, tmp_path, monkeypatch):
    target = tmp_path / "BENCHMARKS.md"
    target.write_text(f"# Benchmarks\n\nwritten by hand\n\n{bench.BEGIN}\nold run\n{bench.END}\n\n## History\nkept\n")
    monkeypatch.setattr(bench, "BENCHMARKS", target)
    bench.write_benchmarks(f"{bench.BEGIN}\nnew run\n{bench.END}\n")
    assert target.read_text() == (f"# Benchmarks\n\nwritten by hand\n\n{bench.BEGIN}\nnew run\n{bench.END}\n\n"
                                  "## History\nkept\n")


def test_markdown_table(bench):
    assert bench.markdown_table([["a", "b"], ["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_local_and_startup_sections_run_for_real(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--only", "local", "startup",
                           "--repeat", "1", "--no-write"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for row in ("| `preflight lint` |", "| `preflight node` |", "| `ds_report` |", "| `accelerate env` |"):
        assert row in out
    assert "| torch, deepspeed and accelerate off the start-up path | none imported | yes |" in out
    assert "Not measured" not in out and "## 2. Fan-out" not in out


def test_the_fanout_table_compares_with_the_faster_of_clush_and_pdsh_and_plots_all_three(bench, tmp_path,
                                                                                          monkeypatch):
    seconds = {1: {"preflight check": 0.5, "clush": 0.6, "pdsh -R ssh": 0.4},  # 1.25x pdsh: over 1.1x
               16: {"preflight check": 3.0, "clush": 3.2, "pdsh -R ssh": 3.5}}  # 0.94x clush
    monkeypatch.setattr(bench, "fanout_contenders", lambda cluster, hosts: {
        name: (lambda s=s: s) for name, s in seconds[len(hosts)].items()})
    plotted = {}
    monkeypatch.setattr(bench, "plot_fanout", lambda medians, png: plotted.update(medians))
    section = bench.Section("2. Fan-out")
    cluster = type("Cluster", (), {"nodes": [f"bench{i:02d}" for i in range(1, 17)]})()
    bench.bench_fanout(section, 3, cluster=cluster, sizes=[1, 16], png=tmp_path / "fanout.png")
    assert section.table[0][-1] == "preflight / the faster of the two"
    assert [row[-1] for row in section.table[1:]] == ["1.25 (pdsh -R ssh)", "0.94 (clush)"]
    assert [(t.text, t.met) for t in section.targets] == [
        ("fan-out at N = 1 at most 1.1x the faster of clush and pdsh", False),
        ("fan-out at N = 16 at most 1.0x the faster of clush and pdsh", True)]
    assert plotted == {name: {1: seconds[1][name], 16: seconds[16][name]} for name in seconds[1]}


@pytest.mark.parametrize("out, said", [
    ("Traceback (most recent call last):", "no JSON document with SSH001"),
    ('{"results": [{"id": "CFG001"}]}', "no JSON document with SSH001"),
    ('{"results": [{"id": "SSH001", "status": "fail", "message": "node02: refused"}]}', "SSH001 fail: node02: refused"),
])
def test_a_check_run_counts_only_when_it_reached_every_host(bench, out, said):
    with pytest.raises(bench.BenchError, match=f"^preflight: {said}"):
        bench.reached_every_host(out, "preflight")
    bench.reached_every_host('{"results": [{"id": "SSH001", "status": "pass", "message": ""}]}', "preflight")


def test_profile_needs_the_fanout_section():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--only", "local", "--profile", "x",
                           "--no-write"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--profile: it profiles the fanout section, which --only leaves out" in proc.stderr


@pytest.mark.cluster
def test_profile_draws_the_heads_check_and_a_nodes_agent_on_real_hosts(bench, cluster, tmp_path):
    written = bench.profile_fanout(cluster, [1, 2], tmp_path / "profiles")
    assert [p.name for p in written] == ["fanout-cpu.md", "fanout-head-1.svg", "fanout-head-2.svg", "fanout-node.svg"]
    table, _, head, node = (p.read_text() for p in written)
    header, _, *rows = table.splitlines()
    assert header == "| hosts | wall | the head's CPU | the rest of the machine's CPU (the hosts' sshd, agents) |"
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 2"]
    for row in rows:  # every figure a time, none a zero: the head and its hosts did work
        assert all(re.fullmatch(r"[1-9]\d* ms|\d+\.\d\d s", cell) for cell in row.strip("| ").split(" | ")[1:]), row
    # py-spy's flame graphs: the frames of the program each one sampled, in its own files
    assert "preflight/remote/gather.py" in head and "preflight/cli.py" in head
    assert "preflight/node/collector.py" in node and "preflight/remote" not in node


@pytest.mark.cluster
def test_a_profiled_run_that_does_not_reach_its_hosts_is_an_error(bench, cluster, tmp_path):
    cluster.stop_sshd("node02")
    with pytest.raises(bench.BenchError, match="^preflight at 2 hosts: SSH001 fail: connection refused"):
        bench.profile_fanout(cluster, [2], tmp_path / "profiles")
