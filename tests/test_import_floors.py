"""The package's imports run one way: every room (a top-level module or subpackage of megatron_lite) imports only
rooms on a lower floor, lazily (inside a function) or not, and no module imports itself back through others.

The floors, from the ground: what everything may use; the parallel layers and the data; the network; the cost
model; checkpoints; validation; training; what runs a model (generation, evaluation) and the flags; tuning."""
import ast
import functools
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_lite")

FLOORS = (
    ("config", "atomic", "targets", "reading", "flag_numbers", "process_end", "cpp_runtime", "deepspeed_compat", "_C",
     "exit_codes", "line_records", "drills"),
    ("deepspeed_config", "batching", "parallel", "data", "fault_log", "refusal"),
    ("model",),
    ("cost",),
    ("checkpoint",),
    ("validation",),
    ("training",),
    ("arguments", "inference"),
    ("tuning",),
)
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


@functools.lru_cache(maxsize=1)
def _modules():
    """{module name: path} of every Python file of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path[:-3], os.path.dirname(PACKAGE)).replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


def _imports(path, known):
    """The package modules a file imports, anywhere in it (module level or inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("megatron_lite"):
            # `from megatron_lite.cost import memory` imports the module megatron_lite.cost.memory.
            names |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("megatron_lite")}
    return {n for n in names if n in known and n != "megatron_lite"}


def _room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@functools.lru_cache(maxsize=1)
def _graph():
    modules = _modules()
    return {m: _imports(path, modules) for m, path in modules.items()}


def test_every_room_of_the_package_has_a_floor():
    rooms = {_room(m) for m in _modules()} - {"megatron_lite"}
    assert rooms - set(FLOOR) == set(), "a new room: give it a floor in FLOORS"


def test_every_import_of_the_package_runs_down_the_floors_network_below_cost_below_training_below_tuning():
    upward = sorted(f"{m} -> {t} (floor {FLOOR[_room(m)]} -> {FLOOR[_room(t)]})"
                    for m, targets in _graph().items() if m != "megatron_lite"
                    for t in targets if _room(t) != _room(m) and FLOOR[_room(t)] >= FLOOR[_room(m)])
    assert upward == []


def _cycle(graph):
    """One import cycle among modules, or None (depth-first search, iterative)."""
    state, stack = {}, []
    for start in sorted(graph):
        if start in state:
            continue
        todo = [(start, iter(sorted(graph[start])))]
        state[start], stack = "open", [start]
        while todo:
            node, children = todo[-1]
            child = next(children, None)
            if child is None:
                todo.pop()
                stack.pop()
                state[node] = "done"
            elif state.get(child) == "open":
                return stack[stack.index(child):] + [child]
            elif child not in state:
                state[child] = "open"
                stack.append(child)
                todo.append((child, iter(sorted(graph[child]))))
    return None


def test_no_module_of_the_package_imports_itself_back_through_others():
    graph = {m: {t for t in targets if not m.startswith(t + ".")}  # a package's submodule may name the package
             for m, targets in _graph().items()}
    assert _cycle(graph) is None


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
])
def test_the_cycle_finder_finds_a_loop_of_three_and_none_in_a_chain(graph, cycle):
    assert _cycle(graph) == cycle
