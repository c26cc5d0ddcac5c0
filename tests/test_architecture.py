"""The library's structure, checked from the source (docs/design.md draws it).

Every library file's imports are read with ``ast``, imports inside functions included; ``kernels/``
and ``comm/`` are mapped to ``tritonmoe.kernels`` / ``tritonmoe.comm`` as pyproject.toml installs
them. Asserted:

* the floors: a module imports only its own floor or lower ones (no upward import);
* no import circle among library files, nor among ``bench/`` files (an ``importlib.import_module``
  of a literal module name counts as an import);
* no ``from X import _private`` across packages (library and ``bench/``), nor a private module
  of another package;
* no library module imports a deprecated alias (the old paths kept for one release);
* at most :data:`LOCAL_IMPORT_LIMIT` function-local import statements of the package's own
  modules in the library (a ratchet: lower it when you remove one, never raise it);
* no class over 300 lines and no function over 120 lines outside Triton kernels.

Run as a script (``python tests/test_architecture.py``) it prints the measurements.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: source folder -> installed package (pyproject.toml's package-dir)
PACKAGE_DIRS = {"tritonmoe": "tritonmoe", "kernels": "tritonmoe.kernels", "comm": "tritonmoe.comm"}

#: The floors, bottom first. A key names a module and everything below it; "=name" names the
#: module alone (a package face that re-exports from a higher floor of its own package).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("tritonmoe.core",)),
    ("kernels", ("tritonmoe.kernels",)),
    ("ops", ("tritonmoe.reference", "tritonmoe.meta", "tritonmoe.backends", "tritonmoe.functional",
             "tritonmoe.custom_ops", "tritonmoe.fp8", "tritonmoe.fp8_reference")),
    ("comm", ("tritonmoe.comm",)),
    ("programs", ("tritonmoe.comm.programs", "tritonmoe.comm.dispatcher", "=tritonmoe.comm")),
    ("parallel", ("tritonmoe.parallel", "tritonmoe.parm_layout", "tritonmoe.bias")),
    ("sim", ("tritonmoe.sim",)),
    ("policy", ("tritonmoe.policy",)),
    ("config", ("tritonmoe.config", "tritonmoe.router", "tritonmoe.aux_loss")),
    ("experts", ("tritonmoe.experts",)),
    ("layer", ("tritonmoe.layer",)),
    ("apps", ("tritonmoe.hf", "tritonmoe.hf_structure", "tritonmoe.hf_archs", "tritonmoe.inference")),
    ("plan", ("tritonmoe.plan",)),
    ("face", ("=tritonmoe",)),
]

#: Old module paths kept one release as deprecation aliases (CHANGELOG 0.2.0). They sit on the
#: top floor; no library module may import them.
DEPRECATED = {
    "tritonmoe.types", "tritonmoe.exact", "tritonmoe.dispatch", "tritonmoe.ops", "tritonmoe.memory",
    "tritonmoe.parm_experts",
    "tritonmoe.comm.pipeline", "tritonmoe.comm.memory", "tritonmoe.comm.parm", "tritonmoe.comm.saa",
    "tritonmoe.comm.hierarchical",
    "tritonmoe.plan.cost_model", "tritonmoe.plan.cluster", "tritonmoe.plan.engine", "tritonmoe.plan.sim_executor",
    "tritonmoe.plan.work", "tritonmoe.plan.schedules", "tritonmoe.plan.simulate", "tritonmoe.plan.planner",
    "tritonmoe.plan.search", "tritonmoe.plan.memory", "tritonmoe.plan.runtime", "tritonmoe.plan.parm",
}

#: Function-local import statements of tritonmoe's own modules allowed in the library. A ratchet:
#: lower it when one goes; the lazy imports of triton-using modules (``import tritonmoe`` must not
#: import triton) are most of what remains.
LOCAL_IMPORT_LIMIT = 10
CLASS_LIMIT = 300
FUNCTION_LIMIT = 120


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (the longest known prefix of what the statement names)
    name: Optional[str]  # the name taken from the module (None: the module itself)
    local: bool  # inside a function body
    line: int


def _modules(dirs: dict[str, str]) -> dict[str, Path]:
    out = {}
    for folder, pkg in dirs.items():
        base = ROOT / folder
        for p in sorted(base.rglob("*.py")):
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = p
    return out


def library_modules() -> dict[str, Path]:
    return _modules(PACKAGE_DIRS)


def bench_modules() -> dict[str, Path]:
    return _modules({"bench": "bench"})


def _resolve(name: str, known: dict[str, Path]) -> Optional[str]:
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import statement of ``module`` that names a module of ``known``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    t = _resolve(a.name, known)
                    if t:
                        out.append(Import(module, t, None, local, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for a in child.names:
                    sub = f"{mod}.{a.name}"
                    if sub in known:
                        out.append(Import(module, sub, None, local, child.lineno))
                    else:
                        t = _resolve(mod, known)
                        if t:
                            out.append(Import(module, t, a.name, local, child.lineno))
            elif isinstance(child, ast.Call) and _import_call(child):
                # importlib.import_module("pkg.mod") / __import__("pkg.mod") with a literal name:
                # an import all the same (a circle must not hide behind it)
                t = _resolve(child.args[0].value, known)
                if t:
                    out.append(Import(module, t, None, True, child.lineno))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def _import_call(node: ast.Call) -> bool:
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return (name in ("import_module", "__import__") and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


def floor_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, keys) in enumerate(FLOORS):
        for k in keys:
            if k.startswith("="):
                if module == k[1:] and len(k) > best_len:
                    best, best_len = i, 10**6
            elif (module == k or module.startswith(k + ".")) and len(k) > best_len:
                best, best_len = i, len(k)
    if module in DEPRECATED:
        return len(FLOORS) - 1
    if best is None:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS in tests/test_architecture.py")
    return best


def _edges(mods: dict[str, Path]) -> list[Import]:
    return [imp for m, p in mods.items() for imp in imports_of(m, p, mods) if imp.target != m]


def _cycles(mods: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module. An import of a package face from
    one of its own submodules is not an edge (Python runs the face first either way)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        if not e.source.startswith(e.target + "."):
            graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10000))
    try:
        for v in graph:
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(old)
    return out


def _package(module: str, mods: dict[str, Path]) -> str:
    return module if mods[module].name == "__init__.py" else module.rpartition(".")[0]


def _private_across(mods: dict[str, Path], edges: list[Import]) -> list[str]:
    bad = []
    for e in edges:
        private_name = e.name is not None and e.name.startswith("_") and not e.name.startswith("__")
        private_module = e.name is None and e.target.rpartition(".")[2].startswith("_") and \
            not e.target.rpartition(".")[2].startswith("__")
        if (private_name or private_module) and _package(e.source, mods) != _package(e.target, mods):
            what = f"{e.target}.{e.name}" if e.name else e.target
            bad.append(f"{e.source}:{e.line} imports {what}")
    return bad


def _is_triton_kernel(node: ast.AST) -> bool:
    for d in getattr(node, "decorator_list", []):
        text = ast.unparse(d)
        if "triton.jit" in text or "triton.autotune" in text or "triton.heuristics" in text or text == "jit":
            return True
    return False


def oversized(mods: dict[str, Path]) -> list[tuple[int, str, str, str]]:
    out = []
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                n = node.end_lineno - node.lineno + 1
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                if n > (CLASS_LIMIT if kind == "class" else FUNCTION_LIMIT):
                    out.append((n, kind, m, node.name))
    return sorted(out, reverse=True)


def local_imports(edges: list[Import]) -> list[tuple[str, int]]:
    return sorted({(e.source, e.line) for e in edges if e.local})


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lib():
    mods = library_modules()
    return mods, _edges(mods)


def test_every_module_has_a_floor(lib):
    mods, _ = lib
    for m in mods:
        floor_of(m)


def test_no_upward_import(lib):
    mods, edges = lib
    bad = []
    for e in edges:
        fs, ft = floor_of(e.source), floor_of(e.target)
        if ft > fs:
            bad.append(f"{e.source}:{e.line} ({FLOORS[fs][0]}) imports {e.target} ({FLOORS[ft][0]})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_kernels_see_only_the_ground_floor(lib):
    mods, edges = lib
    bad = [f"{e.source}:{e.line} imports {e.target}" for e in edges
           if e.source.startswith("tritonmoe.kernels") and not e.target.startswith(("tritonmoe.kernels", "tritonmoe.core"))]
    assert not bad, "\n".join(bad)


def test_no_circles_in_the_library(lib):
    mods, edges = lib
    assert _cycles(mods, edges) == []


def test_no_circles_in_bench():
    mods = bench_modules()
    assert _cycles(mods, _edges(mods)) == []


def test_no_private_names_across_packages(lib):
    mods, edges = lib
    assert _private_across(mods, edges) == []


def test_bench_takes_no_private_names_across_packages():
    mods = {**library_modules(), **bench_modules()}
    edges = [e for m, p in bench_modules().items() for e in imports_of(m, p, mods) if e.target != m]
    assert _private_across(mods, edges) == []


def test_no_library_module_imports_a_deprecated_alias(lib):
    mods, edges = lib
    bad = [f"{e.source}:{e.line} imports {e.target}" for e in edges
           if e.target in DEPRECATED and e.source not in DEPRECATED]
    assert not bad, "\n".join(bad)


def test_deprecated_aliases_exist_and_warn():
    """Every listed alias is a module that still imports (and says it is deprecated)."""
    mods = library_modules()
    for m in sorted(DEPRECATED):
        assert m in mods, f"{m} is listed as a deprecated alias but has no file"
        assert "DeprecationWarning" in mods[m].read_text(), m


#: Names users imported from old paths (public, and outside the new modules' ``__all__``): the
#: aliases forward every name of the modules they stand for.
OLD_NAMES = {
    "tritonmoe.plan.parm": ("COLLECTIVES", "COLLECTIVE_WIDTH", "PROBE_TOKENS", "choose_schedule", "simulate_parm"),
    "tritonmoe.comm.parm": ("s2_part_counts", "baseline_plan", "saa_plan"),
    "tritonmoe.plan.simulate": ("build_programs", "FULL_MODE_MAX_RANKS", "simulate"),
    "tritonmoe.plan.cluster": ("GB", "KERNEL_LAUNCH_S", "PER_PEER_S", "Cluster"),
    "tritonmoe.plan.cost_model": ("PIECEWISE_TRIGGER", "PIECEWISE_MARGIN", "CostModel", "LinearFit"),
    "tritonmoe.exact": ("WgradFn", "rowwise_mm"),
    "tritonmoe.dispatch": ("OpSpec", "implementation", "OPS"),
    "tritonmoe.plan.memory": ("AutoMemory", "choose_memory", "issue_memory_ops"),
    "tritonmoe.parm_experts": ("ParmExperts",),
}


def test_deprecated_aliases_forward_the_old_names():
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old, names in OLD_NAMES.items():
            module = importlib.import_module(old)
            for name in names:
                assert getattr(module, name, None) is not None, f"{old}.{name}"


def test_function_local_imports_ratchet(lib):
    _, edges = lib
    found = local_imports(edges)
    assert len(found) <= LOCAL_IMPORT_LIMIT, (
        f"{len(found)} function-local imports of tritonmoe's own modules (limit {LOCAL_IMPORT_LIMIT}): "
        + ", ".join(f"{m}:{ln}" for m, ln in found)
    )


def test_no_oversized_classes_or_functions(lib):
    mods, _ = lib
    assert oversized(mods) == []


def test_the_checker_sees_what_it_must():
    """The checker itself: a function-local upward import, a circle, and a private name across
    packages are each found in a tree made for it."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        (base / "tritonmoe" / "core").mkdir(parents=True)
        (base / "tritonmoe" / "__init__.py").write_text("")
        (base / "tritonmoe" / "core" / "__init__.py").write_text("")
        (base / "tritonmoe" / "core" / "a.py").write_text("def f():\n    from tritonmoe.layer import _x\n")
        (base / "tritonmoe" / "layer.py").write_text("from tritonmoe.core.a import f\n_x = 1\n")
        (base / "tritonmoe" / "core" / "b.py").write_text(
            "import importlib\n\ndef g():\n    return importlib.import_module('tritonmoe.layer')\n")
        mods = {}
        for p in sorted((base / "tritonmoe").rglob("*.py")):
            parts = list(p.relative_to(base / "tritonmoe").with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(["tritonmoe"] + parts)] = p
        edges = _edges(mods)
        up = [e for e in edges if floor_of(e.target) > floor_of(e.source)]
        assert sorted((e.source, e.target, e.local) for e in up) == [
            ("tritonmoe.core.a", "tritonmoe.layer", True), ("tritonmoe.core.b", "tritonmoe.layer", True)]
        assert _cycles(mods, edges) == [["tritonmoe.core.a", "tritonmoe.layer"]]
        assert _private_across(mods, edges) == ["tritonmoe.core.a:2 imports tritonmoe.layer._x"]


def report() -> str:
    mods = library_modules()
    edges = _edges(mods)
    up = [e for e in edges if floor_of(e.target) > floor_of(e.source)]
    lines = [
        f"library modules: {len(mods)}",
        f"import circles: {_cycles(mods, edges)}",
        f"bench circles: {_cycles(bench_modules(), _edges(bench_modules()))}",
        f"upward imports: {len(up)}",
        *(f"  {e.source}:{e.line} -> {e.target}" for e in up),
        f"private names across packages: {_private_across(mods, edges)}",
        f"function-local imports of own modules: {len(local_imports(edges))}",
        "largest classes and functions:",
    ]
    sizes = []
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not _is_triton_kernel(node):
                sizes.append((node.end_lineno - node.lineno + 1, "class" if isinstance(node, ast.ClassDef) else "def",
                              f"{m}.{node.name}"))
    for n, kind, name in sorted(sizes, reverse=True)[:12]:
        lines.append(f"  {n:5d} {kind} {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
