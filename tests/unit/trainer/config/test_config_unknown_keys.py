"""Unknown keys fail at load with the key that was meant: typed overrides (Hydra would suggest '+')
and keys added with '+' (Hydra keeps them, the dataclasses would silently drop them)."""

import pytest

from nemo_sspo.cli import load_config


@pytest.mark.parametrize("overrides, message", [
    (["+loss.params.kl_coeff=0.05"], r"loss\.params\.kl_coeff: SSPOLossConfig .* no field 'kl_coeff'; did you mean 'kl_coef'\?"),
    (["loss=grpo", "+loss.params.gamma=2.2"], r"'gamma' is a field of the losses \['sspo'\], not of 'grpo'"),
    (["loss=grpo", "loss.params.gamma=2.2"], r"'gamma' is a field of the losses \['sspo'\], not of 'grpo'"),
    (["+trainer.max_stepz=3"], r"trainer\.max_stepz: trainer has no key 'max_stepz'; did you mean 'trainer\.max_steps'\?"),
    (["trainer.max_stepz=3"], r"did you mean 'trainer\.max_steps'\?"),
    (["+foo=1"], r"foo: the config has no key 'foo'\. Valid keys of the config: model, parallel"),
    (["loss=gspo", "loss.params.segmentation=newline"], r"ratio unit of loss 'gspo' .* is fixed"),
])
def test_unknown_keys_name_the_key_meant(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=overrides)


def test_known_keys_still_apply():
    cfg = load_config(overrides=["loss.params.kl_coef=0.05", "++trainer.max_steps=3"])
    assert cfg.loss.params.kl_coef == 0.05 and cfg.trainer.max_steps == 3
