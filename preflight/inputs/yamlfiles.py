"""YAML files as preflight reads them: PyYAML's safe loader, with each key's line, the plain (unquoted) strings,
duplicate keys, and an alias graph held to the limits of one configuration file before it is built. Imported
only when a YAML file is read (preflight.inputs.documents.parse_yaml): PyYAML's import is 20 ms of a start."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import yaml

from preflight.inputs.documents import (
    MAX_DEPTH, MAX_DIGITS, MAX_VALUES, Document, InputError, KeyPath, _top_mapping, shorten,
)


class _Loader(yaml.SafeLoader):
    def __init__(self, text: str):
        super().__init__(text)
        self.alias_lines: Dict[Tuple[int, Any], int] = {}  # (id(parent node), key node id or index) -> line

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):  # the node an alias gives is the anchor's: remember where it is used
            place = index if isinstance(index, int) else id(index)
            self.alias_lines[id(parent), place] = self.peek_event().start_mark.line + 1
        return super().compose_node(parent, index)

    def construct_object(self, node, deep=False):
        if isinstance(node, yaml.ScalarNode) and len(node.value) > MAX_DIGITS and node.tag.endswith((":int", ":float")):
            raise yaml.constructor.ConstructorError(None, None, f"a number of {len(node.value)} digits", node.start_mark)
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


@contextlib.contextmanager
def _yaml_errors(path: str, text: str) -> Iterator[None]:
    """PyYAML's errors, and a nesting Python cannot follow, as one InputError that names the file and the line."""
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
            loader = _Loader(text)  # its reader refuses control characters here, before any parsing
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
            loader = _Loader(text)
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
