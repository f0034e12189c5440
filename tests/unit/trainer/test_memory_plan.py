"""The memory plan against built objects: its weights, gradients and optimizer bytes equal what
megatron-core allocates, full recomputation in chunks of 2 layers keeps one input per chunk, and an
oversize config is refused at load naming the largest term.

The DP 2 (distributed optimizer) case runs in tests/distributed/test_memory_plan_parallel.py; the
activations of every tiny model, precision and layout in tests/unit/megatron/test_memory_grid.py and
tests/distributed/test_memory_grid_parallel.py.
"""

import copy
import functools

import pytest
import torch

from nemo_sspo.cli import load_config
from nemo_sspo.megatron import destroy_parallel, initialize_parallel
from nemo_sspo.megatron.memory import activation_bytes, model_state_bytes, rank_parameters
from tests.unit._memory_cases import (
    build_trained,
    counted_state_bytes,
    counting_routed_tokens,
    grid_models,
    llama,
    padded_and_packed_inputs,
    qwen3,
    recompute,
    saved_activation_bytes,
)
from tests.unit.megatron.test_memory_grid import OVER, UNDER
from nemo_sspo.megatron import build_policy_model


@pytest.fixture
def one_process():
    initialize_parallel(tp_size=1, pp_size=1, seed=3)
    yield
    destroy_parallel()


def test_rank_parameters_of_the_tiny_llama_by_hand():
    # Embedding and untied head: vocab 200 padded to 256 rows x 64 = 16,384 each. Per layer: norms 2 x 64,
    # qkv (4 + 2 x 2) x 16 x 64 = 8,192, proj 64 x 64 = 4,096, fc1 2 x 160 x 64 = 20,480, fc2 64 x 160
    # = 10,240 -> 43,136; two layers 86,272; final norm 64 -> 119,104.
    assert sum(p.numel for p in rank_parameters(llama(), tp=1, pp=1)) == 119_104


@pytest.mark.parametrize("precision,distributed,hf", [
    ("fp32", False, "llama"), ("fp32", True, "llama"), ("bf16", False, "llama"), ("bf16", True, "qwen3")])
def test_weights_gradients_optimizer_equal_the_built_objects(one_process, precision, distributed, hf):
    config = llama() if hf == "llama" else qwen3()
    ddp, optimizer = build_trained(config, precision=precision, distributed=distributed)
    counted = counted_state_bytes(ddp, optimizer)
    # the tensors the plan lists are the built model's, one for one
    assert sorted(p.numel for p in rank_parameters(config, tp=1, pp=1)) == sorted(
        p.numel() for p in ddp.module.parameters())
    planned = model_state_bytes(rank_parameters(config, tp=1, pp=1), param_bytes=2 if precision == "bf16" else 4,
                                dp=1, distributed_optimizer=distributed)
    assert (planned.weights, planned.gradients, planned.optimizer) == (
        counted["weights"], counted["gradients"], counted["optimizer"])
    if hf == "llama" and not distributed:  # by hand: 119,104 parameters
        per_param = {"fp32": (4, 4, 8), "bf16": (2, 4, 12)}[precision]
        assert (counted["weights"], counted["gradients"], counted["optimizer"]) == tuple(
            119_104 * b for b in per_param)
    if hf == "llama" and distributed:  # every tensor is a multiple of 64; 119,104 padded to 128 -> 119,168
        assert counted["gradients"] == 4 * 119_168 and counted["weights"] == 4 * 119_168


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LORA_OVER = 0.2


def _config(hf: str):
    return {"llama": llama, "qwen3": qwen3, "qwen3_moe": lambda: grid_models()["tiny-random-qwen3-moe"]}[hf]()


@pytest.mark.parametrize("precision,distributed,hf", [("fp32", False, "llama"), ("bf16", True, "qwen3"),
                                                      ("fp32", False, "qwen3_moe")])
def test_lora_terms_equal_the_built_objects(one_process, precision, distributed, hf):
    from nemo_sspo.megatron.lora import LoraSettings

    config = _config(hf)
    lora = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=LORA_TARGETS)
    ddp, optimizer = build_trained(config, precision=precision, distributed=distributed, lora=lora)
    counted = counted_state_bytes(ddp, optimizer)
    params = rank_parameters(config, tp=1, pp=1, lora_rank=4, lora_targets=LORA_TARGETS)
    built = dict(ddp.module.named_parameters())
    assert sorted((p.numel, p.frozen) for p in params) == sorted(
        (p.numel(), not p.requires_grad) for p in built.values())
    planned = model_state_bytes(params, param_bytes=2 if precision == "bf16" else 4, dp=1,
                                distributed_optimizer=distributed)
    assert (planned.weights, planned.gradients, planned.optimizer) == (
        counted["weights"], counted["gradients"], counted["optimizer"])
    if hf == "llama":  # by hand: per layer A 4 x 64 and B on qkv (128), proj (64), fc1 (320), fc2 (A 4 x 160, B 64)
        adapters = 2 * (4 * 64 + 128 * 4 + 4 * 64 + 64 * 4 + 4 * 64 + 320 * 4 + 4 * 160 + 64 * 4)
        assert adapters == 7_424
        assert (counted["weights"], counted["gradients"], counted["optimizer"]) == (
            4 * (119_104 + adapters), 4 * adapters, 8 * adapters)
    if hf == "qwen3_moe":  # by hand: 8 experts of width 32 in each of 2 layers (hidden 64), fc1 A 4 x 64 +
        # B 64 x 4, fc2 A 4 x 32 + B 64 x 4; attention: q/k/v (4 + 2 x 2) x 32 = 256 rows, o 128 columns
        experts = 2 * 8 * (4 * 64 + 64 * 4 + 4 * 32 + 64 * 4)
        attention = 2 * (4 * 64 + 256 * 4 + 4 * 128 + 64 * 4)
        assert sum(p.numel for p in params if not p.frozen) == experts + attention == 18_432
        assert {p.name for p in params if p.expert and not p.frozen} == {
            name for name in built if ".experts." in name and ".lora_" in name}


@pytest.mark.parametrize("hf", ["llama", "qwen3_moe"])
def test_lora_activations_within_bounds_of_the_saved_bytes(one_process, hf):
    from nemo_sspo.megatron.lora import LoraSettings

    config = _config(hf)
    (ids, pos), _ = padded_and_packed_inputs(config.vocab_size, 2, 32, [8])
    model = build_policy_model(config, lora=LoraSettings(rank=16, alpha=16.0, dropout=0.0,
                                                         targets=LORA_TARGETS)).train()
    with counting_routed_tokens(model) as routed:
        measured = saved_activation_bytes(model, ids, pos)
    pairs = sum(routed) / len(routed) if routed else None
    planned = activation_bytes(config, tokens=64, rows=2, seq=32, tp=1, pp=1, stage=0, act_bytes=4, impl="local",
                               routed_tokens=pairs, lora_rank=16, lora_targets=LORA_TARGETS).saved
    # A frozen model saves less than the plan counts (the safe direction): megatron-core's linear layer
    # with a frozen weight keeps no input of its own (measured on this Llama: three [T, h] inputs per
    # decoder layer fewer). The plan over-counts by 12.6% (Llama) and 19.4% (Qwen3-MoE) here, where the
    # full-training grid allows 15%.
    assert (1 - UNDER) * measured <= planned <= (1 + LORA_OVER) * measured, (measured, planned)
    # the adapters' own term per decoder layer, fp32 [T, r] (64 tokens, rank 16) for each of the 4
    # adapted layers, or for an MoE layer 2 of them and [R, r] for fc1 and fc2 over the routed pairs
    # (64 tokens, top-2: R = 128)
    without = activation_bytes(config, tokens=64, rows=2, seq=32, tp=1, pp=1, stage=0, act_bytes=4,
                               impl="local", routed_tokens=pairs).saved
    assert planned - without == (2 * 4 * 64 * 16 * 4 if hf == "llama" else 2 * (2 * 64 + 2 * 128) * 16 * 4)


@pytest.mark.parametrize("hf", ["llama", "qwen3_moe"])
def test_lora_dropout_adds_each_adapters_mask_and_dropped_input(one_process, hf):
    from nemo_sspo.megatron.lora import LoraSettings

    config = _config(hf)
    (ids, pos), _ = padded_and_packed_inputs(config.vocab_size, 2, 32, [8])
    measured, planned = {}, {}
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)  # the same routes both times (dropout does not touch the routers' input)
        model = build_policy_model(config, lora=LoraSettings(rank=4, alpha=8.0, dropout=dropout,
                                                             targets=LORA_TARGETS)).train()
        with counting_routed_tokens(model) as routed:
            measured[dropout] = saved_activation_bytes(model, ids, pos)
        planned[dropout] = activation_bytes(config, tokens=64, rows=2, seq=32, tp=1, pp=1, stage=0, act_bytes=4,
                                            impl="local", routed_tokens=sum(routed) / len(routed) if routed else None,
                                            lora_rank=4, lora_targets=LORA_TARGETS, lora_dropout=dropout).saved
    # by hand, per decoder layer: an fp32 copy (4 bytes) of each adapter's dropped input; the Llama's 64
    # tokens into q/k/v (h 64), o (64), gate/up (64) and down (160); the MoE's attention alike (q/k/v 64,
    # o 128) and its R = 128 routed pairs (64 tokens, top-2) into each expert's fc1 (64) and fc2 (32)
    per_layer = 4 * 64 * (64 + 64 + 64 + 160) if hf == "llama" else 4 * (64 * (64 + 128) + 128 * (64 + 32))
    assert planned[0.1] - planned[0.0] == 2 * per_layer
    # Measured: each adapter keeps that one copy, except the first layer's q/k/v adapter, whose input (the
    # frozen embedding's, normed) needs no gradient: the plan over-counts by that copy, 4 x 64 x 64 bytes.
    assert (planned[0.1] - planned[0.0]) - (measured[0.1] - measured[0.0]) == 4 * 64 * 64


def test_full_recomputation_keeps_one_input_per_chunk(one_process):
    # 4 layers in chunks of 2: the forward keeps 2 chunk inputs of T h fp32 values, not 4.
    config = llama(num_hidden_layers=4)
    (ids, pos), _ = padded_and_packed_inputs(config.vocab_size, 2, 32, [8])
    with recompute("full", num_layers=2):
        model = build_policy_model(config).train()
        measured = saved_activation_bytes(model, ids, pos)
    planned = activation_bytes(config, tokens=64, rows=2, seq=32, tp=1, pp=1, stage=0, act_bytes=4, impl="local",
                               recompute="full", recompute_num_layers=2).saved
    assert (1 - UNDER) * measured <= planned <= (1 + OVER) * measured, (measured, planned)


def test_an_oversize_config_is_refused_at_load_naming_the_largest_term():
    # tiny-random-llama: hidden 64, 2 layers, 4 heads, tied 49,152 x 64 embedding: about 3.2 M parameters,
    # 12.6 MB of fp32 weights, 51 MB with gradients and Adam states. Fixed rows: 4 rows of the longest
    # sequence, 2,000 + 1,024 tokens capped at its 1,024 positions; the local spec's softmax alone saves
    # 4 rows x 4 heads x 1,024^2 x 4 B = 64 MiB per layer, 128 MiB for two: activations are the largest
    # term, and with the rest the peak exceeds a 0.2 GiB GPU.
    overrides = ["model=tiny_random", "model.transformer_impl=local", "rollout.sampling.max_new_tokens=2000",
                 "trainer.gpu_memory_gib=0.2"]
    with pytest.raises(ValueError) as err:
        load_config(overrides=overrides, check_model=True)
    message = str(err.value)
    for part in ("memory plan", "GiB per GPU", "the GPU's 0.20 GiB",
                 "largest term is activations", "parallel.recompute=full", "parallel.max_tokens_per_micro_batch",
                 "trainer.skip_memory_check=true"):
        assert part in message, (part, message)
    # the override starts it anyway; a host without a GPU and without gpu_memory_gib checks nothing
    assert load_config(overrides=[*overrides, "trainer.skip_memory_check=true"], check_model=True)
    assert load_config(overrides=overrides[:-1], check_model=True).trainer.gpu_memory_gib is None


@functools.cache
def _qwen3_30b_a3b():
    return load_config("soft_seq_po_qwen3_30b_a3b", command="eval")


def _qwen3_30b_a3b_plan(gib: float, **vllm_or_model):
    """The recipe's plan on 16 GPUs of ``gib`` GiB, with ``gpu_memory_utilization`` or
    ``transformer_impl`` changed as given."""
    from nemo_sspo.models.published import published_config
    from nemo_sspo.trainer.memory_plan import memory_plan

    cfg = copy.deepcopy(_qwen3_30b_a3b())
    for key, value in vllm_or_model.items():
        setattr(cfg.rollout.engine.options if key == "gpu_memory_utilization" else cfg.model, key, value)
    return memory_plan(cfg, published_config(cfg.model.source), world_size=16, gpu_gib=gib)


def test_a_vllm_share_that_cannot_hold_the_weights_is_refused_naming_the_minimum():
    # Qwen3-30B-A3B by hand: per layer q 2,048 x 4,096 + k, v 2 x 2,048 x 512 + o 4,096 x 2,048 + q/k norms
    # 2 x 128 + norms 2 x 2,048 + router 128 x 2,048 + 128 experts x 3 x 2,048 x 768 = 623,120,640; 48
    # layers, untied embedding and head 2 x 151,936 x 2,048, final norm 2,048: 30,532,122,624 parameters,
    # 61,064,245,248 bf16 bytes = 56.87 GiB on the recipe's vLLM TP 1. Its share 0.5 x 80 GiB = 40 GiB;
    # 56.87 / 80 = 0.711, so at least 0.72.
    with pytest.raises(ValueError) as err:
        _qwen3_30b_a3b_plan(80)
    message = str(err.value)
    for part in ("rollout.engine.options.gpu_memory_utilization=0.5", "40.00 GiB of the GPU's 80.00 GiB", "56.87 GiB",
                 "at least 0.72"):
        assert part in message, (part, message)
    # at 0.72 the share holds the weights: 57.60 - 56.87 = 0.73 GiB of KV cache
    plan = _qwen3_30b_a3b_plan(80, gpu_memory_utilization=0.72)
    assert "56.87 GiB bf16 weights + 0.73 GiB KV cache" in "\n".join(plan.notes)
    # a share the whole GPU cannot give: vLLM's tensor parallelism is the way out
    with pytest.raises(ValueError, match=r"even the whole GPU cannot hold them: raise "
                                         r"rollout.engine.options.tensor_parallel_size \(now 1\)"):
        _qwen3_30b_a3b_plan(50)


@pytest.mark.parametrize("impl,labelled", [("auto", True), ("local", False)])
def test_the_transformer_engine_formula_is_labelled_unmeasured(impl, labelled):
    from nemo_sspo.trainer.memory_plan import format_memory_plan

    # a known GPU memory: "auto" plans the TransformerEngine layers, "local" megatron-core's own
    text = format_memory_plan(_qwen3_30b_a3b_plan(141, transformer_impl=impl))
    assert ("transformer_engine layers" in text) == labelled
    assert ("not yet measured on a GPU" in text) == labelled, text


def test_plan_names_the_fix_and_says_which_layers(capsys, monkeypatch):
    # the oversize case above, through `nemo-sspo plan`: exit 2 and the same advice as the refusal at load
    from nemo_sspo.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    overrides = ["model=tiny_random", "rollout.sampling.max_new_tokens=2000"]
    assert main(["plan", *overrides, "model.transformer_impl=local", "trainer.gpu_memory_gib=0.2"]) == 2
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "largest term is activations" in out and "parallel.recompute=full" in out
    # model.transformer_impl=auto: TransformerEngine layers for a GPU of known size, local ones without
    assert main(["plan", *overrides, "trainer.gpu_memory_gib=80"]) == 0
    assert "layers: transformer_engine, as model.transformer_impl=auto builds them on a GPU" in capsys.readouterr().out
    assert main(["plan", *overrides]) == 0
    assert ("layers: local, as model.transformer_impl=auto builds them on a host without a GPU (set "
            "trainer.gpu_memory_gib, or model.transformer_impl=transformer_engine") in capsys.readouterr().out


def test_print_config_says_what_this_host_cannot_start_and_a_real_start_refuses_it_at_load(capsys, monkeypatch):
    from nemo_sspo.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    overrides = ["model=tiny_random", "parallel.context_parallel_size=2"]
    assert main(["train", "--print-config", *overrides]) == 0  # a config check, as on a login node
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("# this host cannot start this run (the config's own checks passed): "
                           "parallel.context_parallel_size=2 needs TransformerEngine's attention")
    with pytest.raises(ValueError, match="parallel.context_parallel_size=2 needs TransformerEngine's attention"):
        load_config(overrides=overrides, check_model=True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["train", "--print-config", "model=tiny_random"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "# this host can start this run"
