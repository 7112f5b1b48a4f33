"""CFG Kubernetes manifest: the training resources of a manifest (`lint --k8s MANIFEST`) as the cluster will run
them: the pods each starts against the launch's nodes, the processes per pod against its GPUs, /dev/shm, the head's
address, sidecar injection and RDMA. The manifest is read by preflight.inputs.manifests (what each operator injects
is stated there, from its source); the main container's launch is the plan's launch command, so the other CFG checks
judge it (and the config files given beside it) as they judge `-- COMMAND`."""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

from preflight.api import Finding, check, fail, passed, skip, warn
from preflight.inputs import launchcmd, manifests
from preflight.inputs.documents import shorten
from preflight.inputs.settings import processes_per_machine
from preflight.inputs.launchcmd import LOCAL_ADDRESSES as LOCAL

HOST_WORDS = ("$(hostname", "`hostname", "$HOSTNAME", "${HOSTNAME}", "$POD_IP", "${POD_IP}", "$(POD_IP)")
ISTIO = "sidecar.istio.io/inject"
NO_MANIFEST = "no Kubernetes manifest given (--k8s)"


def _manifest(ctx):
    return getattr(ctx.plan, "manifest", None)


def _launches(m, per_group=False):
    """Each training resource's container that runs its launch (a launcher's first, else a python script's); with
    per_group, each pod template's (a Master's and a Worker's can ask for different GPUs)."""
    for t in m.trainings:
        for groups in ([(g,) for g in t.groups] if per_group else [t.groups]):
            found = [(g, c) for g in groups for c in g.containers if c.launch is not None]
            for wanted in (launchcmd.MULTI_LAUNCHERS, ("python",)):
                pick = next(((g, c) for g, c in found if c.launch.command.launcher in wanted), None)
                if pick is not None:
                    yield t, pick[0], pick[1]
                    break


def _containers(m):
    """Every container of every pod template: (training, group, container)."""
    return [(t, g, c) for t in m.trainings for g in t.groups for c in g.containers]


def _job_pods(t) -> Optional[int]:
    """The pods of one distributed job: an LWS group's size; all of them where the operator gives the world
    (WORLD_SIZE, PET_NNODES: PyTorchJob, TrainJob, Volcano's pytorch plugin); else the pods of the groups that run a
    launch (a JobSet's other jobs are not the training's)."""
    if t.nodes_per_job is not None:
        return t.nodes_per_job
    if "WORLD_SIZE" in t.injected or "PET_NNODES" in t.injected:
        return t.pods
    running = [g for g in t.groups if any(c.launch is not None for c in g.containers)]
    if not running or any(g.pods is None for g in running):
        return None if running else t.pods
    return sum(g.pods for g in running)


def _label(t, g=None) -> str:
    return f"{t.kind} {t.name}" + (f" ({g.role})" if g is not None and len(t.groups) > 1 else "")


def _config(ctx):
    acc = getattr(ctx.plan, "accelerate", None)
    return dict(acc.data) if acc is not None else {}


def _procs(ctx, t, c) -> Tuple[Optional[int], str]:
    """(processes the container's launch starts, how that is given); None where it is not read."""
    cmd = c.launch.command
    g = manifests.gpus(c)
    if cmd.launcher == "torchrun":
        value, source = manifests.option(t, c, "nproc_per_node")
        value, source = (value, source) if value is not None else ("1", "torchrun's default")
        if value in ("auto", "gpu"):  # torch/distributed/run.py determine_local_world_size: the visible GPUs
            return (g if g else None), f"nproc_per_node {value} ({source})"
        return (int(value) if value.isdigit() else None), f"nproc_per_node {value} ({source})"
    if cmd.launcher == "accelerate":
        data = _config(ctx)
        for name in ("num_processes", "num_machines"):
            if cmd.get(name) is not None:
                data[name] = cmd.get(name)
        if data.get("num_processes") is None:
            return None, "no --num_processes"
        return processes_per_machine(data), f"num_processes {data.get('num_processes')} / num_machines " \
                                            f"{data.get('num_machines', 1)}"
    if cmd.launcher == "deepspeed":
        n = cmd.integer("num_gpus")
        return (n if n is not None else (g or None)), ("--num_gpus" if n is not None else "every GPU it sees")
    return 1, f"python {shorten(cmd.script, 40)}"


@check("CFG080", "k8s-resources", "config", tags=["kubernetes"])
def resources(ctx) -> Iterator[Finding]:
    """The manifest's training resources are ones their operator accepts, and what a template fills is said.

    A PyTorchJob with two Masters, or without a container named `pytorch`, is refused by the training
    operator's webhook (it gives that container the port and the environment). A field written as `{{ }}` or
    `${VAR}` is filled when the manifest is rendered: what it will be is not in the file.

    Give a PyTorchJob one Master and name its training container `pytorch`; lint the rendered manifest
    (`helm template ... > job.yaml`, `envsubst < job.yaml.in > job.yaml`) to have the templated fields read.
    """
    m = _manifest(ctx)
    if m is None:
        yield skip(NO_MANIFEST)
        return
    if not m.trainings:
        yield skip(f"{m.path}: no training resource ({', '.join(sorted(set(m.kinds)))}): PyTorchJob, TrainJob, "
                   "TrainingRuntime, JobSet, LeaderWorkerSet, Volcano Job, an Indexed Job or StatefulSet with a "
                   "launcher or GPUs", file=m.path, kinds=list(m.kinds))
        return
    found = False
    for t in m.trainings:
        for line, problem in t.problems:
            found = True
            yield fail(f"{m.where(line)}: {t.kind} {t.name}: {problem}", "correct the resource as the message says",
                       file=m.path, line=line, kind=t.kind, name=t.name)
    if not found:
        said = "; ".join(f"{t.kind} {t.name}: " + " + ".join(f"{g.role} {g.pods if g.pods is not None else '?'}"
                                                             for g in t.groups) + " pods" for t in m.trainings)
        notes = "; ".join(n for t in m.trainings for n in t.notes if not n.startswith("subdomain:"))
        # A templated field is filled when the manifest is rendered: said as not judged (lint the rendered one).
        fields = ", ".join(f"{f} ({m.where(line)})" for line, f in m.templated[:5])
        templated = f"; templated, not judged until rendered (helm template, envsubst, kustomize build): {fields}" \
            f"{' and more' if len(m.templated) > 5 else ''}" if m.templated else ""
        yield passed(f"{m.path}: {said}" + (f" ({notes})" if notes else "") + templated, file=m.path,
                     kinds=[t.kind for t in m.trainings], templated=[f for _, f in m.templated])


@check("CFG081", "k8s-nodes", "config", tags=["kubernetes", "multinode"])
def nodes(ctx) -> Iterator[Finding]:
    """The launch's node count (torchrun's --nnodes or PET_NNODES, accelerate's num_machines) is the pods the
    resource starts.

    torchrun without --nnodes (and no PET_NNODES) takes one node: each of N pods trains as a job of its own.
    With more nodes than pods the rendezvous waits for pods that never come; with fewer, the extra pods join
    nothing. A PyTorchJob's and a TrainJob's operator set PET_NNODES from the replicas (numNodes), so a
    torchrun without the flag follows them.

    Leave --nnodes to the operator (PyTorchJob, TrainJob), or give it the replicas: --nnodes=4 for a JobSet
    job of 4 pods; accelerate's --num_machines the same.
    """
    m = _manifest(ctx)
    if m is None:
        yield skip(NO_MANIFEST)
        return
    found_any = False
    for t, g, c in _launches(m):
        found_any = True
        cmd, pods = c.launch.command, _job_pods(t)
        where = m.where(t.line)
        ev = dict(file=m.path, kind=t.kind, name=t.name, container=c.name, pods=pods, launcher=cmd.launcher)
        if pods is None:
            yield passed(f"{where}: {_label(t)}: its pod count is not in the file (templated or elsewhere): not "
                         "compared", **ev)
            continue
        if cmd.launcher == "torchrun":
            value, source = manifests.option(t, c, "nnodes")
            value, source = (value, source) if value is not None else ("1:1", "torchrun's default")
            parts = value.split(":")
            if not all(p.strip().isdigit() for p in parts) or len(parts) > 2:
                yield passed(f"{where}: {_label(t)}: --nnodes {shorten(value)} ({source}) is set at run time: not "
                             "read", nnodes=value, **ev)
                continue
            low, high = int(parts[0]), int(parts[-1])
            if not low <= pods <= high:
                yield fail(f"{where}: {_label(t)} starts {pods} pods, torchrun's nnodes is {value} ({source})"
                           + (": every pod trains alone" if high == 1 else ""),
                           f"give torchrun --nnodes={pods}", nnodes=value, source=source, **ev)
            else:
                yield passed(f"{where}: {_label(t)}: {pods} pods, torchrun's nnodes {value} ({source})",
                             nnodes=value, **ev)
        elif cmd.launcher == "accelerate":
            machines = cmd.get("num_machines") or _config(ctx).get("num_machines") or 1
            source = "--num_machines" if cmd.get("num_machines") else ("the config's num_machines"
                                                                      if _config(ctx).get("num_machines") else
                                                                      "accelerate's default")
            n = manifests.count(machines, None)
            if n is None:
                yield passed(f"{where}: {_label(t)}: num_machines {shorten(machines)} is set at run time: not read",
                             **ev)
            elif n != pods:
                yield fail(f"{where}: {_label(t)} starts {pods} pods, accelerate's num_machines is {n} ({source})",
                           f"give --num_machines {pods}", num_machines=n, **ev)
            else:
                yield passed(f"{where}: {_label(t)}: {pods} pods, num_machines {n}", num_machines=n, **ev)
        else:
            world = t.env(c).get("WORLD_SIZE", "")
            said = f"; WORLD_SIZE is the operator's ({world or 'per pod'})" if "WORLD_SIZE" in t.injected else ""
            yield passed(f"{where}: {_label(t)}: {pods} pods running {cmd.launcher} {shorten(cmd.script, 40)}{said}",
                         **ev)
    if not found_any:
        yield skip(f"{m.path}: no container runs a launch (accelerate launch, torchrun, deepspeed, python SCRIPT)")


@check("CFG082", "k8s-gpus-per-pod", "config", tags=["kubernetes", "gpu"])
def gpus_per_pod(ctx) -> Iterator[Finding]:
    """The processes the launch starts in a pod (torchrun's nproc_per_node, accelerate's num_processes per
    machine) match the GPUs the pod asks for (its `nvidia.com/gpu` limit).

    The device plugin gives the container only the GPUs of its limit: more processes than that share GPUs or
    stop with 'invalid device ordinal'; fewer leave GPUs idle. `nproc_per_node: auto` (the operators'
    default) takes the GPUs the container sees.

    Make them equal: --nproc_per_node (or the PyTorchJob's nprocPerNode) the pod's nvidia.com/gpu limit.
    """
    m = _manifest(ctx)
    if m is None:
        yield skip(NO_MANIFEST)
        return
    any_launch = False
    for t, g, c in _launches(m, per_group=True):
        any_launch = True
        procs, how = _procs(ctx, t, c)
        n = manifests.gpus(c)
        where = m.where(t.line)
        ev = dict(file=m.path, kind=t.kind, name=t.name, container=c.name, processes=procs, gpus=n)
        if n is None:
            yield passed(f"{where}: {_label(t, g)}: the GPU limit is templated: not compared", **ev)
        elif n == 0:
            if "nproc_per_node gpu" in how:
                yield fail(f"{where}: {_label(t, g)}: {how} in a container that asks for no GPU: torchrun stops "
                           "with 'Cuda is not available'", "add resources.limits nvidia.com/gpu", **ev)
            else:
                yield passed(f"{where}: {_label(t, g)}: asks for no GPU ({how}): a CPU job", **ev)
        elif procs is None:
            yield passed(f"{where}: {_label(t, g)}: {n} GPU(s); {how}: not read", **ev)
        elif procs > n:
            yield fail(f"{where}: {_label(t, g)}: {procs} processes per pod ({how}) on the {n} GPU(s) its limit "
                       "gives", f"give {n} processes per pod, or nvidia.com/gpu: {procs}", **ev)
        elif procs < n and c.launch.command.launcher == "python":  # one process may use them all (its own code)
            yield passed(f"{where}: {_label(t, g)}: one process per pod ({how}) on {n} GPUs: how many it uses is its "
                         "own code (not judged)", **ev)
        elif procs < n:
            yield warn(f"{where}: {_label(t, g)}: {procs} process(es) per pod ({how}) on {n} GPUs: {n - procs} idle",
                       f"give {n} processes per pod (--nproc_per_node {n}), or ask for {procs} GPU(s)", **ev)
        else:
            yield passed(f"{where}: {_label(t, g)}: {procs} process(es) per pod on {n} GPU(s) ({how})", **ev)
    if not any_launch:
        yield skip(f"{m.path}: no container runs a launch")


@check("CFG083", "k8s-dev-shm", "config", tags=["kubernetes", "shm"])
def dev_shm(ctx) -> Iterator[Finding]:
    """A training pod mounts a memory-backed /dev/shm of a useful size (an emptyDir with medium: Memory).

    Without one the container runtime gives /dev/shm 64 MB. NCCL keeps shared memory between the ranks of a
    pod (its docs: it "may require" it; too small, it fails in ncclShmOpen or with 'No space left on device'),
    a warning for a pod of several GPUs; DataLoader workers share it too, which the manifest does not tell
    (one GPU or none: not judged). An emptyDir's sizeLimit caps it: under the profile's limit it fails.

    Add to the pod: volumes: [{name: dshm, emptyDir: {medium: Memory, sizeLimit: 16Gi}}] and to the
    container: volumeMounts: [{name: dshm, mountPath: /dev/shm}] (or hostIPC: true).
    """
    m = _manifest(ctx)
    if m is None:
        yield skip(NO_MANIFEST)
        return
    limits = ctx.plan.limits
    judged = False
    for t, g, c in _containers(m):
        if c.launch is None and not manifests.gpus(c):
            continue
        judged = True
        where = m.where(t.line)
        ev = dict(file=m.path, kind=t.kind, name=t.name, role=g.role, container=c.name)
        if not g.template_read:
            yield passed(f"{where}: {_label(t, g)}: the pod template is not in this file: /dev/shm not read",
                         **ev)
            continue
        if g.host_ipc:
            yield passed(f"{where}: {_label(t, g)}: hostIPC: the node's /dev/shm", **ev)
            continue
        volume = next((g.volumes.get(name) for path, name in c.mounts if path.rstrip("/") == "/dev/shm"),
                      None)
        empty = volume.get("emptyDir") if isinstance(volume, dict) else None
        if volume is None or (isinstance(empty, dict) and empty.get("medium") != "Memory"):
            # NCCL's shared-memory transport joins the GPUs of one pod: two or more of them need /dev/shm. One GPU, or
            # none (gloo over TCP), needs it only for DataLoader workers, which the manifest does not tell.
            gpus = manifests.gpus(c) or 0
            if gpus > 1:  # NCCL's docs: it "may require" shared memory; how much grows with the ranks of the pod
                yield warn(f"{where}: {_label(t, g)}: container {c.name} has no memory-backed /dev/shm: the "
                           f"runtime's 64 MB for the {gpus} GPUs of the pod, where NCCL (RCCL on AMD) keeps shared "
                           "memory between its ranks (too small, it fails in ncclShmOpen or with 'No space left on "
                           "device')",
                           "mount an emptyDir {medium: Memory, sizeLimit: 16Gi} at /dev/shm", gpus=gpus, **ev)
            else:
                yield passed(f"{where}: {_label(t, g)}: the runtime's 64 MB /dev/shm, {gpus} GPU(s) in the pod: no "
                             "NCCL shared memory between GPUs there; DataLoader workers, if the script starts any, "
                             "share it (not judged: the script is not in the manifest)", gpus=gpus, **ev)
            continue
        size = manifests.quantity_bytes(empty.get("sizeLimit")) if isinstance(empty, dict) else None
        problem = manifests.quantity_problem(empty.get("sizeLimit")) if isinstance(empty, dict) else None
        if problem is not None:  # bad input of the manifest: the API server refuses it
            yield fail(f"{where}: {_label(t, g)}: /dev/shm sizeLimit {problem}: the manifest is refused when applied",
                       "write sizeLimit as a quantity, such as 16Gi", **ev)
        elif isinstance(empty, dict) and empty.get("sizeLimit") is not None and size is None:
            yield passed(f"{where}: {_label(t, g)}: /dev/shm sizeLimit {shorten(empty.get('sizeLimit'))} "
                         "is templated: not compared", **ev)
        elif size is not None and size < limits.shm_fail_bytes:
            yield fail(f"{where}: {_label(t, g)}: /dev/shm sizeLimit {empty.get('sizeLimit')} is under "
                       f"{limits.shm_fail_bytes // 2**20} MiB", "raise sizeLimit (16Gi is common)",
                       size_bytes=size, **ev)
        elif size is not None and size < limits.shm_warn_bytes:
            yield warn(f"{where}: {_label(t, g)}: /dev/shm sizeLimit {empty.get('sizeLimit')} is under "
                       f"{limits.shm_warn_bytes // 2**20} MiB", "raise sizeLimit (16Gi is common)",
                       size_bytes=size, **ev)
        else:
            said = f"sizeLimit {empty.get('sizeLimit')}" if size is not None else \
                "no sizeLimit: up to the pod's memory limit" if isinstance(empty, dict) else "a volume"
            yield passed(f"{where}: {_label(t, g)}: /dev/shm memory-backed ({said})", size_bytes=size, **ev)
    if not judged:
        yield skip(f"{m.path}: no training container (a launch or GPUs)")


def _address(ctx, t, c) -> Tuple[Optional[str], str]:
    """The head's address the launch uses, and where it is given."""
    cmd = c.launch.command
    env = t.env(c)
    options = {"torchrun": ("rdzv_endpoint", "master_addr"), "accelerate": ("main_process_ip",),
               "deepspeed": ("master_addr",)}.get(cmd.launcher, ())
    for name in options:
        value, source = manifests.option(t, c, name)
        if value is not None:
            return (value.rsplit(":", 1)[0] if name == "rdzv_endpoint" else value), source
    if cmd.launcher == "accelerate" and _config(ctx).get("main_process_ip"):
        return str(_config(ctx)["main_process_ip"]), "the config's main_process_ip"
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"], "MASTER_ADDR" + (" (the operator's)" if "MASTER_ADDR" in t.injected else "")
    return None, ""


@check("CFG084", "k8s-rendezvous", "config", tags=["kubernetes", "multinode"])
def rendezvous(ctx) -> Iterator[Finding]:
    """Every pod reaches the same head: the address is the operator's, or a name a headless Service gives the
    head pod; and each pod takes its own node rank.

    A pod's `localhost`, `$(hostname)` or its own IP names each pod itself; a Service with a cluster IP
    load-balances to any pod, and pod DNS names (`pod.subdomain`) exist only under a headless Service
    (clusterIP: None). torchrun's static rendezvous without a node rank makes every pod node 0.

    Use the operator's MASTER_ADDR / PET_MASTER_ADDR (PyTorchJob, TrainJob, Volcano's pytorch plugin), a JobSet's
    `<jobset>-<job>-0-0.<subdomain>`, or a headless Service named as the pods' subdomain; give --node_rank from
    the pod's index (JOB_COMPLETION_INDEX), or use --rdzv_backend c10d.
    """
    m = _manifest(ctx)
    if m is None:
        yield skip(NO_MANIFEST)
        return
    services = {s.name: s for s in m.services}
    judged = False
    for t, g, c in _launches(m):
        pods = _job_pods(t)
        where = m.where(t.line)
        ev = dict(file=m.path, kind=t.kind, name=t.name, container=c.name, pods=pods)
        if pods is not None and pods < 2:
            continue
        judged = True
        host, source = _address(ctx, t, c)
        cmd = c.launch.command
        found = False
        if host is None:
            if cmd.launcher in ("torchrun", "accelerate", "deepspeed") and t.address is None:
                found = True
                yield fail(f"{where}: {_label(t)}: {pods or 'several'} pods and no head address: each launcher "
                           "takes 127.0.0.1, its own pod", "give --master_addr (or --rdzv_endpoint) the head pod's "
                           "DNS name under a headless Service", **ev)
        elif any(w in host for w in HOST_WORDS) or host in LOCAL:
            found = True
            yield fail(f"{where}: {_label(t)}: the head's address {shorten(host)} ({source}) is each pod's own",
                       "give the head pod's DNS name (<pod>.<headless service>) or the operator's MASTER_ADDR",
                       address=host, **ev)
        elif "$" not in host and "." in host and not manifests.is_templated(host):
            service = host.split(".")[1]
            known = services.get(service)
            if known is not None and not known.headless:
                found = True
                yield fail(f"{where}: {_label(t)}: {host} ({source}) names a pod under Service {service}, which has "
                           f"a cluster IP ({m.where(known.line)}): pod DNS names exist only under a headless Service",
                           f"set clusterIP: None on Service {service}", address=host, service=service, **ev)
        sub = manifests.subdomain(t)
        if not found and t.kind in ("Indexed Job", "StatefulSet") and sub:
            known = services.get(sub)
            if known is None:
                found = True
                yield warn(f"{where}: {_label(t)}: its pods' DNS names need the headless Service {sub}, which is not "
                           "in this file", f"add a Service {sub} with clusterIP: None selecting the pods (or check "
                           f"it exists: kubectl get service {sub})", service=sub, **ev)
            elif not known.headless:
                found = True
                yield fail(f"{where}: {_label(t)}: Service {sub} ({m.where(known.line)}) has a cluster IP: the pods "
                           "get DNS names only under a headless Service", f"set clusterIP: None on Service {sub}",
                           service=sub, **ev)
        if cmd.launcher == "torchrun":
            backend, _ = manifests.option(t, c, "rdzv_backend")
            rank, rank_source = manifests.option(t, c, "node_rank")
            env = t.env(c)
            per_pod = rank is not None and any(f"${n}" in rank or f"${{{n}}}" in rank for n, v in env.items()
                                               if v is None)
            if (backend or "static") == "static" and (rank is None or (rank.isdigit() and not per_pod)):
                found = True
                yield fail(f"{where}: {_label(t)}: torchrun's static rendezvous with "
                           + (f"--node_rank {rank} ({rank_source}) on every pod" if rank else "no node rank")
                           + ": every pod claims one rank", "give --node_rank $JOB_COMPLETION_INDEX (the pod's "
                           "index), or --rdzv_backend c10d", node_rank=rank, **ev)
        if not found:
            said = f"{shorten(host)} ({source})" if host else t.address
            yield passed(f"{where}: {_label(t)}: every pod reaches the head at {said}", address=host, **ev)
    if not judged:
        yield skip(f"{m.path}: no launch on more than one pod")


def _istio(g) -> Tuple[bool, object]:
    for where in (g.labels, g.annotations):  # Istio: the label, then the annotation
        if ISTIO in where:
            return True, where[ISTIO]
    return False, None


@check("CFG085", "k8s-sidecar", "config", tags=["kubernetes", "multinode"])
def sidecar(ctx) -> Iterator[Finding]:
    """No service-mesh sidecar sits in the training pods: Istio's `sidecar.istio.io/inject` is "false" where the
    namespace injects.

    An injected istio-proxy intercepts the pods' traffic: the rendezvous and NCCL connections fail or hang
    while the proxy starts, and the pod keeps running after training ends. Whether a namespace injects is its
    label (`istio-injection=enabled`), not in this file unless the Namespace is. Annotation values are strings:
    an unquoted `false` is refused by the API server.

    Set `sidecar.istio.io/inject: "false"` (quoted) in the pod template's annotations (or labels).
    """
    m = _manifest(ctx)
    if m is None:
        yield skip(NO_MANIFEST)
        return
    judged, unknown = False, []
    for t in m.trainings:
        if (t.pods or 0) < 2 and t.pods is not None:
            continue
        judged = True
        ns = t.namespace or "default"
        labels = m.namespaces.get(ns)
        injects = labels is not None and (labels.get("istio-injection") == "enabled" or "istio.io/rev" in labels)
        where = m.where(t.line)
        for g in t.groups:
            given, value = _istio(g)
            ev = dict(file=m.path, kind=t.kind, name=t.name, role=g.role, namespace=ns)
            if given and not isinstance(value, str):
                yield fail(f"{where}: {_label(t, g)}: {ISTIO}: {value!r} is not a string: the API server refuses the "
                           "manifest", f"quote it: {ISTIO}: \"false\"", value=repr(value), **ev)
            elif given and value.strip().lower() == "true":
                yield fail(f"{where}: {_label(t, g)}: {ISTIO} is \"true\": an istio-proxy sidecar intercepts the "
                           "rendezvous and NCCL traffic", f"set {ISTIO}: \"false\"", **ev)
            elif given:
                yield passed(f"{where}: {_label(t, g)}: {ISTIO} is {value!r}", **ev)
            elif injects:
                yield fail(f"{where}: {_label(t, g)}: namespace {ns} injects Istio's sidecar (its label, "
                           f"{m.path}) and the pods do not opt out", f"set {ISTIO}: \"false\" in the pod template",
                           **ev)
            elif not g.template_read:
                yield passed(f"{where}: {_label(t, g)}: the pod template is not in this file: not read", **ev)
            else:
                unknown.append(f"{_label(t, g)} (namespace {ns})")
    if unknown:  # whether the namespace injects is its label on the cluster: said once, not judged
        yield skip(f"{m.path}: no {ISTIO} on {', '.join(unknown[:4])}{' and more' if len(unknown) > 4 else ''}: "
                   "whether the namespace injects Istio's sidecar is its label on the cluster, not in this file "
                   f"(kubectl get namespace -L istio-injection): not judged", file=m.path)
    elif not judged:
        yield skip(f"{m.path}: no training resource of more than one pod")


@check("CFG086", "k8s-rdma", "config", tags=["kubernetes", "rdma"])
def rdma(ctx) -> Iterator[Finding]:
    """A pod that asks for InfiniBand/RoCE (an RDMA device resource, NCCL_IB_HCA) can use it: the devices, the
    locked memory RDMA registration needs, and NCCL not told to skip it.

    Without the RDMA resource (or privileged / hostNetwork) the container has no /dev/infiniband and NCCL falls
    back to sockets; without IPC_LOCK memory registration fails ('ibv_reg_mr failed', 'Cannot allocate
    memory'); NCCL_IB_DISABLE=1 turns the fabric off. AWS's Elastic Fabric Adapter (vpc.amazonaws.com/efa) is
    an RDMA device too, which NCCL reaches through the aws-ofi-nccl plugin, not its InfiniBand transport, on
    nodes that set the locked memory: neither of the last two rules applies to it.

    Ask for the device plugin's resource (e.g. rdma/rdma_shared_device_a: 1), add securityContext.capabilities
    add: [IPC_LOCK], and leave NCCL_IB_DISABLE unset.
    """
    m = _manifest(ctx)
    if m is None:
        yield skip(NO_MANIFEST)
        return
    judged = False
    for t, g, c in _containers(m):
        env = t.env(c)
        devices = manifests.rdma_resources(c)
        hca = env.get("NCCL_IB_HCA")
        if not devices and "NCCL_IB_HCA" not in env:
            continue
        judged = True
        where = m.where(t.line)
        ev = dict(file=m.path, kind=t.kind, name=t.name, role=g.role, container=c.name, resources=devices)
        found = False
        infiniband = [d for d in devices if d != manifests.EFA_RESOURCE]  # EFA: aws-ofi-nccl, memlock set by its nodes
        if infiniband and str(env.get("NCCL_IB_DISABLE", "")).strip() == "1":
            found = True
            yield fail(f"{where}: {_label(t, g)}: asks for {', '.join(infiniband)} and sets NCCL_IB_DISABLE=1: "
                       "NCCL uses sockets", "unset NCCL_IB_DISABLE", **ev)
        if infiniband and "IPC_LOCK" not in c.capabilities and not c.privileged:
            found = True
            yield fail(f"{where}: {_label(t, g)}: asks for {', '.join(infiniband)} without the IPC_LOCK "
                       "capability: RDMA memory registration fails (locked memory)", "add securityContext: "
                       "{capabilities: {add: [IPC_LOCK]}} to the container", **ev)
        if not devices and not c.privileged and not g.host_network:
            found = True
            yield fail(f"{where}: {_label(t, g)}: NCCL_IB_HCA={shorten(hca)} but the container asks for no "
                       "RDMA device: it has no /dev/infiniband, NCCL falls back to sockets",
                       "ask for the RDMA device plugin's resource (e.g. rdma/rdma_shared_device_a: 1)", **ev)
        if not found:
            yield passed(f"{where}: {_label(t, g)}: RDMA: {', '.join(devices) or 'privileged'}"
                         + (f", NCCL_IB_HCA={hca}" if hca else ""), **ev)
    if not judged:
        yield skip(f"{m.path}: no pod asks for RDMA (no RDMA resource, no NCCL_IB_HCA)")
