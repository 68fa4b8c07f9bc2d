"""Layers point down (DESIGN.md rule 12), checked over EVERY import statement of paddletune/.

The scan reads each module's source with `ast.walk` (imports inside functions, methods and
`if` blocks count: a function-level import is still an edge a reader must follow), resolves
relative imports against the module's package, and maps each imported module to its unit:
the packages models, parallel, peft, quant, data, trainer and the modules tokenizer, loading,
generation. Two rules:
  1. no module under paddletune/models imports parallel, peft, quant, loading or trainer;
  2. the unit graph has no cycle (every strongly connected component is a single unit).

On main before issue 27 (75dca72) the scan found 14 imports from models/ into upper layers
(models/__init__.py:load_model -> parallel.expert / plan / pipeline / tensor and quant;
models/loss.py -> parallel.vocab, three times; models/glm_export.py -> peft.lora) and one unit
cycle of seven units, {data, generation, models, parallel, peft, quant, tokenizer}, held together
by models -> parallel / quant / peft / data / tokenizer, tokenizer -> models (the family tokenizer
choice), parallel -> generation (sampling), peft <-> parallel (rdrop), data -> parallel (packing)
and generation -> everything (load_for_generation); at module level a 43-module SCC.
`python tests/test_layering.py` prints the findings of the current tree.
"""
import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "paddletune")
UNITS = ("models", "parallel", "peft", "quant", "data", "trainer", "tokenizer", "loading",
         "generation")
FORBIDDEN_FOR_MODELS = ("parallel", "peft", "quant", "loading", "trainer")


def modules(root=ROOT):
    """{dotted module name: file path} of every .py file under root (package = paddletune)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(root))[:-3]
                parts = rel.split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = os.path.join(d, f)
    return out


def imports(name, path):
    """[(imported dotted name, line)] of every import statement in the file, relative ones
    resolved. `from pkg import x` yields pkg.x when that is a module (checked by the caller),
    else pkg."""
    is_pkg = path.endswith("__init__.py")
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


def unit_of(mod):
    """The layering unit of a paddletune module name, or None (args, io, runtime, ...)."""
    parts = mod.split(".")
    if parts[0] != "paddletune" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in UNITS else None


def edges(root=ROOT):
    """[(from module, to module, line)]: the module-level import graph inside paddletune."""
    mods = modules(root)
    out = []
    for name, path in sorted(mods.items()):
        for target, line in imports(name, path):
            if target in mods and target != name:
                out.append((name, target, line))
    return out


def sccs(graph):
    """Strongly connected components of {node: set(successors)} (Tarjan, iterative)."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    comps.append(sorted(comp))
    return comps


def findings(root=ROOT):
    """(models' forbidden imports, unit cycles with the edges that make them, module SCCs > 1)."""
    es = edges(root)
    bad = [(a, b, line) for a, b, line in es
           if unit_of(a) == "models" and unit_of(b) in FORBIDDEN_FOR_MODELS]
    ugraph, why = {u: set() for u in UNITS}, {}
    for a, b, line in es:
        ua, ub = unit_of(a), unit_of(b)
        if ua and ub and ua != ub:
            ugraph[ua].add(ub)
            why.setdefault((ua, ub), []).append(f"{a}:{line} -> {b}")
    cycles = []
    for comp in sccs(ugraph):
        if len(comp) > 1:
            inner = {k: v for k, v in why.items() if k[0] in comp and k[1] in comp}
            cycles.append((comp, inner))
    mgraph = {}
    for a, b, _ in es:
        mgraph.setdefault(a, set()).add(b)
        mgraph.setdefault(b, set())
    big = [c for c in sccs(mgraph) if len(c) > 1]
    return bad, cycles, big


def test_scanner_sees_function_level_and_relative_imports(tmp_path):
    """The scanner itself: a relative import inside a function body is an edge, and a
    two-unit cycle is found (hand-made package, so a scanner that misses either fails)."""
    pkg = tmp_path / "paddletune"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("def f():\n    from ..parallel import x\n")
    (pkg / "parallel.py").write_text("from .models import y\n")
    bad, cycles, big = findings(str(pkg))
    assert bad == [("paddletune.models", "paddletune.parallel", 2)]
    assert [c for c, _ in cycles] == [["models", "parallel"]]
    assert big == [["paddletune.models", "paddletune.parallel"]]


def test_models_import_no_upper_layer():
    bad, _, _ = findings()
    assert not bad, "models/ imports an upper layer:\n" + "\n".join(f"{a}:{n} -> {b}" for a, b, n in bad)


def test_no_import_cycle_between_units():
    _, cycles, _ = findings()
    msg = "\n".join(f"{comp}: " + "; ".join(e for v in inner.values() for e in v)
                    for comp, inner in cycles)
    assert not cycles, "import cycles between units:\n" + msg


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else ROOT
    bad, cycles, big = findings(root)
    print(f"models/ -> upper layers: {len(bad)}")
    for a, b, n in bad:
        print(f"  {a}:{n} -> {b}")
    print(f"unit-level cycles: {len(cycles)}")
    for comp, inner in cycles:
        print(f"  SCC {comp}")
        for (ua, ub), v in sorted(inner.items()):
            print(f"    {ua} -> {ub}: {len(v)} imports, e.g. {v[:3]}")
    print(f"module-level SCCs > 1: {[len(c) for c in big]}")
    for c in big:
        print("  " + " ".join(m.replace("paddletune.", "") for m in c))
