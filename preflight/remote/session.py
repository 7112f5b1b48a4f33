"""One session with a program of preflight.node, whatever transport carries it: why a node failed (NodeError),
its output read line by line with a deadline and a bound (LineReader), and a deadline on any call
(run_with_deadline). preflight.remote.transport chooses the transport; every transport builds on this."""
from __future__ import annotations

import threading
import time
from typing import Optional


class NodeError(Exception):
    """Why a node could not be reached or could not run the program: kind, message, remediation."""

    def __init__(self, kind: str, message: str, remediation: str):
        super().__init__(message)
        self.kind, self.message, self.remediation = kind, message, remediation


# The longest line a node may send. The longest real one is the answer with the files a node's config names
# (up to 16, each with its text up to the collector's 1 MiB, JSON-escaped); facts are about 4 KiB, 20 KiB
# with the census of a job of 8 ranks (measured on the test cluster). Past it the node fails: memory stays
# bounded whatever it sends.
MAX_LINE = 64 << 20


class LineReader:
    """Lines out of a node's program, each read with a deadline. A subclass says how bytes arrive:
    `_receive(seconds)` gives bytes, b"" at the end of output, or None when nothing came in time.
    Reading a line costs time linear in its length (each byte is searched for the newline once)."""

    def __init__(self):
        self._buffer = bytearray()
        self._searched = 0  # bytes of _buffer known to hold no newline
        self._ended = False

    def _receive(self, seconds: float) -> Optional[bytes]:
        raise NotImplementedError

    def read_line(self, timeout: float) -> Optional[str]:
        """The next line, or None at end of output; NodeError past the deadline or past MAX_LINE bytes (the
        output then counts as ended)."""
        deadline = time.monotonic() + timeout
        buffer = self._buffer
        while True:
            end = buffer.find(b"\n", self._searched)
            if end >= 0 or self._ended:
                break
            self._searched = len(buffer)
            if self._searched > MAX_LINE:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeError("timeout", f"no answer within {timeout:g} s", "the node is overloaded or hung")
            chunk = self._receive(left)
            if chunk is None:
                continue
            if not chunk:
                self._ended = True
                continue
            buffer += chunk
        if end < 0 and len(buffer) <= MAX_LINE:  # the end of output: what is left, if anything
            line = bytes(buffer)
            buffer.clear()
            return line.decode(errors="replace") if line else None
        if end > MAX_LINE or end < 0:
            self._ended = True
            buffer.clear()
            raise NodeError("protocol", f"the node sent a line longer than {MAX_LINE >> 20} MiB, more than any "
                            "answer of preflight's programs", "run the training interpreter there by hand: something "
                            "else writes on its standard output")
        line = bytes(buffer[:end])
        del buffer[:end + 1]
        self._searched = 0
        return line.decode(errors="replace")


def run_with_deadline(func, timeout: float):
    """Run func() in a thread; NodeError if it has not returned in time (the thread is abandoned)."""
    result: dict = {}

    def target():
        try:
            result["value"] = func()
        except BaseException as exc:  # carried over to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise NodeError("timeout", f"no answer within {timeout:g} s", "the node is hung or overloaded")
    if "error" in result:
        raise result["error"]
    return result.get("value")
