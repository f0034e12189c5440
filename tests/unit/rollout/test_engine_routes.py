"""Router replay R3's engine side: the experts transformers' ``generate`` chose, as the HF engine
records them, against a second algorithm.

The reference runs each row's prompt + response tokens alone (no padding, no KV cache) through a
float64 copy of the engine's model and takes the top-k of softmax(router logits) itself, from the
logits every router returns. The engine ran the same tokens left-padded, in one prefill forward
and one decode forward per sampled token, in float32: its routes must give the same top-k sets at
every prompt and response token except the last sampled one (never fed back, so it has no route).
"""

import torch

from nemo_sspo.algorithms.batch import pack_tokens
from nemo_sspo.megatron.router_replay import routing_agreement
from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.rollout import HFRolloutEngine
from nemo_sspo.rollouts.slots import concat_rollouts

PROMPTS = ["Hi", "Let x = 2.\n\nThen 2x =", "Sam has 5 stamps. He buys 2 more. How many"]  # 1, 11 and 14 tokens


def _reference_routes(model, ids: torch.Tensor) -> torch.Tensor:
    """``[1, S, L, k]``: top-k of softmax(router logits) of each MoE layer for one unpadded row."""
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    top_k = model.config.num_experts_per_tok
    return torch.stack([torch.softmax(x.double(), dim=-1).topk(top_k, dim=-1).indices for x in logits],
                       dim=1)[None]


def test_hf_engine_routes_are_the_top_k_of_its_routers_at_every_token_but_the_last():
    config, state_dict, tokenizer = load_hf_checkpoint("tiny-random-qwen3-moe")
    engine = HFRolloutEngine(build_hf_model(config, state_dict), tokenizer, max_new_tokens=6, temperature=1.0,
                             record_routes=True)
    batch = engine.generate(PROMPTS, seed=1)
    ids, lengths = pack_tokens([(batch.prompt_ids, batch.prompt_mask), (batch.response_ids, batch.response_mask)],
                               pad_id=tokenizer.pad_token_id)
    prompt_lengths = batch.prompt_mask.sum(dim=1)
    assert len(set(prompt_lengths.tolist())) == 3  # left padding differs on every row
    assert batch.routes.shape == (*ids.shape, 2, 2)  # 2 MoE layers, top-2
    # 8 experts: held as int16, 2 bytes an id (a quarter of int64's 8)
    assert batch.routes.dtype == torch.int16
    assert batch.routes.nbytes == ids.numel() * 2 * 2 * 2
    reference_model = build_hf_model(config, state_dict).double()
    reference_model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    for row, length in enumerate(lengths.tolist()):
        expected = _reference_routes(reference_model, ids[row:row + 1, :length])
        engine_routes = batch.routes[row:row + 1, :length]
        ran = torch.arange(length)[None, :] < length - 1  # every token but the last sampled one
        # (length - 1) tokens x 2 layers, each top-2 set as the float64 routers chose it
        assert routing_agreement(engine_routes, expected, ran).tolist() == [2.0 * (length - 1)] * 2, row
        assert int(engine_routes.max()) < 8 and int(engine_routes.min()) >= 0
    # the stacked rollout of several groups keeps each row's routes (right-padded with expert 0)
    other = engine.generate(PROMPTS[:1], seed=2)
    stacked = concat_rollouts([batch, other], pad_id=tokenizer.pad_token_id)
    assert stacked.routes.dtype == torch.int16
    assert torch.equal(stacked.routes[:3, :ids.shape[1]], batch.routes)
    assert torch.equal(stacked.routes[3:, :other.routes.shape[1]], other.routes)
    assert int(stacked.routes[3:, other.routes.shape[1]:].abs().sum()) == 0
