"""Integration-test fixtures for the warm worker pool (issue 14).

A group that shuts down healthy keeps its workers in the driver's warm pool
(:mod:`polytrain.launchers.pool.warm_pool`), holding their CPUs until the idle timeout.
Within a module, tests run on the workers the tests before them left warm (a module
opts out with ``KEEP_WARM_POOL = False``); every module ends with an empty pool, and
the root ``no_leftover_actors`` check first gives the idle workers back.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _empty_warm_pool(request):
    """Successive tests of a module run on the workers the tests before them left warm.

    As a user's successive trainers in one session do: the pool's reset
    (:mod:`polytrain.launchers.pool.reset`) is exercised by every such test, and each
    saves its new processes' start and imports (a third of the trainer tests' time).
    A module that sets ``KEEP_WARM_POOL = False`` starts every test with an empty pool
    instead: its tests need CPUs that idle pooled workers would hold (Ray Data tasks,
    plain actors, elastic sizing from the free CPUs, Tune) or test the pool itself.
    Every module's pool is emptied when the module ends.
    """
    yield
    if getattr(request.module, "KEEP_WARM_POOL", True):
        return
    from polytrain.launchers.pool import warm_pool as pool

    pool.clear()


@pytest.fixture(autouse=True, scope="module")
def _empty_warm_pool_after_the_module():
    """Every module leaves an empty pool (see ``KEEP_WARM_POOL``)."""
    yield
    from polytrain.launchers.pool import warm_pool as pool

    pool.clear()


@pytest.fixture
def no_leftover_actors(no_leftover_actors):
    """The root check (every CPU free again), after the warm pool gave its idle workers back."""
    yield
    from polytrain.launchers.pool import warm_pool as pool

    pool.clear()
