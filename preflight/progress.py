"""What a run is doing while it runs, on stderr: the one place for progress (gather, collective, launcher, doctor).

Three modes. "live" (stderr is a terminal, no --json, no NO_COLOR, TERM is not dumb): the plain lines, and
below them one status line redrawn a few times a second by a thread of its own: a spinner, the step, counts
(reached / answered / failed) and the nodes waited for longest, with how long, so a long step always shows
that it is alive and what it waits for. "plain": the plain `preflight: ...` lines only. "off": nothing.
The nodes' threads only update counters under a lock; nothing is written per node, so a fan-out to
thousands of nodes costs no more than a few redraws a second. Node names are shown with every control
character replaced: a name is never a terminal command.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Iterable, List, Optional, TextIO

REFRESH_S = 0.25  # redraws per second: 4
NAMED = 3  # the nodes waited for longest, by name; the rest are counted
NAME_MAX = 40  # cells of a node name on the line
ERASE = "\r\x1b[2K"  # to the line's start, and clear it
# How the status line is made shorter until it fits, level by level: (the short label, the step, the counts:
# 2 all, 1 fewer, 0 none, the nodes named, "and N more"). What it waits for matters most; where a step says
# where it is (the all-reduce's size n of m), that comes next, and the counts last. The levels that keep the
# step are passed over where there is none.
LEVELS = ((False, True, 2, NAMED, True), (True, True, 0, 1, True), (True, True, 0, 1, False),
          (True, False, 1, NAMED, True), (True, False, 1, 1, True))
WITHOUT_STEP = 3  # the first level without the step
FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
ASCII_FRAMES = "-\\|/"


def clean(text: str, limit: Optional[int] = None) -> str:
    """`text` with every control or unprintable character as '?' (and cut to `limit` characters)."""
    text = str(text)
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + "…"
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)


def choose(json_output: bool = False, stream: Optional[TextIO] = None) -> str:
    """The mode for a run: live on a terminal, plain lines where colour or cursor moves are unwelcome, and
    none with --json unless stderr is a terminal (a person is watching)."""
    stream = stream or sys.stderr
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if not terminal:
        return "off" if json_output else "plain"
    if json_output or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return "plain"
    return "live"


def for_stderr(json_output: bool = False, stream: Optional[TextIO] = None) -> "Progress":
    return Progress(choose(json_output, stream), stream)


def of(value) -> "Progress":
    """A Progress from GatherOptions.progress: a Progress as it is; True plain lines, False nothing."""
    if isinstance(value, Progress):
        return value
    return Progress("plain" if value else "off")


class Progress:
    def __init__(self, mode: str = "plain", stream: Optional[TextIO] = None):
        self.mode = mode
        self._stream = stream
        self._lock = threading.RLock()
        self._shown: List[Activity] = []  # the open steps; the last is on the status line
        self._drawn = False  # the status line is on the screen
        self._thread: Optional[threading.Thread] = None
        self._frame = 0

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stderr  # sys.stderr as it is when written to (pytest swaps it)

    @property
    def live(self) -> bool:
        return self.mode == "live"

    def say(self, text: str) -> None:
        """A line that stays: `preflight: text` (above the status line when live)."""
        if self.mode == "off":
            return
        with self._lock:
            self._erase()
            self.stream.write(f"preflight: {clean(text)}\n")
            self._draw()
            self.stream.flush()

    def activity(self, label: str, total: Optional[int] = None, reached: str = "reached",
                 answered: str = "answered", limit: Optional[float] = None, short: Optional[str] = None) -> "Activity":
        """A step shown on the status line while it is open (a context manager, or close() it); counts of
        `total` nodes, named by what their start() / reach() / done() mean here; `limit`: its deadline in s;
        `short`: the label where the whole one does not fit."""
        if not self.live:
            return _QUIET
        step = Activity(self, label, total, reached, answered, limit, short)
        with self._lock:
            self._shown.append(step)
            self._draw()
            self.stream.flush()
            if self._thread is None:
                self._thread = threading.Thread(target=self._refresh, name="preflight-progress", daemon=True)
                self._thread.start()
        return step

    def stop(self) -> None:
        """Closes every open step: the status line is cleared and stays so (before other output takes over)."""
        with self._lock:
            self._shown.clear()
            self._erase()
            self.stream.flush()

    def _redraw(self, step: "Activity") -> None:
        with self._lock:
            if self._shown and self._shown[-1] is step:
                self._erase()
                self._draw()
                self.stream.flush()

    def _close(self, step: "Activity") -> None:
        with self._lock:
            if step in self._shown:
                self._shown.remove(step)
                self._erase()
                self._draw()
                self.stream.flush()

    def _refresh(self) -> None:
        while True:
            time.sleep(REFRESH_S)
            with self._lock:
                if not self._shown:
                    self._thread = None
                    return
                self._frame += 1
                try:
                    self._erase()
                    self._draw()
                    self.stream.flush()
                except (OSError, ValueError):  # the terminal went away: stop drawing, never raise
                    self._shown.clear()

    def _erase(self) -> None:
        if self._drawn:
            self.stream.write(ERASE)
            self._drawn = False

    def _draw(self) -> None:
        if not self._shown:
            return
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            width = 80
        frames = FRAMES if "utf" in (getattr(self.stream, "encoding", "") or "").lower() else ASCII_FRAMES
        spinner, width = frames[self._frame % len(frames)], max(10, width - 1)
        for brevity in range(len(LEVELS)):
            line = f"{spinner} {self._shown[-1].line(brevity)}"
            if len(line) <= width:
                break
        self.stream.write(fit(line, width))  # one row: a wrapped line could not be erased
        self._drawn = True


def fit(text: str, width: int) -> str:
    """`text` cut to `width` terminal cells (wide characters count two)."""
    from rich.cells import cell_len, set_cell_size

    if len(text) <= width // 2 or cell_len(text) <= width:
        return text
    return set_cell_size(text, width - 1) + "…"


class Activity:
    """One step on the status line: its counts, and when each outstanding node began (oldest first)."""

    def __init__(self, progress: Progress, label: str, total: Optional[int], reached: str, answered: str,
                 limit: Optional[float] = None, short: Optional[str] = None):
        self._progress, self._lock = progress, progress._lock
        self.label, self.total, self.words, self.limit = clean(label), total, (reached, answered), limit
        self.short = clean(short) if short else self.label
        self.began = time.monotonic()
        self.step = self.then = ""
        self.waiting = {}  # name -> monotonic start; insertion order: the first waited for longest
        self.reached = self.answered = self.failed = 0

    def __enter__(self) -> "Activity":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._progress._close(self)

    def note(self, step: str, then: str = "") -> None:
        """What the step is doing now (e.g. "starting ranks"), and `then`, once every node is reached."""
        with self._lock:
            if (self.step, self.then) != (clean(step), clean(then)):
                self.step, self.then = clean(step), clean(then)
                self._progress._redraw(self)

    def moved(self, name: str) -> None:
        """`name` got further (still outstanding): it is named after those that have not moved since, so the
        nodes named first are the ones holding the step back (its start time stays: the seconds shown)."""
        with self._lock:
            if name in self.waiting:
                self.waiting[name] = self.waiting.pop(name)

    def start(self, name: str) -> None:
        with self._lock:
            self.waiting[name] = time.monotonic()

    def starts(self, names: Iterable[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for name in names:
                self.waiting[name] = now

    def reach(self, name: str) -> None:
        with self._lock:
            self.reached += 1

    def done(self, name: str, ok: bool = True) -> None:
        with self._lock:
            self.waiting.pop(name, None)
            if ok:
                self.answered += 1
            else:
                self.failed += 1

    def line(self, brevity: int = 0) -> str:
        """The status line's text (under the progress's lock), made shorter by `brevity` (LEVELS)."""
        now = time.monotonic()
        step = self.then if self.then and self.total is not None and self.reached >= self.total else self.step
        short, keep_step, counted, named, more_said = LEVELS[brevity]
        if 0 < brevity < WITHOUT_STEP and not step:  # nothing to keep over the counts
            short, keep_step, counted, named, more_said = LEVELS[WITHOUT_STEP]
        parts = [(self.short if short else self.label) + (f": {step}" if step and keep_step else "")]
        if self.total is not None and counted:
            reached, answered = self.words
            counts = f"{self.reached}/{self.total} {reached}" if reached and counted > 1 else \
                f"{self.answered}/{self.total} {answered}"
            if reached and counted > 1:
                counts += f", {self.answered} {answered}"
            parts.append(counts + (f", {self.failed} failed" if self.failed else ""))
        if self.waiting:
            names = []
            for name in self.waiting:  # the oldest first; the dict keeps its insertion order
                names.append(name)
                if len(names) == named:
                    break
            since = self.waiting[names[0]]
            more = len(self.waiting) - len(names)
            parts.append("waiting for " + ", ".join(clean(n, NAME_MAX) for n in names)
                         + (f" and {more} more" if more and more_said else "") + f" ({now - since:.1f} s{self._of()})")
        else:
            parts.append(f"{now - self.began:.1f} s{self._of()}")
        return " · ".join(parts)

    def _of(self) -> str:
        return f" of {self.limit:.0f} s" if self.limit is not None else ""


class _Quiet(Activity):
    """The step when nothing is drawn: every call does nothing."""

    def __init__(self):
        pass

    def close(self) -> None:
        pass

    def note(self, step: str, then: str = "") -> None:
        pass

    def moved(self, name: str) -> None:
        pass

    def start(self, name: str) -> None:
        pass

    def starts(self, names: Iterable[str]) -> None:
        pass

    def reach(self, name: str) -> None:
        pass

    def done(self, name: str, ok: bool = True) -> None:
        pass


_QUIET = _Quiet()
