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

`cluster_up` hands a module the run's 3-node cluster, under a machine-wide lock: brought up once (after tearing
down any stale cluster with the same name prefix) and kept from one module to the next while each module leaves
it as it found it; at a module's end, a cluster that is not (a process left on a node, a firewall table, a
mount) is taken down, and the next module gets a new one. It is always torn down at the end (finalizer,
atexit, SIGTERM), checked that nothing is left. `cluster` is the same object per test, and undoes every fault
the test left. Another size or prefix, a cluster of the module's own:
``cluster_up, cluster = make_cluster_fixtures(nodes=2, prefix="gpu")``.
Without root, `ip netns` or sshd, every test that uses it is skipped with the reason.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import signal
import sys
import time
from pathlib import Path
from typing import Optional

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


@contextlib.contextmanager
def running_cluster(folder, nodes: int = 3, prefix: str = "node"):
    """A cluster up in `folder` for the `with` block, under the machine-wide lock; torn down after it (also at
    exit and on SIGTERM), checked that nothing is left."""
    with testcluster.cluster_lock():
        testcluster.clean_stale(prefix)
        cluster = Cluster(folder, nodes=nodes, prefix=prefix)
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


def _mounts(pid: int) -> list:
    """The mounts a process sees (root, mount point, type, source), without the IDs a new namespace renumbers."""
    mounts = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields, after = line.split(" - ", 1)
        fields = fields.split()
        mounts.append((fields[3], fields[4], *after.split()[:2]))
    return sorted(mounts)


class SharedCluster:
    """The default cluster (3 nodes, prefix "node"), kept up from one module to the next (an up and a down cost
    about a second, for each module that asks). A module finds it as the one before it found it, or gets a new
    one: `changes` compares each node with what it was when it came up (the faults of testcluster.py are its
    own state, which the per-test fixture restores)."""

    def __init__(self, tmp_path_factory):
        self._folders = tmp_path_factory
        self._stack = contextlib.ExitStack()
        self.cluster: Optional[Cluster] = None
        self._baseline = {}

    def get(self) -> Cluster:
        if self.cluster is None:
            self.cluster = self._stack.enter_context(running_cluster(self._folders.mktemp("cluster-node")))
            self._baseline = self._state()
        return self.cluster

    def _state(self) -> dict:
        """Per node: its mounts (those of its sshd: every session's), its firewall."""
        state = {}
        for node in self.cluster.nodes:
            firewall = self.cluster.netns_exec(node, ["nft", "list", "ruleset"]).stdout.strip()
            state[node] = {"mounts": _mounts(self.cluster.sshd_pid(node)), "firewall": firewall}
        return state

    def changes(self) -> list:
        """What a module left on the nodes, one line each: processes (but the sshds), mounts, firewall tables."""
        sshds = {self.cluster.sshd_pid(n) for n in self.cluster.nodes}
        deadline = time.monotonic() + 2  # sessions that are closing
        while True:
            left = [f"{n}: pid {pid}" for n in self.cluster.nodes
                    for pid in testcluster.netns_pids(self.cluster.netns(n)) if pid not in sshds]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        try:
            now = self._state()
        except (OSError, ClusterError) as exc:  # a node without its sshd
            return left + [str(exc)]
        for node, was in self._baseline.items():
            left += [f"{node}: {what} changed" for what in was if now[node][what] != was[what]]
        return left

    def release(self) -> None:
        """Take it down (the next `get` brings up a new one)."""
        stack, self._stack, self.cluster = self._stack, contextlib.ExitStack(), None
        stack.close()


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory):
    """The run's SharedCluster (tests/conftest.py makes this fixture the run's own)."""
    shared = SharedCluster(tmp_path_factory)
    try:
        yield shared
    finally:
        shared.release()


def _available():
    reason = cluster_unavailable()
    if reason:
        pytest.skip(f"test cluster unavailable: {reason}")


@pytest.fixture(scope="module", name="cluster_up")
def cluster_up(shared_cluster):
    """The 3-node cluster, for this module; taken down after it when the module left it changed."""
    _available()
    yield shared_cluster.get()
    # A cluster of a test's own (make_cluster_fixtures) may have taken it down already.
    if shared_cluster.cluster is not None and shared_cluster.changes():
        shared_cluster.release()


def _per_test_fixture(name: str):
    @pytest.fixture(name=name)
    def _per_test(request):
        cluster = request.getfixturevalue(f"{name}_up")
        try:
            yield cluster
        finally:
            cluster.restore_all()
        problems = cluster.healthy()
        assert not problems, f"test cluster not back to its baseline: {problems}"

    return _per_test


cluster = _per_test_fixture("cluster")


def make_cluster_fixtures(nodes: int = 3, prefix: str = "node", scope: str = "module", name: str = "cluster"):
    """Two fixtures for a cluster of the module's own: `<name>_up` (scope: one cluster) and `<name>` (per test:
    restores every fault after it). Assign both to module attributes of the test module or a conftest. The
    run's shared cluster is taken down first (one cluster on the bridge at a time)."""

    @pytest.fixture(scope=scope, name=f"{name}_up")
    def _up(shared_cluster, tmp_path_factory):
        _available()
        shared_cluster.release()
        with running_cluster(tmp_path_factory.mktemp(f"cluster-{prefix}"), nodes=nodes, prefix=prefix) as up:
            yield up

    return _up, _per_test_fixture(name)
