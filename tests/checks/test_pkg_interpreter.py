"""PKG003 and the interpreter on the nodes: the oldest Python the node side runs on is pyproject's, an older
interpreter (real ones: pyenv's 2.7 and 3.x) says what it is instead of sending facts, and on the real test
cluster an interpreter too old or unable to compile the collector fails PKG003 naming it, and a collector
section that failed on a node is that node's error, not a pass."""
import os
import subprocess
import textwrap

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from cluster_check import check_code, clean
from conftest import results
from preflight.remote.shipping import AGENT, shipped_command, shipped_input


OLD_PYTHONS = {version: os.path.expanduser(f"~/.pyenv/versions/{version}/bin/python")
               for version in ("2.7.18", "3.6.15", "3.8.18")}


def old_python(version):
    """A real old interpreter (pyenv's), else the test is skipped."""
    python = OLD_PYTHONS[version]
    if not os.access(python, os.X_OK):
        pytest.skip(f"no Python {version} here ({python})")
    return python


@pytest.mark.parametrize("version", sorted(OLD_PYTHONS))
def test_an_old_interpreter_says_what_it_is_instead_of_facts(version):
    """The collector compiles with Python 2.7 and every Python 3 up to the gate, which then names the
    interpreter and its version (and sends no facts that would be misread)."""
    python = old_python(version)
    proc = subprocess.run(["bash", "-c", shipped_command(python)], capture_output=True, text=True, timeout=60,
                          input=shipped_input(AGENT, {"head": "x", "port": 29500}) + "done\n")
    assert proc.returncode == 3 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr == (f"preflight: unsupported interpreter: {python} is Python {version}; preflight needs "
                           "Python 3.9 or newer\n")


def test_the_minimum_is_pyprojects():
    from preflight.node import MIN_PYTHON

    pyproject = open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), encoding="utf-8").read()
    assert 'requires-python = ">=%d.%d"' % MIN_PYTHON in pyproject


PYTHON2_SYNTAX_ERROR = textwrap.dedent("""\
    #!/bin/bash
    # What an interpreter too old to compile preflight's program prints (Python 2 meeting Python 3 syntax),
    # once it has read the program (the bootstrap reads a length line, then that many bytes).
    IFS= read -r n
    head -c "$n" > /dev/null
    cat >&2 <<'OUT'
    Traceback (most recent call last):
      File "<string>", line 14, in <module>
      File "preflight-shipped", line 120
        print(f"{name}: {value}", file=sys.stderr)
                                 ^
    SyntaxError: invalid syntax
    OUT
    exit 1
""")


@pytest.mark.cluster
def test_python_2_is_a_pkg003_failure_naming_it_and_its_version(cluster):
    python = old_python("2.7.18")
    code, doc, err = check_code(cluster, "--only", "PKG003,NET001", python=python, timeout="10")
    clean(err)
    assert code == 1
    pkg = results(doc, "PKG003")
    for node in cluster.nodes:
        assert pkg[node]["status"] == "fail", pkg[node]
        assert pkg[node]["message"] == (f"the interpreter {python} is Python 2.7.18, older than Python 3.9, the "
                                        "oldest preflight supports"), pkg[node]
        assert "--python" in pkg[node]["remediation"]
    assert not any("resolve" in r["message"] for r in doc["results"] if r["id"] == "NET001"), doc["results"]


@pytest.mark.cluster
def test_an_interpreter_that_cannot_compile_the_collector_is_a_pkg003_failure(cluster, tmp_path):
    python = tmp_path / "python"
    python.write_text(PYTHON2_SYNTAX_ERROR)
    python.chmod(0o755)
    code, doc, err = check_code(cluster, "--only", "PKG003", python=python, timeout="10")
    clean(err)
    assert code == 1
    for node, result in results(doc, "PKG003").items():
        assert result["status"] == "fail"
        assert result["message"] == (f"the interpreter {python} cannot compile preflight's fact collector "
                                     "(SyntaxError: invalid syntax): it is older than Python 3.9, the oldest "
                                     "preflight supports"), result


@pytest.mark.cluster
def test_a_collector_section_that_failed_on_the_node_is_said_as_such(cluster, tmp_path):
    """socket.getfqdn raises on node02 (a sitecustomize on its PYTHONPATH): the host section failed there,
    and PKG003 says so instead of the node passing."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "sitecustomize.py").write_text(
        "import socket\n\n\ndef broken(*args):\n    raise OSError('getfqdn broken (preflight test)')\n\n\n"
        "socket.getfqdn = broken\n")
    with cluster.env("node02", PYTHONPATH=str(overlay)):
        code, doc, err = check_code(cluster, "--only", "PKG003,NET001,NET006", timeout="10")
    clean(err)
    pkg = results(doc, "PKG003")
    assert pkg["node02"]["status"] == "error", pkg
    assert pkg["node02"]["message"] == ("collector section host failed on the node: OSError: getfqdn broken "
                                        "(preflight test)")
    assert pkg["node01"]["status"] == "pass" and pkg["node03"]["status"] == "pass"
    assert code == 1
    # The checks that read the failed section say they could not, instead of "hostname None does not resolve".
    for check_id in ("NET001", "NET006"):
        found = results(doc, check_id)
        assert found["node02"]["status"] == "error", found
        assert found["node02"]["message"].startswith("not evaluated on node02: collector section host failed"), found
        assert found["node01"]["status"] == "pass"
