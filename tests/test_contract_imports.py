"""The contract package and the policy import each other only one way: module-level
imports that form a DAG, none inside a function (those hid a cycle before)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted([*ROOT.joinpath("brokerd", "contract").glob("*.py"), ROOT / "brokerd" / "leasing" / "selection.py"])


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] == "brokerd"}


def test_no_function_local_imports() -> None:
    offenders = []
    for path in MODULES:
        for func in ast.walk(ast.parse(path.read_text())):
            if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                offenders.extend(f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(func)
                                 if isinstance(node, ast.Import | ast.ImportFrom))
    assert offenders == []


def test_the_import_graph_is_a_dag_with_the_policy_on_top() -> None:
    graph = {_module_name(p): _imports(ast.parse(p.read_text())) & {_module_name(m) for m in MODULES}
             for p in MODULES}
    assert "brokerd.leasing.selection" not in set().union(*graph.values())  # nothing below imports the policy
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for imported in graph[module]:
            visit(imported, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
    assert graph["brokerd.contract.model"] <= {"brokerd.contract.spec", "brokerd.contract.accel_config"}
