"""Shared fixture for multi-process tests: ``run_distributed(fn, world_size, *args)``.

Each call starts ``world_size`` fresh processes (``torch.multiprocessing``, start method
"forkserver"), joins a gloo process group on a free localhost port, runs
``fn(rank, world_size, *args)`` and returns the per-rank results. A child's exception is
re-raised in the test with the child's traceback; a hung run is killed after a timeout.

The fork server (one per pytest process, started at the first call) imports torch, megatron-core
and the trainer once (:data:`_PRELOAD`); each child is forked from it with those loaded and the
launching test's environment, and imports only the test module itself. With start method "spawn"
every child imported them again: measured on this 2-core machine, three files of the distributed
tests (metric reduction, vocab-parallel, data balance) took 47 s with "spawn" and 22 s with
"forkserver". Still, every world costs a fork and a gloo set-up, so group many checks into one
``fn``. ``fn``, ``args`` and the return values must be picklable: ``fn`` is a
module-level function of the test module.

On a loaded machine gloo's set-up itself can fail: measured beside 8 CPU-burning processes on 2
cores, 1 run in 8 of a 2-rank test had a rank's ``init_process_group`` fail with "Gloo
connectFullMesh failed ... Connection closed by peer" while its peer still waited in its own
set-up, before ``fn`` ran. Such a world is torn down and launched again on a fresh port, up to
:data:`_SETUP_ATTEMPTS` times; a failure inside ``fn`` is never retried. How to check it: run the
fast distributed tests 20 times beside one busy loop per core (tests/README.md).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TIMEOUT_S = 120.0
_GRACE_S = 5.0  # after one rank fails, how long the others get to finish before being killed
_SETUP_ATTEMPTS = 3  # launches of a world whose gloo set-up failed (module docstring)
_SETUP = "setup"  # a rank's report that init_process_group failed: fn never ran there


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank, world_size, port, timeout_s, fn, args, results, environ):
    """Child entry: take the launching test's environment ``environ`` (a child forked from the fork
    server would otherwise have the server's), set up gloo, run ``fn``, report ``(rank, status,
    pickled value or traceback)`` with status True (done), False (``fn`` failed) or :data:`_SETUP`
    (the gloo set-up failed)."""
    os.environ.clear()
    os.environ.update(environ)
    # WORLD_SIZE and RANK as torchrun sets them: load_config checks the layout against WORLD_SIZE.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      WORLD_SIZE=str(world_size), RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except BaseException:  # noqa: BLE001 - the parent launches the world again
        results.put((rank, _SETUP, traceback.format_exc()))
        sys.exit(1)
    try:
        # Plain pickle copies tensors by value; torch's queue pickler would pass them through
        # shared memory owned by this process, which is gone once it exits.
        payload = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        # Report before any teardown: closing our sockets makes blocked peers fail too, and the
        # parent shows the first report as the root cause.
        results.put((rank, False, traceback.format_exc()))
        sys.exit(1)
    results.put((rank, True, payload))
    dist.destroy_process_group()


def _import_roots(*functions) -> list[str]:
    """Directories that make the functions' modules importable by name in a spawned child."""
    roots = []
    for function in functions:
        module = sys.modules[function.__module__]
        path = os.path.abspath(module.__file__)
        for _ in range(function.__module__.count(".") + 1):
            path = os.path.dirname(path)
        roots.append(path)
    return roots


def _run(fn, world_size: int, *args, timeout_s: float = _TIMEOUT_S, grace_s: float = _GRACE_S) -> list:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(1, _SETUP_ATTEMPTS + 1):
        values, failures, setup_failed = _launch(fn, world_size, args, timeout_s, grace_s)
        if not setup_failed or attempt == _SETUP_ATTEMPTS:
            break
        # a warning, so that a passing run's summary still shows the retry
        warnings.warn(f"run_distributed: the gloo set-up failed (attempt {attempt} of {_SETUP_ATTEMPTS}), "
                      f"launching the world again:\n{next(iter(failures.values()))}", RuntimeWarning, stacklevel=2)
    if failures:  # the first report is the root cause; later ones are usually broken peers
        rank, first = next(iter(failures.items()))
        others = sorted(set(failures) - {rank})
        raise RuntimeError(f"rank {rank} of {world_size} failed (also failed: {others}):\n{first}")
    if len(values) < world_size:
        raise TimeoutError(
            f"distributed run did not finish in {timeout_s:.0f} s (ranks done: {sorted(values)})"
        )
    return [values[rank] for rank in range(world_size)]


_PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers", "nemo_sspo.megatron",
            "nemo_sspo.trainer.setup"]
"""Modules the fork server imports once (torch, megatron-core and the trainer: about 8 s of a fresh
interpreter on this 2-core machine), so that each child forked from it starts with them loaded."""


def _context():
    """multiprocessing's fork-server context, its server preloading :data:`_PRELOAD`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _launch(fn, world_size: int, args: tuple, timeout_s: float, grace_s: float) -> tuple[dict, dict, bool]:
    """One launch of the world on a fresh port: ``(values, failures, whether a set-up failed)``."""
    ctx = _context()
    results = ctx.SimpleQueue()
    port = _free_port()
    # Children unpickle `fn` and `_child` by module name: put their roots first on sys.path
    # (copied into the children at start) so another `conftest`/test module cannot shadow them.
    saved_path = list(sys.path)
    sys.path[:0] = _import_roots(fn, _child)
    try:
        procs = [
            ctx.Process(
                target=_child, args=(rank, world_size, port, timeout_s, fn, args, results, dict(os.environ)),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
    finally:
        sys.path[:] = saved_path
    return _collect(procs, results, world_size, timeout_s, grace_s)


def _collect(procs, results, world_size: int, timeout_s: float, grace_s: float) -> tuple[dict, dict, bool]:
    """Waits for every rank until the first failure (plus the grace) or the deadline; returns
    ``(values by rank, failures by rank in report order, whether a rank's set-up failed)``."""
    deadline = time.monotonic() + timeout_s
    values, failures, setup_failed = {}, {}, False
    while len(values) + len(failures) < world_size and time.monotonic() < deadline:
        while not results.empty():
            rank, status, payload = results.get()
            if status is True:
                values[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                setup_failed |= status == _SETUP
        for rank, proc in enumerate(procs):
            silent = rank not in values and rank not in failures
            if silent and proc.exitcode is not None and results.empty():
                failures[rank] = f"exited with code {proc.exitcode} without reporting (killed?)"
        if failures:  # the other ranks may be stuck in a collective: give them a short grace
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.02)
    for proc in procs:
        proc.join(timeout=1.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return values, failures, setup_failed


@pytest.fixture(scope="session")
def run_distributed():
    """``run_distributed(fn, world_size, *args, timeout_s=120, grace_s=5) -> [fn result of rank 0, 1, ...]``.

    ``fn(rank, world_size, *args)`` runs in each spawned process after
    ``torch.distributed.init_process_group("gloo")`` (default group = all ranks; build
    subgroups with ``dist.new_group`` on every rank). Raises ``RuntimeError`` with the child's
    traceback when any rank raises, ``TimeoutError`` when ranks hang. After the first failure the
    other ranks get ``grace_s`` seconds to finish (what they report of it is lost after that).
    """
    return _run
