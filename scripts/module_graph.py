#!/usr/bin/env python3
"""The module graph of the crate's top-level modules, read from `crate::` paths in src/.

Prints one line per module with the top-level modules it imports, then every cycle (a pair of
modules that import each other, with the files on each side), then the layer violations: an
import that points up the layering of docs/ARCHITECTURE.md. Exits non-zero when there is a cycle
or a violation, so `python3 scripts/module_graph.py` is a check as well as a picture.

Comments, doc comments included, are stripped before reading: a doc link up the layering (a
kernel's docs naming the op that calls it) is a pointer for the reader, not an import.
`--dot` prints the graph in Graphviz's format instead.
"""
import collections
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")

# Lower layers first; a module may import only modules of its own layer or below.
LAYERS = [
    ["error"],
    ["tensor"],
    ["shmem"],
    ["device"],
    ["collectives", "fused"],
    ["dist_tensor"],
    ["autograd", "nn", "mesh", "checkpoint"],
    ["train"],
    ["models"],
]
LAYER_OF = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def top_modules():
    names = set()
    for entry in os.listdir(ROOT):
        path = os.path.join(ROOT, entry)
        if os.path.isdir(path):
            names.add(entry)
        elif entry.endswith(".rs") and entry != "lib.rs":
            names.add(entry[:-3])
    return names


def edges():
    tops = top_modules()
    found = collections.defaultdict(lambda: collections.defaultdict(set))
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT)
            top = rel.split(os.sep)[0].removesuffix(".rs")
            if top == "lib":
                continue
            text = open(path, encoding="utf-8").read()
            text = re.sub(r"//.*$", "", text, flags=re.M)
            used = set(re.findall(r"crate::(\w+)", text))
            for group in re.findall(r"crate::\{([^}]*)\}", text):
                used.update(re.findall(r"(\w+)", group))
            for other in used & tops - {top}:
                found[top][other].add(rel)
    return found


def main():
    graph = edges()
    if "--dot" in sys.argv:
        print("digraph modules {")
        for a in sorted(graph):
            for b in sorted(graph[a]):
                print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    for a in sorted(graph):
        print(f"{a} -> {' '.join(sorted(graph[a]))}")
    bad = 0
    print("cycles:")
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if a < b and a in graph.get(b, {}):
                bad += 1
                print(f"  {a} <-> {b}: {sorted(graph[a][b])[:3]} | {sorted(graph[b][a])[:3]}")
    print("imports up the layering:")
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if a in LAYER_OF and b in LAYER_OF and LAYER_OF[b] > LAYER_OF[a]:
                bad += 1
                print(f"  {a} -> {b}: {sorted(graph[a][b])[:3]}")
    print("none" if bad == 0 else f"{bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
