"""Counting the jitted-step holders (`Stepper`s) the train jobs build."""

from dpojax.jobs.train import trainer as trainer_mod


def count_steppers(monkeypatch) -> list:
    """The list every `Stepper` the train jobs build from now on is appended to (the jobs build
    theirs through `dpojax.jobs.train.trainer`, patched here for the test)."""
    built: list = []

    class Counting(trainer_mod.Stepper):
        def __post_init__(self):
            built.append(self)
            super().__post_init__()

    monkeypatch.setattr(trainer_mod, "Stepper", Counting)
    return built
