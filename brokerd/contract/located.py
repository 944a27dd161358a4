"""YAML with line numbers, and the error every contract file problem becomes.

PyYAML's `safe_load` throws the marks away, so a message could not say *where* a bad
key is. `load_located` composes the node tree and keeps each value's line beside it,
together with the raw scalar text: "2.10" must stay a version, not become the float 2.1.

Contract files come from any local user, so loading is bounded before anything is built
(docs/security.md): the text's size, NUL bytes, anchors and aliases (refused outright, so
no expansion "bomb" exists), nesting depth and node count are checked on the parser's
event stream, which is flat (no recursion) and runs in libyaml when it is installed.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

# Limits on what a contract file may be. A human-written runtime spec is a few KiB with
# a nesting depth under 6; these leave a wide margin and still bound the daemon's work.
MAX_BYTES = 256 * 1024
MAX_DEPTH = 32
MAX_NODES = 20_000
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ContractError(ValueError):
    """A contract file cannot be used. The message names the file, the line and the key."""


@dataclass
class Located:
    """One YAML value. `value` is a dict of str -> Located, a list of Located, or a scalar."""

    value: Any
    line: int  # 1-based
    raw: str = ""  # the scalar exactly as written; "" for mappings and sequences
    key_lines: dict[str, int] = field(default_factory=dict)

    @property
    def is_mapping(self) -> bool:
        return isinstance(self.value, dict)

    @property
    def is_sequence(self) -> bool:
        return isinstance(self.value, list)

    @property
    def is_scalar(self) -> bool:
        return not (self.is_mapping or self.is_sequence)

    def plain(self) -> Any:
        """The value with the line information stripped (for messages and tests)."""
        if self.is_mapping:
            return {k: v.plain() for k, v in self.value.items()}
        if self.is_sequence:
            return [v.plain() for v in self.value]
        return self.value


class Source:
    """Error reporting for one file: `source.error(node, "key.path", "what is wrong")`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def error(self, line: int, key: str, message: str) -> ContractError:
        where = f"{self.name}:{line}" if line else self.name
        return ContractError(f"{where}: {key}: {message}" if key else f"{where}: {message}")

    def unknown_key(
        self, line: int, key: str, name: str, known: Iterable[str], what: str = "key"
    ) -> ContractError:
        """The did-you-mean error: unknown key 'gpu_vender'; did you mean 'gpu_vendor'?"""
        known = list(known)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"expected one of: {', '.join(known)}"
        return self.error(line, key, f"unknown {what} '{name}'; {hint}")


def load_located(text: str, source: Source) -> Located | None:
    """Parse one YAML document; None for an empty one. Raises ContractError with the
    line of a syntax error or of a duplicate key, and refuses what the limits forbid."""
    _check_text(text, source)
    loader = _Loader(text)
    try:
        _check_events(text, source)
        node = loader.get_single_node()
        return None if node is None else _convert(node, loader, source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise source.error(line, "", f"not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise source.error(0, "", f"not valid YAML: {exc}") from None
    except (UnicodeError, RecursionError) as exc:
        raise source.error(0, "", f"not valid YAML: {type(exc).__name__}") from None
    finally:
        loader.dispose()


def _check_text(text: str, source: Source) -> None:
    if len(text) > MAX_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise source.error(0, "", f"larger than {MAX_BYTES // 1024} KiB; a contract file is a few KiB")
    nul = text.find("\0")
    if nul >= 0:
        raise source.error(text.count("\n", 0, nul) + 1, "", "contains a NUL byte; a contract file is text")


def _check_events(text: str, source: Source) -> None:
    """Refuse anchors/aliases, too deep nesting and too many nodes, before composing."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_Loader):
        line = event.start_mark.line + 1 if event.start_mark else 0
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise source.error(line, "", "YAML anchors and aliases (&name, *name) are not allowed in "
                                         "contract files; write the values out")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise source.error(line, "", f"nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_NODES:
                raise source.error(line, "", f"more than {MAX_NODES} values")


def _convert(node: yaml.Node, loader: yaml.SafeLoader, source: Source) -> Located:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)  # resolves YAML merge keys (<<: *anchor)
        items: dict[str, Located] = {}
        key_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node)
            key_line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                raise source.error(key_line, str(key), "keys must be names (text)")
            if key in items:
                raise source.error(key_line, key, f"duplicate key (first on line {key_lines[key]})")
            items[key] = _convert(value_node, loader, source)
            key_lines[key] = key_line
        return Located(items, line, key_lines=key_lines)
    if isinstance(node, yaml.SequenceNode):
        return Located([_convert(n, loader, source) for n in node.value], line)
    return Located(loader.construct_object(node), line, raw=str(node.value))


_TYPE_WORDS = {dict: "a mapping (key: value)", list: "a list", str: "text", bool: "true or false"}


def type_word(node: Located) -> str:
    if node.is_mapping:
        return "a mapping"
    if node.is_sequence:
        return "a list"
    if node.value is None:
        return "nothing (null)"
    return f"{type(node.value).__name__} {node.raw!r}"


def expect_mapping(
    source: Source, node: Located, key: str, known: Iterable[str]
) -> dict[str, Located]:
    """The node's items, after rejecting a non-mapping or an unknown key."""
    if not node.is_mapping:
        raise source.error(node.line, key, f"expected {_TYPE_WORDS[dict]}, got {type_word(node)}")
    known = tuple(known)
    for name in node.value:
        if name not in known:
            raise source.unknown_key(node.key_lines[name], _join(key, name), name, known)
    return node.value


def expect_list(source: Source, node: Located, key: str) -> list[Located]:
    if not node.is_sequence:
        raise source.error(node.line, key, f"expected {_TYPE_WORDS[list]}, got {type_word(node)}")
    return node.value


def expect_text(source: Source, node: Located, key: str) -> str:
    """A scalar as written (numbers too: a version "2.10" stays "2.10")."""
    if not node.is_scalar or node.value is None or isinstance(node.value, bool):
        raise source.error(node.line, key, f"expected {_TYPE_WORDS[str]}, got {type_word(node)}")
    return node.raw.strip()


def expect_bool(source: Source, node: Located, key: str) -> bool:
    if not isinstance(node.value, bool):
        raise source.error(node.line, key, f"expected {_TYPE_WORDS[bool]}, got {type_word(node)}")
    return node.value


def expect_number(source: Source, node: Located, key: str, *, positive: bool = True) -> float:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise source.error(node.line, key, f"expected a number, got {type_word(node)}")
    if positive and value <= 0:
        raise source.error(node.line, key, f"must be positive, got {node.raw}")
    return float(value)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
