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

    Every check of the config runs here, before any process group, model or data exists (the checks
    of :func:`nemo_sspo.trainer.config.validate`), so a bad value fails in the first second; every
    problem of every kind (unknown or old keys, wrong types, values outside their set, failed checks)
    is reported in one error (:func:`_every_problem`).

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
        ValueError: ``invalid config '<name>': `` and every unknown key, wrong type (with OmegaConf's
            reason) and failed check, each naming the key path and the fix.
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

    from nemo_sspo.trainer.config import find_unknown_key, register_config_nodes, schema
    from nemo_sspo.trainer.config.keyed import failed
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

    def composed():
        try:
            return compose_typed(overrides)
        except (HydraException, OmegaConfBaseException, ValueError) as err:  # ValueError: a dataclass's own check
            raise _invalid(config_name, _every_problem(err, compose_raw, overrides, world_size)) from err

    raw, cfg = composed()
    if set(cfg.plugins) - set(_plugins_named(config_name, overrides, Path(config_dir))):
        # Named by a YAML further down the defaults list: import them, then compose again.
        load_plugins(cfg.plugins)
        register_config_nodes()
        raw, cfg = composed()
    if find_unknown_key(raw, cfg):  # a key added with '+' that no field takes: Hydra keeps it, the dataclasses drop it
        raise _invalid(config_name, _every_problem(None, compose_raw, overrides, world_size))
    problems = failed((not cfg.entry_point_plugins or cfg.entry_point_plugins == installed,
                       f"entry_point_plugins={cfg.entry_point_plugins} is recorded from the installed packages, which "
                       f"now declare {installed}: remove the key (it is filled in) or install the plugins the config "
                       "names"))
    cfg.entry_point_plugins = installed
    problems += _settled_problems(cfg, world_size)
    if problems:
        raise _invalid(config_name, problems)
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


def _invalid(config_name: str, problems: list[str]) -> ValueError:
    """The load's one error: ``invalid config '<name>': `` and every problem, each once (a numbered list
    for several, :func:`~nemo_sspo.trainer.config.config_error`).
    """
    from nemo_sspo.trainer.config import config_error

    return ValueError(f"invalid config {config_name!r}: {config_error(list(dict.fromkeys(problems)))}")


def _settled_problems(cfg, world_size: int | None) -> list[str]:
    """The problems of a typed config: its settings resolved
    (:func:`~nemo_sspo.trainer.config.resolve_settings`, whose one error is the loss's: an unknown
    ``loss.name``, or params of another loss), then every check
    (:func:`~nemo_sspo.trainer.config.problems_of`).
    """
    from nemo_sspo.trainer.config import problems_of, resolve_settings

    try:
        resolve_settings(cfg)
    except ValueError as err:  # also the loss section's own problem (listed once by _invalid); the
        unresolved = [str(err)]  # rules on the loss's settings are skipped (their facts are unknown)
    else:
        unresolved = []
    return [*unresolved, *problems_of(cfg, world_size)]


def _every_problem(err: Exception | None, compose_raw, overrides: list[str], world_size: int | None) -> list[str]:
    """Every problem of a config that did not compose onto the typed schema (OmegaConf and Hydra stop at
    the first) or that adds a key no field takes (``+trainer.foo=1``, ``err`` None): the config is
    composed again over an untyped ``train_schema``, leaving out each override Hydra refuses even so
    (a key that does not exist, a group option that does not exist, a wrong value in a group's
    dataclass); the keys and values the typed schema refuses are then found and taken out
    (:func:`~nemo_sspo.trainer.config.refused.refused_keys_and_values`), and the rest is typed
    (:func:`~nemo_sspo.trainer.config.refused.typed_config`, which names a dataclass's own refusal by its
    key path) and checked.

    Args:
        err: the typed composition's error, or None.
        compose_raw: ``(overrides) -> DictConfig``, Hydra's composition of the config with those overrides.
        overrides: the command line's overrides.
        world_size: as :func:`~nemo_sspo.trainer.config.validate`.

    Returns:
        The messages: refused overrides (in command-line order), refused keys and values (in the
        config's order), then the checks'. Where the config does not compose even over the untyped
        schema (a broken YAML file), the refused overrides and Hydra's error.
    """
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from nemo_sspo.trainer.config import register_config_nodes, schema
    from nemo_sspo.trainer.config.refused import omegaconf_problem, refused_keys_and_values, typed_config

    items, refused = list(overrides), []
    ConfigStore.instance().store(name="train_schema", node=OmegaConf.to_container(OmegaConf.structured(schema())))
    try:
        while True:
            try:
                raw = compose_raw(items)
                break
            except (HydraException, OmegaConfBaseException) as refusal:
                item = _override_named(refusal, items)
                if item is None:  # a YAML file's: the composition ends here
                    return [_override_problem(item, bad, None) for item, bad in refused] + [_stopping_problem(refusal)]
                refused.append((item, refusal))
                items.remove(item)
    finally:
        register_config_nodes()  # the typed train_schema again
    loss_name = OmegaConf.select(raw, "loss.name", default=None)
    problems = [_override_problem(item, bad, loss_name) for item, bad in refused] + refused_keys_and_values(raw)
    cfg, built = typed_config(raw)
    problems += built
    if cfg is None:
        return problems
    problems += _settled_problems(cfg, world_size)
    if not problems and err is not None:  # not found again: the error itself
        problems = [omegaconf_problem(err)]
    return problems


def _stopping_problem(err: Exception) -> str:
    """The problem of a YAML file that stops even the composition over the untyped schema: a group
    option that does not exist (:func:`_group_problem`), or a key or value in a group's dataclass
    (``loss: params: ...``): the key's closest or new key
    (:func:`~nemo_sspo.trainer.config.unknown_key_message`) or the refused value's reason; else
    Hydra's error.
    """
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    from nemo_sspo.algorithms.losses import get_policy_loss, policy_loss_names
    from nemo_sspo.trainer.config import unknown_key_message
    from nemo_sspo.trainer.config.refused import omegaconf_problem

    group = _group_problem(err)
    if group:
        return group
    cause = err.__cause__ or err.__context__  # the first keyed one is this composition's (the typed
    while cause is not None and not getattr(cause, "full_key", None):  # composition's error follows it)
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        owner = getattr(cause, "object_type", None)
        loss = next((name for name in policy_loss_names() if get_policy_loss(name).config_cls is owner), None)
        return unknown_key_message(cause.full_key, loss)
    return omegaconf_problem(cause if isinstance(cause, OmegaConfBaseException) else err)


def _group_problem(err: Exception) -> str | None:
    """For Hydra's ``Could not find '<group>/<option>'``: the option, the group's options (a loss's,
    reward's or engine's registered names, with how a plug-in adds one), else None.
    """
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", str(err))
    if not missing:
        return None
    group, choice = missing.groups()
    if group == "loss":  # Hydra lists the group's files; say what a loss is and how a new one is added
        from nemo_sspo.algorithms.losses import policy_loss_names

        return (f"loss={choice} is neither a registered policy loss nor a variant YAML of the group "
                f"loss; registered: {policy_loss_names()}. A loss of your own is added by the module that "
                f"registers it: plugins=[my_loss.py] loss={choice} (docs/extending.md)")
    from nemo_sspo.registry import PLUGINS_HINT
    from nemo_sspo.trainer.config import OPTION_SECTIONS

    section = next((section for section in OPTION_SECTIONS if section.group == group), None)
    if section is not None:  # a reward / engine group: the registered names, and how a plug-in adds one
        return (f"{group}={choice} is not a registered {section.registry.kind}; registered: "
                f"{section.registry.names()}{PLUGINS_HINT}")
    available = re.search(r"Available options in '[^']+':\n((?:\t.*\n?)*)", str(err))
    options = [line.strip() for line in (available.group(1).splitlines() if available else [])
               if line.strip() and not line.strip().endswith("_schema")]  # *_schema: the typed nodes
    return f"{group}={choice} is not an option of the group {group}; options: {', '.join(options)}"


def _override_named(err: Exception, items: list[str]) -> str | None:
    """The override of ``items`` that Hydra's ``err`` refuses, or None (an error of a YAML file)."""
    def key(item: str) -> str:
        return item.split("=", 1)[0].lstrip("+~")

    text = str(err)
    named = re.search(r"Could not override '([^']+)'|Could not find '([^']+)/[^'/]+'|Could not append to config. "
                      r"An item is already at '([^']+)'|Could not delete from config. '([^']+)' does not exist|"
                      r"Multiple values for ([^ .]+)\.", text)
    if named:
        path = next(group for group in named.groups() if group).replace("/", ".")
        return next((item for item in items if key(item).replace("/", ".") == path), None)
    merging = re.search(r"Error merging override (.+)", text)
    return merging.group(1).strip() if merging and merging.group(1).strip() in items else None


def _override_problem(item: str, err: Exception, loss_name: str | None) -> str:
    """The problem of an override Hydra refuses (:func:`_override_named`), naming the key and the fix: an
    unknown key's closest or new key, a group option's registered names and how a plug-in adds one, or
    the refused value's reason.
    """
    from nemo_sspo.trainer.config import unknown_key_message
    from nemo_sspo.trainer.config.refused import refused_value_message

    group = _group_problem(err)
    if group:
        return group
    path, _, value = item.lstrip("+~").partition("=")
    if "Could not append" in str(err) or "Multiple values for" in str(err):
        return f"{path} is a {'group' if 'Multiple' in str(err) else 'key'} already: set it without '+' ({path}={value})"
    if item.startswith("~") and "Could not delete" not in str(err):
        return f"{path}: a field cannot be deleted; set it to another value instead ({path}=...)"
    if re.search(r"Could not override|Could not delete", str(err)):
        return unknown_key_message(path, loss_name)
    cause = err.__cause__
    return refused_value_message(path, value, cause) if isinstance(cause, Exception) else f"{err}"


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
