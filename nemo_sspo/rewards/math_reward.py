r"""Binary math reward: the last ``\boxed{}`` answer checked against the gold answer by math-verify.

math-verify enforces its timeouts with ``signal.alarm``, which only works in a process's main
thread (docs/pitfalls.md#p16: from a thread, parsing raises and every answer scores 0). Scoring therefore
runs in a pool of worker processes; each worker disables math-verify's own alarms and bounds the
whole check with its own float ``signal.setitimer`` deadline instead.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import re
import signal
import threading
import time
from dataclasses import dataclass

__all__ = ["MathVerifyOptions", "MathVerifyReward", "extract_last_boxed", "parse_gold", "score_response"]

_BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\s*\{")
_SCIENTIFIC = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d+)$")  # 3.83e35 (Minerva's gold style)
# math-verify 0.9's verify() defaults, kept for answers whose numbers are all >= 1 (see _precision_for).
_FLOAT_ROUNDING = 6
_NUMERIC_PRECISION = 15
_SIGNIFICANT = 6  # digits a decimal answer below 1 must match: as 0.333333 for 1/3 by default
_GRACE_S = 5.0  # parent-side slack on top of the workers' own deadlines (process start, pickling)


def extract_last_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, else None.

    Braces are matched by depth counting, so nested groups survive (docs/pitfalls.md#p17):
    ``"\boxed{\frac{1}{2}}"`` -> ``"\frac{1}{2}"``. An opening whose braces never close (a
    truncated response) is skipped in favour of the previous complete one.
    """
    for opening in reversed(list(_BOX_OPENING.finditer(text))):
        content = _braced_content(text, opening.end() - 1)
        if content is not None:
            return content
    return None


def _braced_content(text: str, open_index: int) -> str | None:
    """Text between ``text[open_index] == '{'`` and its matching ``'}'``; None if unbalanced."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1:i]
    return None


def parse_gold(answer: str) -> list:
    r"""math-verify's parse of a gold answer written as bare LaTeX (``"2\sqrt{2}"``, ``"(3,-1)"``).

    Gold answers in the math datasets carry no ``$`` or ``\boxed`` delimiters, and math-verify's
    default extraction misreads many of them when parsed bare (``"2\sqrt{2}"`` -> 2,
    ``"1,2"`` -> 1.2, ``"(3,-1)"`` -> nothing). The answer is therefore parsed as the content of a
    ``\boxed{}``, like the prediction; only when that yields no mathematical object (just the
    string itself, e.g. ``"-1./3"``) is the bare parse used instead. Surrounding ``$`` are dropped
    first. Call under a deadline (math-verify's own timeouts are disabled here).
    """
    from math_verify import parse

    text = answer.strip()
    while len(text) >= 2 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    boxed = _parse_boxed(text)
    if _has_math(boxed):
        return boxed
    return parse(text, parsing_timeout=None) or boxed


def _has_math(parsed: list) -> bool:
    """True when math-verify's result holds a mathematical object, not only its input string."""
    return any(not isinstance(item, str) for item in parsed)


def _parse_boxed(content: str) -> list:
    r"""math-verify's parse of ``\boxed{content}``; a percentage is read as its number.

    math-verify returns only the raw string for ``"17.5\%"``, which then never equals anything,
    so when the first parse finds no mathematical object the ``%`` / ``\%`` signs are dropped
    (the same rule for gold and prediction: ``"8 \%"`` == ``"8"``). A bare scientific literal
    (``"3.83e35"``, which LaTeX parsing reads as 3.83 * e * 35) becomes ``3.83\times10^{35}``.
    """
    from math_verify import parse

    scientific = _SCIENTIFIC.match(content.strip())
    if scientific:
        content = f"{scientific.group(1)}\\times10^{{{scientific.group(2)}}}"
    parsed = parse(f"\\boxed{{{content}}}", parsing_timeout=None)
    if _has_math(parsed) or "%" not in content:
        return parsed
    number = content.replace("\\%", "").replace("%", "").strip()
    return parse(f"\\boxed{{{number}}}", parsing_timeout=None) or parsed


def score_response(response: str, answer: str) -> float:
    """1.0 if math-verify finds the last boxed answer of ``response`` equal to ``answer``, else 0.0.

    The gold ``answer`` is parsed by :func:`parse_gold`. Runs math-verify with its own timeouts
    disabled: call it under a deadline (see :class:`MathVerifyReward`), not directly on untrusted
    text in a latency-critical path.
    """
    boxed = extract_last_boxed(response)
    if boxed is None:
        return 0.0
    from math_verify import verify  # imported in the worker processes only

    gold = parse_gold(answer)
    pred = _parse_boxed(boxed)
    if not (gold and pred):
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None, **_precision_for(gold + pred)) else 0.0


def _precision_for(parsed: list) -> dict[str, int]:
    r"""math-verify's ``float_rounding`` / ``numeric_precision`` scaled to the answers' magnitude.

    Both settings are absolute: a decimal literal is rounded to ``float_rounding`` (default 6)
    decimal places, and any other difference is evaluated to ``numeric_precision`` (default 15)
    digits and counted as zero below about ``1.6e-14``. Two values under ``1e-15`` (``1/2^98`` and
    ``1/2^99``, ``2e-20`` and ``1e-20``) therefore compared equal. With ``e`` the decimal exponent
    of the smallest nonzero number in either answer (``floor(log10|x|)``), a value of ``10^e``
    is compared as the defaults compare a value near 1: ``numeric_precision = 15 - e`` digits,
    and ``float_rounding`` reaching the 6th significant digit (``5 - e`` places) but never fewer
    than the default 6 places, so ``0.333333`` still matches ``1/3``. Answers whose numbers are
    all ``>= 1`` keep the defaults: large integers stay exact (``10^{20}+1 != 10^{20}``) and a
    15-digit decimal like Minerva's ``3.83e35`` still matches ``3.83\times10^{35}``.

    Args:
        parsed: math-verify parse results (sympy objects; strings are ignored).

    Returns:
        ``{"float_rounding": int, "numeric_precision": int}`` keyword arguments for ``verify``.
    """
    exponent = min([0, *(_decimal_exponent(x) for x in _numbers_in(parsed))])
    return {"float_rounding": max(_FLOAT_ROUNDING, _SIGNIFICANT - 1 - exponent),
            "numeric_precision": _NUMERIC_PRECISION - exponent}


def _numbers_in(parsed):
    """The numeric sub-expressions of parsed answers: the answer itself, or the numbers inside
    a tuple, set, interval, matrix, equation or expression with symbols (``2x + 10^{-30}``).
    """
    from sympy import Basic, MatrixBase

    for item in parsed:
        if isinstance(item, MatrixBase):
            yield from _numbers_in(list(item))
        elif isinstance(item, Basic):
            if item.is_number:
                yield item
            else:
                yield from _numbers_in(item.args)


def _decimal_exponent(number) -> int:
    """``floor(log10|number|)`` of a sympy number; 0 for zero and for infinite or unevaluable ones."""
    from sympy import Abs, floor, log

    magnitude = Abs(number).evalf(_SIGNIFICANT)  # sympy Floats have no exponent limit: 1/200! works
    if not (magnitude.is_Float and magnitude.is_finite and magnitude.is_positive):
        return 0
    return int(floor(log(magnitude, 10)))


class _Deadline(BaseException):
    """Raised by the worker's timer; a BaseException so math-verify's ``except Exception`` can't eat it."""


def _raise_deadline(signum, frame):
    raise _Deadline


def _score_with_deadline(scorer, response: str, answer: str, timeout_s: float) -> tuple[float, bool]:
    """Worker body: ``(scorer(response, answer), False)`` within ``timeout_s`` seconds, else ``(0.0, True)``."""
    previous = signal.signal(signal.SIGALRM, _raise_deadline)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return float(scorer(response, answer)), False
    except _Deadline:
        return 0.0, True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _warm_up_worker() -> None:
    """Pool initializer: pay the ~1 s sympy import while the trainer is busy elsewhere, and leave
    Ctrl-C to the trainer, which stops the pool itself (the terminal sends SIGINT to every process
    of the job). SIGTERM keeps its default: ``Pool.terminate()`` and multiprocessing's exit handler
    stop workers with it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import math_verify  # noqa: F401

    # Its "timeout disabled" warning is expected: the deadline here is _score_with_deadline's.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


_POOL_HANDLER = "(_handle_workers)"  # the name's end of multiprocessing.Pool's worker-keeping thread


def _quiet_pool_handler_hook(previous):
    """A ``threading.excepthook`` that drops the connection errors of a Pool's worker-keeping thread.

    A stop signal sent to every process of a job (Slurm, ``kill -TERM -<pgid>``) ends the pool's workers
    and the forkserver together; the Pool's handler thread then tries to start new workers through the
    dead forkserver and dies on ``ConnectionRefusedError`` (or ``EOFError``, when the forkserver went
    while answering), printing a traceback before the trainer's
    own stop line. The pool is being stopped anyway, and a pool that lost its forkserver during a run
    is replaced by :class:`MathVerifyReward`'s deadline, so the traceback tells nobody anything; every
    other thread exception goes to ``previous``.
    """
    def hook(args):
        if args.thread is not None and args.thread.name.endswith(_POOL_HANDLER) and issubclass(args.exc_type, (OSError, EOFError)):
            logging.getLogger(__name__).debug("reward pool: %s after its forkserver stopped", args.exc_type.__name__)
            return
        previous(args)

    hook.quiets_pool_handler = True
    return hook


@dataclass
class MathVerifyOptions:
    """Options of the ``math_verify`` reward (the arguments of :class:`MathVerifyReward`), declared when
    it is registered, so they are the schema of its config section's ``options``.
    """

    num_workers: int = 2
    """Processes scoring answers (its timeouts need each worker's main thread), >= 1."""
    timeout_s: float = 5.0
    """Per-answer verification limit in seconds, > 0; a timeout scores 0."""

    def problems(self, key: str) -> list[str]:
        """The worker count and the deadline.

        Args:
            key: where the options stand, put in front of each field's name.

        Returns:
            One message per broken invariant, naming ``key.<field>``.
        """
        checks = ((self.num_workers >= 1, f"{key}.num_workers must be >= 1"),
                  (self.timeout_s > 0, f"{key}.timeout_s must be > 0 (seconds per answer)"))
        return [message for holds, message in checks if not holds]


class MathVerifyReward:
    r"""Reward function ``responses, answers -> [0.0 | 1.0, ...]`` scored in a process pool.

    Args:
        num_workers: worker processes (``forkserver`` start method, started at construction and
            warmed up in the background), >= 1.
        timeout_s: per-response time budget in seconds, > 0; a response that exceeds it scores
            0.0. If a worker stops answering altogether, the pool is replaced and the unanswered
            responses score 0.0. Either way the response counts in :attr:`timeouts`.

    An adversarial answer such as a tower of exponents (``\boxed{9^{9^{9^{9^{9}}}}}``, which sympy
    would expand to a number of hundreds of millions of digits) is cut off by the deadline: it
    scores 0.0 after ``timeout_s`` and the other responses are scored as usual.

    Attributes:
        timeouts: responses that hit their deadline (or whose worker stopped answering) since
            construction; the trainer logs the step's share as ``reward/timeout_frac``.

    Use as a context manager or call :meth:`close`. Scripts that construct it should guard their
    entry point with ``if __name__ == "__main__":`` as for any multiprocessing user.
    """

    _scorer = staticmethod(score_response)

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.timeouts = 0
        self._pool = self._start_pool()

    def __call__(self, responses: list[str], answers: list[str]) -> list[float]:
        """Score ``responses[i]`` against gold ``answers[i]``; returns floats in {0.0, 1.0}.

        Raises:
            ValueError: ``len(responses) != len(answers)``.
            RuntimeError: called after :meth:`close`.
        """
        if len(responses) != len(answers):
            raise ValueError(f"len(responses)={len(responses)} != len(answers)={len(answers)}; "
                             "pass one gold answer per response (repeat it G times per group)")
        if self._pool is None:
            raise RuntimeError("MathVerifyReward is closed; create a new one")
        jobs = [self._pool.apply_async(_score_with_deadline, (self._scorer, r, a, self.timeout_s))
                for r, a in zip(responses, answers, strict=True)]
        rounds = math.ceil(len(jobs) / self.num_workers)
        deadline = time.monotonic() + rounds * self.timeout_s + _GRACE_S
        scores, stuck = [], False
        for job in jobs:
            try:
                score, timed_out = job.get(timeout=max(0.0, deadline - time.monotonic()))
            except multiprocessing.TimeoutError:
                score, timed_out, stuck = 0.0, True, True
            scores.append(score)
            self.timeouts += timed_out
        if stuck:
            self._stop_pool()
            self._pool = self._start_pool()
        return scores

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._stop_pool()
            self._pool = None

    def _stop_pool(self) -> None:
        """``Pool.terminate()``, bounded: it first takes the task queue's lock, which a worker killed
        while holding it (SIGTERM sent to every process of a Slurm job) never releases; after the
        answer deadline plus a grace period the workers are killed (SIGKILL) and the pool is dropped.
        """
        workers = list(self._pool._pool)  # the Pool's worker processes (no public accessor)
        stopper = threading.Thread(target=self._pool.terminate, name="stop-math-verify-pool", daemon=True)
        stopper.start()
        stopper.join(self.timeout_s + _GRACE_S)
        if stopper.is_alive():
            for worker in workers:
                worker.kill()

    def __enter__(self) -> MathVerifyReward:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _start_pool(self):
        # forkserver, not fork: forking the trainer would copy its threads' held locks. The server
        # preloads math-verify once per process, so each (re)started pool is ready in milliseconds.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__, "math_verify"])
        if not getattr(threading.excepthook, "quiets_pool_handler", False):
            threading.excepthook = _quiet_pool_handler_hook(threading.excepthook)
        return context.Pool(self.num_workers, initializer=_warm_up_worker)
