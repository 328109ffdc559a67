"""The package's layering: no import cycle among gbc_kernels' modules, function-level imports
included (read from the source with ast, so an import inside a function counts too)."""

from __future__ import annotations

import ast
import pathlib

import gbc_kernels

ROOT = pathlib.Path(gbc_kernels.__file__).parent


def _modules():
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


def _targets(mods, module, node):
    """Modules of gbc_kernels an import statement in ``module`` loads (submodules first, then
    their package)."""
    is_pkg = mods[module].name == "__init__.py"
    pkg = module if is_pkg else module.rsplit(".", 1)[0]
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = []
        for a in node.names:
            sub = f"{target}.{a.name}"
            compiled = any((ROOT.parent / sub.replace(".", "/")).parent.glob(a.name + ".*.so"))
            names.append(None if compiled else sub if sub in mods else target)
    out = set()
    for t in names:
        while t and t not in mods and "." in t:
            t = t.rsplit(".", 1)[0]
        if t in mods and t != module:
            out.add(t)
    return out


def import_graph():
    mods = _modules()
    graph = {}
    for m, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _targets(mods, m, node)
        graph[m] = deps
    return graph


def find_cycle(graph):
    """One cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = "done"
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert "gbc_kernels.ops" in graph and graph["gbc_kernels.ops"]      # the walk found imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_walker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_integrations_import_no_private_module():
    """The drop-ins use the library's public API only (gbc_kernels' modules and names without
    a leading underscore)."""
    bad = {(m, d) for m, deps in import_graph().items()
           if m.startswith("gbc_kernels.integrations") for d in deps
           if any(part.startswith("_") for part in d.split(".")[1:])}
    assert not bad, sorted(bad)
