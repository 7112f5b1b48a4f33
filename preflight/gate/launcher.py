"""`preflight launch` on several nodes: start `accelerate launch` on every node over SSH, with the rank flags.

Each node gets the same command, run in the same working directory, with `--machine_rank <its index>`,
`--main_process_ip <the head's checked address>`, `--main_process_port <the plan's port>` and
`--num_machines <the number of nodes>` inserted after `accelerate launch` (the user's own values of these
four are dropped). Nothing of this machine's environment is passed: each node runs the command in the
environment its SSH session gets (sshd's SetEnv, the shell's startup files). When the launch is DeepSpeed's
runner from the head (accelerate's DeepSpeed with the pdsh, openmpi, mvapich, mpich or slurm multinode
launcher), it starts on the head alone: that runner starts every node itself.

Every node's output comes here as it comes, each line (and each `\\r` redraw of a progress bar) prefixed
with `[node] `. When one node's launcher exits
non-zero, or on Ctrl-C / SIGTERM / SIGHUP, the other nodes are stopped: their channels are closed, and since each
session has a pseudo-terminal, the remote launcher gets SIGHUP as its terminal hangs up. The exit code is
the first non-zero exit (0 when every node succeeds).
"""
from __future__ import annotations

import codecs
import os
import queue
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Mapping, Optional, Sequence, TextIO

from preflight.progress import Activity, Progress, for_stderr
from preflight.inputs.launchcmd import rank_command
from preflight.remote import transport
from preflight.remote.session import NodeError, run_with_deadline

EXIT_LOST = 255  # a node whose session ended without an exit status (as ssh says it)


def head_runner(job: Optional[Mapping], head: str) -> Optional[str]:
    """The multinode launcher with which DeepSpeed's runner on the head starts every node, when the head's
    effective launch is that runner (preflight.job.view: started_by "head"); None when every node starts its own.
    accelerate/utils/launch.py, prepare_deepspeed_cmd_env: any deepspeed_multinode_launcher but 'standard'
    (torchrun) and 'nossh' (--no_ssh, with each node's --node_rank) runs `deepspeed --launcher L` on the head."""
    view = ((job or {}).get("nodes") or {}).get(head) or {}
    if view.get("started_by") != "head":
        return None
    return str(view.get("multinode_launcher") or "pdsh")


def here_command(command: Sequence[str]) -> List[str]:
    """The command `launch` execs on this node, as a shell here reads `$VAR`: the verdict judged each node's
    launch with that node's own values (preflight.node.launchfiles.facts, os.path.expandvars)."""
    return [os.path.expandvars(word) for word in command]


def remote_command(cwd: str, args: Sequence[str]) -> str:
    """The shell line a node runs: every word quoted, nothing user-typed unquoted."""
    return f"cd {shlex.quote(cwd)} && exec {' '.join(shlex.quote(a) for a in args)}"


@dataclass
class _Node:
    name: str
    rank: int
    command: List[str]
    connection: object = None  # a connection of preflight.remote.transport ("ssh")
    channel: object = None
    exit_code: Optional[int] = None
    stopped: bool = False


IDLE_FLUSH_S = 0.2  # a partial line (a progress bar between redraws, a prompt) is shown after this long idle
PARTIAL_MAX = 65536  # and at this size: a line without an end is never held whole


class _Output:
    r"""Every node's output as it comes, each line (and each `\r`-ended redraw of a progress bar) prefixed with
    its node, one writer at a time. A partial line is written as it stands, and what follows it from the same
    node continues it without a second prefix; another node's output first ends it with a newline."""

    def __init__(self, out: TextIO, err: TextIO, quiet=None):
        self.out, self.err, self.lock = out, err, threading.Lock()
        self.open = {}  # id(stream) -> the prefix whose partial line is the last thing written there
        self.quiet = quiet  # called before the first output: it ends the status line, which would garble it

    def write(self, stream: TextIO, prefix: str, text: str, end: str) -> None:
        r"""`text` then `end` ("\n", "\r", or "" for a partial line) from the node of `prefix`."""
        with self.lock:
            if self.quiet is not None:
                self.quiet, quiet = None, self.quiet
                quiet()
            open_prefix = self.open.pop(id(stream), None)
            if open_prefix == prefix:  # the continuation of this node's partial line
                stream.write(text + end)
            elif text or end == "\n":  # (a bare `\r` with nothing of ours on the line says nothing)
                stream.write(("\n" if open_prefix is not None else "") + prefix + text + end)
            elif open_prefix is not None:
                self.open[id(stream)] = open_prefix
            if end == "" and (text or open_prefix == prefix):
                self.open[id(stream)] = prefix
            stream.flush()

    def end(self, stream: TextIO, prefix: str) -> None:
        """The node's output has ended: a partial line of it left open gets its newline."""
        with self.lock:
            if self.open.get(id(stream)) == prefix:
                del self.open[id(stream)]
                stream.write("\n")
                stream.flush()


def _segments(buffer: str):
    r"""(the complete segments of buffer, each (text, end), and what is left): `\r\n` (a pty's line end) and
    `\n` end a line, a `\r` alone ends a redraw; a `\r` at the very end waits, in case `\n` follows."""
    done, start = [], 0
    while True:
        n, r = buffer.find("\n", start), buffer.find("\r", start)
        if r != -1 and (n == -1 or r < n):
            if r + 1 == len(buffer):
                break
            if buffer[r + 1] == "\n":
                done.append((buffer[start:r], "\n"))
                start = r + 2
            else:
                done.append((buffer[start:r], "\r"))
                start = r + 1
        elif n != -1:
            done.append((buffer[start:n], "\n"))
            start = n + 1
        else:
            break
    return done, buffer[start:]


def _pump(recv, output: _Output, stream: TextIO, prefix: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buffer = ""
    while True:
        try:
            chunk = recv(65536)
        except socket.timeout:  # idle: show the partial line (a progress bar waiting for its next redraw)
            chunk = None
        except Exception:
            chunk = b""
        if chunk == b"":
            break
        if chunk is not None:
            buffer += decoder.decode(chunk)
        segments, buffer = _segments(buffer)
        for text, end in segments:
            output.write(stream, prefix, text, end)
        if buffer and (chunk is None or len(buffer) >= PARTIAL_MAX):
            text, buffer = (buffer[:-1], "\r") if buffer.endswith("\r") else (buffer, "")
            output.write(stream, prefix, text, "")
    buffer += decoder.decode(b"", final=True)
    if buffer.rstrip("\r"):
        output.write(stream, prefix, buffer.rstrip("\r"), "\n")
    output.end(stream, prefix)


def run(nodes: Sequence[str], address: str, port: int, command: Sequence[str], *, ssh_config: Optional[str] = None,
        accept_new: bool = False, ssh_client: Optional[str] = None, timeout: float = 30.0, cwd: Optional[str] = None,
        pty: bool = True, out: TextIO = None, err: TextIO = None, progress: Optional[Progress] = None,
        runner: Optional[str] = None) -> int:
    """Run `command` (an `accelerate launch` line) on every node; the first non-zero exit, or 0. `progress`: the
    status line while the nodes are reached and the job started (default: live when `err` is a terminal).
    `runner`: head_runner's answer; then the head alone is started, and its DeepSpeed runner starts the rest."""
    out, err = out or sys.stdout, err or sys.stderr
    progress = progress or for_stderr(False, err)
    cwd = cwd or os.getcwd()
    runs = [_Node(name, rank, rank_command(command, rank, address, port, len(nodes))) for rank, name in enumerate(nodes)]
    runs = runs[:1] if runner else runs
    output = _Output(out, err, progress.stop)
    exits: "queue.Queue[_Node]" = queue.Queue()
    threads: List[threading.Thread] = []

    def say(text: str) -> None:
        progress.stop()
        with output.lock:
            err.write(f"preflight: {text}\n")
            err.flush()

    def stop(reason: str) -> None:
        running = [n for n in runs if n.exit_code is None and not n.stopped]
        if running:
            say(f"{reason}; stopping {', '.join(n.name for n in running)}")
        for node in running:
            node.stopped = True
            try:
                node.channel.close()  # the pty hangs up: the remote launcher gets SIGHUP
            except Exception:
                pass

    try:  # SIGTERM and SIGHUP arrive as KeyboardInterrupt (preflight.cli.interruptible), as Ctrl-C does
        with progress.activity("launch: connecting", len(runs), reached="", answered="connected") as shown:
            reaching = SimpleNamespace(ssh_config=ssh_config, accept_new=accept_new, ssh_client=ssh_client,
                                       timeout=timeout)
            errors = _connect_all(runs, reaching, shown)
        if errors:
            for name, exc in errors:
                say(f"not launching: {name}: {exc.message} ({exc.remediation})")
            return 1
        if runner:
            say(f"launching on {runs[0].name} (machine_rank 0) alone, main process {address}:{port}: DeepSpeed's "
                f"runner there starts the job's {len(nodes)} node(s) over {runner}")
        else:
            say(f"launching on {len(runs)} node(s), main process {address}:{port}: "
                + ", ".join(f"{n.name} (machine_rank {n.rank})" for n in runs))
        starting = progress.activity("launch: starting the job", len(runs), reached="", answered="started")
        for node in runs:
            starting.start(node.name)
            # As bytes: a directory or an argument that is not UTF-8 (os.getcwd() and argv carry its bytes as
            # surrogate escapes) reaches the node byte for byte, as the shell here would pass it on. Within the
            # timeout: a sshd that accepts the session but never answers the exec request costs this launch.
            try:
                channel = node.connection.open_command(
                    remote_command(cwd, node.command).encode("utf-8", "surrogateescape"), timeout=timeout, pty=pty)
            except NodeError as exc:
                stop(f"{node.name}: {exc.message}")
                return 1
            starting.done(node.name)
            node.channel = channel
            channel.settimeout(IDLE_FLUSH_S)
            prefix = f"[{node.name}] "
            readers = [threading.Thread(target=_pump, args=(channel.recv, output, out, prefix), daemon=True)]
            if not pty:  # with a pty, stderr arrives merged into the terminal's one stream
                readers.append(threading.Thread(target=_pump, args=(channel.recv_stderr, output, err, prefix),
                                                daemon=True))
            waiter = threading.Thread(target=_wait, args=(node, readers, exits), daemon=True)
            for thread in readers + [waiter]:
                thread.start()
            threads.extend(readers + [waiter])
        starting.close()
        first = 0
        for _ in runs:
            while True:
                try:
                    node = exits.get(timeout=0.2)
                    break
                except queue.Empty:
                    continue
            if node.stopped:
                continue
            if node.exit_code != 0 and first == 0:
                first = node.exit_code
                stop(f"{node.name} exited with {node.exit_code}")
        return first
    except KeyboardInterrupt:
        stop("interrupted")
        raise
    finally:
        progress.stop()
        for node in runs:
            if node.channel is not None and not node.stopped and node.exit_code is None:
                node.stopped = True
                try:
                    node.channel.close()
                except Exception:
                    pass
        deadline = time.monotonic() + 2
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for node in runs:
            if node.connection is not None:
                node.connection.close()


def _wait(node: _Node, readers: List[threading.Thread], exits: "queue.Queue[_Node]") -> None:
    for reader in readers:
        reader.join()  # the output ends first: every line is written before the exit is told
    channel = node.channel
    deadline = time.monotonic() + 5
    while not channel.exit_status_ready() and not node.stopped and time.monotonic() < deadline:
        time.sleep(0.02)
    if not node.stopped:
        node.exit_code = channel.recv_exit_status() if channel.exit_status_ready() else EXIT_LOST
        if node.exit_code == -1:  # sshd sent no status (a signal ended the session)
            node.exit_code = EXIT_LOST
    exits.put(node)


def _connect_all(runs: List[_Node], reaching: SimpleNamespace, shown: Activity) -> list:
    errors = []
    lock = threading.Lock()

    def connect(node: _Node) -> None:
        shown.start(node.name)
        try:
            node.connection = run_with_deadline(lambda: transport.connect("ssh", node.name, reaching, wait=True),
                                                reaching.timeout * 2 + 1)
        except NodeError as exc:
            with lock:
                errors.append((node.name, exc))
        except Exception as exc:
            with lock:
                errors.append((node.name, NodeError("connect", f"{type(exc).__name__}: {exc}", "check SSH to the node")))
        finally:
            shown.done(node.name, node.connection is not None)

    threads = [threading.Thread(target=connect, args=(n,), daemon=True) for n in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(errors, key=lambda e: [n.name for n in runs].index(e[0]))
