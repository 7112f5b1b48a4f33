"""PKG: the same software and environment on every node."""
from __future__ import annotations

import re
from typing import Iterator, Optional

from preflight.api import Finding, Status, check, failed_sections, holders, odd_ones_out, skip
from preflight.node import MIN_PYTHON, UNSUPPORTED
from preflight.job.nccl import fabric_of

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
    versions = {n: _versions(ctx.facts[n]["facts"]) for n in nodes}
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
    groups = {}  # repr of the distributions -> the nodes that have them
    for n in nodes:
        groups.setdefault(repr(installed[n]), []).append(n)
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
    envs = {n: ctx.facts[n]["facts"].get("env") or {} for n in nodes}
    present = set().union(*envs.values())
    names = sorted(v for v in present if v.startswith(COMPARED_PREFIXES) and v not in PER_NODE and v not in BY_MEANING)
    clean = set(nodes)
    for name in names:
        majority, odd = odd_ones_out({n: envs[n].get(name) for n in nodes}, ctx.plan.head)
        for node, value in odd.items():
            clean.discard(node)
            status = Status.FAIL if name.startswith(MUST_MATCH_PREFIXES) else Status.WARN
            yield Finding(status, f"{name} is {value if value is not None else 'unset'} on {node}, "
                          f"{majority if majority is not None else 'unset'} on the others",
                          f"set {name} the same on every node", nodes=(node,),
                          evidence={"variable": name, "value": value, "expected": majority})
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


@check("PKG005", "pinned-versions", "node", tags=["packages", "versions", "profile"])
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

# Versions with a documented defect for multi-node training: (package, version, what happens, fix, source).
KNOWN_BAD = (
    ("nccl", "2.29.2", "NCCL 2.29.2 has a hang regression, fixed in 2.29.3",
     "install nvidia-nccl 2.29.3 or newer (or the torch build that ships it)", "pytorch/pytorch#174338"),
    ("torch", "2.7.0", "torch 2.7.0 can hang in NCCL collectives when init_process_group is given device_id "
     "(its non-blocking communicators), fixed in 2.7.1", "install torch 2.7.1 or newer, or set "
     "TORCH_NCCL_USE_COMM_NONBLOCKING=0", "pytorch/pytorch#153960"),
)


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


@check("PKG007", "cuda-driver", "node", tags=["packages", "cuda", "gpu"])
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


@check("PKG008", "known-bad-versions", "node", tags=["packages", "versions", "nccl"])
def known_bad_versions(ctx) -> Iterator[Finding]:
    """torch and NCCL are not a release with a documented defect for multi-node training (a short list,
    each entry with its source: `preflight explain PKG008`).

    NCCL 2.29.2 has a hang regression (pytorch/pytorch#174338, fixed in 2.29.3); torch 2.7.0 can hang in NCCL
    collectives when init_process_group gets device_id (pytorch/pytorch#153960, fixed in 2.7.1).

    Install the fixed release the message names, or apply its workaround.
    """
    versions = _versions(ctx.fact)
    env = ctx.fact.get("env") or {}
    found = False
    for package, version, what, fix, source in KNOWN_BAD:
        installed = str(versions.get(package) or "").split("+")[0]
        if installed != version:
            continue
        if package == "torch" and env.get("TORCH_NCCL_USE_COMM_NONBLOCKING") == "0":
            continue  # the workaround is in place
        found = True
        yield Finding(Status.WARN, f"{what} ({source})", f"{fix} on {ctx.node}",
                      evidence={"package": package, "version": versions.get(package), "source": source})
    if not found:
        yield Finding(Status.PASS, "torch " + str(versions.get("torch") or "none") + ", NCCL " +
                      str(versions.get("nccl") or "none") + ": no known defect on the list")
