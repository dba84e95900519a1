"""Guards for what the components redesign and the stage packages gained (docs/architecture.md): without them the
next feature undoes it.

- the layering: ``LAYERS`` says which package may import which (the same table as docs/architecture.md); a reverse
  import fails and names the arrow; every package's ``__init__`` says what it is for, what it may import and what it
  exports; no package's top level holds more than 13 modules;
- no function in app/ takes more than 6 positional parameters (past that, call sites pass values by position that
  nobody can check), ``torch.autograd.Function.forward`` included (``ctx`` counts);
- ``GRPOTrainer`` stays at most 170 lines: the recipe reads top to bottom, the stages live in functions and components;
- no import circle in app/, counting imports placed inside functions (where a circle hides);
- no branch on a rollout engine's name outside the engine registry (app/rollout) and config;
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


def test_no_function_takes_more_than_six_positional_parameters():
    offenders = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(positional) > MAX_POSITIONAL:
                    offenders.append(f"{name}.{node.name} (line {node.lineno}): {len(positional)}")
    assert not offenders, f"more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only): {offenders}"


def test_the_grpo_trainer_class_stays_short():
    tree = ast.parse((APP / "training" / "trainer.py").read_text())
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


ENGINE_BRANCH = re.compile(r"""(?:engine\s*(?:==|!=|in)\s*|["'])(?:vllm|replay|hf)["']""")


def test_no_engine_name_branch_outside_the_registry_and_config():
    """Engines differ inside app/rollout; the trainer, evaluation and the recipe ask the registry
    (``needs_engine_views``, ``build_rollout_engine``) and never test a name."""
    offenders = []
    for path in APP.rglob("*.py"):
        if {"config", "rollout", "bench"} & set(path.relative_to(APP).parts[:-1]):
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


# ---- the stage packages and their layering ---------------------------------------------------------------------
BELOW_CONFIG = ("app.common", "app.answers", "app.grouping", "app.runtime", "app.data", "app.rollout", "app.rewards",
                "app.objectives")
LAYERS = {  # package -> the packages it may import (app/__init__.py and app/compat.py: anyone); docs/architecture.md
    "app.common": (),
    "app.answers": ("app.common",),
    "app.grouping": (),
    "app.runtime": ("app.common", "app.grouping"),
    "app.data": ("app.common", "app.answers", "app.grouping", "app.runtime"),
    "app.rollout": ("app.common", "app.grouping", "app.runtime", "app.data"),
    "app.rewards": ("app.common", "app.answers", "app.grouping", "app.runtime", "app.data"),
    "app.objectives": ("app.common",),
    "app.config": BELOW_CONFIG,
    "app.training": (*BELOW_CONFIG, "app.config", "app.planning"),  # the planner prices the rollout's split
    "app.evaluation": ("app.common", "app.answers", "app.grouping", "app.runtime", "app.data", "app.rollout",
                       "app.rewards", "app.config"),
    "app.planning": ("app.common", "app.grouping", "app.runtime", "app.data", "app.rollout", "app.objectives",
                     "app.config"),
    "app.demos": (*BELOW_CONFIG, "app.config", "app.training", "app.evaluation", "app.planning"),
    "app.bench": (*BELOW_CONFIG, "app.config", "app.training", "app.evaluation", "app.planning", "app.demos"),
}
ANYONE = {"app", "app.compat"}
MAX_PACKAGE_MODULES = 13
PUBLIC_ONLY = {("app.rewards", "app.grouping")}  # rewards reach the grouping core through its package API only


def package_of(module: str) -> str:
    parts = module.split(".")
    return module if module in ANYONE else ".".join(parts[:2])


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import arrow between packages that ``LAYERS`` does not allow, named module to module."""
    out = []
    for source, targets in sorted(graph.items()):
        here = package_of(source)
        for target in sorted(targets):
            there = package_of(target)
            if there == here or there in ANYONE:
                continue
            if here not in LAYERS:
                out.append(f"{source} is in no package of LAYERS")
            elif there not in LAYERS[here]:
                out.append(f"{source} -> {target}: {here} may not import {there}")
            elif (here, there) in PUBLIC_ONLY and target != there:
                out.append(f"{source} -> {target}: {here} may use {there}'s package API only")
    return out


def test_the_packages_import_only_what_the_layering_allows():
    found = layering_violations(import_graph())
    assert not found, "imports the layering (LAYERS, docs/architecture.md) does not allow:\n" + "\n".join(found)


def test_a_reverse_import_fails_by_name():
    graph = {"app.grouping.layout": {"app.objectives.grpo"}, "app.rewards.rules": {"app.grouping.forward"},
             "app.training.trainer": {"app.config.loading", "app.compat"}}
    assert layering_violations(graph) == [
        "app.grouping.layout -> app.objectives.grpo: app.grouping may not import app.objectives",
        "app.rewards.rules -> app.grouping.forward: app.rewards may use app.grouping's package API only"]


def test_the_layering_table_is_the_one_in_the_docs():
    """docs/architecture.md's table lists, per package, the packages it may import: the same as ``LAYERS``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`app/") and cells[0].endswith("/`"):
            allowed = re.findall(r"`app/(\w+)/`", cells[2])
            rows["app." + cells[0].strip("`/").split("/")[1]] = tuple(sorted(f"app.{a}" for a in allowed))
    assert rows == {k: tuple(sorted(v)) for k, v in LAYERS.items()}


def test_every_package_is_in_the_table_small_and_says_what_it_is():
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in APP.glob("*/__init__.py")}
    assert packages == set(LAYERS), f"packages not in LAYERS, or LAYERS without a package: {packages ^ set(LAYERS)}"
    for init in APP.rglob("__init__.py"):
        folder = init.parent
        count = sum(1 for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
        assert count <= MAX_PACKAGE_MODULES, f"{folder.relative_to(ROOT)} holds {count} modules (split it)"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 40, f"{init.relative_to(ROOT)} does not say what the package is for"
        if folder.parent == APP:
            assert "May import" in doc and "Export" in doc, f"{init.relative_to(ROOT)}: say what it may import and exports"
    assert sorted(p.name for p in APP.glob("*.py")) == ["__init__.py", "compat.py"]  # everything else is in a stage
