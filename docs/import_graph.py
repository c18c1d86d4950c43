"""Print the import graph's facts: modules, edges, binder's edges up into other apps, cycles.

``make import-graph`` (from the repository root). The contracts themselves are checked by
``lint-imports`` (``make lint``); this shows the numbers behind them.
"""

import itertools
import sys

import grimp

sys.path.insert(0, ".")
g = grimp.build_graph("binder", "usage", "webhooks", "gpuplane", include_external_packages=False, cache_dir=None)
mods = sorted(g.modules)
edges = [(a, b) for a in mods for b in g.find_modules_directly_imported_by(a)]
upward = ("usage", "webhooks", "gpuplane")
back = sorted((a, b) for a, b in edges if a.startswith("binder") and b.split(".")[0] in upward)
print(f"modules {len(mods)}, import edges {len(edges)}")
print(f"binder -> usage/webhooks/gpuplane edges: {len(back)}")
for a, b in back:
    print(f"   {a} -> {b}")
# cycles: strongly connected components of the module graph (Tarjan)
index: dict[str, int] = {}
low: dict[str, int] = {}
stack: list[str] = []
on: set[str] = set()
sccs: list[list[str]] = []
counter = itertools.count()
sys.setrecursionlimit(10000)
adj = {m: sorted(g.find_modules_directly_imported_by(m)) for m in mods}


def strong(v: str) -> None:
    index[v] = low[v] = next(counter)
    stack.append(v)
    on.add(v)
    for w in adj[v]:
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
            sccs.append(sorted(comp))


for m in mods:
    if m not in index:
        strong(m)
print(f"import cycles (strongly connected groups of modules): {len(sccs)}")
for c in sccs:
    print("   " + " <-> ".join(c))
