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


@pytest.fixture
def dist8():
    """Eight real gloo ranks (tp x pp x dp on one mesh), closed after the test: 8 idle ranks hold
    ~5 GiB, and two xdist workers each keeping a pool would crowd the CI machine's 24 GiB. One
    test sends it all its jobs."""
    pool = DistPool(8)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def one_thread():
    """One intra-op thread for tests that train in this process (the 2-core CI machine also runs
    the gloo pool's ranks)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def deepspeed_one_rank(monkeypatch):
    """One process as torchrun would start it (DeepSpeed builds its 1-rank group from these
    variables) on DeepSpeed's CPU accelerator; the process group is destroyed afterwards.
    Yields a function that points MASTER_PORT at a fresh port (for a second build)."""
    import torch.distributed as dist
    from dist_pool import _free_port

    def new_port() -> None:
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    new_port()
    try:
        yield new_port
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def pytest_sessionfinish(session, exitstatus):
    for p in _POOLS.values():
        p.close()


_POOL_FIXTURES = {"dist2", "dist4", "dist8"}


def pytest_collection_modifyitems(config, items):
    """The tests marked `slow` (each ~10-100 s on the CI's two cores) first, the rest in file
    order: with two xdist workers, a 100 s test collected near the end ran alone at the end of
    the suite; started first, it overlaps the many short ones.

    The tests marked `torchrun` share one xdist group (`--dist loadgroup`, scripts/test.sh), so
    one worker runs them one after another while the other takes the rest: two launches at
    once (4-9 fresh processes each on 2 cores) slowed each other several-fold, stretched the
    suite and pushed the fault tests' exit bounds and the c10d rendezvous towards their
    limits."""
    for item in items:
        # a test on the rank pools runs gloo ranks, whether or not it says so: the fast tier
        # (`-m "not dist"`) leaves it out
        if _POOL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.dist)
        if item.get_closest_marker("torchrun") is not None:
            item.add_marker(pytest.mark.xdist_group("torchrun"))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
