"""The shape of the package (docs/architecture.md), checked: imports go one way, down the
layers; no package imports the top-level `slapo` namespace from inside; the built-in primitives
are real, typed `Schedule` methods generated from their classes."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "slapo"

# Bottom to top; a module may import its own layer and the layers below (docs/architecture.md).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "notices", "files", "faultpoints", "distributed", "module_patch", "sharding",
     "init"),
    ("graph", "op", "primitives", "schedule"),
    ("runtime", "verify", "profile", "consolidate"),
    ("model_schedule",),
    ("data", "progressive", "train", "tune"),
    ("compat", "pattern", "pipeline", "random", "utils", "cli", "logger", "framework_dialect"),
]
EDGE = 5  # the adapter layer: the public module paths and the Slapo 2023 API
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported slapo module, line) for every import in the file, at any depth (an import
    inside a function is a dependency too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in MODULES else target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return [(t, line) for t, line in found if t == "slapo" or t.startswith("slapo.")]


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _edges() -> dict[tuple[str, str], list[str]]:
    edges = defaultdict(list)
    for name, path in MODULES.items():
        for target, line in _imports(name, path):
            a, b = _package(name), _package(target)
            if a != b:
                edges[(a, b)].append(f"{path.relative_to(ROOT.parent)}:{line}")
    return edges


def test_every_package_has_a_layer():
    packages = {_package(m) for m in MODULES} - {""}
    assert packages <= set(LAYER_OF), f"add to LAYERS: {sorted(packages - set(LAYER_OF))}"


def test_nothing_inside_imports_the_top_level_namespace():
    """`import slapo` from inside the package hides which room a dependency lives in and makes
    every room depend on all of them (slapo/__init__ imports everything)."""
    bad = [f"{src} imports `slapo`" for (a, b), srcs in _edges().items() if b == ""
           for src in srcs if a]
    assert not bad, "\n".join(bad)


def test_imports_go_down_the_layers():
    bad = []
    for (a, b), srcs in sorted(_edges().items()):
        if a and b and LAYER_OF[b] > LAYER_OF[a]:
            bad += [f"{src}: {a} (layer {LAYER_OF[a]}) imports {b} (layer {LAYER_OF[b]})"
                    for src in srcs]
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_packages():
    graph = defaultdict(set)
    for a, b in _edges():
        if a and b:
            graph[a].add(b)
    # schedule (the tree) and primitives (its methods) are one room split over two names:
    # the tree's methods run the primitive classes; primitives never import the tree
    cycles = []

    def visit(node, stack):
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif len(stack) < 8:
                visit(nxt, stack + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles[:10])


def test_fault_injection_is_behind_the_test_seam():
    """Production code holds no fault-injection logic: `SLAPO_FAULT` is read in one place
    (`slapo/faultpoints.py`, the no-op seam production paths call), and only the run's setup,
    which arms the test hook, imports `train/fault_injection.py`."""
    readers = sorted(str(p.relative_to(ROOT.parent)) for p in MODULES.values()
                     if '"SLAPO_FAULT"' in p.read_text())
    assert readers == ["slapo/faultpoints.py"], readers
    importers = sorted(name for name, path in MODULES.items() for target, _ in _imports(name, path)
                       if target == "slapo.train.fault_injection")
    assert importers == ["slapo.train.setup"], importers


def _class_assignments(tree: ast.AST) -> list[int]:
    """Lines that assign an object's `__class__`: `x.__class__ = C` (also inside a tuple or an
    augmented/annotated assignment) or `setattr(x, "__class__", C)` / `object.__setattr__`."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Attribute) and t.attr == "__class__"
               for target in targets for t in ast.walk(target)):
            lines.append(node.lineno)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("setattr", "__setattr__") and any(
                    isinstance(a, ast.Constant) and a.value == "__class__" for a in node.args):
                lines.append(node.lineno)
    return lines


def test_only_module_patch_swaps_a_class():
    """No class swap on a user's module (issue 30): `build` attaches the trainer as instance
    attributes (`runtime/built_model.py`). `module_patch` is the one exception: its patch
    classes run the primitives' wrappers and kernels on the module object itself (FSDP2's
    `FSDP<Name>` is torch's own)."""
    bad = [f"{path.relative_to(ROOT.parent)}:{line}" for name, path in sorted(MODULES.items())
           if name != "slapo.module_patch"
           for line in _class_assignments(ast.parse(path.read_text()))]
    assert not bad, "`__class__` assigned outside slapo/module_patch.py:\n" + "\n".join(bad)


def test_the_class_swap_check_sees_every_spelling():
    src = ("m.__class__ = C\n(a, m.__class__) = (1, C)\nsetattr(m, '__class__', C)\n"
           "object.__setattr__(m, '__class__', C)\nm.cls = C\nsetattr(m, 'x', C)\n")
    assert _class_assignments(ast.parse(src)) == [1, 2, 3, 4]


def test_primitive_methods_are_generated_from_the_primitives():
    spec = importlib.util.spec_from_file_location(
        "gen_primitive_methods", ROOT.parent / "scripts" / "gen_primitive_methods.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "primitives" / "methods.py").read_text() == gen.render(), \
        "slapo/primitives/methods.py is stale: run `python scripts/gen_primitive_methods.py`"


@pytest.mark.parametrize("name", [c.name for c in __import__("slapo.primitives",
                                                             fromlist=["BUILTIN"]).BUILTIN])
def test_every_builtin_primitive_is_a_typed_schedule_method(name):
    from slapo.primitives import get_primitive
    from slapo.schedule import Schedule

    method = inspect.getattr_static(Schedule, name)
    assert inspect.isfunction(method), f"Schedule.{name} is not a def"
    prim = get_primitive(name)
    want = list(inspect.signature(prim.apply).parameters)[1:]
    got = [p for p in inspect.signature(method).parameters if p != "self"]
    assert got[:len(want)] == want
    assert method.__doc__ and inspect.getdoc(prim).split("\n\n")[0].splitlines()[0] in \
        method.__doc__


# A file over this many lines must be named, with its one concern, in docs/architecture.md's
# "Files over ~400 lines" (issue 30: "no file over ~450 lines mixing concerns").
LONG_FILE_LINES = 450


def _long_files_section() -> str:
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    start = text.index("## Files over ~400 lines")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _unnamed_long_files(bound: int) -> list[str]:
    section = _long_files_section()
    long = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                  if len(p.read_text().splitlines()) > bound)
    return [f for f in long if f"`{f}` (" not in section]


def test_every_long_file_is_named_with_its_one_concern():
    """A file past the bound is either split or documented as one concern; a new giant fails
    here until someone does one or the other (the section names `<dir>/<file>.py`)."""
    unnamed = _unnamed_long_files(LONG_FILE_LINES)
    assert not unnamed, (f"{unnamed} are over {LONG_FILE_LINES} lines: split them along their "
                         "concerns, or name each with its one concern in docs/architecture.md "
                         "'Files over ~400 lines' as `path.py` (...)")


def test_the_long_file_check_sees_an_unnamed_file():
    """Not vacuous: with a lower bound, files the section does not name are found (a file
    named in prose without its `path.py` (...) form would not count)."""
    assert "runtime/deepspeed.py" in _unnamed_long_files(300)


# ------------------------------------------------------------------------------------------------
# Slapo 2023 compatibility stays at the edge (docs/architecture.md, "The edge")
# ------------------------------------------------------------------------------------------------

def test_only_the_edge_imports_compat():
    """The core (layers 0-4) never imports `slapo.compat`: a 2023 spelling reaches it only
    through the public names and the seams `slapo.compat.install` fills."""
    bad = []
    for name, path in MODULES.items():
        package = _package(name)
        if package == "" or LAYER_OF[package] == EDGE:
            continue
        bad += [f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
                for target, line in _imports(name, path)
                if target == "slapo.compat" or target.startswith("slapo.compat.")]
    assert not bad, "\n".join(bad)


_IMPORT_TIME_DECORATORS = {"dataclass", "functools.wraps", "wraps", "property", "staticmethod",
                           "classmethod"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _import_time_effects(tree: ast.Module) -> list[tuple[int, str]]:
    """What a module does to other objects when it is imported: module-level calls (a call is
    where a patch or a registration hides), attribute/item assignments, and decorators that
    are not pure wrappers (e.g. `@register_primitive`). Plain name bindings, imports,
    definitions and docstrings are what an edge module may do at import."""
    found = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        if isinstance(stmt, ast.Expr):
            found.append((stmt.lineno, f"calls {_dotted(stmt.value)}() at import"))
        targets = stmt.targets if isinstance(stmt, ast.Assign) else \
            [stmt.target] if isinstance(stmt, (ast.AugAssign, ast.AnnAssign)) else []
        found += [(stmt.lineno, f"assigns {_dotted(t)} at import") for t in targets
                  if isinstance(t, (ast.Attribute, ast.Subscript))]
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            found += [(d.lineno, f"decorator @{_dotted(d)} runs at import")
                      for d in stmt.decorator_list if _dotted(d) not in _IMPORT_TIME_DECORATORS]
    return found


def _patches_of_imported_objects(tree: ast.Module) -> list[tuple[int, str]]:
    """Anywhere in the file: `x.attr = ...` or `setattr(x, ...)` where `x` was bound by an
    import (another module, or a class or function defined elsewhere)."""
    imported = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            base = t.value if isinstance(t, (ast.Attribute, ast.Subscript)) else None
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if isinstance(base, ast.Name) and base.id in imported:
                found.append((node.lineno, f"assigns {_dotted(t)} (an imported object)"))
        if isinstance(node, ast.Call) and _dotted(node.func) in ("setattr", "delattr") and \
                node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in imported:
            found.append((node.lineno, f"{_dotted(node.func)}({node.args[0].id}, ...)"))
    return found


def test_compat_patches_nothing_at_import():
    """`slapo.compat` changes no core object when imported: what it adds to the core goes
    through `slapo.compat.install()`, which `slapo/__init__` calls explicitly, and the core's
    registration seams (`register_primitive`, `register_method_adapter`, `register_attribute`)."""
    bad = []
    for path in sorted((ROOT / "compat").rglob("*.py")):
        tree = ast.parse(path.read_text())
        found = _import_time_effects(tree) + _patches_of_imported_objects(tree)
        bad += [f"{path.relative_to(ROOT.parent)}:{line}: {what}" for line, what in found]
    assert not bad, "\n".join(bad)


def test_the_patch_detector_sees_the_old_shapes():
    """The two checks above catch what compat used to do (an import-time install call, an
    attribute put on another module, a registering decorator)."""
    old = ast.parse(
        "from .. import pipeline\n"
        "from ..runtime.build import install_2023_adapter\n"
        "def _install():\n"
        "    pipeline.generate_pipeline_partition = object()\n"
        "_install()\n"
        "install_2023_adapter(print)\n"
        "@register_primitive\n"
        "class P: pass\n")
    assert [line for line, _ in _import_time_effects(old)] == [5, 6, 7]
    assert [line for line, _ in _patches_of_imported_objects(old)] == [4]
