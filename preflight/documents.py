"""Reading YAML and JSON documents so that every value can be traced back to its file and line.

Anything a user can hand us (a missing path, a folder, binary data, malformed text) becomes an
InputError: one line that names the file, the line where known, and the problem.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple

import yaml

KeyPath = Tuple[Any, ...]


class InputError(Exception):
    """Unreadable or invalid input; the CLI prints it as one line and exits 2."""

    def __init__(self, path: str, problem: str, line: Optional[int] = None):
        self.path, self.problem, self.line = path, problem, line
        super().__init__(f"{path}:{line}: {problem}" if line else f"{path}: {problem}")


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

    def section(self, *keys: Any) -> Optional["Document"]:
        value = self.data
        for key in keys:
            value = value.get(key) if isinstance(value, Mapping) else None
        if not isinstance(value, Mapping):
            return None
        return Document(self.path, value, self.kind, self.lines, self.plain_strings, self.duplicates, self.prefix + keys)

    def is_plain_string(self, *keys: Any) -> bool:
        return self.prefix + keys in self.plain_strings


def read_text(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise InputError(path, f"{what} not found")
    if os.path.isdir(path):
        raise InputError(path, f"{what} is a directory, expected a file")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(16 * 1024 * 1024 + 1)
    except OSError as exc:
        raise InputError(path, f"cannot read {what}: {exc.strerror or exc}") from None
    if len(raw) > 16 * 1024 * 1024:
        raise InputError(path, f"{what} is larger than 16 MiB; this is not a configuration file")
    if b"\x00" in raw:
        raise InputError(path, f"{what} holds binary data, expected text")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(path, f"{what} is not UTF-8 text (bad byte at offset {exc.start})") from None
    if not text.strip():
        raise InputError(path, f"{what} is empty")
    return text


def load(path: str, what: str, kind: Optional[str] = None) -> Document:
    """Read a YAML or JSON mapping; `kind` defaults to the file's extension (YAML unless .json)."""
    text = read_text(path, what)
    kind = kind or ("json" if path.lower().endswith(".json") else "yaml")
    return parse_json(path, text, what) if kind == "json" else parse_yaml(path, text, what)


def parse_yaml(path: str, text: str, what: str) -> Document:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise InputError(path, f"{what} is empty")
        lines, plain, dups = _yaml_positions(node)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        raise InputError(path, f"malformed YAML: {problem}", mark.line + 1 if mark else None) from None
    except yaml.YAMLError as exc:
        raise InputError(path, f"malformed YAML: {exc}") from None
    except RecursionError:
        raise InputError(path, "YAML nesting is too deep") from None
    finally:
        loader.dispose()
    return Document(path, _top_mapping(path, data, what, "YAML"), "yaml", lines, plain, dups)


def _yaml_positions(root: yaml.Node):
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


def parse_json(path: str, text: str, what: str) -> Document:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(path, f"malformed JSON: {exc.msg} (column {exc.colno})", exc.lineno) from None
    except RecursionError:
        raise InputError(path, "JSON nesting is too deep") from None
    lines, dups = _json_positions(text)
    return Document(path, _top_mapping(path, data, what, "JSON"), "json", lines, frozenset(), dups)


def _json_positions(text: str):
    """Line of every key of a well-formed JSON text, and of every repeated key."""
    lines: Dict[KeyPath, int] = {}
    dups = []
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
        elif c in "}]":
            stack.pop()
        elif c == "," and stack:
            if stack[-1][0] == "{":
                stack[-1][3] = True
            else:
                stack[-1][2] += 1
        i += 1
    return lines, tuple(dups)


def _top_mapping(path: str, data: Any, what: str, syntax: str) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        found = "nothing" if data is None else f"a {type(data).__name__}"
        raise InputError(path, f"{what} must be a {syntax} mapping of settings, found {found}")
    return data
