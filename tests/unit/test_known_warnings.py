"""The one list of silenced third-party warnings (nemo_sspo/known_warnings.py) silences what it names
and nothing else, and a GPU host keeps the warnings that are true there."""

import builtins
import re
import warnings

import pytest

from nemo_sspo.known_warnings import KNOWN_WARNINGS, ignore_known_warnings


def _shown(text: str, category: type[Warning], module: str, *, cuda: bool) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ignore_known_warnings(cuda=cuda)
        warnings.warn_explicit(text, category, "issuer.py", 1, module=module)
    return len(seen) == 1


def test_entries_are_well_formed_and_give_a_reason():
    for known in KNOWN_WARNINGS:
        re.compile(known.message)
        re.compile(known.module)
        assert issubclass(getattr(builtins, known.category), Warning)
        assert len(known.why) > 20, known


@pytest.mark.parametrize("text, category, module, cuda, shown", [
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.fusions.fused_layer_norm",
     False, False),
    # on a GPU host a missing Apex is worth knowing
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.fusions.fused_layer_norm",
     True, True),
    ("`load_state_dict` is deprecated and will be removed", FutureWarning, "megatron.core.dist_checkpointing.strategies",
     True, False),
    # the same text from another module, or another text from megatron, still shows
    ("`load_state_dict` is deprecated and will be removed", FutureWarning, "nemo_sspo.trainer.checkpoint", True, True),
    ("something new", UserWarning, "megatron.core.transformer", False, True),
])
def test_silences_what_it_names_and_nothing_else(text, category, module, cuda, shown):
    assert _shown(text, category, module, cuda=cuda) is shown
