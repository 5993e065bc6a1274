"""Integration-test fixtures for the warm worker pool (issue 14).

A group that shuts down healthy keeps its workers in the driver's warm pool
(:mod:`polytrain.launchers.pool.warm_pool`), holding their CPUs until the idle timeout:
on purpose, so the root ``no_leftover_actors`` check first gives them back, and
every test starts with an empty pool (tests stay independent of their order;
the pool's own tests reuse workers within a test).
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _empty_warm_pool():
    """No idle warm workers carried from one test into the next."""
    yield
    from polytrain.launchers.pool import warm_pool as pool

    pool.clear()


@pytest.fixture
def no_leftover_actors(no_leftover_actors):
    """The root check (every CPU free again), after the warm pool gave its idle workers back."""
    yield
    from polytrain.launchers.pool import warm_pool as pool

    pool.clear()
