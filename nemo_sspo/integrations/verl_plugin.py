"""Import target for verl's ``VERL_USE_EXTERNAL_MODULES``: runs the verl adapter's ``install()``.

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` (comma-separated) at ``import
verl`` in every process: driver, task runner and Ray workers. Set it where those processes get
their environment, e.g. ``ray_kwargs.ray_init.runtime_env.env_vars`` (examples/integrations/verl/
sspo_grpo.yaml). Loss settings come from ``NEMO_SSPO_VERL_LOSS_ARGS``
(:func:`nemo_sspo.integrations.verl.loss_args_from_env`).
"""

from nemo_sspo.integrations.verl import install, loss_args_from_env

install(loss_args_from_env())
