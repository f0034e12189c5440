"""Layers below the trainer raise about their own argument names; the config layer adds the YAML key
once (``nemo_sspo.trainer.config.at_key``, or its own checks in ``validate``). A string literal
(docstrings aside) in those layers that spells a config key path such as ``rollout.sampling.top_p`` is a
hard-coded YAML key: wrong as soon as another caller (an adapter, a second config key such as
``critic.source`` beside ``model.source``) uses the function."""

import ast
import re
from pathlib import Path

from tests.unit.repo.test_docs import _config_key_exists

ROOT = Path(__file__).resolve().parents[3]
LOWER_LAYERS = ("metrics", "algorithms", "parallel", "megatron", "models", "data", "rewards", "rollout", "evaluation")
_KEY = re.compile(r"\b((?:model|parallel|data|rollout|reward|optim|loss|trainer|eval|critic|advantage)\.[a-z_]+(?:\.[a-z_]+)*)")
# Files still holding YAML keys, with how many lines do: the micro-batch, model-build, packing and
# vLLM modules (work in flight elsewhere) and the eval command's own config reader. The count may
# only go down; a file not listed may hold none.
PENDING = {
    "nemo_sspo/algorithms/micro_batches.py": 1,
    "nemo_sspo/megatron/model.py": 6,
    "nemo_sspo/megatron/packed_seq.py": 1,
    "nemo_sspo/rollout/vllm_engine.py": 3,
    "nemo_sspo/evaluation/run.py": 2,
}


def _docstring_ids(tree: ast.AST) -> set[int]:
    """Docstrings: a body's first string statement, and a string statement right after an assignment
    (an attribute's docstring, as Sphinx reads it)."""
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    ids = set()
    for node in ast.walk(tree):
        if not isinstance(node, nodes):
            continue
        for i, stmt in enumerate(node.body):
            documents = i == 0 or isinstance(node.body[i - 1], (ast.Assign, ast.AnnAssign))
            if documents and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                ids.add(id(stmt.value))
    return ids


def yaml_key_literals(path: Path) -> list[tuple[int, str]]:
    """``(line, key)`` of every string literal outside docstrings that spells a config key path."""
    tree = ast.parse(path.read_text())
    docs = _docstring_ids(tree)
    return [(node.lineno, match.group(1)) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            for match in _KEY.finditer(node.value) if _config_key_exists(match.group(1))]


def test_lower_layers_spell_no_yaml_keys():
    found = {}
    for layer in LOWER_LAYERS:
        for path in sorted((ROOT / "nemo_sspo" / layer).rglob("*.py")):
            lines = {line for line, _ in yaml_key_literals(path)}
            if lines:
                found[str(path.relative_to(ROOT))] = len(lines)
    grown = {f: n for f, n in found.items() if n > PENDING.get(f, 0)}
    assert not grown, (f"YAML keys in layers below the trainer: {grown}; raise about the function's own "
                       "argument and let the config layer add the key (nemo_sspo.trainer.config.at_key)")
    assert found == {f: n for f, n in PENDING.items() if f in found}, f"update PENDING: {found}"


def test_the_scanner_finds_a_key_and_skips_docstrings(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Docs may name rollout.sampling.top_p."""\n\n\ndef f(cap):\n'
                      '    """And here: rollout.sampling.top_p."""\n'
                      '    raise ValueError(f"rollout.sampling.top_p={cap} must be >= 1; trainer.nope is not a key")\n'
                      'TABLE = {}\n"""An attribute docstring may name rollout.sampling.top_p."""\n'
                      '"rollout.sampling.top_p"  # a bare string that documents nothing is a literal\n')
    assert sorted(yaml_key_literals(module)) == [(6, "rollout.sampling.top_p"), (9, "rollout.sampling.top_p")]
