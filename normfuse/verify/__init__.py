"""Checking a rewrite: the model against fp64 (check.py), each site against the subgraph it
replaced (graph_check.py, sites.py, numeric.py, symbolic.py), the Pre-Norm conversion's
promise (structure.py), and the results (result.py)."""
