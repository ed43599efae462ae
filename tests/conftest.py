import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from dist_pool import DistPool  # noqa: E402

_POOLS: dict[int, DistPool] = {}


def _pool(n: int) -> DistPool:
    if n not in _POOLS:
        _POOLS[n] = DistPool(n)
    return _POOLS[n]


@pytest.fixture(scope="session")
def dist2():
    """Two real gloo ranks (persistent for the session)."""
    return _pool(2)


@pytest.fixture(scope="session")
def dist4():
    """Four real gloo ranks (persistent for the session; oversubscribed on 2 cores)."""
    return _pool(4)


def pytest_sessionfinish(session, exitstatus):
    for p in _POOLS.values():
        p.close()
