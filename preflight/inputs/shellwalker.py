"""Bash's statements, read in the order bash would run them and never run: assignments, exports, `set -a`, `source`,
functions (read where called, bounded), `if` decided by a test on known words, `case` on a known word, loops, and
the variables known after a branch only where every path agrees. Each simple command is handed to `Walker.command`,
which a reader (preflight.inputs.batchscript) overrides; its words expand by preflight.inputs.shell."""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from preflight.inputs.documents import InputError, read_regular
from preflight.inputs.shell import (BREAK, MAX_NESTING, MAX_PARTS, MAX_STATEMENT, NAME, WORK, Expander, Field, Part,
                                    Scope, Unknown, Var, between, leading_blanks, line_of, merge, pieces, plain,
                                    short, syntax, text_of, unknown_var)

MAX_CALLS = 64  # function calls read in all: a recursive function (or two calling each other) ends here
MAX_DEPTH = 8  # functions called inside functions, read that deep
MAX_SOURCED = 8  # files the script sources, read when they are here
MAX_SOURCED_BYTES = 1024 * 1024  # each, as large as a batch script may be
MAX_STATEMENT_NESTING = 64  # statements inside statements (if in for in a function in a sourced file ...)
MAX_WORDS = 4096  # words of one command read (a command line of Linux holds at most 2 MiB in all)


def simple_commands(text: str) -> List[List[str]]:
    """The simple commands of a shell script in order, each as its words written (see plain)."""
    found = []
    stack = [syntax(text).root_node]
    while stack:
        node = stack.pop()
        if node.type == "command":
            simple = _Simple(node)
            found.append((node.start_byte, [plain(w) for w in simple.words]))
        stack.extend(c for c in node.children if c.type not in ("command_substitution", "heredoc_body"))
    return [words for _, words in sorted(found, key=lambda f: f[0])]


# ---- statements ------------------------------------------------------------------------------------------------

class _Simple:
    """A command node's parts: the assignments before it, its words, its redirections. A line of assignments alone
    that tree-sitter-bash joined to the next line's command is split off (`leading`)."""

    def __init__(self, node):
        self.node = node
        self.assignments = [c for c in node.children if c.type == "variable_assignment"]
        name = node.child_by_field_name("name")
        self.words = ([name] if name is not None else []) + node.children_by_field_name("argument")
        self.redirects = [c for c in node.children if c.type.endswith("_redirect")]
        self.leading: List = []
        if self.assignments and name is not None:
            gap = node.text[self.assignments[-1].end_byte - node.start_byte:name.start_byte - node.start_byte]
            if b"\n" in gap.replace(b"\\\n", b""):
                self.leading, self.assignments = self.assignments, []


@dataclass
class Simple:
    """A simple command as the walker hands it to the reader: its words (expanded when first asked for), where it
    runs."""

    node: object
    line: int
    words: List[object]  # its words' nodes
    scope: Scope
    env: Dict[str, Var]  # NAME=value before it: its own environment
    redirects: List[object]  # redirection nodes (targets: Walker.targets; heredocs: Walker.heredoc)
    background: bool
    loop: bool
    conditional: bool
    expander: "Expander"
    in_substitution: bool = False
    _fields: Optional[List[Field]] = None

    @property
    def fields(self) -> List[Field]:
        """Its words expanded: the first MAX_WORDS (past them one spread unknown word stands for the rest)."""
        if self._fields is None:
            self.expander.work += len(self.words) // 2  # a word costs about half what a statement does
            self._fields = [f for w in self.words[:MAX_WORDS] for f in self.expander.fields(w, self.scope)]
            if len(self.words) > MAX_WORDS:
                self._fields.append(Field((Unknown(f"(its words past {MAX_WORDS})", f"the words past {MAX_WORDS} "
                                                   "of the command: not read", frozenset({"large:words"})),), True))
        return self._fields

    def head(self) -> str:
        """The first word as written, unexpanded: enough to tell srun from other programs cheaply."""
        return text_of(self.words[0]) if self.words else ""

    @property
    def damaged(self) -> bool:
        """tree-sitter-bash could not read the command as bash does: its words may be cut or run together."""
        return self.node.has_error


class Walker(Expander):
    """Reads a script's statements in order, as bash would run them, and hands every simple command to `command`
    (which a reader overrides): assignments, exports, `set -a`, functions (read where called, bounded), `case` on a
    known word, if/loops (their variables known after them only where every path agrees)."""

    def __init__(self):
        super().__init__()
        self.functions: Dict[str, object] = {}
        self.ever_called: set = set()
        self.calls = 0
        self.depth = 0
        self.loops = 0
        self.conditionals = 0
        self.notes: List[Tuple[int, str]] = []
        self.base = "."  # the folder a path the script names relative to where it runs is looked up in, here
        self.sourced_read = 0
        self.nested = 0  # statements being read inside one another
        self.stopped: Optional[int] = None  # the line where the reading's work ran out: nothing after it is read
        self._noted: set = set()
        self.limited: set = set()  # functions whose calls past MAX_CALLS were said

    # -- what a reader overrides
    def command(self, cmd: Simple) -> None:
        pass

    def stop(self, line: int, why: str) -> None:
        """The reading stops at `line` (the first time only): said first of all notes."""
        if self.stopped is None:
            self.stopped = line
            self.notes.insert(0, (line, why))

    def note(self, line: int, why: str) -> None:
        if (line, why) not in self._noted:  # said once, however many times it comes (a call past MAX_CALLS)
            self._noted.add((line, why))
            self.notes.append((line, why))

    # -- statements
    def read(self, text: str, scope: Scope, background: bool = False, visit=None) -> None:
        """A script's text (the batch script, a file it sources, a step script, a `bash -c` string), a piece at a
        time, until the reading's work is spent. visit(tree, first line after the piece), if given, sees every
        piece first, and says whether it wants more once the reading stops."""
        for tree, nodes, end in pieces(text):
            if nodes is None:  # one statement too long to read: nothing from it on is
                self.stop(end, f"a statement longer than {MAX_STATEMENT // 1024} KiB starts here: the script is not "
                               "read from here on, and what it does is not judged")
                break
            wanted = visit(tree, end) if visit is not None else False
            if not self.exhausted:
                self.work += sum(n.end_byte - n.start_byte for n in nodes) // 256  # its parse
                self.block(nodes, scope, background)
            elif not wanted:
                break

    def block(self, nodes: Sequence, scope: Scope, background: bool = False) -> None:
        nodes = list(nodes)
        for k, node in enumerate(nodes):
            if node.is_named:
                self.statement(node, scope, background or (k + 1 < len(nodes) and nodes[k + 1].type == "&"))

    def statement(self, node, scope: Scope, background: bool = False, redirects: Sequence = ()) -> None:
        """One statement, read as bash runs it; past WORK in all, or nested past MAX_STATEMENT_NESTING, not read
        (a reader then treats what it did not see as unknown: `stopped`)."""
        self.work += 1
        if self.exhausted or self.nested >= MAX_STATEMENT_NESTING:
            if self.stopped is None:
                self.stop(line_of(node), f"the script is not read from here on (past {WORK} statements and words "
                          "read): what it does is not judged" if self.exhausted else f"statements nested past "
                          f"{MAX_STATEMENT_NESTING} deep here are not read: what the script does is not judged")
            return
        self.nested += 1
        try:
            self._statement(node, scope, background, redirects)
        finally:
            self.nested -= 1

    def _statement(self, node, scope: Scope, background: bool, redirects: Sequence) -> None:
        kind = node.type
        if kind in ("comment", "heredoc_body", "test_command", "file_redirect"):
            return
        if kind in ("program", "compound_statement", "do_group"):
            return self.block(node.children, scope)
        if kind == "subshell":
            return self.block(node.children, scope.copy())
        if kind == "redirected_statement":
            body = node.child_by_field_name("body")
            found = [c for c in node.children if c.type.endswith("_redirect")]
            if body is not None:
                self.statement(body, scope, background, found)
            return
        if kind == "command":
            return self.simple(node, scope, background, redirects)
        if kind in ("variable_assignment", "variable_assignments"):
            for a in ([node] if kind == "variable_assignment" else node.named_children):
                self.assign(a, scope, False)
            return
        if kind == "declaration_command":
            words = [c for c in node.children if c.is_named]
            return self.declare(text_of(node.children[0]), words, scope, line_of(node))
        if kind == "unset_command":
            for c in node.named_children:
                scope.vars.pop(text_of(c), None)
            return
        if kind == "function_definition":
            name = node.child_by_field_name("name")
            if name is not None:
                self.functions[text_of(name)] = node.child_by_field_name("body")
            return
        if kind == "list":  # `a && b || c`: nested to the left, read flat (a chain of any length)
            chain = []
            while node.type == "list":
                named = [c for c in node.children if c.is_named]
                if not named:
                    break
                chain[:0] = named[1:]
                node = named[0]
            self.statement(node, scope, False)
            for rest in chain:
                self.branches(rest, scope, [[rest], []], background)
            return
        if kind == "pipeline":
            for c in node.named_children:
                self.statement(c, scope.copy(), background, redirects)
            return
        if kind == "negated_command":
            for c in node.named_children:
                self.statement(c, scope, background)
            return
        if kind == "if_statement":
            return self.if_statement(node, scope)
        if kind in ("for_statement", "c_style_for_statement", "while_statement", "select_statement"):
            return self.loop(node, scope)
        if kind == "case_statement":
            return self.case(node, scope)
        if kind == "ERROR":
            self.note(line_of(node), f"line {line_of(node)}: not bash as written (a syntax error); read as far as it "
                                     "goes")
            return self.block(node.children, scope)
        for c in node.named_children:  # anything else: what it holds
            self.statement(c, scope, background)

    def assign(self, node, scope: Scope, exported: bool) -> None:
        name_node, value = node.child_by_field_name("name"), node.child_by_field_name("value")
        if name_node is None:
            return
        if name_node.type == "subscript":  # A[1]=x: one element, chosen at run time
            name = text_of(name_node.child_by_field_name("name") or name_node)
            scope.set(name, unknown_var(name, line_of(node), text_of(node), exported=exported))
            return
        name, line = text_of(name_node), line_of(node)
        appends = any(c.type == "+=" for c in node.children)
        written = text_of(value) if value is not None else ""
        for sub in _substituted_commands(value) if value is not None else ():  # X=$(srun hostname): a helper
            self.command(self._simple_of(sub, scope, False, [], in_substitution=True))
        old = scope.vars.get(name)
        if value is not None and value.type == "array":
            elements: Optional[List[Field]] = []
            for element in value.named_children:  # an unquoted $(...) is as many elements as it prints: spread
                if element.type != "comment":
                    elements += self.fields(element, scope)
            if appends and old is not None:
                elements = None if old.array is None or elements is None else list(old.array) + elements
            if elements is not None and len(elements) > MAX_PARTS:  # an array doubled again and again
                elements = None
            if elements is None:
                scope.set(name, unknown_var(name, line, written, exported=exported,
                                            why=f"${{{name}[@]}} (set on line {line} to {short(written)})"))
                return
            scope.set(name, Var(elements[0].parts if elements else (), line, exported, written, tuple(elements)))
            return
        parts = self.one(value, scope).parts if value is not None else ()
        if appends and old is not None:
            parts = merge(list(old.value) + list(parts))
        if self.loops and (old is None or old.value != parts):
            scope.set(name, unknown_var(name, line, written, parts, exported))
            return
        if len(parts) == 1 and isinstance(parts[0], Unknown) and parts[0].shown is None and \
                parts[0].written != "$" + name:  # `HEAD=$(...)`: `$HEAD` where it is used, set on this line
            scope.set(name, unknown_var(name, line, written, parts, exported))
            return
        scope.set(name, Var(parts, line, exported or bool(old and old.exported), written))  # known parts stay

    def declare(self, command: str, words: Sequence, scope: Scope, line: int) -> None:
        """export/declare/typeset/local/readonly: assignments, with -x (or export) marking them exported."""
        exported = command == "export"
        for word in words:
            if word.type == "word" and text_of(word).startswith(("-", "+")):
                exported = exported or (text_of(word).startswith("-") and "x" in text_of(word))
                continue
            if word.type == "variable_assignment":
                self.assign(word, scope, exported)
            elif word.type in ("variable_name", "word") and NAME.fullmatch(text_of(word)):
                name = text_of(word)
                var = scope.vars.get(name)
                if var is not None and exported:
                    scope.vars[name] = replace(var, exported=True)
                elif var is None and exported:
                    value = (scope.environ[name],) if name in scope.environ else scope.lookup(name)
                    scope.vars[name] = Var(tuple(value), line, True, f"${name} of the environment")

    def simple(self, node, scope: Scope, background: bool, redirects: Sequence) -> None:
        parts = _Simple(node)
        for a in parts.leading:
            self.assign(a, scope, False)
        if not parts.words:
            for a in parts.assignments:
                self.assign(a, scope, False)
            return
        head = text_of(parts.words[0])
        if head in ("set",) and len(parts.words) > 1:
            for word in parts.words[1:]:
                flag = text_of(word)
                if flag.startswith(("-", "+")) and "a" in flag[1:] or flag == "allexport":
                    scope.allexport = flag.startswith("-") or (flag == "allexport" and text_of(parts.words[1]) == "-o")
            return
        if head in ("export", "declare", "typeset", "local", "readonly"):  # joined by the grammar defect above
            return self.declare(head, parts.words[1:], scope, line_of(node))
        if head in ("source", ".") and len(parts.words) > 1:
            return self.source(parts.words[1], scope, node, background, redirects)
        if head == "cd":
            target = self.fields(parts.words[1], scope) if len(parts.words) > 1 else []
            scope.cwd = target[0].text if target and target[0].known and target[0].text != "-" else None
        if head in self.functions and not parts.assignments:
            return self.call(head, parts.words[1:], scope, line_of(node))
        self.command(self._simple_of(node, scope, background, redirects))

    def source(self, word, scope: Scope, node, background: bool, redirects: Sequence) -> None:
        """`source FILE` (or `. FILE`): its commands read here when the file is here (the reader says where a file
        named relative to the script's folder is: `base`); else what it sets is not known (scope.sourced)."""
        target = self.one(word, scope)
        path = target.text if target.known else None
        if path and not os.path.isabs(path) and scope.cwd is not None:
            path = os.path.join(self.base if scope.cwd == "." else scope.cwd, path)
        if path and self.sourced_read < MAX_SOURCED and os.path.isfile(path):
            try:
                text = read_regular(path, "sourced file", MAX_SOURCED_BYTES)
            except InputError as exc:
                self.note(line_of(node), str(exc))
            else:
                self.sourced_read += 1
                return self.read(text, scope)
        scope.sourced = True
        self.command(self._simple_of(node, scope, background, redirects))

    def _simple_of(self, node, scope: Scope, background: bool, redirects: Sequence,
                   in_substitution: bool = False) -> Simple:
        parts = _Simple(node)
        env = {}
        for a in parts.assignments:
            name_node, value = a.child_by_field_name("name"), a.child_by_field_name("value")
            if name_node is not None:
                env[text_of(name_node)] = Var(self.one(value, scope).parts if value is not None else (),
                                              line_of(a), True, text_of(a))
        return Simple(node, line_of(node), parts.words, scope, env, list(redirects) + parts.redirects, background,
                      self.loops > 0, self.conditionals > 0, self, in_substitution)

    def call(self, name: str, args: Sequence, scope: Scope, line: int) -> None:
        """A function's body read where it is called, its arguments as $1... and "$@" (put back after it)."""
        self.ever_called.add(name)
        if self.calls >= MAX_CALLS or self.depth >= MAX_DEPTH:
            if name not in self.limited:  # said at the first call not read
                self.limited.add(name)
                self.note(line, f"{name}: calls past {MAX_CALLS} in all (or {MAX_DEPTH} deep) are not read")
            return
        self.calls += 1
        values = [f for w in args for f in self.fields(w, scope)]
        saved = {n: scope.vars.get(n) for n in ["@", "#"] + [str(k) for k in range(1, 10)]}
        scope.vars["@"] = Var(values[0].parts if values else (), line, False, f"the call on line {line}",
                              tuple(values))
        scope.vars["#"] = Var((str(len(values)),), line, False, f"the call on line {line}")
        for k in range(1, 10):
            scope.vars[str(k)] = Var(values[k - 1].parts if k <= len(values) else (), line, False,
                                     f"${k} of the call on line {line}")
        self.depth += 1
        try:
            self.statement(self.functions[name], scope)
        finally:
            self.depth -= 1
            for n, old in saved.items():
                if old is None:
                    scope.vars.pop(n, None)
                else:
                    scope.vars[n] = old

    # -- control flow
    def branches(self, node, scope: Scope, alternatives: Sequence[Sequence], background: bool = False) -> None:
        """Statements of which one alternative runs (an empty one: none): each read from the same start; afterwards
        a variable is known only where every alternative leaves it the same."""
        start, ends = scope.vars, []
        self.conditionals += 1
        try:
            for statements in alternatives:
                scope.vars = dict(start)
                self.work += len(start) // 64  # the copy
                for s in statements:
                    self.statement(s, scope, background)
                ends.append(scope.vars)
        finally:
            self.conditionals -= 1
        scope.vars = _agreed(start, ends, line_of(node))

    def if_statement(self, node, scope: Scope) -> None:
        """if/elif/else: a condition this reader can decide (`[ -z "$X" ]` on a known or unset X) picks its branch;
        from the first it cannot, every branch left may run."""
        clauses, body, conditions, has_else = [], [], [], False
        for c in node.children:
            if c.type in ("elif_clause", "else_clause"):
                has_else = has_else or c.type == "else_clause"
                clauses.append(_clause(c))
            elif c.is_named and c in node.children_by_field_name("condition"):
                conditions.append(c)
            elif c.is_named:
                body.append(c)
        clauses.insert(0, (conditions, body))
        for k, (conditions, statements) in enumerate(clauses):
            decided = self.decide(conditions, scope) if conditions else True
            if decided is True:
                return self.block(conditions + statements, scope)
            if decided is None:
                rest = [c + s for c, s in clauses[k:]]
                return self.branches(node, scope, rest + ([] if has_else else [[]]))

    def decide(self, conditions: Sequence, scope: Scope) -> Optional[bool]:
        """A condition's truth where it is one test of values known here: `[ ... ]`, `[[ ... ]]`, `test ...`."""
        named = [c for c in conditions if c.is_named]
        if len(named) != 1:
            return None
        node = named[0]
        if node.type == "test_command":
            inner = [c for c in node.named_children]
            return self.truth(inner[0], scope, text_of(node).startswith("[[")) if len(inner) == 1 else None
        return None

    def truth(self, node, scope: Scope, double: bool, depth: int = 0) -> Optional[bool]:
        """A test's truth where its values are known here; None past 48 tests inside one another."""
        if depth > 48:
            return None
        if node.type == "parenthesized_expression" and node.named_children:
            return self.truth(node.named_children[0], scope, double, depth + 1)
        if node.type == "unary_expression":
            operator = node.child_by_field_name("operator")
            operand = [c for c in node.named_children if c != operator]
            op = text_of(operator) if operator is not None else text_of(node.children[0])
            if op == "!" and operand:
                inner = self.truth(operand[0], scope, double, depth + 1)
                return None if inner is None else not inner
            value = self.test_value(operand[0], scope) if operand else None
            if value is None or op not in ("-z", "-n"):
                return None
            return (value == "") == (op == "-z")
        if node.type == "binary_expression":
            left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
            operator = node.child_by_field_name("operator")
            if left is None or right is None or operator is None:
                return None
            op = text_of(operator)
            if op in ("&&", "||", "-a", "-o"):
                a, b = self.truth(left, scope, double, depth + 1), self.truth(right, scope, double, depth + 1)
                if op in ("&&", "-a"):
                    return False if False in (a, b) else None if None in (a, b) else True
                return True if True in (a, b) else None if None in (a, b) else False
            a, b = self.test_value(left, scope), self.test_value(right, scope)
            if a is None or b is None:
                return None
            if op in ("=", "==", "!="):
                same = fnmatch.fnmatchcase(a, b) if double else a == b  # [[ == ]]: the right side is a pattern
                return same == (op != "!=")
            numbers = {"-eq": "==", "-ne": "!=", "-lt": "<", "-gt": ">", "-le": "<=", "-ge": ">="}
            whole = re.compile(r"\s*-?[0-9]{1,18}\s*")  # ASCII digits, as bash's test takes (and int() any length)
            if op in numbers and whole.fullmatch(a) and whole.fullmatch(b):
                x, y = int(a), int(b)
                return {"==": x == y, "!=": x != y, "<": x < y, ">": x > y, "<=": x <= y, ">=": x >= y}[numbers[op]]
        return None

    def test_value(self, node, scope: Scope) -> Optional[str]:
        """A test's operand: its text where known; a variable the script never sets is empty (as submitted)."""
        value = self.one(node, scope)
        if value.known:
            return value.text
        if all(isinstance(p, str) or {x.split(":")[0] for x in p.sources} == {"unset"} for p in value.parts):
            return "".join(p for p in value.parts if isinstance(p, str))
        return None

    def loop(self, node, scope: Scope) -> None:
        variable = node.child_by_field_name("variable")
        if variable is not None:
            name = text_of(variable)
            scope.set(name, unknown_var(name, line_of(node), "the loop's values",
                                        why=f"${name} (a loop variable: each iteration its own)"))
        self.loops += 1
        try:
            body = [c for c in node.named_children if c is not variable]
            self.branches(node, scope, [body, []])
        finally:
            self.loops -= 1

    def case(self, node, scope: Scope) -> None:
        """bash(1), case: the first item whose pattern matches the word runs; with the word unknown any may."""
        value = node.child_by_field_name("value")
        word = self.one(value, scope) if value is not None else Field(())
        items = [c for c in node.named_children if c.type == "case_item"]
        if word.known:
            for item in items:
                patterns = [self.one(p, scope).text for p in item.children_by_field_name("value")]
                if any(fnmatch.fnmatchcase(word.text, p) for p in patterns):
                    return self.block(_item_body(item), scope)
            return
        self.note(line_of(node), f"case {short(text_of(value)) if value else ''}: chosen at run time; every branch is "
                                 "read and the first launch in them judged")
        self.branches(node, scope, [_item_body(i) for i in items] + [[]])

    # -- files
    def targets(self, cmd: Simple) -> List[Field]:
        """The files a command writes by redirection (> FILE, >> FILE, &> FILE), expanded."""
        found = []
        for r in cmd.redirects:
            for target in _redirect_targets(r):
                found += self.fields(target, cmd.scope)
        return found

    def heredoc(self, cmd: Simple) -> Optional[Tuple[Field, int, bool]]:
        """The heredoc fed to a command: (its text as the file gets it, its first line, quoted delimiter)."""
        for r in cmd.redirects:
            if r.type != "heredoc_redirect":
                continue
            start = next((c for c in r.children if c.type == "heredoc_start"), None)
            body = next((c for c in r.children if c.type == "heredoc_body"), None)
            strip = any(c.type == "<<-" for c in r.children)
            quoted = start is not None and any(q in text_of(start) for q in "'\"\\")  # bash(1), Here Documents
            if body is None:
                return Field(()), line_of(r) + 1, quoted
            if quoted:
                text = text_of(body)
                parts: List[Part] = [_strip_tabs(text) if strip else text]
            else:
                parts, at = [], body.start_byte
                for child in body.children:
                    if child.type == "heredoc_content":
                        continue
                    start = child.start_byte + leading_blanks(child)
                    parts += self.literal(_heredoc_unescape(between(body, at, start)))
                    parts += [v for v, _ in self.chunks(child, cmd.scope, True) if v is not BREAK]
                    at = child.end_byte
                parts += self.literal(_heredoc_unescape(between(body, at, body.end_byte)))
                if strip:
                    parts = [_strip_tabs(p) if isinstance(p, str) else p for p in parts]
            parts = list(merge(parts))
            if parts and isinstance(parts[-1], str) and parts[-1].endswith("\n"):
                parts[-1] = parts[-1][:-1]
            return Field(merge(parts)), line_of(body), quoted
        return None


def _agreed(start: Dict[str, Var], ends: Sequence[Dict[str, Var]], line: int) -> Dict[str, Var]:
    """The variables after paths that each began with `start`: one a path changed (or unset) is known only where
    every path leaves it the same; the others are as they were (found by identity: no path touched them)."""
    changed = {n for end in ends for n, v in end.items() if start.get(n) is not v}
    changed.update(n for n in start if any(n not in end for end in ends))
    out = dict(start)
    for name in changed:
        values = [end.get(name) for end in ends]
        known = [v for v in values if v is not None]
        first = values[0]
        if not known:
            out.pop(name, None)
        elif all(v is not None and v.value == first.value and v.array == first.array for v in values):
            out[name] = replace(first, exported=any(v.exported for v in values))
        else:
            out[name] = unknown_var(name, line, "", [p for v in known for p in v.value], any(v.exported for v in known),
                                    why=f"${name} (set differently on the paths of line {line})")
    return out


def _clause(clause) -> Tuple[List, List]:
    """An elif clause's (conditions, statements); an else clause's ([], statements)."""
    named = [c for c in clause.children if c.is_named]
    if clause.type == "else_clause":
        return [], named
    then = next((k for k, c in enumerate(clause.children) if c.type == "then"), len(clause.children))
    before = [c for c in clause.children[:then] if c.is_named]
    return before, [c for c in clause.children[then:] if c.is_named]


def _item_body(item) -> List:
    return [c for c in item.named_children if c not in item.children_by_field_name("value")]


def _substituted_commands(node) -> Iterator:
    """The commands inside a value's command substitutions ($(...), `...`), in order, MAX_NESTING deep at most."""
    stack = [(node, 0)]  # a node, and the substitutions it is in
    while stack:
        node, depth = stack.pop()
        if node.type == "command" and depth:
            yield node
        depth += node.type == "command_substitution"
        if depth <= MAX_NESTING:
            stack.extend((c, depth) for c in reversed(node.children))


def _redirect_targets(node) -> Iterator:
    """The files a redirection (and the ones nested in it) writes."""
    stack = [node]
    while stack:
        node = stack.pop()
        if node.type == "file_redirect" and not any(c.type in ("<", "<&", ">&", "<<<") for c in node.children):
            target = node.child_by_field_name("destination")
            if target is not None and target.type != "process_substitution" and not text_of(target).isdigit():
                yield target
        stack.extend(c for c in reversed(node.children) if c.type == "file_redirect")


def _strip_tabs(text: str) -> str:
    return "\n".join(line.lstrip("\t") for line in text.split("\n"))


def _heredoc_unescape(text: str) -> str:
    """An unquoted heredoc's body: a backslash escapes only $ ` \\ and a newline (bash(1), Here Documents)."""
    return re.sub(r"\\([$`\\\n])", lambda m: "" if m.group(1) == "\n" else m.group(1), text) if "\\" in text else text
