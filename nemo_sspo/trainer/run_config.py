"""The composed config saved with a run, and the comparison a resume must pass.

``<output_dir>/config.yaml`` is the composed config of the run (every key, defaults included, as
``nemo-sspo train --print-config`` prints it); each checkpoint holds a copy, so a resume from any
folder is compared with the run that wrote it (:func:`resume_mismatches`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_sspo.trainer.config import upgrade_saved_config

__all__ = [
    "RESUME_KEYS",
    "RESUME_MAY_CHANGE",
    "RUN_CONFIG_FILE",
    "composed_config",
    "data_parallel_size",
    "read_config",
    "resume_changes",
    "resume_mismatches",
    "write_config",
]

RUN_CONFIG_FILE = "config.yaml"
"""The composed config, in ``trainer.output_dir`` and in every checkpoint folder."""

RESUME_KEYS = (
    "model.source", "model.precision", "model.fp8", "model.fp8_recipe", "model.transformer_impl",
    "model.lora.rank", "model.lora.alpha", "model.lora.target",
    "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
    "parallel.expert_model_parallel_size", "parallel.context_parallel_size", "rollout.schedule.placement",
    "rollout.schedule.num_ranks", "rollout.prompts_per_step", "rollout.samples_per_prompt",
    "rollout.sampling.max_new_tokens",
    "trainer.minibatches_per_step", "trainer.seed", "data", "loss.name", "optim.use_distributed_optimizer",
    # the reward that scores the rollouts, as the loss that trains on them (issue 32)
    "reward.name", "reward.options", "reward.overlong_buffer_len", "reward.overlong_penalty",
)
"""Config keys (a section name covers all of its keys) that a resumed run must share with the
checkpoint: the weights' model, adapters and layout (TP, PP, EP and which ranks train), the batch shape, the
data stream, the seed, the loss and the reward. Others may change on resume: ``trainer.max_steps``
(run longer), micro-batch sizes and token budgets (memory), output and logging settings, learning
rate and loss parameters, the reward's workers and timeout (:data:`RESUME_MAY_CHANGE`); such changes
are listed on resume (:func:`resume_changes`) and sent to the trackers."""

RESUME_MAY_CHANGE = ("reward.options.num_workers", "reward.options.timeout_s")
"""Keys under :data:`RESUME_KEYS` that a resume may change all the same: math_verify's scoring processes
and per-answer deadline (:class:`~nemo_sspo.rewards.MathVerifyOptions`), settings of the run rather than
of the reward's rule, which a resume could change before they moved into ``reward.options`` (a plugin
reward's options of these names are treated alike)."""


def composed_config(cfg: Any) -> dict[str, Any]:
    """The typed config as plain nested dicts and lists (what ``--print-config`` prints; a
    :class:`~nemo_sspo.choice.Choice` as its plain name, as a ``config.yaml`` reads back).
    """
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def write_config(folder: str | Path, config: dict[str, Any]) -> Path:
    """Writes ``config`` as ``folder/config.yaml``; returns the path."""
    from omegaconf import OmegaConf

    path = Path(folder) / RUN_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(config)), encoding="utf-8")
    return path


def read_config(folder: str | Path) -> dict[str, Any] | None:
    """``folder/config.yaml`` as nested dicts in today's layout (an earlier release's keys translated:
    :func:`~nemo_sspo.trainer.config.upgrade_saved_config`), or None when the folder has none (a
    checkpoint written before configs were saved).
    """
    from omegaconf import OmegaConf

    path = Path(folder) / RUN_CONFIG_FILE
    return upgrade_saved_config(OmegaConf.to_container(OmegaConf.load(path))) if path.is_file() else None


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def resume_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The :data:`RESUME_KEYS` whose values differ, as ``"key: checkpoint <a>, now <b>"`` lines
    (keys in order; a key present on one side only counts as different).

    Args:
        saved: the checkpoint's composed config (:func:`read_config`).
        current: this run's (:func:`composed_config`).
    """
    old, new = _flatten(saved), _flatten(current)
    missing = object()
    return [f"{key}: checkpoint {old.get(key, '(absent)')!r}, now {new.get(key, '(absent)')!r}"
            for key in sorted(set(old) | set(new))
            if _must_match(key) and old.get(key, missing) != new.get(key, missing)]


def _must_match(key: str) -> bool:
    return key not in RESUME_MAY_CHANGE and any(key == name or key.startswith(f"{name}.") for name in RESUME_KEYS)


def data_parallel_size(config: dict[str, Any], world_size: int) -> int | None:
    """The data-parallel size of a composed config launched on ``world_size`` processes.

    ``(world_size - R) / (TP x PP)``, where ``R`` is ``rollout.schedule.num_ranks`` with
    ``rollout.schedule.placement=separate`` (those ranks generate, the rest train) and 0 otherwise; EP
    is carved out of the data-parallel ranks and does not change it.

    Args:
        config: a composed config (:func:`composed_config` or :func:`read_config`).
        world_size: processes of the run.

    Returns:
        The size, or None when the config lacks the parallel keys or the division is not exact.
    """
    parallel, schedule = config.get("parallel") or {}, (config.get("rollout") or {}).get("schedule") or {}
    model = parallel.get("tensor_model_parallel_size", 1) * parallel.get("pipeline_model_parallel_size", 1)
    trainers = world_size - (schedule.get("num_ranks", 0) if schedule.get("placement") == "separate" else 0)
    if not parallel or trainers <= 0 or trainers % model:
        return None
    return trainers // model


_NOT_A_CHANGE = ("trainer.resume",)  # how this launch was asked to continue, not a setting of the run


def resume_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings a resumed run changed that a resume allows (every key outside
    :data:`RESUME_KEYS` and ``trainer.resume``), as ``{dotted key: (checkpoint value, value now)}``
    in key order (a key present on one side only has ``None`` on the other).

    Args:
        saved: the checkpoint's composed config (:func:`read_config`).
        current: this run's (:func:`composed_config`).
    """
    old, new = _flatten(saved), _flatten(current)
    return {key: (old.get(key), new.get(key)) for key in sorted(set(old) | set(new))
            if not _must_match(key) and key not in _NOT_A_CHANGE and old.get(key) != new.get(key)}
