"""Print nemo_sspo's module import graph by layer; exit 1 on an upward import.

Layers, bottom to top (a module may import its own layer and those below it):

    metrics / registry / choice -> algorithms -> parallel -> megatron -> models / data / rewards -> rollout
    -> evaluation / rollouts -> trainer -> cli

``integrations`` sits beside ``trainer`` but may import only ``metrics``, ``algorithms``,
``parallel``, ``megatron`` and itself (an adapter runs inside another project's loop, never
ours). Every import counts, including the lazy ones inside functions. A sub-package missing from
the table is an error too, so a new package has to be placed in a layer.

    python tools/import_graph.py [PACKAGE_DIR]     # default: the nemo_sspo package next to tools/
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

LAYERS: dict[str, int] = {
    "metrics": 0,
    "registry": 0,
    "choice": 0,
    "known_warnings": 0,
    "algorithms": 1,
    "parallel": 2,
    "megatron": 3,
    "models": 4,
    "data": 4,
    "rewards": 4,
    "rollout": 5,
    "evaluation": 6,
    "rollouts": 6,
    "trainer": 7,
    "integrations": 7,
    "cli": 8,
}
"""Sub-package (or top-level module) -> layer rank; imports may not go to a higher rank."""

RESTRICTED: dict[str, frozenset[str]] = {
    "integrations": frozenset({"metrics", "algorithms", "parallel", "megatron", "integrations"}),
}
"""Parts that may import only the listed parts, whatever their rank."""


@dataclass(frozen=True)
class Violation:
    """``importer`` (a module) imports ``imported`` against the layer order; ``reason`` says why."""

    importer: str
    imported: str
    reason: str


def _module_name(package_dir: Path, file: Path) -> str:
    parts = list(file.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Absolute names of every module ``module`` imports (relative imports resolved)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{alias.name}" for alias in node.names)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's own modules it imports, for every ``.py`` file under ``package_dir``.

    Names that are attributes rather than modules (``from pkg.a import func``) are mapped to the
    deepest existing module.
    """
    package_dir = Path(package_dir)
    files = sorted(package_dir.rglob("*.py"))
    modules = {_module_name(package_dir, f): f for f in files}
    root = package_dir.name
    graph: dict[str, set[str]] = {}
    for module, file in modules.items():
        names = _imports(ast.parse(file.read_text(), str(file)), module, file.name == "__init__.py")
        targets = set()
        for name in names:
            if name != root and not name.startswith(root + "."):
                continue
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _part(module: str) -> str | None:
    """The layer table key of a module (``nemo_sspo.trainer.loop`` -> ``trainer``); None for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def check(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS,
          restricted: dict[str, frozenset[str]] = RESTRICTED) -> list[Violation]:
    """Every import that goes up the layer order, into a part a restricted part may not use, or
    from/to a part missing from ``layers``. The package root (``__init__``) is exempt."""
    violations = []
    for importer, targets in sorted(graph.items()):
        source = _part(importer)
        if source is None:
            continue
        if source not in layers:
            violations.append(Violation(importer, "", f"{source!r} is in no layer: add it to LAYERS"))
            continue
        for imported in sorted(targets):
            target = _part(imported)
            if target is None or target == source:
                continue
            if target not in layers:
                violations.append(Violation(importer, imported, f"{target!r} is in no layer: add it to LAYERS"))
            elif source in restricted and target not in restricted[source]:
                violations.append(Violation(importer, imported, f"{source} may import only "
                                                                f"{', '.join(sorted(restricted[source]))}"))
            elif layers[target] > layers[source]:
                violations.append(Violation(importer, imported, f"upward: {source} (layer {layers[source]}) "
                                                                f"imports {target} (layer {layers[target]})"))
    return violations


def render(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS) -> str:
    """The graph as text: per layer, each part and the parts it imports (with import counts)."""
    by_part: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    modules: dict[str, int] = defaultdict(int)
    for importer, targets in graph.items():
        source = _part(importer) or "(root)"
        modules[source] += 1
        for imported in targets:
            target = _part(imported) or "(root)"
            if target != source:
                by_part[source][target] += 1
    lines = []
    for part in sorted(modules, key=lambda p: (layers.get(p, -1), p)):
        uses = ", ".join(f"{t} ({n})" for t, n in sorted(by_part[part].items(), key=lambda kv: layers.get(kv[0], -1)))
        lines.append(f"[{layers.get(part, '?')}] {part} ({modules[part]} modules) -> {uses or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Prints the graph and any violations; returns 1 when there is one, else 0."""
    args = sys.argv[1:] if argv is None else argv
    package_dir = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "nemo_sspo"
    graph = import_graph(package_dir)
    print(render(graph))
    violations = check(graph)
    for v in violations:
        print(f"VIOLATION {v.importer} -> {v.imported or '?'}: {v.reason}")
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(violations)} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
