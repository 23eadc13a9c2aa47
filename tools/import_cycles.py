#!/usr/bin/env python3
"""Circles in the project's import graph: Rust files under src/ (crate::/super::/self:: paths, test
modules left out) and Python files under python/shardwise/ (lazy imports included). A circle is a set
of files that reach each other through imports. Prints each circle; exits 1 if there is any.
Usage: python3 tools/import_cycles.py [REPO]   (default: the current directory)
"""
import ast
import os
import re
import sys

def rust_files(src):
    out = []
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in ("bin",)]
        for f in files:
            if f.endswith(".rs"):
                out.append(os.path.relpath(os.path.join(root, f), src))
    return sorted(out)


def mod_path_of(rel):
    """src-relative file -> module path list (lib.rs -> [], a/mod.rs -> [a], a/b.rs -> [a, b])."""
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return parts


def strip_tests(text):
    """Drops `#[cfg(test)] mod tests { ... }` blocks (brace matched)."""
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub\s+)?mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 0, m.end() - 1
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        i = j + 1
    out.append(text[i:])
    return "".join(out)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def expand_use_groups(text):
    """`use crate::a::{b, c::{d, e}};` -> crate::a::b crate::a::c::d crate::a::c::e (paths only)."""
    paths = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        stack = [(m.group(1).replace(" ", "").replace("\n", ""), "")]
        while stack:
            body, prefix = stack.pop()
            # split top-level commas
            depth, cur, items = 0, "", []
            for ch in body:
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                if ch == "," and depth == 0:
                    items.append(cur)
                    cur = ""
                else:
                    cur += ch
            items.append(cur)
            for it in items:
                if not it:
                    continue
                if "{" in it:
                    head, rest = it.split("{", 1)
                    stack.append((rest[: rest.rfind("}")], prefix + head))
                else:
                    paths.append(prefix + it.split("as")[0] if "::as" not in it else prefix + it.split("::as")[0])
    return paths


def rust_graph(src):
    files = rust_files(src)
    by_mod = {tuple(mod_path_of(f)): f for f in files}
    edges = {f: set() for f in files}
    for f in files:
        text = strip_comments(strip_tests(open(os.path.join(src, f), encoding="utf-8", errors="replace").read()))
        here = mod_path_of(f)
        # the module a `super::` refers to: parent of this file's module
        paths = expand_use_groups(text)
        paths += re.findall(r"\b(?:crate|super|self)(?:::\w+)+", text)
        for p in paths:
            segs = [s for s in p.split("::") if s]
            if not segs:
                continue
            if segs[0] == "crate":
                base, rest = [], segs[1:]
            elif segs[0] == "super":
                base, rest = here[:-1], segs[1:]
                while rest and rest[0] == "super":
                    base, rest = base[:-1], rest[1:]
            elif segs[0] == "self":
                base, rest = here, segs[1:]
            else:
                continue
            full = base + rest
            # longest prefix that is a file module
            for n in range(len(full), 0, -1):
                tgt = by_mod.get(tuple(full[:n]))
                if tgt:
                    if tgt != f and not (mod_path_of(tgt) == here[: len(mod_path_of(tgt))] and tgt.endswith("mod.rs") and False):
                        edges[f].add(tgt)
                    break
    # a parent mod.rs declaring `mod child;` and re-exporting is not a use of the child's contents; we
    # only count paths, so `pub use child::X` in mod.rs counts (it is a dependency of the parent on the child)
    return edges


def py_graph(pkg):
    files = []
    for root, _, fs in os.walk(pkg):
        for f in fs:
            if f.endswith(".py"):
                files.append(os.path.relpath(os.path.join(root, f), pkg))
    mods = {}
    for f in files:
        parts = f[:-3].split(os.sep)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[tuple(parts)] = f
    edges = {f: set() for f in files}
    for f in files:
        parts = f[:-3].split(os.sep)
        pkg_parts = parts[:-1]
        try:
            tree = ast.parse(open(os.path.join(pkg, f), encoding="utf-8").read())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg_parts[: len(pkg_parts) - (node.level - 1)] if node.level > 1 else pkg_parts
                    mod = base + (node.module.split(".") if node.module else [])
                else:
                    if not node.module or not node.module.startswith("shardwise"):
                        continue
                    mod = node.module.split(".")[1:]
                targets.append(mod)
                for a in node.names:
                    targets.append(mod + [a.name])
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("shardwise"):
                        targets.append(a.name.split(".")[1:])
            for t in targets:
                for n in range(len(t), -1, -1):
                    tgt = mods.get(tuple(t[:n]))
                    if tgt is not None:
                        if tgt != f and not tgt.endswith("__init__.py"):
                            edges[f].add(tgt)
                        break
    return edges


def sccs(edges):
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
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
            out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]




def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
    rc = sccs(rust_graph(os.path.join(repo, "src")))
    pkg = os.path.join(repo, "python", "shardwise")
    pc = sccs(py_graph(pkg)) if os.path.isdir(pkg) else []
    for name, cs in (("src/", rc), ("python/shardwise/", pc)):
        if not cs:
            print(f"{name}: no circle")
        for c in cs:
            print(f"{name}: circle of {len(c)} files: {', '.join(c)}")
    return 1 if rc or pc else 0


if __name__ == "__main__":
    sys.exit(main())
