"""SYS: the limits (open files, locked memory, processes) and the host memory of each node, from recorded
node facts."""

from node_facts import by_node, facts, run
from preflight.result import Status


def test_limits_and_memory():
    def low_nofile(state):
        state["facts"]["limits"]["nofile"] = [1024, 4096]

    assert by_node(run("SYS001", facts(n02=low_nofile)))["n02"].status == Status.WARN

    def rdma(state):
        state["facts"]["host"]["rdma_devices"] = ["mlx5_0"]
        state["facts"]["limits"]["memlock"] = [65536, 65536]

    results = by_node(run("SYS002", facts(n03=rdma)))
    assert results["n03"].status == Status.WARN and results["n01"].status == Status.SKIP

    def starving(state):
        state["facts"]["memory"]["available_bytes"] = 2**29

    assert by_node(run("SYS003", facts(n01=starving)))["n01"].status == Status.FAIL
