"""The modes of `config.mode`: one `Mode` record each, the only place a mode is described.

The command line's `--help` (`dpojax.main.usage`), the dispatch (`dpojax.jobs.run_job`), a run's
last line (`dpojax.jobs.outputs_line`), the line after a signal (`dpojax.jobs.stop_summary`) and
the table of modes in docs/config.md (`dpojax.config.reference`) all read these records. A job is
named as `module:function` and imported when its mode runs, so the config never imports a job.
"""

from __future__ import annotations

import dataclasses

# What a stopped job says (`Mode.stopped`); the fields come from the job's result and the workdir.
RESUMES_FROM_CHECKPOINT = (
    "{status} at step {step} of {total_steps}; {checkpoint}; rerun the same command to resume"
)
CONTINUES_ROUNDS = (
    "{status} after {rounds_done} finished round(s); they are kept in {workdir} (summary.json so "
    "far); rerun the same command to continue"
)
WRITES_NOTHING_PARTIAL = "{status}: {mode} wrote nothing partial; rerun the same command"


@dataclasses.dataclass(frozen=True)
class Mode:
    """One mode: its name, its job (`module:function`, called as `job(config, workdir)`), the line
    `--help` shows, what it writes in the workdir (in the order a run's last line names them) and
    the line a job stopped by a signal ends with."""

    name: str
    job: str
    summary: str
    outputs: tuple[str, ...]
    stopped: str = WRITES_NOTHING_PARTIAL


_RECORDS = (
    Mode(
        "train",
        "dpojax.jobs.train:train",
        "DPO training, resuming from the workdir's checkpoints; exports and reports at the end",
        (
            "checkpoints",
            "metrics.jsonl",
            "tensorboard",
            "report.md",
            "summary.json",
            "export",
            "export_best",
        ),
        RESUMES_FROM_CHECKPOINT,
    ),
    Mode(
        "evaluate",
        "dpojax.jobs.train:evaluate",
        "per-pair log-probs and losses of the workdir's latest checkpoint",
        ("evaluate/metrics.json", "evaluate/pairs.jsonl"),
    ),
    Mode(
        "export",
        "dpojax.jobs.train:export",
        "the workdir's latest checkpoint as a Hugging Face directory (WORKDIR/export)",
        ("export",),
    ),
    Mode(
        "collect",
        "dpojax.jobs.rounds.collection:collect",
        "one round of on-policy collection: events and preference pairs",
        ("events.jsonl", "pairs.jsonl", "summary.json"),
    ),
    Mode(
        "loop",
        "dpojax.jobs.rounds:loop",
        "rounds of collect -> train -> evaluate, keeping the best policy",
        ("report.md", "summary.json", "final_metrics.json", "export"),
        CONTINUES_ROUNDS,
    ),
    Mode(
        "submit",
        "dpojax.jobs.submit:submit",
        "preference pairs to a NeMo Customizer service",
        ("collect",),
    ),
    Mode(
        "plan",
        "dpojax.jobs.plan:plan",
        "the step compiled ahead of time for a target: memory, FLOPs, roofline; no training",
        ("plan.json",),
    ),
)
MODE_RECORDS: dict[str, Mode] = {m.name: m for m in _RECORDS}
MODES = tuple(MODE_RECORDS)


def mode_table() -> list[str]:
    """The modes as a markdown table (docs/config.md)."""
    lines = ["| mode | what it does | job | writes in the workdir |", "|---|---|---|---|"]
    for m in _RECORDS:
        outputs = ", ".join(f"`{o}`" for o in m.outputs)
        lines.append(f"| `{m.name}` | {m.summary} | `{m.job}` | {outputs} |")
    return lines
