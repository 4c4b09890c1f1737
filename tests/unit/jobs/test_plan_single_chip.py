"""Single-chip TPU plan targets: libtpu's default host is a 2x2x1 block of chips, so a slice of
fewer chips gets its own host bounds."""

from dpojax.jobs.plan import _single_host_bounds


def test_single_chip_topologies_get_their_own_host_bounds():
    assert _single_host_bounds("v5e:1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert _single_host_bounds("v6e:1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert _single_host_bounds("v5e:2x1") == {"chips_per_host_bounds": (2, 1, 1)}
    assert _single_host_bounds("v5e:2x2") == {}
    assert _single_host_bounds("v5p:2x2x1") == {}
