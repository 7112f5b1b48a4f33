"""A SLURM batch script as sbatch and the shell will run it: its #SBATCH directives (and the SBATCH_* input
environment variables, which override them), the allocation they ask for, and its launch lines (`srun`, the
launchers, and what each task runs), with the variables the script sets.

What sbatch does (sbatch(1), Slurm 22.05): it takes the options of the `#SBATCH` lines before the first line that
is neither a comment nor blank, as literal text (no shell expands them); the SBATCH_* environment variables override
them; the first line must start with `#!`. The script then runs once, in the batch step on the first node, where
SLURM_PROCID and SLURM_NODEID are 0: a variable in a launch line expands there, once, unless it is single-quoted
or escaped into a shell the task runs (`srun bash -c '... $SLURM_PROCID'`).

The reader is one linear pass over the text, a shell word scanner that keeps the quoting of each part; it never
runs anything. It follows what bash(1) does with the forms real scripts use: a function's body is read where the
function is called, with the call's words as $1... $@; of a `case` whose word it knows (the directives' SLURM_NNODES,
a variable the script sets) only the branch that matches runs; an array's elements are words ("${ARGS[@]}"); a
file written from a heredoc holds the body as written (a quoted delimiter) or as the batch shell expands it. What
the script computes at run time (`$(...)`, a variable set by a command, SLURM's own SLURM_* variables) stays unknown
and is said so; a part it cannot follow (a heredoc it runs, a task that runs another script, a function never
called) is listed in `unread`.
"""
from __future__ import annotations

import ast
import dataclasses
import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from preflight.inputs import launchcmd
from preflight.inputs.documents import InputError, read_regular

# Real batch scripts are a few KiB; Slurm's own bound is max_script_size (SchedulerParameters, slurm.conf(5); 4 MB by
# default). Past 1 MiB the file is refused, which keeps the read within seconds.
MAX_BYTES = 1024 * 1024
MAX_NOTES = 50  # lines of `unread` kept
MAX_STEPS = 64  # launch and helper lines read; past them, one note says how many more were not
MAX_CALLS = 8  # functions called inside functions, read that deep

# sbatch's short options that take a value, as the long option they stand for (sbatch(1)).
SBATCH_SHORT = {"-N": "nodes", "-n": "ntasks", "-G": "gpus", "-c": "cpus-per-task", "-J": "job-name",
                "-p": "partition", "-t": "time", "-o": "output", "-e": "error", "-D": "chdir", "-w": "nodelist",
                "-A": "account", "-a": "array", "-C": "constraint", "-x": "exclude", "-q": "qos", "-d": "dependency",
                "-i": "input", "-m": "distribution", "-F": "nodefile", "-M": "clusters", "-L": "licenses",
                "-S": "core-spec", "-b": "begin"}
SBATCH_SHORT_FLAGS = {"-H": "hold", "-k": "no-kill", "-O": "overcommit", "-Q": "quiet", "-s": "oversubscribe",
                      "-v": "verbose", "-W": "wait", "-h": "help", "-V": "version", "-I": "immediate"}
ALIASES = {"tasks-per-node": "ntasks-per-node", "mem-per-node": "mem", "workdir": "chdir"}
# The SBATCH_* input environment variables this reader uses, as the option each stands for (sbatch(1) of Slurm
# 22.05, INPUT ENVIRONMENT VARIABLES; SBATCH_NODES, SBATCH_NTASKS and SBATCH_NTASKS_PER_NODE are not among them).
SBATCH_ENV = {"SBATCH_GPUS": "gpus", "SBATCH_GPUS_PER_NODE": "gpus-per-node", "SBATCH_GPUS_PER_TASK": "gpus-per-task",
              "SBATCH_GRES": "gres", "SBATCH_EXPORT": "export", "SBATCH_DISTRIBUTION": "distribution",
              "SBATCH_EXCLUSIVE": "exclusive", "SBATCH_PARTITION": "partition", "SBATCH_CPUS_PER_GPU": "cpus-per-gpu"}

# srun's options that take no value, and those whose value is optional (getopt: given only as `--opt=V`).
SRUN_FLAGS = frozenset("""
label unbuffered overlap overcommit no-kill quiet verbose pty exact whole multi-prog disable-status no-allocate
test-only preserve-env mpi-combine no-mpi-combine help usage version wait-all-nodes spread-job use-min-nodes
oversubscribe contiguous hold send-libs no-send-libs
""".split())
SRUN_OPTIONAL = frozenset("exclusive kill-on-bad-exit immediate cpu-bind mem-bind accel-bind".split())
SRUN_SHORT = {"-N": "nodes", "-n": "ntasks", "-c": "cpus-per-task", "-G": "gpus", "-w": "nodelist", "-x": "exclude",
              "-p": "partition", "-t": "time", "-J": "job-name", "-o": "output", "-e": "error", "-i": "input",
              "-D": "chdir", "-m": "distribution", "-W": "wait", "-A": "account", "-r": "relative", "-T": "threads",
              "-C": "constraint", "-d": "dependency", "-L": "licenses", "-q": "qos", "-S": "core-spec"}
SRUN_SHORT_FLAGS = {"-l": "label", "-u": "unbuffered", "-K": "kill-on-bad-exit", "-k": "no-kill", "-O": "overcommit",
                    "-Q": "quiet", "-v": "verbose", "-X": "disable-status", "-Z": "no-allocate", "-s": "oversubscribe",
                    "-h": "help", "-I": "immediate", "-E": "preserve-env", "-H": "hold"}

# What SLURM sets differently in every task (srun(1), OUTPUT ENVIRONMENT VARIABLES), with its value in the batch
# step, which is task 0 on node 0 (sbatch(1)).
PER_TASK = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURMD_NODENAME": None,
            "SLURM_STEP_ID": None, "SLURM_TOPOLOGY_ADDR": None, "HOSTNAME": None, "SLURM_TASK_PID": None}
# Programs whose output a script uses for the head's address; run per task they give each node its own.
HOST_COMMANDS = ("hostname", "hostname -i", "hostname -I", "hostname --ip-address", "hostname -f")
LAUNCHERS = ("accelerate", "torchrun", "deepspeed", "python")
SHELLS = ("bash", "sh", "zsh", "dash")
CONTAINER_VALUE_OPTIONS = frozenset("-B --bind --env --home -H --pwd -W --workdir --overlay -o".split())

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])?(\+?=)")
KEYWORDS = frozenset("then do else elif ! time exec nohup command builtin { ( }".split())


# ---- words -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seg:
    """A part of a shell word: literal text, a parameter ($NAME, ${...}), a substitution ($(...), `...`, $((...)))."""

    kind: str  # "lit", "var", "sub", "arith", "array"
    text: str  # the literal text; the parameter's text inside ${}; the substitution's inside text
    quote: str = ""  # "'", '"' or "" (bare)
    unset: Tuple[str, ...] = ()  # a piece of a split $VAR: the variables in it set nowhere, unless in a sourced file


Word = Tuple[Seg, ...]


@dataclass
class Command:
    """One simple command of the script, with the line it starts on."""

    line: int
    words: List[Word]
    background: bool = False
    heredoc: Optional[str] = None  # the body of a heredoc fed to it
    redirects: List[Word] = field(default_factory=list)  # the targets of its redirections (> FILE, < FILE)
    heredoc_quoted: bool = False  # its delimiter quoted (<<'EOF', <<"EOF", <<\EOF): the body is literal text
    heredoc_line: int = 0  # the body's first line
    patterns: Optional[List[str]] = None  # a case branch's patterns (`0|1)`): this "command" opens the branch
    defines: Optional[str] = None  # `NAME()`: a function definition; its body follows


def _plain(word: Word) -> str:
    """The word's text as written, quotes removed, expansions as written ($NAME, $(cmd))."""
    out = []
    for seg in word:
        if seg.kind == "lit":
            out.append(seg.text)
        elif seg.kind == "var":
            out.append("${" + seg.text + "}" if not NAME.fullmatch(seg.text) else "$" + seg.text)
        elif seg.kind == "arith":
            out.append("$((" + seg.text + "))")
        elif seg.kind == "array":
            out.append("(" + seg.text + ")")
        else:
            out.append("$(" + seg.text + ")")
    return "".join(out)


class _Scanner:
    """The shell's words and commands of a text, in one pass: quotes, escapes, continuations, comments,
    $VAR/${...}/$(...)/`...`/$((...)), separators (newline ; & | && ||), redirections and heredocs."""

    def __init__(self, text: str, first_line: int = 1):
        self.s, self.i, self.line = text, 0, first_line
        self.commands: List[Command] = []
        self.pending_heredocs: List[Tuple[str, bool, Command]] = []
        self.current = Command(first_line, [])
        self.cases = 0  # `case ... in` open
        self.pattern_next = False  # after `in` or `;;`: the words up to `)` are a branch's patterns

    def run(self) -> List[Command]:
        s = self.s
        words: List[Word] = []
        start = self.line
        while self.i < len(s):
            c = s[self.i]
            if c == "\n":
                self._end(words, start)
                self.i += 1
                self.line += 1
                self._heredoc_bodies()
                words, start = [], self.line
                continue
            if c in " \t\r":
                self.i += 1
                continue
            if c == "\\" and s[self.i + 1:self.i + 2] == "\n":
                self.i += 2
                self.line += 1
                continue
            if c == "#":
                while self.i < len(s) and s[self.i] != "\n":
                    self.i += 1
                continue
            if c == "|" and self.pattern_next and words:  # `0|1)`: one branch, several patterns
                self.i += 1
                continue
            if c in ";&|":
                two = s[self.i:self.i + 2]
                if c == "&" and s[self.i + 1:self.i + 2] == ">":  # &> file: a redirection
                    self.i += 2
                    self._redirect_target()
                    continue
                self.i += 2 if two in ("&&", "||", ";;") else 1
                self._end(words, start, background=c == "&" and two != "&&")
                words, start = [], self.line
                self.pattern_next = self.pattern_next or (two == ";;" and self.cases > 0)
                continue
            if c == ")" and words and self._case_branch(words, start):
                self.i += 1
                words, start = [], self.line
                continue
            if c == "(" and (len(words) == 1 or len(words) == 2 and _plain(words[0]) == "function") and \
                    re.match(r"\(\s*\)", s[self.i:self.i + 8]):  # NAME() or function NAME(): a function
                self.i = s.index(")", self.i) + 1
                self.current.defines = _plain(words[-1])
                self._end(words, start)
                words, start = [], self.line
                continue
            if c in "()" and not words:
                self.i += 1
                continue
            if c in "<>":
                if s.startswith("<<", self.i) and not s.startswith("<<<", self.i):
                    self.i += 2
                    strip = s[self.i:self.i + 1] == "-"
                    self.i += strip
                    while self.i < len(s) and s[self.i] in " \t":
                        self.i += 1
                    at = self.i
                    delimiter = _plain(self._word())
                    self.current.heredoc_quoted = any(q in s[at:self.i] for q in "'\"\\")  # bash(1), Here Documents
                    self.pending_heredocs.append((delimiter, strip, self.current))
                    continue
                self.i += 1
                while self.i < len(s) and s[self.i] in "<>&|":
                    self.i += 1
                self._redirect_target()
                continue
            at = self.i
            word = self._word()
            if word:
                words.append(word)
            if self.i == at:  # a bracket the word stops at (a subshell's, a group's): no word of its own
                self.i += 1
        self._end(words, start)
        return self.commands

    def _redirect_target(self) -> None:
        s = self.s
        while self.i < len(s) and s[self.i] in " \t":
            self.i += 1
        if self.i < len(s) and s[self.i] not in "\n;&|":
            self.current.redirects.append(self._word())

    def _end(self, words: List[Word], start: int, background: bool = False) -> None:
        cmd, self.current = self.current, Command(self.line, [])
        if words or cmd.heredoc is not None or any(cmd is pending for _, _, pending in self.pending_heredocs):
            cmd.line, cmd.words, cmd.background = start, list(words), background
            self.commands.append(cmd)
            first, last = _plain(words[0]) if words else "", _plain(words[-1]) if words else ""
            if first == "case" and last == "in" and len(words) == 3:
                self.cases += 1
                self.pattern_next = True
            elif first == "esac":
                self.cases = max(0, self.cases - 1)
                self.pattern_next = False

    def _case_branch(self, words: List[Word], start: int) -> bool:
        """A `)` that closes a case branch's patterns (`0)`, `0|1)`, `case $X in 0)` on one line): the patterns
        become a branch command of their own. False for any other `)`."""
        plain = [_plain(w) for w in words]
        if len(plain) > 3 and plain[0] == "case" and plain[2] == "in":  # case WORD in PATTERN) on one line
            self._end(words[:3], start)
            plain = plain[3:]
        elif not self.pattern_next:
            return False
        self.pattern_next = False
        self.commands.append(Command(start, [], patterns=[p.lstrip("(") for p in plain]))
        return True

    def _heredoc_bodies(self) -> None:
        """After a line that opened heredocs, their bodies, up to each delimiter line."""
        s = self.s
        while self.pending_heredocs:
            delimiter, strip, cmd = self.pending_heredocs.pop(0)
            body, first = [], self.line
            while self.i < len(s):
                end = s.find("\n", self.i)
                end = len(s) if end < 0 else end
                text = s[self.i:end]
                self.i = min(len(s), end + 1)
                self.line += 1
                if (text.lstrip("\t") if strip else text) == delimiter:
                    break
                body.append(text.lstrip("\t") if strip else text)
            cmd.heredoc, cmd.heredoc_line = "\n".join(body), first

    def _word(self) -> Word:
        s, segs, lit = self.s, [], []
        quote, opened = "", 0  # opened: len(segs) when the quote opened (an empty '' or "" is still a word)

        def flush():
            if lit:
                segs.append(Seg("lit", "".join(lit), quote))
                lit.clear()

        while self.i < len(s):
            c = s[self.i]
            if not quote and (c in " \t\r\n;&|<>" or (c in "()" and not segs and not lit)):
                break
            if not quote and c == "(" and not segs and NAME.fullmatch("".join(lit)) and \
                    re.match(r"\(\s*\)", s[self.i:self.i + 8]):  # NAME(): a function's name, a word of its own
                break
            if not quote and c == "(" and (lit and lit[-1].endswith("=") or segs):  # name=( ... ): an array
                flush()
                segs.append(Seg("array", self._balanced("(", ")"), ""))
                continue
            if c == "\x00" and s[self.i + 1:self.i + 2] == "(":  # a $(...) the batch step left to run time (task_text)
                self.i += 1
                lit.append("\x00(" + self._balanced("(", ")") + ")")
                continue
            if not quote and c == ")":
                break
            if c == "\\":
                nxt = s[self.i + 1:self.i + 2]
                if quote == "'":  # no escapes inside single quotes, a backslash-newline included
                    lit.append(c)
                    self.i += 1
                    continue
                if nxt == "\n":  # a continuation, bare or inside double quotes
                    self.i += 2
                    self.line += 1
                    continue
                if quote == '"' and nxt not in '$`"\\':
                    lit.append(c)
                    self.i += 1
                    continue
                lit.append(nxt)
                self.i += 2
                continue
            if quote == "'":
                if c == "'":
                    flush()
                    if len(segs) == opened:
                        segs.append(Seg("lit", "", quote))
                    quote = ""
                else:
                    lit.append(c)
                    self.line += c == "\n"
                self.i += 1
                continue
            if c == "'" and not quote:
                flush()
                quote, opened = "'", len(segs)
                self.i += 1
                continue
            if c == '"':
                flush()
                if quote == '"' and len(segs) == opened:
                    segs.append(Seg("lit", "", quote))
                quote, opened = ("", opened) if quote == '"' else ('"', len(segs))
                self.i += 1
                continue
            if c == "$" and s[self.i + 1:self.i + 2] == "'" and not quote:  # $'...': ANSI-C quoting, read as literal
                self.i += 1
                continue
            if c == "$":
                seg = self._dollar(quote)
                if seg is not None:
                    flush()
                    segs.append(seg)
                    continue
            if c == "`":
                flush()
                self.i += 1
                end = s.find("`", self.i)
                end = len(s) if end < 0 else end
                segs.append(Seg("sub", s[self.i:end], quote))
                self.line += s.count("\n", self.i, end)
                self.i = end + 1
                continue
            lit.append(c)
            self.line += c == "\n"
            self.i += 1
        flush()
        return tuple(segs)

    def _dollar(self, quote: str) -> Optional[Seg]:
        s, i = self.s, self.i + 1
        if s.startswith("((", i):
            self.i = i
            inner = self._balanced("(", ")")
            return Seg("arith", inner[1:-1] if inner.startswith("(") and inner.endswith(")") else inner, quote)
        if s.startswith("(", i):
            self.i = i
            return Seg("sub", self._balanced("(", ")"), quote)
        if s.startswith("{", i):
            self.i = i
            return Seg("var", self._balanced("{", "}"), quote)
        m = NAME.match(s, i)
        if m:
            self.i = m.end()
            return Seg("var", m.group(0), quote)
        if i < len(s) and s[i] in "0123456789@*#?$!-":
            self.i = i + 1
            return Seg("var", s[i], quote)
        return None

    def _balanced(self, open_: str, close: str) -> str:
        """The text between an opening bracket at self.i and its match (quotes skipped); moves past it."""
        s, depth, j = self.s, 0, self.i
        while j < len(s):
            c = s[j]
            if c == "\\":
                j += 2
                continue
            if c in "'\"" and open_ != "{":
                end = s.find(c, j + 1)
                j = len(s) if end < 0 else end + 1
                continue
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    break
            j += 1
        inner = s[self.i + 1:j]
        self.line += inner.count("\n")
        self.i = min(len(s), j + 1)
        return inner


def scan(text: str, first_line: int = 1) -> List[Command]:
    return _Scanner(text, first_line).run()


# ---- values ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Var:
    """A variable the script sets: its value when it reads as one (None: computed at run time), where it is set."""

    value: Optional[str]
    line: int
    exported: bool
    text: str  # as written
    per_task: bool = False  # set inside a task's shell
    expanded: Optional[str] = None  # the value with its run-time parts marked (see Scope.render), when not known
    unset_unless_sourced: Tuple[str, ...] = ()  # the variables in it set nowhere, unless in a sourced file
    array: Optional[Tuple[str, ...]] = None  # an array's elements (marked as Scope.render marks), when they are known


@dataclass
class Rendered:
    """A word after the shell expanded what it could: its text, and where its unknown parts come from."""

    text: str
    unknown: List[str] = field(default_factory=list)  # what is computed at run time (as written)
    batch_task_vars: List[str] = field(default_factory=list)  # per-task variables expanded in the batch step
    task_vars: List[str] = field(default_factory=list)  # per-task variables expanded in each task
    host_commands: List[str] = field(default_factory=list)  # $(hostname) and the like, and where (batch or task)
    unset: List[str] = field(default_factory=list)  # variables set nowhere (empty when the shell expands them)
    unset_unless_sourced: List[str] = field(default_factory=list)  # set nowhere, unless in a file it sources


def _arith(expr: str) -> Optional[int]:
    """A shell arithmetic expression of whole numbers, + - * / % and brackets, else None (never eval)."""
    if len(expr) > 200 or not re.fullmatch(r"[\d\s+\-*/%()]+", expr):
        return None
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Mod)):
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if b == 0:
                raise ValueError
            return int(a / b) if isinstance(node.op, ast.Div) else a % b  # the shell truncates toward zero
        raise ValueError

    try:
        result = value(tree.body)
    except (ValueError, RecursionError):
        return None
    return result if abs(result) < 10**12 else None


class Scope:
    """The variables a shell knows at one level: the batch step's, or a task's (what the batch step exports, the
    task's own SLURM variables, what the task's shell sets)."""

    def __init__(self, known: Mapping[str, Var], level: str):
        self.vars: Dict[str, Var] = dict(known)
        self.level = level  # "batch" or "task"

    def render(self, word: Word) -> Rendered:
        """The word as this shell expands it, marked: a per-task variable the batch step expands as \\x01NAME\\x02,
        the `$` of a part known only at run time as \\x00 (finish() turns them into text and notes)."""
        out = Rendered("")
        parts = []
        for seg in word:
            if seg.kind == "lit":
                parts.append(seg.text)
                out.unset_unless_sourced.extend(seg.unset)
            elif seg.kind == "var":
                parts.append(self._param(seg.text, out))
            elif seg.kind == "arith":
                expr = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: self._param(m.group(1), out), seg.text)
                expr = re.sub(r"\b([A-Za-z_][A-Za-z0-9_]*)\b", lambda m: self._param(m.group(1), out), expr)
                number = _arith(expr)
                if number is None:
                    out.unknown.append(f"$(({seg.text}))")
                    parts.append(f"\x00(({seg.text}))")
                else:
                    parts.append(str(number))
            else:
                written = _plain((seg,))
                command = " ".join(seg.text.split())
                if command in HOST_COMMANDS or command.startswith("hostname "):
                    out.host_commands.append(f"{written} ({self.level})")
                out.unknown.append(written)
                parts.append(re.sub(r"\s", "\x03", written.replace("$", "\x00")))  # one word, as the shell keeps it
        out.text = "".join(parts)
        return out

    def split(self, words: Sequence[Word]) -> List[Word]:
        """The words after the shell's word splitting (still to be rendered: each piece literal, its run-time parts
        marked)."""
        found: List[Word] = []
        for word in words:
            r = self.render(word)
            pieces = _pieces(word, r.text)
            if pieces is None:
                found.append(word)
                continue
            names = r.unset_unless_sourced
            found.extend((Seg("lit", piece, "", tuple(n for n in names if piece in ("\x00" + n, "\x00{" + n + "}"))),)
                         for piece in pieces)
        return found

    def words(self, words: Sequence[Word]) -> List[Rendered]:
        """The words after expansion and the shell's word splitting, finished."""
        found = []
        for word in words:
            r = self.render(word)
            pieces = _pieces(word, r.text)
            if pieces is not None:
                for piece in pieces:
                    found.append(finish(Rendered(piece, list(r.unknown), list(r.batch_task_vars),
                                                 list(r.task_vars), list(r.host_commands), list(r.unset),
                                                 list(r.unset_unless_sourced))))
            elif not r.text and not any(seg.quote for seg in word):
                continue  # an unquoted word that expands to nothing is no word at all
            else:
                found.append(finish(r))
        return found

    def _param(self, text: str, out: Rendered) -> str:
        m = NAME.match(text)
        name = m.group(0) if m else text
        rest = text[m.end():] if m else ""
        var = self.vars.get(name)  # (set nowhere: None)
        if var is not None and var.array is not None and (not rest or re.fullmatch(r"\[(@|\*|\d+)\]", rest)):
            index = rest[1:-1] if rest else "0"  # $NAME is its first element
            if index in ("@", "*"):
                return "\x04".join(var.array)  # one word each (Scope.words), "${NAME[@]}" quoted or not
            return var.array[int(index)] if int(index) < len(var.array) else ""
        if var is not None and var.array is not None and rest.startswith("["):
            out.unknown.append(f"${{{text}}} (an element chosen at run time)")
            return "\x00{" + text + "}"
        if name in PER_TASK and (not rest or rest.startswith((":-", "-"))):  # SLURM sets it: a default is unused
            if self.level == "batch":
                out.batch_task_vars.append(name)
                return "\x01" + name + "\x02"
            out.task_vars.append(name)
            return "$" + name
        if var is not None and var.per_task:
            out.task_vars.append(name)
        if var is not None and not rest and (var.value is not None or var.expanded is not None):
            if var.value is None:
                out.unknown.append(f"${name} (set on line {var.line} to {var.text})")
                out.unset_unless_sourced.extend(var.unset_unless_sourced)
            return var.value if var.value is not None else var.expanded
        if var is None and self.level == "task" and name in self.unexported and not rest:
            out.unknown.append(f"${name} (empty in the task: set in the batch step, not exported)")
            return ""
        if var is None and name in self.environ and not rest:  # sbatch exports the submitting environment
            return self.environ[name]
        if rest.startswith((":-", "-")) and (var is None or var.value is not None):  # ${NAME:-default}
            value = var.value if var is not None else self.environ.get(name)
            default = rest.split("-", 1)[1]
            if value is not None and (value or rest.startswith("-")):
                return value
            if "$" not in default and "`" not in default:
                return default.strip('"\'')
        written = "${" + text + "}" if rest or not NAME.fullmatch(text) else "$" + text
        # SLURM sets its SLURM_* output variables in the batch step and the tasks (sbatch(1), srun(1)): set, their
        # values known at run time
        if var is None and NAME.fullmatch(text) and name not in self.environ and not name.startswith("SLURM_"):
            if not self.sourced:
                out.unset.append(name)  # set nowhere the reader sees: the shell expands it to nothing
                return ""
            out.unset_unless_sourced.append(name)
        if var is not None:
            out.unknown.append(f"{written} (set on line {var.line} to {var.text})")
        else:
            out.unknown.append(written)
        return "\x00" + written[1:]

    unexported: frozenset = frozenset()
    environ: Mapping[str, str] = {}
    sourced: bool = False  # the script sources a file before this point: a variable may be set there


def _pieces(word: Word, text: str) -> Optional[List[str]]:
    """The words one rendered word becomes, or None where it stays one: "${A[@]}" and "$@" one word per element
    (marked \\x04, quoted or not), an unquoted $VAR of several words split on blanks."""
    if "\x04" in text:
        return text.split("\x04")
    if len(word) == 1 and word[0].kind == "var" and not word[0].quote and len(text.split()) > 1:
        return text.split()
    return None


def finish(r: Rendered) -> Rendered:
    """A rendered word as text: per-task variables the batch step expanded take their batch-step value (noted),
    run-time parts are written as they are (`$NAME`, `$(cmd)`)."""
    for name in re.findall("\x01([A-Za-z_]+)\x02", r.text):
        r.batch_task_vars.append(name)
    text = re.sub("\x01([A-Za-z_]+)\x02", lambda m: PER_TASK.get(m.group(1)) or "$" + m.group(1), r.text)
    r.text = text.replace("\x00", "$").replace("\x03", " ").replace("\x04", " ")
    r.batch_task_vars = list(dict.fromkeys(r.batch_task_vars))
    return r


# ---- the script ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Directive:
    option: str  # the long option, without dashes: nodes, ntasks-per-node, gpus-per-node, gres, ...
    value: Optional[str]  # None for a flag
    line: int  # 0 for an environment variable
    text: str  # the line (or NAME=value) as written
    source: str = "#SBATCH"  # or the environment variable's name


@dataclass(frozen=True)
class Step:
    """A line that starts the job's processes: srun with what each task runs, or a launcher run in the batch step."""

    line: int
    text: str  # the command as written, whole (a report shortens it)
    srun: Optional[Mapping[str, str]]  # srun's options (long names; "" for a flag); None without srun
    command: launchcmd.LaunchCommand  # what runs (the launcher), words expanded where the script tells their value
    words: Tuple[Rendered, ...]  # the launcher's words with where their unknown parts come from
    in_task_shell: bool = False  # run by a shell in each task (srun bash -c '...')
    loop: bool = False  # inside a for/while loop
    conditional: bool = False  # inside an if/case
    background: bool = False
    chosen_by: Optional[str] = None  # the per-task value a `case` in each task picks this launch by ($SLURM_PROCID)
    alternatives: Tuple["Step", ...] = ()  # with chosen_by: the launches of the case's other branches

    def value_of(self, *options: str) -> Optional[Rendered]:
        """The rendered word given as the value of one of the launcher's options (the last one given)."""
        found = None
        argv = self.command.argv
        for k, word in enumerate(argv):
            if word == "--" or (k > 0 and self.command.script is not None and k >= len(argv) - len(
                    self.command.script_args)):
                break
            name, eq, value = word.partition("=")
            if name.startswith("--") and launchcmd.canonical(name) in options:
                if eq:
                    found = Rendered(value, *_info(self.words[k]))
                elif k + 1 < len(argv):
                    found = self.words[k + 1]
        return found


def _info(r: Rendered):
    return r.unknown, r.batch_task_vars, r.task_vars, r.host_commands, r.unset, r.unset_unless_sourced


@dataclass(frozen=True)
class Allocation:
    """What the directives ask SLURM for (None where they do not say, or say it in a way not read here)."""

    nodes: Optional[int]
    nodes_text: Optional[str]
    ntasks: Optional[int]
    tasks_per_node: Optional[int]
    gpus_per_node: Optional[int]
    gpus_per_task: Optional[int]
    gpus: Optional[int]


@dataclass(frozen=True)
class Heredoc:
    """A file the script writes from a heredoc (`cat > FILE <<EOF`), as it will hold it."""

    name: str  # the file as the script names it, expanded (its run-time parts as written)
    line: int  # the line of the command that writes it
    body_line: int  # the script's line of the body's first line
    text: str  # the body as the file will hold it (an unquoted heredoc expanded as the batch shell expands it)
    runtime: Tuple[str, ...] = ()  # what in the body is computed at run time, as written; empty: the text is literal
    unset: Tuple[str, ...] = ()  # variables in the body the script sets nowhere: the shell writes nothing for them

    def document_text(self) -> str:
        """The body with as many newlines before it as there are script lines above it: read as the config, every
        key keeps the script's line number."""
        return "\n" * (self.body_line - 1) + self.text


@dataclass(frozen=True)
class BatchScript:
    path: str
    directives: Mapping[str, Directive]  # the option sbatch takes, the environment's over the script's
    literal: Tuple[Directive, ...]  # directives with a $ or ` in them: sbatch takes the text as it is
    ignored: Tuple[Directive, ...]  # #SBATCH lines after the first command: sbatch never reads them
    first_command_line: Optional[int]
    overridden: Tuple[Tuple[Directive, Directive], ...]  # (the script's directive, the environment's)
    variables: Mapping[str, Var]
    steps: Tuple[Step, ...]
    helpers: Tuple[Tuple[int, str], ...]  # sruns that run something else (hostname, nvidia-smi, ...)
    unread: Tuple[Tuple[int, str], ...]  # what was not read, and why
    written_files: Mapping[str, int]  # files the script writes (cat > FILE <<EOF), by line
    sourced: Tuple[str, ...] = ()  # files it sources (their variables are not read)
    heredocs: Mapping[str, Heredoc] = field(default_factory=dict)  # what those files hold, by name

    def named_configs(self) -> List[Tuple[str, str, Heredoc]]:
        """The config files the launch names that this script writes from a heredoc: (what reads it, "accelerate"
        or "deepspeed"; the option that names it; the heredoc)."""
        if self.main is None:
            return []
        command, found = self.main.command, []
        named = [("accelerate", "--config_file", command.get("config_file") if command.launcher == "accelerate"
                  else None), ("deepspeed", "--deepspeed_config_file", command.get("deepspeed_config_file"))]
        named += [("deepspeed", option, value) for option, value in deepspeed_files_named(command)]
        for reader, option, value in named:
            heredoc = self.written(value)
            if heredoc is not None and all(heredoc is not h for _, _, h in found):
                found.append((reader, option, heredoc))
        return found

    def written(self, named: Optional[str]) -> Optional[Heredoc]:
        """The heredoc that writes the file a launch names (as it names it: `./ds.json` and `ds.json` alike)."""
        if not isinstance(named, str):
            return None
        key = os.path.normpath(named)
        return next((h for name, h in self.heredocs.items() if os.path.normpath(name) == key), None)

    @property
    def allocation(self) -> Allocation:
        return allocation(self.directives)

    @property
    def main(self) -> Optional[Step]:
        """The step that starts the training: the first that runs a launcher (srun's before the batch step's), else
        the first that runs a Python script (srun's first: a `python prep.py` in the batch step is a helper where an
        srun starts the job)."""
        for launchers in (LAUNCHERS[:-1], LAUNCHERS[-1:]):
            for in_srun in (True, False):
                found = next((s for s in self.steps if s.command.launcher in launchers and
                              (s.srun is not None) == in_srun), None)
                if found is not None:
                    return found
        return None

    def where(self, line: int) -> str:
        return f"{self.path}:{line}" if line else self.path


def deepspeed_files_named(command: launchcmd.LaunchCommand) -> List[Tuple[str, str]]:
    """The DeepSpeed JSON the launch gives the training script: (option, file) of --deepspeed FILE (the HF
    Trainer's, transformers TrainingArguments.deepspeed) and --deepspeed_config FILE (DeepSpeed's own,
    deepspeed.add_config_arguments)."""
    args, found = list(command.script_args), []
    for k, word in enumerate(args):
        name, eq, value = word.partition("=")
        if name in ("--deepspeed", "--deepspeed_config"):
            path = value if eq else (args[k + 1] if k + 1 < len(args) else "")
            if path and not path.startswith("-"):
                found.append((name, path))
    return found


def _count(value: Optional[str]) -> Optional[int]:
    return int(value) if isinstance(value, str) and re.fullmatch(r"\d{1,6}", value.strip()) else None


def gpu_count(gres: Optional[str]) -> Optional[int]:
    """The GPUs of a --gres (`gpu:8`, `gpu:a100:8`, `gpu`: one) or --gpus-per-node (`8`, `a100:8`) value."""
    if gres is None:
        return None
    for item in gres.split(","):
        parts = item.strip().split(":")
        if parts[0] == "gpu" or (len(parts) <= 2 and parts[-1].isdigit()):
            if parts[0] == "gpu" and len(parts) == 1:
                return 1
            return _count(parts[-1].split("(")[0])
    return None


def allocation(directives: Mapping[str, Directive]) -> Allocation:
    def get(name):
        d = directives.get(name)
        return d.value if d is not None else None

    nodes_text = get("nodes")
    nodes = _count(nodes_text)
    if nodes_text is not None and "-" in nodes_text:  # min-max: SLURM picks
        low, _, high = nodes_text.partition("-")
        nodes = _count(low) if low == high else None
    ntasks = _count(get("ntasks"))
    per_node = _count(get("ntasks-per-node"))
    if nodes_text is None and directives.get("nodes") is None and "nodelist" not in directives:
        nodes = 1 if ntasks is None or per_node is None else max(1, ntasks // max(per_node, 1))
    if per_node is None and ntasks is not None and nodes:
        per_node = ntasks // nodes if ntasks % nodes == 0 else None
    elif per_node is None and ntasks is None:
        per_node = 1  # one task per node, sbatch's default
    gpus = _count(get("gpus").split(":")[-1]) if get("gpus") else None
    per_gpu_node = gpu_count(get("gpus-per-node")) if get("gpus-per-node") else gpu_count(get("gres"))
    if per_gpu_node is None and gpus is not None and nodes:
        per_gpu_node = gpus // nodes if gpus % nodes == 0 else None
    per_task = gpu_count(get("gpus-per-task")) if get("gpus-per-task") else None
    if per_gpu_node is None and per_task is not None and per_node is not None:
        per_gpu_node = per_task * per_node
    return Allocation(nodes, nodes_text, ntasks, per_node, per_gpu_node, per_task, gpus)


def _options(words: Sequence[str], short: Mapping[str, str], short_flags: Mapping[str, str],
             flags=frozenset(), optional=frozenset(), stop_at_word: bool = True):
    """(options, index of the first word that is not one) of sbatch's or srun's getopt; long names."""
    options: Dict[str, Optional[str]] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return options, i + 1
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            name = ALIASES.get(name, name)
            if eq:
                options[name] = value
            elif name in flags or name in optional:
                options[name] = None
            elif i + 1 < len(words):
                options[name] = words[i + 1]
                i += 1
            else:
                options[name] = ""
        elif word.startswith("-") and len(word) >= 2 and word[:2] in short:
            if len(word) > 2:
                options[short[word[:2]]] = word[2:].lstrip("=")
            elif i + 1 < len(words):
                options[short[word[:2]]] = words[i + 1]
                i += 1
        elif word.startswith("-") and len(word) >= 2 and word[:2] in short_flags:
            options[short_flags[word[:2]]] = None
        elif stop_at_word:
            return options, i
        i += 1
    return options, i


def _directive_words(rest: str) -> List[str]:
    """The words of an #SBATCH line after the tag: split on blanks, double quotes kept together, a `#` after a
    blank starts a comment (Slurm's own reading of the line, not a shell's)."""
    words, current, quoted, i = [], [], False, 0
    while i < len(rest):
        c = rest[i]
        if c == '"':
            quoted = not quoted
        elif c in " \t" and not quoted:
            if current:
                words.append("".join(current))
                current = []
        elif c == "#" and not quoted and not current:
            break
        else:
            current.append(c)
        i += 1
    if current:
        words.append("".join(current))
    return words


def load(path: str, environ: Optional[Mapping[str, str]] = None) -> BatchScript:
    """Read a batch script as sbatch and the shell will. Bad input (missing, not a regular file, too large,
    binary, not a batch script) raises InputError naming the file."""
    if not path:
        raise InputError("--sbatch", "the batch script path is empty")
    text = read_regular(path, "batch script", MAX_BYTES)
    if not text.startswith("#!"):  # sbatch: "This does not look like a batch script"
        raise InputError(path, "does not look like a batch script: the first line must start with #! followed by "
                               "the interpreter, as sbatch requires", 1)
    return parse(path, text, os.environ if environ is None else environ)


def parse(path: str, text: str, environ: Mapping[str, str]) -> BatchScript:
    lines = text.split("\n")
    directives: Dict[str, Directive] = {}
    literal, ignored = [], []
    first_command = None
    for number, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if raw.startswith("#SBATCH"):
            rest = raw[len("#SBATCH"):]
            if rest[:1] not in (" ", "\t", ""):
                continue  # #SBATCHX: a comment
            options, _ = _options(_directive_words(rest), SBATCH_SHORT, SBATCH_SHORT_FLAGS, stop_at_word=False)
            for option, value in options.items():
                d = Directive(option, value, number, raw.strip())
                if first_command is not None:
                    ignored.append(d)
                    continue
                if value is not None and ("$" in value or "`" in value):
                    literal.append(d)
                directives[option] = d
        elif first_command is None and stripped and not stripped.startswith("#"):
            first_command = number
    overridden = []
    for name, option in SBATCH_ENV.items():
        if name in environ:
            d = Directive(option, environ[name], 0, f"{name}={environ[name]}", name)
            if option in directives and directives[option].value != d.value:
                overridden.append((directives[option], d))
            directives[option] = d
    reader = _Body(path, directives, environ)
    reader.read(scan(text))
    return BatchScript(path, directives, tuple(literal), tuple(ignored), first_command, tuple(overridden),
                       reader.batch.vars, tuple(reader.steps), tuple(reader.helpers), tuple(reader.unread[:MAX_NOTES]),
                       {name: h.line for name, h in reader.heredocs.items()}, tuple(reader.sourced), reader.heredocs)


def slurm_values(directives: Mapping[str, Directive], environ: Optional[Mapping[str, str]] = None) -> Dict[str, Var]:
    """The allocation's variables SLURM sets in the batch step that the directives tell (sbatch(1), OUTPUT
    ENVIRONMENT VARIABLES); inside the allocation (SLURM_JOB_ID set), the environment's own: what the script's
    $SLURM_NNODES will be, whatever the directives ask (sbatch's command line and SBATCH_* override them)."""
    alloc = allocation(directives)
    known = {}
    if alloc.nodes is not None:
        for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
            known[name] = str(alloc.nodes)
    if alloc.tasks_per_node is not None and "ntasks-per-node" in directives:
        known["SLURM_NTASKS_PER_NODE"] = str(alloc.tasks_per_node)
    if alloc.nodes is not None and alloc.tasks_per_node is not None:
        for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
            known[name] = str(alloc.ntasks or alloc.nodes * alloc.tasks_per_node)
    if alloc.gpus_per_node is not None:
        known["SLURM_GPUS_ON_NODE"] = str(alloc.gpus_per_node)
    if "gpus-per-node" in directives and alloc.gpus_per_node is not None:
        known["SLURM_GPUS_PER_NODE"] = str(alloc.gpus_per_node)
    found = {k: Var(v, 0, True, f"from the directives ({k})") for k, v in known.items()}
    if environ and environ.get("SLURM_JOB_ID"):
        for name in SLURM_COUNTS:
            found.pop(name, None)
            if name in environ:
                found[name] = Var(environ[name], 0, True, f"${name} of this allocation")
    return found


# The batch step's variables that slurm_values tells.
SLURM_COUNTS = ("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS",
                "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")


class _Body:
    """The script's commands read in order: assignments, loops and conditionals, sruns and launchers."""

    def __init__(self, path: str, directives: Mapping[str, Directive], environ: Mapping[str, str]):
        self.path = path
        self.batch = Scope(slurm_values(directives, environ), "batch")
        self.batch.environ = environ
        self.steps: List[Step] = []
        self.helpers: List[Tuple[int, str]] = []
        self.unread: List[Tuple[int, str]] = []
        self.heredocs: Dict[str, Heredoc] = {}
        self.sourced: List[str] = []
        self.skipped = 0  # srun lines past MAX_STEPS
        self.loops = 0
        self.conditionals = 0
        self.functions: Dict[str, Tuple[int, List[Command]]] = {}  # name -> (line, body), read where called
        self.called: List[str] = []  # the function calls being read (a recursion stops at MAX_CALLS)
        self.ever_called: set = set()
        self.cases: List[_Case] = []
        self.branches: Optional[Tuple[str, List[List[Word]]]] = None  # a task's `case` between launches

    def note(self, line: int, why: str) -> None:
        self.unread.append((line, why))

    def read(self, commands: List[Command]) -> None:
        self.block(commands)
        for name, (line, body) in self.functions.items():
            if name not in self.ever_called and any(_runs_srun_or_launcher(c) for c in body):
                self.note(line, f"function {name} is defined but never called: the launch in it does not run")
        if self.skipped:
            self.note(0, f"{self.skipped} more srun lines after the first {MAX_STEPS}: not read")

    def block(self, commands: List[Command]) -> None:
        """Commands in order: a function's body is kept for its calls, a case branch the value rules out skipped."""
        i = 0
        while i < len(commands):
            cmd = commands[i]
            i += 1
            words = [_plain(w) for w in cmd.words]
            name = cmd.defines or (words[1] if words[:1] == ["function"] and len(words) > 1 else None)
            if name is not None and NAME.fullmatch(name):
                body, i = _function_body(commands, i, opened=words[-1:] == ["{"] and len(words) > 1)
                self.functions[name] = (cmd.line, body)
                continue
            if not self.case_command(cmd, words):
                self.command(cmd)

    def case_command(self, cmd: Command, words: List[str]) -> bool:
        """`case WORD in`, a branch's patterns and `esac` (True), and the commands of a branch not taken (True:
        skipped). With WORD known (the directives' SLURM_NNODES, a variable the script sets) only the branch it
        matches runs, as the shell picks it (the first whose pattern matches); else every branch is read."""
        if words[:1] == ["case"] and words[-1:] == ["in"] and len(words) == 3:
            r = self.batch.render(cmd.words[1])
            known = None if "\x00" in r.text else finish(r).text
            self.cases.append(_Case(words[1], known, not self.cases or self.cases[-1].active))
            if known is None and self.cases[-1].active:
                self.conditionals += 1
                self.note(cmd.line, f"case {words[1]}: chosen at run time; every branch is read and the first "
                                    "launch in them judged")
            return True
        if not self.cases:
            return False
        frame = self.cases[-1]
        if cmd.patterns is not None:
            frame.branch(cmd.patterns)
            return True
        if words[:1] == ["esac"]:
            self.cases.pop()
            if frame.value is None and frame.parent_active:
                self.conditionals = max(0, self.conditionals - 1)
            return True
        return not frame.active

    def command(self, cmd: Command) -> None:
        words = list(cmd.words)
        while words and _plain(words[0]) in KEYWORDS:
            words.pop(0)
        if not words:
            return
        head = _plain(words[0])
        if head in self.functions and len(self.called) < MAX_CALLS:
            return self.call(cmd, head, words[1:])
        if head in ("for", "while", "until", "select"):
            self.loops += 1
            name = _plain(words[1]) if head in ("for", "select") and len(words) > 1 else ""
            if NAME.fullmatch(name):  # its value changes with each iteration: known only at run time
                self.batch.vars[name] = Var(None, cmd.line, False, "the loop's values", expanded="\x00" + name)
            return
        if head == "done":
            self.loops = max(0, self.loops - 1)
            return
        if head in ("if", "case"):
            self.conditionals += 1
            words = words[1:]
            if not words or head == "case":
                return
            head = _plain(words[0])
        if head in ("fi", "esac"):
            self.conditionals = max(0, self.conditionals - 1)
            return
        if head in ("export", "declare", "typeset", "local", "readonly"):
            self.assignments(cmd.line, words[1:], exported=head == "export" or
                             any(_plain(w).startswith("-") and "x" in _plain(w) for w in words[1:2]))
            return
        plain = [_plain(w) for w in words]
        k = 0
        while k < len(words) and ASSIGNMENT.match(plain[k]):
            k += 1
        if k == len(words):
            self.assignments(cmd.line, words, exported=False)
            return
        program = os.path.basename(plain[k])
        if program == "cat" and cmd.heredoc is not None:
            return self.heredoc_file(cmd)
        if cmd.heredoc is not None and program in SHELLS + ("srun", "python", "python3"):
            self.note(cmd.line, f"{program} runs a heredoc script here: its commands are not read")
            return
        if program in ("source", ".") and len(plain) > k + 1:
            self.note(cmd.line, f"sources {plain[k + 1]}: the variables it sets are not read")
            self.batch.sourced = True
            self.sourced.append(plain[k + 1])
            return
        if program == "eval":
            self.note(cmd.line, "eval: the command it builds at run time is not read")
            return
        if program == "srun" and len(self.steps) + len(self.helpers) >= MAX_STEPS:
            self.skipped += 1
        elif program == "srun":
            self.srun(cmd, words[k + 1:])
        elif self.launcher_of([r.text for r in self.batch.words(words[k:])]) is not None:
            self.steps.append(self.make_step(cmd, None, self.batch, words[k:], task_shell=False))

    def call(self, cmd: Command, name: str, args: List[Word]) -> None:
        """A call of a function the script defines: its body read here, with the variables set by now and $1...
        $@ the call's words (put back after it)."""
        self.ever_called.add(name)
        values = [self.batch.render(w).text for w in self.batch.split(args)]
        known = all("\x00" not in v and "\x01" not in v for v in values)
        given = {str(n): v for n, v in enumerate(values, 1)}
        given.update({"@": "\x04".join(values), "*": " ".join(values), "#": str(len(values))})
        saved = {n: self.batch.vars.get(n) for n in list(given) + [str(n) for n in range(len(values) + 1, 10)]}
        for n in saved:
            value = given.get(n, "")
            self.batch.vars[n] = Var(value if known else None, cmd.line, False, f"${n} of the call on line {cmd.line}",
                                     expanded=None if known else value)
        self.called.append(name)
        try:
            self.block(self.functions[name][1])
        finally:
            self.called.pop()
            for n, old in saved.items():
                if old is None:
                    self.batch.vars.pop(n, None)
                else:
                    self.batch.vars[n] = old

    def assignments(self, line: int, words: List[Word], exported: bool) -> None:
        for word in words:
            text = _plain(word)
            m = ASSIGNMENT.match(text)
            if not m:
                if exported and NAME.fullmatch(text) and text in self.batch.vars:
                    v = self.batch.vars[text]
                    self.batch.vars[text] = Var(v.value, v.line, True, v.text)
                elif exported and NAME.fullmatch(text):
                    self.batch.vars[text] = Var(os.environ.get(text), line, True, f"${text} of the environment")
                continue
            name = m.group(1)
            value_word = _after_assignment(word, len(m.group(0)))
            for seg in value_word:  # head=$(srun -N1 -n1 hostname): a helper step, its output the value
                inner = scan(seg.text, line)[:1] if seg.kind == "sub" else []
                if inner and inner[0].words and os.path.basename(_plain(inner[0].words[0])) == "srun":
                    texts = [_plain(w) for w in inner[0].words[1:]]
                    k = _options(texts, SRUN_SHORT, SRUN_SHORT_FLAGS, SRUN_FLAGS, SRUN_OPTIONAL)[1]
                    self.helpers.append((line, " ".join(texts[k:])[:120]))  # what its tasks run, as srun's are
            if m.group(2) or any(seg.kind == "array" for seg in value_word):
                self.batch.vars[name] = Var(None, line, exported, _plain(value_word),
                                            array=None if m.group(2) or m.group(3) == "+=" else
                                            self.array_elements(value_word))
                continue
            rendered = self.batch.render(value_word)
            marked = rendered.text
            value = None if "\x00" in marked or "\x01" in marked else marked
            if self.loops or self.conditionals:
                old = self.batch.vars.get(name)
                if old is not None and old.value != value:
                    value = None  # set differently on some path: not known
            keep = exported or (name in self.batch.vars and self.batch.vars[name].exported)
            if "\x01" not in marked and (value is not None or self.loops or len(value_word) == 1 and
                                          value_word[0].kind != "lit"):
                marked = "\x00" + name  # its run-time value, one word: `$name`
            self.batch.vars[name] = Var(value, line, keep, _plain(value_word),
                                        expanded=marked if value is None else None,
                                        unset_unless_sourced=tuple(rendered.unset_unless_sourced))

    def array_elements(self, value_word: Word) -> Optional[Tuple[str, ...]]:
        """NAME=(a b "c d"): the elements as the batch step expands them; None where their number is known only at
        run time (an unquoted $(...) or $VAR splits into as many as it prints)."""
        if len(value_word) != 1 or value_word[0].kind != "array":
            return None
        elements: List[str] = []
        for cmd in scan(value_word[0].text):
            for word in self.batch.split(cmd.words):
                if any(seg.kind == "sub" and not seg.quote for seg in word):
                    return None
                elements.append(self.batch.render(word).text)  # an unknown $VAR: one word, as in a launch line
        return tuple(elements)

    def heredoc_file(self, cmd: Command) -> None:
        """`cat > FILE <<EOF`: a file the script writes when it runs (often the accelerate or DeepSpeed config), as
        it will hold it: a quoted delimiter keeps the body as written; else the batch shell expands it first."""
        body = cmd.heredoc or ""
        rendered = Rendered(body) if cmd.heredoc_quoted else self.batch.render(_heredoc_word(body))
        runtime = tuple(dict.fromkeys(rendered.unknown + rendered.unset_unless_sourced))
        text = finish(rendered).text
        for target in cmd.redirects:
            name = finish(self.batch.render(target)).text
            self.heredocs[name] = Heredoc(name, cmd.line, cmd.heredoc_line, text, runtime,
                                          tuple(dict.fromkeys(rendered.unset)))

    def launcher_of(self, words: Sequence[str]) -> Optional[str]:
        launcher, _ = launchcmd.launcher_of(list(words))
        return launcher if launcher in LAUNCHERS else None

    def srun(self, cmd: Command, words: List[Word]) -> None:
        words = self.batch.split(words)
        texts = [finish(self.batch.render(w)).text for w in words]
        options, k = _options(texts, SRUN_SHORT, SRUN_SHORT_FLAGS, SRUN_FLAGS, SRUN_OPTIONAL)
        srun_opts = {name: (value if value is not None else "") for name, value in options.items()}
        task = words[k:]
        task, scope, task_shell = self.unwrap(cmd, task)
        if task is None:
            return
        plain = [r.text for r in scope.words(task)]
        if not plain:
            self.note(cmd.line, "srun with no command read")
            return
        if self.launcher_of(plain) is None:
            program = os.path.basename(plain[0])
            if program.endswith(".sh") or program in SHELLS:
                self.note(cmd.line, f"each task runs {' '.join(plain[:2])}: what it launches is not read")
                self.steps.append(self.make_step(cmd, srun_opts, scope, task, task_shell))
            else:
                self.helpers.append((cmd.line, " ".join(plain)[:120]))
            return
        step = self.make_step(cmd, srun_opts, scope, task, task_shell)
        if self.branches is not None:  # `case $SLURM_PROCID in 0) LAUNCH;; *) LAUNCH;; esac` in each task
            (chosen_by, others), self.branches = self.branches, None
            step = dataclasses.replace(step, chosen_by=chosen_by, alternatives=tuple(
                self.make_step(cmd, srun_opts, scope, words, task_shell) for words in others))
        self.steps.append(step)

    def unwrap(self, cmd: Command, words: List[Word]):
        """What each task runs, past env, containers and `bash -c STRING` (whose string the task's shell reads):
        (words, the scope they expand in, whether a shell in the task reads them)."""
        scope, task_shell = self.batch, False
        for _ in range(8):
            plain = [_plain(w) for w in words]
            if not plain:
                return words, scope, task_shell
            program = os.path.basename(plain[0])
            if program == "env":
                j = 1
                while j < len(plain) and (plain[j].startswith("-") or ASSIGNMENT.match(plain[j])):
                    j += 1 + (plain[j] in ("-u", "--unset", "-C", "--chdir"))
                words = words[j:]
                continue
            if program in ("singularity", "apptainer") and len(plain) > 2 and plain[1] in ("exec", "run"):
                j = 2
                while j < len(plain) and plain[j].startswith("-"):
                    j += 1 + (plain[j] in CONTAINER_VALUE_OPTIONS and "=" not in plain[j])
                words = words[j + 1:]  # past the image
                continue
            if program in SHELLS:
                j = next((n for n, p in enumerate(plain[1:], 1) if not p.startswith("-") or "c" in p[1:]), None)
                if j is not None and plain[j].startswith("-") and "c" in plain[j] and j + 1 < len(plain):
                    inner = self.task_text(words[j + 1])
                    scope, task_shell = self.task_scope(), True
                    return self.inner_launch(cmd, inner, scope), scope, task_shell
                return words, scope, task_shell
            return words, scope, task_shell
        return words, scope, task_shell

    def task_text(self, word: Word) -> str:
        """The string `bash -c` gets from the batch step. What the batch shell expands is filled in there: a value
        it knows as is, a per-task variable as its batch-step value (marked \\x01NAME\\x02), anything else as
        written with its `$` marked \\x00 (for the task's shell, it is text). Single-quoted parts and an escaped
        `\\$` reach the task as written, for its shell to expand."""
        out = []
        for seg in word:
            if seg.quote == "'" or seg.kind == "lit":
                out.append(seg.text)
                continue
            out.append(self.batch.render((seg,)).text)
        return "".join(out)

    def task_scope(self) -> Scope:
        exported = {name: var for name, var in self.batch.vars.items() if var.exported}
        scope = Scope(exported, "task")
        scope.unexported = frozenset(n for n, v in self.batch.vars.items() if not v.exported)
        scope.environ, scope.sourced = self.batch.environ, self.batch.sourced
        return scope

    def inner_launch(self, cmd: Command, text: str, scope: Scope) -> Optional[List[Word]]:
        """The launcher inside a task's shell string, its assignments read into the task's scope."""
        found, case_word, others = None, None, []
        for inner in scan(text, cmd.line):
            words = list(inner.words)
            while words and _plain(words[0]) in KEYWORDS:
                words.pop(0)
            plain = [_plain(w) for w in words]
            if plain[:1] == ["case"] and plain[-1:] == ["in"] and len(plain) == 3:
                r = scope.render(words[1])
                case_word = plain[1] if r.task_vars or r.host_commands else case_word  # each task its branch
                continue
            if inner.patterns is not None or plain[:1] == ["esac"]:
                continue
            k = 0
            while k < len(words) and ASSIGNMENT.match(plain[k]):
                k += 1
            if words and plain[0] == "export":
                words, plain, k = words[1:], plain[1:], len(plain) - 1
            if k == len(words):
                for word in words:
                    m = ASSIGNMENT.match(_plain(word))
                    if m:
                        value_word = _after_assignment(word, len(m.group(0)))
                        r = scope.render(value_word)
                        varies = bool(r.host_commands or r.task_vars)  # each task its own value
                        value = None if varies or "\x00" in r.text or "\x01" in r.text else r.text
                        scope.vars[m.group(1)] = Var(value, cmd.line, True, _plain(value_word), per_task=varies,
                                                     expanded=r.text if value is None else None)
                continue
            if self.launcher_of([r.text for r in scope.words(words[k:])]) is not None:
                if found is None:
                    found = words
                else:
                    others.append(words)
        if found is None:
            self.note(cmd.line, "the task's shell string runs no launcher read here")
        if case_word is not None and others:
            self.branches = (case_word, others)
        return found

    def make_step(self, cmd: Command, srun_opts, scope: Scope, words: List[Word], task_shell: bool) -> Step:
        rendered = scope.words(words)
        command = launchcmd.parse([r.text for r in rendered])
        text = " ".join(_plain(w) for w in cmd.words)
        return Step(cmd.line, text, srun_opts, command, tuple(rendered), task_shell, self.loops > 0,
                    self.conditionals > 0, cmd.background)


@dataclass
class _Case:
    """An open `case WORD in`: its value when known, and whether the branch being read runs."""

    word: str
    value: Optional[str]
    parent_active: bool
    matched: bool = False
    taken: bool = False

    @property
    def active(self) -> bool:
        return self.parent_active and (self.value is None or self.taken)

    def branch(self, patterns: Sequence[str]) -> None:
        # bash(1), case: the first branch whose pattern matches WORD runs (patterns as glob patterns)
        self.taken = self.value is not None and not self.matched and any(
            fnmatch.fnmatchcase(self.value, p) for p in patterns)
        self.matched = self.matched or self.taken


def _function_body(commands: List[Command], i: int, opened: bool) -> Tuple[List[Command], int]:
    """The commands of a function's `{ ... }` body from commands[i] on (opened: its `{` is on the definition's
    line), and the index after its `}`; a body that is one other command (`f() ( ... )`) is that command."""
    depth = 1 if opened else 0
    body: List[Command] = []
    while i < len(commands):
        cmd = commands[i]
        i += 1
        plain = [_plain(w) for w in cmd.words]
        opens = next((n for n, p in enumerate(plain) if p != "{"), len(plain))
        depth += opens
        if depth == 0:
            return [cmd], i
        if plain[:1] == ["}"]:
            depth -= 1
            if depth == 0:
                return body, i
            continue
        body.append(cmd)
    return body, i


def _runs_srun_or_launcher(cmd: Command) -> bool:
    plain = [os.path.basename(_plain(w)) for w in cmd.words]
    return any(p in ("srun",) + LAUNCHERS for p in plain)


def _heredoc_word(body: str) -> Word:
    """An unquoted heredoc's body as the shell reads it, one word: text, $VAR, ${...}, $(...), `...`, $((...)); a
    backslash escapes only $, `, \\ and a newline (bash(1), Here Documents)."""
    scanner, segs, lit = _Scanner(body), [], []

    def flush():
        if lit:
            segs.append(Seg("lit", "".join(lit), '"'))
            lit.clear()

    while scanner.i < len(body):
        c, nxt = body[scanner.i], body[scanner.i + 1:scanner.i + 2]
        if c == "\\" and nxt in ("$", "`", "\\", "\n"):
            lit.append(nxt if nxt != "\n" else "")
            scanner.i += 2
            continue
        seg = scanner._dollar('"') if c == "$" else None
        if seg is not None:
            flush()
            segs.append(seg)
            continue
        if c == "`":
            end = body.find("`", scanner.i + 1)
            end = len(body) if end < 0 else end
            flush()
            segs.append(Seg("sub", body[scanner.i + 1:end], '"'))
            scanner.i = end + 1
            continue
        lit.append(c)
        scanner.i += 1
    flush()
    return tuple(segs)


def _after_assignment(word: Word, width: int) -> Word:
    """The value part of a NAME=value word (its first `width` characters are NAME=)."""
    out, left = [], width
    for seg in word:
        if left <= 0:
            out.append(seg)
        elif seg.kind == "lit" and len(seg.text) > left:
            out.append(Seg("lit", seg.text[left:], seg.quote))
            left = 0
        else:
            left -= len(seg.text) if seg.kind == "lit" else 0
            if seg.kind != "lit":
                out.append(seg)
                left = 0
    return tuple(out)
