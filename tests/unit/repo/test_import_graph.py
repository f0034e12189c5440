"""tools/import_graph.py: the package has no upward import, and the checker finds one when there is."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _tool()


def test_package_has_no_upward_import(tool, capsys):
    assert tool.main([str(ROOT / "nemo_sspo")]) == 0
    out = capsys.readouterr().out
    assert "0 violations" in out and "[0] metrics" in out and "[1] algorithms" in out and "[8] cli" in out
    graph = tool.import_graph(ROOT / "nemo_sspo")
    # The batch type sits at the bottom and megatron/ imports it from there.
    assert "nemo_sspo.algorithms.batch" in graph["nemo_sspo.megatron.step"]


def _write(base: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = base / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base / "pkg"


def test_checker_reports_the_one_upward_import(tool, tmp_path, capsys):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "algorithms/__init__.py": "",
        "algorithms/maths.py": "def f():\n    from pkg.trainer.loop import run  # lazy, still counted\n",
        "trainer/__init__.py": "",
        "trainer/loop.py": "from pkg.algorithms import maths\nfrom ..algorithms.maths import f\n\ndef run():\n    pass\n",
        "integrations/__init__.py": "",
        "integrations/host.py": "from pkg.algorithms import maths\n",
    })
    graph = tool.import_graph(pkg)
    assert graph["pkg.trainer.loop"] == {"pkg.algorithms", "pkg.algorithms.maths"}  # relative import resolved
    violations = tool.check(graph)
    assert [(v.importer, v.imported) for v in violations] == [("pkg.algorithms.maths", "pkg.trainer.loop")]
    assert "upward: algorithms (layer 1) imports trainer (layer 7)" in violations[0].reason
    assert tool.main([str(pkg)]) == 1
    assert "VIOLATION pkg.algorithms.maths -> pkg.trainer.loop" in capsys.readouterr().out


def test_checker_restricts_integrations_and_unplaced_packages(tool, tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "data/__init__.py": "",
        "integrations/__init__.py": "",
        "integrations/host.py": "import pkg.data\n",  # same rank as nothing it may use: not allowed
        "extras/__init__.py": "",
    })
    reasons = {(v.importer, v.reason.split(":")[0]) for v in tool.check(tool.import_graph(pkg))}
    assert reasons == {("pkg.integrations.host", "integrations may import only algorithms, integrations, megatron, "
                                                 "metrics, parallel"),
                       ("pkg.extras", "'extras' is in no layer")}
