"""The data path between this node and its peers, as the ranks will use it: a listener on an ephemeral port
(where NCCL and gloo listen), and from here to every peer the route the kernel takes, the names this node
resolves for it, a TCP connection to its listener and do-not-fragment datagrams of the path's size.

Every step has a deadline; nothing but these probes' own small packets is sent, and only to the peers the
head names. Its requests (preflight.node.agent): "paths_open" (`Responder`), "paths_probe" (`probe`),
"paths_close"."""
import errno
import os
import select
import socket
import struct
import threading
import time

# Linux's values (<linux/in.h>); not every Python's socket module names them.
IP_MTU_DISCOVER, IP_PMTUDISC_DO, IP_MTU = 10, 2, 14
UDP_OVER_IP = 28  # an IPv4 header (20) and a UDP header (8): a datagram of MTU - 28 bytes fills one frame
SMALLEST = 576  # every IPv4 path carries it (RFC 791): the first datagram, that tells "no UDP" from "too big"
COMMON_MTUS = (1280, 1450, 1492, 1500, 4000, 4096, 8192, 9000)
MAX_PEERS = 64  # the head sends at most so many (its schedule bounds the pairs)
THREADS = 16  # peers whose path MTU is searched at once (a healthy path needs no search)
ROUND_SIZES = 14  # datagrams of different sizes sent at once per round, while the carried size is searched
ROUNDS = 3
RESOLVE_S = 3.0  # a name resolves by then, or is said not to (a resolver that hangs holds nothing)
MAX_NAMES = 8
RESOLVERS = 8  # lookups at once: one thread per name per peer cost the node more CPU than the probes
ANSWER = struct.Struct("!II")  # a probe datagram starts with (token, size); the answer is those 8 bytes


def port_range():
    """[low, high] of net.ipv4.ip_local_port_range: where the kernel picks the port of a socket bound to port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = handle.read().split()[:2]
        return [int(low), int(high)]
    except (OSError, ValueError):
        return None


def routes():
    """The IPv4 main table from /proc/net/route: (destination, mask, metric, device, gateway), as integers."""
    table = []
    try:
        with open("/proc/net/route") as handle:
            lines = handle.read().splitlines()[1:2049]
    except OSError:
        return table
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or not int(fields[3], 16) & 0x1:  # RTF_UP
            continue
        table.append((socket.ntohl(int(fields[1], 16)), socket.ntohl(int(fields[7], 16)), int(fields[6]), fields[0],
                      socket.ntohl(int(fields[2], 16))))
    return table


def route_to(address, table):
    """(device, the route as `ip route` writes it) of the most specific route to an IPv4 address (the lowest
    metric among equals), or (None, None)."""
    try:
        target = struct.unpack("!I", socket.inet_aton(address))[0]
    except (OSError, TypeError):
        return None, None
    best = None
    for dest, mask, metric, device, gateway in table:
        if target & mask == dest:
            key = (bin(mask).count("1"), -metric)
            if best is None or key > best[0]:
                best = (key, dest, mask, device, gateway)
    if best is None:
        return None, None
    _, dest, mask, device, gateway = best
    where = "default" if not mask else "%s/%d" % (socket.inet_ntoa(struct.pack("!I", dest)), bin(mask).count("1"))
    via = " via %s" % socket.inet_ntoa(struct.pack("!I", gateway)) if gateway else ""
    return device, "%s%s dev %s" % (where, via, device)


def in_threads(func, items, most, lock):
    """At most `most` started threads that call func on each of `items`, taken from the list (under `lock`) in
    turn until none is left; emptying the list stops them. Daemons: one still waiting never holds the exit."""
    def work():
        while True:
            with lock:
                if not items:
                    return
                item = items.pop(0)
            func(item)

    threads = [threading.Thread(target=work) for _ in range(min(most, len(items)))]
    for thread in threads:
        thread.daemon = True
        thread.start()
    return threads


def host_names(names):
    """The distinct names that may be looked up, in their order."""
    return [n for n in dict.fromkeys(names) if isinstance(n, str) and 0 < len(n) <= 255]


def resolve(names, seconds=RESOLVE_S, most=MAX_NAMES):
    """{name: [address, ...]} as this node's resolver gives them (socket.getaddrinfo, as torch's TCPStore client
    connects to the name), {name: {"error"}} when it does not resolve, or not within `seconds`: at most
    RESOLVERS lookups at once, each distinct name once, and none is waited for past the deadline."""
    names = host_names(names)[:most]
    found, queue, lock = {}, list(names), threading.Lock()

    def lookup(name):
        try:
            infos = socket.getaddrinfo(name, None, 0, socket.SOCK_STREAM)
            found[name] = list(dict.fromkeys(info[4][0] for info in infos))[:16]
        except (OSError, UnicodeError, ValueError) as exc:  # socket.gaierror is an OSError
            found[name] = {"error": str(exc) or type(exc).__name__}

    threads = in_threads(lookup, queue, RESOLVERS, lock)
    until = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, until - time.monotonic()))
    late = {"error": "no answer from the resolver within %g s" % seconds}
    with lock:
        del queue[:]  # a name not begun by the deadline is not begun after it
        return dict((name, found.get(name, late)) for name in names)


def resolve_one(name, seconds=RESOLVE_S):
    """resolve() of one name: its addresses, or {"error"}."""
    return resolve([name], seconds).get(name) or {"error": "not a host name: %r" % (name,)}


class Responder(object):
    """A TCP listener and a UDP answerer on ports the kernel picks (port 0, as NCCL's ncclSocketListen and
    gloo's tcp Listener bind theirs: from ip_local_port_range), served by a thread until `stop`."""

    def __init__(self):
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.wake = os.pipe()  # written by stop: the serving thread ends at once, with no polling meanwhile
        try:
            self.tcp.bind(("0.0.0.0", 0))
            self.tcp.listen(128)
            self.udp.bind(("0.0.0.0", 0))
        except OSError:
            self.close()
            raise
        self.stopping = False
        self.thread = threading.Thread(target=self.serve)
        self.thread.daemon = True
        self.thread.start()

    def ports(self):
        return {"tcp_port": self.tcp.getsockname()[1], "udp_port": self.udp.getsockname()[1],
                "port_range": port_range()}

    def serve(self):
        while not self.stopping:
            try:
                ready = select.select([self.tcp, self.udp, self.wake[0]], [], [])[0]
            except (OSError, ValueError):
                return
            for sock in ready:
                try:
                    if sock is self.udp:
                        data, peer = self.udp.recvfrom(65535)
                        if len(data) >= ANSWER.size:
                            self.udp.sendto(data[:ANSWER.size], peer)
                    elif sock is self.tcp:
                        self.tcp.accept()[0].close()  # a FIN: the prober, which resets, leaves no TIME_WAIT here
                except OSError:
                    continue

    def close(self):
        self.stopping = True
        for sock in (self.tcp, self.udp):
            try:
                sock.close()
            except OSError:
                pass
        for fd in self.wake:
            try:
                os.close(fd)
            except OSError:
                pass
        self.wake = ()

    def stop(self):
        self.stopping = True
        if getattr(self, "thread", None) is not None:
            try:
                os.write(self.wake[1], b"x")
            except (OSError, IndexError):
                pass
            self.thread.join(1.0)
        self.close()


def connect_all(targets, timeout_s):
    """{key: {"ok", "seconds", "error"}} for each (key, address, port): TCP connections begun at once, without
    blocking, in this thread, each given timeout_s; one that connects is reset (SO_LINGER 0), so that the
    listener's end leaves no TIME_WAIT."""
    started, results, pending = time.monotonic(), {}, {}

    def said(key, error=None):
        seconds = round(time.monotonic() - started, 4)
        results[key] = {"ok": True, "seconds": seconds} if error is None else \
            {"ok": False, "error": error, "seconds": seconds}

    try:
        for key, address, port in targets:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                code = sock.connect_ex((address, port))
            except (OSError, OverflowError) as exc:  # an address the kernel refuses outright, a port past 65535
                code = getattr(exc, "errno", None) or errno.EINVAL
            if code in (0, errno.EINPROGRESS):
                pending[sock] = key
            else:
                said(key, os.strerror(code))
                sock.close()
        deadline = started + timeout_s
        while pending:
            left = deadline - time.monotonic()
            done = select.select([], list(pending), [], left)[1] if left > 0 else []
            if not done:
                break
            for sock in done:
                key, code = pending.pop(sock), sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                said(key, os.strerror(code) if code else None)
                sock.close()
        for sock, key in pending.items():
            said(key, "timed out after %gs" % timeout_s)
    finally:
        for sock in pending:
            sock.close()
    return results


def connect(address, port, timeout_s):
    return connect_all([(0, address, port)], timeout_s)[0]


def _datagrams_to(batch, wait_s):
    """{key: (came, refused)} for each key's (address, port, sizes), all sent at once and awaited together in this
    thread (_datagrams of each). A destination that cannot be set up has nothing come back."""
    socks, found = {}, {}
    try:
        for key, (address, port, sizes) in batch.items():
            found[key] = (set(), [])
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks[sock] = key
            try:
                sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
                sock.connect((address, port))
            except (OSError, OverflowError):
                continue
            token, refused = struct.unpack("!I", os.urandom(4))[0], found[key][1]
            found[key] = (set(), refused, token, sizes)
            for _ in range(2):
                for size in sizes:
                    payload = ANSWER.pack(token, size) + b"\0" * max(0, size - UDP_OVER_IP - ANSWER.size)
                    try:
                        sock.send(payload)
                    except OSError as exc:
                        if size not in refused and exc.errno == errno.EMSGSIZE:
                            refused.append(size)
        waiting = [sock for sock, key in socks.items() if len(found[key]) == 4 and _owed(found[key])]
        deadline = time.monotonic() + wait_s
        while waiting:
            left = deadline - time.monotonic()
            ready = select.select(waiting, [], [], left)[0] if left > 0 else []
            if not ready:
                break
            for sock in ready:
                came, _, token, _ = state = found[socks[sock]]
                try:
                    data = sock.recv(64)
                except OSError:
                    data = None  # an ICMP error (port unreachable) on a connected socket: nothing more comes
                if data is not None and len(data) == ANSWER.size:
                    got, size = ANSWER.unpack(data)
                    if got == token:
                        came.add(size)
                if data is None or not _owed(state):
                    waiting.remove(sock)
    finally:
        for sock in socks:
            sock.close()
    return dict((key, state[:2]) for key, state in found.items())


def _owed(state):
    came, refused, _, sizes = state
    return len(came) + len(refused) < len(sizes)


def _datagrams(address, port, sizes, wait_s):
    """Which of `sizes` (IP packet sizes) reach the peer's answerer and come back, sent with do-not-fragment
    (IP_PMTUDISC_DO: too big for a link is dropped, never split); each size twice, all at once. Also the
    sizes the kernel refused to send (EMSGSIZE: larger than the route's MTU or a path MTU it learnt)."""
    return _datagrams_to({0: (address, port, sizes)}, wait_s)[0]


def path_mtu(address, port, size, wait_s, first=None):
    """Whether packets of `size` bytes (the MTU both ends of the path have) reach the peer with
    do-not-fragment; when not, the largest size that does, searched in at most ROUNDS rounds of
    ROUND_SIZES sizes sent at once, then confirmed (each round waits at most wait_s). `first`: what the
    first try of [SMALLEST, size] brought back, when it was sent already (with every peer's, `probe`)."""
    came, refused = first or _datagrams(address, port, [SMALLEST, size], wait_s)
    if SMALLEST not in came:  # one more try: a slow link's queue may have dropped the first burst
        came, refused = _datagrams(address, port, [SMALLEST, size], wait_s)
    result = {"size": size, "ok": size in came, "carried": size if size in came else None}
    if size in refused:
        result["refused"] = True  # this node's own route or a learnt path MTU is smaller
    if result["ok"] or SMALLEST not in came:
        if SMALLEST not in came:
            result["error"] = ("no datagram came back in two tries, not even of %d bytes (UDP to port %d dropped, "
                               "or a link that loses packets)" % (SMALLEST, port))
        return result
    low, high = SMALLEST, size
    for _ in range(ROUNDS):
        if high - low <= 1:
            break
        step = max(1, (high - low) // (ROUND_SIZES + 1))
        sizes = sorted(set([s for s in COMMON_MTUS if low < s < high] +
                           list(range(low + step, high, step))[:ROUND_SIZES]))
        came = _datagrams(address, port, sizes, wait_s)[0]
        for s in sizes:
            if s in came:
                low = max(low, s)
            elif s > low:
                high = min(high, s)
                break
    # Loss is not a black hole: the full size must still fail where the size found passes, in two more tries.
    for _ in range(2):
        came = _datagrams(address, port, [low, size], wait_s)[0]
        if size in came:
            return dict(result, ok=True, carried=size, lossy=True)
        if low in came:
            result["carried"] = low
            return result
    result["error"] = "packets were lost on the way: no size is known to pass (a link that drops packets)"
    return result


def _route(peer, table):
    address = peer["address"]
    found = {"address": address}
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.connect((address, 9))  # a UDP connect sends nothing: the kernel's choice of source address
            found["source"] = sock.getsockname()[0]
        finally:
            sock.close()
    except OSError as exc:
        found["route_error"] = exc.strerror or str(exc)
    found["device"], found["route"] = route_to(address, table)
    return found


def probe(peers, timeout_s, wait_s):
    """Each peer ({"name", "address", "names", "tcp_port", "udp_port", "mtu"}): its route; the names given,
    each distinct one resolved once (RESOLVERS at once, meanwhile); a TCP connection to its listener and the
    first datagrams of its path's size, to every peer at once from this thread; the path MTU searched only
    where that first try did not come back, THREADS peers at a time. A peer not done by the deadline (every
    step's bound added up, as probe_budget) is said so."""
    peers = list(peers)[:MAX_PEERS]
    started, table = time.monotonic(), routes()
    deadline = started + probe_budget(len(peers), timeout_s, wait_s)
    results, lock = {}, threading.Lock()
    asked = dict((peer["name"], (peer.get("names") or [])[:4]) for peer in peers)
    names = {}
    everyone = [n for listed in asked.values() for n in listed]
    resolver = threading.Thread(target=lambda: names.update(resolve(everyone, timeout_s, len(everyone))))
    resolver.daemon = True
    resolver.start()
    for peer in peers:
        try:
            results[peer["name"]] = _route(peer, table)
        except Exception as exc:  # one peer's failure is that peer's answer
            results[peer["name"]] = {"address": peer.get("address"), "error": "%s: %s" % (type(exc).__name__, exc)}
    usable = [p for p in peers if "error" not in results[p["name"]]]
    dialled = connect_all([(p["name"], p["address"], int(p["tcp_port"])) for p in usable if p.get("tcp_port")],
                          timeout_s)
    sized = [p for p in usable if p.get("udp_port") and p.get("mtu") and "route_error" not in results[p["name"]]]
    first = _datagrams_to(dict((p["name"], (p["address"], int(p["udp_port"]), [SMALLEST, int(p["mtu"])]))
                               for p in sized), wait_s)
    search = []
    for peer in sized:
        came = first[peer["name"]][0]
        if SMALLEST in came and int(peer["mtu"]) in came:  # a healthy path: nothing to search
            results[peer["name"]]["mtu"] = {"size": int(peer["mtu"]), "ok": True, "carried": int(peer["mtu"])}
        else:
            search.append(peer)
    for name, answer in dialled.items():
        results[name]["tcp"] = answer

    def search_one(peer):
        name = peer["name"]
        try:
            found = {"mtu": path_mtu(peer["address"], int(peer["udp_port"]), int(peer["mtu"]), wait_s, first[name])}
        except Exception as exc:  # one peer's failure is that peer's answer
            found = {"error": "%s: %s" % (type(exc).__name__, exc)}
        with lock:
            if "error" in found:
                results[name] = dict(found, address=peer["address"])
            else:
                results[name].update(found)

    waiting = list(search)
    searching = in_threads(search_one, search, THREADS, lock)
    for thread in searching + [resolver]:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        del search[:]
        late = {"error": "not probed within %.1fs" % (time.monotonic() - started)}
        for peer in waiting:
            if "mtu" not in results[peer["name"]] and "error" not in results[peer["name"]]:
                results[peer["name"]] = dict(late, address=peer["address"])
        for name, listed in asked.items():
            if "error" not in results[name]:
                results[name]["names"] = dict((n, names.get(n, {"error": "no answer from the resolver within %g s"
                                                                  % timeout_s})) for n in host_names(listed))
        return dict((peer["name"], dict(results[peer["name"]])) for peer in peers)


def probe_budget(peers, timeout_s, wait_s):
    """The longest `probe` takes for so many peers: what the head waits for its answer."""
    return (2 * timeout_s + (ROUNDS + 4) * wait_s) * (-(-min(peers, MAX_PEERS) // THREADS)) + 1.0
