"""A NCCL RAS service that replays recorded answers (tests/fixtures/nccl_ras), speaking the protocol as NCCL's
src/ras/client_support.cc implements it (rasClientEventLoop): commands are lines ("\\n", a "\\r" before it dropped,
case ignored); "CLIENT PROTOCOL N" gets "SERVER PROTOCOL 2", "TIMEOUT S" gets "OK" (or "ERROR: Invalid timeout
value S"), "SET FORMAT json|text" gets "OK" (an NCCL before 2.28.7 knows no such command: "ERROR: Unknown command
..."), "STATUS" gets the next recorded answer and the connection is closed; anything else gets "ERROR: Unknown
command ...". The one seam between doctor's RAS client and a GPU job: the client talks real TCP to it."""
import socket
import threading
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "nccl_ras"


def recorded(case, version):
    """The two answers of a fixture case, as NCCL printed them."""
    ext = "txt" if version < "2.28.7" else "json"
    return [(FIXTURES / case / f"{version}-{n}.{ext}").read_text() for n in (1, 2)]


class RasServer:
    """Listens on 127.0.0.1 (port: self.port) until closed; `answers` are given to STATUS in turn (the last one
    again when they run out); `json`: whether SET FORMAT json is known; `handler(conn)` replaces the protocol (a
    hostile service). Records every connection's commands (self.sessions) and whether the client closed it."""

    def __init__(self, answers=(), json=True, handler=None, protocol=2):
        self.answers, self.json, self.handler, self.protocol = list(answers), json, handler, protocol
        self.sessions, self.closed_by_client, self.served = [], [], 0
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.threads = []
        self.running = True
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()

    def _accept(self):
        while self.running:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            worker = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(worker)
            worker.start()

    def _serve(self, conn):
        with conn:
            conn.settimeout(10)
            try:
                if self.handler:
                    self.handler(conn)
                else:
                    self._protocol(conn)
            except OSError:
                pass

    def _protocol(self, conn):
        commands, buffer = [], b""
        self.sessions.append(commands)
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                self.closed_by_client.append(True)
                return
            buffer += chunk
            while b"\n" in buffer:
                line, _, buffer = buffer.partition(b"\n")
                cmd = line.decode().rstrip("\r")
                commands.append(cmd)
                low = cmd.lower()
                if low.startswith("client protocol "):
                    conn.sendall(b"SERVER PROTOCOL %d\n" % self.protocol)
                elif low.startswith("timeout "):
                    value = cmd[len("timeout "):]
                    conn.sendall(b"OK\n" if value.isdigit() else b"ERROR: Invalid timeout value %s\n" % value.encode())
                elif low.startswith("set format ") and self.json:
                    fmt = low[len("set format "):]
                    conn.sendall(b"OK\n" if fmt in ("text", "json") else b"ERROR: Invalid format %s\n" % fmt.encode())
                elif low in ("status", "verbose status"):
                    answer = self.answers[min(self.served, len(self.answers) - 1)]
                    self.served += 1
                    conn.sendall(answer.encode() if isinstance(answer, str) else answer)
                    conn.shutdown(socket.SHUT_WR)  # RAS_CLIENT_FINISHED: it closes once all is sent
                    self.closed_by_client.append(conn.recv(1) == b"")
                    return
                else:
                    conn.sendall(b"ERROR: Unknown command %s\n" % cmd.encode())

    def close(self):
        self.running = False
        self.listener.close()
        for worker in self.threads:
            worker.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
