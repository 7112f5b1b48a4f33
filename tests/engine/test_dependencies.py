"""Dependencies say what is used: every distribution pyproject.toml declares for the core is imported by the engine
or its checks, or run as a program (py-spy), in this interpreter's installed form."""
import ast
import importlib.metadata as metadata
import pathlib
import sys

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def imported_and_said():
    """The top-level modules that preflight/ and checks/ import, and their whole source text."""
    modules, text = set(), []
    for path in sorted((ROOT / "preflight").rglob("*.py")) + sorted((ROOT / "checks").glob("*.py")):
        source = path.read_text()
        text.append(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module.split(".")[0])
    return modules, "\n".join(text)


def provides(distribution):
    """What an installed distribution gives: its top-level modules and its programs."""
    modules, programs = set(), set()
    for file in metadata.files(distribution) or ():
        parts = file.parts
        if parts[0] == ".." and "bin" in parts:
            programs.add(parts[-1])
        elif len(parts) == 1 and file.suffix == ".py":
            modules.add(file.stem)
        elif len(parts) > 1 and not parts[0].endswith((".dist-info", ".libs", ".data")) and parts[0] != "..":
            modules.add(parts[0])
    return modules, programs


def test_every_core_dependency_is_used():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    modules, source = imported_and_said()
    unused = []
    for spec in map(Requirement, declared):
        if spec.marker and not spec.marker.evaluate():
            continue
        gives, programs = provides(spec.name)
        assert gives or programs, f"{spec.name} is declared but not installed here"
        if not (gives & modules or any(f'"{program}"' in source for program in programs)):
            unused.append(spec.name)
    assert not unused, f"declared in pyproject.toml, used nowhere in preflight/ or checks/: {unused}"
