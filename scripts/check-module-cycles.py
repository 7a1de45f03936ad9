#!/usr/bin/env python3
"""Import cycles between the modules of one crate.

The rule: inside a crate, the top-level modules (the children of the crate root) must form a
directed acyclic graph. Module `a` depends on module `b` when code anywhere in `a` (its file,
its submodules, its inline modules) names a path into `b`: `use crate::b::X;`, a `use` group
(`use crate::{b::X, c};`), or a path in code (`crate::b::f()`, `super::b::X` from a child of
the root). Paths that end on an item of the root itself (`crate::Error`) count for the module
the root re-exports that item from (`pub use b::Error;` makes it `b`); items the root defines
count for nobody. The same rule holds one level down, and further: inside every module that has
submodules (a module directory such as `dispatcher/`), its direct children must not form a
cycle either (`super::sibling::X`, `crate::dispatcher::sibling::X`).

Test code may import anything, so it is left out: files named `tests.rs`, and every item under
`#[cfg(test)]` (a `mod tests;` and the files below it, a `mod tests { ... }`, a test-only
`use`). Comments, doc links, strings, `$crate` in macros and `pub(in crate::x)` visibilities are
not dependencies.

Crates: every directory with a Cargo.toml and a src/ under backend/, vmm-integration/ and
guest-tests/ (target/ skipped). Each crate root is checked on its own: src/lib.rs, src/main.rs
and src/bin/*.rs; files are mapped to module paths by following `mod` declarations from the
root (`mod x;` in `a.rs` or `a/mod.rs` is `a/x.rs` or `a/x/mod.rs`).

Run:  scripts/check-module-cycles.py            # from anywhere; the repository is found from here
      scripts/check-module-cycles.py --root DIR # another checkout
      scripts/check-module-cycles.py -v         # also list every crate's module graph

Exit status: 0 and a one-line summary when there is no cycle; 1 with every cycle printed (the
modules of each strongly connected component, one cycle through them, and where each edge of
the component comes from) when there is one. Python 3 standard library only.
"""

import argparse
import os
import re
import sys
from collections import defaultdict

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
ITEM_KEYWORDS = {
    "pub", "use", "mod", "fn", "impl", "struct", "enum", "trait", "type", "const", "static",
    "macro_rules", "extern", "unsafe", "async", "let", "union",
}


# --------------------------------------------------------------------------- source cleaning

def blank(s):
    """`s` with every character but newlines replaced by a space (offsets and lines kept)."""
    return "".join(c if c == "\n" else " " for c in s)


def strip_comments_and_literals(src):
    """Comments, string/char literals blanked; everything else kept at the same offsets."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(src[i:j]))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(src[i:j]))
            i = j
        elif re.match(r'(?:b|c)?r#*"', src[i:i + 40]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'(?:b|c)?r(#*)"', src[i:])
            close = '"' + m.group(1)
            j = src.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
            out.append(blank(src[i:j]))
            i = j
        elif c == '"' or (c in "bc" and src.startswith('"', i + 1) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_"))):
            j = i + (1 if c == '"' else 2)
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j = min(n, j + 1)
            out.append(blank(src[i:j]))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}', b'x' handled by the 'b' falling through here)
            # or a lifetime ('a, 'static): only literals are blanked.
            if src.startswith("\\", i + 1):
                j = i + 3  # past the escaped character: '\'' and '\\' end at the next quote
                while j < n and src[j] != "'" and src[j] != "\n":
                    j += 1
                j = min(n, j + 1)
                out.append(blank(src[i:j]))
                i = j
            elif i + 2 < n and src[i + 2] == "'":
                out.append("   " if src[i + 1] != "\n" else " \n ")
                i += 3
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def skip_ws(text, i):
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def match_bracket(text, i):
    """Index just past the bracket closing the one at `i` (any of ([{ nested)."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [pairs[text[i]]]
    j = i + 1
    while j < len(text) and stack:
        ch = text[j]
        if ch in pairs:
            stack.append(pairs[ch])
        elif ch in ")]}":
            stack.pop()
        j += 1
    return j


def item_end(text, i):
    """End of the item (or field, arm, statement) starting at `i`."""
    word = re.match(IDENT, text[i:])
    is_item = bool(word) and word.group(0) in ITEM_KEYWORDS
    is_use = bool(word) and word.group(0) == "use" or bool(re.match(r"pub(\s*\([^)]*\))?\s+use\b", text[i:]))
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return j  # the enclosing block ends: the item ended before it
            depth -= 1
            if depth == 0 and ch == "}" and is_item and not is_use:
                return j + 1
        elif ch == ";" and depth == 0:
            return j + 1
        elif ch == "," and depth == 0 and not is_item:
            return j + 1
        j += 1
    return j


CFG_TEST = re.compile(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")


def strip_cfg_test(text):
    """Every item under an outer `#[cfg(test)]` attribute blanked."""
    while True:
        m = CFG_TEST.search(text)
        if not m:
            return text
        j = skip_ws(text, m.end())
        while text.startswith("#", j) and text[skip_ws(text, j + 1):].startswith("["):
            j = match_bracket(text, skip_ws(text, j + 1))
            j = skip_ws(text, j)
        end = item_end(text, j)
        text = text[:m.start()] + blank(text[m.start():end]) + text[end:]


def clean(src):
    text = strip_comments_and_literals(src)
    text = strip_cfg_test(text)
    # Visibility paths are not dependencies; neither are `$crate` paths of macros.
    text = re.sub(r"pub\s*\(\s*in\s+[^)]*\)", lambda m: blank(m.group(0)), text)
    text = re.sub(r"\$crate\b(\s*::\s*" + IDENT + r")*", lambda m: blank(m.group(0)), text)
    return text


# --------------------------------------------------------------------------- use trees

TOKEN = re.compile(r"\s*(::|" + IDENT + r"|[{},*;])")


def parse_use_tree(body):
    """[(name or None, [segments])] for a `use` item's tree (without `use` and `;`).
    name is the binding the item introduces (None for `*` and `_`)."""
    toks = []
    pos = 0
    while pos < len(body):
        m = TOKEN.match(body, pos)
        if not m:
            if body[pos:].strip() == "":
                break
            pos += 1
            continue
        toks.append(m.group(1))
        pos = m.end()
    out = []

    def tree(i, prefix):
        # One use tree at toks[i]; returns the index after it.
        path = list(prefix)
        if i < len(toks) and toks[i] == "::":
            i += 1
        while i < len(toks):
            t = toks[i]
            if t == "{":
                i += 1
                while i < len(toks) and toks[i] != "}":
                    i = tree(i, path)
                    if i < len(toks) and toks[i] == ",":
                        i += 1
                return i + 1
            if t == "*":
                out.append((None, path))
                return i + 1
            if re.fullmatch(IDENT, t):
                if t == "self" and path and (i + 1 >= len(toks) or toks[i + 1] != "::"):
                    name, seg = path[-1], path
                    i += 1
                    if i + 1 < len(toks) and toks[i] == "as":
                        name, i = toks[i + 1], i + 2
                    out.append((None if name == "_" else name, seg))
                    return i
                path = path + [t]
                i += 1
                if i < len(toks) and toks[i] == "::":
                    i += 1
                    continue
                name = t
                if i + 1 < len(toks) and toks[i] == "as":
                    name, i = toks[i + 1], i + 2
                out.append((None if name == "_" else name, path))
                return i
            return i + 1
        return i

    i = 0
    while i < len(toks):
        i = tree(i, [])
        if i < len(toks) and toks[i] == ",":
            i += 1
    return out


# --------------------------------------------------------------------------- module tree

class Module:
    def __init__(self, path, file):
        self.path = tuple(path)     # segments from the crate root
        self.file = file            # file holding its text (for messages)
        self.children = {}          # name -> Module
        self.uses = {}              # binding -> [segments] (as written)
        self.refs = []              # ([segments] as written, file, line, snippet)


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


USE_ITEM = re.compile(r"(?<![\w$])use\s+(?!<)")
CODE_PATH = re.compile(r"(?<![\w$])(crate|super|self)((?:\s*::\s*" + IDENT + r")+)")
MOD_DECL = re.compile(r"(?<![\w$])mod\s+(" + IDENT + r")\s*([;{])")


class Crate:
    def __init__(self, name, root_file, warn):
        self.name = name
        self.root_file = root_file
        self.warn = warn
        self.root = Module((), root_file)
        self.modules = {(): self.root}
        self.load(self.root, root_file, os.path.dirname(root_file), is_root=True)

    def load(self, module, path, child_dir, is_root=False):
        with open(path, encoding="utf-8") as f:
            text = clean(f.read())
        self.scan(module, text, path, child_dir)

    def scan(self, module, text, path, child_dir):
        # Inline modules first: their text is theirs, blanked out of the parent's.
        pos = 0
        while True:
            m = MOD_DECL.search(text, pos)
            if not m:
                break
            name, kind = m.group(1), m.group(2)
            if kind == "{":
                open_at = m.end() - 1
                close = match_bracket(text, open_at)
                child = self.child(module, name, path)
                inner = " " * (open_at + 1) + text[open_at + 1:close - 1]
                self.scan(child, inner, path, os.path.join(child_dir, name))
                text = text[:m.start()] + blank(text[m.start():close]) + text[close:]
                pos = close
            else:
                if name != "tests":
                    self.file_module(module, name, child_dir, path)
                pos = m.end()
        # `use` items.
        for m in list(USE_ITEM.finditer(text)):
            end = text.find(";", m.end())
            if end < 0:
                continue
            body = text[m.end():end]
            line = line_of(text, m.start())
            for name, segs in parse_use_tree(body):
                if name is not None:
                    module.uses[name] = segs
                module.refs.append((segs, path, line, "use " + "::".join(segs)))
            text = text[:m.start()] + blank(text[m.start():end + 1]) + text[end + 1:]
        # Paths in code.
        for m in CODE_PATH.finditer(text):
            segs = [m.group(1)] + [s.strip() for s in m.group(2).split("::") if s.strip()]
            module.refs.append((segs, path, line_of(text, m.start()), "::".join(segs)))

    def child(self, module, name, file):
        c = module.children.get(name)
        if c is None:
            c = Module(module.path + (name,), file)
            module.children[name] = c
            self.modules[c.path] = c
        return c

    def file_module(self, module, name, child_dir, declared_in):
        for cand, grand_dir in ((os.path.join(child_dir, name + ".rs"), os.path.join(child_dir, name)),
                                (os.path.join(child_dir, name, "mod.rs"), os.path.join(child_dir, name))):
            if os.path.isfile(cand):
                if os.path.basename(cand) == "tests.rs":
                    return
                child = self.child(module, name, cand)
                self.load(child, cand, grand_dir)
                return
        self.warn(f"{declared_in}: `mod {name};` has no file in {child_dir}")

    # ----------------------------------------------------------------------- resolution

    def resolve(self, segs, frm, depth=0):
        """The module a path written in module `frm` leads into (a tuple), or None when the
        path leaves the crate or is not a module path."""
        if depth > 16 or not segs:
            return None
        first, rest = segs[0], list(segs[1:])
        if first == "crate":
            base = ()
        elif first == "super" or first == "self":
            base = frm.path
            while first in ("super", "self"):
                if first == "super":
                    if not base:
                        return None
                    base = base[:-1]
                if not rest:
                    return base
                first, rest = rest[0], rest[1:]
            rest = [first] + rest
        else:
            cur = self.modules.get(frm.path)
            if first in cur.children:
                base = frm.path
                rest = segs
            elif first in cur.uses and cur.uses[first] != segs:
                target = self.resolve(cur.uses[first], frm, depth + 1)
                if target is None:
                    return None
                return self.walk(target, rest, depth)
            else:
                return None
        return self.walk(base, rest, depth)

    def walk(self, base, rest, depth):
        cur = self.modules.get(base)
        while rest and cur is not None:
            s = rest[0]
            if s in cur.children:
                cur = cur.children[s]
                rest = rest[1:]
            elif s in cur.uses:
                target = self.resolve(cur.uses[s], cur, depth + 1)
                if target is None:
                    return cur.path
                cur = self.modules.get(target)
                rest = rest[1:]
            else:
                break
        return None if cur is None else cur.path

    # ----------------------------------------------------------------------- graphs

    def graphs(self):
        """{parent path: {child: {child: (file, line, snippet)}}} for every module with
        children; the root's graph is the top-level one."""
        graphs = defaultdict(dict)
        for mod in self.modules.values():
            for segs, file, line, snippet in mod.refs:
                target = self.resolve(segs, mod)
                if target is None:
                    continue
                src = mod.path
                # Where the two paths part: an edge between the two children of the deepest
                # common parent (none when one contains the other).
                k = 0
                while k < len(src) and k < len(target) and src[k] == target[k]:
                    k += 1
                if k < len(src) and k < len(target):
                    g = graphs[src[:k]]
                    g.setdefault(target[k], {})
                    g.setdefault(src[k], {}).setdefault(target[k], (file, line, snippet))
        # Every module with children appears, even without edges.
        for mod in self.modules.values():
            if mod.children:
                g = graphs[mod.path]
                for c in mod.children:
                    g.setdefault(c, {})
        return graphs


def tarjan(graph):
    index, low, on, stack, sccs = {}, {}, set(), [], []
    counter = [0]

    def strong(v):
        # Iterative Tarjan: (node, iterator over successors).
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    scc.append(w)
                    if w == node:
                        break
                sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sccs


def one_cycle(graph, scc):
    """A shortest cycle through the first module of a strongly connected component."""
    members = set(scc)
    start = scc[0]
    prev = {start: None}
    queue = [start]
    while queue:
        nxt = []
        for v in queue:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        queue = nxt
    return scc + [scc[0]]


# --------------------------------------------------------------------------- crates

def crate_roots(repo):
    for top in ("backend", "vmm-integration", "guest-tests"):
        base = os.path.join(repo, top)
        if not os.path.isdir(base):
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in ("target", ".git", "src", "tests", "benches", "examples"))
            if "Cargo.toml" not in filenames or not os.path.isdir(os.path.join(dirpath, "src")):
                continue
            name = os.path.basename(dirpath)
            with open(os.path.join(dirpath, "Cargo.toml"), encoding="utf-8") as f:
                m = re.search(r'^\s*name\s*=\s*"([^"]+)"', f.read(), re.M)
                if m:
                    name = m.group(1)
            src = os.path.join(dirpath, "src")
            for root in ("lib.rs", "main.rs"):
                if os.path.isfile(os.path.join(src, root)):
                    yield (name if root == "lib.rs" else f"{name} (bin)"), os.path.join(src, root)
            bindir = os.path.join(src, "bin")
            if os.path.isdir(bindir):
                for entry in sorted(os.listdir(bindir)):
                    p = os.path.join(bindir, entry)
                    if entry.endswith(".rs"):
                        yield f"{name} (bin {entry[:-3]})", p
                    elif os.path.isfile(os.path.join(p, "main.rs")):
                        yield f"{name} (bin {entry})", os.path.join(p, "main.rs")


def label(parent):
    return "crate" if not parent else "crate::" + "::".join(parent)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description="Report import cycles between the modules of each crate.")
    ap.add_argument("--root", default=os.path.dirname(here), help="repository root (default: this script's parent)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every crate's module graph")
    args = ap.parse_args()
    repo = os.path.abspath(args.root)

    warnings = []
    cycles = []
    n_roots = n_modules = n_graphs = 0
    for name, root_file in crate_roots(repo):
        crate = Crate(name, root_file, warnings.append)
        n_roots += 1
        n_modules += len(crate.modules) - 1
        graphs = crate.graphs()
        for parent in sorted(graphs):
            graph = graphs[parent]
            n_graphs += 1
            if args.verbose and any(graph.values()):
                print(f"{name}: {label(parent)}")
                for a in sorted(graph):
                    if graph[a]:
                        print(f"  {a} -> {', '.join(sorted(graph[a]))}")
            for scc in tarjan(graph):
                if len(scc) > 1:
                    cycles.append((name, os.path.relpath(root_file, repo), parent, graph, scc))

    for w in warnings:
        print(f"warning: {os.path.relpath(w, repo) if os.path.isabs(w) else w}", file=sys.stderr)
    if not cycles:
        print(f"no module cycles: {n_roots} crate roots, {n_modules} modules, {n_graphs} module graphs checked")
        return 0
    n_crates = len({c[0] for c in cycles})
    print(f"module cycles: {len(cycles)}, in {n_crates} crate{'' if n_crates == 1 else 's'}")
    for name, root_rel, parent, graph, scc in cycles:
        print(f"\n{name} ({root_rel}): {label(parent)}::{{{', '.join(scc)}}}")
        print("  cycle: " + " -> ".join(one_cycle(graph, scc)))
        members = set(scc)
        for a in scc:
            for b in sorted(graph[a]):
                if b in members:
                    file, line, snippet = graph[a][b]
                    if len(snippet) > 90:
                        snippet = snippet[:87] + "..."
                    print(f"  {a} -> {b}: {os.path.relpath(file, repo)}:{line}: {snippet}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
