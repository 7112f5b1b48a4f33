"""Reading YAML and JSON documents so that every value can be traced back to its file and line.

Anything a user can hand us (a missing path, a folder, binary data, malformed text) becomes an
InputError: one line that names the file, the line where known, and the problem.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Iterator, List, Mapping, Optional, Tuple

if TYPE_CHECKING:  # PyYAML is imported where a YAML file is read (20 ms of every start otherwise)
    import yaml


KeyPath = Tuple[Any, ...]


class InputError(Exception):
    """Unreadable or invalid input; the CLI prints it as one line and exits 2."""

    def __init__(self, path: str, problem: str, line: Optional[int] = None):
        self.path, self.problem, self.line = path, problem, line
        super().__init__(one_line(f"{path}:{line}: {problem}" if line else f"{path}: {problem}"))


def one_line(text: str) -> str:
    """Escape line breaks and other unprintable characters (a path, a YAML tag with %0A in it) so
    that a message stays one line on a terminal. Most texts have nothing to escape: no walk over them."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def shorten(value: Any, limit: int = 60) -> str:
    """repr() of a value for a one-line message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def counted(count: int, noun: str, plural: str = "") -> str:
    """'1 GPU', '2 GPUs', '2 processes' (plural: when adding an s is not it)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


# Limits on what a configuration file can be; past them the file is refused, not walked.
MAX_DEPTH = 100  # nesting: deeper structures overflow recursive walks (deepcopy, json, the checks)
MAX_VALUES = 100_000  # values with every use of an alias expanded: refuses a "billion laughs"
MAX_DIGITS = 4000  # an integer written with more digits is no setting (int() refuses past 4300 at all)


@dataclass(frozen=True)
class Document:
    """A parsed mapping plus the line of every key; `prefix` roots a view at a nested section."""

    path: str
    data: Mapping[str, Any]
    kind: str  # "yaml" or "json"
    lines: Mapping[KeyPath, int] = field(default_factory=dict, repr=False)
    plain_strings: FrozenSet[KeyPath] = frozenset()  # YAML plain scalars that resolved to strings
    duplicates: Tuple[Tuple[KeyPath, int], ...] = ()  # keys given twice: (path, line of the repeat)
    prefix: KeyPath = ()
    # What DeepSpeed's hjson reads past and json.load refuses ("comments", "trailing commas", "a byte order mark")
    hjson_only: Tuple[str, ...] = ()
    # json.load's refusal of the text as written, (line, problem), where the file was read another way: past what
    # hjson_only names, or as YAML (a DeepSpeed config named .yaml that is not JSON); None where json.load reads it
    json_load_refusal: Optional[Tuple[Optional[int], str]] = None

    def line(self, *keys: Any) -> Optional[int]:
        path = self.prefix + keys
        while path:  # the nearest enclosing key that has a line
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def where(self, *keys: Any) -> str:
        line = self.line(*keys)
        return f"{self.path}:{line}" if line else self.path

    def setting(self, *keys: Any) -> str:
        """The name a fix tells the user to set for keys: the key path here (a launch flag in FlagDocument)."""
        return ".".join(str(k) for k in keys)

    def given_by_flag(self, *keys: Any) -> bool:
        """Whether a launch flag gives the value at keys (FlagDocument); never in a file's own document."""
        return False

    def in_file(self, *keys: Any) -> bool:
        """Whether the file itself writes keys, whether or not a launch flag gives a value over it."""
        value: Any = self.data
        for key in keys:
            if not isinstance(value, Mapping) or key not in value:
                return False
            value = value[key]
        return True

    def section(self, *keys: Any) -> Optional["Document"]:
        value = self.data
        for key in keys:
            value = value.get(key) if isinstance(value, Mapping) else None
        if not isinstance(value, Mapping):
            return None
        return dataclasses.replace(self, data=value, prefix=self.prefix + keys)

    def is_plain_string(self, *keys: Any) -> bool:
        return self.prefix + keys in self.plain_strings


def read_regular(path: str, what: str, max_bytes: int) -> str:
    """The text of a file that must be a regular file of at most `max_bytes` (what sbatch and kubectl read: a
    FIFO or a device could block), as read_text reads it."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise InputError(path, f"{what} cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise InputError(path, f"{what} is a directory, expected a file")
    if not stat.S_ISREG(info.st_mode):
        raise InputError(path, f"{what} is not a regular file")
    if info.st_size > max_bytes:
        raise InputError(path, f"{what} is larger than {max_bytes // 2**20} MiB ({info.st_size} bytes)")
    return read_text(path, what, limit=max_bytes)  # a file of /proc says 0 bytes whatever it holds


def read_text(path: str, what: str, bom: bool = False, limit: int = 16 * 1024 * 1024) -> str:
    """The file's text, at most `limit` bytes; `bom`: a UTF-8 byte order mark at its start is kept (json.load refuses
    it), else dropped."""
    if not os.path.exists(path):
        raise InputError(path, f"{what} not found")
    if os.path.isdir(path):
        raise InputError(path, f"{what} is a directory, expected a file")
    mode = os.stat(path).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):  # a terminal or a device could block or never end
        raise InputError(path, f"{what} is not a regular file")
    try:
        # O_NONBLOCK: opening a named pipe that nobody writes to would otherwise wait forever (a pipe
        # such as <(envsubst < accel.yaml) still reads); its reads then block again, as usual. A regular file
        # reads as ever; one of /proc that would wait for data (/proc/kmsg) says so instead of blocking.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        if stat.S_ISFIFO(mode):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(limit + 1)
        if raw is None:  # nothing to read now, and more may come: not a file of text
            raise InputError(path, f"{what} cannot be read: it waits for data that may never come")
    except OSError as exc:
        raise InputError(path, f"cannot read {what}: {exc.strerror or exc}") from None
    if len(raw) > limit:
        raise InputError(path, f"{what} is larger than {limit // 2**20} MiB; this is not a configuration file")
    if b"\x00" in raw:
        raise InputError(path, f"{what} holds binary data, expected text")
    try:
        text = raw.decode("utf-8" if bom else "utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start]
        raise InputError(path, f"{what} is not UTF-8 text (byte 0x{bad:02x} at offset {exc.start})",
                         raw.count(b"\n", 0, exc.start) + 1) from None
    if not text.lstrip("\ufeff").strip():
        raise InputError(path, f"{what} is empty")
    return text


def syntax_by_name(path: str) -> str:
    """accelerate's rule for its config file: JSON when the name ends in `.json`, in that case, else YAML
    (accelerate/commands/config/config_args.py, load_config_from_file: `config_file.endswith(".json")`)."""
    return "json" if path.endswith(".json") else "yaml"


def load(path: str, what: str, kind: Optional[str] = None, comments: bool = False,
         text: Optional[str] = None) -> Document:
    """Read a YAML or JSON mapping; `kind` defaults to syntax_by_name; `comments`: JSON is read as DeepSpeed's hjson
    reads it too (parse_json); `text`: the document's text where the caller holds it (a file a batch script writes
    from a heredoc), `path` then names where it is written."""
    kind = kind or syntax_by_name(path)
    if text is None:
        text = read_text(path, what, bom=kind == "json")  # YAML readers skip a byte order mark themselves
    return parse_json(path, text, what, comments) if kind == "json" else parse_yaml(path, text, what)


def parse_deepspeed(path: str, text: str, what: str = "DeepSpeed config") -> Document:
    """A DeepSpeed config as its readers read it, whatever its name: DeepSpeed with hjson (deepspeed/runtime/config.py,
    DeepSpeedConfig), accelerate's and transformers' HfDeepSpeedConfig with json.load (accelerate/utils/deepspeed.py),
    which accelerate launch's DeepSpeedPlugin and the transformers Trainer build; Lightning's strategy with json.load
    too. Only a file named .yaml or .yml that is not JSON is read as YAML, as a script that reads it itself would
    read it; json_load_refusal then says why the libraries do not (CFG008)."""
    try:
        return parse_json(path, text, what, comments=True)
    except InputError as refused:
        if not path.lower().endswith((".yaml", ".yml")):
            raise
        doc = parse_yaml(path, text, what)  # meant as YAML: its own errors are the ones to show
        return dataclasses.replace(doc, json_load_refusal=(refused.line, refused.problem))


@functools.lru_cache(maxsize=None)
def _loader():
    """PyYAML's safe loader that remembers where each alias is used and refuses numbers past MAX_DIGITS, made on
    first use: PyYAML is imported only where a YAML file is read."""
    import yaml

    class Loader(yaml.SafeLoader):
        def __init__(self, text: str):
            super().__init__(text)
            self.alias_lines: Dict[Tuple[int, Any], int] = {}  # (id(parent node), key node id or index) -> line

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):  # the node an alias gives is the anchor's: remember where it is used
                place = index if isinstance(index, int) else id(index)
                self.alias_lines[id(parent), place] = self.peek_event().start_mark.line + 1
            return super().compose_node(parent, index)

        def construct_object(self, node, deep=False):
            if (isinstance(node, yaml.ScalarNode) and len(node.value) > MAX_DIGITS
                    and node.tag.endswith((":int", ":float"))):
                raise yaml.constructor.ConstructorError(None, None, f"a number of {len(node.value)} digits",
                                                        node.start_mark)
            try:
                value = super().construct_object(node, deep)
            except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError) as exc:
                # PyYAML's constructors raise these on values such as `2001-13-45` or `!!int ""`:
                # give them the node's line, like its own errors.
                raise yaml.constructor.ConstructorError(
                    None, None, f"cannot read {node.tag.rsplit(':', 1)[-1]} value {shorten(node.value)}: {exc}",
                    node.start_mark,
                ) from None
            return value

    return Loader


@contextlib.contextmanager
def _yaml_errors(path: str, text: str) -> Iterator[None]:
    """PyYAML's errors, and a nesting Python cannot follow, as one InputError that names the file and the line."""
    import yaml

    try:
        yield
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        if exc.problem and exc.context and exc.context_mark and exc.context_mark.line != mark.line:
            # "found unexpected end of stream" is more use with where the unclosed thing began
            problem += f" ({exc.context} on line {exc.context_mark.line + 1})"
        raise InputError(path, f"malformed YAML: {problem}", mark.line + 1 if mark else None) from None
    except yaml.reader.ReaderError as exc:
        problem = f"unacceptable character #x{exc.character:04x}: {exc.reason}"
        raise InputError(path, f"malformed YAML: {problem}", text.count("\n", 0, exc.position) + 1) from None
    except yaml.YAMLError as exc:
        raise InputError(path, f"malformed YAML: {exc}") from None
    except RecursionError:
        raise InputError(path, "YAML nesting is too deep") from None


def parse_yaml(path: str, text: str, what: str) -> Document:
    loader = None
    with _yaml_errors(path, text):
        try:
            loader = _loader()(text)  # its reader refuses control characters here, before any parsing
            node = loader.get_single_node()
            if node is None:
                raise InputError(path, f"{what} is empty")
            _check_yaml_graph(path, node, loader.alias_lines)
            lines, plain, dups = _yaml_positions(node)
            data = loader.construct_document(node)
        finally:
            if loader is not None:
                loader.dispose()
    return Document(path, _top_mapping(path, data, what, "YAML"), "yaml", lines, plain, dups)


def yaml_documents(path: str, text: str, limit: int) -> List[Tuple[Any, int]]:
    """Every document of a YAML stream (`---` between them) with its first line, each held to the limits of one
    configuration file (an alias bomb is refused before it is built: _check_yaml_graph); past `limit` documents
    the file is refused."""
    docs: List[Tuple[Any, int]] = []
    loader = None
    with _yaml_errors(path, text):
        try:
            loader = _loader()(text)
            while loader.check_node():
                node = loader.get_node()
                if node is None:
                    continue
                if len(docs) >= limit:
                    raise InputError(path, f"holds more than {limit} documents")
                _check_yaml_graph(path, node, loader.alias_lines)
                docs.append((loader.construct_document(node), node.start_mark.line + 1))
        finally:
            if loader is not None:
                loader.dispose()
    return docs


STR_TAG, MERGE_TAG = "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"


def _check_yaml_graph(path: str, root: yaml.Node, alias_lines: Mapping[Tuple[int, Any], int]) -> None:
    """Refuse, before anything walks the data, what would make a walk loop (an alias inside its own
    anchor), explode (aliases of aliases: a "billion laughs") or overflow (deep nesting), and keys
    that are not strings (`1:`, `true:`, `[a, b]:`), which neither accelerate nor DeepSpeed can have."""
    import yaml

    done: Dict[int, Tuple[int, int]] = {}  # id(node) -> (values under it with aliases expanded, height)
    open_nodes = set()  # the nodes on the way down to the current one

    def walk(node: yaml.Node, depth: int, alias_line: Optional[int]) -> Tuple[int, int]:
        line = alias_line or node.start_mark.line + 1
        if id(node) in done:  # an alias: count it again, without walking it again
            size, height = done[id(node)]
            if depth + height > MAX_DEPTH:
                raise InputError(path, f"YAML nesting is deeper than {MAX_DEPTH} levels (through an alias)", line)
            return size, height
        if id(node) in open_nodes:
            raise InputError(path, "recursive YAML alias: it is used inside the node it names", line)
        collection = not isinstance(node, yaml.ScalarNode)
        if collection and depth > MAX_DEPTH:  # depth: of the mappings and lists, as JSON counts it
            raise InputError(path, f"YAML nesting is deeper than {MAX_DEPTH} levels", line)
        open_nodes.add(id(node))
        children = []  # (node, line of the alias when it is one)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag != MERGE_TAG and not (isinstance(key, yaml.ScalarNode) and key.tag == STR_TAG):
                    if isinstance(key, yaml.ScalarNode):
                        problem = f"key {key.value!r} is read as {key.tag.rsplit(':', 1)[-1]}, not a string; quote it"
                    else:
                        problem = f"a key is a {key.id}, expected a string"
                    raise InputError(path, problem, key.start_mark.line + 1)
                children.append((value, alias_lines.get((id(node), id(key)))))
        elif isinstance(node, yaml.SequenceNode):
            children = [(item, alias_lines.get((id(node), i))) for i, item in enumerate(node.value)]
        size, height = 1, 0 if collection else -1  # height: of the deepest mapping or list, from here
        for child, child_alias_line in children:
            child_size, child_height = walk(child, depth + 1, child_alias_line)
            size, height = size + child_size, max(height, child_height + 1)
        open_nodes.discard(id(node))
        if size > MAX_VALUES:
            raise InputError(path, f"holds more than {MAX_VALUES} values (counting every use of an alias); "
                                   "this is not a configuration file", line)
        done[id(node)] = size, height
        return size, height

    walk(root, 0, None)


def _yaml_positions(root: yaml.Node):
    import yaml

    lines: Dict[KeyPath, int] = {}
    plain, dups = set(), []
    seen_nodes = set()  # aliases can make a graph (even a cycle): visit each node once

    def walk(node: yaml.Node, path: KeyPath) -> None:
        if id(node) in seen_nodes:
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys = set()
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                child = path + (key_node.value,)
                if key_node.value in keys:
                    dups.append((child, key_node.start_mark.line + 1))
                keys.add(key_node.value)
                lines[child] = key_node.start_mark.line + 1
                if isinstance(value_node, yaml.ScalarNode):
                    if value_node.style is None and value_node.tag == "tag:yaml.org,2002:str":
                        plain.add(child)
                else:
                    walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines.setdefault(path + (index,), item.start_mark.line + 1)
                walk(item, path + (index,))

    walk(root, ())
    return lines, frozenset(plain), tuple(dups)


class _NotANumber(ValueError):
    """An integer past int()'s digit limit (else a ValueError from deep inside json.loads, without a position).
    NaN, Infinity and 1e999 are read, as DeepSpeed's json.load reads them: a setting whose value must be a
    number refuses them (jobconfig.validate_types)."""


def _json_integer(text: str) -> int:
    if len(text) > MAX_DIGITS:
        raise _NotANumber(text, f"an integer of {len(text)} digits")
    return int(text)


# A JSON string (to its line's end if it is never closed), or a comment as hjson takes them. Wherever a string's
# characters run out, one of its endings matches: a match never fails and is retried, so one pass over the text,
# whatever it holds.
JSON_STRING = r'"(?:[^"\\\n]|\\.)*(?:"|$|\\\Z)'
JSON_STRING_OR_COMMENT = re.compile(JSON_STRING + r'|//[^\n]*|#[^\n]*|/\*.*?(?:\*/|\Z)', re.S | re.M)
JSON_STRING_OR_TRAILING_COMMA = re.compile(JSON_STRING + r'|,(?=\s*[}\]])', re.S | re.M)


def hjson_reading(text: str) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """TEXT as JSON once what DeepSpeed's hjson reads past and json.load refuses is blanked (a byte order mark,
    // # /* */ comments, a comma before } or ]; newlines kept, so every key keeps its line), and what of these it
    held; None if it holds none, or a /* that is never closed (hjson stops on that too)."""
    found = []
    if text.startswith("\ufeff"):
        text = " " + text[1:]
        found.append("a byte order mark")
    closed = []

    def blank(match: "re.Match[str]") -> str:
        written = match.group(0)
        if written.startswith('"'):
            return written
        closed.append(not written.startswith("/*") or (len(written) >= 4 and written.endswith("*/")))
        return re.sub(r"[^\n]", " ", written)

    text = JSON_STRING_OR_COMMENT.sub(blank, text)
    if closed:
        if not all(closed):
            return None
        found.append("comments")
    commas = len(closed)
    text = JSON_STRING_OR_TRAILING_COMMA.sub(blank, text)
    if len(closed) > commas:
        found.append("trailing commas")
    return (text, tuple(found)) if found else None


def parse_json(path: str, text: str, what: str, comments: bool = False) -> Document:
    """A JSON mapping, as json.load reads it; `comments`: else as DeepSpeed's hjson reads it too (hjson_reading:
    comments, trailing commas, a byte order mark), json.load's refusal kept in the Document."""
    hjson_only, refusal = (), None
    try:
        data = _json_data(path, text)
    except InputError as refused:
        reading = hjson_reading(text) if comments else None
        if reading is None:
            raise
        text, hjson_only = reading
        data = _json_data(path, text)  # past them, the error of the text that is left
        refusal = (refused.line, refused.problem)
    lines, dups, too_deep = _json_positions(text)
    if too_deep:
        raise InputError(path, f"JSON nesting is deeper than {MAX_DEPTH} levels", too_deep)
    return Document(path, _top_mapping(path, data, what, "JSON"), "json", lines, frozenset(), dups,
                    hjson_only=hjson_only, json_load_refusal=refusal)


def _json_data(path: str, text: str) -> Any:
    try:
        return json.loads(text, parse_int=_json_integer)
    except json.JSONDecodeError as exc:
        if exc.msg.startswith("Unexpected UTF-8 BOM"):
            raise InputError(path, "malformed JSON: it starts with a UTF-8 byte order mark, which json.load refuses "
                                   "('Unexpected UTF-8 BOM'); save it as UTF-8 without one", 1) from None
        raise InputError(path, f"malformed JSON: {exc.msg} (column {exc.colno})", exc.lineno) from None
    except RecursionError:
        raise InputError(path, "JSON nesting is too deep") from None
    except _NotANumber as exc:
        found, problem = exc.args
        at = re.search(r"(?<![\w.])" + re.escape(found), text)  # its line: the first place it is written
        raise InputError(path, f"malformed JSON: {problem}", text.count("\n", 0, at.start()) + 1 if at else None) from None


def _json_positions(text: str):
    """Line of every key of a well-formed JSON text, of every repeated key, and where the nesting
    first goes deeper than MAX_DEPTH (None if never)."""
    lines: Dict[KeyPath, int] = {}
    dups = []
    too_deep = None
    stack = []  # frames: [kind, path, current key or index, expecting a key, keys seen]
    line, i, n = 1, 0, len(text)

    def value_path() -> KeyPath:
        if not stack:
            return ()
        kind, path, slot, _, _ = stack[-1]
        return path + (slot,)

    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
        elif c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if stack and stack[-1][0] == "{" and stack[-1][3]:
                frame = stack[-1]
                key = json.loads(text[i : j + 1])
                frame[2], frame[3] = key, False
                if key in frame[4]:
                    dups.append((frame[1] + (key,), line))
                frame[4].add(key)
                lines[frame[1] + (key,)] = line
            i = j
        elif c in "{[":
            path = value_path()
            if c == "[" and stack:
                lines.setdefault(path, line)
            stack.append([c, path, 0 if c == "[" else None, c == "{", set()])
            if len(stack) > MAX_DEPTH + 1 and too_deep is None:
                too_deep = line
        elif c in "}]":
            stack.pop()
        elif c == "," and stack:
            if stack[-1][0] == "{":
                stack[-1][3] = True
            else:
                stack[-1][2] += 1
        i += 1
    return lines, tuple(dups), too_deep


def _top_mapping(path: str, data: Any, what: str, syntax: str) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        found = "nothing" if data is None else f"a {type(data).__name__}"
        raise InputError(path, f"{what} must be a {syntax} mapping of settings, found {found}")
    return data
