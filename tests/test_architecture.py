"""Guards for what the components redesign gained (docs/architecture.md): without them the next feature undoes it.

- no function in app/ takes more than 6 positional parameters (past that, call sites pass values by position that
  nobody can check; ``torch.autograd.Function.forward/backward`` are exempt: ``apply`` takes positional arguments only);
- ``GRPOTrainer`` stays at most 170 lines: the recipe reads top to bottom, the stages live in functions and components;
- no import circle in app/, counting imports placed inside functions (where a circle hides);
- no branch on a rollout engine's name outside the engine registry (app/engines) and config;
- no module in app/ over 420 lines (each names one job in its opening comment);
- no ``global`` statement but the three lazily built caches: parallel state lives in the ``ParallelContext`` a
  recipe builds and passes on, never in a module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app"
MAX_POSITIONAL = 6
MAX_TRAINER_LINES = 170
MAX_MODULE_LINES = 420
LAZY_CACHES = {"_TORCHVISION_SCHEMA_LIBRARY", "_compiled_flex", "_rouge"}


def modules() -> dict[str, Path]:
    out = {}
    for path in APP.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _autograd_methods(tree: ast.Module) -> set[int]:
    """ids of forward/backward methods of classes deriving from torch.autograd.Function."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("autograd.Function")
                                                  for base in node.bases):
            out |= {id(item) for item in node.body if isinstance(item, ast.FunctionDef)
                    and item.name in ("forward", "backward")}
    return out


def test_no_function_takes_more_than_six_positional_parameters():
    offenders = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        exempt = _autograd_methods(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in exempt:
                positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(positional) > MAX_POSITIONAL:
                    offenders.append(f"{name}.{node.name} (line {node.lineno}): {len(positional)}")
    assert not offenders, f"more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only): {offenders}"


def test_the_grpo_trainer_class_stays_short():
    tree = ast.parse((APP / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    lines = trainer.end_lineno - trainer.lineno + 1
    assert lines <= MAX_TRAINER_LINES, f"GRPOTrainer is {lines} lines (at most {MAX_TRAINER_LINES})"


def import_graph() -> dict[str, set[str]]:
    """Module -> the app modules it imports, at the top or inside functions."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                found = resolve(target) if target.startswith("app") else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_app():
    found = cycles(import_graph())
    assert not found, f"import circles (imports inside functions included): {found}"


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


ENGINE_BRANCH = re.compile(r"""(?:engine\s*(?:==|!=|in)\s*|["'])(?:vllm|replay)["']""")


def test_no_engine_name_branch_outside_the_registry_and_config():
    """Engines differ inside app/engines; the trainer, evaluation and the recipe ask the registry
    (``needs_engine_views``, ``build_rollout_engine``) and never test a name."""
    allowed = {APP / "config.py", APP / "config_sections.py", APP / "config_checks.py"}
    offenders = []
    for path in APP.rglob("*.py"):
        if path in allowed or "engines" in path.parts or "bench" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ENGINE_BRANCH.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_no_module_is_a_grab_bag():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"
    undocumented = [name for name, path in modules().items() if path.stat().st_size
                    and ast.get_docstring(ast.parse(path.read_text())) is None and not name.endswith("__main__")]
    assert not undocumented, f"modules without an opening comment naming their job: {undocumented}"


def test_no_module_state_but_lazy_caches():
    found = {f"{name}: {', '.join(node.names)}" for name, path in modules().items()
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)
             and not set(node.names) <= LAZY_CACHES}
    assert not found, f"module state set through `global` (pass a context object instead): {sorted(found)}"
