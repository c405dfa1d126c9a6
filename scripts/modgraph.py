#!/usr/bin/env python3
"""Module dependency graphs of src/protocol and src/ep: layers and import cycles, and the
protocol core's purity (make lint runs it all; make test runs --purity).

Each folder is its own graph. Nodes are files: src/ep/foo.rs and src/ep/foo/mod.rs are module
ep::foo, src/ep/gpu/ipc.rs is ep::gpu::ipc, src/ep/mod.rs is ep (src/protocol likewise). Inline
non-test modules count as part of their file.

Edges A -> B ("A uses B") come from, in A's file outside `#[cfg(test)]` modules and comments:
- `use crate::...`, `use super::...`, `use self::...`, `use child::...` trees (`pub use`
  included; `child` a submodule of A named relative to it), and
- paths written in code: `crate::ep::x::...`, `super::x::...`, `child::...`.
A `mod child;` declaration alone is no edge (declaring a module uses none of its code).
A path is resolved to the longest module prefix it names (`crate::ep::gpu::ipc::Foo` is
ep::gpu::ipc; `super::Foo` from ep::gpu::ipc is ep::gpu), then through re-exports:

Re-exports. A `pub use` in P of an item of C is an edge P -> C (P's API is built on C). A path
that names an item through P (`P::Name`) is resolved to where P's `pub use` takes Name from
(followed through several facades, and through `pub use C::*` when C defines Name), so using an
item through a parent's facade is a dependency on the module that defines it, not on the
facade. So a parent that re-exports its children's items is not in a cycle with them unless a
child uses one of the parent's *own* items (defined in the parent's file), which is an edge
child -> parent.

Paths outside the graph's folder (crate::cuda, crate::fabric, and for src/ep crate::protocol)
are not nodes. Self edges are dropped.

Output, per folder: every module's layer (0: uses nothing else in the folder; k: 1 + the highest
layer of what it uses) in topological order of the condensation, then every strongly connected
component (Tarjan) with more than one module, its edges with the line that makes each, and its
elementary cycles (at most MAX_CYCLES per component).

Purity. src/protocol is the pure core: no CUDA, no libfabric, no threads. Every path a file
there names, tests included (`use` trees and paths in code, `super::` resolved; comments and
strings do not count), is checked against IMPURE; each hit is printed as file:line.

Exit status: 1 if a component with more than one module remains once the edges in ALLOWED are
taken out, or if a file under src/protocol names an IMPURE path; else 0. With --report, always
0. With --purity, only the purity check runs (and decides the status).
"""

import os
import re
import sys

# Known edges that close cycles, each with why it stays (empty: neither folder has an import
# cycle).
# Key: (from module, to module). A cycle passes if removing these edges breaks it.
ALLOWED = {}

MAX_CYCLES = 50
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "src")
TOPS = ("protocol", "ep")
PURE = "protocol"

# What src/protocol may not name, by path prefix, with why: the runtime around the protocol core
# (the engines, the C ABI, the CUDA and libfabric wrappers, the proxy's threads, the bootstrap),
# the crates under them, and threads, locks and atomics (nothing in the core is shared between
# threads; its callers own the concurrency).
IMPURE = {
    ("crate", "cuda"): "CUDA",
    ("crate", "fabric"): "libfabric",
    ("crate", "proxy"): "the proxy runtime, its threads",
    ("crate", "bootstrap"): "the bootstrap",
    ("crate", "ffi"): "the C ABI",
    ("crate", "ep"): "the engines, which build on protocol",
    ("cudarc",): "CUDA",
    ("libfabric_sys",): "libfabric",
    ("std", "thread"): "threads",
    ("std", "sync"): "locks, atomics and channels",
    ("core", "sync"): "atomics",
    ("parking_lot",): "locks",
    ("crossbeam",): "threads and channels",
    ("thread_local!",): "thread-local state",
}

ITEM_RE = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+|const\s+|async\s+|extern\s+\"C\"\s+)*"
    r"(?:fn|struct|enum|union|trait|type|const|static|mod|macro_rules!)\s+([A-Za-z_]\w*)",
    re.M,
)


def module_of(path):
    rel = os.path.relpath(path, SRC)[: -len(".rs")].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    return "::".join(rel)


def strip(text):
    """Comments and string/char literals blanked (newlines kept, so offsets map to lines)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i : j + 1]))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:]):
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_end(text, open_brace):
    depth = 0
    for j in range(open_brace, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def drop_test_modules(text):
    """Blanks `#[cfg(test)] mod x { ... }` (and `#[cfg(test)] mod x;`)."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
        if not m:
            return text
        end = block_end(text, m.end() - 1)
        text = text[: m.start()] + re.sub(r"[^\n]", " ", text[m.start() : end]) + text[end:]


def inline_mod_ranges(text):
    return [(m.end(), block_end(text, m.end() - 1))
            for m in re.finditer(r"\bmod\s+\w+\s*\{", text)]


def expand_use(tree):
    """`a::{b, c::{d, e as f}, self}` -> [[a, b], [a, c, d], [a, c, e], [a]] (renames dropped:
    the edge is to where the item comes from)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        return parts

    def go(prefix, s):
        if "{" in s:
            head, _, rest = s.partition("{")
            head = [p for p in head.split("::") if p]
            inner = rest[:-1] if rest.endswith("}") else rest
            res = []
            for part in split_top(inner):
                res.extend(go(prefix + head, part))
            return res
        segs = [p for p in s.split("::") if p]
        if segs and segs[-1] == "self":
            segs = segs[:-1]
        return [prefix + segs]

    return go([], tree)


class Graph:
    def __init__(self, top):
        self.top = top
        self.files = {}
        for d, _, fs in os.walk(os.path.join(SRC, top)):
            for f in fs:
                if f.endswith(".rs"):
                    p = os.path.join(d, f)
                    self.files[module_of(p)] = p
        self.mods = set(self.files)
        self.text = {m: drop_test_modules(strip(open(p).read())) for m, p in self.files.items()}
        self.items = {m: set(ITEM_RE.findall(t)) for m, t in self.text.items()}
        self.reexports = {m: self.parse_reexports(m) for m in self.mods}
        self.edges = {}  # (a, b) -> first "file:line: text" that makes it

    def children(self, m):
        return sorted(c.rsplit("::", 1)[1] for c in self.mods if self.parent(c) == m)

    def parent(self, m):
        return m.rsplit("::", 1)[0] if "::" in m else None

    def absolute(self, m, segs, nested):
        """Segments of a path written in module m as crate-absolute segments (None: external)."""
        if not segs:
            return None
        if segs[0] == "crate":
            return segs[1:]
        base = m.split("::")
        if "::".join(base + segs[:1]) in self.mods and not nested:
            return base + segs  # a child module, named relative to m (`use ipc::PeerPath`)
        if segs[0] in ("super", "self"):
            if nested:
                # Inside an inline module of m: `super` is m itself (or deeper, still m's file).
                depth = nested
                while segs and segs[0] == "super" and depth:
                    segs, depth = segs[1:], depth - 1
                if depth:
                    return base + [s for s in segs if s not in ("self",)]
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    base = base[:-1]
                segs = segs[1:]
            return base + segs
        return None

    def parse_reexports(self, m):
        """{name: crate-absolute path of the item} for m's `pub use`, plus glob sources."""
        names, globs = {}, []
        for u in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", self.text[m]):
            if u.group(1).split("::")[0].strip() not in ["crate", "super", "self"] + self.children(m):
                continue
            for segs in expand_use(u.group(1)):
                nested = self.nesting(m, u.start())
                segs2 = self.absolute(m, segs, nested)
                if not segs2:
                    continue
                if segs2[-1] == "*":
                    globs.append(segs2[:-1])
                else:
                    names[segs2[-1]] = segs2
        return names, globs

    def nesting(self, m, pos):
        return sum(1 for a, b in inline_mod_ranges(self.text[m]) if a <= pos < b)

    def nesting_full(self, m, text, pos):
        """`nesting` in a file's text with its test modules kept."""
        return sum(1 for a, b in inline_mod_ranges(text) if a <= pos < b)

    def resolve(self, segs, seen=None):
        """Module (node) that defines what crate-absolute `segs` names; None if outside the
        graph's folder."""
        if not segs or segs[0] != self.top:
            return None
        k = len(segs)
        while k and "::".join(segs[:k]) not in self.mods:
            k -= 1
        if not k:
            return None
        mod = "::".join(segs[:k])
        rest = segs[k:]
        if not rest or rest[0] in self.items[mod]:
            return mod
        seen = seen or set()
        if (mod, rest[0]) in seen:
            return mod
        seen.add((mod, rest[0]))
        names, globs = self.reexports[mod]
        if rest[0] in names:
            return self.resolve(names[rest[0]] + rest[1:], seen) or mod
        for g in globs:
            gm = "::".join(g)
            if gm in self.mods and rest[0] in self.items[gm]:
                return self.resolve(g + rest, seen) or mod
        return mod

    def add(self, a, b, m, pos, what):
        if b is None or a == b:
            return
        line = self.text[m].count("\n", 0, pos) + 1
        rel = os.path.relpath(self.files[m], ROOT)
        self.edges.setdefault((a, b), f"{rel}:{line}: {what}")

    def build(self):
        for m in sorted(self.mods):
            t = self.text[m]
            spans = []
            children = self.children(m)
            heads = "|".join(["crate", "super", "self"] + children)
            for u in re.finditer(r"\buse\s+((?:%s)\b[^;]*);" % heads, t):
                spans.append((u.start(), u.end()))
                nested = self.nesting(m, u.start())
                for segs in expand_use(u.group(1)):
                    segs = [s for s in segs if s != "*"]
                    ab = self.absolute(m, segs, nested)
                    self.add(m, self.resolve(ab), m, u.start(), "use " + "::".join(segs))
            for p in re.finditer(r"(?<![\w:])((?:%s)(?:::\w+)+)" % heads.replace("|self", ""), t):
                if any(a <= p.start() < b for a, b in spans):
                    continue
                segs = p.group(1).split("::")
                ab = self.absolute(m, segs, self.nesting(m, p.start()))
                self.add(m, self.resolve(ab), m, p.start(), p.group(1))
        return self


def tarjan(nodes, adj):
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(adj.get(v, ())):
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
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def cycles_in(comp, adj):
    """Elementary cycles of one component, each starting at its smallest module."""
    comp = sorted(comp)
    found = []
    for i, s in enumerate(comp):
        allowed = set(comp[i:])
        stack = [(s, [s])]
        while stack and len(found) < MAX_CYCLES:
            v, path = stack.pop()
            for w in sorted(adj.get(v, ()), reverse=True):
                if w == s:
                    found.append(path + [s])
                elif w in allowed and w not in path:
                    stack.append((w, path + [w]))
    return found


def graph_report(top):
    """Prints the layers and cycles of src/<top>; returns the components ALLOWED does not break."""
    g = Graph(top).build()
    adj = {}
    for a, b in g.edges:
        adj.setdefault(a, set()).add(b)
    comps = tarjan(g.mods, adj)
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    # Tarjan emits components in reverse topological order: dependencies first.
    layer = {}
    for i, c in enumerate(comps):
        deps = {comp_of[b] for m in c for b in adj.get(m, ()) if comp_of[b] != i}
        layer[i] = 1 + max((layer[d] for d in deps), default=-1)
    print(f"src/{top}: {len(g.mods)} modules, {len(g.edges)} edges")
    for L in range(max(layer.values(), default=-1) + 1):
        names = [" + ".join(c) if len(c) > 1 else c[0]
                 for i, c in enumerate(comps) if layer[i] == L]
        print(f"layer {L}: " + ", ".join(sorted(names)))
    big = [c for c in comps if len(c) > 1]
    print(f"cycles: {len(big)} component(s) with more than one module")
    for c in big:
        print("component: " + ", ".join(c))
        for (a, b), why in sorted(g.edges.items()):
            if a in c and b in c:
                mark = "  [allowed: " + ALLOWED[(a, b)] + "]" if (a, b) in ALLOWED else ""
                print(f"  {a} -> {b}   ({why}){mark}")
        for cyc in cycles_in(c, adj):
            print("  cycle: " + " -> ".join(cyc))
    pruned = {a: {b for b in bs if (a, b) not in ALLOWED} for a, bs in adj.items()}
    bad = [c for c in tarjan(g.mods, pruned) if len(c) > 1]
    for c in bad:
        print("not allowed: " + ", ".join(c), file=sys.stderr)
    return bad


def impure_paths(g):
    """[(file:line, path, why)] for every path a file of graph g names that IMPURE forbids."""
    hits = []
    path_re = re.compile(r"(?<![\w:])(?:::)?([A-Za-z_]\w*(?:::[A-Za-z_]\w*)+)")
    for m in sorted(g.mods):
        text = strip(open(g.files[m]).read())  # tests included: no threads there either
        found = []  # (pos, segments as written)
        spans = []
        for u in re.finditer(r"\buse\s+(?:::)?([^;]+);", text):
            spans.append((u.start(), u.end()))
            found.extend((u.start(), segs) for segs in expand_use(u.group(1)))
        for p in path_re.finditer(text):
            if not any(a <= p.start() < b for a, b in spans):
                found.append((p.start(), p.group(1).split("::")))
        for mac in re.finditer(r"\bthread_local!", text):
            found.append((mac.start(), ["thread_local!"]))
        for pos, segs in found:
            segs = [s for s in segs if s != "*"]
            if not segs:
                continue
            if segs[0] in ("crate", "super", "self") or segs[0] in g.children(m):
                ab = g.absolute(m, segs, g.nesting_full(m, text, pos))
                if ab is None:
                    continue
                segs = ["crate"] + ab
            for prefix, why in IMPURE.items():
                if tuple(segs[: len(prefix)]) == prefix:
                    line = text.count("\n", 0, pos) + 1
                    rel = os.path.relpath(g.files[m], ROOT)
                    hits.append((f"{rel}:{line}", "::".join(segs), why))
                    break
    return sorted(set(hits))


def purity_report():
    """Prints every impure path under src/PURE; returns how many."""
    hits = impure_paths(Graph(PURE))
    for where, path, why in hits:
        print(f"{where}: {path} ({why})", file=sys.stderr)
    if hits:
        print(f"modgraph: src/{PURE} is the pure protocol core; {len(hits)} path(s) above name "
              "what it may not use (IMPURE in scripts/modgraph.py)", file=sys.stderr)
    else:
        print(f"purity: src/{PURE} names no CUDA, libfabric, proxy, bootstrap, C ABI, engine, "
              "thread or lock paths")
    return len(hits)


def main():
    args = sys.argv[1:]
    report = "--report" in args
    if "--purity" in args:
        return 1 if purity_report() and not report else 0
    bad = []
    for i, top in enumerate(TOPS):
        if i:
            print()
        bad += graph_report(top)
    print()
    impure = purity_report()
    if bad and not report:
        print(f"modgraph: {len(bad)} import cycle(s) (see above; --report to only print)",
              file=sys.stderr)
    return 1 if (bad or impure) and not report else 0

if __name__ == "__main__":
    sys.exit(main())
