"""Command line: ``nemo-sspo train|eval|plan [--config-name NAME] [--config-dir DIR] [key=value ...]``
and ``nemo-sspo data prepare --out DIR``.

``train`` runs GRPO-family training; ``eval`` scores ``model.source`` by greedy Avg@1 on
``eval.benchmarks`` (e.g. ``nemo-sspo eval model=smollm2_135m data.template=qwen-math
eval.limit_per_benchmark=8 eval.data_dir=/path/to/data``); ``data prepare`` writes the paper's math
datasets into a folder from their public sources (:mod:`nemo_sspo.data.prepare`); ``plan`` prints the
memory plan of a training config per GPU and pipeline stage and exits 0 when it fits the GPU memory,
2 when it does not (:mod:`nemo_sspo.trainer.memory_plan`; ``WORLD_SIZE`` as for ``train``,
``trainer.gpu_memory_gib=80`` for a GPU that is not here).

Configs are Hydra YAML files under ``nemo_sspo/conf/`` (shipped inside the package) (default ``sspo_smollm2_cpu``) composed over the
structured schema of :mod:`nemo_sspo.trainer.config`; overrides use Hydra syntax
(``trainer.max_steps=2``, ``loss=grpo``, ``loss.params.gamma=2.2``, ``parallel=tp3``). Under
torchrun every rank runs the same command.
"""

from __future__ import annotations

import argparse
import re
import os
import sys
from pathlib import Path

__all__ = ["main", "launch_world_size", "load_config", "DEFAULT_CONFIG_DIR"]

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parent / "conf"
DEFAULT_CONFIG_NAME = "sspo_smollm2_cpu"


def launch_world_size() -> int:
    """Processes of this launch: torchrun's ``WORLD_SIZE``, else 1 (read before any process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_config(config_name: str = DEFAULT_CONFIG_NAME, overrides: list[str] | None = None,
                config_dir: str | Path = DEFAULT_CONFIG_DIR, *, command: str = "train", check_model: bool = False):
    """Composes a YAML config with overrides into a typed, validated :class:`TrainConfig`.

    Every check of the config runs here, before any process group, model or data exists
    (:func:`nemo_sspo.trainer.config.validate`), so a bad value fails in the first second.

    Args:
        config_name: the primary YAML file's name (without ``.yaml``) in ``config_dir``.
        overrides: Hydra overrides (``trainer.max_steps=2``, ``loss=grpo``, ``plugins=[my_loss.py]``).
        config_dir: the folder of the YAML files.
        command: ``train`` checks the parallel layout against :func:`launch_world_size`; ``eval``
            (one process, no Megatron model) does not read the layout.
        check_model: also check the layout against ``model.source``'s config.json
            (:func:`nemo_sspo.trainer.config.check_model_layout`; reads no weights, but the model must
            be at hand). The CLI sets it for every run.

    Raises:
        ValueError: an unknown key, a wrong type (with OmegaConf's reason), or a failed check, naming
            the key path.
        FileNotFoundError: ``model.source`` cannot be found (``check_model``).

    With ``check_model`` and ``command="train"``, the memory plan
    (:func:`nemo_sspo.trainer.memory_plan.plan_for_config`) is checked against the GPU memory
    (``trainer.gpu_memory_gib``, else the visible device's; no check without either, or with
    ``trainer.skip_memory_check``): a peak above it raises ``ValueError`` naming the largest term.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from nemo_sspo.trainer.config import (
        config_error,
        find_unknown_key,
        register_config_nodes,
        resolve_settings,
        schema,
        unknown_key_message,
        validate,
    )
    from nemo_sspo.trainer.plugins import load_entry_point_plugins, load_plugins

    overrides = list(overrides or [])
    installed = load_entry_point_plugins()
    load_plugins(_plugins_named(config_name, overrides, Path(config_dir)))
    register_config_nodes()

    def compose_raw(items: list[str]):
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
            return compose(config_name=config_name, overrides=items)

    def compose_typed(items: list[str]):
        raw = compose_raw(items)
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema()), raw))
        return OmegaConf.to_container(raw, resolve=True), typed

    world_size = launch_world_size() if command == "train" else None
    try:
        raw, cfg = compose_typed(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        problems = _unknown_choice_problems(err, lambda: compose_raw(overrides), world_size)
        if problems:
            raise ValueError(f"invalid config {config_name!r}: {config_error(problems)}") from err
        raise ValueError(_hydra_error_message(config_name, err, overrides, compose_typed)) from err
    if set(cfg.plugins) - set(_plugins_named(config_name, overrides, Path(config_dir))):
        # Named by a YAML further down the defaults list: import them, then compose again.
        load_plugins(cfg.plugins)
        register_config_nodes()
        raw, cfg = compose_typed(overrides)
    unknown = find_unknown_key(raw, cfg)
    if unknown:  # a key added with '+' that no field takes: Hydra keeps it, the dataclasses drop it
        raise ValueError(f"invalid config {config_name!r}: {unknown_key_message(unknown, cfg.loss.name)}")
    if cfg.entry_point_plugins and cfg.entry_point_plugins != installed:
        raise ValueError(f"entry_point_plugins={cfg.entry_point_plugins} is recorded from the installed "
                         f"packages, which now declare {installed}: remove the key (it is filled in) or "
                         "install the plugins the config names")
    cfg.entry_point_plugins = installed
    resolve_settings(cfg)
    validate(cfg, world_size=world_size)
    if check_model:
        from nemo_sspo.models import load_hf_config
        from nemo_sspo.trainer.config import check_model_layout

        if command == "train":  # what this host cannot run, refused before the model's config is read
            from nemo_sspo.trainer.device import check_host

            check_host(cfg)
        hf_config = load_hf_config(cfg.model.source, cache_dir=cfg.model.cache_dir)
        check_model_layout(cfg, hf_config, world_size)
        if command == "train" and not cfg.trainer.skip_memory_check:
            from nemo_sspo.trainer.memory_plan import check_memory_plan, gpu_memory_gib, plan_for_config

            if gpu_memory_gib(cfg) is not None:
                check_memory_plan(plan_for_config(cfg, world_size, hf_config))
    return cfg


def _plugins_named(config_name: str, overrides: list[str], config_dir: Path) -> list[str]:
    """The ``plugins`` of a ``plugins=...`` override, else of the primary YAML file, read before
    composing (a plugin may register the very loss the overrides select).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    for item in overrides:
        if item.split("=", 1)[0].lstrip("+") == "plugins":
            value = OverridesParser.create().parse_overrides([item])[0].value()
            return [value] if isinstance(value, str) else list(value or [])
    primary = config_dir / f"{config_name}.yaml"
    named = OmegaConf.load(primary).get("plugins") if primary.is_file() else None
    return list(named or [])


def _hydra_error_message(config_name: str, err: Exception, overrides: list[str], compose_typed) -> str:
    """Hydra's error, or, for an override of a key that does not exist, which key was meant (Hydra
    would suggest '+', which adds a key no dataclass field reads).
    """
    from nemo_sspo.trainer.config import unknown_key_message

    missing = re.search(r"Could not find 'loss/([^']+)'", str(err))
    if missing:  # Hydra lists the group's files; say what a loss is and how a new one is added
        from nemo_sspo.algorithms.losses import policy_loss_names

        return (f"invalid config {config_name!r}: loss={missing.group(1)} is neither a registered policy "
                f"loss nor a variant YAML of the group loss; registered: {policy_loss_names()}. "
                "A loss of your own is added by the module that registers it: "
                f"plugins=[my_loss.py] loss={missing.group(1)} (docs/extending.md)")
    missing = re.search(r"Could not find '(reward|rollout/engine)/([^']+)'", str(err))
    if missing:  # a reward / engine group: the registered names, and how a plug-in adds one
        from nemo_sspo.registry import PLUGINS_HINT
        from nemo_sspo.trainer.config import OPTION_SECTIONS

        group, choice = missing.groups()
        registry = next(section.registry for section in OPTION_SECTIONS if section.group == group)
        return (f"invalid config {config_name!r}: {group}={choice} is not a registered {registry.kind}; registered: "
                f"{registry.names()}{PLUGINS_HINT}")
    match = re.search(r"Could not override '([^']+)'", str(err))
    if not match:
        renamed = _renamed_key(err)
        if renamed:
            return f"invalid config {config_name!r}: {unknown_key_message(renamed, None)}"
        return f"invalid config {config_name!r}: {err}{_omegaconf_reason(err)}"
    path = match.group(1)
    rest = [item for item in overrides if item.split("=", 1)[0].lstrip("+~") != path]
    try:
        loss_name = compose_typed(rest)[1].loss.name
    except Exception:  # noqa: BLE001 - the other overrides are broken too: no loss-specific hint
        loss_name = None
    return f"invalid config {config_name!r}: {unknown_key_message(path, loss_name)}"


def _renamed_key(err: Exception) -> str | None:
    """The key of an earlier release (:data:`~nemo_sspo.trainer.config.RENAMED_KEYS`) that ``err``
    refuses, or None: a key the schema lacks in a YAML file (``full_key: rollout.temperature``), or a
    value given where a section now stands (``rollout.correction=token_tis``: OmegaConf's ``full_key``
    under Hydra's error on the command line; in a YAML file only the section's class, ``str is not a
    subclass of CorrectionConfig``).
    """
    from nemo_sspo.trainer.config import RENAMED_KEYS
    from nemo_sspo.trainer.config.old_keys import moved_value_key

    cause: BaseException | None = err
    while cause is not None:
        for key in (getattr(cause, "full_key", None), *re.findall(r"full_key: (\S+)", str(cause))):
            if key in RENAMED_KEYS:
                return key
        section = re.search(r"is not a subclass of (\w+)", str(cause))
        moved = moved_value_key(section.group(1)) if section else None
        if moved:
            return moved
        cause = cause.__cause__ or cause.__context__
    return None


def _unknown_choice_problems(err: Exception, compose_raw, world_size: int | None) -> list[str]:
    """Every problem of a config that OmegaConf refused for a value outside a
    :class:`~nemo_sspo.choice.Choice` field's names (``Invalid value 'remote', expected one of
    [colocated, separate]``; raised itself, under Hydra's ``Error merging override`` or while Hydra
    composes a YAML file's value), which stops at the first such value: the config composed again over
    an untyped schema gives every refused value
    (:func:`~nemo_sspo.trainer.config.validation.unknown_choices`), and the config with those at their
    defaults every other problem (:func:`~nemo_sspo.trainer.config.validation.problems_of`). Empty for
    any other error.

    Args:
        err: the composition's error.
        compose_raw: ``() -> DictConfig``, Hydra's composition of the same config name and overrides.
        world_size: as :func:`~nemo_sspo.trainer.config.validate`.

    Returns:
        The messages, refused values first; only the one ``err`` names where the config cannot be
        composed over the untyped schema either (then its other errors show once this is fixed).
    """
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException, ValidationError

    from nemo_sspo.trainer.config import (
        problems_of,
        register_config_nodes,
        resolve_settings,
        schema,
        unknown_choices,
    )

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ValidationError):
        cause = cause.__cause__ or cause.__context__
    refused = cause and cause.full_key and re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", str(cause.msg))
    if not refused:
        return []
    value, valid = refused.groups()
    first = [f"{cause.full_key}={value!r} is unknown; valid: {valid}"]
    ConfigStore.instance().store(name="train_schema", node=OmegaConf.to_container(OmegaConf.structured(schema())))
    try:
        raw = compose_raw()
    except (HydraException, OmegaConfBaseException):
        return first
    finally:
        register_config_nodes()  # the typed train_schema again
    problems = unknown_choices(raw)
    if not problems:  # a value the walk does not reach: the one OmegaConf named
        return first
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema()), raw))
        resolve_settings(cfg)
    except (OmegaConfBaseException, ValueError):  # broken further: reported once the choices are fixed
        return problems
    return problems + problems_of(cfg, world_size)


def _omegaconf_reason(err: Exception) -> str:
    """``": <reason>"`` from the OmegaConf error under a Hydra one (``Error merging override
    trainer.max_steps=two`` hides ``Value 'two' of type 'str' could not be converted to Integer``).
    """
    from omegaconf.errors import OmegaConfBaseException

    cause = err.__cause__
    if not isinstance(cause, OmegaConfBaseException) or not getattr(cause, "msg", None):
        return ""
    return f": {cause.msg.splitlines()[0]}"  # the rest repeats the key and names internal classes


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nemo-sspo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"train": "run GRPO-family training (SSPO by default)",
                "eval": "greedy Avg@1 of model.source on eval.benchmarks (math-verify)",
                "plan": "print the memory plan per GPU and pipeline stage; exit 0 if it fits, 2 if not"}
    for name, help_text in commands.items():
        command = sub.add_parser(name, help=help_text)
        command.add_argument("--config-name", default=DEFAULT_CONFIG_NAME)
        command.add_argument("--config-dir", default=str(DEFAULT_CONFIG_DIR))
        if name != "plan":
            command.add_argument("--print-config", action="store_true", help="print the composed config and exit")
        example = {"train": "trainer.max_steps=2", "eval": "eval.limit_per_benchmark=4",
                   "plan": "trainer.gpu_memory_gib=80"}[name]
        command.add_argument("overrides", nargs="*", help=f"Hydra overrides, e.g. {example}")
    data = sub.add_parser("data", help="the paper's math datasets").add_subparsers(dest="action", required=True)
    prepare = data.add_parser("prepare", help="download the training and evaluation sets from their public "
                              "sources into a folder, each checked against its published sha256 and row count")
    prepare.add_argument("--out", required=True, help="the data folder (then export NEMO_SSPO_DATA_DIR=<it>)")
    prepare.add_argument("--source", default=None, help="a local folder instead of the download: a mirror "
                         "<owner>/<repo>/<commit>/<path> of the source files, or prepared JSONL files "
                         "(default: $NEMO_SSPO_DATA_SOURCE, else download)")
    prepare.add_argument("--only", nargs="+", default=None, metavar="NAME", help="these datasets only")
    prepare.add_argument("--format", default="jsonl", dest="file_format", metavar="{jsonl,parquet}",
                         help="jsonl (default): the native trainer's files; parquet: verl's RL dataset "
                         "schema, for examples/integrations/verl (docs/data.md)")
    prepare.add_argument("--template", default=None, metavar="NAME", help="--format parquet only: the prompt "
                         "template of the prompt column (default qwen-math, the paper recipes' data.template)")
    return parser.parse_args(argv)


def _prepare_data(args: argparse.Namespace) -> int:
    """``nemo-sspo data prepare``: writes the datasets, one line per file, then where they are."""
    from nemo_sspo.data.math_datasets import DATA_DIR_ENV
    from nemo_sspo.data.prepare import prepare_datasets

    try:
        written = prepare_datasets(args.out, names=args.only, source=args.source, file_format=args.file_format,
                                   template=args.template)
    except (ValueError, OSError, ImportError) as err:
        print(f"nemo-sspo: {err}", file=sys.stderr)
        return 2
    folder = Path(args.out).expanduser().resolve()
    use = (f"export {DATA_DIR_ENV}={folder}" if args.file_format == "jsonl" else
           "verl's data.train_files / data.val_files (examples/integrations/verl/sspo_grpo.yaml)")
    print(f"datasets written to {folder}: {', '.join(written)}; use them with: {use}")
    return 0


def _evaluate(cfg) -> int:
    """``nemo-sspo eval``: one process, no model parallelism (vLLM brings its own)."""
    import logging

    from nemo_sspo.evaluation.run import run_eval

    progress = logging.getLogger("nemo_sspo.evaluation")  # one line per finished benchmark
    progress.setLevel(logging.INFO)
    progress.addHandler(logging.StreamHandler(sys.stdout))

    try:
        run_eval(cfg)
    except ValueError as err:
        print(f"nemo-sspo: {err}", file=sys.stderr)
        return 2
    print(f"results in {cfg.eval.output_dir}/results.json")
    return 0


def _parameter_counts_comment(cfg) -> str:
    """``--print-config``'s last lines (YAML comments): each rank's parameters under the config's
    layout, counted from the model built on the meta device (no weights read, no memory taken).

    The architecture is ``model.source``'s config.json, or, for a hub id not in the local cache,
    its published architecture (:mod:`nemo_sspo.models.published`).

    A source neither found nor listed gives one comment line saying so instead of the counts.

    Raises:
        ValueError: naming the key: the layout does not fit the model
            (:func:`nemo_sspo.trainer.config.check_model_layout`).
    """
    from nemo_sspo.megatron import parameter_counts
    from nemo_sspo.megatron.model import PRECISIONS
    from nemo_sspo.trainer.config import check_model_layout
    from nemo_sspo.trainer.memory_plan import hf_architecture

    source = cfg.model.source
    try:
        hf_config, origin = hf_architecture(source, cfg.model.cache_dir)
    except FileNotFoundError as err:  # a config check on a machine without the model: say so, fail nothing
        return f"# parameters per rank: not counted, model.source has no config here ({err})"
    # The same layout checks as a run's load_config (not the launch's world size: any is given here).
    check_model_layout(cfg, hf_config, world_size=1)
    par = cfg.parallel
    tp, pp, ep = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size
    counts = parameter_counts(hf_config, tp_size=tp, pp_size=pp, ep_size=ep, precision=cfg.model.precision)
    width = PRECISIONS[cfg.model.precision].itemsize
    lines = [f"# parameters per rank of model.source={source} under TP={tp} x PP={pp} x EP={ep} "
             f"(built on the meta device from {origin}):"]
    for stage, ranks in enumerate(counts):
        # every TP rank of a stage holds as many, and so does every data-parallel (and EP) replica
        lines.append(f"#   pipeline stage {stage}: {ranks[0]:,} on every rank ({ranks[0] * width / 2**30:.2f} "
                     f"GiB of {cfg.model.precision} weights)")
    return "\n".join(lines)


def _memory_plan_comment(cfg) -> str:
    """``--print-config``'s memory plan (YAML comments), or one comment line saying why there is none."""
    from nemo_sspo.trainer.memory_plan import format_memory_plan, plan_for_config

    try:
        return format_memory_plan(plan_for_config(cfg, launch_world_size()), prefix="# ")
    except (ValueError, FileNotFoundError) as err:
        return f"# memory plan: not computed ({err})"


def _host_comment(cfg) -> str:
    """``--print-config``'s last line: whether this host can start the run (the checks a real start runs
    before anything is loaded, :func:`nemo_sspo.trainer.device.check_host`), without refusing: a GPU
    recipe's config is checked on a login node too.
    """
    from nemo_sspo.trainer.device import check_host

    try:
        check_host(cfg)
    except ValueError as err:
        return f"# this host cannot start this run (the config's own checks passed): {err}"
    return "# this host can start this run"


def _plan(cfg) -> int:
    """``nemo-sspo plan``: the table; 0 when the peak fits the GPU memory (or it is unknown), 2 when not."""
    from nemo_sspo.trainer.memory_plan import format_memory_plan, plan_for_config

    try:
        plan = plan_for_config(cfg, launch_world_size())
    except (ValueError, FileNotFoundError) as err:
        print(f"nemo-sspo: {err}", file=sys.stderr)
        return 2
    print(format_memory_plan(plan))
    return 2 if plan.fits is False else 0


def _quiet_known_warnings() -> None:
    """Silences the third-party warnings of :data:`nemo_sspo.known_warnings.KNOWN_WARNINGS`."""
    import torch

    from nemo_sspo.known_warnings import ignore_known_warnings

    ignore_known_warnings(cuda=torch.cuda.is_available())


def _stopped(err, trainer, output_dir: str) -> str:
    """The line saying where a run stopped by a signal left off (``trainer`` None: while starting)."""
    from nemo_sspo.trainer.interrupt import stop_message

    if trainer is None:
        return stop_message(err, completed_steps=None, output_dir=output_dir, interrupted_dir=None)
    return stop_message(err, completed_steps=trainer.completed_steps, output_dir=output_dir,
                        interrupted_dir=trainer.interrupted_dir, policy_step=trainer.engine_step)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nemo-sspo`` console script; returns the process exit code."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.command == "data":
        return _prepare_data(args)
    _quiet_known_warnings()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    printing = getattr(args, "print_config", False)
    try:
        cfg = load_config(args.config_name, args.overrides, args.config_dir,
                          command="train" if args.command == "plan" else args.command,
                          check_model=not printing and args.command != "plan")
    except (ValueError, FileNotFoundError) as err:
        print(f"nemo-sspo: {err}", file=sys.stderr)
        return 2
    if args.command == "plan":
        return _plan(cfg)
    if printing:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        try:
            print(_parameter_counts_comment(cfg))
        except ValueError as err:
            print(f"nemo-sspo: {err}", file=sys.stderr)
            return 2
        if args.command == "train":
            print(_memory_plan_comment(cfg))
            print(_host_comment(cfg))
        return 0
    if args.command == "eval":
        return _evaluate(cfg)
    from nemo_sspo.megatron import destroy_parallel
    from nemo_sspo.trainer.interrupt import RunInterrupted, stop_on_signals
    from nemo_sspo.trainer.loop import GRPOTrainer
    from nemo_sspo.trainer.setup import run_rollout_rank, start_parallel

    trainer = None
    try:
        with stop_on_signals():  # SIGINT/SIGTERM: abandon the step, save what is safe, exit cleanly
            split = None
            if cfg.rollout.schedule.placement == "separate":
                import datetime

                from nemo_sspo.parallel.world_split import split_launched_world

                # Free-running posts its weights over gloo pair groups (docs/async.md); the refit group is lock-step's.
                split = split_launched_world(cfg.rollout.schedule.num_ranks,
                                             timeout=datetime.timedelta(seconds=cfg.rollout.schedule.peer_timeout_s),
                                             device_refit=cfg.rollout.schedule.mode == "lockstep")
                if split.is_rollout:
                    run_rollout_rank(cfg, split)
                    return 0
            trainer = GRPOTrainer(cfg, start_parallel(cfg.parallel, cfg.trainer.seed), split=split)
            history = trainer.fit()
    except ValueError as err:
        print(f"nemo-sspo: {err}", file=sys.stderr)
        return 2
    except RunInterrupted as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"nemo-sspo: {_stopped(err, trainer, cfg.trainer.output_dir)}", file=sys.stderr)
        return err.exit_code
    finally:
        if trainer is not None:
            trainer.shutdown_engine()
        destroy_parallel()
    if trainer.logger.enabled:
        print(f"done: {len(history)} steps, outputs in {cfg.trainer.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
