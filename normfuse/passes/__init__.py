"""The pass, one module per stage: capture's graph in, fused op calls out.

    canonical.py   one table of op spellings -> canonical primitives
    graph.py       the graph every stage reads (order, canonical view, copies)
    find.py        norms and the adds next to them
    classify.py    placement on the residual stream
    analysis.py    analyze(graph) -> Analysis: the three stages above, frozen
    parts/         fusion parts: each step a call takes over besides norm and add, one module each
    planning.py    plan(analysis, config) -> every fused call, decided before the graph changes
    rewrite.py     apply the plans: fused op calls in the graph
    provenance.py  where a site came from, and the report's record of it
    pipeline.py    NormFusionPass: the stages in order, the fallback, nested regions
    prenorm.py, prenorm_model.py   Post-Norm -> Pre-Norm (graph side, model side)
    cross_block/   the residual pair carried across block boundaries (model side)
    dtensor_graph.py  sequence parallel: the add reaches its norm through from_local
"""
