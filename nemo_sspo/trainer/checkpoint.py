"""Resumable training checkpoints: Megatron distributed checkpoints of the policy (and the SPPO
critic) with their optimizers, plus the data position, the RNG states and the step counter.

Layout under ``<output_dir>/checkpoints``::

    step_000004/
        policy/                 megatron.core.dist_checkpointing (torch_dist): model + optimizer
        critic/                 the same for the SPPO critic (loss=sppo only)
        rng/rank_00000.pt       per-rank RNG states (python, numpy, torch CPU and CUDA, Megatron tracker)
        config.yaml             the run's composed config (compared on resume: ``RESUME_KEYS``)
        files.json              every file above with its size in bytes (checked on resume)
        trainer_state.json      :class:`TrainerState`, written last
    latest                      the name of the newest complete checkpoint ("step_000004")

Model and optimizer go through Megatron's distributed checkpointing (``sharded_state_dict`` of the
model and ``optimizer.sharded_state_dict(model_sharded_state_dict)``): every tensor is saved once
(its main replica) with its global offsets (so the format itself could be read under another TP/PP
layout; a resume refuses one all the same, see below).
Measured with megatron-core 0.16.1: it works on CPU/gloo (TP=2 tested) and on CUDA (BF16 with the
mixed-precision optimizer, one H200), with three properties of its writer (``FileSystemWriterAsync``):
the first save of a process starts a multiprocessing Manager, a *spawned* helper process that
re-imports the launching script as ``__mp_main__`` (so that script needs an ``if __name__ ==
"__main__"`` guard, and its top-level imports are paid again: ~4-6 s on 2 busy cores, later saves
~0.5 s for the tiny model); each save forks writer processes, so the training processes must not be
daemonic (torchrun and ``mp.spawn`` workers are fine; ``multiprocessing`` daemons, as in
``tests/distributed/conftest.py``, are not).

Atomicity: every rank writes into ``.step_000004.tmp``; after a barrier rank 0 writes
``trainer_state.json`` into it, renames it to ``step_000004`` and only then replaces ``latest``
(write a temporary file, fsync, ``os.replace``). A save killed at any point therefore leaves
``latest`` naming the previous complete checkpoint; a stale ``.tmp`` folder is removed by the next
save. (Assumes a shared filesystem with atomic rename, as dist_checkpointing does.)

Damage after the save (a copy cut short, a full disk during ``rsync``, a file truncated by hand) is
found before anything is loaded: ``files.json`` lists every file with its size, and a missing or
resized file (or an unreadable ``trainer_state.json`` or RNG file) refuses the resume naming the
file and the previous complete checkpoint, which is used only when the user passes it as
``trainer.resume`` (docs/pitfalls.md#damaged-checkpoint).

Resume check: a resumed run must have the checkpoint's model, parallel layout and world size, batch
shape, data stream and seed (``nemo_sspo.trainer.run_config.RESUME_KEYS``, compared with the
checkpoint's ``config.yaml``; every differing key is listed). An exact continuation needs them: the
RNG states are per rank, and the data-parallel size decides which responses share a mini-batch.

Data position: prompt sources are seeded streams whose state depends only on the number of
problems drawn so far (``RolloutSampler.problems_drawn``); resuming replays that many draws. Sampling
seeds derive from ``(trainer.seed, step, round, slot)`` (:mod:`nemo_sspo.rollouts.sampling`), so with
the step counter restored the rollouts continue exactly. Free-running rollout ranks each draw from a
shard of the stream at their own pace, so their checkpoint keeps a position per rollout rank
(:attr:`TrainerState.rollout_positions`). DCPO's per-prompt reward history (smooth
advantage standardisation) is part of :class:`TrainerState`, so the advantages continue exactly too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nemo_sspo.megatron.cpu_shims import cpu_device_context
from nemo_sspo.parallel.weight_checksum import tensor_checksum, tensors_checksums
from nemo_sspo.trainer.periodic_eval import BEST_DIR
from nemo_sspo.trainer.rollout_log import ROLLOUT_LOG_DIR
from nemo_sspo.trainer.run_config import (
    RUN_CONFIG_FILE,
    data_parallel_size,
    read_config,
    resume_mismatches,
    write_config,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "EARLIER_RUN_PREFIX",
    "LATEST_FILE",
    "INTERRUPTED_DIR",
    "RUN_OUTPUTS",
    "STATE_FILE",
    "TrainerState",
    "base_checksum",
    "checkpoint_name",
    "load_checkpoint",
    "prepare_output_dir",
    "resolve_resume",
    "save_checkpoint",
    "write_hf_checkpoint",
]

CHECKPOINTS_DIR = "checkpoints"
"""Sub-folder of ``trainer.output_dir`` holding the checkpoints and ``latest``."""
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "files.json"
"""In each checkpoint folder: ``{relative path: size in bytes}`` of every file of the checkpoint."""
_RNG_DIR = "rng"
EARLIER_RUN_PREFIX = "earlier_run_"
"""``<output_dir>/earlier_run_<k>``: where ``trainer.resume=auto`` moves an earlier run that has no checkpoint."""
logger = logging.getLogger(__name__)

INTERRUPTED_DIR = "hf_checkpoint_interrupted"
"""``<output_dir>/hf_checkpoint_interrupted``: the policy of a run that stopped early (removed when a run in
that folder finishes)."""

_MODEL_FOLDERS = ("hf_checkpoint", INTERRUPTED_DIR, BEST_DIR)
RUN_OUTPUTS = ("metrics.jsonl", ROLLOUT_LOG_DIR, "tensorboard", "reward_entropy.png", CHECKPOINTS_DIR, *_MODEL_FOLDERS,
               "eval",
               RUN_CONFIG_FILE, "throughput_summary.json", "timeline.jsonl", "timeline.png", "trackers.json",
               "wandb", "mlflow.db", "mlflow.db-journal", "mlflow.db-wal", "mlflow.db-shm", "mlflow_artifacts",
               *(f".{name}.{kind}" for name in _MODEL_FOLDERS for kind in ("tmp", "old")))
"""What a training run writes into ``trainer.output_dir``: its files, the trackers' local runs (the W&B
offline folders, the local MLflow store and artifacts, ``trackers.json``) and the temporary siblings
of a model folder whose write was killed (``trainer.overwrite_output_dir=true`` deletes these and
nothing else; a W&B or MLflow run on a server is left there)."""


@dataclass
class TrainerState:
    """What the loop needs besides the weights to continue a run.

    Attributes:
        step: the last completed step (the resumed run starts at ``step + 1``).
        problems_drawn: prompts drawn from the prompt source so far (the data position).
        seed: ``trainer.seed`` of the run (a resumed run must use the same).
        world_size: processes that wrote the RNG files.
        best_eval_mean: best ``eval/mean`` so far (None before the first evaluation).
        best_eval_step: the step that reached it.
        advantage_history: the per-prompt reward stats of a history-keeping estimator
            (``advantage.name=dcpo_smooth``), prompt key -> ``[visits, mean, std]``; None when the
            estimator keeps none. JSON floats round-trip
            exactly, so a resumed run continues with the same stats.
        rollout_positions: free-running: each rollout rank's ``[rollouts received, problems drawn]``
            (``nemo_sspo.rollouts.records.RolloutPosition``); None for the other modes.
        base_checksum: LoRA (``model.lora.rank >= 1``): :func:`base_checksum` of the frozen weights
            the adapters were trained on, which the checkpoint does not hold; None otherwise.
    """

    step: int
    problems_drawn: int
    seed: int
    world_size: int
    best_eval_mean: float | None = None
    best_eval_step: int | None = None
    advantage_history: dict[str, list[float]] | None = None
    rollout_positions: list[list[int]] | None = None
    base_checksum: list[int] | None = None


def base_checksum(state_dict: dict[str, torch.Tensor]) -> list[int]:
    """One exact checksum of a whole set of weights (``model.source``'s HF state dict, in its key order):
    the :func:`~nemo_sspo.parallel.weight_checksum.tensor_checksum` of the ``[n, 2]`` per-tensor
    checksums, so a changed element and two tensors swapped both change it. Ours.
    """
    return [int(v) for v in tensor_checksum(tensors_checksums({k: t.cpu() for k, t in state_dict.items()}))]


def checkpoint_name(step: int) -> str:
    """``step_000004`` for step 4."""
    return f"step_{step:06d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- model / optimizer through dist_checkpointing ------------------------------------------------
def _trained_entries(module) -> dict[str, Any]:
    """``module``'s sharded state dict without its frozen parameters (LoRA's base weights, which come
    from ``model.source`` and are checked by :func:`base_checksum` instead of being copied).
    """
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}
    return {key: entry for key, entry in module.sharded_state_dict(prefix="").items()
            if id(getattr(entry, "data", None)) not in frozen}


def _sharded_state(model, optimizer, lr_scheduler, *, is_loading: bool) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ..., "lr_scheduler": ...}`` state of a DDP-wrapped model chunk:
    sharded model and optimizer state dicts (the distributed optimizer's states sharded over the
    data-parallel ranks), and the learning-rate schedule's plain dict (common state, kept once).
    """
    model_state = _trained_entries(model.module)
    # The distributed optimizer's default format (fully_sharded_model_space) fails its own integrity
    # check in megatron-core 0.16.1; dp_reshardable is the format it recommends (plain optimizers ignore it).
    state = {"model": model_state, "optimizer": optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    return state


def _save_sharded(directory: Path, model, optimizer, lr_scheduler) -> None:
    from megatron.core import dist_checkpointing

    with cpu_device_context():
        dist_checkpointing.save(_sharded_state(model, optimizer, lr_scheduler, is_loading=False), str(directory))


def _distributed_optimizers(optimizer) -> list:
    """The megatron-core ``DistributedOptimizer`` instances in ``optimizer`` (itself, or inside a chain)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [inner for inner in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(inner, DistributedOptimizer)]


def _create_distributed_optimizer_states(optimizer) -> None:
    """Gives a fresh distributed optimizer its Adam states before a load fills them in place.

    torch's Adam (megatron-core's optimizer without TransformerEngine or Apex, e.g. on CPU) creates
    its states at the first step, and megatron-core 0.16.1's distributed optimizer needs them (with
    their step counter) to describe what it loads; megatron-core's own dummy step creates them
    (zero gradients; every value it writes is then replaced by the checkpoint's).
    """
    for inner in _distributed_optimizers(optimizer):
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """Gives every parameter's Adam state its own step counter, the checkpoint's, after a
    distributed-optimizer load.

    Without TransformerEngine or Apex (torch's Adam, e.g. on CPU), megatron-core 0.16.1's
    ``DistributedOptimizer.load_state_dict`` first puts the checkpoint's update count (kept in each
    param group as ``step``) into every parameter's state as one shared tensor, then, loading the
    ``dp_reshardable`` buckets, copies into it the step of the state the load started from (the
    bucket entry for ``step`` is the pre-load tensor, not saved): the count went back to 1, the
    dummy step's, and the bias correction of every resumed update was wrong (measured: step-3
    ratios about 1e-5 off the uninterrupted run). torch's Adam also increments each state's counter
    in place, so a shared one would advance once per parameter per update.
    """
    for inner in _distributed_optimizers(optimizer):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state.get(param, {})
                if "step" in group and torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def _group_settings(optimizer) -> list[dict[str, Any]]:
    """This run's settings of each optimizer param group: everything but its parameters and Adam's
    update count (``step``), e.g. the schedule's bounds ``max_lr`` / ``min_lr``, ``betas``, ``eps``.
    """
    return [{key: value for key, value in group.items() if key not in ("params", "step")}
            for group in optimizer.param_groups]


def _load_sharded(directory: Path, model, optimizer, lr_scheduler) -> None:
    """Loads one model's checkpoint folder into ``model``, ``optimizer`` and ``lr_scheduler``.

    The checkpoint gives the weights, the optimizer's states and update counts, and the schedule's
    position; the settings stay this run's (an allowed change of ``optim.lr``, ``optim.min_lr`` or the
    schedule's shape takes effect from the next update). The optimizer's ``load_state_dict`` puts the
    checkpoint's param groups back, ``max_lr`` / ``min_lr`` included, and megatron-core's scheduler
    reads a group's bounds before its own: without restoring this run's group settings, a resume at
    another ``optim.lr`` ran at the checkpoint's rates (measured: steps 3-4 of a cosine run resumed at
    2e-3 ran at the 1e-3 run's rates).
    """
    from megatron.core import dist_checkpointing

    settings = _group_settings(optimizer)
    with cpu_device_context():
        _create_distributed_optimizer_states(optimizer)
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, lr_scheduler, is_loading=True),
                                         str(directory))
        missing, unexpected = model.module.load_state_dict(loaded["model"], strict=False)
        frozen = {name for name, p in model.module.named_parameters() if not p.requires_grad}
        if unexpected or set(missing) - frozen - {k for k in missing if k.endswith("_extra_state")}:
            raise ValueError(f"checkpoint {directory} does not fit the model: missing {sorted(set(missing) - frozen)}, "
                             f"unexpected {sorted(unexpected)}")
        with torch.no_grad():  # an fp32 model's distributed-optimizer shards are views of its parameters
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    if lr_scheduler is not None:  # the update count; this run's schedule settings stay (override)
        lr_scheduler.load_state_dict(loaded["lr_scheduler"])


# ---- RNG ------------------------------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "megatron_tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / _RNG_DIR / f"rank_{rank:05d}.pt"


# ---- publishing -----------------------------------------------------------------------------------
def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _publish(tmp: Path, final: Path) -> None:
    """Renames the complete ``tmp`` folder to ``final`` (replacing an older folder of that name)."""
    if final.exists():
        stale = final.with_name(f".{final.name}.old")
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        tmp.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        tmp.rename(final)


def _prune(root: Path, keep: int, latest: str) -> None:
    """Keeps ``latest`` and the ``keep - 1`` newest checkpoints before it; keep 0 deletes nothing.

    Folders of later steps (left by a killed run that had not yet moved ``latest``) are not touched:
    the resumed run replaces them when it reaches those steps.
    """
    if keep <= 0:
        return
    older = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name < latest)
    for old in older[: max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def write_hf_checkpoint(path: str | Path, hf_config, state_dict: dict[str, torch.Tensor], tokenizer,
                        extra: dict[str, Any] | None = None, *, stop_ids: list[int], adapter=None) -> Path:
    """Writes a Hugging Face model folder (``nemo_sspo.models.hf_folder.write_model_folder``) atomically:
    into a temporary sibling folder, then a rename that replaces an older ``path``. Not collective:
    call it on one rank.

    Args:
        path: the final folder (``output_dir/hf_checkpoint``, ``best``, ``hf_checkpoint_interrupted``).
        hf_config: the model's config (written cleaned, with the tensors' dtype).
        state_dict: HF names -> tensors on any device (as ``export_hf_state_dict``; a tied head is dropped).
        tokenizer: saved with the weights.
        extra: ``name -> JSON value`` files written as ``<name>.json`` (e.g. ``best.json``).
        stop_ids: the model's stop list (the trainer's, from the source's tokenizer and generation config).
        adapter: LoRA: the :class:`~nemo_sspo.models.hf_folder.PeftAdapter` written as ``path/adapter``.

    Returns:
        ``path``, loadable by ``nemo_sspo.models.load_hf_checkpoint``, ``transformers`` and vLLM.

    Raises:
        ValueError: ``stop_ids`` is empty.
    """
    from nemo_sspo.models.hf_folder import write_model_folder

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_model_folder(tmp, hf_config, state_dict, tokenizer, stop_ids=stop_ids, extra=extra, adapter=adapter)
    _publish(tmp, path)
    return path


def _earlier_run_dir(out: Path) -> Path:
    """The first free ``<out>/earlier_run_<k>`` (k = 1, 2, ...)."""
    k = 1
    while (out / f"{EARLIER_RUN_PREFIX}{k}").exists():
        k += 1
    return out / f"{EARLIER_RUN_PREFIX}{k}"


def prepare_output_dir(trainer_cfg: Any, *, is_writer: bool) -> Path | None:
    """Before a run that does not resume: refuses a folder holding an earlier run unless
    ``trainer.overwrite_output_dir``, which deletes that run's outputs (:data:`RUN_OUTPUTS`: its
    checkpoints too, so a later ``trainer.resume=auto`` cannot continue the old weights).

    With ``trainer.resume=auto`` an earlier run that left metrics but no checkpoint (a job stopped
    or requeued before its first ``trainer.checkpoint_interval``) is not an error: the run starts
    fresh, as the same command would on an empty folder, after rank 0 moves that run's outputs
    into ``<output_dir>/earlier_run_<k>/`` (the first free k) and logs one line saying so.

    Args:
        trainer_cfg: the ``trainer`` section (``output_dir``, ``overwrite_output_dir``, ``resume``).
        is_writer: this rank deletes or moves (rank 0; the others only check).

    Returns:
        The folder the earlier run's outputs were moved to (on the writing rank), else None.

    Only a folder that holds a run of ours (:func:`_run_folder_of_ours`: a composed ``config.yaml``)
    is cleared; leftovers of a run that stopped before its first step are cleared too.

    Raises:
        ValueError: an earlier run's ``metrics.jsonl`` is there and overwriting is off; names
            ``trainer.resume=auto`` first when a checkpoint exists. With overwriting on: the folder
            holds an earlier run's files but does not look like a run folder of ours (no composed
            ``config.yaml``, or the home or root folder); names the folder and what it holds.
    """
    out = Path(trainer_cfg.output_dir)
    earlier = out / "metrics.jsonl"
    held = earlier.is_file() and earlier.stat().st_size > 0
    has_checkpoint = (out / CHECKPOINTS_DIR / LATEST_FILE).is_file()  # what trainer.resume=auto continues
    if not held and not has_checkpoint:
        if trainer_cfg.overwrite_output_dir and is_writer and _run_folder_of_ours(out):
            _delete_run_outputs(out)  # a run stopped before its first step: its config, tracker runs
        return None
    if getattr(trainer_cfg, "resume", None) == "auto" and not has_checkpoint and not trainer_cfg.overwrite_output_dir:
        if not is_writer:
            return None
        aside = _earlier_run_dir(out)
        aside.mkdir()
        moved = [name for name in RUN_OUTPUTS if (out / name).exists()]
        for name in moved:
            os.replace(out / name, aside / name)
        steps = sum(1 for line in (aside / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip())
        logger.warning("trainer.resume=auto: %s holds an earlier run without a checkpoint (%d step(s) in "
                       "metrics.jsonl); moved its outputs (%s) to %s and starting fresh", out, steps,
                       ", ".join(moved), aside)
        return aside
    if not trainer_cfg.overwrite_output_dir:
        where = f"trainer.output_dir={trainer_cfg.output_dir!r} holds an earlier run ({earlier if held else out / CHECKPOINTS_DIR})"
        if has_checkpoint:
            raise ValueError(f"{where}; continue it with trainer.resume=auto, start it over with "
                             "trainer.overwrite_output_dir=true (deletes its metrics and checkpoints), or choose "
                             "another trainer.output_dir")
        raise ValueError(f"{where} without a checkpoint to resume from; start it over with "
                         "trainer.overwrite_output_dir=true (deletes its metrics), or choose another "
                         "trainer.output_dir")
    if not _run_folder_of_ours(out):
        found = ", ".join(name for name in RUN_OUTPUTS if (out / name).exists())
        raise ValueError(f"trainer.overwrite_output_dir=true: trainer.output_dir={trainer_cfg.output_dir!r} does "
                         f"not look like a run folder of nemo_sspo (it holds {found} but no composed "
                         f"{RUN_CONFIG_FILE} of a run, or it is the home or root folder), so nothing was deleted; "
                         "choose a folder of its own for the run (e.g. outputs/<name>), or delete those files "
                         "yourself")
    if is_writer:
        _delete_run_outputs(out)
    return None


def _run_folder_of_ours(out: Path) -> bool:
    """True when ``out`` holds the composed ``config.yaml`` every run writes at its start (a mapping
    with ``model`` and ``trainer`` sections) and is neither the home folder nor a filesystem root.
    """
    resolved = out.expanduser().resolve()
    if resolved == Path.home().resolve() or resolved == Path(resolved.anchor):
        return False
    try:
        saved = read_config(out)
    except Exception:  # noqa: BLE001 - any unreadable config.yaml (YAML or OmegaConf error) is not ours
        return False
    return isinstance(saved, dict) and {"model", "trainer"} <= saved.keys()


def _delete_run_outputs(out: Path) -> None:
    for name in RUN_OUTPUTS:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def save_checkpoint(root: str | Path, state: TrainerState, models: dict[str, tuple[Any, Any]], *,
                    config: dict[str, Any], keep: int = 0) -> Path:
    """Writes a checkpoint of step ``state.step`` atomically (module docstring). Collective: every
    rank calls it with its own model chunks.

    Args:
        root: the checkpoints folder (``<output_dir>/checkpoints``).
        state: the trainer state (written by rank 0, last).
        config: the run's composed config (``nemo_sspo.trainer.run_config.composed_config``), saved
            as ``config.yaml`` for the resume check.
        models: name -> ``(DDP-wrapped model chunk, Megatron optimizer, learning-rate scheduler or
            None)``, e.g. ``{"policy": ..., "critic": ...}``; each gets its own dist_checkpointing
            sub-folder.
        keep: number of newest checkpoints kept after this one is published (0 = all).

    Returns:
        The published folder ``root/step_<N>``.
    """
    root = Path(root)
    name = checkpoint_name(state.step)
    tmp = root / f".{name}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / _RNG_DIR).mkdir(parents=True)
        for key in models:
            (tmp / key).mkdir()
    _barrier()
    for key, (model, optimizer, lr_scheduler) in models.items():
        _save_sharded(tmp / key, model, optimizer, lr_scheduler)
    torch.save(_rng_state(), _rng_file(tmp, _rank()))
    _barrier()
    if _rank() == 0:
        write_config(tmp, config)
        _write_manifest(tmp)
        _write_text_atomic(tmp / STATE_FILE, json.dumps(dataclasses.asdict(state), indent=1))
        _publish(tmp, root / name)
        _write_text_atomic(root / LATEST_FILE, name)
        _prune(root, keep, name)
    _barrier()
    return root / name


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint folder ``trainer.resume`` names, or None to start fresh.

    ``None`` -> None; ``"auto"`` -> ``<output_dir>/checkpoints/<latest>`` if ``latest`` exists, else
    None; a ``step_<N>`` folder (holding ``trainer_state.json``) -> itself; a checkpoints folder (holding
    ``latest``) -> the checkpoint it names.

    Raises:
        ValueError: a path that is neither, or a ``latest`` naming a missing folder.
    """
    if resume is None:
        return None
    if resume == "auto":
        root = Path(output_dir) / CHECKPOINTS_DIR
        if not (root / LATEST_FILE).is_file():
            return None
    else:
        root = Path(resume).expanduser()
        if (root / STATE_FILE).is_file():
            return root
        if not (root / LATEST_FILE).is_file():
            raise ValueError(f"trainer.resume={resume!r} is neither a checkpoint folder (with {STATE_FILE}) nor a "
                             f"checkpoints folder (with {LATEST_FILE}); use a path under <output_dir>/"
                             f"{CHECKPOINTS_DIR}, 'auto', or null")
    path = root / (root / LATEST_FILE).read_text(encoding="utf-8").strip()
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"trainer.resume={resume!r}: {root / LATEST_FILE} names {path.name}, which is not a "
                         "complete checkpoint; pass an older step_<N> folder explicitly")
    return path


def load_checkpoint(path: str | Path, models: dict[str, tuple[Any, Any]], *, config: dict[str, Any],
                    base: list[int] | None = None) -> TrainerState:
    """Restores the models, optimizers and this rank's RNG states from ``path``. Collective.

    Args:
        path: a complete checkpoint folder (:func:`resolve_resume`).
        models: as for :func:`save_checkpoint`, built with the checkpoint's architecture.
        config: this run's composed config; its ``RESUME_KEYS`` (model, layout, batch shape, data,
            seed) must equal the checkpoint's, and the world size the checkpoint's.
        base: LoRA: :func:`base_checksum` of this run's base weights, which must equal the
            checkpoint's (its adapters were trained on them); None without adapters.

    Returns:
        The saved :class:`TrainerState`.

    Raises:
        ValueError: a file missing, resized (``files.json``) or unreadable (the state and RNG
            files), naming it and the previous complete checkpoint; or listing every key that
            differs from the checkpoint's config (TP, PP and EP
            sizes and placement included; a checkpoint without ``config.yaml``, written by an
            earlier version, is checked on the seed only), a different world size or data-parallel
            size, or a model without a folder in it.
    """
    path = Path(path)
    _check_files(path)
    try:
        state = TrainerState(**json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
    except (ValueError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise _damaged(path, path / STATE_FILE, f"unreadable ({err})") from err
    saved = read_config(path)
    if saved is None:
        saved = {"trainer": {"seed": state.seed}}
        config = {"trainer": {"seed": config["trainer"]["seed"]}}
    differ = resume_mismatches(saved, config)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != state.world_size:
        differ.append(f"world size (processes): checkpoint {state.world_size}, now {world_size}")
    dp_then, dp_now = data_parallel_size(saved, state.world_size), data_parallel_size(config, world_size)
    if dp_then != dp_now and dp_then is not None and dp_now is not None:
        differ.append(f"data-parallel size: checkpoint {dp_then}, now {dp_now}")
    if base != state.base_checksum:
        differ.append(f"base weights under the adapters (model.source={config['model']['source']!r}): checksum "
                      f"{base} now, {state.base_checksum} in the checkpoint; its adapters were trained on other "
                      "weights (or the checkpoint has none, or this run trains no adapters)")
    if differ:
        raise ValueError(f"trainer.resume: checkpoint {path} was written by a run with another config:\n  "
                         + "\n  ".join(differ) + f"\nresume with the settings in {path / RUN_CONFIG_FILE} (only "
                         "those keys must match), or start a new run in another trainer.output_dir")
    for key, (model, optimizer, lr_scheduler) in models.items():
        if not (path / key).is_dir():
            raise ValueError(f"checkpoint {path} has no {key!r} state; was it written with another loss config?")
        _load_sharded(path / key, model, optimizer, lr_scheduler)
    try:
        rng = torch.load(_rng_file(path, _rank()), weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise _damaged(path, _rng_file(path, _rank()), f"unreadable ({err})") from err
    _set_rng_state(rng)
    return state


def _write_manifest(folder: Path) -> None:
    """Writes ``folder/files.json``: every file under ``folder`` (but itself and the state file) -> bytes."""
    sizes = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*"))
             if f.is_file() and f.name not in (MANIFEST_FILE, STATE_FILE)}
    _write_text_atomic(folder / MANIFEST_FILE, json.dumps(sizes, indent=1))


def _check_files(path: Path) -> None:
    """Refuses a checkpoint whose files differ from its ``files.json`` (none: an older checkpoint, not checked)."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return
    try:
        sizes = json.loads(manifest.read_text(encoding="utf-8"))
    except ValueError as err:
        raise _damaged(path, manifest, f"unreadable ({err})") from err
    for name, size in sizes.items():
        file = path / name
        if not file.is_file():
            raise _damaged(path, file, "missing")
        if file.stat().st_size != size:
            raise _damaged(path, file, f"{file.stat().st_size} bytes, written with {size} (truncated or changed)")


def _damaged(path: Path, file: Path, what: str) -> ValueError:
    """The refusal of a damaged checkpoint: names the file and the previous complete checkpoint."""
    older = sorted((p for p in path.parent.glob("step_*") if p.name < path.name and (p / STATE_FILE).is_file()),
                   reverse=True)
    fix = (f"resume from the previous checkpoint with trainer.resume={older[0]}" if older
           else "no earlier complete checkpoint is there: start over with trainer.overwrite_output_dir=true")
    return ValueError(f"trainer.resume: checkpoint {path} is damaged: {file} is {what}; restore the file from a "
                      f"copy, or {fix} (the steps after it are run again)")
