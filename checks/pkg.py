"""PKG: the same software and environment on every node."""
from __future__ import annotations

import functools
import re
from typing import Iterator, Optional

from preflight.api import Finding, Status, check, failed_sections, holders, odd_ones_out, skip
from preflight.node import MIN_PYTHON, UNSUPPORTED
from preflight.job.nccl import fabric_of, misread_lines, nccl_env, nccl_env_of, nccl_wheel
from preflight.inputs.settings import job_environment
from preflight.inputs.versions import condition_text, judge, known_defects, unmet_requirements

KEY_VERSIONS = ("python", "torch", "cuda", "nccl", "deepspeed", "accelerate", "transformers")
# Variables that must be equal for collectives to agree; others are compared and only warned about.
MUST_MATCH_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
COMPARED_PREFIXES = MUST_MATCH_PREFIXES + ("CUDA_", "TORCH_", "FI_", "UCX_", "OMP_", "ACCELERATE_", "DEEPSPEED_")
PER_NODE = ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "NODE_RANK")
# Variables that name per-node things (interfaces, HCAs, GPUs, files), so their text may differ between nodes
# (NCCL's documentation and maintainers say so): never compared; the check that tests each one's meaning on
# every node, None where none does.
BY_MEANING = {
    "NCCL_SOCKET_IFNAME": "NET005", "GLOO_SOCKET_IFNAME": "NET005", "NCCL_IB_HCA": "NET005",
    "CUDA_VISIBLE_DEVICES": "GPU001",
    "NCCL_IB_GID_INDEX": None, "NCCL_HOSTID": None, "NCCL_CONF_FILE": None, "NCCL_DEBUG_FILE": None,
    "NCCL_TOPO_FILE": None, "NCCL_TOPO_DUMP_FILE": None, "NCCL_GRAPH_FILE": None, "NCCL_GRAPH_DUMP_FILE": None,
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None,
}


def _versions(facts: dict) -> dict:
    versions = dict((facts.get("packages") or {}).get("versions") or {})
    versions["python"] = (facts.get("python") or {}).get("version")
    return versions


@check("PKG001", "key-versions", "cluster", tags=["packages", "versions"])
def key_versions(ctx) -> Iterator[Finding]:
    """python, torch, its CUDA build, NCCL, deepspeed, accelerate and transformers have the same version on
    every node.

    Different versions of torch or NCCL across ranks make collectives hang or fail with opaque errors;
    different deepspeed or accelerate versions disagree on config keys and checkpoint layouts.

    Install the same versions everywhere (one image, one lock file); the message names the odd node and
    both versions.
    """
    nodes = ctx.reachable
    if not nodes:
        yield skip("no node was reached")
        return
    agreeing = set(nodes)
    versions, seen = {}, {}  # seen: the ids of a node's sections read -> its versions (nodes alike share them)
    for n in nodes:
        facts = ctx.facts[n]["facts"]
        sections = (id(facts.get("packages")), id(facts.get("python")))
        versions[n] = seen.get(sections) or seen.setdefault(sections, _versions(facts))
    for package in KEY_VERSIONS:
        values = {n: versions[n].get(package) for n in nodes}
        majority, odd = odd_ones_out(values, ctx.plan.head)
        majority_holders = holders(values, majority) if odd else ""
        for node, version in odd.items():
            agreeing.discard(node)
            yield Finding(Status.FAIL, f"{package} differs: {node} has {version or 'none'}, "
                          f"{majority_holders} {majority or 'none'}",
                          f"install {package} {majority} on {node}" if majority else f"remove {package} from {node}",
                          nodes=(node,), evidence={"package": package, "version": version, "expected": majority})
    if agreeing:
        reference = _versions(ctx.facts[sorted(agreeing)[0]]["facts"])
        shown = ", ".join(f"{p} {reference.get(p)}" for p in KEY_VERSIONS if reference.get(p))
        yield Finding(Status.PASS, f"same versions: {shown}", nodes=tuple(n for n in nodes if n in agreeing),
                      evidence={p: reference.get(p) for p in KEY_VERSIONS})


@check("PKG002", "distributions", "cluster", tags=["packages", "versions"])
def distributions(ctx) -> Iterator[Finding]:
    """The other installed Python distributions (those PKG001 does not compare) are the same on every node.

    A different numpy, triton or flash-attn on one node gives a different numerical path or an import
    error on that rank only, long after the start.

    Install from one lock file or image on every node.
    """
    nodes = ctx.reachable
    if len(nodes) < 2:
        yield skip("fewer than two nodes reached: nothing to compare")
        return
    installed = {n: (ctx.facts[n]["facts"].get("packages") or {}).get("distributions") or {} for n in nodes}
    # Nodes with the same distributions are compared as one: thousands of nodes, dozens of names, few groups.
    groups, seen = {}, {}  # repr of the distributions -> the nodes that have them; seen: id -> repr
    for n in nodes:
        distributions = installed[n]
        text = seen.get(id(distributions))
        if text is None:  # once per distinct object: the gathering shares identical sections among nodes
            text = seen[id(distributions)] = repr(distributions)
        groups.setdefault(text, []).append(n)
    members = {group[0]: group for group in groups.values()}  # the first node stands for its group
    head = next((first for first, group in members.items() if ctx.plan.head in group), None)
    sizes = {first: len(group) for first, group in members.items()}
    # The key packages are PKG001's; the interpreter's own are PKG001's python.
    names = sorted(set().union(*(installed[n] for n in members)) - {"torch", "deepspeed", "accelerate", "transformers"})
    differing = {}
    for name in names:
        majority, odd = odd_ones_out({n: installed[n].get(name) for n in members}, head, sizes)
        for first, version in odd.items():
            for node in members[first]:
                differing.setdefault(node, []).append(f"{name} {version or 'missing'} (others {majority or 'missing'})")
    for node, items in sorted(differing.items()):
        shown = "; ".join(items[:8]) + (f"; and {len(items) - 8} more" if len(items) > 8 else "")
        yield Finding(Status.WARN, f"{len(items)} distribution(s) differ on {node}: {shown}",
                      f"align {node}'s environment with the others (same lock file or image)", nodes=(node,),
                      evidence={"differences": items})
    same = [n for n in nodes if n not in differing]
    if same:
        yield Finding(Status.PASS, f"the same {len(installed[same[0]])} distributions", nodes=tuple(same))


@check("PKG003", "interpreter-and-workdir", "cluster", tags=["packages", "python"])
def interpreter_and_workdir(ctx) -> Iterator[Finding]:
    """The training interpreter (--python) runs on every node and is one preflight supports (Python 3.9 or
    newer), every section of preflight's fact collector ran there, and the working directory exists.

    The launcher starts the same interpreter path in the same directory on every node; where either is
    missing, that rank dies at once and the others wait for it. An interpreter older than the job needs
    (Python 2, an old Python 3) is named with its version, and a section of facts that failed on the node
    is said, not read as a wrong value.

    Install the environment at the same path on every node (or pass --python with its path), and run
    from a directory that exists everywhere (a shared filesystem).
    """
    ok = []
    for node, state in ctx.facts.items():
        error = state.get("error") or {}
        facts = state.get("facts") or {}
        failed = failed_sections(facts)
        if error.get("kind") == "python-missing":
            yield Finding(Status.FAIL, error["message"], error["remediation"], nodes=(node,))
        elif error.get("kind") == "collector":
            yield _collector_stopped(node, error, ctx.plan.python)
        elif failed:  # the checks that read these sections find this error in their place
            yield Finding(Status.ERROR, "; ".join(failed), f"the checks that read these facts are not reliable on "
                          f"{node}: report this error (a defect of preflight's collector, or a node it does not "
                          "know)", nodes=(node,), evidence={"failed": failed})
        elif facts:
            workdir = (facts.get("storage") or {}).get("workdir")
            if workdir is not None and not workdir.get("exists"):
                yield Finding(Status.FAIL, f"the working directory {workdir['path']} does not exist",
                              "run from a directory that exists on every node, such as a shared filesystem",
                              nodes=(node,), evidence={"path": workdir["path"]})
            else:
                ok.append(node)
    if ok:
        yield Finding(Status.PASS, "the interpreter runs and the working directory exists", nodes=tuple(ok))


_UNSUPPORTED = re.compile(re.escape(UNSUPPORTED) + r": (.*) is Python (\S+);")
MINIMUM = "%d.%d" % MIN_PYTHON


def _collector_stopped(node: str, error: dict, python: Optional[str]) -> Finding:
    """The collector ended without facts: an interpreter older than preflight supports (it says so, or it
    cannot even compile the collector), else whatever stopped it."""
    message = str(error.get("message") or "")
    fix = (f"pass --python with the path of the job's training interpreter, Python {MINIMUM} or newer (the "
           "environment's bin/python), installed at the same path on every node")
    found = _UNSUPPORTED.search(message)
    if found:
        interpreter, version = found.group(1), found.group(2)
        return Finding(Status.FAIL, f"the interpreter {interpreter} is Python {version}, older than Python {MINIMUM}, "
                       f"the oldest preflight supports", fix, nodes=(node,),
                       evidence={"interpreter": interpreter, "version": version, "minimum": MINIMUM})
    if "SyntaxError" in message:  # too old even to compile the collector (which Python 2.7 still compiles)
        syntax = message[message.rfind("SyntaxError"):].strip()
        return Finding(Status.FAIL, f"the interpreter {python or '(--python)'} cannot compile preflight's fact "
                       f"collector ({syntax}): it is older than Python {MINIMUM}, the oldest preflight supports",
                       fix, nodes=(node,), evidence={"interpreter": python, "version": None, "minimum": MINIMUM})
    return Finding(Status.FAIL, message, error.get("remediation"), nodes=(node,))


@check("PKG004", "environment", "cluster", tags=["environment", "nccl"])
def environment(ctx) -> Iterator[Finding]:
    """NCCL_*, GLOO_* and other job-relevant environment variables have the same values on every node.

    NCCL settings that differ between ranks (NCCL_IB_DISABLE, NCCL_P2P_LEVEL, NCCL_ALGO, ...) make ranks
    pick different transports and hang in the first collective; other differences change behaviour on
    one node only. Variables that name a node's own interfaces, HCAs, GPUs or files (NCCL_SOCKET_IFNAME,
    GLOO_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_GID_INDEX, CUDA_VISIBLE_DEVICES, NCCL_TOPO_FILE,
    NCCL_DEBUG_FILE, ...) may differ: their text is not compared, their meaning is checked on each node
    (NET005, GPU001).

    Set these variables the same way on every node (the job script, not a node's profile). Values of
    names containing TOKEN, SECRET, PASSWORD or KEY are compared redacted.
    """
    nodes = ctx.reachable
    if len(nodes) < 2:
        yield skip("fewer than two nodes reached: nothing to compare")
        return
    seen = {n: nccl_env_of(ctx, n) for n in nodes}  # with what NCCL's files (~/.nccl.conf) add
    envs = {n: seen[n].values for n in nodes}
    present = set().union(*envs.values())
    names = sorted(v for v in present if v.startswith(COMPARED_PREFIXES) and v not in PER_NODE and v not in BY_MEANING)
    clean = set(nodes)
    for name in names:
        majority, odd = odd_ones_out({n: envs[n].get(name) for n in nodes}, ctx.plan.head)
        for node, value in odd.items():
            clean.discard(node)
            status = Status.FAIL if name.startswith(MUST_MATCH_PREFIXES) else Status.WARN
            where = seen[node].sources.get(name)
            yield Finding(status, f"{name} is {value if value is not None else 'unset'} on {node}"
                          f"{f' (from {where})' if where else ''}, "
                          f"{majority if majority is not None else 'unset'} on the others",
                          f"set {name} the same on every node" + (f" (on {node} it comes from {where})" if where else ""),
                          nodes=(node,), evidence={"variable": name, "value": value, "expected": majority,
                                                   **({"source": where} if where else {})})
    if clean:
        per_node = sorted(v for v in present if v in BY_MEANING)
        checked = {}
        for name in per_node:
            checked.setdefault(BY_MEANING[name], []).append(name)
        notes = [f"{', '.join(vs)} checked by meaning in {check_id}, not by text"
                 for check_id, vs in sorted(checked.items(), key=lambda kv: kv[0] or "~") if check_id]
        if checked.get(None):
            notes.append(f"{', '.join(checked[None])} may differ per node (not compared)")
        yield Finding(Status.PASS, f"{len(names)} job-relevant variable(s) equal" + "".join(f"; {n}" for n in notes),
                      nodes=tuple(n for n in nodes if n in clean),
                      evidence={"compared": len(names), "by_meaning": {v: BY_MEANING[v] for v in per_node}})


@check("PKG005", "pinned-versions", "node", tags=["packages", "versions", "profile"],
       reads=["packages", "python"])
def pinned_versions(ctx) -> Iterator[Finding]:
    """Each package the profile pins ([pins] in preflight.toml, such as torch = "2.13.0" or
    accelerate = ">=1.10,<2") is installed on the node in a version the pin allows.

    Versions that agree across nodes (PKG001) can still all be the wrong ones: a torch without the fix the
    job needs, a deepspeed whose config keys differ from the ones the job was written for.

    Install the pinned version on the node (pip install 'torch==2.13.0'), or change the pin in the profile.
    A pin without a local label (2.13.0) accepts any (2.13.0+cu124); a pin with one wants exactly that.
    """
    pins = ctx.plan.profile.pins if ctx.plan.profile is not None else ()
    if not pins:
        yield skip("no [pins] in the profile")
        return
    versions = _versions(ctx.fact)
    installed = (ctx.fact.get("packages") or {}).get("distributions") or {}
    within = []
    for pin in pins:
        version = versions.get(pin.package) or installed.get(pin.package)
        evidence = {"package": pin.package, "version": version, "expected": pin.spec}
        if not version:
            yield Finding(Status.FAIL, f"{pin.package} is not installed, the profile pins {pin.spec}",
                          f"pip install '{pin.package}{_requirement(pin.spec)}'", evidence=evidence)
        elif not pin.allows(version):
            yield Finding(Status.FAIL, f"{pin.package} is {version}, the profile pins {pin.spec}",
                          f"pip install '{pin.package}{_requirement(pin.spec)}' (or change the pin in "
                          f"{ctx.plan.profile.path})", evidence=evidence)
        else:
            within.append(f"{pin.package} {version}")
    if within:
        yield Finding(Status.PASS, f"as pinned: {', '.join(within)}", evidence={"pinned": len(within)})


def _requirement(spec: str) -> str:
    """A pin as pip writes a requirement: "2.13.0" -> "==2.13.0"."""
    return ",".join(p.strip() if p.strip()[:1] in "=!<>" else f"=={p.strip()}" for p in spec.split(","))


# --- the NCCL and CUDA stack under torch ---------------------------------------------------------

def _plugins(facts: dict) -> tuple:
    nccl = (fabric_of(facts)[0] or {}).get("nccl") or {}
    found = tuple(sorted(f"{p.get('name')} ({p.get('bytes')} bytes)" for p in nccl.get("plugins") or []))
    return found + ((f"NCCL_NET_PLUGIN={nccl['net_plugin']}",) if nccl.get("net_plugin") else ())


@check("PKG006", "nccl-net-plugin", "cluster", tags=["packages", "nccl", "rdma"])
def nccl_net_plugin(ctx) -> Iterator[Finding]:
    """Every node has the same NCCL net plugins (libnccl-net*.so on LD_LIBRARY_PATH and in the system
    library folders, and NCCL_NET_PLUGIN), or none.

    NCCL loads a net plugin (the SHARP, AWS OFI/EFA or a vendor's plugin) where it finds one and uses its
    own transports elsewhere: nodes that disagree pick different networks, and their ranks cannot connect
    or run at the slower one's speed.

    Install the same plugin on every node (one image), or remove it where it does not belong.
    """
    nodes = [n for n in ctx.reachable if fabric_of(ctx.facts[n]["facts"])[0] is not None]
    if not nodes:
        yield skip("no node reported its NCCL libraries (fabric facts)")
        return
    values = {n: _plugins(ctx.facts[n]["facts"]) for n in nodes}
    majority, odd = odd_ones_out(values, ctx.plan.head)
    for node, found in odd.items():
        yield Finding(Status.WARN, f"NCCL net plugins differ: {node} has {', '.join(found) or 'none'}, "
                      f"{holders(values, majority)} {', '.join(majority) or 'none'}",
                      f"install the same NCCL net plugin on {node} as on the others" if majority else
                      f"remove {', '.join(found)} from {node}'s library path, or install it on every node",
                      nodes=(node,), evidence={"plugins": list(found), "expected": list(majority)})
    agreeing = tuple(n for n in nodes if n not in odd)
    if agreeing:
        yield Finding(Status.PASS, f"NCCL net plugins: {', '.join(majority) or 'none'}", nodes=agreeing,
                      evidence={"plugins": list(majority)})


def _major_minor(text) -> Optional[tuple]:
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (TypeError, ValueError):
        return None


@check("PKG007", "cuda-driver", "node", tags=["packages", "cuda", "gpu"],
       reads=["packages", "python", "gpus", "fabric"])
def cuda_driver(ctx) -> Iterator[Finding]:
    """torch's CUDA build is one the NVIDIA driver runs: the same major version as the driver's CUDA or an
    older one, ideally no newer minor release either.

    A torch built for a newer CUDA major release than the driver supports stops at the first CUDA call
    ('The NVIDIA driver on your system is too old', 'CUDA driver version is insufficient'), unless CUDA's
    forward compatibility package (a newer libcuda under a `compat` folder on the library path) is there:
    then it only warns. A newer minor release runs through CUDA's minor version compatibility, without the
    features (and the PTX JIT) that need the newer driver.

    Install a torch built for the driver's CUDA (the +cuXYZ wheel), or update the NVIDIA driver.
    """
    build = (_versions(ctx.fact)).get("cuda")
    gpus = ctx.fact.get("gpus") or {}
    if not build:
        yield skip("torch is not installed, or is a CPU build")
        return
    if not gpus.get("available"):
        yield skip(f"no NVIDIA driver answers on this node (torch is built for CUDA {build})")
        return
    driver = gpus.get("cuda_driver_version")
    have, need = _major_minor(driver), _major_minor(build)
    compat = ((fabric_of(ctx.fact)[0] or {}).get("nccl") or {}).get("cuda_compat") or []
    evidence = {"torch_cuda": build, "driver_cuda": driver, "driver": gpus.get("driver_version"), "cuda_compat": compat}
    if have is None or need is None:
        yield skip(f"versions not comparable: torch CUDA {build}, driver CUDA {driver}", **evidence)
    elif need[0] > have[0] and compat:
        yield Finding(Status.WARN, f"torch is built for CUDA {build}, the driver {gpus.get('driver_version')} runs CUDA "
                      f"{driver}: it runs only through CUDA's forward compatibility package ({compat[0]}), which "
                      "datacenter GPUs support", f"update the NVIDIA driver on {ctx.node} to one for CUDA {build} "
                      "(or keep the compat package on every node's library path)", evidence=evidence)
    elif need[0] > have[0]:
        yield Finding(Status.FAIL, f"torch is built for CUDA {build}, the driver {gpus.get('driver_version')} runs "
                      f"CUDA {driver} at most: torch stops at its first CUDA call",
                      f"install the torch wheel for CUDA {have[0]} on {ctx.node}, or update the NVIDIA driver there",
                      evidence=evidence)
    elif need > have:
        yield Finding(Status.WARN, f"torch is built for CUDA {build}, newer than the driver's CUDA {driver}: it runs "
                      "through minor version compatibility, without what needs the newer driver (PTX JIT)",
                      f"update the NVIDIA driver on {ctx.node} to one for CUDA {build}, or install torch for CUDA "
                      f"{driver}", evidence=evidence)
    else:
        yield Finding(Status.PASS, f"torch CUDA {build} on a driver for CUDA {driver}", evidence=evidence)


def _known_defects_doc(func):
    """PKG008's docstring lists the table's rows, each with its source (`preflight explain PKG008`)."""
    rows = "; ".join(f"{d.shown()}: {d.symptom} ({f'fixed in {d.fixed}' if d.fixed else d.fix}; {d.source}, "
                     f"{d.confirmed})" for d in known_defects())
    func.__doc__ = func.__doc__.replace("ROWS", rows)
    return func


# What each row may judge, read from the facts the collector already gathers: never by importing a package.
FROM_DISTRIBUTIONS = ("peft", "trl", "flash-attn", "bitsandbytes")


def _requires(facts: dict) -> dict:
    """Each distribution's declared requirements (Requires-Dist lines) as the collector sent them, lists of text
    only: the head never trusts a node's document."""
    raw = (facts.get("packages") or {}).get("requires")
    return {k: [str(r) for r in v] for k, v in raw.items() if isinstance(v, list)} if isinstance(raw, dict) else {}


def _node_versions(facts: dict):
    """(the node's version of each package a row may judge, the packages it could not tell with the reason,
    which NCCL was judged and what may load another)."""
    packages = facts.get("packages") or {}
    versions = dict(packages.get("versions") or {})
    installed = packages.get("distributions") or {}
    found = {p: versions.get(p) for p in ("torch", "deepspeed", "accelerate", "transformers")}
    found.update((p, installed.get(p)) for p in FROM_DISTRIBUTIONS)
    found["torch-cuda"] = versions.get("cuda")
    found["python"] = (facts.get("python") or {}).get("version")
    # The NCCL torch loads is the nvidia-nccl wheel its metadata requires (torch's own Requires-Dist), else the
    # libnccl.so.2 its libtorch_cuda.so names (NGC, conda: preflight.node.packages.torch_loaded_nccl).
    wheel, found["nccl"] = nccl_wheel(facts)
    library = packages.get("nccl_library")
    nccl_from = (f"{wheel}, the wheel torch depends on" if wheel else
                 f"{library}, the libnccl torch's libtorch_cuda.so loads" if isinstance(library, str) and library else
                 "the nvidia-nccl wheel installed")
    preload = ((facts.get("env") or {}).get("LD_PRELOAD") or "")
    others = [p for p in preload.replace(" ", ":").split(":") if "nccl" in p.rsplit("/", 1)[-1]]
    if others:
        nccl_from += f"; LD_PRELOAD loads {', '.join(others)}, which may be another NCCL"
    # torch's own lib folder comes first for the dynamic loader (preflight.node.fabric, _nccl_libraries).
    libraries = ((fabric_of(facts)[0] or {}).get("nccl") or {}).get("libraries") or []
    bundled = [p for p in libraries if "/torch/lib/" in str(p)]
    if bundled:
        nccl_from += f"; torch loads its own {bundled[0]} first, which may be another NCCL"
    gpus = facts.get("gpus") or {}
    unknown = {}
    if gpus.get("available"):
        found["nvidia-driver"], found["cuda-driver"] = gpus.get("driver_version"), gpus.get("cuda_driver_version")
    else:
        reason = "no NVIDIA driver answers on the node (NVML), so its driver and CUDA versions are unknown"
        unknown = {"nvidia-driver": reason, "cuda-driver": reason}
    return found, unknown, nccl_from


def _node_conditions(ctx, facts: dict) -> tuple:
    """The job's answers to the rows' conditions (Plan.conditions) completed with what
    the node tells: its machine, whether it is a container and holds CAP_SYS_NICE (where the plan does not say
    the job runs in one), the .deepspeed_env files its launch would read, the NCCL net plugins it loads."""
    known, unknown = (dict(answers) for answers in ctx.plan.conditions)
    host = facts.get("host") or {}
    told = "the node did not report it (a preflight older than this one collected its facts)"
    if isinstance(host.get("machine"), str) and host["machine"]:
        known["machine"] = host["machine"]
    else:
        unknown["machine"] = f"the node's machine (aarch64, x86_64) is not known: {told}"
    if "container" not in known:
        if "container" in host:
            known["container"] = bool(host["container"])
        else:
            unknown["container"] = f"whether the node runs the job in a container is not known: {told}"
    if "sys_nice" not in known:
        if known.get("container") and not host.get("container"):
            unknown["sys_nice"] = "the job's container is not the one preflight ran in, so its capabilities (SYS_NICE) are not known"
        elif isinstance(host.get("sys_nice"), bool):
            known["sys_nice"] = host["sys_nice"]
        else:
            unknown["sys_nice"] = f"whether the job holds CAP_SYS_NICE is not known: {told}"
    launch = facts.get("job") or {}
    files = launch.get("deepspeed_env")
    if isinstance(files, list):
        known["deepspeed_env"] = "both" if len(files) > 1 else "one" if files else "none"
    else:
        unknown["deepspeed_env"] = "the node's .deepspeed_env files are not known (its launch was not read)"
    nccl = (fabric_of(facts)[0] or {}).get("nccl")
    if isinstance(nccl, dict):
        known["net_plugin"] = tuple(sorted({kind for p in nccl.get("plugins") or [] if isinstance(p, dict)
                                            for kind in plugin_kinds(str(p.get("name")))}))
    else:
        unknown["net_plugin"] = "the node did not report its NCCL net plugins (fabric facts)"
    return known, unknown


# NCCL net plugins by the library NCCL loads (libnccl-net-<name>.so, NCCL_NET_PLUGIN): aws-ofi-nccl builds
# libnccl-net-ofi.so (and libnccl-net.so before 1.9); the row's spelling is the project's name.
PLUGIN_KINDS = {"aws-ofi-nccl": ("libnccl-net-ofi.so", "libnccl-net-aws-ofi.so")}


def plugin_kinds(name: str) -> tuple:
    return tuple(kind for kind, files in PLUGIN_KINDS.items() if name.rsplit("/", 1)[-1].startswith(files))


@check("PKG008", "known-bad-versions", "node", tags=["packages", "versions", "nccl"],
       reads=["packages", "python", "env", "nccl_conf", "fabric", "gpus", "job", "host.machine", "host.container", "host.sys_nice"])
@_known_defects_doc
def known_bad_versions(ctx) -> Iterator[Finding]:
    """No release on the node has a known defect for multi-node training that this job meets, alone or with
    another installed (torch, the NCCL torch loads, deepspeed, accelerate, transformers, peft, trl, flash-attn,
    bitsandbytes, the driver and CUDA that NVML reports), and every installed library's declared requirements
    are met.

    Versions that agree across nodes can all carry a defect its maintainers confirmed and fixed; each row of
    the table (preflight/inputs/known_defects.toml) has its affected range, the conditions under which it bites
    (the job's precision, ZeRO stage, offload, clipping, MoE, launcher; the node's machine, container,
    capabilities, files, variables; the driver), the symptom, the fixed release and its public source. A row
    is reported only when the job meets every condition; one whose condition preflight cannot know (no
    DeepSpeed config given, no NVML, a choice the training code makes) is listed as not judged with the missing
    fact; one whose documented workaround is set is a pass note. Versions are compared as pip compares them
    (local labels such as +cu121 never hide a release; pre-releases such as NGC's 2.8.0a0 sort below it).
    Requirements are read as pip reads them: a hard one (no extra) unmet fails, as `pip check` does; one of an
    extra named after an installed distribution ([torch], [deepspeed]) warns, naming the extra and the code that
    enforces it at run time; [dev], [test], [docs] and [all] are never read. The rows: ROWS.

    Install the release the message names (or apply the workaround it names) on the node.
    """
    facts = ctx.fact
    found, unknown, nccl_from = _node_versions(facts)
    known, not_known = _node_conditions(ctx, facts)
    env = nccl_env(facts, job_environment(ctx.plan)).values  # the job's settings over the node's, then NCCL's files
    packages = facts.get("packages") or {}
    installed = packages.get("distributions") or {}
    applies, skipped, worked_around, unmet = _judged(
        _frozen(found), _frozen({**not_known, **unknown}), tuple((name, env.get(name)) for name in _defect_variables()),
        tuple((owner, tuple(lines)) for owner, lines in sorted(_requires(facts).items())), _frozen(installed),
        _frozen(known))
    flagged = 0
    for defect in applies:
        flagged += 1
        have = found.get(defect.package)
        judged = f" (NCCL from {nccl_from})" if "nccl" in defect.needs else ""
        fix = "; ".join(part for part in (f"install {defect.package} {defect.fixed} or newer" if defect.fixed
                                          else "", defect.fix) if part)
        met = [condition_text(name, known[name]) for name, _ in defect.when if name in known]
        yield Finding(Status.FAIL if defect.status == "fail" else Status.WARN,
                      f"{defect.package} {have}{judged}" + (f" with {', '.join(met)}" if met else "") +
                      f": {defect.symptom} ({defect.source})", f"on {ctx.node}: {fix}",
                      evidence={"defect": defect.id, "package": defect.package, "version": have,
                                "affected": defect.shown(), "fixed": defect.fixed or None, "source": defect.source,
                                "confirmed": defect.confirmed, "nccl": nccl_from if judged else None,
                                "conditions": {name: known[name] for name, _ in defect.when if name in known}})
    for item in unmet:
        flagged += 1
        yield _unmet_finding(ctx.node, item, installed)
    for ids, reason in _grouped(skipped):
        yield skip(f"{len(ids)} known defect(s) not judged ({', '.join(ids)}): {reason}", defects=ids)
    for defect_id, workaround in worked_around:
        yield Finding(Status.PASS, f"known defect {defect_id} is worked around: {workaround} is set",
                      evidence={"defect": defect_id, "workaround": workaround})
    if not flagged:
        shown = ", ".join(f"{p} {found[p]}" for p in ("torch", "nccl", "deepspeed", "accelerate", "transformers")
                          if found.get(p))
        yield Finding(Status.PASS, f"{shown or 'no training stack'}: none of {len(known_defects())} known defects "
                      f"applies to this job", evidence={"versions": {p: v for p, v in found.items() if v},
                                                        "nccl": nccl_from, "conditions": known})


def _unmet_finding(node: str, item, installed: dict) -> Finding:
    evidence = {"package": item.owner, "requirement": item.requirement, "installed": {item.name: item.have},
                "extra": item.extras[0] if item.extras else None, "extras": list(item.extras)}
    owner = f"{item.owner} {installed.get(item.owner)}"
    if not item.extras:
        return Finding(Status.FAIL, f"{owner} requires {item.requirement} (its metadata), the node has {item.name} "
                       f"{item.have}", f"pip install '{item.requirement}' on {node}, or the {item.owner} release "
                       f"that works with {item.name} {item.have}", evidence=evidence)
    why = (item.enforced_by or f"{item.owner} may refuse it at run time") if item.lower else \
        f"pip refuses it only where {item.owner}[{item.extras[0]}] is installed by name"
    extras = ", ".join(f"[{e}]" for e in item.extras) + (" extras" if len(item.extras) > 1 else " extra")
    return Finding(Status.WARN, f"{owner} requires {item.requirement} with its {extras} (its metadata), "
                   f"the node has {item.name} {item.have}: {why}",
                   f"pip install '{item.requirement}' on {node}, or the {item.owner} release that works with "
                   f"{item.name} {item.have}", evidence=evidence)


def _frozen(mapping) -> tuple:
    """A mapping of facts as a key of _judged (the same keys in another order are only another key): a value
    that cannot be hashed (a malformed fact) by its repr, which reads as a version just as the value does
    (versions.version reads str(value))."""
    items = tuple(mapping.items())
    try:
        hash(items)
        return items
    except TypeError:
        return tuple((k, v if isinstance(v, (str, int, float, type(None))) else repr(v)) for k, v in items)


@functools.lru_cache(maxsize=1)
def _defect_variables() -> tuple:
    """The variables the table's rows read (their conditions and workarounds)."""
    return tuple(sorted({name for d in known_defects() for name, _ in d.env + d.workaround}))


@functools.lru_cache(maxsize=256)
def _judged(found: tuple, unknown: tuple, env: tuple, requires: tuple, installed: tuple, job: tuple = ()) -> tuple:
    """(the rows that apply, (row ID, why not judged) of the skipped ones, (row ID, its workaround) of those
    worked around, the unmet requirements) for one node's versions and the job's conditions. A function of
    them alone, kept for the next node with the same ones: thousands of nodes have a few sets of versions, and
    parsing every Requires-Dist line and marker (packaging) for each node took seconds."""
    found, unknown, env, installed, job = dict(found), dict(unknown), dict(env), dict(installed), dict(job)
    applies, skipped, worked_around = [], [], []
    for defect in known_defects():
        verdict = judge(defect, found, unknown, env, job)
        if verdict == "worked around":
            worked_around.append((defect.id, ", ".join(f"{n}={v}" for n, v in defect.workaround)))
        elif verdict == "applies":
            applies.append(defect)
        elif verdict is not None:
            skipped.append((defect.id, verdict[1]))
    unmet = unmet_requirements({owner: list(lines) for owner, lines in requires}, installed, found.get("python"))
    return tuple(applies), tuple(skipped), tuple(worked_around), tuple(unmet)


def _grouped(skipped):
    by_reason = {}
    for defect_id, reason in skipped:
        by_reason.setdefault(reason, []).append(defect_id)
    return [(ids, reason) for reason, ids in by_reason.items()]


MISREAD_SHOWN = 8  # lines named per node; the rest counted


@check("PKG009", "nccl-conf-lines", "node", tags=["environment", "nccl"], reads=["nccl_conf", "env", "packages"])
def nccl_conf_lines(ctx) -> Iterator[Finding]:
    """The NCCL configuration files NCCL reads on the node (the one NCCL_CONF_FILE names, else ~/.nccl.conf, then
    /etc/nccl.conf) hold no line NCCL reads other than as written.

    NCCL reads a line as NAME=value split at its first `=` (src/misc/param.cc, setEnvFile), trimming and unquoting
    nothing: `NCCL_X = y` sets a variable named `NCCL_X ` (and NCCL_X stays unset), `export NCCL_X=y` one named
    `export NCCL_X`, `NCCL_X="eth0"` keeps the quotes in the value, and before NCCL 2.30 a Windows line end leaves
    a CR in it: the setting is silently lost or wrong on that node. With the node's NCCL not known, only the files
    every release reads are judged, and a CR is not.

    Write each line as NAME=value, with no `export`, spaces around `=` or quotes; convert a file with Windows
    line ends (`dos2unix FILE`); or set the variable in the job's environment, which NCCL reads first.
    """
    found, not_judged, lines = misread_lines(ctx.fact, job_environment(ctx.plan))
    if not lines:
        yield skip("no NCCL_ line in the configuration files NCCL reads here" + (
            f" (not judged: {'; '.join(not_judged)})" if not_judged else ""), not_judged=not_judged)
        return
    for line in found[:MISREAD_SHOWN]:
        yield Finding(Status.WARN, f"{line.where}: `{line.line}`: {line.why}", f"{line.fix} in {line.where}",
                      evidence={"source": line.where, "line": line.line})
    if len(found) > MISREAD_SHOWN:
        yield Finding(Status.WARN, f"{len(found) - MISREAD_SHOWN} more line(s) NCCL misreads, after "
                      f"{found[MISREAD_SHOWN - 1].where}", "write each line as NAME=value",
                      evidence={"more": len(found) - MISREAD_SHOWN})
    if not found:
        said = f" (not judged: {'; '.join(not_judged)})" if not_judged else ""
        yield Finding(Status.PASS, f"{lines} NCCL_ line(s) of the configuration files NCCL reads here, each read as "
                      f"written{said}", evidence={"lines": lines, "not_judged": not_judged})
