"""The all-reduce worker: one per node, shipped like the agent and run by the node's training interpreter.

Stdlib only at the top level: torch is imported lazily, by each rank's own process. The node process
forks one process per local rank (before anything imports torch), watches them, and writes exactly one
line of JSON on stdout when every rank has finished, failed, been killed at the deadline or aborted:

    {"ok": bool, "host": hostname, "elapsed_s": F, "aborted": bool,
     "ranks": [{"rank", "local_rank", "ok", "stage", "kind", "error", "import_s", "init_s", "torch",
                "sizes": [{"bytes", "iters", "time_s", "algbw_gbps", "busbw_gbps", "mismatches"}],
                "skipped_sizes": [bytes...], "check": {"ok", "expected", "mismatches", "first"},
                "joined": [ranks that reached the store] or null, "tail": last output of the rank or null,
                "nccl": {"lines": [NCCL's INFO lines about the network], "debug": the user's NCCL_DEBUG or null}
                        (with nccl, on local rank 0 only),
                "pairs": [{"round", "peer" (a node index), "ok", "stage", "error", "gbps", "time_s", "connect_s",
                           "retest": true for a link measured again alone after the rounds}],
                "pairs_s": F (with options["pairs"], on local rank 0 only)}]}

stage is where the rank was (import, store, init, sweep, done); kind says how it failed: import
(torch cannot be imported), timeout, error, clash (the port is another run's), died (the process
ended without a result), killed (still running at the hard deadline), aborted (the controller asked to
stop), wrong-values (the reduced values differ from the exact expected sum). Nothing is parsed out of
logs: each rank sends its stage and its result over a pipe; its stdout and stderr (torch's, gloo's,
NCCL's) go to a file whose tail is attached to a failing rank. With nccl the ranks run with NCCL_DEBUG=INFO
and NCCL_DEBUG_SUBSYS=INIT,NET (unless the user's environment sets NCCL_DEBUG), and local rank 0's lines
that name the network are sent as they are, for the head to read (preflight.collective.nccllog).

Its program is `main(options)`. options: master_addr, master_port, world_size, ranks (the global ranks of this
node, in local-rank order), backend (gloo or nccl), sizes (bytes), timeout_s (the cap on the store,
init and collective timeouts), budget_s (seconds after start at which every rank is killed), env
(variables for the ranks), target_s (time spent timing each size), max_iters, run (this run's token);
pairs (the pairwise phase: {"rounds": [[[a, b], ...], ...] of node indices, "bytes", "reps", "rep_s"}, run by
local rank 0 at the rendezvous, see _pair_rounds) and mode "pairs" (that phase alone: no whole group).

Two runs at once (two users, a prolog and a user) may pick the same port: rank 0 writes the run's token
into its store, the other ranks use a store only once they have read their own token there (kind clash
when another run's store holds the port until the deadline, or rank 0 cannot bind it), and every key of
the run lives under that token, so a rank of another run is never counted.

With options["progress"], lines of progress come before the report, one each time the node's slowest rank
moves on (to the rendezvous, to the next size; never per iteration, so at most 1 + len(sizes) of them):

    {"progress": {"rank": the slowest rank, "stage": "rendezvous" or "sweep", "size": 1-based index of the
                  size being run (0 at the rendezvous), "sizes": how many sizes}}

A line "abort" on stdin, or the end of stdin (the controller closed the session), kills the ranks at once.
"""
import datetime
import json
import os
import select
import signal
import socket
import sys
import tempfile
import time
import traceback

from preflight.node import pairlinks

TAIL_CHARS = 1500
RUN_KEY = "preflight/run"  # outside every run's prefix: whose store this is
JOIN_KEY = "joined/%d"  # under the run's prefix, as every key of the run
OWNER_WAIT_S = 2.0  # a store that is ours has the token within moments of accepting connections
REPORT_S = 0.5  # a rank that waits for the store gives up this long before the deadline, to send its result
# With NCCL: what NCCL says it chose for the network (its INIT and NET INFO lines), for COL003. Only the lines
# that name the network are kept, few and short (the node's answer is one capped line); the head parses them.
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
NCCL_WORDS = ("NET/", "Using network", "NCCL version", "GPU Direct", "Plugin Path")
NCCL_MAX_LINES, NCCL_LINE_CHARS, NCCL_READ_BYTES = 40, 300, 8 << 20
# Links measured again alone after the rounds, at most MAX_RETESTS or one per node: a fault is one link or a few
# (a whole row is a straggler, not retested), while busy hosts can make many look slow (2 to 15 of 66 at 12
# loopback nodes on 2 busy cores, 25 of 120 at 16 test hosts). One pair alone costs no more than a round of N/2
# pairs, so N retests at most about double the rounds' N-1; each is tried only with RETEST_S left for it.
# Beyond, a suspect is judged from its round, as without retests.
MAX_RETESTS = 16
RATES_S = 3.0  # how long the head's rank 0 waits for every node's rates after the rounds, at most
RETEST_S = 1.0  # the time left each retest needs to be tried: as a round, a second at least (a dead pair all)
# A retest times more round trips than a round (the best counts): alone, a pair still shares its hosts' cores
# with whatever else runs there, and more tries find a moment they are free. Cheap: a healthy round trip takes
# a millisecond, and a slow link stops at RETEST_REP_S.
RETEST_REPS, RETEST_REP_S = 32, 0.3


class Clash(Exception):
    """The rendezvous port is another run's (or another process's)."""


def _now():
    return time.monotonic()


# --- one rank, in its own process ---------------------------------------------------------------

def run_rank(rank, local_rank, options, report, deadline):
    """Import torch, rendezvous, sweep the sizes; returns the rank's result dict."""
    result = {"rank": rank, "local_rank": local_rank, "ok": False, "stage": "import", "kind": None,
              "error": None, "import_s": None, "init_s": None, "torch": None, "sizes": [],
              "skipped_sizes": [], "check": None, "joined": None}
    world = int(options["world_size"])
    cap = float(options["timeout_s"])

    def stage(name):
        result["stage"] = name
        report({"stage": name})

    def timeout_left(margin=1.0):
        return max(1.0, min(cap, deadline - _now() - margin))

    started = _now()
    try:
        import torch
        import torch.distributed as dist
    except BaseException as exc:  # ImportError, or anything a broken install raises on import
        traceback.print_exc()  # into the rank's output, whose tail goes with the result
        result.update(kind="import", error="cannot import torch: %s: %s" % (type(exc).__name__, exc))
        return result
    result["import_s"] = round(_now() - started, 3)
    result["torch"] = getattr(torch, "__version__", None)
    store = None
    store_timeout = op_timeout = cap
    stage_started = _now()
    try:
        stage("store")
        token, port = str(options.get("run") or ""), int(options["master_port"])
        store_timeout = max(1.0, deadline - _now() - 1.0)
        if rank == 0:  # the previous run's rank 0 may still be closing its listener
            if not _wait_until_bindable(port, min(_now() + 3.0, deadline - 2.0)):
                raise Clash("port %d on the head is in use by another process (another preflight run, or a "
                            "job)" % port)
            store = dist.TCPStore(options["master_addr"], port, world, True,
                                  timeout=datetime.timedelta(seconds=store_timeout), wait_for_workers=False)
            store.set(RUN_KEY, token)
        else:  # as long as the budget allows: the head may import torch later
            store = _join(dist, options, token, deadline)
        store = dist.PrefixStore("preflight/%s/" % token, store)
        store.set(JOIN_KEY % rank, socket.gethostname())
        stage_started = _now()
        alone = options.get("mode") == "pairs"  # the pairwise phase alone: no group of the whole world to meet
        if options.get("pairs") and local_rank == 0:
            # At the rendezvous, before the whole group's init: a dead link between two nodes makes gloo's init
            # (it connects every pair of ranks) hang, and the pairs have been measured by then. In a full run
            # they take at most half the time left; the sweep follows.
            stage("pairs")
            until = deadline - 1.0 if alone else _now() + (deadline - _now()) / 2
            result["pairs"] = _pair_rounds(torch, dist, store, options, rank, until, report)
            result["pairs_s"] = round(_now() - stage_started, 3)
            stage_started = _now()
        if alone:
            stage("done")
            result["ok"] = True
            return result
        stage("init")
        backend = options["backend"]
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
            sync = torch.cuda.synchronize
        else:
            device = torch.device("cpu")

            def sync():
                return None
        op_timeout = timeout_left()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=op_timeout))
        result["init_s"] = round(_now() - stage_started, 3)
        stage_started = _now()
        stage("sweep")
        _sweep(torch, dist, options, result, device, sync, rank, world, deadline - 1.0, report)
        op_timeout = timeout_left()
        dist.destroy_process_group()
        stage("done")
        mismatches = result["check"]["mismatches"]
        if mismatches:
            result.update(kind="wrong-values", error="%d reduced value(s) differ from the exact sum %s (first: %s)"
                          % (mismatches, result["check"]["expected"], result["check"]["first"]))
        else:
            result["ok"] = True
    except BaseException as exc:
        traceback.print_exc()
        elapsed = _now() - stage_started
        limit = store_timeout if result["stage"] == "store" else op_timeout
        in_use = result["stage"] == "store" and "EADDRINUSE" in str(exc)  # rank 0 lost a race for the port
        result["kind"] = "clash" if isinstance(exc, Clash) or in_use else \
            "timeout" if isinstance(exc, TimeoutError) or elapsed >= 0.9 * limit else "error"
        result["error"] = (str(exc) if isinstance(exc, Clash) else "%s: %s" % (type(exc).__name__, exc))[:600]
        result["elapsed_in_stage_s"] = round(elapsed, 3)
    if not result["ok"] and store is not None:
        result["joined"] = _joined(store, world)
    return result


def _wait_until_bindable(port, until):
    """True once the port can be bound (as TCPStore binds it), False when it is still taken at `until`."""
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", port))
            return True
        except OSError:
            if _now() >= until:
                return False
            time.sleep(0.1)
        finally:
            sock.close()


def _join(dist, options, token, deadline):
    """A client of the store at the master's address once it is this run's (it holds our token); another
    run's store is left alone and tried again until the deadline (Clash then, TimeoutError when none came)."""
    address, port, world = options["master_addr"], int(options["master_port"]), int(options["world_size"])
    foreign = None
    while True:
        left = deadline - _now() - REPORT_S
        if left <= 0:
            if foreign is None:
                raise TimeoutError("no store at %s:%d before the deadline" % (address, port))
            raise Clash(foreign)
        # A plain connect first: a store client retries a refused connect only a second or more later, which
        # a short run (a bisect's) cannot afford while the head's rank 0 is still importing torch.
        if not _accepts(address, port, min(1.0, left)):
            time.sleep(0.05)
            continue
        # In slices: a listener that is not a store (another run's port probe) keeps a client until its timeout.
        try:  # wait_for_workers=False: a client that counts itself would write into another run's store
            store = dist.TCPStore(address, port, world, False, timeout=datetime.timedelta(seconds=min(5.0, left / 3)),
                                  wait_for_workers=False)
        except Exception:  # gone again, or not a store
            time.sleep(0.1)
            continue
        owner = _owner(store, min(_now() + OWNER_WAIT_S, deadline - REPORT_S))
        if owner == token:  # from here on the store waits (for ranks still importing torch) up to the deadline
            store.set_timeout(datetime.timedelta(seconds=max(1.0, deadline - _now() - 1.0)))
            return store
        foreign = ("the rendezvous at %s:%d is held by another preflight run (its token is not this run's)"
                   % (address, port) if owner else "the rendezvous at %s:%d is held by another process (a store "
                   "without this run's token: another preflight run, or a job)" % (address, port))
        del store
        time.sleep(0.3)


def _accepts(address, port, timeout):
    """Whether something accepts TCP connections at address:port within `timeout` seconds."""
    try:
        socket.create_connection((address, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _owner(store, until):
    """The run token in a store, or None when none comes by `until`."""
    while True:
        try:
            if store.check([RUN_KEY]):
                return store.get(RUN_KEY).decode("utf-8", "replace")
        except Exception:
            return None
        if _now() >= until:
            return None
        time.sleep(0.05)


def _joined(store, world):
    joined = []
    try:
        for rank in range(world):
            if store.check([JOIN_KEY % rank]):
                joined.append(rank)
    except Exception:
        return None
    return joined


def _sweep(torch, dist, options, result, device, sync, rank, world, deadline, report):
    """Every size: check the exact sum once, then time a few all-reduces. Every decision that changes
    how many collectives run (stop for lack of time, the iteration count) is agreed on with MAX."""
    expected = world * (world + 1) / 2.0  # each rank contributes rank + 1: exact in float32
    factor = 2.0 * (world - 1) / world
    target = float(options.get("target_s") or 0.5)
    max_iters = int(options.get("max_iters") or 20)
    min_iters = min(max_iters, 3)
    check = {"ok": True, "expected": expected, "mismatches": 0, "first": None}
    result["check"] = check
    per_byte = None
    agree = torch.zeros(2, device=device)
    sizes = [int(s) for s in options["sizes"]]
    for index, size in enumerate(sizes):
        report({"stage": "sweep", "size": index + 1})  # to the node process: one message per size
        numel = max(1, size // 4)
        nbytes = numel * 4
        predicted = per_byte * nbytes * 2 if per_byte is not None else 0.0
        agree.zero_()
        agree[0] = 1.0 if _now() + predicted > deadline else 0.0
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)
        if agree[0].item() > 0:
            result["skipped_sizes"] = [max(1, s // 4) * 4 for s in sizes[index:]]
            break
        buf = torch.full((numel,), float(rank + 1), dtype=torch.float32, device=device)
        sync()
        t = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        warm = time.perf_counter() - t
        wrong = buf != expected
        mismatches = int(wrong.sum().item())
        if mismatches:
            first = int(wrong.nonzero()[0].item())
            check["ok"] = False
            check["mismatches"] += mismatches
            if check["first"] is None:
                check["first"] = {"bytes": nbytes, "index": first, "value": float(buf[first].item())}
        agree.zero_()
        agree[0] = warm
        agree[1] = -(deadline - _now())  # MAX of the negated: the least time any rank has left
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)
        warm, left = max(float(agree[0].item()), 1e-9), -float(agree[1].item())
        iters = max(min_iters, min(max_iters, int(target / warm)))
        iters = max(1, min(iters, int(left / warm) - 1))
        buf.zero_()  # zeros stay zeros: the timed loop cannot overflow
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        elapsed = time.perf_counter() - t
        agree.zero_()
        agree[0] = elapsed
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
        per_iter = max(float(agree[0].item()), 1e-9) / iters
        algbw = nbytes / per_iter / 1e9
        result["sizes"].append({"bytes": nbytes, "iters": iters, "time_s": per_iter, "algbw_gbps": algbw,
                                "busbw_gbps": algbw * factor, "mismatches": mismatches})
        per_byte = per_iter / nbytes


def _pair_rounds(torch, dist, store, options, rank, deadline, report):
    """The pairwise phase from this node's side: in each round of options["pairs"]["rounds"] (pairs of node
    indices), a 2-rank gloo group of its own with the peer (ProcessGroupGloo over the run's store, as
    torch.distributed.distributed_c10d._new_process_group_helper makes one: GLOO_SOCKET_IFNAME is honoured),
    then round trips of "bytes" each way, the best one timed. Every pair has a deadline (its share of the time
    left); a round waits for every node to finish the previous one (or for that deadline), so that a peer stuck
    in a dead pair does not make the next pair fail. Returns [{"round", "peer", "ok", "stage", "error", "gbps",
    "time_s", "connect_s"}]; the rounds the time did not allow are left out; the links that looked slow follow,
    measured again alone (_retests). Each pair is also sent to the node process as it is measured: a rank killed
    later (in a hung init) still has its pairs reported."""
    spec = options["pairs"]
    me = rank // max(1, len(options["ranks"]))
    numel = max(1, int(spec["bytes"]) // 4)
    rounds = spec["rounds"]
    nodes = max(1, int(options["world_size"]) // max(1, len(options["ranks"])))
    # Every node at the rendezvous before the first round: a peer still importing torch would fail its first pair
    # for nothing. At most half the time left, and never the second each round needs: a node that never comes
    # fails its row with every peer, not the phase. A round then waits for the nodes that came ("pairs/present").
    wait = min((deadline - _now()) / 2, deadline - _now() - len(rounds) * 1.0)
    try:
        if store.add("pairs/present", 1) >= nodes:
            store.set("pairs/start", "1")
        store.wait(["pairs/start"], datetime.timedelta(seconds=max(0.01, wait)))
    except Exception:
        pass  # not every node came in time: the rounds go on with those that did
    address = _local_address(options["master_addr"], int(options["master_port"]))
    out = []
    for index, pairs in enumerate(rounds):
        left = deadline - _now()
        if left < 0.5:
            break  # the rounds left are not run (the head sees them missing)
        # A share of the time left, at least a second (a healthy pair takes milliseconds; a dead one all of it).
        pair_s = min(float(options["timeout_s"]), left - 0.2, max(1.0, left / max(1, len(rounds) - index) - 0.2))
        peer = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        if peer is not None:
            out.append(_pair(torch, dist, store, spec, index, me, int(peer), numel, pair_s, address))
            report({"pair": out[-1]})
        # After the last round only the head's rank 0 waits: it holds the store the others may still need.
        _round_barrier(store, "pairs/done/%d" % index, min(deadline, _now() + pair_s + 1.0),
                       wait=index + 1 < len(rounds) or me == 0)
    if rounds:
        out += _retests(torch, dist, store, options, me, nodes, out, deadline, report, address)
    return out


def _retests(torch, dist, store, options, me, nodes, measured, deadline, report, address):
    """Each link that looks slow after the rounds (pairlinks.slow_links over every node's rates), measured again
    alone: one pair at a time while every other node waits at the round barrier, so that a link that was only
    busy with the other pairs' traffic (hosts that share cores, a busy switch port) is not warned of. The head's
    rank 0 decides which (the nodes' rates may reach the store at different times: one list for all), at most
    MAX_RETESTS or one per node and only as many as the time left allows (RETEST_S each); none when the time is
    short. Returns the retest pairs, as _pair measures them (RETEST_REPS round trips), with "retest": True."""
    spec = dict(options["pairs"], reps=RETEST_REPS, rep_s=RETEST_REP_S)
    start = len(spec["rounds"])  # the retests' round indices follow the scheduled rounds'
    rates = dict((p["peer"], p["gbps"]) for p in measured if p.get("ok") and p.get("gbps") is not None)
    try:
        store.set("pairs/rates/%d" % me, json.dumps(rates))
        # Every node has finished the last round by now (the head's rank 0 waited for them): its rates follow in
        # moments, but a busy host may take a second or two (a rate missing would be judged from one end only).
        _round_barrier(store, "pairs/rates", min(deadline, _now() + RATES_S), wait=me == 0)
        if me == 0:
            store.set("pairs/suspects", json.dumps(_suspects(store, nodes, deadline)))
        store.wait(["pairs/suspects"], datetime.timedelta(seconds=max(0.01, min(deadline - _now(), RATES_S + 2.0))))
        suspects = [tuple(link) for link in json.loads(store.get("pairs/suspects").decode())]
    except Exception:  # the head's node gone or stuck: no retest (the head judges from the rounds)
        return []
    out = []
    # Every node has read the list before the first retest (and the head's rank 0 stays until they all have).
    _round_barrier(store, "pairs/suspects/read", min(deadline, _now() + 1.0), wait=me == 0 or bool(suspects))
    for i, (a, b) in enumerate(suspects):
        left = deadline - _now()
        if left < 0.5:
            break
        pair_s = min(float(options["timeout_s"]), left - 0.2, max(1.0, left / (len(suspects) - i) - 0.2))
        if me in (a, b):
            found = _pair(torch, dist, store, spec, start + i, me, b if me == a else a,
                          max(1, int(spec["bytes"]) // 4), pair_s, address)
            found["retest"] = True
            out.append(found)
            report({"pair": found})
        _round_barrier(store, "pairs/done/%d" % (start + i), min(deadline, _now() + pair_s + 1.0),
                       wait=i + 1 < len(suspects) or me == 0)
    return out


def _suspects(store, nodes, deadline):
    """The links to measure again, from the rates of every node that published them: [[a, b], ...], the most
    suspect first, at most MAX_RETESTS or one per node, as many as fit in the time left."""
    rates = {}
    for node in range(nodes):
        key = "pairs/rates/%d" % node
        if not store.check([key]):
            continue  # not there (gone, stuck in a dead pair): its peers' ends say its links
        for peer, gbps in json.loads(store.get(key).decode()).items():
            link = (min(node, int(peer)), max(node, int(peer)))
            rates[link] = min(gbps, rates.get(link, gbps))  # the slower end, as the head's matrix takes it
    slow = pairlinks.most_suspect_first(pairlinks.slow_links(rates, nodes, pairlinks.stragglers(rates)))
    room = int((deadline - _now() - 1.0) // RETEST_S)
    return [[a, b] for a, b, _, _ in slow[:max(0, min(max(MAX_RETESTS, nodes), room))]]


def _local_address(host, port):
    """The address of this node's interface toward the head (where the route to the rendezvous leaves)."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, port, 0, socket.SOCK_DGRAM)[0]
        probe = socket.socket(family, socket.SOCK_DGRAM)
        try:
            probe.connect(where)  # UDP: no packet is sent, the kernel only picks the route
            return probe.getsockname()[0]
        finally:
            probe.close()
    except OSError:
        return "0.0.0.0"


def _both_ways(pstore, me, peer, address, until):
    """TCP between the two ends, each way, before gloo (whose connect does not always keep its timeout on a
    path that drops packets): each end listens on an ephemeral port and dials the other's. None when both
    connections came, else (stage "dial" or "accept", why)."""
    listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(2)
        pstore.set("tcp/%d" % me, "%s %d" % (address, listener.getsockname()[1]))
        pstore.wait(["tcp/%d" % peer], datetime.timedelta(seconds=max(0.1, until - _now())))
        host, port = pstore.get("tcp/%d" % peer).decode().split()
        wait = max(0.1, until - _now())
        try:  # a connect completes in the peer's kernel, without waiting for its accept
            socket.create_connection((host, int(port)), timeout=wait).close()
        except OSError as exc:
            return "dial", "no TCP connection to the peer's port %s at %s in %.1f s: %s" % (port, host, wait, exc)
        listener.settimeout(max(0.1, until - _now()))
        try:
            listener.accept()[0].close()
        except OSError:
            return "accept", "no TCP connection from the peer to this node's port %d at %s (it dialled, nothing came)" \
                % (listener.getsockname()[1], address)
        return None
    finally:
        listener.close()


def _pair(torch, dist, store, spec, index, me, peer, numel, pair_s, address):
    first = min(me, peer)
    found = {"round": index, "peer": peer, "ok": False, "stage": "connect", "error": None, "gbps": None,
             "time_s": None, "connect_s": None}
    started = _now()
    until = started + pair_s
    try:
        pstore = dist.PrefixStore("pairs/%d/%d-%d/" % (index, first, max(me, peer)), store)
        failed = _both_ways(pstore, me, peer, address, until)
        if failed:
            found["stage"], found["error"] = failed
            return found
        group = dist.ProcessGroupGloo(pstore, 0 if me == first else 1, 2,
                                      datetime.timedelta(seconds=max(0.5, until - _now())))
        found["connect_s"] = round(_now() - started, 4)
        found["stage"] = "transfer"
        buf, more = torch.zeros(numel), torch.zeros(1)
        other = 1 if me == first else 0
        best = None
        spent = 0.0

        def step(send, tensor):
            work = group.send([tensor], other, index) if send else group.recv([tensor], other, index)
            work.wait(datetime.timedelta(seconds=max(0.1, until - _now())))

        for rep in range(int(spec.get("reps") or 1)):
            t = time.perf_counter()
            step(me == first, buf)  # there and back: the first of the pair sends, then receives
            step(me != first, buf)
            took = time.perf_counter() - t
            best = took if best is None else min(best, took)
            spent += took
            # The first of the pair decides whether to go on, and says so: both must make the same transfers.
            more[0] = float(rep + 1 < int(spec.get("reps") or 1) and spent < float(spec.get("rep_s") or 0)
                            and _now() + 2 * took < until)
            step(me == first, more)
            if not more[0]:
                break
        found.update(ok=True, stage="done", time_s=round(best, 6), gbps=round(2 * numel * 4 / best / 1e9, 6))
    except Exception as exc:  # gloo's connect or transfer past the deadline, a peer gone: this pair failed
        found["error"] = ("%s: %s" % (type(exc).__name__, exc)).splitlines()[0][:300]
        found["elapsed_s"] = round(_now() - started, 3)
    return found


def _round_barrier(store, key, until, wait=True):
    """Say this node finished the round; with `wait`, wait until every node present did (or `until`): True
    when they all did. The last to finish says so under key/all: the others wait on the store, not in a loop
    that would load the head's store (and its core) while the next pairs are measured."""
    try:
        if store.add(key, 1) >= store.add("pairs/present", 0):
            store.set(key + "/all", "1")
        if wait:
            store.wait([key + "/all"], datetime.timedelta(seconds=max(0.01, until - _now())))
        return True
    except Exception:  # past `until` (a node stuck in a dead pair, or gone): go on with the next round
        return False


# --- the node process ---------------------------------------------------------------------------

def _tail(path):
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 4 * TAIL_CHARS))
            return handle.read().decode("utf-8", "replace")[-TAIL_CHARS:]
    except OSError:
        return None


def nccl_lines(path):
    """NCCL's INFO lines about the network in a rank's output (the first NCCL_MAX_LINES, each cut short)."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(NCCL_READ_BYTES).decode("utf-8", "replace")
    except OSError:
        return []
    kept = []
    for line in text.splitlines():
        if "NCCL INFO" in line and any(word in line for word in NCCL_WORDS):
            kept.append(line.strip()[:NCCL_LINE_CHARS])
            if len(kept) >= NCCL_MAX_LINES:
                break
    return kept


def _child(rank, local_rank, options, write_fd, log_path, deadline):
    """In the forked process: output to the log file, then one rank; never returns."""
    code = 0
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:  # die with the node process, whatever kills it
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass
        for key, value in (options.get("env") or {}).items():
            os.environ[str(key)] = str(value)
        if options.get("backend") == "nccl" and not os.environ.get("NCCL_DEBUG"):  # else the user's is kept
            os.environ.update(NCCL_DEBUG_ENV)
            os.environ.pop("NCCL_DEBUG_FILE", None)  # had no effect without NCCL_DEBUG; the lines go to the log
        os.environ.update({"MASTER_ADDR": str(options["master_addr"]), "MASTER_PORT": str(options["master_port"]),
                           "WORLD_SIZE": str(options["world_size"]), "RANK": str(rank),
                           "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(len(options["ranks"]))})

        def report(message):
            os.write(write_fd, (json.dumps(message) + "\n").encode())

        result = run_rank(rank, local_rank, options, report, deadline)
        report({"result": result})
    except BaseException as exc:
        code = 1
        try:
            sys.stderr.write("preflight all-reduce worker: %s: %s\n" % (type(exc).__name__, exc))
            sys.stderr.flush()
        except Exception:
            pass
    os._exit(code)


PLACE = {"import": 0, "store": 1, "pairs": 1, "init": 1, "sweep": 2, "done": 3}  # store to init: the rendezvous


def _progress(children, shown, sizes):
    """Says where the node's slowest running rank is when that moved past `shown` (to the rendezvous, or to
    a size of the sweep); returns the position said last, or None once stdout is gone."""
    running = [c for c in children.values() if c["open"] and c["result"] is None]
    if not running:
        return shown  # the report follows
    slowest = min(running, key=lambda c: (PLACE.get(c["stage"], 0), c["size"], c["rank"]))
    place = PLACE.get(slowest["stage"], 0)
    position = (place, slowest["size"] if place == 2 else 0)
    if position <= shown or place not in (1, 2) or position == (2, 0):
        return shown
    line = {"rank": slowest["rank"], "stage": "rendezvous" if place == 1 else "sweep", "size": position[1],
            "sizes": sizes}
    try:
        sys.stdout.write(json.dumps({"progress": line}) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        return None
    return position


def main(options):
    started = _now()
    deadline = started + float(options["budget_s"])
    ranks = [int(r) for r in options["ranks"]]
    children = {}  # read fd -> state
    for local_rank, rank in enumerate(ranks):
        read_fd, write_fd = os.pipe()
        log_fd, log_path = tempfile.mkstemp(prefix="preflight-col-rank%d-" % rank, suffix=".log")
        os.close(log_fd)
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child(rank, local_rank, options, write_fd, log_path, deadline)
        os.close(write_fd)
        children[read_fd] = {"pid": pid, "rank": rank, "local_rank": local_rank, "log": log_path, "buffer": b"",
                             "stage": "import", "size": 0, "result": None, "open": True, "status": None,
                             "pairs": []}
    sizes = len(options["sizes"])
    shown = (0, 0) if options.get("progress") else None  # the position last said; None: say nothing
    aborted = False
    stdin_open = True
    while any(c["open"] for c in children.values()):
        left = deadline - _now()
        if left <= 0:
            break
        watched = [fd for fd, c in children.items() if c["open"]] + ([0] if stdin_open else [])
        try:
            ready = select.select(watched, [], [], left)[0]
        except InterruptedError:
            continue
        if 0 in ready:
            data = os.read(0, 4096)
            if not data or b"abort" in data:
                aborted = True
                break
        for fd in ready:
            if fd == 0:
                continue
            child = children[fd]
            chunk = os.read(fd, 65536)
            if not chunk:
                child["open"] = False
                os.close(fd)
                continue
            child["buffer"] += chunk
            while b"\n" in child["buffer"]:
                line, child["buffer"] = child["buffer"].split(b"\n", 1)
                try:
                    message = json.loads(line.decode())
                except ValueError:
                    continue
                if "stage" in message:
                    child["stage"], child["size"] = message["stage"], message.get("size", 0)
                if "pair" in message:
                    child["pairs"].append(message["pair"])
                if "result" in message:
                    child["result"] = message["result"]
        if shown is not None:
            shown = _progress(children, shown, sizes)
    for fd, child in children.items():
        if child["open"]:  # past the deadline, or aborted: kill it
            try:
                os.kill(child["pid"], signal.SIGKILL)
            except OSError:
                pass
            os.close(fd)
        try:
            child["status"] = os.waitpid(child["pid"], 0)[1]
        except OSError:
            pass
    out = []
    for child in sorted(children.values(), key=lambda c: c["rank"]):
        result = child["result"]
        if result is None:
            if child["open"]:
                kind = "aborted" if aborted else "killed"
                error = ("stopped at the controller's request" if aborted else
                         "still in stage %s at the hard deadline (%.1f s): killed"
                         % (child["stage"], options["budget_s"]))
            else:
                kind, status = "died", child["status"]
                how = ("signal %d" % os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status)
                       else "exit %s" % (os.WEXITSTATUS(status) if status is not None else "?"))
                error = "the rank's process ended in stage %s without a result (%s)" % (child["stage"], how)
            result = {"rank": child["rank"], "local_rank": child["local_rank"], "ok": False, "stage": child["stage"],
                      "kind": kind, "error": error, "sizes": [], "skipped_sizes": [], "check": None, "joined": None}
        if child["pairs"] and result.get("pairs") is None:  # measured before the rank hung or was killed
            result["pairs"] = child["pairs"]
        result["tail"] = None if result.get("ok") else _tail(child["log"])
        if options.get("backend") == "nccl" and child["local_rank"] == 0:
            env = dict(os.environ, **{str(k): str(v) for k, v in (options.get("env") or {}).items()})
            result["nccl"] = {"lines": nccl_lines(child["log"]), "debug": env.get("NCCL_DEBUG") or None}
        out.append(result)
        try:
            os.unlink(child["log"])
        except OSError:
            pass
    line = {"ok": bool(out) and all(r.get("ok") for r in out), "host": socket.gethostname(),
            "elapsed_s": round(_now() - started, 3), "aborted": aborted, "ranks": out}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
