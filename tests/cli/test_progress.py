"""Live progress on stderr (preflight.progress): a status line on a terminal, plain lines elsewhere.

The cluster tests run the real CLI with its stderr on a pseudo-terminal against the test cluster, one node
made slow (its interpreter starts 3 s late: a wrapper --python that sleeps where sshd sets PF_SLOW_START),
and read what the terminal got, chunk by chunk, with the time each came."""
import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import tempfile
import termios
import time

import pytest

from cluster import cluster, cluster_up  # noqa: F401  (fixtures)
from preflight import progress
from preflight.gate import launcher

ERASE = "\r\x1b[2K"
SPINNER = set(progress.FRAMES)
ACCELERATE_LIKE = ["/bin/echo", "launch"]  # launcher.run adds the rank flags after the first two words


def open_terminal(columns: int = 160):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return leader, follower


def read_terminal(leader: int, done, limit_s: float = 120.0) -> list:
    """What the terminal got: [(monotonic time, text)], until done() and nothing more comes."""
    chunks, end = [], time.monotonic() + limit_s
    while time.monotonic() < end:
        ready, _, _ = select.select([leader], [], [], 0.1)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the last writer closed the terminal
                break
            if not data:
                break
            chunks.append((time.monotonic(), data.decode("utf-8", "replace")))
        elif done():
            break
    return chunks


def run_cli(args, env=None, terminal=True, columns=160):
    """The CLI with stderr on a pseudo-terminal (or a pipe); (exit code, stdout, [(time, stderr text)], end time)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    environ.update({"TERM": "xterm-256color", **(env or {})})
    with tempfile.TemporaryFile() as out:
        if not terminal:
            proc = subprocess.run([sys.executable, "-m", "preflight", *map(str, args)], stdout=out,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=environ, timeout=120)
            out.seek(0)
            return proc.returncode, out.read().decode(), [(time.monotonic(), proc.stderr.decode())], time.monotonic()
        leader, follower = open_terminal(columns)
        proc = subprocess.Popen([sys.executable, "-m", "preflight", *map(str, args)], stdout=out, stderr=follower,
                                stdin=subprocess.DEVNULL, env=environ)
        os.close(follower)
        try:
            chunks = read_terminal(leader, lambda: proc.poll() is not None)
            code = proc.wait(timeout=60)
        finally:
            os.close(leader)
        ended = time.monotonic()
        out.seek(0)
        return code, out.read().decode(), chunks, ended


def frames(text: str) -> list:
    """The status lines drawn: each is erased by the next draw (or a plain line)."""
    parts = text.replace("\r\n", "\n").replace(ERASE, "\n").split("\n")
    return [part for part in parts if part[:1] in SPINNER]


def slow_python(tmp_path) -> str:
    """An interpreter that starts PF_SLOW_START seconds late where the session has that variable."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\n[ -n "$PF_SLOW_START" ] && sleep "$PF_SLOW_START"\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def target(cluster, python=sys.executable):
    return ["--hosts", ",".join(cluster.nodes), "--ssh-config", str(cluster.ssh_config), "--python", python]


# --- the status line, in process ----------------------------------------------------------------

class Screen(io.StringIO):
    encoding = "utf-8"

    def isatty(self):
        return True


def test_the_line_names_the_nodes_waited_for_longest_and_counts_the_rest():
    shown = progress.Progress("live", Screen())
    with shown.activity("facts", 6) as step:
        for name in ("n1", "n2", "n3", "n4", "n5", "n6"):
            step.start(name)
            step.reach(name)
        step.done("n1")
        step.done("n3", ok=False)
        assert re.fullmatch(r"facts · 6/6 reached, 1 answered, 1 failed · waiting for n2, n4, n5 and 1 more "
                            r"\(\d+\.\d s\)", step.line())
        step.note("starting ranks", "rendezvous")
        assert step.line().startswith("facts: rendezvous · ")  # every node reached: the step after it


def test_control_characters_in_a_node_name_never_reach_the_terminal():
    screen = Screen()
    shown = progress.Progress("live", screen)
    with shown.activity("facts", 1) as step:
        step.start("evil\x1b]0;owned\x07\x1b[2J\rnode")
        drawn = step.line()
        shown.say("from evil\x1b[31m\n")
    assert "\x1b" not in drawn and "\x07" not in drawn and "\r" not in drawn
    assert "evil?]0;owned??[2J?node" in drawn
    written = screen.getvalue()
    assert written.count("\x1b") == written.count(ERASE)  # our own erases are the only escapes
    assert "preflight: from evil?[31m?\n" in written
    assert progress.clean("x" * 100, 10) == "x" * 9 + "…"


def test_the_line_fits_the_terminal_and_is_erased_at_the_end():
    leader, follower = open_terminal(columns=40)
    stream = os.fdopen(follower, "w", encoding="utf-8")
    try:
        shown = progress.Progress("live", stream)
        with shown.activity("a step with a rather long name", 2) as step:
            step.starts(["node-with-a-long-name-0001", "node-with-a-long-name-0002"])
            time.sleep(0.6)  # two redraws
        stream.flush()
        text = "".join(t for _, t in read_terminal(leader, lambda: True, 5))
    finally:
        stream.close()
        os.close(leader)
    drawn = frames(text)
    assert len(drawn) >= 3 and all(len(line) <= 39 for line in drawn), drawn
    assert text.endswith(ERASE)  # transient: nothing of it stays


def test_a_narrow_terminal_keeps_what_is_waited_for_over_the_details():
    screen = Screen()  # no terminal size: 80 columns
    with progress.Progress("live", screen).activity("facts", 1000) as step:
        step.note("a step with a good deal of detail that an 80-column terminal has no room for")
        names = [f"node{i:04d}" for i in range(1, 1001)]
        step.starts(names)
        for name in names[:996]:
            step.reach(name)
            step.done(name, ok=name != "node0500")
        time.sleep(0.3)
    last = frames(screen.getvalue())[-1]
    assert re.fullmatch(r".  facts · 995/1000 answered, 1 failed · waiting for node0997 and 3 more \(0\.\d s\)"
                        .replace("  ", " "), last), last


def test_the_all_reduce_keeps_its_size_and_the_node_holding_it_back_at_80_columns():
    screen = Screen()  # no terminal size: 80 columns
    shown = progress.Progress("live", screen)
    names = [f"node0{i}" for i in range(1, 7)]
    with shown.activity("all-reduce full run (6 gloo ranks)", 6, "started", "reported", limit=40,
                        short="all-reduce") as step:
        step.starts(names)
        for name in names:
            step.reach(name)
        for name in names:  # every node but node02 moved on: node02 holds the run back, and is named first
            if name != "node02":
                step.moved(name)
        step.note("starting ranks", "size 3 of 5 (1 MiB)")
        wide = step.line()
        time.sleep(0.3)
    assert re.fullmatch(r"all-reduce full run \(6 gloo ranks\): size 3 of 5 \(1 MiB\) · 6/6 started, 0 reported · "
                        r"waiting for node02, node01, node03 and 3 more \(0\.\d s of 40 s\)", wide), wide
    drawn = frames(screen.getvalue())
    assert all(len(line) <= 79 for line in drawn), drawn
    assert re.fullmatch(r". all-reduce: size 3 of 5 \(1 MiB\) · waiting for node02 \(0\.\d s of 40 s\)", drawn[-1]), drawn


def test_a_terminal_that_goes_away_ends_the_line_without_an_error(monkeypatch):
    import threading

    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    leader, follower = open_terminal()
    stream = os.fdopen(follower, "w", encoding="utf-8")
    shown = progress.Progress("live", stream)
    with shown.activity("facts", 1) as step:
        step.start("node01")
        os.close(leader)  # the terminal hangs up
        time.sleep(0.8)
    assert not errors and not shown._shown
    try:
        stream.close()
    except OSError:
        pass


def test_the_mode_follows_the_terminal_json_no_color_and_term(monkeypatch):
    leader, follower = open_terminal()
    terminal = os.fdopen(follower, "w")
    try:
        monkeypatch.setenv("TERM", "xterm")
        monkeypatch.delenv("NO_COLOR", raising=False)
        assert progress.choose(False, terminal) == "live"
        assert progress.choose(True, terminal) == "plain"  # --json on a terminal: the plain lines
        assert progress.choose(False, io.StringIO()) == "plain"
        assert progress.choose(True, io.StringIO()) == "off"
        monkeypatch.setenv("NO_COLOR", "1")
        assert progress.choose(False, terminal) == "plain"
        monkeypatch.delenv("NO_COLOR")
        monkeypatch.setenv("TERM", "dumb")
        assert progress.choose(False, terminal) == "plain"
    finally:
        terminal.close()
        os.close(leader)


def test_plain_and_off_draw_nothing():
    for mode, said in (("plain", "preflight: hello\n"), ("off", "")):
        screen = Screen()
        shown = progress.Progress(mode, screen)
        with shown.activity("facts", 1) as step:
            step.start("n1")
            time.sleep(0.3)
            shown.say("hello")
        assert screen.getvalue() == said


# --- on the test cluster --------------------------------------------------------------------------

@pytest.mark.cluster
def test_a_slow_node_is_named_on_the_terminal_while_it_is_outstanding(cluster, tmp_path):
    with cluster.env("node02", PF_SLOW_START="3"):
        code, out, chunks, ended = run_cli(["check", *target(cluster, slow_python(tmp_path)), "--only", "SSH"])
    text = "".join(t for _, t in chunks)
    assert code == 0, text + out
    waiting = [f for f in frames(text) if f.startswith(tuple(SPINNER)) and "facts" in f and "waiting for" in f]
    slow = [f for f in waiting if "waiting for node02 (" in f]
    assert slow, text
    # Only node02 is waited for, every node reached, the others answered; the seconds count up.
    assert all("node01" not in f and "node03" not in f and "3/3 reached, 2 answered" in f for f in slow), slow
    seconds = [float(re.search(r"\((\d+\.\d) s\)", f).group(1)) for f in slow]
    assert max(seconds) >= 2.0 and seconds == sorted(seconds), seconds
    # Seen while it lasted, not only at the end.
    seen, so_far = None, ""
    for at, chunk in chunks:
        so_far += chunk
        if "waiting for node02 (1." in so_far:
            seen = at
            break
    assert seen is not None and ended - seen > 1.0
    # The plain lines stay; the status line is gone at the end; the report on stdout has none of it.
    assert "preflight: reaching 3 node(s) over SSH" in text and "preflight: facts from 3/3 node(s)" in text
    assert "waiting for" not in text.rsplit(ERASE, 1)[-1]
    assert "\x1b[2K" not in out and "waiting for" not in out


@pytest.mark.cluster
@pytest.mark.parametrize("how", ["a pipe", "--json", "--json on a pipe", "NO_COLOR", "TERM=dumb"])
def test_no_status_line_off_a_terminal_with_json_or_without_colour(cluster, tmp_path, how):
    args, env = ["check", *target(cluster, slow_python(tmp_path)), "--only", "SSH"], {}
    args += ["--json"] if how.startswith("--json") else []
    env = {"NO_COLOR": "1"} if how == "NO_COLOR" else {"TERM": "dumb"} if how == "TERM=dumb" else {}
    with cluster.env("node02", PF_SLOW_START="1"):
        code, out, chunks, _ = run_cli(args, env, terminal=not how.endswith("a pipe"))
    text = "".join(t for _, t in chunks)
    assert code == 0, text
    assert "\x1b[" not in text and "waiting for" not in text and not SPINNER & set(text), text
    assert "\r" not in text.replace("\r\n", "\n")  # a terminal's line ends only
    # The plain lines stay; with --json and no terminal to watch, not even those.
    assert ("preflight: reaching 3 node(s) over SSH" in text) == (how != "--json on a pipe"), text
    if how.startswith("--json"):
        assert out.lstrip().startswith("{") and "\x1b[" not in out


@pytest.mark.cluster
def test_doctor_shows_its_census_and_the_slow_node(cluster, tmp_path):
    with cluster.env("node02", PF_SLOW_START="3"):
        _, _, chunks, _ = run_cli(["doctor", *target(cluster, slow_python(tmp_path)), "--no-stacks"])
    text = "".join(t for _, t in chunks)
    slow = [f for f in frames(text) if f[2:].startswith("census") and "waiting for node02 (" in f]
    assert slow and all("node01" not in f and "node03" not in f for f in slow), text
    assert "preflight: census from 3/3 node(s)" in text


@pytest.mark.cluster
def test_the_all_reduce_shows_its_run_its_size_and_what_it_waits_for_at_80_columns(cluster):
    code, out, chunks, _ = run_cli(["check", *target(cluster), "--only", "COL", "--col-sizes", "64K,1M",
                                    "--timeout", "40"], columns=80)
    text = "".join(t for _, t in chunks)
    drawn = [f for f in frames(text) if f[2:].startswith("all-reduce")]
    assert drawn and all(len(f) <= 79 for f in drawn), text
    assert any(re.fullmatch(r". all-reduce(: starting ranks)? · .*waiting for node0\d.*\(\d+\.\d s of \d+ s\)", f)
               for f in drawn), drawn
    # The worker's lines of progress: the run at its slowest node's size, and the node named, within 80 columns.
    sizes = [re.fullmatch(r". all-reduce: size (\d) of 2 \((64 KiB|1 MiB)\) · waiting for node0\d( and \d more)? "
                          r"\(\d+\.\d s of \d+ s\)", f) for f in drawn]
    seen = [m.group(1, 2) for m in sizes if m]
    assert ("2", "1 MiB") in seen and seen == sorted(seen), drawn  # size 2 of 2 shown, never going back
    assert code == 0, text + out


@pytest.mark.cluster
def test_launch_shows_the_node_it_cannot_reach_yet(cluster, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    leader, follower = open_terminal()
    err, out = os.fdopen(follower, "w", encoding="utf-8"), io.StringIO()
    try:
        with cluster.frozen_sshd("node03"):  # connects, then never answers: costs the connect timeout
            code = launcher.run(cluster.nodes, cluster.ip("node01"), 29500, ACCELERATE_LIKE,
                                ssh_config=str(cluster.ssh_config), timeout=2, out=out, err=err)
        err.flush()
        text = "".join(t for _, t in read_terminal(leader, lambda: True, 5))
    finally:
        err.close()
        os.close(leader)
    assert code == 1
    connecting = [f for f in frames(text) if "launch: connecting" in f and "waiting for node03 (" in f]
    assert connecting and any("2/3 connected" in f and "node01" not in f for f in connecting), text
    assert "preflight: not launching: node03" in text


@pytest.mark.cluster
def test_launch_output_is_not_garbled_by_the_status_line(cluster, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    leader, follower = open_terminal()
    terminal = os.fdopen(follower, "w", encoding="utf-8")
    try:  # the nodes' output and the status line on one terminal, as a person sees them
        code = launcher.run(cluster.nodes, cluster.ip("node01"), 29500, ACCELERATE_LIKE,
                            ssh_config=str(cluster.ssh_config), timeout=10, out=terminal, err=terminal)
        terminal.flush()
        text = "".join(t for _, t in read_terminal(leader, lambda: True, 5)).replace("\r\n", "\n")
    finally:
        terminal.close()
        os.close(leader)
    assert code == 0
    assert any("launch: connecting" in f for f in frames(text)), text
    for rank, node in enumerate(cluster.nodes):  # every node's line whole, from the line's start (an erase ends there)
        assert re.search(rf"(^|\n|{re.escape(ERASE)})\[{node}\] launch --machine_rank {rank} --main_process_ip ", text), text
    assert "waiting for" not in text.split("[node", 1)[1]  # once the output flows, the status line is gone
