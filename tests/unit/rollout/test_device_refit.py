"""The refit check (``rollout.refit.verify``), its checksum, and ``model.output_layer_precision``.

Checksums are compared with sums of the same bytes done in Python integers; the refit check runs on
the tiny random Llama in the HF engine (a correct refit, a one-ulp corruption, a bf16 engine fed an
fp32 export, a rollout rank's stream that names its version); the output precision against
float64 logits of the same bf16 values.
"""

import struct
import sys
from types import SimpleNamespace

import pytest
import torch

from nemo_sspo.cli import load_config
from nemo_sspo.models import build_hf_model, load_hf_checkpoint
from nemo_sspo.parallel import weight_checksum
from nemo_sspo.parallel.fused_output import fused_linear_logprobs_entropy
from nemo_sspo.parallel.weight_checksum import tensor_checksum
from nemo_sspo.rollout import HFRolloutEngine
from nemo_sspo.rollout.refit_check import VerifiedRefitEngine, load_verified
from nemo_sspo.rollout.vllm_engine import VLLMRolloutEngine
from nemo_sspo.rollouts import ColocatedSource

MOD = 1 << 64


def _python_checksum(tensor: torch.Tensor, fmt: str) -> tuple[int, int]:
    """(sum x_i, sum (i + 1) x_i) mod 2^64 of the elements' bytes read as signed ints (struct ``fmt``)."""
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    words = struct.unpack(f"<{len(raw) // struct.calcsize(fmt)}{fmt}", raw)
    return sum(words) % MOD, sum((i + 1) * w for i, w in enumerate(words)) % MOD


def _unsigned(pair: torch.Tensor) -> tuple[int, int]:
    return tuple(int(v) % MOD for v in pair.tolist())


@pytest.mark.parametrize("dtype, fmt", [(torch.bfloat16, "h"), (torch.float32, "i"), (torch.float64, "q")])
def test_checksum_equals_integer_sums_of_the_bytes_in_any_chunking(monkeypatch, dtype, fmt):
    values = torch.randn(7, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype) * 1e3
    expected = _python_checksum(values, fmt)
    assert _unsigned(tensor_checksum(values)) == expected
    monkeypatch.setattr(weight_checksum, "CHUNK_ELEMENTS", 4)  # 35 elements in 9 chunks: same sums mod 2^64
    assert _unsigned(tensor_checksum(values)) == expected


def test_checksum_sees_one_ulp_a_swap_the_sign_of_zero_and_the_dtype():
    base = torch.tensor([1.0, 2.0, 3.0, 0.0])
    one_ulp = base.clone()
    one_ulp[2] = torch.nextafter(one_ulp[2], torch.tensor(10.0))
    swapped = base[[1, 0, 2, 3]]
    negative_zero = torch.tensor([1.0, 2.0, 3.0, -0.0])
    reference = _unsigned(tensor_checksum(base))
    assert _unsigned(tensor_checksum(one_ulp))[0] != reference[0]
    assert _unsigned(tensor_checksum(swapped))[0] == reference[0]  # a plain sum misses a swap ...
    assert _unsigned(tensor_checksum(swapped))[1] != reference[1]  # ... the position-weighted one does not
    assert _unsigned(tensor_checksum(negative_zero)) != reference
    assert _unsigned(tensor_checksum(base.bfloat16())) == _python_checksum(base.bfloat16(), "h") != reference


@pytest.fixture(scope="module")
def tiny():
    return load_hf_checkpoint("tiny-random-llama")


def _engine(tiny, dtype=torch.float32):
    config, state_dict, tokenizer = tiny
    return HFRolloutEngine(build_hf_model(config, state_dict).to(dtype), tokenizer, max_new_tokens=4,
                           temperature=1.0)


def _buckets(tiny, seed=5):
    """The tiny model's weights moved a little, in buckets of 3 weights (HF order)."""
    generator = torch.Generator().manual_seed(seed)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in tiny[1].items()}
    names = list(moved)
    return moved, [{n: moved[n] for n in names[i:i + 3]} for i in range(0, len(names), 3)]


class _OneUlpOff:
    """A test engine that loads every bucket but moves one element of ``target`` by one ulp."""

    def __init__(self, inner, target: str) -> None:
        self.inner, self.target = inner, target

    def load_weight_buckets(self, buckets):
        def perturbed():
            for bucket in buckets:
                if self.target in bucket:
                    bad = bucket[self.target].clone()
                    bad.view(-1)[3] = torch.nextafter(bad.view(-1)[3], torch.tensor(float("inf")))
                    bucket = {**bucket, self.target: bad}
                yield bucket
        self.inner.load_weight_buckets(perturbed())

    def read_weights(self, names):
        return self.inner.read_weights(names)


def test_a_correct_refit_passes_and_one_ulp_off_names_the_weight_bucket_and_step(tiny):
    moved, buckets = _buckets(tiny)
    engine = _engine(tiny)
    assert load_verified(engine, iter(buckets), step=4) == len(buckets)
    for name, value in moved.items():
        assert torch.equal(engine.read_weights([name])[name], value), name
    target = "model.layers.1.mlp.up_proj.weight"
    index = next(i for i, b in enumerate(buckets) if target in b)
    with pytest.raises(RuntimeError, match=rf"step 4, .* bucket {index} .* first differing weight: '{target}' "
                                           r"\(1 of the bucket's 3 differ\)"):
        load_verified(_OneUlpOff(_engine(tiny), target), iter(buckets), step=4)


def test_a_bf16_engine_refitted_from_an_fp32_export_passes_and_a_stale_head_does_not(tiny):
    _, buckets = _buckets(tiny)
    engine = _engine(tiny, torch.bfloat16)
    assert load_verified(engine, iter(buckets), step=1) == len(buckets)  # compared in the engine's bf16

    class KeepsOldNorm(HFRolloutEngine):  # drops the final norm from every refit
        def load_weight_buckets(self, stream):
            keep = self.model.state_dict()["model.norm.weight"].clone()
            super().load_weight_buckets(stream)
            self.model.state_dict()["model.norm.weight"].copy_(keep)

    config, state_dict, tokenizer = tiny
    stale = KeepsOldNorm(build_hf_model(config, state_dict), tokenizer, max_new_tokens=4, temperature=1.0)
    with pytest.raises(RuntimeError, match="first differing weight: 'model.norm.weight'"):
        load_verified(stale, iter(buckets), step=9)


def test_a_rollout_rank_check_names_the_version_the_stream_carries(tiny):
    _, buckets = _buckets(tiny)

    def received(version):  # what receive_weight_buckets yields and returns
        yield from buckets
        return version

    inner = _engine(tiny)
    wrapped = VerifiedRefitEngine(inner)
    wrapped.load_weight_buckets(received(3))
    assert wrapped.verified_buckets == len(buckets) and wrapped.stop_token_ids == inner.stop_token_ids
    corrupt = VerifiedRefitEngine(_OneUlpOff(_engine(tiny), "model.embed_tokens.weight"))
    with pytest.raises(RuntimeError, match=r"step 7, .* bucket 0 .*'model.embed_tokens.weight'"):
        corrupt.load_weight_buckets(received(7))
    with pytest.raises(RuntimeError, match="an unnamed step"):
        corrupt.load_weight_buckets(received(None))


def test_an_engine_that_cannot_read_back_is_refused_naming_the_setting(tiny):
    class NoReadBack:
        def load_weight_buckets(self, buckets):
            for _ in buckets:
                pass

    _, buckets = _buckets(tiny)
    with pytest.raises(ValueError, match="the refit check needs an engine that reads its weights back .* NoReadBack does not"):
        load_verified(NoReadBack(), iter(buckets), step=1)
    assert VLLMRolloutEngine.read_weights(None, ["x"]) is None  # vLLM's processed weights: no read-back


def test_the_colocated_source_checks_each_refit_with_its_step(tiny):
    _, buckets = _buckets(tiny)
    engine = _OneUlpOff(_engine(tiny), "lm_head.weight" if "lm_head.weight" in tiny[1] else "model.norm.weight")
    source = ColocatedSource(None, SimpleNamespace(buckets=lambda: iter(buckets)), engine, max_staleness=0, last_step=3,
                             verify_refit=True)
    source.start(0, 0)
    with pytest.raises(RuntimeError, match="after the refit of step 2,"):
        source.after_update(2)


# ---- model.output_layer_precision ------------------------------------------------------------------


def _bf16_head_inputs(seed=0, n=64, h=96, v=300):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=generator) * 2).bfloat16()
    weight = (torch.randn(v, h, generator=generator) * 0.3).bfloat16()
    targets = torch.randint(0, v, (n,), generator=generator)
    return hidden, weight, targets


def _max_error(logprobs: torch.Tensor, hidden, weight, targets, temperature) -> float:
    """Largest |log-prob - float64 log-prob| of the same bf16 values (float64 matmul and softmax)."""
    reference = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, dim=-1)
    return float((logprobs.detach().double() - reference.gather(1, targets[:, None])[:, 0]).abs().max())


def test_fp32_output_layer_is_closer_to_float64_than_bf16_on_the_fused_path():
    hidden, weight, targets = _bf16_head_inputs()
    errors, outputs = {}, {}
    for precision in ("auto", "bf16", "tf32", "fp32"):
        h = hidden.clone().requires_grad_(True)
        logprobs, entropy = fused_linear_logprobs_entropy(h, weight, targets, tp_group=None, vocab_start=0,
                                                          vocab_size=weight.shape[0], temperature=0.7,
                                                          chunk_size=16, precision=precision)
        logprobs.sum().backward()
        assert h.grad.dtype == torch.bfloat16  # gradients come back in the inputs' dtype
        errors[precision], outputs[precision] = _max_error(logprobs, hidden, weight, targets, 0.7), logprobs
    assert torch.equal(outputs["auto"], outputs["bf16"])  # a bf16 model: auto is today's bf16 matmul
    assert torch.equal(outputs["tf32"], outputs["fp32"])  # no TF32 on a CPU: plain fp32
    # bf16 logits of magnitude ~10 are rounded to 2^-8 relative (measured 0.087 after the softmax);
    # fp32 to ~1e-6 (measured 5.7e-6).
    assert errors["fp32"] < 1e-4 < 1e-2 < errors["bf16"], errors
    with pytest.raises(ValueError, match="precision='fp16' must be one of auto, bf16, tf32, fp32"):
        fused_linear_logprobs_entropy(hidden, weight, targets, tp_group=None, vocab_start=0,
                                      vocab_size=weight.shape[0], precision="fp16")


def test_the_hf_engine_head_computes_in_the_output_precision_and_follows_a_refit(tiny):
    config, state_dict, tokenizer = tiny
    engines = {p: HFRolloutEngine(build_hf_model(config, state_dict).to(torch.bfloat16), tokenizer, max_new_tokens=4,
                                  temperature=1.0, output_layer_precision=p) for p in ("auto", "fp32")}
    hidden = (torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()

    def error(engine) -> tuple[float, torch.dtype]:
        head = engine.model.get_output_embeddings()
        with torch.no_grad():
            logits = head(hidden)
        reference = hidden.double() @ head.weight.double().t()
        return float((logits.double() - reference).abs().max()), logits.dtype

    (auto_error, auto_dtype), (fp32_error, fp32_dtype) = error(engines["auto"]), error(engines["fp32"])
    assert (auto_dtype, fp32_dtype) == (torch.bfloat16, torch.float32)
    assert fp32_error < 1e-4 < 1e-3 < auto_error, (fp32_error, auto_error)
    moved, buckets = _buckets(tiny, seed=8)
    engines["fp32"].load_weight_buckets(iter(buckets))  # the head's fp32 copy is recast after a refit
    assert error(engines["fp32"])[0] < 1e-4
    with pytest.raises(ValueError, match="output_layer_precision='half' must be one of"):
        HFRolloutEngine(engines["auto"].model, tokenizer, max_new_tokens=4, temperature=1.0, output_layer_precision="half")


def test_vllm_gets_its_head_dtype_and_refuses_tf32(monkeypatch, tmp_path):
    built = {}
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=lambda **kwargs: built.update(kwargs)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from nemo_sspo.rollout.vllm_engine import build_llm

    build_llm(tmp_path, seed=1, head_dtype="float32")
    assert built["hf_overrides"] == {"head_dtype": "float32"}
    with pytest.raises(ValueError, match="no tf32"):
        VLLMRolloutEngine.build(tmp_path, None, options=None, seed=1, output_layer_precision="tf32")


@pytest.mark.parametrize("overrides, message", [
    (["model.output_layer_precision=fp16"], "model.output_layer_precision='fp16' is unknown; valid: auto, bf16, tf32, fp32"),
    (["model.output_layer_precision=fp32", "parallel.output_chunk_size=null"],
     "needs the fused output layer: set parallel.output_chunk_size"),
    (["model.output_layer_precision=tf32", "rollout.engine.backend=vllm"], "'tf32' has no vLLM counterpart"),
    (["rollout.refit.verify=true", "rollout.engine.backend=vllm"], "rollout.refit.verify=true cannot read vLLM's weights"),
])
def test_bad_settings_fail_at_load_naming_the_field_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=overrides)
    assert load_config(overrides=["model.output_layer_precision=fp32", "rollout.refit.verify=true"]).rollout.refit.verify
