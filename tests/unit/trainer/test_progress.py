"""Phase lines of a running step (nemo_sspo.trainer.progress), on a clock the test sets."""

import io

from nemo_sspo.trainer.progress import StepProgress


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_are_throttled_to_one_per_interval_and_none_for_a_short_step():
    clock, out = _Clock(), io.StringIO()
    progress = StepProgress(enabled=True, interval_s=10, total_steps=12, stream=out, clock=clock)
    progress.start_step(3)
    for now, args in ((105, ("generation", 4, 16, "responses")),  # 5 s into the step: too early
                      (112, ("generation", 8, 16, "responses")),  # 12 s: a line
                      (115, ("scoring 16 responses",)),           # 3 s after it: none
                      (118, ("update", 1, 2, "optimizer steps"))):  # 6 s after it: none
        clock.now = now
        progress.phase(*args)
    clock.now = 123  # 11 s after the last line: the micro-batch of the phase the step is in
    progress.micro_batch(3, 8)
    progress.start_step(4)
    clock.now = 128  # 5 s into step 4: none
    progress.phase("refit")
    assert out.getvalue().splitlines() == ["step 3/12 [12 s]: generation, 8/16 responses",
                                           "step 3/12 [23 s]: update, 1/2 optimizer steps, 3/8 micro-batches"]


def test_off_when_disabled_or_at_interval_zero():
    for enabled, interval in ((False, 10), (True, 0)):
        clock, out = _Clock(), io.StringIO()
        progress = StepProgress(enabled=enabled, interval_s=interval, total_steps=1, stream=out, clock=clock)
        progress.start_step(1)
        clock.now += 1000
        progress.phase("generation", 1, 1, "groups")
        assert out.getvalue() == ""
