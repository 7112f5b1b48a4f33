"""pytest fixtures for a real test cluster (scripts/testcluster.py): N hosts in network namespaces, each
with its own sshd, hostname and /etc/hosts.

In a test module::

    import pytest
    from cluster import cluster, cluster_up  # noqa: F401  (both: pytest finds fixtures by module attribute)

    pytestmark = pytest.mark.cluster

    def test_something(cluster):
        subprocess.run(["ssh", "-F", str(cluster.ssh_config), "node02", "hostname"])
        with cluster.frozen_sshd("node02"):
            ...

`cluster_up` brings the cluster up once per module (3 nodes), under a machine-wide lock, after tearing down
any stale cluster with the same name prefix; it always tears it down (finalizer, atexit, SIGTERM) and
checks that nothing is left. `cluster` is the same object per test, and undoes every fault the test left.
Another size or prefix: ``cluster_up, cluster = make_cluster_fixtures(nodes=2, prefix="gpu")``.
Without root, `ip netns` or sshd, every test that uses it is skipped with the reason.
"""

from __future__ import annotations

import atexit
import importlib.util
import signal
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "testcluster.py"


def _load_testcluster():
    module = sys.modules.get("testcluster")
    if module is None:
        spec = importlib.util.spec_from_file_location("testcluster", _SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["testcluster"] = module
        spec.loader.exec_module(module)
    return module


testcluster = _load_testcluster()
Cluster = testcluster.Cluster
ClusterError = testcluster.ClusterError


def cluster_unavailable() -> str:
    """Why no test cluster can be built here ('' when it can)."""
    return "; ".join(testcluster.requirements(probe=True))


def make_cluster_fixtures(nodes: int = 3, prefix: str = "node", scope: str = "module", name: str = "cluster"):
    """Two fixtures: `<name>_up` (scope: one cluster) and `<name>` (per test: restores every fault after it).
    Assign both to module attributes of the test module or a conftest."""

    @pytest.fixture(scope=scope, name=f"{name}_up")
    def _up(tmp_path_factory):
        reason = cluster_unavailable()
        if reason:
            pytest.skip(f"test cluster unavailable: {reason}")
        with testcluster.cluster_lock():
            testcluster.clean_stale(prefix)
            cluster = Cluster(tmp_path_factory.mktemp(f"cluster-{prefix}"), nodes=nodes, prefix=prefix)
            done = []

            def teardown():
                if not done:
                    done.append(True)
                    cluster.down()

            atexit.register(teardown)
            previous = signal.getsignal(signal.SIGTERM)
            if previous in (signal.SIG_DFL, None):
                def on_sigterm(signum, frame):  # let finalizers run on `kill PID`
                    raise KeyboardInterrupt("SIGTERM")
                signal.signal(signal.SIGTERM, on_sigterm)
            pids = []
            try:
                cluster.up()
                pids = [cluster.sshd_pid(n) for n in cluster.nodes]
                yield cluster
            finally:
                try:
                    teardown()
                finally:
                    atexit.unregister(teardown)
                    if previous in (signal.SIG_DFL, None):
                        signal.signal(signal.SIGTERM, signal.SIG_DFL)
            left = testcluster.leftovers(prefix, pids=pids)
            assert not left, f"test cluster teardown left: {left}"

    @pytest.fixture(name=name)
    def _per_test(request):
        cluster = request.getfixturevalue(f"{name}_up")
        try:
            yield cluster
        finally:
            cluster.restore_all()
        problems = cluster.healthy()
        assert not problems, f"test cluster not back to its baseline: {problems}"

    return _up, _per_test


cluster_up, cluster = make_cluster_fixtures()
