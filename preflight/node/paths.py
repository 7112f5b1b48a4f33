"""The data path between this node and its peers, as the ranks will use it: a listener on an ephemeral port
(where NCCL and gloo listen), and from here to every peer the route the kernel takes, the names this node
resolves for it, a TCP connection to its listener and do-not-fragment datagrams of the path's size.

Every step has a deadline; nothing but these probes' own small packets is sent, and only to the peers the
head names. Its requests (preflight.node.agent): "paths_open" (`Responder`), "paths_probe" (`probe`),
"paths_close"."""
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
THREADS = 16
ROUND_SIZES = 14  # datagrams of different sizes sent at once per round, while the carried size is searched
ROUNDS = 3
RESOLVE_S = 3.0  # a name resolves by then, or is said not to (a resolver that hangs holds nothing)
MAX_NAMES = 8
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
    """The IPv4 main table from /proc/net/route: (destination, mask, metric, device), as integers."""
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
        table.append((socket.ntohl(int(fields[1], 16)), socket.ntohl(int(fields[7], 16)), int(fields[6]), fields[0]))
    return table


def route_device(address, table):
    """The device of the most specific route to an IPv4 address (the lowest metric among equals), or None."""
    try:
        target = struct.unpack("!I", socket.inet_aton(address))[0]
    except (OSError, TypeError):
        return None
    best = None
    for dest, mask, metric, device in table:
        if target & mask == dest:
            key = (bin(mask).count("1"), -metric)
            if best is None or key > best[0]:
                best = (key, device)
    return best[1] if best else None


def resolve(names, seconds=RESOLVE_S):
    """{name: [address, ...]} as this node's resolver gives them (socket.getaddrinfo, as torch's TCPStore client
    connects to the name), {name: {"error"}} when it does not resolve, or not within `seconds`: each lookup
    runs in its own thread, and none is waited for past the deadline."""
    names = [n for n in dict.fromkeys(names) if isinstance(n, str) and 0 < len(n) <= 255][:MAX_NAMES]
    found = {}

    def lookup(name):
        try:
            infos = socket.getaddrinfo(name, None, 0, socket.SOCK_STREAM)
            found[name] = list(dict.fromkeys(info[4][0] for info in infos))[:16]
        except (OSError, UnicodeError, ValueError) as exc:  # socket.gaierror is an OSError
            found[name] = {"error": str(exc) or type(exc).__name__}

    threads = []
    for name in names:
        thread = threading.Thread(target=lookup, args=(name,))
        thread.daemon = True  # a lookup still hanging never holds the agent's exit
        thread.start()
        threads.append(thread)
    until = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, until - time.monotonic()))
    late = {"error": "no answer from the resolver within %g s" % seconds}
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
                ready = select.select([self.tcp, self.udp], [], [], 0.2)[0]
            except (OSError, ValueError):
                return
            for sock in ready:
                try:
                    if sock is self.udp:
                        data, peer = self.udp.recvfrom(65535)
                        if len(data) >= ANSWER.size:
                            self.udp.sendto(data[:ANSWER.size], peer)
                    else:
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

    def stop(self):
        self.stopping = True
        if getattr(self, "thread", None) is not None:
            self.thread.join(1.0)
        self.close()


def connect(address, port, timeout_s):
    started = time.monotonic()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect((address, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return {"ok": True, "seconds": round(time.monotonic() - started, 4)}
    except socket.timeout:
        return {"ok": False, "error": "timed out after %gs" % timeout_s, "seconds": round(time.monotonic() - started, 4)}
    except OSError as exc:
        return {"ok": False, "error": exc.strerror or str(exc), "seconds": round(time.monotonic() - started, 4)}
    finally:
        sock.close()


def _datagrams(address, port, sizes, wait_s):
    """Which of `sizes` (IP packet sizes) reach the peer's answerer and come back, sent with do-not-fragment
    (IP_PMTUDISC_DO: too big for a link is dropped, never split); each size twice, all at once. Also the
    sizes the kernel refused to send (EMSGSIZE: larger than the route's MTU or a path MTU it learnt)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    came, refused = set(), []
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        sock.connect((address, port))
        token = struct.unpack("!I", os.urandom(4))[0]
        for _ in range(2):
            for size in sizes:
                payload = ANSWER.pack(token, size) + b"\0" * max(0, size - UDP_OVER_IP - ANSWER.size)
                try:
                    sock.send(payload)
                except OSError as exc:
                    if size not in refused and exc.errno == 90:  # EMSGSIZE
                        refused.append(size)
        deadline = time.monotonic() + wait_s
        while len(came) + len(refused) < len(sizes):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                break
            try:
                data = sock.recv(64)
            except OSError:
                break  # an ICMP error (port unreachable) on a connected socket
            if len(data) == ANSWER.size:
                got, size = ANSWER.unpack(data)
                if got == token:
                    came.add(size)
    finally:
        sock.close()
    return came, refused


def path_mtu(address, port, size, wait_s):
    """Whether packets of `size` bytes (the MTU both ends of the path have) reach the peer with
    do-not-fragment; when not, the largest size that does, searched in at most ROUNDS rounds of
    ROUND_SIZES sizes sent at once, then confirmed (each round waits at most wait_s)."""
    came, refused = _datagrams(address, port, [SMALLEST, size], wait_s)
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


def _probe_peer(peer, table, timeout_s, wait_s):
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
    found["device"] = route_device(address, table)
    found["names"] = resolve((peer.get("names") or [])[:4], timeout_s)
    if peer.get("tcp_port"):
        found["tcp"] = connect(address, int(peer["tcp_port"]), timeout_s)
    if peer.get("udp_port") and peer.get("mtu") and "route_error" not in found:
        found["mtu"] = path_mtu(address, int(peer["udp_port"]), int(peer["mtu"]), wait_s)
    return found


def probe(peers, timeout_s, wait_s):
    """Each peer ({"name", "address", "names", "tcp_port", "udp_port", "mtu"}) probed, THREADS at a time;
    a peer not done by the deadline (every step's bound added up) is said so."""
    peers = list(peers)[:MAX_PEERS]
    table = routes()
    results, queue, lock = {}, list(peers), threading.Lock()

    def work():
        while True:
            with lock:
                if not queue:
                    return
                peer = queue.pop(0)
            try:
                answer = _probe_peer(peer, table, timeout_s, wait_s)
            except Exception as exc:  # one peer's failure is that peer's answer
                answer = {"address": peer.get("address"), "error": "%s: %s" % (type(exc).__name__, exc)}
            with lock:
                results[peer["name"]] = answer

    workers = [threading.Thread(target=work) for _ in range(min(THREADS, len(peers)))]
    for thread in workers:
        thread.daemon = True
        thread.start()
    per_peer = 2 * timeout_s + (ROUNDS + 4) * wait_s
    deadline = time.monotonic() + per_peer * (-(-len(peers) // THREADS)) + 1.0
    for thread in workers:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        for peer in peers:
            results.setdefault(peer["name"], {"address": peer.get("address"),
                                              "error": "not probed within %.1fs" % (deadline - time.monotonic())})
        return dict(results)


def probe_budget(peers, timeout_s, wait_s):
    """The longest `probe` takes for so many peers: what the head waits for its answer."""
    return (2 * timeout_s + (ROUNDS + 4) * wait_s) * (-(-min(peers, MAX_PEERS) // THREADS)) + 1.0
