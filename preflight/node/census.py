"""The census of a running job on this node, for `preflight doctor`: its launchers and ranks, their job
variables, state, age and CPU time, their sockets, their Python stacks, the flight-recorder records they left, and
what NCCL's RAS says of them (preflight.node.ras).

Read only (the rules of preflight.node). /proc gives the processes and sockets; py-spy, run
as a program with --nonblocking, gives the stacks without stopping the process. Nothing is signalled,
written to or left behind: py-spy runs under a deadline and is killed past it.
"""
import json
import os
import subprocess
import threading
import time

from preflight.node import ncclconf, procfs
from preflight.node.host import py_spy
from preflight.node.launchfiles import accelerate_default_config, read_file
from preflight.node.packages import LIBNCCL, nccl_library_version
from preflight.node.secret import REDACTED, secret_name, secret_text

CENSUS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
              "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_MAX_RESTARTS", "CUDA_VISIBLE_DEVICES", "ACCELERATE_MIXED_PRECISION")
# PET_*: torchrun reads each option's default from PET_<OPTION> (torch/distributed/argparse_util.py, class env): a
# launcher without --master_addr is at 127.0.0.1 only when PET_MASTER_ADDR is not set. TORCH_FR_*: where a rank's
# flight recorder writes its records.
CENSUS_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "PET_", "TORCH_FR_")
# Words of a command line that make it a launcher agent of a torch job.
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
             "deepspeed.launcher.launch", "deepspeed.launcher.runner")
MAX_ARGS, MAX_ARG, MAX_SOCKETS, MAX_PROCESSES = 64, 200, 64, 256
# A launcher's command line is read by the head as its parser reads it (its ranks, its nodes, its port, the
# command that tells two jobs apart): sent whole up to 1,024 words and 64 KiB of JSON, a word up to the longest
# path (PATH_MAX), and the launchers of one census up to 8 MiB of JSON, well inside the head's longest line
# (remote.session.MAX_LINE); past any of these a launcher's line is cut where a word would not fit, and the
# words not sent are counted (argv_dropped).
MAX_LAUNCHER_ARGS, MAX_LAUNCHER_TEXT, MAX_LAUNCHER_ARG, MAX_LAUNCHERS_TEXT = 1024, 64 << 10, 4096, 8 << 20
# The user:password@ of a URL (https://user:hunter2@host/x) and Hugging Face tokens, hidden on the node before
# an argument or a value is cut: a cut inside the password leaves no "@" for the head's rule to find. The head
# redacts again (preflight.report.redact, the same patterns).
# Sockets the checks read first when a process holds more than MAX_SOCKETS: who listens, and who waits to connect.
SOCKET_ORDER = {"LISTEN": 0, "SYN_SENT": 1}


def take_census(options):
    """{"processes": [...], "listeners": [...], "stacks": how they were read, ...} of the job processes on
    this node. options: port (the master port, to pick one job and its listeners), pids (only these and
    their children), stacks (run py-spy), py_spy (its path, else found on PATH or beside this python),
    deadline_s (for the whole census)."""
    started = time.monotonic()
    deadline = started + float(options.get("deadline_s") or 10)
    port = options.get("port")
    own_net = procfs.namespace("self", "net")
    ticks = os.sysconf("SC_CLK_TCK")
    boot = procfs.boot_time()
    sockets = procfs.tcp_sockets()
    table, elsewhere = {}, 0
    for pid in procfs.pids():
        info = _process(pid, ticks, boot)
        if info is None:
            continue
        if own_net is not None and procfs.namespace(pid, "net") not in (own_net, None):
            elsewhere += 1  # another network namespace: a container, or another test host
            continue
        table[pid] = info
    chosen, job = _job_processes(table, options.get("pids"), port)
    processes, launchers_text, conf_files, nccl_environ = [], [0], {}, {}
    for pid in chosen[:MAX_PROCESSES]:
        info = table[pid]
        if info["kind"] == "rank":  # what NCCL's files add to its environment: NCCL reads them in the rank
            nccl_environ[pid], sources, unread = _nccl_environ(pid, conf_files)
            if sources and info["env"] is not None:
                info["env"].update((name, nccl_environ[pid][name][:MAX_ARG]) for name in sources)
                info["nccl_from"] = sources
            if unread:
                info["nccl_unread"] = list(unread)[:8]
        info["sockets"], info["sockets_dropped"] = _sockets_of(pid, sockets)
        info["children"] = [p for p, other in table.items() if other["ppid"] == pid]
        inner = _own_pid(pid)
        if inner is not None and inner != pid:  # in a PID namespace of its own (a container): NCCL's RAS names this
            info["own_pid"] = inner
        if info["kind"] == "launcher":
            words = procfs.argv(pid)
            if words:  # else it has just ended: what was read first stands
                kept = _launcher_words(words, launchers_text)
                info["argv"], info["argv_dropped"] = shown_argv(kept, MAX_LAUNCHER_ARG), len(words) - len(kept)
            if "accelerate" in " ".join(info["argv"][:4]):
                info["config"] = _accelerate_config(pid, info["argv"])
        processes.append(info)
    listeners = []
    if port:
        for pid, info in table.items():
            if pid in job:  # the job's own (those --pid left out too): not another holder of its port
                continue
            held = [s for s in _sockets_of(pid, sockets)[0] if s["state"] == "LISTEN" and s["local_port"] == port]
            if held:
                listeners.append({"pid": pid, "argv": info["argv"], "argv_dropped": info["argv_dropped"],
                                  "age_s": info["age_s"], "env": _job_env(pid)})
    ras = _ras(processes, options, deadline, nccl_environ)  # its two queries, a second apart, while the rest is read
    records = _flight_records(processes, options, deadline)  # before the stacks: their sampling takes the time left
    stacks = _stacks(processes, options, deadline) if options.get("stacks", True) else {"skipped": "not asked"}
    cpu_before = {p["pid"]: p["cpu_s"] for p in processes}
    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    for p in processes:  # CPU use over the census: a rank spinning in NCCL against one at 0%
        again = _process(p["pid"], ticks, boot)
        p["cpu_percent"] = None if again is None else round(
            100.0 * (again["cpu_s"] - cpu_before[p["pid"]]) / max(0.05, time.monotonic() - started), 1)
    # What was cut is said, so that the head never reads a cut list as the whole of it.
    return {"nccl_ras": ras(), "processes": processes, "processes_dropped": max(0, len(chosen) - MAX_PROCESSES),
            "listeners": listeners, "stacks": stacks, "elsewhere": elsewhere, "port": port, "flight_recorder": records,
            "pids": sorted(int(p) for p in options.get("pids") or ()),
            "seconds": round(time.monotonic() - started, 3), "ptrace_scope": procfs.ptrace_scope(), "uid": os.getuid()}


def _flight_records(processes, options, deadline):
    """The flight-recorder dumps on this node (preflight.node.flightrec): at doctor's --flight-recorder PREFIX,
    else where each rank of the job writes them; {"skipped": why} when there is neither."""
    ranks = []
    for p in processes:
        if p["kind"] == "rank":
            environ = procfs.environ(p["pid"]) or {}
            ranks.append((p["pid"], environ, _int(environ.get("RANK"))))
    if not options.get("flight_recorder") and not ranks:
        return {"skipped": "no rank of a job on this node and no --flight-recorder"}
    from preflight.node import flightrec  # only doctor reads dumps

    started = dict((p["pid"], time.time() - p["age_s"]) for p in processes if p.get("age_s") is not None)
    return flightrec.collect(options.get("flight_recorder"), ranks, started, deadline - 2.0)


def _nccl_environ(pid, cache):
    """(environment, sources, unread) of a rank as its NCCL reads it (preflight.node.ncclconf.merge): its own
    environment, then NCCL's files as its HOME, NCCL_CONF_FILE, user and working folder name them, each file read
    once per node (`cache`), by the rules of the NCCL release the rank loaded (rank_nccl), else by what every
    release agrees on."""
    environ = procfs.environ(pid) or {}
    try:
        uid = os.stat("/proc/%d" % pid).st_uid
    except OSError:
        uid = None
    cwd = procfs.link("/proc/%d/cwd" % pid)
    # its mount namespace too: ranks in different containers see different files at the same path
    key = (environ.get("HOME"), environ.get("NCCL_CONF_FILE"), uid, cwd, procfs.link("/proc/%d/ns/mnt" % pid))
    if key not in cache:
        cache[key] = ncclconf.facts(environ, uid, cwd, pid)
    values, sources, unread = ncclconf.merge(environ, cache[key])  # what every release agrees on
    if not unread:  # nearly every rank: nothing depends on its NCCL's release
        return values, sources, unread
    library, version = rank_nccl(pid)
    release = _release(version) if version else None
    if release is not None:
        return ncclconf.merge(environ, cache[key], release)
    return values, sources, unread + ("NCCL's release: %s" % (library or "no libnccl is loaded in the rank"),)


def rank_nccl(pid):
    """(the libnccl a rank has loaded as its /proc/PID/maps names it, its version or None): the version only where
    its own files prove it (preflight.node.packages.nccl_library_version), read in the rank's own root folder;
    None too where it maps more than one NCCL, or none."""
    deleted = " (deleted)"  # replaced since it was loaded (an upgrade): its version is no longer on disk
    libraries = [p for p in procfs.mapped_files(pid)
                 if LIBNCCL.match(os.path.basename(p[:-len(deleted)] if p.endswith(deleted) else p))]
    if not libraries:
        return None, None
    versions = set(nccl_library_version(p, "/proc/%d/root" % pid) for p in libraries)
    version = versions.pop() if len(versions) == 1 else None
    said = ", ".join(libraries[:2])
    return (said if version else "%s, whose version its files do not tell" % said), version


def _release(version):
    """(2, 21, 5) of "2.21.5"; None where it is no such number."""
    try:
        return tuple(int(part) for part in version.split(".")[:3])
    except ValueError:
        return None


def _ras(processes, options, deadline, nccl_environ):
    """NCCL's RAS where the job's ranks run it (preflight.node.ras), asked in a thread of its own; returns the
    function that waits for its answer (until the deadline) and gives it. `nccl_environ`: each rank's
    environment as NCCL reads it (NCCL_RAS_ADDR may come from ~/.nccl.conf)."""
    ranks = [(p["pid"], nccl_environ.get(p["pid"]) or procfs.environ(p["pid"]) or {}) for p in processes
             if p["kind"] == "rank"]
    if not ranks:
        return lambda: {"skipped": "no rank of a job on this node"}
    if options.get("ras") == "first" and not any(_first_nodes(env) for _, env in ranks):
        return lambda: {"skipped": "asked on the job's first two nodes only (RAS answers for the whole job)"}
    from preflight.node import ras  # only doctor asks RAS

    found = []

    def ask():
        try:
            found.append(ras.collect(ranks, deadline - 0.5, float(options.get("interval_s", 1.0))))
        except Exception as exc:  # the rest of the census stands
            found.append({"error": "NCCL RAS could not be asked: %s: %s" % (type(exc).__name__, exc)})
    worker = threading.Thread(target=ask)
    worker.daemon = True  # bounded by its deadline: it never outlives the agent by more
    worker.start()

    def answer():
        worker.join(max(0.0, deadline - time.monotonic()))
        return found[0] if found else {"error": "NCCL RAS was still being asked when the census's time ran out"}
    return answer


def _int(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _process(pid, ticks, boot):
    """argv, state, parent, age and CPU seconds of one process (None when it is gone or unreadable)."""
    words = procfs.argv(pid)
    fields = procfs.stat_fields(pid)
    if not words or not fields:
        return None
    argv, dropped = shown_argv(words[:MAX_ARGS]), max(0, len(words) - MAX_ARGS)
    try:
        state, ppid = fields[0].decode(), int(fields[1])
        cpu = (int(fields[11]) + int(fields[12])) / float(ticks)
        start = int(fields[19]) / float(ticks)
    except (IndexError, ValueError):
        return None
    age = round(time.time() - (boot + start), 1) if boot else None
    return {"pid": pid, "ppid": ppid, "argv": argv, "argv_dropped": dropped, "state": state, "cpu_s": round(cpu, 2),
            "age_s": age}


def _launcher_words(words, spent):
    """The first words of a launcher's command line that fit: MAX_LAUNCHER_ARGS of them, none longer than
    MAX_LAUNCHER_ARG (a word is sent whole or not at all: the head parses what it gets), MAX_LAUNCHER_TEXT of
    JSON, and MAX_LAUNCHERS_TEXT with what the census's launchers before it took (spent[0], added to), past
    the first four words (those that name the launcher)."""
    kept, size = [], 0
    for word in words[:MAX_LAUNCHER_ARGS]:
        cost = len(json.dumps(secret_text(word))) + 2  # as the agent writes it (ensure_ascii), and ", "
        over_census = len(kept) >= 4 and spent[0] + size + cost > MAX_LAUNCHERS_TEXT
        if len(word) > MAX_LAUNCHER_ARG or size + cost > MAX_LAUNCHER_TEXT or over_census:
            break
        kept.append(word)
        size += cost
    spent[0] += size
    return kept


def shown_argv(words, limit=MAX_ARG):
    """A command line as the node sends it: secrets redacted first, then each argument cut to `limit` (an empty
    argument stays, as the launcher's parser reads it). The value of an option or NAME=value whose name looks secret
    (--token X, --password=X, HF_TOKEN=X), URL credentials and Hugging Face tokens become <redacted>."""
    shown, hide_next = [], False
    for word in words:
        if hide_next and word and not word.startswith("-"):
            shown.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        name, has_value, _ = word.partition("=")
        if secret_name(name) and (word.startswith("-") or has_value):
            hide_next = not has_value and word.startswith("-")
            shown.append(name + "=" + REDACTED if has_value else word)
            continue
        shown.append(secret_text(word)[:limit])
    return shown



def _job_env(pid):
    """The job's variables of a process (None when /proc/PID/environ cannot be read); secrets redacted."""
    environ = procfs.environ(pid)
    if environ is None:
        return None
    return dict((name, REDACTED if secret_name(name) else secret_text(value)[:MAX_ARG]) for name, value in environ.items()
                if name in CENSUS_ENV or name.startswith(CENSUS_PREFIXES))


def _accelerate_config(pid, argv):
    """The accelerate config a running `accelerate launch` read: its --config_file (from its working
    directory), else the default under its own HF_HOME / XDG_CACHE_HOME / HOME."""
    cwd = procfs.link("/proc/%d/cwd" % pid) or "/"
    named = None
    for i, word in enumerate(argv):
        if word in ("--config_file", "--config-file") and i + 1 < len(argv):
            named = argv[i + 1]
        elif word.startswith(("--config_file=", "--config-file=")):
            named = word.split("=", 1)[1]
    if named:
        return read_file(named, cwd, True)
    path = accelerate_default_config(procfs.environ(pid) or {})
    return dict(read_file(path, cwd, True), default=True)


def _is_launcher(argv):
    words = [os.path.basename(a) for a in argv[:4]]
    if any(w in ("torchrun", "deepspeed") for w in words):
        return True
    if "accelerate" in words and "launch" in argv[:4]:
        return True
    return any(a in LAUNCHERS for a in argv[:4])


def _job_processes(table, pids, port):
    """The pids of the job's launchers and ranks. A rank is a process its launcher started (the launcher's
    child), or, with no launcher above it, a process with a rank's variables; the processes below a rank
    (DataLoader workers, which inherit RANK) are its helpers, not ranks. With `pids`, only those and their
    descendants; with `port`, every launcher (the head reads the port each one really uses from its
    flags and config file, preflight.job.running) and the ranks that MASTER_PORT or their launcher put
    on that port. Returns (those pids, every pid of the job before `pids` chose among them)."""
    launchers = set(pid for pid, info in table.items() if _is_launcher(info["argv"]))
    envs = {}

    def env(pid):
        if pid not in envs:
            envs[pid] = _job_env(pid)
        return envs[pid]

    def has_rank_env(pid):
        found = env(pid)
        return bool(found) and ("RANK" in found or "TORCHELASTIC_RUN_ID" in found)

    def rank_above(pid):  # a launcher, or a Python process with a rank's variables (a rank, whose helper this is)
        return pid in launchers or pid in table and has_rank_env(pid) and \
            os.path.basename(table[pid]["argv"][0]).startswith("python")

    children = {}
    for pid, info in table.items():
        children.setdefault(info["ppid"], []).append(pid)

    def wraps_a_rank(pid):  # `RANK=0 bash run.sh`: the shell handed its rank's variables to the rank it started
        rank = env(pid).get("RANK")
        return not os.path.basename(table[pid]["argv"][0]).startswith("python") and \
            any((env(child) or {}).get("RANK") == rank for child in children.get(pid, ()))

    chosen = []
    for pid, info in table.items():
        if pid in launchers:
            kind = "launcher"
        elif info["ppid"] in launchers:
            kind = "rank"
        elif has_rank_env(pid) and not _ancestor(pid, table, rank_above) and not wraps_a_rank(pid):
            kind = "rank"
        else:
            continue
        info["kind"] = kind
        info["env"] = env(pid)
        chosen.append(pid)
    if port:
        chosen = [p for p in chosen if table[p]["kind"] == "launcher" or table[p]["ppid"] in launchers
                  or (table[p]["env"] or {}).get("MASTER_PORT") == str(port)]
    job = set(chosen)
    if pids:
        wanted = set(int(p) for p in pids)
        chosen = [p for p in chosen if p in wanted or _ancestor(p, table, lambda q: q in wanted)]
    return chosen, job


def _ancestor(pid, table, test):
    """Whether a process above `pid` (its parent, theirs, ...) passes `test`."""
    seen = 0
    while pid in table and seen < 64:
        pid, seen = table[pid]["ppid"], seen + 1
        if test(pid):
            return True
    return False


def _sockets_of(pid, sockets):
    """(the process's TCP sockets, listeners and pending connections first, at most MAX_SOCKETS; how many
    more it holds)."""
    found = [sockets[inode] for inode in procfs.socket_inodes(pid) if inode in sockets]
    found.sort(key=lambda s: SOCKET_ORDER.get(s["state"], 2))
    return found[:MAX_SOCKETS], max(0, len(found) - MAX_SOCKETS)


def _stacks(processes, options, deadline):
    """Each process's Python stack through `py-spy dump --json --nonblocking`, in parallel, bounded; taken
    twice, `interval_s` apart, so that a process seen at the same place both times is `stable` (stuck there,
    not passing through)."""
    tool = py_spy(options.get("py_spy"))
    if tool is None:
        return {"error": "py-spy is not installed on this node (pip install py-spy in the training environment)"}
    samples = max(1, int(options.get("samples", 2)))
    results = {}
    for sample in range(samples):
        if sample:
            time.sleep(max(0.0, min(float(options.get("interval_s", 1.0)), deadline - time.monotonic() - 1.0)))
        _sample(tool, processes, deadline, results, first=sample == 0)
    for info in processes:
        info.pop("_waits", None)  # the first sample's count: compared, not reported
    failed = [r["error"] for r in results.values() if "error" in r]
    return {"tool": tool, "read": sum(1 for r in results.values() if r.get("ok")), "failed": len(failed),
            "error": failed[0] if failed else None, "samples": samples}


def _sample(tool, processes, deadline, results, first):
    def dump(info):
        left = deadline - time.monotonic()
        if left <= 0.2:
            results.setdefault(info["pid"], {"error": "no time left for py-spy"})
            return
        try:
            proc = subprocess.Popen([tool, "dump", "--json", "--nonblocking", "--pid", str(info["pid"])],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        except OSError as exc:
            results[info["pid"]] = {"error": "py-spy cannot run: %s" % exc}
            return
        try:
            out, err = proc.communicate(timeout=min(left, 8.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            results.setdefault(info["pid"], {"error": "py-spy did not answer in time"})
            return
        if proc.returncode != 0:
            if first:
                results[info["pid"]] = {"error": err.decode("utf-8", "replace").strip()[-300:] or
                                        "exit %d" % proc.returncode}
            return
        try:
            threads = json.loads(out.decode("utf-8", "replace"))
        except ValueError:
            results.setdefault(info["pid"], {"error": "py-spy's answer is not JSON"})
            return
        threads = [{"name": t.get("thread_name"), "active": t.get("active"),
                    "frames": [[f.get("name"), f.get("filename"), f.get("line")] for f in (t.get("frames") or [])[:48]]}
                   for t in (threads if isinstance(threads, list) else [])[:16] if isinstance(t, dict)]
        if first:
            info["threads"] = threads
            info["stable"] = None
            info["_waits"] = _waits(info["pid"])
            results[info["pid"]] = {"ok": True}
        elif "threads" in info:
            # Still: the same frames both times, and its main thread neither blocked nor woke in between (a
            # loop that sleeps or waits between steps wakes many times a second and may show the same frames).
            waits = _waits(info["pid"])
            info["stable"] = _main_frames(info["threads"]) == _main_frames(threads) and \
                waits is not None and waits == info.pop("_waits", None)
            info["threads"] = threads

    workers = [threading.Thread(target=dump, args=(p,)) for p in processes if p["state"] not in ("Z", "X")]
    for worker in workers:
        worker.daemon = True
        worker.start()
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))


def _first_nodes(environ):
    """Whether a rank runs on the job's node 0 or 1: torchrun's GROUP_RANK (its node rank), else RANK 0."""
    group = environ.get("GROUP_RANK")
    return group in ("0", "1") if group is not None else environ.get("RANK") == "0"


def _own_pid(pid):
    """The pid a process sees for itself: the last of NSpid in /proc/PID/status (its innermost PID namespace)."""
    raw = procfs.read("/proc/%d/status" % pid)
    for line in (raw or b"").decode("ascii", "replace").splitlines():
        if line.startswith("NSpid:"):
            found = line.split()[1:]
            return int(found[-1]) if found and found[-1].isdigit() else None
    return None


def _waits(pid):
    """How often the process's main thread has blocked and been woken (voluntary context switches)."""
    raw = procfs.read("/proc/%d/task/%d/status" % (pid, pid))
    for line in (raw or b"").decode("ascii", "replace").splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return None


def _main_frames(threads):
    main = [t for t in threads if t.get("name") == "MainThread"] or threads[:1]
    return main[0]["frames"] if main else None
