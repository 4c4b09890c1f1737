"""The modes of `config.mode` and the job that runs each: `module:function` names, resolved by
`dpojax.jobs.run_job` when the mode runs (so the config never imports a job), and the line that
describes each (`--help`)."""

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
SUMMARIES = {
    "train": "DPO training, resuming from the workdir's checkpoints; exports and reports at the end",
    "evaluate": "per-pair log-probs and losses of the workdir's latest checkpoint",
    "export": "the workdir's latest checkpoint as a Hugging Face directory (WORKDIR/export)",
    "collect": "one round of on-policy collection: events and preference pairs",
    "loop": "rounds of collect -> train -> evaluate, keeping the best policy",
    "submit": "preference pairs to a NeMo Customizer service",
    "plan": "the step compiled ahead of time for a target: memory, FLOPs, roofline; no training",
}
