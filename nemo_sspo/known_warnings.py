"""The third-party warnings a run and the test suite silence: one list, each entry with why.

Only warnings of libraries we do not control, matched by message and issuing module, that say
nothing a user can act on; everything else (ours included) shows. ``nemo-sspo`` applies them at
start (:func:`ignore_known_warnings`), and ``tests/conftest.py`` gives them to pytest, so a new
warning of a dependency shows in the suite's summary and is either fixed or added here with its
reason.
"""

from __future__ import annotations

import builtins
import warnings
from dataclasses import dataclass

__all__ = ["KNOWN_WARNINGS", "KnownWarning", "ignore_known_warnings"]


@dataclass(frozen=True)
class KnownWarning:
    """One silenced warning.

    Attributes:
        message: regular expression matched at the start of the warning's text.
        category: the warning class's name (a builtin warning category).
        module: regular expression matched against the whole name of the module that issues it.
        why: the reason it is silenced.
        cpu_only: silenced only on a host without CUDA (on a GPU it says something true).
    """

    message: str
    category: str
    module: str
    why: str
    cpu_only: bool = False

    def pytest_filter(self) -> str:
        """The entry in pytest's ``filterwarnings`` form (``action:message:category:module``)."""
        return f"ignore:{self.message}:{self.category}:{self.module}"


KNOWN_WARNINGS = (
    KnownWarning(r"(Transformer Engine and )?Apex (is|are) not installed", "UserWarning", r"megatron\.core",
                 "megatron-core 0.16 announces its torch fallbacks at import on a host without TransformerEngine "
                 "and Apex (the CPU setup)", cpu_only=True),
    KnownWarning(r"CUDA_DEVICE_MAX_CONNECTIONS", "UserWarning", r"megatron\.core.*",
                 "megatron-core asks for a CUDA setting on a host without CUDA", cpu_only=True),
    KnownWarning(r"full scope is deprecated", "UserWarning", r"megatron\.core\.transformer\.transformer_config",
                 "a megatron-core 0.16 deprecation raised by its own internals, not by a call of ours"),
    KnownWarning(r"The .megatron\.core\.transformer\.custom_layers", "DeprecationWarning", r"megatron\.core",
                 "a megatron-core 0.16 deprecation raised by its own internals"),
    KnownWarning(r"The following imports from `dynamic_context\.py`", "DeprecationWarning",
                 r"megatron\.core\.inference", "a megatron-core 0.16 deprecation raised by its own internals"),
    KnownWarning(r"MLP requires ffn_hidden_size", "DeprecationWarning", r"megatron\.core\.transformer\.spec_utils",
                 "a megatron-core 0.16 deprecation raised by its own internals"),
    KnownWarning(r"Warning. tp_group is None", "DeprecationWarning", r"megatron\.core\.tensor_parallel\.layers",
                 "a megatron-core 0.16 deprecation raised by its own internals"),
    KnownWarning(r"`load_state_dict` is deprecated", "FutureWarning", r"megatron\.core\.dist_checkpointing",
                 "torch 2.13 deprecates torch.distributed.checkpoint's load_state_dict, which megatron-core 0.16's "
                 "checkpoint loading calls"),
    KnownWarning(r"The ..noload.. loader strategy is deprecated", "DeprecationWarning", r"mlflow\.store",
                 "SQLAlchemy 2.1 deprecates a loader option MLflow's SQLite store still uses"),
    KnownWarning(r"`torch\.jit\.script_method` is deprecated", "DeprecationWarning", r"torch\.jit",
                 "torch 2.13 deprecates torch.jit.script_method, which a dependency uses at import"),
    KnownWarning(r"(torchtitan|veomni|automodel) engine is not available", "UserWarning", r"verl\.workers\.engine",
                 "verl 0.9.1 probes optional training engines we do not install"),
    KnownWarning(r"Ray state API is no longer experimental", "DeprecationWarning", r"ray\.util\.state",
                 "verl 0.9.1 imports Ray's old state API"),
    KnownWarning(r"Please use DTensor instead and we are deprecating ShardedTensor", "FutureWarning",
                 r"nemo_sspo\.megatron\.cpu_shims",
                 "torch 2.13 deprecates ShardedTensor, which megatron-core 0.16's distributed checkpointing builds "
                 "(reported at our CPU device shim, through which the call passes)"),
    KnownWarning(r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                 "FutureWarning", r"(torch\.distributed|nemo_sspo\.megatron\.cpu_shims)",
                 "torch 2.13 deprecates the collectives megatron-core 0.16's distributed optimizer calls (gradient "
                 "reduce-scatter, weight all-gather; reported at torch's c10d logger or at our CPU device shim)"),
)
"""Every silenced warning (module docstring)."""


def ignore_known_warnings(*, cuda: bool) -> None:
    """Silences :data:`KNOWN_WARNINGS` in this process (the ``cpu_only`` ones only when ``cuda`` is False)."""
    for known in KNOWN_WARNINGS:
        if not (known.cpu_only and cuda):
            warnings.filterwarnings("ignore", message=known.message, category=getattr(builtins, known.category),
                                    module=known.module)
