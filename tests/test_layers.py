"""The layer contract of docs/architecture.md, read from every module's imports with `ast` (module-level,
function-level and TYPE_CHECKING imports alike).

What fails: a module importing a higher layer; client importing builder; common importing builder or client;
a library module importing a CLI (or bench); builder importing a client module outside the measurement API;
any function-level import between project modules outside the CLIs; and an import cycle among builder, client
and common (module level), except those closed only by a TYPE_CHECKING import listed in TYPE_CHECKING_CYCLES.
Each exception that stands today is listed below with its reason: remove an entry when its cause is fixed,
never add one to let new code through.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    "client.cli_env": "trtbuild makes the same process-wide settings as perfclient before grpc is imported (its "
                      "CLI only: see test_only_the_clis_import_their_process_wide_settings)",
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
    ("builder.steps.prepare", "builder.steps.export"): "cost: export imports torch, only for a model with a source",
    ("builder.examples.datasets", "builder.examples.models"): "cost: the tokenizer imports transformers",
}


# Import cycles that stand today, each closed by one TYPE_CHECKING-only import (importer, imported): reason.
# Every other cycle among builder, client and common fails, at run time or under TYPE_CHECKING alike; an entry
# whose import is gone, or no longer closes a cycle, fails too (remove it).
TYPE_CHECKING_CYCLES: dict[tuple[str, str], str] = {
    ("builder.errors", "builder.steps.accuracy"):
        "AccuracyError names steps' Violation, and accuracy raises AccuracyError; the type belongs in errors or spec",
    ("builder.spec.shapes", "builder.spec.model"):
        "resolve() reads ModelSpec/TensorSpec, and the spec model builds its ShapeRanges from shapes",
    ("client.protocol", "client.validate"):
        "Prepared.expected is a validate.Check, and validate reads protocol.ModelMeta",
}


# The strongly connected components under mypy's view today, closed by the imports above; none of it is a run-time
# cycle. The spec model names keys through builder.spec.keys (plain Python), not the pydantic schema, so the
# schema stays out of this group.
TYPE_CHECKING_GROUPS = [
    ["builder.errors", "builder.spec.model", "builder.spec.shapes", "builder.steps.accuracy"],
    ["client.inputs", "client.protocol", "client.validate"],
]


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


def type_checking_lines(path: Path) -> set[int]:
    """The lines of the imports under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) in `path`."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")):
            lines |= {inner.lineno for statement in node.body for inner in ast.walk(statement)
                      if isinstance(inner, ast.Import | ast.ImportFrom)}
    return lines


def module_level_edges() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """The module-level imports among builder, client and common: (at run time, under TYPE_CHECKING only)."""
    found = {name: path for name, path in modules().items() if not name.startswith("bench")}
    runtime: set[tuple[str, str]] = set()
    checking: set[tuple[str, str]] = set()
    for name, path in sorted(found.items()):
        typing_only = type_checking_lines(path)
        for target, line, local in imports(path, set(found)):
            if not local:
                (checking if line in typing_only else runtime).add((name, target))
    return runtime, checking - runtime  # imported both ways: it counts at run time


def cycles(edge_set: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, in sorted order."""
    graph: dict[str, list[str]] = {}
    for source, target in sorted(edge_set):
        graph.setdefault(source, []).append(target)
        graph.setdefault(target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return sorted(found)


def reaches(edge_set: set[tuple[str, str]], source: str, target: str) -> bool:
    seen, todo = {source}, [source]
    while todo:
        node = todo.pop()
        for a, b in edge_set:
            if a == node and b not in seen:
                seen.add(b)
                todo.append(b)
    return target in seen


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


def test_the_cycle_finder_finds_cycles() -> None:
    # The check below passes on a graph without cycles, or on a finder that finds none: prove it finds them.
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d"), ("f", "a")}) == [
        ["a", "b", "c"], ["d", "e"]]
    assert cycles({("a", "b"), ("b", "c")}) == []


def test_no_import_cycle_among_project_modules() -> None:
    runtime, checking = module_level_edges()
    assert len(runtime) > 100 and ("client.protocol", "client.validate") in checking  # the walk read the packages
    assert cycles(runtime) == []  # at run time: none at all
    # Under TYPE_CHECKING (mypy's view): only the listed imports close cycles.
    assert cycles(runtime | (checking - set(TYPE_CHECKING_CYCLES))) == []
    # And the groups those imports close are pinned as they are: removing an allowed edge above would also hide
    # a new cycle running through the same modules (a module-level import into one of these groups).
    assert cycles(runtime | checking) == TYPE_CHECKING_GROUPS


def test_the_listed_type_checking_cycles_still_exist() -> None:
    runtime, checking = module_level_edges()
    gone = [edge for edge in TYPE_CHECKING_CYCLES if edge not in checking]
    assert gone == [], "no longer a TYPE_CHECKING import: remove the entry"
    # Each still closes a cycle: what it imports imports its importer back (through run-time imports alone).
    closed = [edge for edge in TYPE_CHECKING_CYCLES if not reaches(runtime, edge[1], edge[0])]
    assert closed == [], "no longer a cycle: remove the entry (and the TYPE_CHECKING guard it needed)"


# Steps that use ONNX Runtime itself (builder.runtimes.onnxruntime or onnxruntime) rather than the reference
# executor their context carries (runtimes.base.ReferenceExecutor), each with its reason. Every other step runs
# "the FP32 reference" and "this candidate" through the executor; a new entry needs a tool that is ONNX Runtime.
ORT_IN_STEPS: dict[str, str] = {
    "builder.steps.precision": "ModelOpt's calibration and ONNX Runtime's quantizer run ONNX Runtime: its errors "
                               "raised inside them are tool failures (TOOL_ERRORS)",
    "builder.steps.calibration_order": "the ranges the calibrators (ONNX Runtime sessions) see, for the ops ONNX "
                                       "Runtime's quantizer registry calibrates",
    "builder.steps.sensitivity": "streams batches through two sessions keeping running sums of the exposed tensors "
                                 "(an executor's run() returns every sample's outputs at once)",
    "builder.steps.fp16_fallback": "repairs the FP16 graph from ONNX Runtime's own type-check messages",
    "builder.steps.fp16_ranges": "stands in for ModelOpt autocast's ONNX Runtime reference run, one feed at a time, "
                                 "on the sanitized graph autocast hands it",
    "builder.steps.ort_calibration": "ONNX Runtime's entropy calibration, streamed through the calibrator's own "
                                     "augmented graph and histogram bins inside the quantizer subprocess",
}


def absolute_imports(path: Path) -> set[str]:
    """Every module `path` imports by absolute name (project or third-party), at any level of the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def _uses_ort(path: Path) -> bool:
    return any(n == "onnxruntime" or n.startswith(("onnxruntime.", "builder.runtimes.onnxruntime"))
               for n in absolute_imports(path))


def test_steps_run_graphs_through_the_reference_executor_not_onnx_runtime() -> None:
    steps = {name: path for name, path in modules().items() if name.startswith("builder.steps.")}
    users = sorted(name for name, path in steps.items() if _uses_ort(path))
    assert [name for name in users if name not in ORT_IN_STEPS] == []
    assert sorted(set(ORT_IN_STEPS) - set(users)) == []  # an entry whose import is gone is removed
    assert {"builder.steps.variant", "builder.steps.guard", "builder.steps.onnx_model"} <= set(steps)
    assert _uses_ort(modules()["builder.runtimes.onnxruntime"])  # the check reads what it should

def _names_log_global(node: ast.AST) -> bool:
    """A name, an import or an attribute (`logs.active_log_file`, `logs._active_log`) of the CLI's log global."""
    wanted = ("active_log_file", "_active_log")
    if isinstance(node, ast.Name):
        return node.id in wanted
    if isinstance(node, ast.alias):
        return node.name in wanted
    return isinstance(node, ast.Attribute) and node.attr in wanted


def test_no_library_module_reads_the_clis_log_file_global() -> None:
    # The CLI sets the build log (common.logs) and passes it on (BuildOptions.log_file, runtimes.select): a library
    # module that read the global would name a log file only when run under the CLI.
    readers = [name for name, path in sorted(modules().items())
               if name not in CLIS and name != "common.logs" and not name.startswith("bench")
               and any(_names_log_global(node) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))]
    assert readers == []
    assert "active_log_file" in modules()["builder.cli"].read_text(encoding="utf-8")  # the name the CLI does use


def test_only_the_clis_import_their_process_wide_settings() -> None:
    """client.cli_env sets environment a library must leave to its program (GRPC_VERBOSITY): only the CLIs
    import it, and client/__init__ sets nothing."""
    importers = {name for name, target, _, _ in edges() if target == "client.cli_env"}
    assert importers == {"builder.cli", "client.cli"}
    assert "environ" not in (ROOT / "client" / "__init__.py").read_text()


_GRPC_ORDER = r"""
import importlib, os, sys
seen = []

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get("GRPC_VERBOSITY"))
        return None

sys.meta_path.insert(0, Watch())
importlib.import_module(sys.argv[1])
print(seen[0] if seen else "unimported", os.environ.get("GRPC_VERBOSITY"))
"""


@pytest.mark.parametrize("cli", ["client.cli", "client.__main__", "builder.cli"])
def test_each_cli_sets_grpc_verbosity_before_grpc_is_imported(cli: str) -> None:
    """Import order, not a rule a linter keeps: a new top-level import above client.cli_env that pulls in grpc
    (builder.repository imports tritonclient.grpc) would let grpc-core's INFO lines through again."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    proc = subprocess.run([sys.executable, "-c", _GRPC_ORDER, cli], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    at_grpc_import, after = proc.stdout.strip().splitlines()[-1].split()
    assert at_grpc_import in ("ERROR", "unimported") and after == "ERROR"
