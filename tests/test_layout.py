"""The package layout is a contract: which package may import which, no import cycles (function-level
imports included), nothing below ``zoo.api`` imports it, every architecture is one folder with the
parts the architecture table names, and no module of the loader, the engine or the server names an
architecture (what they need to know of one is in its row of the table)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zoo
from zoo.images import FAMILIES as IMAGE_FAMILIES
from zoo.models.architectures import ARCHITECTURES, PARTS, VISION_PARTS
from zoo.registry import REGISTRY
from zoo.text.tool_calls import FORMATS as TOOL_CALL_FORMATS

PACKAGE = Path(zoo.__file__).parent
# Lowest first: a package may import only packages before it in this list (and itself).
ORDER = ["configs", "distributed", "text", "images", "formats", "sources", "sharding", "ops", "kernels", "quant",
         "models", "registry", "loader", "weight_cache", "engine", "tools", "eval", "server", "api", "train", "kaggle",
         "cli"]
TOP = {"__init__", "__main__"}             # the public entry points import lazily from anywhere


def module_name(path: Path) -> str:
    """``zoo/a/b.py`` -> ``zoo.a.b``; a package's ``__init__.py`` -> the package."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every zoo module a file imports, at any depth of the file (function bodies included)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("zoo")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            if base.startswith("zoo"):
                for a in node.names:     # ``from pkg import module`` depends on the module, not on pkg
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULE_NAMES else base)
    return out


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "assets" not in p.parts}
MODULE_NAMES = set(MODULES)
GRAPH = {m: {i for i in imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_place_in_the_order():
    assert {package_of(m) for m in MODULES} - TOP == set(ORDER)


def test_packages_import_only_lower_packages():
    bad = []
    for m, deps in GRAPH.items():
        src = package_of(m)
        if src in TOP:
            continue
        for d in deps:
            dst = package_of(d)
            if dst in TOP and src == "cli":          # the command line uses the public API
                continue
            if dst in TOP or ORDER.index(dst) > ORDER.index(src):
                bad.append(f"{m} -> {d}")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_module_import_cycles():
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_nothing_below_the_api_imports_it():
    above = ORDER[ORDER.index("api") + 1:]             # the consumers of the public API (train, cli)
    users = sorted(m for m, deps in GRAPH.items() if "zoo.api" in deps and package_of(m) not in above)
    assert set(users) <= {"zoo"}, users


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_architecture_is_one_folder_with_every_part(arch):
    a = ARCHITECTURES[arch]
    folder = PACKAGE / "models" / a.package.rsplit(".", 1)[1]
    assert folder.is_dir() and a.package == f"zoo.models.{folder.name}"
    for part in PARTS:
        assert a.part(part) is not None
    for part in VISION_PARTS if a.has_vision else ():
        assert a.part(part) is not None
    assert a.config_class().arch == arch
    assert all(m in REGISTRY for m in a.models)
    assert a.tool_format in TOOL_CALL_FORMATS
    assert a.image_family is None or a.image_family in IMAGE_FAMILIES


def test_the_registry_and_the_table_agree():
    assert {m for a in ARCHITECTURES.values() for m in a.models} == set(REGISTRY)


def table_names() -> set[str]:
    """Every name the architecture table knows an architecture by (lower case): ids, tool-call
    formats, image families, HF model types, GGUF architectures, registry names."""
    return {v.lower() for a in ARCHITECTURES.values()
            for v in (a.id, a.tool_format, a.image_family, *a.hf_model_types, *a.gguf_architectures, *a.models) if v}


def code_strings(path: Path):
    """``(line, text)`` of every string literal of a file (f-string pieces included) but docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_loader_engine_and_server_name_no_architecture():
    """Adding a model touches its package and its row only: no string in zoo/loader, zoo/engine or
    zoo/server holds a name from the table (comments and docstrings aside)."""
    names = table_names()
    bad = [f"{m}:{line}: {text!r} names {sorted(n for n in names if n in text.lower())}"
           for m, p in sorted(MODULES.items()) if package_of(m) in ("loader", "engine", "server")
           for line, text in code_strings(p) if any(n in text.lower() for n in names)]
    assert not bad, "architecture names outside the table:\n" + "\n".join(bad)


def test_the_name_check_sees_code_strings_only(tmp_path):
    source = tmp_path / "m.py"
    name = sorted(ARCHITECTURES)[0]
    source.write_text(f'"""Docstring naming {name}."""\n\n\ndef f(arch):\n    """{name} again."""\n'
                      f'    # a comment: {name}\n    return arch == "{name}" or f"{{arch}}-{name.upper()}"\n')
    hits = [(line, text) for line, text in code_strings(source) if any(n in text.lower() for n in table_names())]
    assert hits == [(7, name), (7, f"-{name.upper()}")]
