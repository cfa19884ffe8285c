"""The engine's parts each own their state and reach each other only through narrow methods.

The engine is :class:`Submissions` (thread-safe queue), :class:`Cycle` (negotiation, with
:class:`Execution` beneath it) and :class:`Lifecycle` (join, shutdown, stalls, failure), held by
:class:`Engine`.  Checked three ways: every part declares its attributes (``__slots__``, so an
attribute set anywhere else fails at once); in the engine's source, code that holds another part
calls its public methods or properties only, never its attributes or private methods; and in a
running engine no two parts hold the same mutable object.
"""
from __future__ import annotations

import ast
import inspect
import pathlib
import threading

import pytest

import psrt.engine
import psrt.torch as hvd
from psrt.engine.cycle import Cycle
from psrt.engine.engine import Engine
from psrt.engine.execution import Execution
from psrt.engine.lifecycle import Lifecycle
from psrt.engine.submissions import Submissions

PARTS = (Submissions, Cycle, Execution, Lifecycle, Engine)
#: In each part, the attribute holding another part, and that part's class.
HELD = {
    Engine: {"_submissions": Submissions, "_cycle": Cycle, "_lifecycle": Lifecycle},
    Cycle: {"_submissions": Submissions, "_execution": Execution},
    Execution: {"_submissions": Submissions},
    Lifecycle: {"_submissions": Submissions, "_cycle": Cycle},
    Submissions: {},
}
ENGINE = pathlib.Path(psrt.engine.__file__).parent


@pytest.mark.parametrize("part", PARTS, ids=lambda part: part.__name__)
def test_every_part_declares_its_attributes(part):
    unslotted = [cls.__name__ for cls in part.__mro__[:-1] if "__slots__" not in vars(cls)]
    assert not unslotted, f"{part.__name__}: no __slots__ in {unslotted}, so its instances take any attribute"
    assert "__dict__" not in part.__slots__


def _interface(cls: type) -> set[str]:
    """What another part may use of ``cls``: its public methods and properties."""
    return {name for name, value in vars(cls).items() if not name.startswith("_")
            and (inspect.isfunction(value) or isinstance(value, (property, staticmethod)))}


@pytest.mark.parametrize("part", PARTS, ids=lambda part: part.__name__)
def test_a_part_uses_the_others_through_their_methods_only(part):
    module = inspect.getmodule(part)
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == part.__name__]
    held = HELD[part]
    wrong = []
    for use in ast.walk(node):
        if (isinstance(use, ast.Attribute) and isinstance(use.value, ast.Attribute)
                and isinstance(use.value.value, ast.Name) and use.value.value.id == "self"
                and use.value.attr in held):
            other = held[use.value.attr]
            if use.attr not in _interface(other):
                wrong.append(f"line {use.lineno}: self.{use.value.attr}.{use.attr} is not a public method or "
                             f"property of {other.__name__}")
    assert not wrong, f"{part.__name__} reaches into another part:\n" + "\n".join(wrong)


def _private_names() -> set[str]:
    """The private attributes and methods the engine's classes define."""
    names = set()
    for path in ENGINE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef):
                names.add(node.name)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_engine_module_reads_another_objects_private_attributes():
    """``x._name`` of an engine class only on ``self``: a part's private state is its own."""
    private, found = _private_names(), []
    assert {"_queue", "_local", "_negotiator", "_stopped"} <= private
    for path in sorted(ENGINE.glob("*.py")):
        for use in ast.walk(ast.parse(path.read_text())):
            if (isinstance(use, ast.Attribute) and use.attr in private
                    and not (isinstance(use.value, ast.Name) and use.value.id in ("self", "cls"))):
                found.append(f"{path.name}:{use.lineno}: .{use.attr}")
    assert not found, "private attributes read from outside their object:\n" + "\n".join(found)


@pytest.fixture
def engine():
    hvd.init()
    yield psrt.runtime.current().engine
    hvd.shutdown()


def _state(obj: object, seen: set[int]) -> dict[int, str]:
    """The mutable objects a part holds directly (not the other parts it holds, nor shared
    services such as the configuration, the watchdog and the topology)."""
    mutable = (dict, list, set, type(threading.Lock()), threading.Event)
    found = {}
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            value = getattr(obj, name, None)
            if isinstance(value, mutable) and id(value) not in seen:
                found[id(value)] = f"{type(obj).__name__}.{name}"
    return found


def test_a_running_engines_parts_share_no_state(engine):
    parts = [engine, engine._submissions, engine._cycle, engine._cycle._execution, engine._lifecycle]
    assert [type(p) for p in parts] == [Engine, Submissions, Cycle, Execution, Lifecycle]
    owner: dict[int, str] = {}
    shared = []
    for part in parts:
        for ident, where in _state(part, set()).items():
            if ident in owner:
                shared.append(f"{owner[ident]} is {where}")
            owner.setdefault(ident, where)
    assert not shared, "parts holding the same mutable object: " + ", ".join(shared)
    assert len(owner) >= 10, f"only {len(owner)} pieces of state found: the check would see nothing"
