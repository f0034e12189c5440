"""Weight broadcast to a rollout rank of a split world (world 3 = 2 training ranks + 1 rollout rank).

The training ranks run a TP=2 or PP=2 Megatron policy (tied and untied embeddings) on their own
default process group; rank 2 is a rollout rank outside Megatron's world. The buckets rank 2
receives must equal the trainer's ``export_hf_state_dict`` bit for bit, keep the trainer's bucket
boundaries and order, and never hold more than one bucket at a time. Then rank 2 dies in the middle
of a broadcast: the trainer's send fails within the group timeout with an error naming rank 2.
"""

import datetime
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_sspo.megatron import (
    build_policy_model,
    destroy_parallel,
    export_hf_state_dict,
    initialize_parallel,
    iter_hf_weight_buckets,
    load_hf_into_megatron,
)
from nemo_sspo.parallel.weight_broadcast import receive_weight_buckets, send_weight_buckets
from tests.distributed._split_world import resplit

LAYOUTS = ((2, 1, False), (2, 1, True), (1, 2, False), (1, 2, True))  # (tp, pp, tied)
TIMEOUT = datetime.timedelta(seconds=20)


def _config(tied):
    return LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=100, tie_word_embeddings=tied, max_position_embeddings=32)


def _trainer_side(split, tp, pp, tied):
    """Training ranks: export, then stream the same buckets to the rollout rank (rank 0 sends)."""
    config = _config(tied)
    torch.manual_seed(1234)
    hf_state = LlamaForCausalLM(config).state_dict()
    initialize_parallel(tp_size=tp, pp_size=pp, seed=7)
    try:
        model = build_policy_model(config).eval()
        load_hf_into_megatron(model, hf_state, config)
        export = export_hf_state_dict(model, config)
        layer_budget = 1  # one decoder layer per bucket: embeddings, layer 0, layer 1, norm (+ head)
        buckets = iter_hf_weight_buckets(model, config, layer_budget, dst_rank=0)
        if split.rank == 0:
            seen = []

            def recorded():
                for bucket in buckets:
                    seen.append(list(bucket))
                    yield bucket

            stats = send_weight_buckets(recorded(), group=split.refit, receivers=[2], version=10 * tp + pp)
            return {"export": export, "layout": seen, "bytes": stats.bytes, "buckets": stats.buckets,
                    "to_host": stats.bytes_to_host, "version": 10 * tp + pp}
        for _ in buckets:  # rank 1's share of the gathers
            pass
        return {}
    finally:
        destroy_parallel()


def _rollout_side():
    """Rollout rank: receive bucket by bucket; record what it holds at each bucket."""
    received, layout, live, end = {}, [], [], {}

    def stream():
        end["version"] = yield from receive_weight_buckets(group=_SPLIT[0].refit)

    for bucket in stream():
        layout.append(list(bucket))
        live.append(len({t.untyped_storage().data_ptr() for t in bucket.values()}))  # one payload buffer
        received.update({name: tensor.clone() for name, tensor in bucket.items()})
    return {"received": received, "layout": layout, "live": live, "version": end["version"]}


_SPLIT = []


def _split_and_broadcast(rank, world_size, out_dir):
    split = resplit(rank, world_size, 1, TIMEOUT.total_seconds())
    _SPLIT.append(split)
    assert split.is_rollout == (rank == 2) and split.num_training_ranks == 2
    assert list(split.pairs) == ([] if rank == 1 else [0])  # training rank 0 and the rollout rank: one pair
    assert dist.get_world_size() == (1 if rank == 2 else 2)  # each side's own default group
    results = [_rollout_side() if split.is_rollout else _trainer_side(split, tp, pp, tied)
               for tp, pp, tied in LAYOUTS]
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    _kill_mid_broadcast(split, out_dir)
    return None


def _kill_mid_broadcast(split, out_dir):
    """Rank 2 takes one bucket and dies; rank 0 must fail naming it, within the timeout."""
    if split.rank == 2:
        next(receive_weight_buckets(group=split.refit))
        os._exit(17)
    if split.rank == 0:
        big = [{f"w{i}": torch.zeros(1 << 16)} for i in range(50)]
        try:
            send_weight_buckets(iter(big), group=split.refit, receivers=[2])
            message = "no error"
        except RuntimeError as err:
            message = str(err)
        with open(os.path.join(out_dir, "kill.txt"), "w") as f:
            f.write(message)


def test_broadcast_equals_export_bit_for_bit_and_a_dead_rollout_rank_is_named(run_distributed, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)rank 2 of 3 failed.*exited with code 17"):
        run_distributed(_split_and_broadcast, 3, str(tmp_path), timeout_s=240)
    trainer = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    rollout = pickle.loads((tmp_path / "rank2.pkl").read_bytes())
    for (tp, pp, tied), sent, got in zip(LAYOUTS, trainer, rollout, strict=True):
        export = sent["export"]
        # tied: lm_head travels with the embeddings, as the same tensor; it is received as a copy
        assert set(got["received"]) == set(export), (tp, pp, tied)
        for name, tensor in export.items():
            assert got["received"][name].dtype == tensor.dtype and torch.equal(got["received"][name], tensor), name
        assert got["layout"] == sent["layout"] and sent["buckets"] == len(sent["layout"]) == 4
        assert got["live"] == [1] * 4  # every bucket arrives as one buffer, released before the next
        assert got["version"] == sent["version"]  # the end marker carries the sender's version
        assert sent["to_host"] == 0  # a CPU export: no tensor is on a device, nothing is copied to the host
        weights = sum(t.numel() * t.element_size() for b in sent["layout"] for t in (export[n] for n in b))
        assert weights <= sent["bytes"] < weights + 8 * sum(len(b) for b in sent["layout"])  # 8-byte padding only
    message = (tmp_path / "kill.txt").read_text()
    assert "weight broadcast to rollout rank(s) [2] failed after" in message and "died" in message
