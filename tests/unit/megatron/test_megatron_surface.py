"""The one list of megatron-core names (nemo_sspo/megatron/surface.py) is the set the package uses:
found here by scanning every module's imports and its reads of imported megatron-core modules."""

import ast
from pathlib import Path

import nemo_sspo
from nemo_sspo.megatron.surface import MEGATRON_SURFACE

PACKAGE = Path(nemo_sspo.__file__).parent


def _used_names() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {}  # local name -> dotted megatron-core module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    used.setdefault(name, set()).add(path.name)
                    if alias.name[0].islower():  # a module (a function's attributes would count too)
                        modules[alias.asname or alias.name] = name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("megatron.core"):
                        used.setdefault(alias.name, set()).add(path.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                used.setdefault(f"{modules[node.value.id]}.{node.attr}", set()).add(path.name)
    return used


def test_the_surface_lists_exactly_the_names_the_package_touches():
    used = _used_names()
    unlisted = {name: sorted(files) for name, files in used.items() if name not in MEGATRON_SURFACE}
    unused = sorted(set(MEGATRON_SURFACE) - set(used))
    assert unlisted == {}, "add these to nemo_sspo/megatron/surface.py"
    assert unused == [], "these are listed but no module uses them"


def test_only_the_cpu_shims_touch_megatron_internals():
    used = _used_names()
    internal = {name: files for name, files in used.items() if name.rsplit(".", 1)[1].startswith("_")}
    assert internal and all(files == {"cpu_shims.py"} for files in internal.values()), internal
