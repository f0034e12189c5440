"""Every CPU-only workaround megatron-core needs (0.16.1 on Python 3.11, 0.19.2 on 3.12), in one place.

megatron-core assumes a CUDA device in many small spots. On a CPU-only host (gloo backend; the
development and test setup) these shims make the same code paths run. Nothing here changes
behaviour when ``torch.cuda.is_available()`` is True: each public function is a no-op, returns a
``nullcontext`` or returns an empty override dict on GPU.

This is also the compatibility layer across megatron-core versions: the calls nemo_sspo makes
(GPTModel, layer specs, DDP, optimizer, schedules, parallel_state) have the same
signatures in 0.16.1 and 0.19.2; the one difference on CPU is shim 3's ``current_stream``. Shims
detect what is missing, never a version number. Every megatron-core name the product uses, these
shims' internals included, is listed in :mod:`nemo_sspo.megatron.surface`.

Shims (measured with megatron-core 0.16.1 + torch 2.13.0 CPU build, and 0.19.2 + PyPI's torch
2.13.0 CUDA build on a host without a GPU):

1. ``torch.cuda.current_device`` returns ``"cpu"``: layers, p2p buffers and rotary embeddings
   allocate on ``torch.cuda.current_device()``.
2. A CPU RNG tracker replaces Megatron's CUDA one: ``model_parallel_cuda_manual_seed`` and every
   ``get_cuda_rng_tracker().fork()`` (attention dropout runs inside one even at p=0) read CUDA
   generator states, which raise on CPU-only torch. Activation recomputation (Megatron's
   ``CheckpointFunction``) also saves and restores the CUDA generator's state around a recomputed
   forward: with no CUDA generator that state is an empty placeholder and restoring it does nothing
   (the CPU generator and the tracker's states are restored as on GPU).
3. ``cpu_device_context()``: a ``TorchFunctionMode`` that rewrites ``device="cuda"`` to CPU, and
   turns ``torch.cuda.synchronize`` into a no-op and ``torch.cuda.current_stream()`` into a stream
   whose waits return at once (0.19's gradient buffers wait on the current stream for CUDA-graph
   events before every gradient reduction); wrap Megatron's pipeline schedules
   (``torch.zeros([], device="cuda")`` for the token count), its optimizer, and GPTModel
   construction (tied embeddings with PP > 1 call ``weight.data.cuda()``) in it.
4. ``cpu_config_overrides()``: ``TransformerConfig`` fields: CPU initialisation, no fused kernels
   (apex / TE are absent), ``pipeline_dtype=float32`` (gloo p2p), ``batch_p2p_sync=False`` (it
   calls ``torch.cuda.synchronize``), ``batch_p2p_comm=False`` (with virtual pipeline stages the
   batched gloo p2p silently returns wrong activations; we turn it off for every PP layout).
   Sequence parallelism needs no shim: gloo runs the all-gather and reduce-scatter of
   Megatron's sequence-parallel regions (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
   also asynchronous), its global memory buffer allocates on ``torch.cuda.current_device()``
   (shim 1), and the local spec's norms come from
   :class:`nemo_sspo.megatron.sequence_parallel.SequenceParallelTorchNorm` (megatron-core's
   torch norms refuse it).
5. ``attention_mask_for()``: the local attention builds its default causal mask with
   ``device="cuda"``; on CPU we pass an explicit boolean causal mask instead.
6. Gradient clipping: ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` grads;
   the optimizer module's reference to it is replaced by :func:`_clip_grads_cpu`, which applies the
   same coefficient ``max_norm / (total_norm + 1e-6)`` when it is below 1. The total norm itself
   is still Megatron's (all-reduced over the model-parallel ranks).
7. MoE router without TransformerEngine: megatron-core 0.16.1's ``moe_utils`` imports
   ``te_general_gemm`` only when TransformerEngine imports, yet its router gating reads the name
   unconditionally (``NameError``). Where the name is missing it is set to None, the value
   Megatron's own check (``te_general_gemm is not None``) expects for "no TransformerEngine", so
   the router takes its ``torch.mm`` path. This one also applies on a GPU host without
   TransformerEngine; with TransformerEngine the name exists and nothing changes.
8. Parameter type names: megatron-core's optimizers (the distributed optimizer, the mixed-precision
   one) sort parameters by ``Tensor.type()`` and accept only ``torch.cuda.{Float,Half,BFloat16}Tensor``.
   Inside ``cpu_device_context()`` an argument-free ``Tensor.type()`` of a CPU tensor answers with
   its CUDA name (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``), so the same branches run.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "CpuRNGStatesTracker",
    "apply_cpu_shims",
    "attention_mask_for",
    "cpu_config_overrides",
    "cpu_device_context",
    "needs_cpu_shims",
]


def needs_cpu_shims() -> bool:
    """True when no CUDA device is present, i.e. when the shims in this module must be applied."""
    return not torch.cuda.is_available()


class CpuRNGStatesTracker:
    """Named CPU generator states with the interface of Megatron's ``CudaRNGStatesTracker``.

    ``add(name, seed)`` records the CPU generator state after ``torch.manual_seed(seed)``;
    ``fork(name)`` swaps that state in for the duration of the block and stores the advanced state
    back, so tensor-parallel ranks draw different dropout masks, as on GPU.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        """Whether any RNG state was added (Megatron's tracker interface)."""
        return bool(self.states_)

    def reset(self) -> None:
        """Forget every RNG state."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of the RNG states by name."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the RNG states (``get_states`` output)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Register ``name`` seeded with ``seed``; raises ValueError on a reused seed or name."""
        if seed in self.seeds_:
            raise ValueError(f"CPU rng seed {seed} already registered")
        if name in self.states_:
            raise ValueError(f"CPU rng state {name!r} already exists")
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block with generator state ``name``; raises KeyError if it was never added."""
        if name not in self.states_:
            raise KeyError(f"CPU rng state {name!r} was not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def _cpu_current_device() -> str:
    return "cpu"


def _clip_grads_cpu(parameters, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """Shim 6: scales the gradients of ``parameters`` in place so their global norm is <= max_norm."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grad.mul_(coeff)


def apply_cpu_shims() -> bool:
    """Install shims 1, 2 and 6 (no CUDA) and 7 (no TransformerEngine) (idempotent). Returns True
    when the CPU shims were needed (no CUDA).

    Must run before ``model_parallel_cuda_manual_seed``: Megatron's ``initialize_rng_tracker``
    keeps an already-initialised tracker, so the CPU tracker installed here is the one it seeds.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not needs_cpu_shims():
        return False
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = _cpu_current_device
    megatron_optimizer.clip_grad_by_total_norm_fp32 = _clip_grads_cpu
    if not isinstance(megatron_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = _set_no_cuda_rng_state
    return True


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    """Shim 2: the (absent) CUDA generator's state, an empty placeholder."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    """Shim 2: restoring the (absent) CUDA generator's state does nothing."""


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _NoStream:
    """Stand-in for ``torch.cuda.current_stream()`` on CPU: every wait is already satisfied."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_current_stream(device=None) -> _NoStream:
    return _NoStream()


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=<cuda>`` keyword arguments to CPU and ``Tensor.cuda()`` to identity; an
    argument-free ``Tensor.type()`` of a CPU tensor gives its CUDA type name (shim 8).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_context() -> Iterator[None]:
    """Context for Megatron schedules / optimizer on CPU (shim 3); ``nullcontext`` on GPU."""
    if not needs_cpu_shims():
        yield
        return
    synchronize, current_stream = torch.cuda.synchronize, torch.cuda.current_stream
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = _cpu_current_stream
    try:
        with _CudaToCpuMode():
            yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_stream = synchronize, current_stream


def cpu_config_overrides() -> dict[str, Any]:
    """``TransformerConfig`` keyword overrides for CPU (shim 4); empty dict on GPU."""
    if not needs_cpu_shims():
        return {}
    return {
        "use_cpu_initialization": True,
        "pipeline_dtype": torch.float32,
        "batch_p2p_sync": False,
        "batch_p2p_comm": False,
        "gradient_accumulation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }


def attention_mask_for(seq_len: int, device: torch.device,
                       sequence_lengths: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention mask for the local spec on CPU (shim 5).

    Returns a bool tensor [1, 1, S, S], True where a key position is masked: above the diagonal,
    and, for a packed row (``sequence_lengths`` [K] int64 of the sequences laid end to end, summing
    to S), across sequence boundaries, so attention stays within each sequence. Returns None on
    CUDA devices, where Megatron (local or TE spec) builds the causal mask itself from
    ``AttnMaskType.causal``.
    """
    if device.type == "cuda":
        return None
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(diagonal=1)
    if sequence_lengths is not None:
        owner = torch.repeat_interleave(torch.arange(len(sequence_lengths), device=device),
                                        sequence_lengths.to(device))
        mask |= owner[:, None] != owner[None, :]
    return mask.view(1, 1, seq_len, seq_len)
