"""The Triton kernels of nemo_sspo.parallel.triton_chunk, run on CPU by Triton's interpreter.

References are independent float64 computations on the same (exactly representable) input
values: torch.logsumexp / torch.softmax over the row for the forward statistics, float64
autograd of g_lp log p_t + g_H H for the gradient. The end-to-end tests also compare the kernel
path of the public functions with their torch path (a second algorithm, not a reference).

The interpreter is chosen when ``@triton.jit`` decorates, i.e. when triton_chunk is imported, so
the ``kernels`` fixture imports it afresh under TRITON_INTERPRET=1 and forgets it afterwards (a
later import, e.g. on a CUDA machine, compiles the kernels normally). Nothing else imports the
module on CPU: ``test_cpu_import_and_reduction_leave_triton_alone`` checks that.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_sspo.parallel import fused_linear_logprobs_entropy, vocab_parallel_logprobs_entropy
from nemo_sspo.parallel.vocab_parallel import use_triton

triton = pytest.importorskip("triton")
# Numpy, which runs the interpreted kernels, reports what the kernels do on purpose: the running
# max's start (finfo.min) minus a logit, over tau < 1, overflows to -inf and is floored; a +inf
# logit gives inf - inf = NaN, which must reach the output check.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")]

ROOT = Path(__file__).resolve().parents[3]
MODULE = "nemo_sspo.parallel.triton_chunk"
ROWS, N_VALID, V_LOCAL, OTHER = 5, 50, 53, 20  # 50 valid columns: not a multiple of any tile
ALL_NEG_INF_ROW = 3


@pytest.fixture(scope="module")
def kernels():
    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    patch.delitem(sys.modules, MODULE, raising=False)
    module = importlib.import_module(MODULE)
    assert type(module._local_stats_kernel).__name__ == "InterpretedFunction"
    yield module
    sys.modules.pop(MODULE, None)
    patch.undo()


def _logits(dtype, seed=0):
    """``[ROWS, V_LOCAL + OTHER]`` float64 logits rounded to ``dtype``: columns ``[:N_VALID]`` are
    this shard's valid ids, ``[N_VALID:V_LOCAL]`` its padding (30.0, which would dominate if it
    leaked), ``[V_LOCAL:]`` the rest of the vocabulary on another rank."""
    gen = torch.Generator().manual_seed(seed)
    full = 3.0 * torch.randn(ROWS, V_LOCAL + OTHER, generator=gen, dtype=torch.float64)
    full[:, N_VALID:V_LOCAL] = 30.0
    full[0, 0] = 9.0  # max in the first tile
    full[1, [3, 17, 40]] = float("-inf")
    full[2, :40] = float("-inf")  # first tiles empty: the running max starts from the clamp
    full[ALL_NEG_INF_ROW, :N_VALID] = float("-inf")  # nothing in this shard
    full[4, :N_VALID] = torch.linspace(-6.0, 6.0, N_VALID)  # max rises in every tile
    return full.to(dtype)


def _shard_and_vocab(full):
    """(this shard ``[ROWS, V_LOCAL]`` as a strided view, float64 true-vocabulary rows)."""
    vocab = torch.cat([full[:, :N_VALID], full[:, V_LOCAL:]], dim=1).double()
    return full[:, :V_LOCAL], vocab


def _acc(dtype):
    return torch.promote_types(dtype, torch.float32)


def _tolerance(dtype):
    # Sums of <= 50 terms in [0, 1]: relative error <= 50 eps (3e-6 in fp32) on S0 and S1, so on
    # log Z and H (values ~5) a few 1e-6 at worst (4e-7 measured); fp64 the same at eps = 1e-16.
    return 1e-12 if dtype == torch.float64 else 5e-6


@pytest.mark.parametrize("tile", [16, None])  # 16: four tiles, the last partial; None: one tile
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_local_stats_give_float64_log_normaliser_and_entropy(kernels, dtype, temperature, tile):
    shard, _ = _shard_and_vocab(_logits(dtype))
    stats = kernels.chunk_local_stats(shard[:, :N_VALID], 1.0 / temperature, _acc(dtype), tile=tile)
    assert stats.dtype == _acc(dtype) and stats.shape == (ROWS, 3)

    rows = [r for r in range(ROWS) if r != ALL_NEG_INF_ROW]
    z = shard[rows, :N_VALID].double() / temperature
    raw_max, sum_exp, sum_exp_shifted = stats[rows].double().unbind(-1)
    # c is the raw max exactly (max is an exact operation).
    assert torch.equal(raw_max, shard[rows, :N_VALID].double().amax(-1))
    # log Z = m + log S0; H = log S0 - S1 / S0 (module docstring of vocab_parallel).
    log_normaliser = raw_max / temperature + sum_exp.log()
    entropy = sum_exp.log() - sum_exp_shifted / sum_exp
    p = torch.softmax(z, dim=-1)
    ref_entropy = -torch.where(p > 0, p * torch.log_softmax(z, dim=-1), 0.0).sum(-1)
    torch.testing.assert_close(log_normaliser, torch.logsumexp(z, -1), rtol=0, atol=_tolerance(dtype))
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=_tolerance(dtype))
    # A shard row of only -inf: the clamped max and exact zero sums (no NaN).
    lowest = torch.finfo(_acc(dtype)).min
    assert stats[ALL_NEG_INF_ROW].tolist() == [lowest, 0.0, 0.0]


@pytest.mark.parametrize("layout", ["one row", "column-major"])
def test_local_stats_of_one_row_and_of_non_unit_column_stride(kernels, layout):
    shard, _ = _shard_and_vocab(_logits(torch.float32, seed=1))
    block = shard[:1, :N_VALID] if layout == "one row" else shard[:, :N_VALID].t().contiguous().t()
    assert layout == "one row" or block.stride(1) == ROWS
    stats = kernels.chunk_local_stats(block, 1.0 / 0.7, torch.float32, tile=16).double()
    rows = [0] if layout == "one row" else [0, 1, 2, 4]
    z = block[rows].double() / 0.7
    torch.testing.assert_close(stats[rows, 0] / 0.7 + stats[rows, 1].log(), torch.logsumexp(z, -1),
                               rtol=0, atol=1e-5)


def _reference_gradient(vocab, targets, temperature, grads, with_entropy):
    """float64 d(g_lp log p_t + g_H H)/d logits over the true vocabulary, the target term
    g_lp / tau (added by vocab_parallel._set_target_entries, not by the kernel) removed, and the
    per-row ``(c, log S0, c1, c0)`` the kernel takes, from the same float64 quantities."""
    logits = vocab.clone().requires_grad_(True)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logprobs = logp_all.gather(1, targets[:, None])[:, 0]
    # -inf ids masked before exp * log (a NaN there would leak into the gradient through where).
    finite = vocab > -torch.inf
    safe_logp = torch.where(finite, logp_all, 0.0)
    entropy = -(torch.where(finite, safe_logp.exp(), 0.0) * safe_logp).sum(-1)
    g_lp, g_h = grads[0], grads[1] if with_entropy else torch.zeros_like(grads[1])
    ((g_lp * logprobs).sum() + (g_h * entropy).sum()).backward()
    grad = logits.grad.clone()
    grad[torch.arange(len(targets)), targets] -= g_lp / temperature
    raw_max = vocab.amax(-1)
    columns = torch.stack([raw_max, torch.logsumexp(vocab / temperature, -1) - raw_max / temperature,
                           -g_h / temperature, -(g_lp + g_h * entropy.detach()) / temperature], dim=1)
    return grad, columns


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_block_grad_matches_float64_autograd(kernels, dtype, temperature, with_entropy):
    full = _logits(dtype, seed=2)
    shard, vocab = _shard_and_vocab(full)
    gen = torch.Generator().manual_seed(3)
    targets = torch.randint(0, vocab.shape[1], (ROWS,), generator=gen)
    targets[0], targets[ALL_NEG_INF_ROW] = 4, N_VALID + 1  # one in this shard, one on the other
    grads = torch.randn(2, ROWS, generator=gen, dtype=torch.float64)
    ref_grad, columns = _reference_gradient(vocab, targets, temperature, grads, with_entropy)

    out = torch.full((ROWS, V_LOCAL), 7.0, dtype=dtype)  # padding columns must stay untouched
    kernels.write_block_grad(shard[:, :N_VALID], columns.to(_acc(dtype)), with_entropy,
                             1.0 / temperature, out[:, :N_VALID], tile=16)
    assert torch.equal(out[:, N_VALID:], torch.full((ROWS, V_LOCAL - N_VALID), 7.0, dtype=dtype))
    # The interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest): one bf16 ulp,
    # 2^-7 relative, instead of half of one.
    if dtype == torch.bfloat16:
        tolerance = dict(rtol=2.0**-7, atol=1e-6)
    else:
        tolerance = dict(rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-6)
    torch.testing.assert_close(out[:, :N_VALID].double(), ref_grad[:, :N_VALID], **tolerance)
    # -inf logits (and the shard row of only -inf) get exactly zero, not NaN.
    assert torch.equal(out[1, [3, 17, 40]], torch.zeros(3, dtype=dtype))
    assert torch.equal(out[ALL_NEG_INF_ROW, :N_VALID], torch.zeros(N_VALID, dtype=dtype))


@pytest.fixture
def kernel_calls(kernels, monkeypatch):
    """Counts the kernel wrappers' calls (vocab_parallel imports them at each call)."""
    calls = []
    for name in ("chunk_local_stats", "write_block_grad"):
        original = getattr(kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return calls


def _run_both_paths(monkeypatch, inputs, function, **kwargs):
    """Outputs and input gradients with NEMO_SSPO_TRITON=1 and =0, loss g_lp.logp + g_H.H."""
    results = []
    for choice in ("1", "0"):
        monkeypatch.setenv("NEMO_SSPO_TRITON", choice)
        leaves = [x.clone().requires_grad_(True) for x in inputs[:-2]]
        logprobs, entropy = function(*leaves, inputs[-2], tp_group=None, vocab_start=0, **kwargs)
        grads = inputs[-1]
        ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()
        results.append((logprobs, entropy, *(leaf.grad for leaf in leaves)))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_vocab_parallel_with_kernels_equals_torch_path(kernels, kernel_calls, monkeypatch, dtype):
    full = _logits(dtype, seed=4)
    full[ALL_NEG_INF_ROW, 0] = 1.0  # every row needs one finite logit at TP 1
    logits = full[:, :V_LOCAL].contiguous()
    targets = torch.tensor([0, 5, 45, 0, 49])  # finite logits, edges of the valid range
    grads = torch.randn(2, ROWS, generator=torch.Generator().manual_seed(5), dtype=_acc(dtype))
    (k_lp, k_h, k_grad), (t_lp, t_h, t_grad) = _run_both_paths(
        monkeypatch, (logits, targets, grads), vocab_parallel_logprobs_entropy,
        vocab_size=N_VALID, temperature=0.7, chunk_size=3)
    assert kernel_calls == ["chunk_local_stats"] * 2 + ["write_block_grad"]  # 2 chunks; 1 backward
    fwd = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(k_lp, t_lp, rtol=0, atol=fwd)
    torch.testing.assert_close(k_h, t_h, rtol=0, atol=fwd)
    # bf16: both round the same fp32 value, the interpreter toward zero (one ulp apart at most).
    bwd = dict(rtol=2.0**-7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=0, atol=fwd / 10)
    torch.testing.assert_close(k_grad.double(), t_grad.double(), **bwd)
    assert torch.equal(k_grad[:, N_VALID:], torch.zeros(ROWS, V_LOCAL - N_VALID, dtype=dtype))
    # And both against float64 log_softmax over the true vocabulary.
    logp_all = torch.log_softmax(logits[:, :N_VALID].double() / 0.7, dim=-1)
    torch.testing.assert_close(k_lp.double(), logp_all.gather(1, targets[:, None])[:, 0],
                               rtol=0, atol=fwd)


def test_fused_output_with_kernels_equals_torch_path(kernels, kernel_calls, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(7, 8, generator=gen)
    weight = torch.randn(V_LOCAL, 8, generator=gen)
    weight[N_VALID:] = 5.0  # padding rows: large logits that would dominate if they leaked
    targets = torch.randint(0, N_VALID, (7,), generator=gen)
    grads = torch.randn(2, 7, generator=gen)
    (k_lp, k_h, k_gh, k_gw), (t_lp, t_h, t_gh, t_gw) = _run_both_paths(
        monkeypatch, (hidden, weight, targets, grads), fused_linear_logprobs_entropy,
        vocab_size=N_VALID, temperature=0.7, chunk_size=4)
    assert kernel_calls == ["chunk_local_stats"] * 2 + ["write_block_grad"] * 2
    for got, want in ((k_lp, t_lp), (k_h, t_h), (k_gh, t_gh), (k_gw, t_gw)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(k_gw[N_VALID:], torch.zeros(V_LOCAL - N_VALID, 8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fused_output_with_kernels_ignores_non_finite_padding_rows(kernels, monkeypatch, bad):
    # Padding rows past vocab_size hold NaN or inf: the kernel path must give the float64
    # gradient of the valid rows (before the fix dL/dh was NaN everywhere: 0 x NaN in G @ W).
    monkeypatch.setenv("NEMO_SSPO_TRITON", "1")
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(7, 8, generator=gen)
    weight = torch.randn(V_LOCAL, 8, generator=gen)
    weight[N_VALID:] = bad
    targets = torch.randint(0, N_VALID, (7,), generator=gen)
    grads = torch.randn(2, 7, generator=gen)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logprobs, entropy = fused_linear_logprobs_entropy(h, w, targets, tp_group=None, vocab_start=0,
                                                      vocab_size=N_VALID, chunk_size=4)
    ((grads[0] * logprobs).sum() + (grads[1] * entropy).sum()).backward()
    ref_h = hidden.double().requires_grad_(True)
    logp_all = torch.log_softmax(ref_h @ weight[:N_VALID].double().t(), dim=-1)
    ref_lp = logp_all.gather(1, targets[:, None])[:, 0]
    ((grads[0].double() * ref_lp).sum() - (grads[1].double() * (logp_all.exp() * logp_all).sum(-1)).sum()).backward()
    torch.testing.assert_close(logprobs.double(), ref_lp.detach(), rtol=0, atol=1e-5)
    # fp32 gradients of O(1) values from sums of 50 terms: within 1e-5 of float64.
    torch.testing.assert_close(h.grad.double(), ref_h.grad, rtol=0, atol=1e-5)
    assert torch.equal(w.grad[N_VALID:], torch.zeros(V_LOCAL - N_VALID, 8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_pos_inf_logits_still_refused(kernels, monkeypatch, bad):
    # The kernels must not drop a NaN (a GPU's max/maximum may): the output check sees it.
    monkeypatch.setenv("NEMO_SSPO_TRITON", "1")
    logits = _logits(torch.float32, seed=7)[:, :N_VALID].contiguous()
    logits[2, 30] = bad
    with pytest.raises(ValueError, match="row 2: its logits contain NaN or \\+inf"):
        vocab_parallel_logprobs_entropy(logits, torch.zeros(ROWS, dtype=torch.int64), tp_group=None,
                                        vocab_start=0, vocab_size=N_VALID)


def test_wrappers_refuse_bad_arguments(kernels):
    block = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="power of two"):
        kernels.chunk_local_stats(block, 1.0, torch.float32, tile=12)
    with pytest.raises(ValueError, match="acc must be"):
        kernels.chunk_local_stats(block, 1.0, torch.bfloat16)
    with pytest.raises(ValueError, match="columns \\[rows, 4\\]"):
        kernels.write_block_grad(block, torch.zeros(2, 4), True, 1.0, torch.zeros(2, 7))
    # column offsets 2 * 2^30 = 2^31 would wrap in the kernels' int32 arithmetic (meta: no memory)
    wide = torch.empty_strided((2, 3), (1, 2**30), device="meta")
    with pytest.raises(ValueError, match="column stride 1073741824"):
        kernels.chunk_local_stats(wide, 1.0, torch.float32)
    with pytest.raises(ValueError, match="past 2\\^31"):
        kernels.write_block_grad(wide, torch.zeros(2, 4, device="meta"), True, 1.0, wide)


def test_use_triton_choice(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("NEMO_SSPO_TRITON", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton(cpu)  # auto: CPU keeps the torch path
    monkeypatch.setenv("NEMO_SSPO_TRITON", "0")
    assert not use_triton(cpu)
    monkeypatch.setenv("NEMO_SSPO_TRITON", "1")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        use_triton(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(cpu)
    monkeypatch.setenv("NEMO_SSPO_TRITON", "yes")
    with pytest.raises(ValueError, match="must be 0, 1 or auto"):
        use_triton(cpu)


def test_cpu_import_and_reduction_leave_triton_alone():
    # A fresh interpreter: importing the package and running the reduction on CPU (forward and
    # backward) must import neither the kernel module nor triton.
    code = (
        "import sys, torch\n"
        "from nemo_sspo.parallel import vocab_parallel_logprobs_entropy as f\n"
        "x = torch.randn(3, 8, requires_grad=True)\n"
        "lp, h = f(x, torch.tensor([0, 1, 2]), tp_group=None, vocab_start=0, vocab_size=8)\n"
        "(lp.sum() + h.sum()).backward()\n"
        f"assert {MODULE!r} not in sys.modules and 'triton' not in sys.modules\n"
    )
    env = {key: value for key, value in os.environ.items()
           if key not in ("NEMO_SSPO_TRITON", "TRITON_INTERPRET")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def compile_for_sm90() -> None:
    """Compile both kernels for an H100/H200 (sm_90) with triton's own ptxas, no GPU needed, for
    the argument kinds the wrappers pass on a GPU (16-aligned pointers and row strides, unit
    column stride), and check the loads and stores are 128-bit vectors. Run in a fresh process
    (``test_kernels_compile_for_sm90``): the interpreter must be off when the module is imported.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nemo_sspo.parallel import triton_chunk

    aligned = [["tt.divisibility", 16]]
    for x, acc, acc_dtype in (("bf16", "fp32", torch.float32), ("fp16", "fp32", torch.float32),
                              ("fp32", "fp32", torch.float32), ("fp64", "fp64", torch.float64)):
        stats = ASTSource(
            triton_chunk._local_stats_kernel,
            {"x_ptr": f"*{x}", "out_ptr": f"*{acc}", "inv_temp_ptr": f"*{acc}", "n_cols": "i32",
             "stride_row": "i32", "stride_col": "i32", "ACC": "constexpr", "LOWEST": "constexpr",
             "TILE": "constexpr"},
            {"ACC": triton_chunk._TL_DTYPES[acc_dtype], "LOWEST": torch.finfo(acc_dtype).min,
             "TILE": 4096, "stride_col": 1},
            {(i,): aligned for i in range(5)})
        grad = ASTSource(
            triton_chunk._block_grad_kernel,
            {"x_ptr": f"*{x}", "columns_ptr": f"*{acc}", "inv_temp_ptr": f"*{acc}",
             "grad_ptr": f"*{x}", "n_cols": "i32", "stride_row": "i32", "stride_col": "i32",
             "grad_stride_row": "i32", "grad_stride_col": "i32", "HAS_C1": "constexpr",
             "ACC": "constexpr", "TILE": "constexpr"},
            {"HAS_C1": True, "ACC": triton_chunk._TL_DTYPES[acc_dtype], "TILE": 4096,
             "stride_col": 1, "grad_stride_col": 1},
            {(i,): aligned for i in (0, 1, 2, 3, 4, 5, 7)})
        for source in (stats, grad):
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 8, "enable_fp_fusion": True}).asm["ptx"]
            vector = ".v2.b64" if x == "fp64" else ".v4.b32"
            assert f"ld.global{vector}" in ptx, f"{source.fn.__name__} {x}: no 128-bit loads"
            assert source is stats or f"st.global{vector}" in ptx, f"{x}: no 128-bit stores"


def test_kernels_compile_for_sm90(tmp_path):
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file():
        pytest.skip("this triton build ships no ptxas")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh compile, and nothing left in ~/.triton
    code = "from tests.unit.parallel.test_triton_chunk import compile_for_sm90; compile_for_sm90()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
