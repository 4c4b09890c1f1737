"""The modes of `config.mode` and the job that runs each: `module:function` names, resolved by
`dpojax.jobs.run_job` when the mode runs (so the config never imports a job)."""

from __future__ import annotations

JOBS = {
    "train": "dpojax.jobs.train:train",
    "evaluate": "dpojax.jobs.train:evaluate",
    "export": "dpojax.jobs.train:export",
    "collect": "dpojax.jobs.rounds:collect",
    "loop": "dpojax.jobs.rounds:loop",
    "submit": "dpojax.jobs.submit:submit",
    "plan": "dpojax.jobs.plan:plan",
}
MODES = tuple(JOBS)
