"""The package's shape: no import cycle among its modules, an analysis nothing writes to,
and every module saying what it is."""

import ast
import dataclasses
from pathlib import Path

import networkx as nx
import pytest
import torch
import torch.fx as fx

import normfuse
from normfuse.passes.analysis import analyze
from normfuse.zoo import ToyTransformer

PACKAGE = Path(normfuse.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph(run_time: bool = False) -> nx.DiGraph:
    """module -> module it imports, at the top or inside a function; ``normfuse.name`` after an
    ``import normfuse`` counts as importing the module the package resolves the name from.
    ``run_time``: without the imports under ``if TYPE_CHECKING:`` (names for annotations only)."""
    modules = _modules()
    exports = normfuse._EXPORTS
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        tree = ast.parse(path.read_text())
        if run_time:
            for block in [n for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]:
                block.body = []
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
                if base == "normfuse":
                    targets += [exports[a.name] for a in node.names if a.name in exports]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "normfuse" and node.attr in exports:
                targets = [exports[node.attr]]
            for target in targets:
                if target in modules and target != name and target != "normfuse":
                    graph.add_edge(name, target)
    return graph


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_passes_do_not_import_the_checker():
    graph = import_graph()
    for module in (m for m in graph if m.startswith("normfuse.passes")):
        reached = nx.descendants(graph, module)
        assert not any(m.startswith("normfuse.verify") and m != "normfuse.verify.structure" for m in reached), \
            (module, sorted(m for m in reached if m.startswith("normfuse.verify")))


def test_every_module_says_what_it_is():
    for name, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.split()) >= 4, f"{name} has no opening docstring"


def test_the_analysis_is_read_only():
    model = ToyTransformer(placement="pre", depth=2).eval()
    gm = torch.export.export(model, (torch.randint(0, 64, (2, 8)),), strict=False).module()
    analysis = analyze(gm.graph)
    assert len(analysis.sites) == 5
    site = analysis.sites[1]
    for obj, attr in ((analysis, "sites"), (site, "placement"), (site.match, "eps"), (site.in_add, "operands")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, None)
    with pytest.raises(TypeError):
        analysis.index.order[site.match.output] = 0
    with pytest.raises((TypeError, AttributeError)):
        analysis.index.norm_outputs.add(site.match.output)
    assert isinstance(site.match.nodes, tuple) and all(isinstance(n, fx.Node) for n in site.match.nodes)


def test_the_checker_reads_the_rewrite_s_record_and_runs_no_analysis():
    """verify/ pairs each fused call with what it replaced from the record the rewrite left
    (normfuse/passes/record.py): none of its modules reaches the analysis (``check`` itself,
    which optimizes the model it is given, is the entry point and may)."""
    graph = import_graph(run_time=True)
    for module in (m for m in graph if m.startswith("normfuse.verify") and m != "normfuse.verify.check"):
        reached = nx.descendants(graph, module)
        assert "normfuse.passes.analysis" not in reached, (module, nx.shortest_path(graph, module,
                                                                                    "normfuse.passes.analysis"))


def test_each_fusion_part_lives_in_its_module():
    """A fusion part (normfuse/passes/parts/) is declared in one module: outside it and the
    kernels (the op it extends, normfuse/kernels/), its name appears in at most 5 modules of the
    package (the registry, the option that switches it off, the report's fields); and no stage
    of the pass imports a part's module, only the registry and the order."""
    import re

    from normfuse.passes.parts import PARTS

    modules = _modules()
    graph = import_graph()
    for part in PARTS:
        own = f"normfuse.passes.parts.{part.name}"
        assert own in modules, f"part {part.name!r} has no module {own}"
        word = re.compile(rf"\b{re.escape(part.name)}\b")
        naming = [name for name, path in modules.items()
                  if name != own and not name.startswith("normfuse.kernels") and word.search(path.read_text())]
        assert len(naming) <= 5, (part.name, naming)
        importers = {m for m in graph.predecessors(own) if not m.startswith("normfuse.passes.parts")
                     and m != "normfuse.passes.order"}
        assert not importers, (part.name, sorted(importers))


def test_each_fusion_lives_in_its_module_and_the_stages_name_none():
    """A fusion (normfuse/passes/fusions/) is one module named after its op, imported only by
    the fusions' registry, the order and the pieces of the pass that build on its op; the
    rewrite and the checker reach it through ``fusion_of`` and name no fusion op or part."""
    import re

    from normfuse.passes.fusions import FUSIONS
    from normfuse.passes.order import STEPS

    modules = _modules()
    graph = import_graph()
    for fusion in FUSIONS:
        own = f"normfuse.passes.fusions.{fusion.ops[0]}"
        assert own in modules, f"fusion {fusion.name!r} has no module {own}"
        importers = {m for m in graph.predecessors(own) if not m.startswith("normfuse.passes.fusions")}
        assert importers <= {"normfuse.passes.order", "normfuse.passes.rewrite", "normfuse.passes.record"}, \
            (fusion.name, sorted(importers))
    words = {op for fusion in FUSIONS for op in fusion.ops} | {step.name for step in STEPS}
    pattern = re.compile(rf"\b({'|'.join(sorted(words - {'norm'}))})\b")  # "norm" is also the word
    for name, path in modules.items():
        if name.startswith("normfuse.verify"):
            assert not pattern.search(path.read_text()), (name, pattern.search(path.read_text()).group())
