#!/bin/sh
# layers_check.sh: the library's layers (docs/design.md, "Layers") are folders
# of src/, lowest first: base, backend, memory, features, api. A file may use
# its own folder and the folders below it, never one above: no #include of a
# header of a higher folder, and no object file of the static library with
# an undefined symbol that a higher folder's object defines (nm). Folder
# dependencies then form no cycle, and tide_malloc can be read downward.
# Every file of src/ lies in one of those folders, with a name unique in src/.
#
# Inside memory/ and features/ the files are a stack too (ORDER, lowest
# first): a file's objects call functions of its own and lower files only.
# The calls still going up are listed in KNOWN_ORDER, printed at every run,
# and must leave the list when they go; a new file of those folders must
# take its place in ORDER.
#
# The inline functions of those folders' headers escape the symbols (their
# calls land in whichever object uses them), so each header sits at the
# place of a file of ORDER (HEADER_AT): the functions its inline bodies call
# are defined in that file or below it, or are inline functions of a header
# placed no higher. A header of declarations only is placed at None, and
# fails once it holds an inline body. A new header must take its place too.
#
# The check also shows it can fail: it runs itself on a copy of src/ with an
# upward #include added, on the library's symbols with an upward call added
# (between folders and inside one), and on a copy of src/ with an inline
# function of core.h calling arena.c, and fails unless each is caught.
#
# usage: layers_check.sh [path/to/tidalloc] (the command's directory holds
# libtidalloc.a, whose symbols are checked; without it, only the includes).
# NM names the nm program (default nm).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
lib=""
[ $# -ge 1 ] && lib="$(dirname "$1")/libtidalloc.a"
exec python3 - "$root/src" "$lib" "${NM:-nm}" <<'PY'
import os, re, shutil, subprocess, sys, tempfile

LAYERS = ["base", "backend", "memory", "features", "api"]  # lowest first
RANK = {name: i for i, name in enumerate(LAYERS)}
PUBLIC = {"tidalloc.h", "tidalloc_testing.h", "tidalloc_torch.h"}  # include/

# Upward uses still in the code, each (file, header or symbol): printed at
# every run; one that is gone must leave this list too.
KNOWN = {}

# The files of a folder, lowest first: each calls only itself and those
# before it.
ORDER = {
    "memory": ["trace.c", "ptrmap.c", "bins.c", "device_memory.c", "stream_events.c", "segment.c",
               "arena.c", "arena_table.c"],
    "features": ["stats.c", "pinned.c", "graph_reuse.c", "pool.c", "checkpoint.c", "others.c",
                 "buffer.c",
                 "share.c", "snapshot.c", "validate.c"],
}

# The place of each header of a folder of ORDER: the file of ORDER its
# inline bodies are at the level of (None: declarations only).
HEADER_AT = {
    "memory": {"core.h": "ptrmap.c", "quick.h": "arena.c", "arena_table.h": "arena_table.c"},
    "features": {"features.h": None, "pinned.h": None},
}

# Calls still going up inside a folder, each (file, symbol): why they remain.
# None now: a call that goes up fails the check until it is restructured.
KNOWN_ORDER = {}

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
NM_LINE = re.compile(r"^[^:]*:([^:]+):\s*(?:[0-9a-fA-F]+)?\s+([A-Za-z])\s+(\S+)$")


def sources(src):
    """{path relative to src: folder}, and the problems of the tree itself."""
    files, problems = {}, []
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if not os.path.isdir(path):
            problems.append(f"src/{entry} is in no layer folder ({', '.join(LAYERS)})")
        elif entry not in RANK:
            problems.append(f"src/{entry}/ is not a layer ({', '.join(LAYERS)})")
        else:
            for name in sorted(os.listdir(path)):
                if name.endswith((".c", ".h")):
                    files[f"{entry}/{name}"] = entry
    seen = {}
    for rel in files:
        base = os.path.basename(rel)
        if base in seen:
            problems.append(f"src/{rel} and src/{seen[base]} share a name")
        seen[base] = rel
    return files, problems


def include_edges(src, files):
    """(file, its folder, folder used, header) for each #include "..."."""
    edges, problems = [], []
    for rel, folder in files.items():
        with open(os.path.join(src, rel), encoding="utf-8") as f:
            text = f.read()
        for header in INCLUDE.findall(text):
            if header in PUBLIC:
                continue  # the public headers, below every layer
            target = header if "/" in header else f"{folder}/{header}"
            if target.startswith("../") or target not in files:
                problems.append(f"src/{rel}: #include \"{header}\" is no header of src/<layer>/")
                continue
            edges.append((rel, folder, files[target], header))
    return edges, problems


def symbol_edges(nm_lines, files, target_files=None):
    """(file, its folder, folder used, symbol) for each undefined symbol of an
    object that another object of the library defines; target_files, if a
    list, gets the defining file of each edge."""
    folder_of = {os.path.basename(rel): folder for rel, folder in files.items()}
    rel_of = {os.path.basename(rel): rel for rel in files}
    defined, undefined = {}, []
    for line in nm_lines:
        m = NM_LINE.match(line.rstrip("\n"))
        if not m:
            continue
        member, kind, sym = m.groups()
        source = member[:-2] if member.endswith(".o") else member
        if source not in folder_of:
            continue
        if kind in "Uw":
            undefined.append((source, sym))
        elif kind.isupper():
            defined[sym] = source
    edges = []
    for source, sym in undefined:
        if sym in defined:
            edges.append((rel_of[source], folder_of[source], folder_of[defined[sym]], sym))
            if target_files is not None:
                target_files.append(rel_of[defined[sym]])
    return edges


def order_problems(nm_lines, files, known_order, met):
    """Calls inside a folder of ORDER to a file above the caller."""
    problems = []
    for folder, names in ORDER.items():
        present = sorted(os.path.basename(r) for r, f in files.items()
                         if f == folder and r.endswith(".c"))
        for name in present:
            if name not in names:
                problems.append(f"src/{folder}/{name} has no place in ORDER[{folder!r}]")
    targets = []
    edges = symbol_edges(nm_lines, files, targets)
    for (rel, a, b, sym), target in zip(edges, targets):
        if a != b or a not in ORDER:
            continue
        names = ORDER[a]
        src_name, dst_name = os.path.basename(rel), os.path.basename(target)
        if src_name not in names or dst_name not in names:
            continue
        if names.index(dst_name) > names.index(src_name):
            if (rel, sym) in known_order:
                met.add((rel, sym))
                continue
            problems.append(f"src/{rel} uses {sym} of {dst_name}, a file above it in {a}/")
    return problems


C_WORDS = {"if", "for", "while", "switch", "return", "sizeof", "_Alignof", "do", "_Static_assert"}
INLINE_HEAD = re.compile(r"\bstatic\s+(?:\w+\s+)*?(?:inline|TIDE_ALWAYS_INLINE)\b[^;{}()]*?\b(\w+)\s*\(")
CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")


def inline_calls(text):
    """{inline function: names called in its body} of a header's text, its
    comments, strings and preprocessor lines left out."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", text, flags=re.M)
    found, pos = {}, 0
    while True:
        m = INLINE_HEAD.search(text, pos)
        if not m:
            break
        i, depth = m.end(), 1
        while depth and i < len(text):  # past the parameters
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        body = re.match(r"\s*\{", text[i:])
        if not body:  # a declaration
            pos = i
            continue
        start = end = i + body.end() - 1
        depth = 0
        while end < len(text):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
            end += 1
        found[m.group(1)] = {c for c in CALL.findall(text[start:end]) if c not in C_WORDS}
        pos = end
    return found


def header_problems(src, nm_lines, files):
    """Inline bodies of a header of a folder of ORDER that call a function
    of a file above the header's place (HEADER_AT), and headers without one."""
    problems = []
    defined = {}  # symbol -> the file of the library that defines it
    for line in nm_lines:
        m = NM_LINE.match(line.rstrip("\n"))
        if m and m.group(2).isupper() and m.group(2) not in "UW" and m.group(1).endswith(".o"):
            defined[m.group(3)] = m.group(1)[:-2]
    for folder, names in ORDER.items():
        places = HEADER_AT.get(folder, {})
        headers = sorted(os.path.basename(r) for r, f in files.items()
                         if f == folder and r.endswith(".h"))
        inline = {}  # inline function -> (its header, its level in names)
        bodies = {}
        for h in headers:
            if h not in places:
                problems.append(f"src/{folder}/{h} has no place in HEADER_AT[{folder!r}]")
                continue
            if places[h] is not None and places[h] not in names:
                problems.append(f"HEADER_AT[{folder!r}][{h!r}]: {places[h]} is not in ORDER")
                continue
            with open(os.path.join(src, folder, h), encoding="utf-8") as f:
                bodies[h] = inline_calls(f.read())
            if places[h] is None and bodies[h]:
                problems.append(f"src/{folder}/{h} is placed at None (declarations only) but has "
                                f"inline bodies: {', '.join(sorted(bodies[h]))}")
                continue
            for fn in bodies[h]:
                inline[fn] = (h, names.index(places[h]) if places[h] else -1)
        for h, funcs in bodies.items():
            if places[h] is None:
                continue
            level = names.index(places[h])
            for fn, calls in sorted(funcs.items()):
                for callee in sorted(calls):
                    if callee in inline:
                        where, at = inline[callee][0], inline[callee][1]
                    elif defined.get(callee) in names:
                        where = defined[callee]
                        at = names.index(where)
                    else:
                        continue  # a lower folder's, the C library's, or a macro
                    if at > level:
                        problems.append(f"src/{folder}/{h}: inline {fn} calls {callee} of {where}, "
                                        f"above the header's place ({places[h]}) in {folder}/")
    return problems


def cycles(edges):
    graph = {}
    for _, a, b, _ in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
    found, state = [], {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def check(src, nm_lines, known):
    """Problems found, the known exceptions met, and the edges."""
    files, problems = sources(src)
    includes, unknown = include_edges(src, files)
    problems += unknown
    edges = [("include",) + e for e in includes]
    if nm_lines is not None:
        edges += [("call",) + e for e in symbol_edges(nm_lines, files)]
    met, kept = set(), []
    for kind, rel, a, b, what in edges:
        if RANK[b] > RANK[a]:
            if (rel, what) in known:
                met.add((rel, what))
                continue
            verb = "includes" if kind == "include" else "uses"
            problems.append(f"src/{rel} ({a}) {verb} {what}, of {b}, a higher layer")
            continue
        kept.append((rel, a, b, what))
    for cycle in cycles(kept):
        problems.append("folders in a cycle: " + " -> ".join(cycle))
    return problems, met, edges


src, lib, nm = sys.argv[1:4]
nm_lines = None
if lib:
    try:
        out = subprocess.run([nm, "-A", lib], capture_output=True, text=True, check=True)
        nm_lines = out.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"FAIL: cannot read the symbols of {lib} with {nm}: {e}", file=sys.stderr)
        sys.exit(1)
else:
    print("symbols: not checked (no path of the built command given)")

problems, met, edges = check(src, nm_lines, KNOWN)
for key in sorted(set(KNOWN) - met):
    problems.append(f"known exception src/{key[0]} -> {key[1]} no longer occurs: remove it")
if nm_lines is not None:
    files, _ = sources(src)
    met_order = set()
    problems += order_problems(nm_lines, files, KNOWN_ORDER, met_order)
    for key in sorted(set(KNOWN_ORDER) - met_order):
        problems.append(f"known upward call src/{key[0]} -> {key[1]} no longer occurs: remove it")
    problems += header_problems(src, nm_lines, files)
    print("file order inside folders (lowest first):")
    for folder, names in ORDER.items():
        print(f"  {folder}/: " + " < ".join(names))
    print("headers' inline code, at the place of a file:")
    for folder, places in HEADER_AT.items():
        print(f"  {folder}/: " + ", ".join(f"{h} at {at or 'none (declarations only)'}"
                                          for h, at in places.items()))
    if KNOWN_ORDER:
        print(f"known upward calls inside a folder, to be removed ({len(KNOWN_ORDER)}):")
        for (rel, sym), why in sorted(KNOWN_ORDER.items()):
            print(f"  src/{rel} -> {sym}: {why}")
pairs = {}
for kind, rel, a, b, what in edges:
    if a != b:
        pairs.setdefault((a, b), set()).add(kind)
print("folder dependencies (lowest layer first: " + ", ".join(LAYERS) + "):")
for (a, b) in sorted(pairs, key=lambda p: (RANK[p[0]], RANK[p[1]])):
    print(f"  {a} -> {b} ({', '.join(sorted(pairs[(a, b)]))})")
if KNOWN:
    print(f"known upward uses, to be removed ({len(KNOWN)}):")
    for (rel, what), why in sorted(KNOWN.items()):
        print(f"  src/{rel} -> {what}: {why}")

# The check must be able to fail: an upward include and an upward call.
with tempfile.TemporaryDirectory() as tmp:
    copy = os.path.join(tmp, "src")
    shutil.copytree(src, copy)
    with open(os.path.join(copy, "base", "error.c"), "a", encoding="utf-8") as f:
        f.write('\n#include "memory/core.h"\n')
    caught, _, _ = check(copy, None, KNOWN)
    if not any("base/error.c (base) includes memory/core.h" in p for p in caught):
        problems.append("self-test: an #include of memory/core.h in base/error.c went unseen")
    else:
        print("self-test: an upward #include is caught:", [p for p in caught if "error.c" in p][0])
if nm_lines is not None:
    fake = nm_lines + [f"{lib}:segment.c.o:                 U tide_malloc"]
    caught, _, _ = check(src, fake, KNOWN)
    if not any("memory/segment.c (memory) uses tide_malloc" in p for p in caught):
        problems.append("self-test: a call of tide_malloc from segment.c went unseen")
    else:
        print("self-test: an upward call is caught:", [p for p in caught if "tide_malloc" in p][0])
    fake = nm_lines + [f"{lib}:bins.c.o:                 U _tide_arena_create"]
    files, _ = sources(src)
    caught = order_problems(fake, files, KNOWN_ORDER, set())
    if not any("memory/bins.c uses _tide_arena_create" in p for p in caught):
        problems.append("self-test: a call of arena.c from bins.c went unseen")
    else:
        print("self-test: a call up inside a folder is caught:",
              [p for p in caught if "bins.c uses _tide_arena_create" in p][0])
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "src")
        shutil.copytree(src, copy)
        core = os.path.join(copy, "memory", "core.h")
        with open(core, encoding="utf-8") as f:
            text = f.read()
        end = text.rindex("#endif")
        text = (text[:end] + "static inline int _tide_up(struct tide_allocator *a) {\n"
                "  return _tide_arena_create(a, NULL, NULL);\n}\n\n" + text[end:])
        with open(core, "w", encoding="utf-8") as f:
            f.write(text)
        files, _ = sources(copy)
        caught = header_problems(copy, nm_lines, files)
        want = "memory/core.h: inline _tide_up calls _tide_arena_create of arena.c"
        if not any(want in p for p in caught):
            problems.append("self-test: an inline function of core.h calling arena.c went unseen")
        else:
            print("self-test: a header's inline call up is caught:",
                  [p for p in caught if want in p][0])

for p in problems:
    print("FAIL:", p, file=sys.stderr)
if problems:
    sys.exit(1)
if KNOWN:
    print(f"layers: no upward include or call but the {len(KNOWN)} known ones above")
else:
    print("layers: every include and call goes to the same layer or a lower one")
PY
