"""The package's shape: no import cycles, and the lower layers never reach up.

Every ``import`` counts, including those inside functions (deferred imports still tie the
modules together).
"""

import ast
from pathlib import Path

import ckptstore

PACKAGE = Path(ckptstore.__file__).parent

# Layers from the bottom up: a module may import its own layer and those below, never above.
LAYERS = [
    {"errors", "knobs", "progress", "layers", "hashing", "keys", "private"},
    {"model", "objects"},
    {"format"},
    {"catalog", "deepspeed", "strategies", "auxfiles", "arguments"},
    {"commit", "materialize", "verify", "gc", "thin", "restore", "dcp", "tier"},
    {"export"},
    {"store"},
    {"opening"},
    {"cli", "__init__", "integrations"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """ckptstore module -> the ckptstore modules it imports (names relative to the package)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = list(path.relative_to(PACKAGE).parent.parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                for alias in node.names:
                    candidate = f"{target}.{alias.name}" if target else alias.name
                    found.add(candidate if candidate in modules else target)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptstore."):
                found.add(node.module.removeprefix("ckptstore."))
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _layer(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_every_module_has_a_layer():
    for module in import_graph():
        _layer(module)


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in targets
        if _layer(target) > _layer(module)
    ]
    assert upward == []


def test_there_is_no_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            # A package's __init__ re-exporting its own submodule is not a cycle of the design.
            if module == target.rsplit(".", 1)[0]:
                continue
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []
