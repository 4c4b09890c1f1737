"""Entry points that README documented before the package was reorganised still import, and
are the same objects as at their new homes."""

from __future__ import annotations


def test_old_names_are_the_new_objects():
    import dpojax.collect.sampler
    import dpojax.losses
    import dpojax.models.sampler
    import dpojax.train.losses

    assert dpojax.losses.preference_loss is dpojax.train.losses.preference_loss
    assert dpojax.losses.LOSS_TYPES == dpojax.train.losses.LOSS_TYPES
    assert dpojax.collect.sampler.generate is dpojax.models.sampler.generate
