"""Reading a YAML file a user wrote (a run config, an experiment spec) strictly, with answers that name the file
and the line.

PyYAML's `safe_load` lets the last of two equal keys win (`group_size: 8` ... `group_size: 4`, or a section given
twice, whose first half is then dropped without a word), and reports errors `in "<unicode string>"`. `read_yaml`
refuses a key given twice, also once dotted and once nested (`learner.optim.lr: 1e-5` and
`learner: {optim: {lr: 2e-5}}`), and says where each problem is: `run.yaml, line 5: ...`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError


class YamlFileError(ValueError):
    """A file that is not one readable YAML document; the message names the file and the line."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key given twice, directly or as a dotted key and a nested one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            _check_repeats(node)
        return super().construct_mapping(node, deep=deep)


def _leaves(node: yaml.Node, prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], yaml.Node]]:
    """(path, key node) of every key under `node`, a dotted key split at its dots."""
    out = []
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        path = prefix + tuple(key.value.split("."))
        out.append((path, key))
        if isinstance(value, yaml.MappingNode):
            out += _leaves(value, path)
    return out


def _check_repeats(node: yaml.MappingNode) -> None:
    seen: dict[str, yaml.Node] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        if key.value in seen:
            first = seen[key.value].start_mark.line + 1
            raise ConstructorError(None, None, f"{key.value} is given twice (lines {first} and "
                                   f"{key.start_mark.line + 1}); the second would replace the first (a section "
                                   "given twice loses the first one's keys): keep one", key.start_mark)
        seen[key.value] = key
    if not any("." in k for k in seen):
        return
    by_path: dict[tuple[str, ...], tuple[yaml.Node, yaml.Node]] = {}  # path -> (its top key, its own key)
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        top = tuple(key.value.split("."))
        mine = [(top, key)] + (_leaves(value, top) if isinstance(value, yaml.MappingNode) else [])
        for path, k in mine:
            if path in by_path and by_path[path][0] is not key:
                a, b = sorted([by_path[path][1], k], key=lambda n: n.start_mark.line)
                raise ConstructorError(None, None, f"{'.'.join(path)} is given twice, once as a dotted key and once "
                                       f"nested in its section (lines {a.start_mark.line + 1} and "
                                       f"{b.start_mark.line + 1}); keep one", b.start_mark)
        for path, k in mine:
            by_path.setdefault(path, (key, k))


def _where(p: Path, mark: Any) -> str:
    return f"{p}, line {mark.line + 1}" + (f", column {mark.column + 1}" if mark.column else "")


def _explain(p: Path, e: yaml.YAMLError) -> str:
    """One line: the file and line, what is wrong, and for the usual slips (tabs, a second document) the fix."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    where = _where(p, mark) if mark is not None else str(p)
    if "'\\t'" in problem:
        return f"{where}: a tab; YAML indents with spaces only (replace the tab with spaces)"
    if "expected a single document" in (getattr(e, "context", None) or ""):
        return f"{where}: a second YAML document ('---'); one file holds one document: remove it, or merge the two"
    if isinstance(e, ConstructorError):  # a key given twice: its message has the lines
        return f"{p}, line {mark.line + 1}: {problem}"
    context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
    opened = f" that starts on line {start.line + 1}" if start is not None and start.line != mark.line else ""
    return f"{where}: not valid YAML: {problem}" + (f" ({context}{opened})" if context else "")


def read_yaml(p: Path, what: str) -> Any:
    """The document in `p`, which the caller has checked is a file; `what` names it ("a config is a YAML file
    of sections"). YamlFileError for bytes that are not UTF-8, invalid YAML, several documents, a tab indent,
    and a key given twice."""
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise YamlFileError(f"{p}, line {line}: not a text file (byte {e.start} is not UTF-8); {what}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506: a SafeLoader
    except yaml.YAMLError as e:
        raise YamlFileError(_explain(p, e)) from None
