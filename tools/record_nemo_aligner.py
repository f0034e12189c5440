r"""Record NeMo-Aligner's own actor losses on fixed small batches, for tests/integration.

Runs the real actor code of NeMo-Aligner 0.7.0 (the PyPI wheel, ``pip download --no-deps
nemo-aligner==0.7.0``, unzipped) and, optionally, of its unreleased GRPO branch (a ``git archive``
of NVIDIA/NeMo-Aligner's ``geshen/llama_combo``). The actors import NeMo toolkit, Lightning and
TensorRT-LLM, which do not install on CPU: this script stands in for those three packages,
``nemo``, ``lightning`` and ``tensorrt_llm`` (plus ``pytorch_lightning``, Lightning's old name,
which the 2024 branch imports): every name is a placeholder class, except NeMo's data-parallel
loss averaging, which the actor's ``loss_func`` calls. ``Tensor.cuda`` becomes a no-op.
Megatron-Core is real (``pip install --no-deps megatron-core==0.16.1``; the branch's one renamed
import is aliased), with a one-rank gloo group, so the host's own vocab-parallel log-prob
autograd function runs. Writes figures only.

    PYTHONPATH=. /path/to/venv/bin/python tools/record_nemo_aligner.py \
        --release /path/to/nemo_aligner-0.7.0 --grpo-branch /path/to/aligner-grpo-branch \
        --grpo-branch-commit 7b3805a --out tests/integration/data/nemo_aligner_recorded.json

Cases: the 0.7.0 PPO actor on a GRPO-style batch (A_i broadcast, one truncated response), on a
PPO batch (per-token GAE advantages), and the 0.7.0 REINFORCE actor on its batch
(``rewards_with_kl``, ``baseline``); the GRPO branch's actor on a batch with one all-zero-advantage
group (its loss leaves those tokens out of the mean).
"""

from __future__ import annotations

import abc
import argparse
import datetime
import importlib
import importlib.abc
import importlib.machinery
import json
import socket
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

ROWS, LENGTH, VOCAB = 4, 9, 12
PROMPT = 3
RESPONSE_LENGTHS = (6, 3, 5, 4)
RATIO_EPS = 0.2
_STUBBED = ("nemo", "lightning", "tensorrt_llm", "pytorch_lightning")  # the last: GRPO branch only


def _average_losses_across_data_parallel_group(losses):
    """NeMo's helper: the detached losses, all-reduced and divided by the data-parallel size."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    dist.all_reduce(averaged)
    return averaged / dist.get_world_size()


class _PlaceholderType(abc.ABCMeta):  # actor bases mix these with ABCs
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None  # e.g. nemo.utils.logging.info(...)


class _Placeholder(metaclass=_PlaceholderType):
    """Any NeMo / Lightning name the actor modules import but the loss does not run."""

    def __init__(self, *args, **kwargs):
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "average_losses_across_data_parallel_group":
            return _average_losses_across_data_parallel_group
        return type(name, (_Placeholder,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _batch(seed: int, *, gae: bool = False, zero_group: bool = False):
    """The actor's layout: [B, S - 1] target-frame tensors, response_tokens [B, S]."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=gen)
    positions = torch.arange(LENGTH - 1)
    lengths = torch.tensor(RESPONSE_LENGTHS)
    mask = ((positions >= PROMPT - 1) & (positions < PROMPT - 1 + lengths[:, None])).float()
    logits = 1.5 * torch.randn(ROWS, LENGTH, VOCAB, generator=gen)
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    prev = (logprobs + 0.8 * torch.randn(logprobs.shape, generator=gen)) * mask
    per_response = torch.randn(ROWS, generator=gen)
    if zero_group:
        per_response[2:] = 0.0  # rows 2-3: a group whose rewards were all equal
    advantages = per_response[:, None] * mask
    if gae:
        advantages = torch.randn(ROWS, LENGTH - 1, generator=gen) * mask
    return {"response_tokens": tokens, "mask": mask, "advantages": advantages,
            "prev_logprobs": prev, "is_end": torch.tensor([1.0, 1.0, 0.0, 1.0]),
            "logits": logits}


def _run_actor(actor_cls, batch, **attributes):
    """The actor's fwd_output_and_loss_func on one micro-batch, then its loss_func."""
    actor = object.__new__(actor_cls)
    for name, value in attributes.items():
        setattr(actor, name, value)
    logits = batch["logits"].clone().requires_grad_(True)
    host_batch = {k: v for k, v in batch.items() if k != "logits"}
    host_batch["position_ids"] = torch.arange(LENGTH).expand(ROWS, -1)
    host_batch["attention_mask"] = torch.ones(1)
    forward = actor.get_actor_forward_output_and_loss_func()
    output, loss_func = forward(iter([host_batch]), lambda *args, **kwargs: logits)
    loss, metrics = loss_func(output)
    loss.backward()
    return {"loss": float(loss), "metrics": {k: v.tolist() for k, v in metrics.items()},
            "grad": _figures(logits.grad)}


def _figures(tensor: torch.Tensor):
    """Nested lists of 9-significant-digit floats (exact for float32)."""
    flat = [float(f"{x:.9g}") for x in tensor.detach().double().flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(tensor.shape).tolist()


def _import_actor(root: Path, module: str, cls: str):
    for name in [n for n in sys.modules if n == "nemo_aligner" or n.startswith("nemo_aligner.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        return getattr(importlib.import_module(module), cls)
    finally:
        sys.path.remove(str(root))


def main() -> None:
    """Run every case through the host actors and write the record."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--release", type=Path, required=True, help="unzipped 0.7.0 wheel")
    parser.add_argument("--grpo-branch", type=Path, help="source of the GRPO branch")
    parser.add_argument("--grpo-branch-commit", help="its commit, recorded")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.meta_path.insert(0, _StubFinder())
    torch.Tensor.cuda = lambda self, *a, **k: self  # the actor moves its batch to the GPU
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    version = (args.release / "nemo_aligner" / "package_info.py").read_text()
    ppo = _import_actor(args.release, "nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor",
                        "MegatronGPTActorModel")
    reinforce = _import_actor(args.release,
                              "nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor",
                              "MegatronGPTReinforceActorModel")
    cases = {}
    for name, batch in (("ppo_actor_grpo_batch", _batch(0)), ("ppo_actor_gae_batch",
                                                              _batch(1, gae=True))):
        cases[name] = {"batch": {k: _figures(v) if v.is_floating_point() else v.tolist()
                                 for k, v in batch.items()},
                       **_run_actor(ppo, batch, ratio_eps=RATIO_EPS, entropy_bonus=0.0)}
    batch = _batch(2)
    batch["is_end"] = torch.ones(ROWS)  # the REINFORCE actor averages over mask, not is_end
    gen = torch.Generator().manual_seed(3)
    reinforce_batch = {"response_tokens": batch["response_tokens"], "mask": batch["mask"],
                       "rewards_with_kl": torch.randn(ROWS, 1, generator=gen),
                       "baseline": torch.randn(ROWS, 1, generator=gen),
                       "is_end": batch["is_end"], "logits": batch["logits"]}
    cases["reinforce_actor"] = {"batch": {k: _figures(v) if v.is_floating_point() else v.tolist()
                                          for k, v in reinforce_batch.items()},
                                **_run_actor(reinforce, reinforce_batch)}
    record = {"host": "NVIDIA/NeMo-Aligner", "release": "0.7.0 (PyPI wheel)",
              "release_version_file": [line for line in version.splitlines()
                                       if line.startswith(("MAJOR", "MINOR", "PATCH"))],
              "stubbed_packages": list(_STUBBED), "ratio_eps": RATIO_EPS, "dtype": "float32",
              "torch": torch.__version__, "recorder": "tools/record_nemo_aligner.py",
              "recorded_on": datetime.date.today().isoformat(), "cases": cases}
    if args.grpo_branch is not None:
        from megatron.core import num_microbatches_calculator as calculator

        # The branch (2024) imports this under its Megatron-Core 0.9 name.
        calculator.reconfigure_microbatch_calculator = (
            calculator.reconfigure_num_microbatches_calculator)
        branch = _import_actor(args.grpo_branch,
                               "nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor",
                               "MegatronGPTActorModel")
        batch = _batch(4, zero_group=True)
        batch["init_logprobs"] = batch["prev_logprobs"].clone()  # its loss always reads it
        cfg = types.SimpleNamespace(ppo=types.SimpleNamespace(initial_policy_kl_penalty=0.0))
        cases["grpo_branch_zero_advantage_group"] = {
            "batch": {k: _figures(v) if v.is_floating_point() else v.tolist()
                      for k, v in batch.items()},
            **_run_actor(branch, batch, ratio_eps=RATIO_EPS, entropy_bonus=0.0, cfg=cfg)}
        record["grpo_branch"] = {"ref": "geshen/llama_combo", "commit": args.grpo_branch_commit}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {sorted(cases)}; losses "
          f"{ {k: round(v['loss'], 6) for k, v in cases.items()} }")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
