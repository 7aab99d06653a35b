"""The package's shape: no import cycles, and the lower layers never reach up.

Every ``import`` counts, including those inside functions (deferred imports still tie the
modules together).
"""

import ast
from pathlib import Path

import pytest

import ckptstore

PACKAGE = Path(ckptstore.__file__).parent

# Layers from the bottom up: a module may import its own layer and those below, never above.
LAYERS = [
    {
        "errors",
        "settings",
        "knobs",
        "remote_knobs",
        "progress",
        "layers",
        "hashing",
        "keys",
        "private",
        "forked",
        "pathnames",
    },
    {"model", "objects", "tensorsplit", "fused_experts"},
    {"format"},
    {"catalog", "deepspeed", "strategies", "auxfiles", "arguments"},
    {"commit", "materialize", "verify", "quarantine", "gc", "retention", "thin", "restore", "dcp", "tier"},
    {"export", "frontdoors", "report"},
    {"store", "queries"},
    {"opening"},
    {"cli", "__init__", "__main__", "integrations"},
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


def test_the_deepspeed_verbs_ask_the_step_record_not_the_dcp_door_which_door_wrote_a_step():
    # Which front door wrote a step is a fact of its record (model.front_door): commit/ and
    # materialize/ route on it without reaching into another door's package.
    reaching = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module.split(".")[0] in ("commit", "materialize")
        for target in targets
        if target.split(".")[0] == "dcp"
    ]
    assert reaching == []


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


def _code_lines(path: Path) -> int:
    """Lines of ``path`` holding code: not blank, not comments, not docstrings."""
    import io
    import tokenize

    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped and token.type != tokenize.ENDMARKER:
            lines.update(line for line in range(token.start[0], token.end[0] + 1) if line not in docstrings)
    return len(lines)


def test_the_store_stays_a_facade():
    # One short method per verb: a pipeline growing in store.py belongs in the module it serves.
    assert _code_lines(PACKAGE / "store.py") <= 200


def test_every_package_ships_in_a_non_editable_install():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(
        tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {path.parent.relative_to(PACKAGE).parts for path in PACKAGE.rglob("*.py")}
    assert {".".join(["ckptstore", *parts]) for parts in folders} - listed == set()
