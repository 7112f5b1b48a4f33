"""The distribution as users install it: the wheel and the sdist built from this tree, the wheel installed into a
fresh virtual environment (its dependencies from the package index, as `pip install preflight-multinode` takes
them; no source tree on the path), and run from there: `lint` on a fixture, `check` on this machine, and `check`
on the test cluster with the all-reduce, so that shipping the node modules, the check entry points and the package
data are proven from the installed wheel. `pipx install` of the wheel gives a working command too, and the wheel
in fresh environments of Python 3.9 and 3.13 runs the README's commands as written."""
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import preflight
import transcripts
from cluster import make_cluster_fixtures

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "config" / "CFG001" / "ok-all-known"
WHEEL_LIMIT = 1 << 20  # the wheel is code and a few data files: well under 1 MiB (about 0.55 MB today)

cluster_up, cluster = make_cluster_fixtures(nodes=2, prefix="whl")


def run(*argv, cwd, env=None, timeout=600):
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory):
    """The `preflight` command of a fresh virtual environment with the wheel installed."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    run(sys.executable, "-m", "venv", venv, cwd=venv.parent)
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", dist[0],
        cwd=venv.parent)
    return venv / "bin" / "preflight"


def outside_the_tree(tmp_path):
    """An environment without PYTHONPATH, and a working directory away from the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env, tmp_path


def test_the_wheel_holds_the_package_and_its_data_and_no_tests(dist):
    wheel, sdist = dist
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name == f"preflight_multinode-{preflight.__version__}-py3-none-any.whl"
    assert sdist.name == f"preflight_multinode-{preflight.__version__}.tar.gz"
    assert "preflight/inputs/known_defects.toml" in names and "preflight/node/agent.py" in names
    assert "preflight/checks/config/world.py" in names and "preflight/checks/net.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    assert {f"preflight/gate/slurm_scripts/{n}.sh" for n in ("prolog", "healthcheck", "epilog")} <= set(names)
    assert not [n for n in names if n.startswith(("tests/", "scripts/", "docs/")) or "/fixtures/" in n], names
    assert wheel.stat().st_size < WHEEL_LIMIT, wheel.stat().st_size
    said = float(re.search(r"\(about (\d+\.\d+) MB\)", (ROOT / "CHANGELOG.md").read_text()).group(1))
    assert abs(said - wheel.stat().st_size / 1e6) < 0.05, f"CHANGELOG.md says the wheel is about {said} MB"


def test_the_installed_wheel_lints_checks_this_machine_and_says_its_version(installed, tmp_path):
    env, cwd = outside_the_tree(tmp_path)
    version = run(installed, "--version", cwd=cwd, env=env).stdout
    assert version == f"preflight-multinode {preflight.__version__}\n"
    where = run(installed.parent / "python", "-c", "import preflight; print(preflight.__file__)", cwd=cwd, env=env)
    assert str(installed.parents[2]) in where.stdout and str(ROOT) not in where.stdout
    lint = json.loads(run(installed, "lint", "--config", FIXTURE / "accelerate.yaml", "--json", cwd=cwd, env=env).stdout)
    assert lint["preflight"] == preflight.__version__ and "CFG001" in {r["id"] for r in lint["results"]}
    listed = json.loads(run(installed, "list", "--json", cwd=cwd, env=env).stdout)
    families = {c["id"][:3] for c in listed}  # every family's entry point, from the wheel's metadata
    assert {"CFG", "SSH", "NET", "CLK", "PKG", "FS0", "SYS", "COL", "GPU", "JOB", "RUN", "MEM", "RDM"} <= families
    proc = subprocess.run([str(installed), "check", "--json", "--skip", "CLK002"], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)
    doc = json.loads(proc.stdout)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
    pkg = [r for r in doc["results"] if r["id"] == "PKG008"]
    assert pkg and pkg[0]["status"] in ("pass", "warn", "fail", "skip")  # the table was found in the wheel
    assert not [r for r in doc["results"] if r["status"] == "error"], doc["results"]


@pytest.mark.cluster
def test_the_installed_wheel_checks_the_cluster_with_the_all_reduce(installed, cluster, tmp_path):
    env, cwd = outside_the_tree(tmp_path)
    # The nodes' training interpreter is this test run's (torch for the all-reduce worker); what runs there is
    # what the installed wheel ships.
    proc = subprocess.run([str(installed), "check", "--hosts", ",".join(cluster.nodes), "--ssh-config",
                           str(cluster.ssh_config), "--python", sys.executable, "--only", "SSH,PKG001,COL001",
                           "--json"], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    doc = json.loads(proc.stdout)
    assert "Traceback" not in proc.stderr, proc.stderr
    by_id = {r["id"]: r for r in doc["results"]}
    assert by_id["SSH001"]["status"] == "pass" and by_id["COL001"]["status"] == "pass", doc["results"]
    assert by_id["COL001"]["evidence"].get("busbw_gbps"), by_id["COL001"]


def test_pipx_install_of_the_wheel_gives_a_working_command(dist, tmp_path):
    pipx = shutil.which("pipx") or str(Path(sys.executable).parent / "pipx")
    if not os.path.exists(pipx):
        pytest.fail("pipx is not installed: scripts/test installs it with the test extra")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIPX_HOME=str(tmp_path / "pipx"), PIPX_BIN_DIR=str(tmp_path / "bin"), PIPX_MAN_DIR=str(tmp_path / "man"))
    run(pipx, "install", "--python", sys.executable, dist[0], cwd=tmp_path, env=env)
    version = run(tmp_path / "bin" / "preflight", "--version", cwd=tmp_path, env=env).stdout
    assert version == f"preflight-multinode {preflight.__version__}\n"


def other_python(version: str):
    """An interpreter of this Python version: on the PATH, else one pyenv built (None: neither)."""
    found = shutil.which(f"python{version}")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:  # not a pyenv shim only
        return found
    built = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
    return str(built[-1]) if built else None


README_LINTS = ("lint-sbatch", "lint-k8s-jobset", "examples-sbatch", "examples-k8s")  # the README's, on its files


@pytest.mark.parametrize("version", ["3.9", "3.13"])
def test_the_wheel_on_the_oldest_and_newest_python_runs_the_readmes_commands_as_written(dist, tmp_path, version):
    """A fresh venv of Python 3.9 (the oldest pyproject allows) and 3.13 with the wheel: `--version`, `check` and
    `node` on this machine, the README's lint commands printing what their transcripts show, its preflight.toml,
    its plugin example, and `slurm-scripts`."""
    python = other_python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (PATH, ~/.pyenv)")
    venv = tmp_path / "env"
    run(python, "-m", "venv", venv, cwd=tmp_path)
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", dist[0],
        cwd=tmp_path)
    env, cwd = outside_the_tree(tmp_path / "work")
    cwd.mkdir()
    preflight_bin = venv / "bin" / "preflight"
    assert run(preflight_bin, "--version", cwd=cwd, env=env).stdout == f"preflight-multinode {preflight.__version__}\n"
    for argv in (["check"], ["node", "--budget", "20", "--skip", "CLK002"]):
        proc = subprocess.run([str(preflight_bin), *argv], capture_output=True, text=True, timeout=300, cwd=cwd,
                              env=env)
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, (argv, proc.stdout, proc.stderr)
    for name in README_LINTS:
        inputs = cwd / name
        shutil.copytree(ROOT / "tests" / "fixtures" / "transcripts", inputs)
        shutil.copy(ROOT / "tests" / "fixtures" / "k8s" / "jobset_pytorch_resnet.yaml", inputs)
        if name.startswith("examples"):
            shutil.copytree(ROOT / "docs" / "examples", inputs, dirs_exist_ok=True)
        said, _ = transcripts.run(name, inputs, python=venv / "bin" / "python", env=env)
        transcripts.held(name, said, write=False)
    readme = (ROOT / "README.md").read_text()
    profile = readme[readme.index("```toml\n# preflight.toml\n") + 8:]
    (cwd / "preflight.toml").write_text(profile[:profile.index("```\n")])
    shutil.copy(ROOT / "docs" / "examples" / "train.slurm", cwd)
    shutil.copy(ROOT / "docs" / "examples" / "accelerate.yaml", cwd)
    lint = subprocess.run([str(preflight_bin), "lint", "--sbatch", "train.slurm"], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)
    assert lint.returncode == 0 and "verdict: PASS" in lint.stdout, (lint.stdout, lint.stderr)
    (cwd / "slurm").mkdir()
    run(preflight_bin, "slurm-scripts", cwd / "slurm", cwd=cwd, env=env)
    written = sorted(p.name for p in (cwd / "slurm").iterdir())
    assert written == [f"preflight-{n}.sh" for n in ("epilog", "healthcheck", "prolog")]
