"""A Kubernetes manifest as the cluster will run it: its training resources (Kubeflow PyTorchJob, MPIJob, TrainJob and
(Cluster)TrainingRuntime, JobSet, LeaderWorkerSet, Volcano Job, an Indexed Job or a StatefulSet), the pods each
makes, what their containers run and ask for, and what the operator adds to them.

No API server is asked anything: the file is read as written, documents separated by `---`. What an operator
injects is taken from its source and stated where it is used:
- PyTorchJob (kubeflow/training-operator v1, pkg/controller.v1/pytorch envvar.go, master.go, elastic.go, and the
  defaults of pkg/apis/kubeflow.org/v1/pytorch_defaults.go): with a Master, MASTER_ADDR and PET_MASTER_ADDR
  `<name>-master-0`, MASTER_PORT and PET_MASTER_PORT (the port named `pytorchjob-port` of the container `pytorch`,
  23456 by default), WORLD_SIZE, RANK and PET_NODE_RANK; PET_NPROC_PER_NODE from spec.nprocPerNode ("auto" by
  default) or the older elasticPolicy.nProcPerNode; PET_NNODES (all replicas, or elasticPolicy's MIN:MAX) and,
  with an elasticPolicy, PET_RDZV_ENDPOINT (`<name>-worker-0:PORT`) and PET_RDZV_BACKEND (c10d). The operator
  makes a headless Service for every pod. torchrun reads each PET_<OPTION> as that option's default
  (torch/distributed/argparse_util.py, `env`).
- TrainJob (kubeflow/trainer, pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy): PET_NNODES (the
  TrainJob's trainer.numNodes over its runtime's mlPolicy.numNodes), PET_NPROC_PER_NODE (trainer.numProcPerNode over
  mlPolicy.torch.numProcPerNode, "auto"), PET_NODE_RANK, PET_MASTER_ADDR `<name>-trainer-node-0-0.<name>` and
  PET_MASTER_PORT 29500 (pkg/constants/constants.go).
- JobSet (kubernetes-sigs/jobset, pkg/webhooks/jobset_webhook.go): network.enableDNSHostnames defaults to true, the
  subdomain to the JobSet's name: pods are `<jobset>-<job>-<index>-<pod>.<subdomain>`, behind a headless Service.
- LeaderWorkerSet (kubernetes-sigs/lws): LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX.
- Volcano Job (volcano-sh/volcano, pkg/controllers/job/plugins/distributed-framework/pytorch/pytorch.go): the
  `pytorch` plugin sets MASTER_ADDR, MASTER_PORT (23456), WORLD_SIZE and RANK.

A container's command is the launch (preflight.inputs.launchcmd), also inside `bash -c "..."` (read with the batch
script's shell scanner). Kubernetes expands `$(VAR)` in command and args from the container's environment; a `$VAR`
there is the shell's, at run time. `{{ }}` anywhere and `${VAR}` outside a command are templates: the fields they
fill are said to be templated, not guessed.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from preflight.inputs import launchcmd
from preflight.inputs.documents import InputError, read_regular, shorten, yaml_documents

# Real manifests are KiB; an object the API server stores is at most 1.5 MiB (etcd's default request limit).
MAX_BYTES = 4 * 1024 * 1024
MAX_DOCUMENTS = 1000
SHELLS = ("bash", "sh", "zsh", "dash", "ash")
TEMPLATE = re.compile(r"\{\{.*?\}\}", re.S)
MARK = "PREFLIGHT-TEMPLATED"  # what a {{ ... }} becomes while the YAML is read
ENV_TEMPLATE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(:?-[^}]*)?\}|\$[A-Za-z_][A-Za-z0-9_]*")
SHELL_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
RDMA_RESOURCE = re.compile(r"(^rdma/|/rdma|/hca|infiniband|mellanox\.com/|nvidia\.com/(mlnx|hostdev|sriov)|"
                           r"^vpc\.amazonaws\.com/efa$)", re.I)
EFA_RESOURCE = "vpc.amazonaws.com/efa"  # AWS's Elastic Fabric Adapter: NCCL reaches it through aws-ofi-nccl

PYTORCHJOB_PORT = 23456  # kubeflow.org/v1 PyTorchJobDefaultPort
TRAINER_PORT = 29500  # trainer constants.ContainerTrainerPort
VOLCANO_PORT = 23456  # volcano pytorch plugin DefaultPort


@dataclass(frozen=True)
class Launch:
    """The launch a container runs: its command as the launcher reads it, the environment's known values put in."""

    command: launchcmd.LaunchCommand
    in_shell: bool  # read from a `sh -c` string
    text: str  # the launch as written


@dataclass(frozen=True)
class Container:
    name: str
    line: int
    argv: Tuple[str, ...]  # command + args, $(VAR) expanded as the kubelet does
    launch: Optional[Launch]
    env: Mapping[str, Optional[str]]  # the container's own: name -> value (None: from a field, a secret, templated)
    limits: Mapping[str, str]  # resource limits (requests where no limit is given)
    mounts: Tuple[Tuple[str, str], ...]  # (mountPath, volume name)
    capabilities: Tuple[str, ...]
    privileged: bool


@dataclass(frozen=True)
class Group:
    """The pods one template makes."""

    role: str
    pods: Optional[int]  # None: templated or not in the file
    line: int
    containers: Tuple[Container, ...]
    volumes: Mapping[str, Mapping[str, Any]]
    annotations: Mapping[str, Any]
    labels: Mapping[str, Any]
    host_network: bool = False
    host_ipc: bool = False
    subdomain: Optional[str] = None
    template_read: bool = True  # False: the pod template is elsewhere (a TrainJob's runtime not in the file)


@dataclass(frozen=True)
class Training:
    kind: str
    name: str
    namespace: Optional[str]
    line: int
    groups: Tuple[Group, ...]
    injected: Mapping[str, Optional[str]]  # what the operator sets in every container (None: differs per pod)
    address: Optional[str] = None  # how the operator gives pods the head's address, in words
    nodes_per_job: Optional[int] = None  # the pods of one distributed job (an LWS group), when not all pods
    problems: Tuple[Tuple[int, str], ...] = ()  # what the operator's admission refuses
    notes: Tuple[str, ...] = ()

    @property
    def pods(self) -> Optional[int]:
        if any(g.pods is None for g in self.groups):
            return None
        return sum(g.pods for g in self.groups)

    def env(self, container: Container) -> Dict[str, Optional[str]]:
        """The container's environment as it runs: its own, then the operator's (appended after it: the last wins)."""
        return {**container.env, **self.injected}


@dataclass(frozen=True)
class Service:
    name: str
    namespace: Optional[str]
    headless: bool
    line: int


@dataclass(frozen=True)
class Manifest:
    path: str
    kinds: Tuple[str, ...]
    trainings: Tuple[Training, ...]
    services: Tuple[Service, ...]
    namespaces: Mapping[str, Mapping[str, Any]]  # Namespace objects in the file: name -> labels
    templated: Tuple[Tuple[int, str], ...]  # (line, the field) a template fills

    def where(self, line: int) -> str:
        return f"{self.path}:{line}" if line else self.path

    @property
    def launches(self) -> List[Tuple[Training, Group, Container]]:
        return [(t, g, c) for t in self.trainings for g in t.groups for c in g.containers if c.launch is not None]

    @property
    def main(self) -> Optional[Tuple[Training, Group, Container]]:
        """The container whose launch is the job's (a launcher's, else a python script's), the plan's command."""
        found = self.launches
        for wanted in (launchcmd.MULTI_LAUNCHERS, ("python",)):
            for t, g, c in found:
                if c.launch.command.launcher in wanted:
                    return t, g, c
        return None


# ---- reading ---------------------------------------------------------------------------------------------------

def load(path: str) -> Manifest:
    """Read a manifest. Bad input (missing, not a regular file, too large, binary, not YAML, a YAML bomb, no
    Kubernetes object) raises InputError naming the file."""
    what = "Kubernetes manifest"
    if not path:
        raise InputError("--k8s", "the manifest path is empty")
    return parse(path, read_regular(path, what, MAX_BYTES))


def _masked(text: str) -> Tuple[str, List[int]]:
    """The text with every `{{ ... }}` made a plain word (a line that is only template actions made blank), and the
    lines that held one."""
    lines = []
    out = []
    for number, raw in enumerate(text.split("\n"), 1):
        if "{{" not in raw:
            out.append(raw)
            continue
        lines.append(number)
        rest = TEMPLATE.sub("", raw).strip()
        out.append("" if not rest or rest == "-" else TEMPLATE.sub(MARK, raw))
    return "\n".join(out), lines


def parse(path: str, text: str) -> Manifest:
    masked, template_lines = _masked(text)
    try:
        docs = yaml_documents(path, masked, MAX_DOCUMENTS)
    except InputError as exc:
        if template_lines:
            raise InputError(path, f"{exc.problem} (a templated manifest: {{{{ }}}} on line {template_lines[0]}; "
                                   "render it first, e.g. helm template)", exc.line) from None
        raise
    objects = []
    for data, line in docs:
        items = data.get("items") if isinstance(data, dict) and data.get("kind") == "List" else [data]
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and isinstance(item.get("kind"), str) and isinstance(item.get("apiVersion"), str):
                objects.append((item, line))
    if not objects:
        raise InputError(path, "not a Kubernetes manifest: no document has apiVersion and kind")
    templated: List[Tuple[int, str]] = []
    for obj, line in objects:
        _templated_fields(obj, (), line, templated)
    by_name = {(o["kind"], _text(_meta(o).get("name"))): o for o, _ in objects}
    trainings = []
    referenced = {_text(_get(o, "spec", "runtimeRef", "name")) for o, _ in objects if o["kind"] == "TrainJob"}
    for obj, line in objects:
        kind = obj["kind"]
        reader = READERS.get(kind)
        if reader is None:
            continue
        if kind in ("TrainingRuntime", "ClusterTrainingRuntime") and _text(_meta(obj).get("name")) in referenced:
            continue  # read with the TrainJob that names it
        found = reader(obj, line, by_name) if kind == "TrainJob" else reader(obj, line)
        if found is not None:
            trainings.append(found)
    services = tuple(Service(_text(_meta(o).get("name")), _namespace(o),
                             _get(o, "spec", "clusterIP") == "None", line)
                     for o, line in objects if o["kind"] == "Service")
    namespaces = {_text(_meta(o).get("name")): dict(_map(o, "metadata", "labels")) for o, _ in objects
                  if o["kind"] == "Namespace"}
    return Manifest(path, tuple(o["kind"] for o, _ in objects), tuple(trainings), services, namespaces,
                    tuple(templated))


def _templated_fields(value: Any, keys: Tuple[Any, ...], line: int, out: List[Tuple[int, str]]) -> None:
    """The fields a template fills: {{ }} anywhere, ${VAR} outside a container's command and args."""
    if isinstance(value, dict):
        for k, v in value.items():
            _templated_fields(v, keys + (k,), line, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _templated_fields(v, keys + (i,), line, out)
    elif isinstance(value, str) and len(out) < 50:
        in_command = any(k in ("command", "args") for k in keys[-2:])
        if MARK in value or (not in_command and ENV_TEMPLATE.search(value)):
            out.append((line, ".".join(str(k) for k in keys)))


def is_templated(value: Any) -> bool:
    return isinstance(value, str) and (MARK in value or bool(ENV_TEMPLATE.fullmatch(value.strip())))


def _meta(obj: Mapping) -> Mapping:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _namespace(obj: Mapping) -> Optional[str]:
    return _text(_meta(obj).get("namespace")) or None


def _map(obj: Any, *keys: Any) -> Mapping:
    """The mapping at keys, or an empty one where the manifest has none or something else (the API server would
    refuse that shape; the checks read what is there)."""
    value = _get(obj, *keys)
    return value if isinstance(value, dict) else {}


def _list(obj: Any, *keys: Any) -> List[Any]:
    value = _get(obj, *keys)
    return list(value) if isinstance(value, list) else []


def _get(obj: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(obj, dict):
            obj = obj.get(key)
        elif isinstance(obj, list) and isinstance(key, int) and 0 <= key < len(obj):
            obj = obj[key]
        else:
            return None
    return obj


def count(value: Any, default: Optional[int] = 1) -> Optional[int]:
    """A count as the API server reads it (an integer field); absent: the default; templated or not a number: None."""
    if value is None:
        return default
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


QUANTITY = re.compile(r"^([0-9.]+)(e[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
SUFFIX = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Ki": 2**10,
          "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


QUANTITY_MAX = 2**63 - 1  # a Quantity's value is an int64 (resource.Quantity.Value)


def quantity_bytes(value: Any) -> Optional[int]:
    """A resource quantity (k8s.io/apimachinery resource.Quantity: 16Gi, 1G, 512Mi, 1e9) in bytes, or None where it
    is none (quantity_problem says why) or templated."""
    return quantity_read(value)[0]


def quantity_problem(value: Any) -> Optional[str]:
    """Why a value written as a resource quantity is none the API server takes (it refuses the manifest), or None."""
    return quantity_read(value)[1]


def quantity_read(value: Any) -> Tuple[Optional[int], Optional[str]]:
    if isinstance(value, bool) or value is None or is_templated(value):
        return None, None
    if isinstance(value, float) and not math.isfinite(value):  # YAML's .inf, 1e999: no JSON can carry it
        return None, f"{value!r} is not a number kubectl can send (JSON has no infinity)"
    if isinstance(value, (int, float)):
        number, text = float(value), repr(value)
    else:
        text = str(value).strip()
        m = QUANTITY.match(text)
        try:
            number = float(m.group(1)) if m else None
        except ValueError:
            number = None
        if number is None:
            return None, f"{shorten(text)} is not a quantity (a number with a suffix such as Gi: 16Gi)"
        suffix = m.group(2)
        exponent = int(suffix[1:]) if suffix and suffix.startswith("e") else None
        number = QUANTITY_MAX + 1.0 if exponent is not None and exponent > 30 else \
            number * (10 ** exponent if exponent is not None else SUFFIX[suffix])
    # Past an int64 the Quantity's value saturates (resource.Quantity.Value): no limit to compare, and no problem
    return (QUANTITY_MAX if not math.isfinite(number) or number > QUANTITY_MAX else int(number)), None


# ---- containers and their launch --------------------------------------------------------------------------------

def kubelet_expand(text: str, env: Mapping[str, Optional[str]]) -> str:
    """`$(VAR)` replaced by the container's VAR where it has a value, `$$` by `$`; others left as written
    (k8s.io/kubernetes third_party/forked/golang/expansion, Expand)."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("$(", i):
            end = text.find(")", i + 2)
            name = text[i + 2:end] if end > 0 else ""
            if end > 0 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name) and env.get(name) is not None:
                out.append(env[name])
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def shell_expand(word: str, env: Mapping[str, Optional[str]]) -> str:
    """$VAR and ${VAR} (${VAR:-default}) from the environment the container runs with, where it is known; the rest
    stays as written (the shell's, at run time)."""
    def value(m):
        name = m.group(1) or m.group(3)
        if env.get(name) is not None:
            return env[name]
        if m.group(1) and m.group(2) is not None and name not in env:
            return m.group(2)
        return m.group(0)

    return SHELL_VAR.sub(value, word)


def _shell_script(argv: Sequence[str]) -> Optional[str]:
    """The script of `sh -c SCRIPT` (-c alone or in a cluster: -xc, -lc, -ec), or None."""
    if not argv or os.path.basename(argv[0]) not in SHELLS:
        return None
    for k, word in enumerate(argv[1:], 1):
        if not word.startswith("-"):
            return None
        if not word.startswith("--") and "c" in word[1:]:
            return argv[k + 1] if k + 1 < len(argv) else None
    return None


def _launch(argv: Sequence[str], env: Mapping[str, Optional[str]]) -> Optional[Launch]:
    """The launch a container runs: argv itself, or the launcher line of its `sh -c` script."""
    script = _shell_script(argv)
    if script is None:
        command = launchcmd.parse([shell_expand(w, env) for w in argv]) if argv else None
        return Launch(command, False, " ".join(argv)) if command and _runs_something(command) else None
    from preflight.inputs import shellwalker  # bash's grammar: quotes, continuations, separators, heredocs

    best = None
    for words in shellwalker.simple_commands(script):
        while words and words[0] in ("exec", "time", "nohup", "command", "then", "do", "else", "eval"):
            words = words[1:]
        command = launchcmd.parse([shell_expand(w, env) for w in words])
        if command.launcher in launchcmd.MULTI_LAUNCHERS:
            return Launch(command, True, " ".join(words))
        if best is None and _runs_something(command):
            best = Launch(command, True, " ".join(words))
    return best


def _runs_something(command: launchcmd.LaunchCommand) -> bool:
    """A launcher, or python running a script or module (not `python -c CODE`)."""
    if command.launcher in launchcmd.MULTI_LAUNCHERS:
        return True
    return command.launcher == "python" and bool(command.script) and "-c" not in command.from_program[1:3]


def _env(container: Mapping) -> Dict[str, Optional[str]]:
    env: Dict[str, Optional[str]] = {}
    for item in _list(container, "env"):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        value = item.get("value")
        if value is None and "valueFrom" in item:
            env[item["name"]] = None  # from a field, a ConfigMap or a Secret: set, its value known at run time
            continue
        text = "" if value is None else str(value)
        env[item["name"]] = None if is_templated(text) else kubelet_expand(text, env)
    return env


def _words(value: Any) -> List[str]:
    return [str(w) for w in value if isinstance(w, (str, int, float))] if isinstance(value, list) else []


def _container(c: Mapping, injected: Mapping[str, Optional[str]], line: int) -> Container:
    own = _env(c)
    env = {**own, **injected}
    argv = tuple(kubelet_expand(w, env) for w in _words(c.get("command")) + _words(c.get("args")))
    resources = _map(c.get("resources"))
    limits = {**_map(resources.get("requests")), **_map(resources.get("limits"))}
    mounts = tuple((str(m.get("mountPath")), str(m.get("name"))) for m in _list(c, "volumeMounts")
                   if isinstance(m, dict))
    security = _map(c.get("securityContext"))
    caps = _get(security, "capabilities", "add") or []
    return Container(str(c.get("name")), line, argv, _launch(argv, env), own,
                     {str(k): str(v) for k, v in limits.items()}, mounts,
                     tuple(x for x in caps if isinstance(x, str)) if isinstance(caps, list) else (),
                     security.get("privileged") is True)


def _group(role: str, pods: Optional[int], template: Any, line: int, injected: Mapping[str, Optional[str]],
           template_read: bool = True) -> Group:
    template = template if isinstance(template, dict) else {}
    spec = _map(template, "spec")
    meta = _meta(template)
    containers = tuple(_container(c, injected, line) for c in _list(spec, "containers") if isinstance(c, dict))
    volumes = {str(v.get("name")): v for v in _list(spec, "volumes") if isinstance(v, dict)}
    return Group(role, pods, line, containers, volumes, dict(_map(meta, "annotations")),
                 dict(_map(meta, "labels")), spec.get("hostNetwork") is True, spec.get("hostIPC") is True,
                 spec.get("subdomain") if isinstance(spec.get("subdomain"), str) else None, template_read)


def gpus(container: Container) -> Optional[int]:
    """The GPUs the device plugin gives the container (its nvidia.com/gpu limit), 0 when none is asked, None when
    the count is templated."""
    for name in GPU_RESOURCES:
        if name in container.limits:
            return count(container.limits[name], None)
    return 0


def rdma_resources(container: Container) -> List[str]:
    return [name for name in container.limits if RDMA_RESOURCE.search(name)]


# ---- the resources --------------------------------------------------------------------------------------------

def _pytorchjob(obj: Mapping, line: int) -> Training:
    name, spec = _text(_meta(obj).get("name")), _map(obj, "spec")
    replica_specs = _map(spec, "pytorchReplicaSpecs")
    roles = {str(k).lower(): v for k, v in replica_specs.items() if isinstance(v, dict)}  # setTypeNameToCamelCase
    problems = []
    for role, rs in roles.items():
        containers = _list(rs, "template", "spec", "containers")
        if role not in ("master", "worker"):
            problems.append((line, f"replica type {role!r} is not Master or Worker"))
        if not any(isinstance(c, dict) and c.get("name") == "pytorch" for c in containers):
            problems.append((line, f"{role.title()} has no container named 'pytorch' (the operator requires one: it "
                                   "is the container that gets the port and the environment)"))
    if "master" in roles and count(roles["master"].get("replicas")) not in (1, None):
        problems.append((line, "Master replicas must be 1"))
    total = 0
    for rs in roles.values():
        n = count(rs.get("replicas"))
        total = None if n is None or total is None else total + n
    elastic = spec.get("elasticPolicy") if isinstance(spec.get("elasticPolicy"), dict) else None
    nproc = spec.get("nprocPerNode")
    if elastic is not None and elastic.get("nProcPerNode") is not None:
        if nproc is not None:
            problems.append((line, "elasticPolicy.nProcPerNode must not be used with nprocPerNode"))
        nproc = elastic.get("nProcPerNode")
    nproc = "auto" if nproc is None else str(nproc)  # setDefaultNprocPerNode

    def port(role):
        for c in _list(roles.get(role), "template", "spec", "containers"):
            if isinstance(c, dict) and c.get("name") == "pytorch":
                for p in _list(c, "ports"):
                    if isinstance(p, dict) and p.get("name") == "pytorchjob-port":
                        return str(p.get("containerPort"))
        return str(PYTORCHJOB_PORT)  # setPyTorchDefaultPort

    injected: Dict[str, Optional[str]] = {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": nproc}
    address = None
    if "master" in roles:
        head = f"{name}-master-0"
        injected.update(MASTER_ADDR=head, PET_MASTER_ADDR=head, MASTER_PORT=port("master"),
                        PET_MASTER_PORT=port("master"), RANK=None, PET_NODE_RANK=None, WORLD_SIZE=None)
        if total is not None:
            injected["WORLD_SIZE"] = str(total * int(nproc)) if nproc.isdigit() else str(total)
        address = f"MASTER_ADDR={head}, the operator's (a headless Service for every pod)"
    if elastic is not None:
        workers = count(_get(roles, "worker", "replicas"))
        low, high = count(elastic.get("minReplicas"), None), count(elastic.get("maxReplicas"), None)
        low, high = (low or high or workers), (high or low or workers)  # setElasticPolicy
        injected["PET_NNODES"] = f"{low}:{high}" if low is not None and high is not None else None
        rdzv_host = elastic.get("rdzvHost") or f"{name}-worker-0"
        injected["PET_RDZV_ENDPOINT"] = f"{rdzv_host}:{elastic.get('rdzvPort') or port('worker')}"
        injected["PET_RDZV_BACKEND"] = str(elastic.get("rdzvBackend") or "c10d")
        address = address or f"PET_RDZV_ENDPOINT={injected['PET_RDZV_ENDPOINT']}, the operator's"
    else:
        injected["PET_NNODES"] = None if total is None else str(total)
    groups = tuple(_group(role.title(), count(rs.get("replicas")), rs.get("template"), line, injected)
                   for role, rs in roles.items())
    return Training("PyTorchJob", name, _namespace(obj), line, groups, injected, address,
                    problems=tuple(problems))


def _torch_env(name: str, nodes: Optional[int], nproc: Any) -> Dict[str, Optional[str]]:
    return {"PET_NNODES": None if nodes is None else str(nodes), "PET_NPROC_PER_NODE": str(nproc or "auto"),
            "PET_NODE_RANK": None, "PET_MASTER_ADDR": f"{name}-trainer-node-0-0.{name}",
            "PET_MASTER_PORT": str(TRAINER_PORT)}


def _runtime_groups(runtime: Mapping, line: int, nodes: Optional[int], injected, trainer: Optional[Mapping]):
    groups = []
    for rj in _list(runtime, "spec", "template", "spec", "replicatedJobs"):
        if not isinstance(rj, dict):
            continue
        template = _get(rj, "template", "spec", "template")
        trainer_node = rj.get("name") in ("trainer-node", "node")
        if trainer_node and trainer:
            template = _overridden(template, trainer)
        pods = nodes if trainer_node else count(rj.get("replicas"))
        groups.append(_group(str(rj.get("name")), pods, template, line, injected if trainer_node else {}))
    return groups


def _overridden(template: Any, trainer: Mapping) -> Mapping:
    """The runtime's trainer pod template with the TrainJob's trainer fields on its trainer container."""
    import copy

    template = copy.deepcopy(template) if isinstance(template, dict) else {"spec": {"containers": [{"name": "node"}]}}
    containers = _list(template, "spec", "containers")
    target = next((c for c in containers if isinstance(c, dict) and c.get("name") in ("trainer", "node")), None)
    if target is None:
        return template
    for key in ("image", "command", "args"):
        if trainer.get(key) is not None:
            target[key] = trainer[key]
    if isinstance(trainer.get("env"), list):
        target["env"] = _list(target, "env") + trainer["env"]
    if isinstance(trainer.get("resourcesPerNode"), dict):
        target["resources"] = trainer["resourcesPerNode"]
    return template


def _trainjob(obj: Mapping, line: int, by_name) -> Training:
    name = _text(_meta(obj).get("name"))
    trainer = _map(obj, "spec", "trainer")
    ref = _text(_get(obj, "spec", "runtimeRef", "name"))
    runtime = by_name.get(("ClusterTrainingRuntime", ref)) or by_name.get(("TrainingRuntime", ref))
    policy = _map(runtime, "spec", "mlPolicy")
    nodes = count(trainer.get("numNodes"), None)
    if nodes is None and trainer.get("numNodes") is None:
        nodes = count(policy.get("numNodes")) if runtime is not None else None
    nproc = trainer.get("numProcPerNode") or _get(policy, "torch", "numProcPerNode") or "auto"
    injected = _torch_env(name, nodes, nproc)
    notes = []
    if runtime is None:
        notes.append(f"its runtime {ref!r} is not in this file: the pod template (volumes, /dev/shm, the number of "
                     "nodes when the TrainJob does not give it) is not read; the torch runtime's environment is "
                     "assumed")
        groups = [_group("trainer-node", nodes, _overridden(None, trainer), line, injected, template_read=False)]
    else:
        groups = _runtime_groups(runtime, line, nodes, injected, trainer)
    return Training("TrainJob", name, _namespace(obj), line, tuple(groups), injected,
                    f"PET_MASTER_ADDR={injected['PET_MASTER_ADDR']}, the trainer's (a headless Service)",
                    notes=tuple(notes))


def _runtime(obj: Mapping, line: int) -> Training:
    name = _text(_meta(obj).get("name"))
    policy = _map(obj, "spec", "mlPolicy")
    nodes = count(policy.get("numNodes"))
    injected = _torch_env("TRAINJOB", nodes, _get(policy, "torch", "numProcPerNode")) \
        if isinstance(policy.get("torch"), dict) else {}
    groups = _runtime_groups(obj, line, nodes, injected, None)
    address = "PET_MASTER_ADDR, the trainer's (a headless Service)" if injected else None
    return Training(obj["kind"], name, _namespace(obj), line, tuple(groups), injected, address)


def _jobset(obj: Mapping, line: int) -> Training:
    name = _text(_meta(obj).get("name"))
    network = _map(obj, "spec", "network")
    subdomain = _text(network.get("subdomain")) or name
    dns = network.get("enableDNSHostnames") is not False  # the webhook's default: true
    groups = []
    for rj in _list(obj, "spec", "replicatedJobs"):
        if not isinstance(rj, dict):
            continue
        replicas, parallelism = count(rj.get("replicas")), count(_get(rj, "template", "spec", "parallelism"))
        pods = None if replicas is None or parallelism is None else replicas * parallelism
        group = _group(str(rj.get("name")), pods, _get(rj, "template", "spec", "template"), line,
                       {"JOB_COMPLETION_INDEX": None})
        groups.append(group)
    address = f"pods {name}-JOB-INDEX-POD.{subdomain}, behind the JobSet's headless Service" if dns else None
    return Training("JobSet", name, _namespace(obj), line, tuple(groups), {"JOB_COMPLETION_INDEX": None},
                    address, notes=(f"subdomain:{subdomain}",) if dns else ())


def _lws(obj: Mapping, line: int) -> Training:
    name = _text(_meta(obj).get("name"))
    replicas = count(_get(obj, "spec", "replicas"))
    size = count(_get(obj, "spec", "leaderWorkerTemplate", "size"))
    injected = {"LWS_LEADER_ADDRESS": None, "LWS_GROUP_SIZE": None if size is None else str(size),
                "LWS_WORKER_INDEX": None}
    lwt = _map(obj, "spec", "leaderWorkerTemplate")
    worker = lwt.get("workerTemplate")
    leader = lwt.get("leaderTemplate") or worker
    groups = (_group("leader", replicas, leader, line, injected),
              _group("worker", None if replicas is None or size is None else replicas * (size - 1), worker, line,
                     injected))
    return Training("LeaderWorkerSet", name, _namespace(obj), line, groups, injected,
                    "LWS_LEADER_ADDRESS, the leader's (a headless Service)", nodes_per_job=size)


def _volcano(obj: Mapping, line: int) -> Optional[Training]:
    if not str(obj.get("apiVersion", "")).startswith("batch.volcano.sh/"):
        return _job(obj, line)
    name = _text(_meta(obj).get("name"))
    plugins = _map(obj, "spec", "plugins")
    tasks = [t for t in _list(obj, "spec", "tasks") if isinstance(t, dict)]
    total = 0
    for t in tasks:
        n = count(t.get("replicas"))
        total = None if n is None or total is None else total + n
    injected: Dict[str, Optional[str]] = {}
    address = None
    if isinstance(plugins, dict) and "pytorch" in plugins:
        options = dict(str(a).lstrip("-").split("=", 1) for a in _list(plugins, "pytorch") if "=" in str(a))
        master = options.get("master", "master")
        head = f"{name}-{master}-0.{name}"
        injected = {"MASTER_ADDR": head, "MASTER_PORT": options.get("port", str(VOLCANO_PORT)),
                    "WORLD_SIZE": None if total is None else str(total), "RANK": None}
        address = f"MASTER_ADDR={head}, the pytorch plugin's (the svc plugin's headless Service)"
    if isinstance(plugins, dict) and "env" in plugins:
        injected.update(VC_TASK_INDEX=None, VK_TASK_INDEX=None)
    groups = tuple(_group(str(t.get("name")), count(t.get("replicas")), t.get("template"), line, injected)
                   for t in tasks)
    notes = (f"subdomain:{name}",) if isinstance(plugins, dict) and ("svc" in plugins or "pytorch" in plugins) else ()
    return Training("Volcano Job", name, _namespace(obj), line, groups, injected, address, notes=notes)


def _mpijob(obj: Mapping, line: int) -> Training:
    """An MPIJob (kubeflow/mpi-operator v2beta1, and training-operator's v1): a Launcher pod runs mpirun, which starts
    the ranks on the Worker pods (slotsPerWorker of them each, 1 by default) over the hostfile the operator writes;
    the workers' containers are where the GPUs and /dev/shm matter."""
    name, spec = _text(_meta(obj).get("name")), _map(obj, "spec")
    roles = {str(k): v for k, v in _map(spec, "mpiReplicaSpecs").items() if isinstance(v, dict)}
    groups = tuple(_group(role, count(rs.get("replicas")), rs.get("template"), line, {}) for role, rs in roles.items())
    slots = count(spec.get("slotsPerWorker"), 1)
    return Training("MPIJob", name, _namespace(obj), line, groups, {}, None,
                    notes=(f"{slots if slots is not None else '?'} slot(s) per worker",))


def _is_training(group: Group) -> bool:
    return any(c.launch is not None and c.launch.command.launcher in launchcmd.MULTI_LAUNCHERS or gpus(c) for c in
               group.containers)


def _job(obj: Mapping, line: int) -> Optional[Training]:
    """A batch/v1 Job: training when a container runs a launcher or asks for GPUs."""
    name, spec = _text(_meta(obj).get("name")), _map(obj, "spec")
    indexed = spec.get("completionMode") == "Indexed"
    injected = {"JOB_COMPLETION_INDEX": None} if indexed else {}
    group = _group("pods", count(spec.get("parallelism")), spec.get("template"), line, injected)
    if not _is_training(group):
        return None
    notes = (f"subdomain:{group.subdomain}",) if indexed and group.subdomain else ()
    return Training("Indexed Job" if indexed else "Job", name, _namespace(obj), line, (group,), injected,
                    notes=notes)


def _statefulset(obj: Mapping, line: int) -> Optional[Training]:
    name, spec = _text(_meta(obj).get("name")), _map(obj, "spec")
    group = _group("pods", count(spec.get("replicas")), spec.get("template"), line, {})
    if not _is_training(group):
        return None
    service = spec.get("serviceName")
    notes = (f"subdomain:{service}",) if isinstance(service, str) and service else ()
    return Training("StatefulSet", name, _namespace(obj), line, (group,), {}, notes=notes)


READERS = {"PyTorchJob": _pytorchjob, "TrainJob": _trainjob, "TrainingRuntime": _runtime,
           "ClusterTrainingRuntime": _runtime, "JobSet": _jobset, "LeaderWorkerSet": _lws, "Job": _volcano,
           "StatefulSet": _statefulset, "MPIJob": _mpijob}


def subdomain(training: Training) -> Optional[str]:
    """The headless Service name the pods' DNS names sit under (JobSet, Volcano svc, Indexed Job, StatefulSet)."""
    return next((n.split(":", 1)[1] for n in training.notes if n.startswith("subdomain:")), None)


def option(training: Training, container: Container, launcher_option: str) -> Tuple[Optional[str], str]:
    """A torchrun option as torchrun takes it: the flag, else PET_<OPTION> of the environment the pod runs with
    (torch/distributed/argparse_util.py, env), else None. Returns (value, where it came from)."""
    command = container.launch.command
    value = command.get(launcher_option)
    if isinstance(value, str):
        return value, f"--{launcher_option}"
    if command.launcher == "torchrun":
        name = "PET_" + launcher_option.upper()
        env = training.env(container)
        if name in env:
            source = "the operator's" if name in training.injected else "the container's"
            # a value that differs per pod (a rank, a field) is the variable itself: set, known at run time
            return (env[name] if env[name] is not None else "$" + name), f"{name} ({source})"
    return None, ""
