"""ParallelDims: the one place parallel degrees are checked and turned into a mesh shape."""

import pytest

from slapo import ParallelDims
from slapo.errors import SchedulingError
from slapo.profile import meter


def test_for_world_infers_data_parallel():
    dims = ParallelDims.for_world(8, tp=2, pp=2)
    assert (dims.dp, dims.pp, dims.tp) == (2, 2, 2)
    assert dims.world == 8 and dims.shape == (2, 2, 2)
    assert str(dims) == "dp=2 x pp=2 x tp=2"
    assert ParallelDims.for_world(1) == ParallelDims()


def test_for_world_rejects_indivisible_job_naming_the_fix():
    with pytest.raises(SchedulingError, match=r"tp=2 x pp=1 = 2 .* 3 processes.*multiple of 2"):
        ParallelDims.for_world(3, tp=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_degrees_must_be_positive_ints(bad):
    with pytest.raises(SchedulingError, match="must be a positive int"):
        ParallelDims(tp=bad)


def test_of_without_mesh_is_one_rank():
    assert ParallelDims.of(None) == ParallelDims()


def test_meter_reports_a_peak_on_cpu():
    meter.reset_peak("cpu")
    assert meter.peak_bytes("cpu") >= meter.rss_bytes() > 0
    assert "RSS" in meter.peak_kind("cpu")
