#!/usr/bin/env python3
"""Check the house rules of the source tree (docs/ARCHITECTURE.md, "The tree").

    scripts/ci/check-layout.py [--max-file-lines 800] [--max-fn-lines 120] [CRATE_DIR ...]

1. No non-test source file over 800 lines (test files: `tests.rs`, `tests/`, `*_tests.rs`).
2. No function over 120 lines, except the documented checklists listed in CHECKLISTS below
   (their module docs number the steps).
3. No import circle between the files of one crate: an edge A -> B means file A names an item
   that file B defines (through `crate::…`, `super::…` or a `use` of a sibling module). A
   `mod.rs` that only re-exports a child's item is not counted as defining it. A module and the modules nested in it are one unit: uses between a parent and
   its descendants are not edges (a child sees its parent's private items by design); uses
   between siblings, or between cousins, are.
4. No import in the coordinator that climbs its folder order. COORDINATOR_ORDER below lists
   the coordinator's subsystems from the bottom up; each file belongs to the longest entry
   that is a prefix of its module path. A file *climbs* when it names an item defined in a
   file of a subsystem listed higher than its own (`learn` naming `run::…`, or the artifact
   storage naming `learn::…`). Naming items of its own subsystem or of lower ones is how the
   graph is meant to be read; tests (`#[cfg(test)]` modules and test files) may import anything.

Reads the sources as text (standard library only): it is a guard, not a compiler. Exits 0 when
every rule holds, 1 with one line per finding otherwise. Default crates: coordinator, worker,
shared, inspect, constraint and the root package.
"""

import os
import re
import sys

# Functions allowed past the length limit: a documented checklist whose module docs number
# its steps. (file suffix, function name).
CHECKLISTS = {
    ("coordinator/src/learn/op_check.rs", "check_op"),
    ("coordinator/src/decide/selection.rs", "select"),
}

DEFAULT_CRATES = ["coordinator", "worker", "shared", "inspect", "constraint", "."]

# The coordinator's subsystems, bottom first: a file may name items of its own subsystem and
# of those listed before it, never of those listed after it.
COORDINATOR_ORDER = [
    ("progress",),  # what rank 0 is doing now: read by everyone, reads nobody
    ("artifacts",),  # storage: crash-safe JSONL, atomic writes, seals, file names
    ("guidance",),  # the per-run guidance repository
    ("cluster",),  # facing the workers: service, lease table, completions
    ("decide",),  # selection, fail-first guardrail, eligibility, accuracy
    ("artifacts", "rows"),  # the schema of the JSONL lines (holds decisions and job facts)
    ("artifacts", "documents"),  # the schema of manifest.json and summary.json
    ("learn",),  # reflection and what judges its proposals
    ("run",),  # the epoch loop, which drives all of the above
]


def is_test_path(path):
    base = os.path.basename(path)
    parts = path.replace("\\", "/").split("/")
    return base == "tests.rs" or base.endswith("_tests.rs") or "tests" in parts[:-1] or "test_support" in base


def rust_files(crate):
    src = os.path.join(crate, "src")
    out = []
    for root, _dirs, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                out.append(os.path.join(root, f))
    return sorted(out)


def strip_code(text):
    """Blank out comments, string and char literals (keeping newlines) so braces count true."""
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
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i:j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


FN_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+\"C\"\s+)?fn\s+(\w+)")


def long_functions(code, limit):
    lines = code.split("\n")
    found = []
    test_depth = None
    depth = 0
    for idx, line in enumerate(lines):
        m = FN_RE.match(line)
        if m and test_depth is None:
            # Find the body's opening brace, then its match.
            d, start, j = 0, None, idx
            while j < len(lines):
                for ch in lines[j]:
                    if ch == "{":
                        d += 1
                        start = start if start is not None else j
                    elif ch == "}":
                        d -= 1
                    elif ch == ";" and start is None:
                        d = None
                        break
                if d is None or (start is not None and d == 0):
                    break
                j += 1
            if d is not None and start is not None:
                length = j - idx + 1
                if length > limit:
                    found.append((m.group(1), idx + 1, length))
        if re.match(r"\s*#\[cfg\(test\)\]", line):
            test_depth = depth
        depth += line.count("{") - line.count("}")
        if test_depth is not None and depth <= test_depth and "}" in line:
            test_depth = None
    return found


def module_path(crate, path):
    rel = os.path.relpath(path, os.path.join(crate, "src")).replace("\\", "/")[:-3]
    parts = rel.split("/")
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


DEF_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+)?(?:async\s+)?(?:const\s+fn|fn|struct|enum|trait|type|const|static|mod|union|macro_rules!)\s+(\w+)", re.M)
PATH_RE = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
USE_GROUP_RE = re.compile(r"\buse\s+(crate|super|self)((?:::\w+)*)::\{([^;]*)\};", re.S)


def nested(a, b):
    """Whether one module is the other's ancestor: a parent and the children it declares are
    one unit (a child sees its parent's private items by design), so their mutual uses are
    not counted as a circle."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def import_edges(crate):
    """File -> the files whose items it names (outside its own module family)."""
    files = [f for f in rust_files(crate) if not is_test_path(f)]
    mods = {}
    defs = {}
    texts = {}
    for f in files:
        code = strip_code(open(f, encoding="utf-8").read())
        # Drop #[cfg(test)] modules: tests may import anything.
        code = re.sub(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{.*", "", code, flags=re.S)
        texts[f] = code
        mp = module_path(crate, f)
        mods[mp] = f
        defs[f] = set(DEF_RE.findall(code))
    edges = {f: set() for f in files}

    def resolve(base, names):
        """The file defining base::names[0]::…: the deepest module, then the item in it."""
        mp = tuple(base)
        rest = list(names)
        while rest and mp + (rest[0],) in mods:
            mp, rest = mp + (rest[0],), rest[1:]
        target = mods.get(mp)
        if target is None:
            return None
        if rest:
            item = rest[0]
            if item not in defs[target]:
                # A re-export: find the child module that defines it.
                for child, cf in mods.items():
                    if child[:-1] == mp and item in defs[cf]:
                        return cf
                return None
        return target

    for f in files:
        mp = module_path(crate, f)
        refs = []
        for root, tail in PATH_RE.findall(texts[f]):
            refs.append((root, tail.strip(":").split("::")))
        for root, tail, group in USE_GROUP_RE.findall(texts[f]):
            for item in re.split(r"[,\s]+", group):
                item = item.split("::")
                if item and item[0] and item[0] not in ("self",):
                    refs.append((root, [x for x in tail.strip(":").split("::") if x] + item))
        for root, names in refs:
            if root == "crate":
                base = ()
            elif root == "self":
                base = mp
            else:
                base = mp[:-1]
                while names and names[0] == "super":
                    base, names = base[:-1], names[1:]
            t = resolve(base, names)
            if t and t != f and not nested(module_path(crate, t), mp):
                edges[f].add(t)
    return edges


def circles(crate):
    return find_cycles(import_edges(crate))


def layer(order, mp):
    """The index in `order` of the longest entry that is a prefix of module path `mp`."""
    best, best_len = None, -1
    for i, entry in enumerate(order):
        if mp[:len(entry)] == entry and len(entry) > best_len:
            best, best_len = i, len(entry)
    return best


def climbs(crate, order):
    """(file, file it names) pairs where the named file sits higher in `order`."""
    out = []
    for f, targets in sorted(import_edges(crate).items()):
        lf = layer(order, module_path(crate, f))
        for t in sorted(targets):
            lt = layer(order, module_path(crate, t))
            if lf is not None and lt is not None and lt > lf:
                out.append((f, t))
    return out


def find_cycles(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            strong(v)
    return out


def main(argv):
    max_file, max_fn, crates = 800, 120, []
    i = 1
    while i < len(argv):
        if argv[i] == "--max-file-lines":
            max_file, i = int(argv[i + 1]), i + 2
        elif argv[i] == "--max-fn-lines":
            max_fn, i = int(argv[i + 1]), i + 2
        elif argv[i] in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        else:
            crates.append(argv[i])
            i += 1
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    os.chdir(root)
    crates = crates or [c for c in DEFAULT_CRATES if os.path.isdir(os.path.join(c, "src"))]
    findings = []
    for crate in crates:
        for f in rust_files(crate):
            rel = os.path.normpath(f).replace("\\", "/")
            text = open(f, encoding="utf-8").read()
            if is_test_path(rel):
                continue
            n = text.count("\n")
            if n > max_file:
                findings.append(f"file {rel}: {n} lines (limit {max_file})")
            for name, line, length in long_functions(strip_code(text), max_fn):
                if any(rel.endswith(s) and name == fn for s, fn in CHECKLISTS):
                    continue
                findings.append(f"function {rel}:{line} {name}: {length} lines (limit {max_fn})")
        for cyc in circles(crate):
            names = " <-> ".join(os.path.normpath(c).replace("\\", "/") for c in cyc)
            findings.append(f"import circle: {names}")
        if os.path.normpath(crate) == "coordinator":
            for f, t in climbs(crate, COORDINATOR_ORDER):
                a, b = (os.path.normpath(x).replace("\\", "/") for x in (f, t))
                findings.append(f"import climbs the folder order: {a} -> {b}")
    for f in findings:
        print(f)
    print(f"check-layout: {len(findings)} finding(s) in {', '.join(crates)}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
