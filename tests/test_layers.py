"""The layer contract of README "Architecture", read from every module's imports with `ast` (module-level,
function-level and TYPE_CHECKING imports alike).

What fails: a module importing a higher layer; client importing builder; common importing builder or client;
a library module importing a CLI (or bench); builder importing a client module outside the measurement API;
and any function-level import between project modules outside the CLIs. Each exception that stands today is
listed below with its reason: remove an entry when its cause is fixed, never add one to let new code through.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# builder's layers, top to bottom: a module may import its own layer and the layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("builder.__main__", "builder.cli"),
    ("builder.pipeline", "builder.summary", "builder.lockcheck", "builder.examples"),
    ("builder.tuning",),
    ("builder.serving",),
    ("builder.steps",),
    ("builder.runtimes",),
    ("builder.repository",),
    ("builder.spec",),
    ("builder.errors", "builder"),  # `builder` itself (__version__): the package alone, not its modules
]
# Names in LAYERS that place only themselves, not the modules under them (else every module has a layer).
PACKAGE_ONLY = {"builder"}

# The CLIs: they import the libraries lazily (a command pays only for what it runs) and nothing imports them.
CLIS = {"builder.__main__", "builder.cli", "client.__main__", "client.cli"}

# What builder may use of client, each module with its reason: the measurement API and the request pieces
# verify sends with. Plumbing both packages use (progress, atomic files, logs, choices, datatypes) is in
# common/, so no entry is here for it; add one only for a measurement or request module.
CLIENT_API: dict[str, str] = {
    "client.session": "tune and the bench measure through a session (its load levels and results)",
    "client.engine": "LoadLevel and Measurement: what a session is asked to run and what it returns",
    "client.power": "tune's energy figures read the same power meters a session uses",
    "client.errors": "a failed measurement is a PerfClientError, which tune records as the point's reason",
    "client.protocol": "verify sends its requests through perfclient's connections",
    "client.validate": "verify compares answers with the tolerances perfclient validates with",
    "client.admin_key": "verify sends the admin-key header a request to an exposed server needs; exposure "
                        "names the same header and variable for the server's flags (one definition for both)",
}

# Imports against the layer order that stand today (importer module, imported module): reason.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("builder.errors", "builder.steps.accuracy"):
        "TYPE_CHECKING only: AccuracyError names steps' Violation; the type belongs in errors or spec",
}

# Function-level imports between project modules outside the CLIs (importer, imported): reason. A new one
# fails: import at module level, or fix the cycle it would hide.
FUNCTION_LEVEL: dict[tuple[str, str], str] = {
    ("builder.runtimes", "builder.runtimes.tensorrt"): "cost: only --runtime tensorrt imports tensorrt",
    ("builder.runtimes.tensorrt", "builder.runtimes.tensorrt_engine"): "cost: tensorrt itself, at construction",
    ("builder.pipeline", "builder.steps.export"): "cost: export imports torch, only for a model with a source",
    ("builder.examples.datasets", "builder.examples.models"): "cost: the tokenizer imports transformers",
    ("builder.summary", "builder.pipeline"):
        "cost: ModelStatus alone, without the ONNX/ORT/ModelOpt imports of the pipeline (no cycle: the pipeline "
        "does not import summary); the records' types belong below the orchestrator",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for top in ("builder", "client", "common", "bench") for p in (ROOT / top).rglob("*.py")}


def imports(path: Path, known: set[str]) -> Iterator[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for each import of `path`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(target: str) -> str | None:  # the longest project module `target` names
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parent, *([base] if base else [])])
                targets = [f"{base}.{a.name}" for a in child.names]
            for target in targets:
                module = resolve(target)
                if module is not None and module != name:
                    yield module, child.lineno, in_function
            yield from walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), False)


def layer(module: str) -> int | None:
    """The index in LAYERS (0 the top) of the longest prefix naming `module`'s layer."""
    best: tuple[int, int] | None = None
    for index, names in enumerate(LAYERS):
        for prefix in names:
            under = module.startswith(prefix + ".") and prefix not in PACKAGE_ONLY
            if (module == prefix or under) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def edges() -> list[tuple[str, str, int, bool]]:
    found = modules()
    return [(name, target, line, local) for name, path in sorted(found.items())
            for target, line, local in imports(path, set(found))]


def test_every_builder_module_has_a_layer() -> None:
    assert [m for m in modules() if m.startswith("builder") and layer(m) is None] == []


def test_builder_imports_only_its_own_or_lower_layers() -> None:
    wrong = []
    for name, target, line, _ in edges():
        if name.startswith("builder") and target.startswith("builder"):
            upward = (layer(target) or 0) < (layer(name) or 0)
            if upward and (name, target) not in LAYER_EXCEPTIONS:
                wrong.append(f"{name}:{line} imports {target} (a higher layer)")
    assert wrong == []


def test_client_never_imports_builder_and_no_library_imports_a_cli_or_bench() -> None:
    wrong = [f"{name}:{line} imports {target}" for name, target, line, _ in edges()
             if (name.startswith("client") and target.startswith("builder"))  # client's CLI included
             or (not name.startswith("bench") and name not in CLIS
                 and (target in CLIS or target.startswith("bench")))]
    assert wrong == []


def test_builder_uses_client_only_through_the_measurement_api() -> None:
    wrong = [f"{name}:{line} imports {target}" for name, target, line, _ in edges()
             if name.startswith("builder") and target.startswith("client") and target not in CLIENT_API]
    assert wrong == []
    # Every allowed module is still used by builder: the list stays the list of what is needed.
    used = {target for name, target, _, _ in edges() if name.startswith("builder") and target.startswith("client")}
    assert sorted(set(CLIENT_API) - used) == []


def test_common_imports_neither_builder_nor_client() -> None:
    wrong = [f"{name}:{line} imports {target}" for name, target, line, _ in edges()
             if name.startswith("common") and not target.startswith("common")]
    assert wrong == []
    assert "common.progress" in modules()  # the walk reads common/ (else the check above passes on nothing)


def test_no_new_function_level_import_between_project_modules() -> None:
    found = {(name, target) for name, target, _, local in edges() if local and name not in CLIS
             and not name.startswith("bench")}
    assert sorted(found - set(FUNCTION_LEVEL)) == []
    # An entry whose import is gone is removed too, so that the list stays the list of what remains.
    assert sorted(set(FUNCTION_LEVEL) - found) == []


def test_the_listed_layer_exceptions_still_exist() -> None:
    found = {(name, target) for name, target, _, _ in edges()}
    assert sorted(set(LAYER_EXCEPTIONS) - found) == []
