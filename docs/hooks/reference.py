"""MkDocs hook: the reference pages that are generated from the code, so they cannot drift.

A page asks for a generated block with a marker on a line of its own:

    <!-- generate: config -->   the PSRT_* variables, read from psrt/config.py's Config
    <!-- generate: psrun -->    psrun's options, from launcher.cli.make_parser()
    <!-- generate: psrt -->     the psrt command's subcommands, from psrt.cli.make_parser()

psrt/config.py is read as source (its fields, the comments above them, ``_ENV_NAMES`` and
``_RANGES``), not imported: importing psrt starts MPI and torch, which a documentation build
has no business doing.  psrun's parser imports nothing heavy.  The psrt command's parser is
imported, since its subcommands live in several packages; that costs one torch import.
"""
from __future__ import annotations

import argparse
import ast
import operator
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # docs/hooks/ -> the repository
_MARKER = re.compile(r"^<!-- generate: ([\w-]+) -->$", re.MULTILINE)
_SIZES = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def on_page_markdown(markdown: str, page, config, files) -> str:
    return _MARKER.sub(lambda m: _generate(m.group(1), page.file.src_uri), markdown)


def _generate(what: str, where: str) -> str:
    if what == "config":
        return config_markdown((ROOT / "psrt" / "config.py").read_text())
    if what == "psrun":
        from launcher.cli import make_parser
        return parser_markdown(make_parser())
    if what == "psrt":
        from psrt.cli import make_parser
        return parser_markdown(make_parser())
    raise ValueError(f"{where}: unknown generated block {what!r} (config, psrun or psrt)")


# -- psrt/config.py ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One field of Config as a user meets it: its environment variables and what it does."""

    field: str
    names: tuple[str, ...]  # the PSRT_* name first, then Horovod's aliases
    kind: str  # int, float, bool, str
    default: object
    unit: str  # from _RANGES ("bytes", "seconds", ...), "" where there is none
    lowest: float | None
    highest: float | None
    meaning: str  # the comment above the field


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.LShift: operator.lshift}


def _value(node: ast.AST, names: dict[str, object]) -> object:
    """The value of a constant expression (``16 * _MiB``, ``(1, _TiB, "bytes")``)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left, names), _value(node.right, names))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, names)
    if isinstance(node, ast.Tuple):
        return tuple(_value(item, names) for item in node.elts)
    if isinstance(node, ast.Dict):
        return {_value(k, names): _value(v, names) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"psrt/config.py line {node.lineno}: {ast.unparse(node)!r} is not a constant expression")


def _comment_above(lines: list[str], lineno: int) -> str:
    """The ``#`` comment lines right above line ``lineno`` (1-based), joined."""
    text, i = [], lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        text.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(text)


def read_config(source: str) -> list[Setting]:
    """Every field of ``Config`` in psrt/config.py's source, in order."""
    tree, lines = ast.parse(source), source.splitlines()
    names: dict[str, object] = {}
    config = None
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.AST):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name):
                try:
                    names[target.id] = _value(node.value, names)
                except (ValueError, KeyError):
                    pass  # not a constant (a function call, say): no field refers to it
        elif isinstance(node, ast.ClassDef) and node.name == "Config":
            config = node
    if config is None:
        raise ValueError("psrt/config.py defines no class Config")
    env, ranges = names["_ENV_NAMES"], names["_RANGES"]
    settings = []
    for node in config.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        field = node.target.id
        if field not in env:
            raise ValueError(f"Config.{field} has no environment variable in _ENV_NAMES")
        lowest, highest, unit = ranges.get(field, (None, None, ""))
        meaning = _comment_above(lines, node.lineno)
        if not meaning:
            raise ValueError(f"Config.{field} has no comment above it saying what it does")
        settings.append(Setting(field, tuple(env[field]), ast.unparse(node.annotation),
                                _value(node.value, names), unit, lowest, highest, meaning))
    return settings


def _amount(value: float, unit: str) -> str:
    if unit == "bytes":
        for size, name in _SIZES:
            if value >= size and value % size == 0:
                return f"{value // size:g} {name}"
        return "1 byte" if value == 1 else f"{value:g} bytes"
    short = {"seconds": "s", "milliseconds": "ms"}.get(unit, unit)
    number = f"{int(value):,}" if value == int(value) else f"{value:g}"
    return f"{number} {short}".strip()


def _default(setting: Setting) -> str:
    if setting.kind == "bool":
        return "`1`" if setting.default else "`0`"
    if setting.kind == "str":
        return f"`{setting.default}`" if setting.default else "unset"
    return _amount(setting.default, setting.unit)


def _range(setting: Setting) -> str:
    if setting.kind == "bool":
        return "`1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`"
    if setting.lowest is None:
        return "a path" if setting.field == "timeline" else "any"
    return f"{_amount(setting.lowest, setting.unit)} to {_amount(setting.highest, setting.unit)}"


def _markdown_text(text: str) -> str:
    """Plain text (a comment, a help string) as Markdown that shows it as written, inside a
    table cell; ``code`` in double backticks, as the sources write it, becomes code."""
    pieces = re.split(r"(`[^`]*`)", text.replace("``", "`"))
    return "".join(piece if piece.startswith("`") else re.sub(r"[*|<]", _escape, piece) for piece in pieces)


def _escape(match: re.Match) -> str:
    return {"*": "\\*", "|": "\\|", "<": "&lt;"}[match.group()]


def config_markdown(source: str) -> str:
    rows = ["| Variable | Type | Default | Accepts | Meaning |", "| --- | --- | --- | --- | --- |"]
    for s in read_config(source):
        names = "<br>".join(f"`{name}`" for name in s.names)
        rows.append(f"| {names} | {s.kind} | {_default(s)} | {_range(s)} | {_markdown_text(s.meaning)} |")
    return "\n".join(rows)


# -- argparse parsers --------------------------------------------------------------------------

def _invocation(action: argparse.Action) -> str:
    """``-np N``, ``--dry-run``, ``command ...``: how the option is written."""
    if not action.option_strings:
        metavar = action.metavar or action.dest
        return f"`{metavar} ...`" if action.nargs == argparse.REMAINDER else f"`{metavar}`"
    if action.nargs == 0:
        return ", ".join(f"`{option}`" for option in action.option_strings)
    metavar = action.metavar or action.dest.upper()
    return ", ".join(f"`{option} {metavar}`" for option in action.option_strings)


def _describe(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(prog)s", "").replace("%%", "%")
    if action.default not in (None, False, [], "", argparse.SUPPRESS) and "default" not in text:
        text += f" (default: {action.default})"
    return _markdown_text(text)


def _table(actions: list[argparse.Action]) -> str:
    heading = "Option" if any(a.option_strings for a in actions) else "Argument"
    rows = [f"| {heading} | Meaning |", "| --- | --- |"]
    rows += [f"| {_invocation(a)} | {_describe(a)} |" for a in actions]
    return "\n".join(rows)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return f"```text\n{formatter.format_help().strip()}\n```"


def parser_markdown(parser: argparse.ArgumentParser, level: int = 2) -> str:
    """A parser's usage, description, options by group and subcommands, as Markdown."""
    parts = [_usage(parser)]
    if parser.description:
        parts.append(_markdown_text(parser.description))
    subcommands = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and not isinstance(a, (
            argparse._HelpAction, argparse._SubParsersAction))]
        subcommands += [a for a in group._group_actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            continue
        title = {"options": "Options", "optional arguments": "Options", "positional arguments": "Arguments"}.get(
            group.title, (group.title or "").capitalize())
        parts.append(f"{'#' * level} {title}")
        if group.description:
            parts.append(_markdown_text(group.description))
        parts.append(_table(actions))
    for exclusive in parser._mutually_exclusive_groups:
        options = " and ".join(f"`{a.option_strings[-1]}`" for a in exclusive._group_actions)
        parts.append(f"{options} exclude each other.")
    if parser.epilog:
        parts.append(_markdown_text(parser.epilog))
    for action in subcommands:
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            parts.append(f"{'#' * level} `{sub.prog}`")
            if helps.get(name):
                parts.append(helps[name][0].upper() + helps[name][1:] + ("" if helps[name].endswith(".") else "."))
            parts.append(parser_markdown(sub, level + 1))
    return "\n\n".join(parts)
