"""The rules of preflight.node, the code that runs on the nodes: it imports only the standard library and its
own modules (a node has nothing of preflight installed), and it runs on the oldest interpreter preflight
supports, preflight.node.MIN_PYTHON, as the bootstrap ships it."""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import preflight.node
from own_network import own_network
from preflight.remote import shipping

NODE = Path(preflight.node.__file__).parent
MODULES = sorted(NODE.glob("*.py"))
# The node's own training environment, imported inside the function that needs it and nowhere else: torch by
# the all-reduce worker's ranks, NVML's binding by the GPU facts (its absence is a fact, not an error).
THE_NODES_OWN = {"torch", "pynvml"}


def imports(path):
    """(module imported, whether at the top level of the file) for every import of a source file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import (the loader ships absolute names)"
            yield node.module, id(node) in top


def test_the_node_package_has_its_modules():
    names = {p.stem for p in MODULES}
    assert {"__init__", "collector", "agent", "census", "allreduce", "procfs", "secret"} <= names, names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_node_modules_import_only_the_standard_library_and_each_other(path):
    found = list(imports(path))
    for module, at_top in found:
        first = module.split(".")[0]
        if module == "preflight.node" or module.startswith("preflight.node."):
            continue
        assert first != "preflight", f"{path.name} imports {module}: the head's code is not on the node"
        if first in THE_NODES_OWN:
            assert not at_top, f"{path.name} imports {module} at its top: only inside the function that needs it"
            continue
        assert first in sys.stdlib_module_names, f"{path.name} imports {module}, not in the standard library"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_the_shipping_reads_a_modules_node_imports_as_python_does(path):
    """shipping reads imports as text (for speed): it must find what the syntax tree holds, neither less nor more."""
    sources = {("preflight.node" if p.stem == "__init__" else f"preflight.node.{p.stem}"): "" for p in MODULES}
    names = {m for m, _ in imports(path)}
    expected = {m for m in names if m in sources} | {
        f"preflight.node.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "preflight.node" for alias in node.names}
    expected.discard("preflight.node")  # the package itself is always shipped
    assert set(shipping._node_imports(path.read_text(), sources)) == expected & set(sources)


def test_a_program_is_shipped_with_the_modules_it_imports_and_no_others():
    agent = json.loads(shipping.bundle(shipping.AGENT))
    assert set(agent["modules"]) == {"preflight", "preflight.node"} | {
        f"preflight.node.{p.stem}" for p in MODULES
        if p.stem not in ("__init__", "allreduce", "pairlinks")}  # census: lazily; pairlinks: the worker's
    assert agent["main"] == "preflight.node.agent" and agent["packages"] == ["preflight", "preflight.node"]
    worker = json.loads(shipping.bundle(shipping.ALLREDUCE))
    assert set(worker["modules"]) == {"preflight", "preflight.node", "preflight.node.allreduce",
                                      "preflight.node.pairlinks"}
    # the head's package face stays on the head: the node's `preflight` holds only the head's version
    assert agent["modules"]["preflight"] == f"__version__ = {preflight.__version__!r}\n"
    with pytest.raises(ValueError, match="not a module of preflight.node"):
        shipping.bundle("preflight.cli")


@pytest.fixture(scope="module")
def oldest():
    wanted = "python%d.%d" % preflight.node.MIN_PYTHON
    pyenv = Path.home() / ".pyenv" / "versions"
    found = [shutil.which(wanted)] + sorted(str(p) for p in pyenv.glob(f"{wanted[6:]}*/bin/{wanted}"))
    python = next((p for p in found if p and subprocess.run([p, "-c", "pass"], capture_output=True).returncode == 0),
                  None)
    if python is None:
        pytest.skip("no Python %d.%d here (on PATH or installed by pyenv)" % preflight.node.MIN_PYTHON)
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version == "%d.%d" % preflight.node.MIN_PYTHON, f"{python} is Python {version}, not the oldest supported"
    return python


def test_every_node_module_compiles_under_the_oldest_python(oldest):
    code = "import sys\nfor path in sys.argv[1:]:\n    compile(open(path).read(), path, 'exec')\n"
    proc = subprocess.run([oldest, "-c", code, *map(str, MODULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_shipped_agent_and_census_run_under_the_oldest_python(oldest):
    """Through the real bootstrap and loader: the facts (every section), then a request, then the census."""
    options = {"head": "127.0.0.1", "port": 29500, "census": {"port": 29999, "stacks": False, "deadline_s": 5}}
    with own_network():  # its census sees no other job on this machine
        proc = subprocess.run(["sh", "-c", shipping.shipped_command(oldest)], capture_output=True, text=True,
                              timeout=60, input=shipping.shipped_input(shipping.AGENT, options) + '{"op": "time"}\ndone\n')
    assert proc.returncode == 0, proc.stderr
    facts, answer = [json.loads(line) for line in proc.stdout.splitlines()]
    assert facts["python"]["version"].startswith("%d.%d." % preflight.node.MIN_PYTHON)
    failed = {name: section for name, section in facts.items() if isinstance(section, dict) and "error" in section}
    assert not failed, failed
    assert facts["census"]["processes"] == [] and facts["census"]["port"] == 29999
    assert isinstance(answer["time"], float)


def test_the_shipped_agent_probes_a_data_path_under_the_oldest_python(oldest):
    """The data-path requests through the real bootstrap: a responder on ephemeral ports, a probe of it over
    loopback (TCP, do-not-fragment datagrams, a name), and its close."""
    proc = subprocess.Popen(["sh", "-c", shipping.shipped_command(oldest)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(shipping.shipped_input(shipping.AGENT, {"head": "127.0.0.1", "port": 29500}) +
                         '{"op": "paths_open"}\n')
        proc.stdin.flush()
        facts = json.loads(proc.stdout.readline())
        opened = json.loads(proc.stdout.readline())
        peer = {"name": "self", "address": "127.0.0.1", "names": ["localhost"], "tcp_port": opened["tcp_port"],
                "udp_port": opened["udp_port"], "mtu": 1500}
        proc.stdin.write(json.dumps({"op": "paths_probe", "peers": [peer], "timeout_s": 2, "wait_s": 0.5}) +
                         '\n{"op": "paths_close"}\ndone\n')
        proc.stdin.flush()
        probed, closed = json.loads(proc.stdout.readline()), json.loads(proc.stdout.readline())
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        proc.kill()
    assert isinstance(facts["host"]["port_range"], list) and facts["host"]["links"]["lo"]["mtu"] > 0
    assert opened["open"] is True and opened["port_range"] == facts["host"]["port_range"]
    found = probed["paths"]["self"]
    assert found["tcp"]["ok"] is True and found["mtu"]["ok"] is True and "127.0.0.1" in found["names"]["localhost"]
    assert closed == {}
