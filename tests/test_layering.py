"""The layering of design.md, checked: every import in the package (module level and inside functions)
is read from the source, and a broken rule or an import circle fails here, naming the file and line."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "localllm"

# a module's room: the first matching prefix (dotted module names, most specific first)
ROOMS = [
    ("localllm.runtime.types", "leaves"), ("localllm.config", "leaves"), ("localllm.errors", "leaves"),
    ("localllm.__init__", "leaves"), ("localllm.standalone", "leaves"), ("localllm.__main__", "entry"),
    ("localllm.models", "models"), ("localllm.machine", "machine"), ("localllm.runtime", "runtime"),
    ("localllm.compose", "compose"), ("localllm.eval", "eval"), ("localllm.server", "server"), ("localllm.tui", "tui"),
    ("localllm.cli", "cli"), ("localllm.bench", "bench"),
]
BELOW_DOORS = {"leaves", "models", "machine", "runtime", "compose"}
# what each room may import of localllm (its own room always)
MAY_IMPORT = {
    "leaves": set(),
    "models": {"leaves"},
    "machine": {"leaves", "models"},
    "runtime": {"leaves", "machine"},
    "compose": {"leaves", "models", "machine", "runtime"},
    # llama.cpp itself as the yardstick: the fresh-context reference, the Llama class, perplexity
    "eval": {"leaves", "machine", "runtime"},
    "server": BELOW_DOORS,
    "tui": BELOW_DOORS,
    "bench": BELOW_DOORS | {"eval"},
    # the command line is the entry point: it starts the server, opens the chat UI and runs the benches
    "cli": BELOW_DOORS | {"server", "tui", "bench", "eval"},
    "entry": {"cli"},
}
# third-party libraries stay in their rooms (module-name prefixes that may import them)
THIRD_PARTY = {
    # the ctypes boundary, the runner child's log hook, quantizing, and the Llama class as the bench's baseline
    "llama_cpp": ("localllm.runtime.native.", "localllm.runtime.runner.child", "localllm.models.quantize",
                  "localllm.eval.baseline"),
    "textual": ("localllm.tui.",),
    "fastapi": ("localllm.server.",),
    "starlette": ("localllm.server.",),
    "pydantic": ("localllm.server.",),
    "uvicorn": ("localllm.cli.serve",),
    "huggingface_hub": ("localllm.models.hub", "localllm.models.pull"),
}


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (localllm.*) or top-level third-party name
    names: tuple[str, ...]  # names taken with `from x import a, b`
    where: str  # file:line


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    return ".".join(rel.parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def edges() -> list[Edge]:
    mods = modules()
    out = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                out += [Edge(name, a.name, (), where) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("localllm"):
                    # `from localllm.runtime import engine` imports the submodule
                    subs = [a.name for a in node.names if f"{node.module}.{a.name}" in mods]
                    out += [Edge(name, f"{node.module}.{s}", (), where) for s in subs]
                    rest = tuple(a.name for a in node.names if a.name not in subs)
                    if rest:
                        target = node.module if node.module in mods else f"{node.module}.__init__"
                        out.append(Edge(name, target, rest, where))
                else:
                    out.append(Edge(name, node.module, (), where))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "standalone"
                  and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)):
                # localllm/standalone.py loads a dependency's module by name: an import all the same
                out.append(Edge(name, f"{node.args[0].value}.{node.args[1].value}", (), where))
    return out


def room(module: str) -> str:
    for prefix, r in ROOMS:
        if module == prefix or module.startswith(prefix + "."):
            return r
    raise AssertionError(f"{module} is in no room of design.md: add it to ROOMS")


def test_every_module_has_a_room() -> None:
    for name in modules():
        room(name)


def test_rooms_import_only_downward() -> None:
    bad = []
    for e in edges():
        if not e.dst.startswith("localllm"):
            continue
        src, dst = room(e.src), room(e.dst)
        if dst != src and dst not in MAY_IMPORT[src]:
            bad.append(f"{e.where}: {e.src} ({src}) imports {e.dst} ({dst})")
    assert not bad, "imports that break design.md's layering:\n" + "\n".join(bad)


def test_third_party_libraries_stay_in_their_rooms() -> None:
    bad = []
    for e in edges():
        top = e.dst.split(".")[0]
        allowed = THIRD_PARTY.get(top)
        if allowed is not None and not any(e.src == a or e.src.startswith(a) for a in allowed):
            bad.append(f"{e.where}: {e.src} imports {e.dst} (allowed in {', '.join(allowed)})")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules() -> None:
    bad = [f"{e.where}: {e.src} takes {', '.join(n for n in e.names if n.startswith('_'))} from {e.dst}"
           for e in edges() if e.dst.startswith("localllm") and e.dst != e.src
           and any(n.startswith("_") and not n.startswith("__") for n in e.names)]
    assert not bad, "modules talk through public names:\n" + "\n".join(bad)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    graph: dict[str, set[str]] = {}
    for e in edges():
        if e.dst.startswith("localllm") and e.dst != e.src and not e.dst.endswith("__init__"):
            graph.setdefault(e.src, set()).add(e.dst)
    assert circles(graph) == []


def test_the_checks_can_fail() -> None:
    """The circle finder and the room rules see what they should (so a green run means something)."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert "compose" not in MAY_IMPORT["runtime"] and "server" not in MAY_IMPORT["tui"]
    assert room("localllm.runtime.types") == "leaves" and room("localllm.runtime.engine.scheduler") == "runtime"
    found = {(e.src, e.dst) for e in edges()}
    assert ("localllm.server.openai.chat", "localllm.server.core.lifecycle") in found  # edges are really read
