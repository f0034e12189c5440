"""Resumable training checkpoints: Megatron distributed checkpoints of the policy (and the SPPO
critic) with their optimizers, plus the data position, the RNG states and the step counter.

Layout under ``<output_dir>/checkpoints``::

    step_000004/
        policy/                 megatron.core.dist_checkpointing (torch_dist): model + optimizer
        critic/                 the same for the SPPO critic (loss=sppo only)
        rng/rank_00000.pt       per-rank RNG states (python, numpy, torch CPU and CUDA, Megatron tracker)
        config.yaml             the run's composed config (compared on resume: ``RESUME_KEYS``)
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

Resume check: a resumed run must have the checkpoint's model, parallel layout and world size, batch
shape, data stream and seed (``nemo_sspo.trainer.run_config.RESUME_KEYS``, compared with the
checkpoint's ``config.yaml``; every differing key is listed). An exact continuation needs them: the
RNG states are per rank, and the data-parallel size decides which responses share a mini-batch.

Data position: prompt sources are seeded streams whose state depends only on the number of
problems drawn so far (``RolloutSampler.problems_drawn``); resuming replays that many draws. Sampling
seeds derive from ``(trainer.seed, step, round, slot)`` (:mod:`nemo_sspo.trainer.sampling`), so with
the step counter restored the rollouts continue exactly. DCPO's per-prompt reward history (smooth
advantage standardisation) is part of :class:`TrainerState`, so the advantages continue exactly too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nemo_sspo.megatron.cpu_shims import cpu_device_context
from nemo_sspo.trainer.periodic_eval import BEST_DIR
from nemo_sspo.trainer.run_config import RUN_CONFIG_FILE, read_config, resume_mismatches, write_config

__all__ = [
    "CHECKPOINTS_DIR",
    "EARLIER_RUN_PREFIX",
    "LATEST_FILE",
    "RUN_OUTPUTS",
    "STATE_FILE",
    "TrainerState",
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
_RNG_DIR = "rng"
EARLIER_RUN_PREFIX = "earlier_run_"
"""``<output_dir>/earlier_run_<k>``: where ``trainer.resume=auto`` moves an earlier run that has no checkpoint."""
logger = logging.getLogger(__name__)

RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "reward_entropy.png", CHECKPOINTS_DIR, "hf_checkpoint",
               "hf_checkpoint_interrupted", BEST_DIR, "eval", RUN_CONFIG_FILE)
"""What a training run writes into ``trainer.output_dir`` (``trainer.overwrite_output_dir=true``
deletes these and nothing else)."""


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
        advantage_history: DCPO's per-prompt reward stats (``loss.params.smooth_advantages``), prompt
            key -> ``[visits, mean, std]``; None when the loss keeps none. JSON floats round-trip
            exactly, so a resumed run continues with the same stats.
    """

    step: int
    problems_drawn: int
    seed: int
    world_size: int
    best_eval_mean: float | None = None
    best_eval_step: int | None = None
    advantage_history: dict[str, list[float]] | None = None


def checkpoint_name(step: int) -> str:
    """``step_000004`` for step 4."""
    return f"step_{step:06d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- model / optimizer through dist_checkpointing ------------------------------------------------
def _sharded_state(model, optimizer, *, is_loading: bool) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` sharded state dicts of a DDP-wrapped model chunk."""
    model_state = model.module.sharded_state_dict(prefix="")
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def _save_sharded(directory: Path, model, optimizer) -> None:
    from megatron.core import dist_checkpointing

    with cpu_device_context():
        dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(directory))


def _load_sharded(directory: Path, model, optimizer) -> None:
    from megatron.core import dist_checkpointing

    with cpu_device_context():
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(directory))
        model.module.load_state_dict(loaded["model"], strict=True)
        optimizer.load_state_dict(loaded["optimizer"])


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
                        extra: dict[str, Any] | None = None, *, stop_ids: list[int]) -> Path:
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
    write_model_folder(tmp, hf_config, state_dict, tokenizer, stop_ids=stop_ids, extra=extra)
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

    Raises:
        ValueError: an earlier run's ``metrics.jsonl`` is there and overwriting is off; names
            ``trainer.resume=auto`` first when a checkpoint exists.
    """
    out = Path(trainer_cfg.output_dir)
    earlier = out / "metrics.jsonl"
    held = earlier.is_file() and earlier.stat().st_size > 0
    has_checkpoint = (out / CHECKPOINTS_DIR / LATEST_FILE).is_file()  # what trainer.resume=auto continues
    if not held and not has_checkpoint:
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
    if is_writer:
        for name in RUN_OUTPUTS:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    return None


def save_checkpoint(root: str | Path, state: TrainerState, models: dict[str, tuple[Any, Any]], *,
                    config: dict[str, Any], keep: int = 0) -> Path:
    """Writes a checkpoint of step ``state.step`` atomically (module docstring). Collective: every
    rank calls it with its own model chunks.

    Args:
        root: the checkpoints folder (``<output_dir>/checkpoints``).
        state: the trainer state (written by rank 0, last).
        config: the run's composed config (``nemo_sspo.trainer.run_config.composed_config``), saved
            as ``config.yaml`` for the resume check.
        models: name -> ``(DDP-wrapped model chunk, Megatron optimizer)``, e.g. ``{"policy": ...,
            "critic": ...}``; each gets its own dist_checkpointing sub-folder.
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
    for key, (model, optimizer) in models.items():
        _save_sharded(tmp / key, model, optimizer)
    torch.save(_rng_state(), _rng_file(tmp, _rank()))
    _barrier()
    if _rank() == 0:
        write_config(tmp, config)
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


def load_checkpoint(path: str | Path, models: dict[str, tuple[Any, Any]], *, config: dict[str, Any]) -> TrainerState:
    """Restores the models, optimizers and this rank's RNG states from ``path``. Collective.

    Args:
        path: a complete checkpoint folder (:func:`resolve_resume`).
        models: as for :func:`save_checkpoint`, built with the checkpoint's architecture.
        config: this run's composed config; its ``RESUME_KEYS`` (model, layout, batch shape, data,
            seed) must equal the checkpoint's, and the world size the checkpoint's.

    Returns:
        The saved :class:`TrainerState`.

    Raises:
        ValueError: listing every key that differs from the checkpoint's config (a checkpoint
            without ``config.yaml``, written by an earlier version, is checked on the seed only), a
            different world size, or a model without a folder in it.
    """
    path = Path(path)
    state = TrainerState(**json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
    saved = read_config(path)
    if saved is None:
        saved = {"trainer": {"seed": state.seed}}
        config = {"trainer": {"seed": config["trainer"]["seed"]}}
    differ = resume_mismatches(saved, config)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != state.world_size:
        differ.append(f"world size (processes): checkpoint {state.world_size}, now {world_size}")
    if differ:
        raise ValueError(f"trainer.resume: checkpoint {path} was written by a run with another config:\n  "
                         + "\n  ".join(differ) + f"\nresume with the settings in {path / RUN_CONFIG_FILE} (only "
                         "those keys must match), or start a new run in another trainer.output_dir")
    for key, (model, optimizer) in models.items():
        if not (path / key).is_dir():
            raise ValueError(f"checkpoint {path} has no {key!r} state; was it written with another loss config?")
        _load_sharded(path / key, model, optimizer)
    _set_rng_state(torch.load(_rng_file(path, _rank()), weights_only=False))
    return state
