"""Bash's words, read and never run: what each word of a script expands to, where it can be known without running
it, and what stays unknown and why. The statements (assignments, functions, `if`, `case`, loops) are read in
preflight.inputs.shellwalker, which keeps the variables a `Scope` looks up.

The syntax is tree-sitter-bash's (a real grammar of bash: quoting, heredocs, arrays, `case`, functions, `$((...))`);
the semantics are here and in shellwalker: the variables the script sets, arrays, parameter expansion, word
splitting, and what bash, SLURM and the environment set at run time. Chosen over bashlex 0.18 by measurement on the
corpus of published batch scripts (tests/fixtures/realworld): bashlex refuses 111 of its 194 scripts (arrays,
`$((...))`, heredocs it cannot end) and imports in 150 ms; tree-sitter-bash reads all 194 in 0.15 s, 19 with a part
it cannot parse (a `<PATH>` placeholder, a backslash before blanks: a launch line there is said to be read in part),
and imports in 16 ms. Two of its defects are mended: two assignments alone on a line are sometimes joined to the
next line's command (`A=1 B=2` newline `srun x`, see shellwalker._Simple), and `$((cmd) && ...)` is taken for
arithmetic (see _subshells).

A word expands to fields (bash(1), EXPANSION): known text, and `Unknown` parts for what only the run can tell (a
command's output, `$RANDOM`, SLURM's per-task variables, a variable the script never sets). An unquoted unknown
part may split into several words or none: its field is `spread`, and a reader must not take an option as absent
when such a field could hold it.
"""
from __future__ import annotations

import ast
import fnmatch
import re
import secrets
from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

# Variables bash itself sets (bash(1), Shell Variables): known only when the script runs, never "set nowhere".
BASH_SETS = frozenset("""RANDOM SRANDOM SECONDS EPOCHSECONDS EPOCHREALTIME BASHPID PPID UID EUID HOSTNAME HOSTTYPE
OSTYPE MACHTYPE LINENO BASH BASH_VERSION BASH_VERSINFO BASH_SOURCE BASH_LINENO BASH_ARGV BASH_ARGC BASH_COMMAND
BASH_REMATCH FUNCNAME PWD OLDPWD SHLVL GROUPS PIPESTATUS IFS OPTIND OPTARG REPLY SHELLOPTS BASHOPTS DIRSTACK
COLUMNS LINES""".split())
# Set in every login's environment: from the environment when the job runs.
LOGIN_ENV = frozenset("HOME USER LOGNAME PATH SHELL LANG TERM TMPDIR MAIL LD_LIBRARY_PATH PYTHONPATH".split())
SPECIAL = frozenset("@*#?$!-_0")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What one reading follows, so that any script is read in bounded time and memory (a hostile one included): past
# them a value, a word or the rest of the script is unknown, and said so.
MAX_TEXT = 1024 * 1024  # characters of one value or word (a variable doubled 40 times is not followed to 1 TB)
MAX_PARTS = 4096  # parts of one value, elements of one array
MAX_NESTING = 48  # words inside words (${X:-${Y:-...}}), tests inside tests
WORK = 20_000  # statements read in all (a function's body each time it is called, sourced files, bash -c strings)


@dataclass(frozen=True)
class Unknown:
    """A part of a word known only at run time."""

    written: str  # as the script writes it (or names it): $RANDOM, $(hostname), $HEAD
    why: str = ""  # where it comes from, for messages; empty: `written` says it
    sources: FrozenSet[str] = frozenset()  # "KIND:NAME": task, batch_task, host, unset, sourced, unexported, bash...
    shown: Optional[str] = None  # its text where this reader knows it (SLURM_NODEID in the batch step: "0")


Part = Union[str, Unknown]
TOO_LARGE = Unknown("(a value past 1 MiB)", "a value past 1 MiB or 4096 parts: not followed",
                    frozenset({"large:value"}))


@dataclass(frozen=True)
class Field:
    """One word after expansion and word splitting."""

    parts: Tuple[Part, ...]
    spread: bool = False  # holds an unquoted run-time expansion: the shell may make it several words, or none

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.shown if p.shown is not None else p.written for p in self.parts)

    @property
    def known(self) -> bool:
        return all(isinstance(p, str) or p.shown is not None for p in self.parts)

    def unknowns(self) -> List[Unknown]:
        return [p for p in self.parts if isinstance(p, Unknown)]

    def sources(self, kind: str) -> List[str]:
        found = [s.split(":", 1)[1] for p in self.unknowns() for s in sorted(p.sources) if s.startswith(kind + ":")]
        return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Var:
    """A variable as the script leaves it at one point."""

    value: Tuple[Part, ...]
    line: int
    exported: bool
    text: str  # as written
    array: Optional[Tuple[Field, ...]] = None  # an array's elements, when their number is known


def unknown_var(name: str, line: int, text: str, inner: Sequence[Part] = (), exported: bool = False,
                why: str = "") -> Var:
    """A variable whose value is known only at run time: it reads as `$NAME`, and keeps where its parts come from."""
    sources = frozenset(s for p in inner if isinstance(p, Unknown) for s in p.sources)
    why = why or f"${name} (set on line {line} to {short(text)})"
    return Var((Unknown("$" + name, why, sources),), line, exported, text)


def short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


class Scope:
    """The variables one shell knows: the batch step's, or a task's."""

    def __init__(self, level: str, environ: Mapping[str, str], known: Optional[Mapping[str, Var]] = None):
        self.level = level  # "batch" or "task"
        self.environ = environ
        self.vars: Dict[str, Var] = dict(known or {})
        self.allexport = False  # set -a
        self.sourced = False  # a file sourced before this point may set any variable
        self.cwd: Optional[str] = "."  # the working folder as the script leaves it: "." where it started, None unknown
        self.unexported: FrozenSet[str] = frozenset()  # (a task) set in the batch step without export
        self.per_task: Mapping[str, Optional[str]] = {}  # SLURM's per-task variables, with their batch-step value

    def copy(self) -> "Scope":
        other = Scope(self.level, self.environ, self.vars)
        other.allexport, other.sourced, other.cwd = self.allexport, self.sourced, self.cwd
        other.unexported, other.per_task = self.unexported, self.per_task
        return other

    def set(self, name: str, var: Var) -> None:
        if self.allexport or (name in self.vars and self.vars[name].exported):
            var = replace(var, exported=True)
        self.vars[name] = var

    def lookup(self, name: str) -> Tuple[Part, ...]:
        """$NAME as this shell expands it."""
        var = self.vars.get(name)
        if var is not None:
            return var.array[0].parts if var.array else var.value
        if name in self.per_task:
            if self.level == "task":
                return (Unknown("$" + name, "", frozenset({"task:" + name})),)
            shown = self.per_task[name]
            return (Unknown("$" + name, "", frozenset({"batch_task:" + name}), shown),)
        if name == "HOSTNAME":
            return (Unknown("$HOSTNAME", "", frozenset({f"host:$HOSTNAME ({self.level})"})),)
        if name in BASH_SETS:
            return (Unknown("$" + name, f"${name} (bash sets it)", frozenset({"bash:" + name})),)
        if name.isdigit() or name in SPECIAL:
            return (Unknown("$" + name, f"${name} (the script's arguments)", frozenset({"arg:" + name})),)
        if name.startswith(("SLURM_", "SLURMD_")):
            return (Unknown("$" + name, "", frozenset({"slurm:" + name})),)
        if self.level == "task" and name in self.unexported:
            return (Unknown("$" + name, f"${name} (empty in the task: set in the batch step, not exported)",
                            frozenset({"unexported:" + name})),)
        if name in self.environ:  # sbatch exports the environment it is submitted from
            return (self.environ[name],)
        if name in LOGIN_ENV:
            return (Unknown("$" + name, f"${name} (from the environment)", frozenset({"env:" + name})),)
        kind = "sourced" if self.sourced else "unset"
        return (Unknown("$" + name, f"${name} (set nowhere in the script: from the environment it is submitted "
                                    "from, or empty)", frozenset({f"{kind}:{name}"})),)


# ---- syntax ----------------------------------------------------------------------------------------------------

_parser = None


def syntax(text: str):
    """The tree-sitter-bash tree of a script's text."""
    global _parser
    if _parser is None:
        import tree_sitter
        import tree_sitter_bash

        _parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_bash.language()))
    return _parser.parse(_subshells(text).encode("utf-8", "surrogateescape"))


def _subshells(text: str) -> str:
    """`$((cmd) && ...)` as bash reads it: a `$((` whose `((` does not close with `))` is a command substitution that
    starts with a subshell, not arithmetic (bash(1), Arithmetic Expansion); tree-sitter-bash takes every `$((` for
    arithmetic, so such a one is written `$( (` (one column more, the same lines). One pass pairs the brackets."""
    if "$((" not in text:
        return text
    closing: Dict[int, int] = {}  # where each `(` closes (quotes are not read: as bash's own first look at `$((`)
    opened: List[int] = []
    for m in re.finditer(r"[()]", text):
        if m.group() == "(":
            opened.append(m.start())
        elif opened:
            closing[opened.pop()] = m.start()
    out, at = [], 0
    for m in re.finditer(r"\$\(\(", text):
        inner = closing.get(m.start() + 2)
        if inner is not None and text[inner + 1:inner + 2] != ")":  # the inner `(` closes alone: a subshell
            out.append(text[at:m.start() + 2] + " ")
            at = m.start() + 2
    out.append(text[at:])
    return "".join(out)


def text_of(node) -> str:
    return node.text.decode("utf-8", "replace")


def line_of(node) -> int:
    return node.start_point[0] + 1


def is_comment(tree, line: int) -> bool:
    """Whether the line starts with a comment of the script: a `#SBATCH` line inside a heredoc's body is the body's
    text (a child job's), not a comment."""
    node = tree.root_node.descendant_for_point_range((line - 1, 0), (line - 1, 1))
    while node is not None and node.type not in ("comment", "heredoc_body", "program"):
        node = node.parent
    return node is not None and node.type == "comment"


PIECE = 64 * 1024  # bytes parsed at a time: tree-sitter's tree of 1 MiB of pipelines takes 350 MB, of 64 KiB 30
MAX_STATEMENT = 128 * 1024  # bytes of one statement read (a command of 500,000 words is not)


def pieces(text: str) -> Iterator[Tuple[object, list, int]]:
    """A script's top-level statements in order, parsed about PIECE bytes at a time so that memory stays bounded
    and nothing past where a reader stops is parsed: (the piece's tree, its top-level nodes, the first line after
    them). A piece ends before its last statement, which the cut may have split: that one starts the next piece,
    which grows until it holds one whole; past MAX_STATEMENT bytes the last piece is (None, None, its first line): the
    rest is not read. Line numbers are the script's (each piece is parsed after as many newlines as lines before it)."""
    starts = [0] + [m.end() for m in re.finditer("\n", text)]  # where each line starts

    def cut(begin: int, size: int) -> int:  # after the last whole line within size (or the first line, whole)
        if begin + size >= len(text):
            return len(text)
        end = text.rfind("\n", begin, begin + size) + 1
        return end if end > begin else text.find("\n", begin + size) + 1 or len(text)

    line = 0  # the piece's first line, from 0
    while starts[line] < len(text) or line == 0:
        begin, size = starts[line], PIECE
        end = cut(begin, size)
        while True:
            if end - begin > MAX_STATEMENT:
                yield None, None, line + 1
                return
            tree = syntax("\n" * line + text[begin:end])
            children = tree.root_node.children
            if end == len(text):
                yield tree, children, len(starts) + 1
                return
            last = next((c for c in reversed(children) if c.is_named), None)
            # the last statement may be cut short: it starts the next piece (a comment last, or none, is whole)
            whole = last is None or last.type == "comment"
            next_line = line + text.count("\n", begin, end) if whole else last.start_point[0]
            kept = [c for c in children if c.end_point[0] < next_line]
            if kept and next_line > line:
                break
            size *= 2  # one statement longer than the piece: a larger one, at least a line larger
            end = max(cut(begin, size), text.find("\n", end) + 1 or len(text))
        yield tree, kept, next_line + 1
        line = next_line


# ---- words -----------------------------------------------------------------------------------------------------

BREAK = object()  # a forced word boundary ("$@", "${A[@]}")


class Expander:
    """Expands words in a scope; the unknown parts of a string handed to another shell travel as placeholders.
    `work` counts what a reading costs (WORK in all): past it, what is left is not read (see Walker)."""

    def __init__(self):
        self.placeholders: List[Unknown] = []
        # A placeholder is private-use characters around this reading's own key and an index: text a script writes
        # cannot pass for one.
        key = secrets.token_hex(4)
        self.placeholder = re.compile(f"\ue000{key}:([0-9]{{1,9}})\ue001")
        self.key = key
        self.work = 0
        self.nesting = 0

    @property
    def exhausted(self) -> bool:
        return self.work > WORK

    def fields(self, node, scope: Scope) -> List[Field]:
        chunks = self.chunks(node, scope, False)
        if len(chunks) > MAX_PARTS or sum(len(v) for v, _ in chunks if isinstance(v, str)) > MAX_TEXT:
            return [Field((TOO_LARGE,), spread=True)]  # splitting it could make millions of words
        return split(chunks)

    def one(self, node, scope: Scope) -> Field:
        """The node expanded as one word, as an assignment's value is (no splitting)."""
        return Field(merge([value for value, _ in self.chunks(node, scope, True) if value is not BREAK]))

    def handed_on(self, parts: Sequence[Part]) -> str:
        """Text for another shell to read (`bash -c STRING`): an unknown part becomes a placeholder it keeps."""
        out = []
        for p in parts:
            if isinstance(p, str):
                out.append(p)
            else:
                self.placeholders.append(p)
                out.append(f"\ue000{self.key}:{len(self.placeholders) - 1}\ue001")
        return "".join(out)

    def literal(self, text: str) -> List[Part]:
        if "\ue000" not in text:
            return [text] if text else []
        parts: List[Part] = []
        at = 0
        for m in self.placeholder.finditer(text):
            parts.append(text[at:m.start()])
            index = int(m.group(1))
            parts.append(self.placeholders[index] if index < len(self.placeholders) else m.group(0))
            at = m.end()
        parts.append(text[at:])
        return [p for p in parts if p != ""]

    def chunks(self, node, scope: Scope, quoted: bool) -> list:
        """(part or BREAK, quoted) in order: what word splitting then works on. Words nested past MAX_NESTING, and
        any once the reading's work is spent, are unknown."""
        if self.nesting >= MAX_NESTING or self.exhausted:
            why = "nested too deep to follow" if self.nesting >= MAX_NESTING else "past what one reading follows"
            return [(Unknown(short(_text(node)), f"{short(_text(node))} ({why})", frozenset({"large:word"})), quoted)]
        self.nesting += 1
        try:
            return self._chunks(node, scope, quoted)
        finally:
            self.nesting -= 1

    def _chunks(self, node, scope: Scope, quoted: bool) -> list:
        kind = node.type
        if kind in ("word", "number", "extglob_pattern", "regex", "special_variable_name", "variable_name"):
            return [(p, quoted) for p in self.literal(_unescape(text_of(node), quoted))]
        if kind == "raw_string":
            return [(p, True) for p in self.literal(text_of(node)[1:-1])] or [("", True)]
        if kind == "ansi_c_string":
            return [(_ansi_c(text_of(node)[2:-1]), True)]
        if kind in ("string", "translated_string"):
            out = [("", True)]
            body = [c for c in node.children if c.type not in ('"', '$"')]
            at = node.start_byte + (2 if kind == "translated_string" else 1)
            for child in body:  # tree-sitter leaves text between its children, and puts blanks inside them
                start = child.start_byte + leading_blanks(child)
                end = child.end_byte if child.type == "string_content" else start
                if end > at:
                    out += [(p, True) for p in self.literal(_unescape(between(node, at, end), True))]
                if child.type != "string_content":
                    out += self.chunks(child, scope, True)
                at = child.end_byte
            if at < node.end_byte - 1:
                out += [(p, True) for p in self.literal(_unescape(between(node, at, node.end_byte - 1), True))]
            return out
        if kind == "string_content":
            return [(p, True) for p in self.literal(_unescape(text_of(node), True))]
        if kind == "concatenation":
            out = []
            for child in node.children:
                out += self.chunks(child, scope, quoted)
            return out
        if kind == "simple_expansion":
            name = text_of(node.named_children[0]) if node.named_children else ""
            return self._parameter(name, None, scope, quoted, _text(node))
        if kind == "expansion":
            return self._expansion(node, scope, quoted)
        if kind in ("command_substitution", "process_substitution"):
            written = _text(node)
            command = " ".join(written.strip("$()`<>").split())
            sources = {f"host:{written} ({scope.level})"} if command.startswith("hostname") else set()
            return [(Unknown(written, "", frozenset(sources)), quoted)]
        if kind == "arithmetic_expansion":
            number = self.arithmetic(node, scope)
            if number is None:  # what it is computed from says where its unknown parts come from
                inner = [p for n in descendants(node) if n.type in ("simple_expansion", "expansion", "variable_name")
                         for p in self.one(n, scope).unknowns()]
                return [(Unknown(_text(node), "", frozenset(s for u in inner for s in u.sources)), quoted)]
            return [(str(number), quoted)]
        if kind == "brace_expression":
            return [(text_of(node), quoted)]
        return [(p, quoted) for p in self.literal(text_of(node))]

    def _expansion(self, node, scope: Scope, quoted: bool) -> list:
        """${...}: a parameter, its subscript, and one operator (defaults, length, trims)."""
        children = [c for c in node.children if c.type not in ("${", "}")]
        written = _text(node)
        prefix = children[0].type if children and children[0].type in ("#", "!") else ""
        if prefix:
            children = children[1:]
        if not children or children[0].type not in ("variable_name", "special_variable_name", "subscript"):
            return [(Unknown(written), quoted)]
        target, rest = children[0], children[1:]
        index = None
        if target.type == "subscript":
            name_node, index_node = target.child_by_field_name("name"), target.child_by_field_name("index")
            name = text_of(name_node) if name_node is not None else ""
            index = text_of(index_node) if index_node is not None else "0"
        else:
            name = text_of(target)
        if prefix == "!":
            return [(Unknown(written, f"{written} (indirect)"), quoted)]
        if prefix == "#":
            var = scope.vars.get(name)
            if index in ("@", "*") and var is not None and var.array is not None:
                return [(str(len(var.array)), quoted)]
            value = Field(scope.lookup(name))
            return [(str(len(value.text)) if value.known and index is None else Unknown(written), quoted)]
        operator = rest[0].type if rest else None
        argument = rest[1:] if rest else []
        if operator is None:
            return self._parameter(name, index, scope, quoted, written)
        if operator in (":-", "-", ":=", "=", ":+", "+", ":?", "?"):  # bash(1), Parameter Expansion
            state = _state(name, index, scope)
            colon = operator.startswith(":")
            if state == "maybe" and colon:  # set, but maybe empty: which branch runs is known only then
                inner = Field(scope.lookup(name)).unknowns()
                return [(Unknown(written, "", frozenset(s for u in inner for s in u.sources)), quoted)]
            use_default = state == "unset" or (colon and state == "empty")
            argument_chunks = [c for n in argument for c in self.chunks(n, scope, quoted)] or [("", quoted)]
            if operator.endswith("+"):
                return [("", quoted)] if use_default else argument_chunks
            if not use_default:
                return self._parameter(name, index, scope, quoted, written)
            if operator.endswith("?"):  # unset: the script stops here
                return [(Unknown(written, f"{written} (the script stops when {name} is not set)"), quoted)]
            if operator.endswith("=") and index is None:
                parts = merge([v for v, _ in argument_chunks if v is not BREAK])
                scope.set(name, Var(parts, line_of(node), False, written))
            return argument_chunks
        value = Field(scope.lookup(name)) if index is None else None
        if operator in ("%", "%%", "#", "##") and value is not None and value.known and len(value.text) <= 4096:
            pattern = self.one(argument[0], scope) if argument else Field(())
            self.work += len(value.text) // 16  # a trim tries every length
            if pattern.known:
                return [(_trim(value.text, pattern.text, operator), quoted)]
        if operator in ("^^", ",,") and value is not None and value.known:
            return [(value.text.upper() if operator == "^^" else value.text.lower(), quoted)]
        inner = value.unknowns() if value is not None else []
        return [(Unknown(written, "", frozenset(s for u in inner for s in u.sources)), quoted)]

    def _parameter(self, name: str, index: Optional[str], scope: Scope, quoted: bool, written: str) -> list:
        var = scope.vars.get(name)
        if name in ("@", "*") and "@" in scope.vars:  # a function's arguments, one word each
            var = scope.vars["@"]
            index = "@"
        if var is not None and index is not None:
            if var.array is None:
                if index in ("@", "*", "0"):
                    return [(p, quoted) for p in var.value]
                return [(Unknown(written, f"{written} (an element chosen at run time)"), quoted)]
            if index in ("@", "*"):
                out: list = []
                for k, element in enumerate(var.array):
                    if k:
                        out.append((BREAK, quoted) if quoted and index == "@" else (" ", quoted))
                    out += [(p, quoted and not (element.spread and isinstance(p, Unknown))) for p in element.parts] \
                        or [("", quoted)]
                return out or [("", False)]
            if re.fullmatch(r"[0-9]{1,9}", index) and not any(e.spread for e in var.array[:int(index) + 1]):
                k = int(index)
                return [(p, quoted) for p in (var.array[k].parts if k < len(var.array) else ())] or [("", quoted)]
            return [(Unknown(written, f"{written} (an element chosen at run time)"), quoted)]
        if index is not None and var is None and name not in scope.environ:
            return [(Unknown(written), quoted)]
        parts = scope.lookup(name)
        return [(p, quoted) for p in parts] or [("", quoted)]

    def arithmetic(self, node, scope: Scope) -> Optional[int]:
        """$((...)) of whole numbers and known variables, + - * / % and brackets; None where not known (never eval)."""
        text = _text(node)
        inner = text[3:-2] if text.startswith("$((") else text

        def value(m) -> str:
            name = m.group(1) or m.group(2) or m.group(3)
            field_ = Field(scope.lookup(name))
            return field_.text if field_.known and re.fullmatch(r"\s*-?\d+\s*", field_.text or "0") else "\x00"

        expr = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)|\b([A-Za-z_][A-Za-z0-9_]*)\b",
                      value, inner)
        return arithmetic(expr)


def _state(name: str, index: Optional[str], scope: Scope) -> str:
    """Whether a parameter is set, for ${NAME:-...} and the like: "unset", "empty", "full", or "maybe" (set, its
    value known only at run time). A variable set nowhere is unset, as the script runs when submitted as it is (an
    environment that sets it is the one preflight runs in); positional parameters likewise (no arguments given)."""
    var = scope.vars.get(name)
    if var is not None:
        if index is not None:
            return "maybe"
        value = Field(var.value)
        if value.known:
            return "empty" if value.text == "" else "full"
        return "full" if any(isinstance(p, str) and p for p in var.value) else "maybe"
    if index is not None or name.isdigit():
        return "unset"
    if name in scope.environ:
        return "empty" if scope.environ[name] == "" else "full"
    if name in scope.per_task or name in BASH_SETS or name in LOGIN_ENV or name in SPECIAL:
        return "full"
    return "maybe" if name.startswith(("SLURM_", "SLURMD_")) else "unset"


def arithmetic(expr: str) -> Optional[int]:
    """A shell arithmetic expression of whole numbers, + - * / % and brackets, else None."""
    if len(expr) > 200 or not re.fullmatch(r"[\d\s+\-*/%()]+", expr):
        return None
    try:
        tree = ast.parse(expr.strip() or "0", mode="eval")
    except SyntaxError:
        return None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
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


def split(chunks) -> List[Field]:
    """Word splitting (bash(1), Word Splitting) on unquoted text; an unquoted unknown part makes its field spread;
    an unquoted word that expands to nothing is no word at all."""
    out: List[Field] = []
    parts: List[Part] = []
    state = {"kept": False, "spread": False}

    def end():
        if parts or state["kept"]:
            out.append(Field(merge(parts), state["spread"]))
        parts.clear()
        state["kept"] = state["spread"] = False

    for value, quoted in chunks:
        if value is BREAK:
            end()
            state["kept"] = True
        elif isinstance(value, Unknown):
            parts.append(value)
            state["spread"] = state["spread"] or (not quoted and value.shown is None)
            state["kept"] = state["kept"] or quoted
        elif quoted:
            parts.append(value)
            state["kept"] = True
        else:
            for k, piece in enumerate(re.split(r"[ \t\n]+", value)):
                if k:
                    end()
                if piece:
                    parts.append(piece)
    end()
    return out


def merge(parts: Sequence[Part]) -> Tuple[Part, ...]:
    """Adjacent text joined; a value past MAX_TEXT characters or MAX_PARTS parts is TOO_LARGE, whole."""
    if len(parts) > MAX_PARTS or sum(len(p) for p in parts if isinstance(p, str)) > MAX_TEXT:
        return (TOO_LARGE,)
    out: List[Part] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return tuple(out)


_LEAD = re.compile(rb"(?:[ \t\n]|\\\n)*")


def leading_blanks(node) -> int:
    """The blanks (and backslash-newlines) tree-sitter puts at the start of a node inside a string: they are the
    string's text, not the node's."""
    return _LEAD.match(node.text).end()


def _text(node) -> str:
    return node.text[leading_blanks(node):].decode("utf-8", "replace")


def between(node, start: int, end: int) -> str:
    base = node.start_byte
    return node.text[start - base:end - base].decode("utf-8", "replace")


def descendants(node) -> Iterator:
    stack = list(node.children)
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children)


def _unescape(text: str, quoted: bool) -> str:
    """Backslashes as bash reads them: bare, one escapes any character; in double quotes only $ ` " \\ and a newline
    (bash(1), QUOTING)."""
    if "\\" not in text:
        return text
    if quoted:
        return re.sub(r'\\([$`"\\\n])', lambda m: "" if m.group(1) == "\n" else m.group(1), text)
    return re.sub(r"\\(.)", lambda m: "" if m.group(1) == "\n" else m.group(1), text, flags=re.S)


def _ansi_c(text: str) -> str:
    """$'...': its escapes decoded; a \\u escape to half a surrogate pair (no character) becomes U+FFFD."""
    try:
        decoded = text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except (UnicodeDecodeError, ValueError):
        return text
    return re.sub("[\ud800-\udfff]", "\ufffd", decoded)


def _trim(value: str, pattern: str, operator: str) -> str:
    """${V%P} ${V%%P} ${V#P} ${V##P}: the shortest or longest match of a glob pattern taken off one end."""
    spans = range(len(value) + 1)
    if operator.startswith("%"):
        order = spans if operator == "%%" else reversed(spans)
        for k in order:
            if fnmatch.fnmatchcase(value[k:], pattern):
                return value[:k]
        return value
    order = reversed(spans) if operator == "##" else spans
    for k in order:
        if fnmatch.fnmatchcase(value[:k], pattern):
            return value[k:]
    return value


def plain(node) -> str:
    """A word as written, quotes taken off and every expansion as written: what another reader (a manifest's
    `sh -c` string) then expands itself."""
    scope = Scope("task", {})
    scope.lookup = lambda name: (Unknown("$" + name),)  # type: ignore[method-assign]
    return "".join(p if isinstance(p, str) else p.written for p in Expander().one(node, scope).parts)
