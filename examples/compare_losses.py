"""GRPO vs GSPO vs SSPO without the entropy clip vs SSPO: same model, task, seed and rollouts.

Each method trains ``--steps`` steps from the same initial weights, one after another in this
process (the checkpoint is loaded once). Step 1 of every run samples the *same* rollouts (same
weights, seed and prompts; the script checks a fingerprint of the responses and rewards), and its
``trainer.minibatches_per_step`` updates (4 here: the first on-policy, the next three off-policy) are
the shared-rollout comparison of clip fractions. Later steps differ as the policies diverge.

Writes to ``--output-dir``: ``<loss>/metrics.jsonl`` (+ TensorBoard, per run), ``comparison.md``
(tables), ``compare_losses.png`` (reward, token entropy and token clip fraction per method over
steps) and ``shared_rollouts_clipfrac.png`` (step-1 clip fractions by tokens / segments / responses).

Defaults: SmolLM2-135M-Instruct on the word-problem task of ``nemo_sspo/conf/sspo_smollm2_cpu.yaml`` with one
change per problem (shorter answers, more often right), 4 methods x 4 steps x 16 responses (2 prompts
x 8), responses up to 48 tokens. At ~10 ms per prompt+response token per forward/backward pass
(~210 tokens per response, ~185 of them the one-shot chat template) a step costs about a minute on
2 CPU cores, so the whole comparison takes about 17 minutes (the script prints an estimate after the
first method); ``--steps 3`` cuts it to about 13.

    python examples/compare_losses.py                                   # the default comparison
    python examples/compare_losses.py --steps 2 --output-dir /tmp/cmp_quick rollout.prompts_per_step=1 \\
        rollout.samples_per_prompt=4 rollout.sampling.max_new_tokens=32 parallel.micro_batch_size=1 \\
        optim.lr=5e-5                                                   # quick comparison (~5 min)
    python examples/compare_losses.py --steps 1 --output-dir /tmp/cmp model=tiny_random \\
        data.template=qwen-math rollout.sampling.max_new_tokens=8   # smoke test

The quick comparison is the same model and task at 2 steps x 4 responses (one prompt), responses up
to 32 tokens, 4 single-response mini-batches per step and 2.5x the learning rate, so the three
off-policy updates move the ratios far enough to clip. Measured with OMP_NUM_THREADS=1 on 2 cores
shared with other work (load average 7-10): 4 min 49 s wall, 4 min 9 s CPU.

    method            reward step 1 / 2   token clip frac step 1 / 2   entropy step 1 / 2
    grpo              0.75 / 0.00         0.070 / 0                    0.253 / 0.181
    gspo              0.75 / 1.00         0     / 0                    0.253 / 0.161
    sspo_fixed_clip   0.75 / 0.75         0     / 0.090                0.253 / 0.158
    sspo              0.75 / 0.75         0     / 0.090                0.253 / 0.158

On the shared step-1 rollouts only GRPO clips (7% of tokens, all on the high side); by step 2 the
policies have diverged (GRPO's 4 responses are all wrong, 31.2 of at most 32 tokens on average, and
GSPO's all right, so both groups have zero advantage and make no update), and both SSPO variants
clip 9% of tokens (12.5% of segments). Four responses per step: the rewards are one group's, not evidence that
any method learns faster.

The smoke test (35 s wall, 22 s CPU, same machine state) only checks that the script runs: the tiny random model earns
no math-verify reward, so every advantage is 0, no method changes the weights, and every table row
and curve is the same (clip fractions 0, ratios 1).

Trailing ``key=value`` arguments are Hydra overrides applied to every run (after the defaults).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

LOSSES = ("grpo", "gspo", "sspo_fixed_clip", "sspo")
DEFAULT_OVERRIDES = ["data.options.max_steps=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=8",
                     "rollout.sampling.max_new_tokens=48", "trainer.minibatches_per_step=4",
                     "trainer.save_hf_checkpoint=false", "trainer.overwrite_output_dir=true"]
SHARED_KEYS = (  # step-1 metrics compared on the shared rollouts
    ("policy/clipfrac_tokens", "clip tok"), ("policy/clipfrac_segments", "clip seg"),
    ("policy/clipfrac_responses", "clip resp"), ("policy/clipfrac_low_tokens", "low tok"),
    ("policy/clipfrac_high_tokens", "high tok"), ("policy/zero_grad_frac_tokens", "zero-grad tok"),
    ("policy/ratio_token_std", "ratio std (tok)"), ("policy/approx_kl_k3", "KL k3"),
)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), help="registered loss names")
    parser.add_argument("--steps", type=int, default=4, help="training steps per method")
    parser.add_argument("--output-dir", default="outputs/compare_losses")
    parser.add_argument("--config-name", default="sspo_smollm2_cpu")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. model=tiny_random")
    return parser.parse_args(argv)


def _fingerprint(rollout) -> str:
    """Digest of a rollout's response tokens and rewards (equal digests = the same rollouts)."""
    digest = hashlib.sha256(rollout.batch.response_ids.numpy().tobytes())
    digest.update(rollout.task_rewards.numpy().tobytes())
    return digest.hexdigest()[:16]


def _config(name, args, output):
    """The composed, validated config of one method's run (``ValueError`` naming the key if invalid)."""
    from nemo_sspo.cli import load_config

    return load_config(args.config_name, [*DEFAULT_OVERRIDES, f"loss={name}", f"trainer.max_steps={args.steps}",
                                          f"trainer.output_dir={output / name}", *args.overrides])


def _train(cfg, checkpoint):
    """One method's run: its per-step metrics and the fingerprint of its step-1 rollouts."""
    from nemo_sspo.megatron import destroy_parallel
    from nemo_sspo.trainer.loop import GRPOTrainer
    from nemo_sspo.trainer.setup import start_parallel

    if checkpoint is None:
        from nemo_sspo.models import load_hf_checkpoint

        checkpoint = load_hf_checkpoint(cfg.model.source, cache_dir=cfg.model.cache_dir)
    trainer = GRPOTrainer(cfg, start_parallel(cfg.parallel, cfg.trainer.seed), checkpoint=checkpoint)
    first = {}

    def observe(step, event, data):  # a step observer (nemo_sspo.trainer.step_metrics): step 1's rollout
        if step == 1 and event == "rollout":
            first["rollout"] = _fingerprint(data.versioned.rollout)

    trainer.metrics.observers.append(observe)
    try:
        history = trainer.fit()
    finally:
        destroy_parallel()
    return history, first["rollout"], checkpoint


def _mean(history, key):
    values = [h[key] for h in history if key in h]
    return sum(values) / len(values) if values else math.nan


def _table(runs, shared_ok) -> str:
    lines = ["## Training (per method, same model, task and seed)", "",
             "| method | reward step 1 | reward last | mean reward | mean entropy | entropy last | "
             "mean clip frac (tokens) | mean clip frac (segments) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, history in runs.items():
        first, last = history[0], history[-1]
        lines.append(f"| {name} | {first['reward/mean']:.3f} | {last['reward/mean']:.3f} | "
                     f"{_mean(history, 'reward/mean'):.3f} | {_mean(history, 'policy/entropy'):.3f} | "
                     f"{last['policy/entropy']:.3f} | {_mean(history, 'policy/clipfrac_tokens'):.4f} | "
                     f"{_mean(history, 'policy/clipfrac_segments'):.4f} |")
    lines += ["", f"## Shared rollouts (step 1; identical responses and rewards for every method: "
                  f"{'yes' if shared_ok else 'NO'})", "",
              "| method | " + " | ".join(label for _, label in SHARED_KEYS) + " |",
              "|---|" + "---|" * len(SHARED_KEYS)]
    for name, history in runs.items():
        lines.append(f"| {name} | " + " | ".join(f"{history[0].get(key, math.nan):.4g}" for key, _ in SHARED_KEYS)
                     + " |")
    return "\n".join(lines) + "\n"


def _plots(runs, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = (("reward/mean", "mean reward"), ("policy/entropy", "old-policy token entropy (nats)"),
              ("policy/clipfrac_tokens", "clip fraction (tokens)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.8))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, history in runs.items():
            ax.plot([h["step"] for h in history], [h.get(key, math.nan) for h in history], marker="o", ms=3, label=name)
        ax.set(xlabel="step", title=label)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(output / "compare_losses.png", dpi=110)
    plt.close(fig)

    levels = ("tokens", "segments", "responses")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(len(runs), 1)
    for i, (name, history) in enumerate(runs.items()):
        ax.bar([j + i * width for j in range(len(levels))],
               [history[0].get(f"policy/clipfrac_{lvl}", math.nan) for lvl in levels], width, label=name)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(levels))], levels)
    ax.set(ylabel="clip fraction", title="Step 1: the same rollouts for every method")
    ax.legend()
    fig.tight_layout()
    fig.savefig(output / "shared_rollouts_clipfrac.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    output = Path(args.output_dir)
    try:  # every method's config is checked before the first one trains
        configs = {name: _config(name, args, output) for name in args.losses}
    except ValueError as err:
        print(f"compare_losses.py: {err}", file=sys.stderr)
        return 2
    output.mkdir(parents=True, exist_ok=True)
    runs, fingerprints, checkpoint = {}, {}, None
    for name, cfg in configs.items():
        start = time.perf_counter()
        runs[name], fingerprints[name], checkpoint = _train(cfg, checkpoint)
        elapsed = time.perf_counter() - start
        left = len(args.losses) - len(runs)
        print(f"{name}: {len(runs[name])} steps in {elapsed:.0f} s; about {elapsed * left / 60:.0f} min for the "
              f"{left} other methods", flush=True)
    shared_ok = len(set(fingerprints.values())) == 1
    (output / "comparison.md").write_text(_table(runs, shared_ok))
    (output / "comparison.json").write_text(json.dumps({"runs": runs, "step1_fingerprints": fingerprints}, indent=1))
    _plots(runs, output)
    print((output / "comparison.md").read_text())
    print(f"plots and tables in {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
