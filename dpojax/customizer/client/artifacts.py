"""Run artifacts of a Customizer submission, written under the run's workdir (all redacted).

- `dataset/training/training_file.jsonl`, `dataset/validation/validation_file.jsonl`: NAT's exact
  JSONL and ordered 80/20 split.
- `submission.json`: the job reference (NAT's `TrainingJobRef`: run_id, backend, metadata), the
  hosts, the job payload and the settings (token masked).
- `job_status.jsonl`: one line per status poll (time, status, progress, epochs, losses, message).
- `final_metrics.json`: NAT's keys in NAT's order (run_id, timestamp, status, message, progress,
  num_collection_runs, total_trajectory_groups, collection_summary, job_metadata), then dpojax's
  `exit_code` and `deployment`.
- `deployment.json`: the deployment as last seen (when deploying).
- `customizer.log`: the run's log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from dpojax.customizer.client.auth import Redactor
from dpojax.data.pairs import PreferencePair

SUBMISSION = "submission.json"
STATUS_LOG = "job_status.jsonl"
FINAL_METRICS = "final_metrics.json"
DEPLOYMENT = "deployment.json"
RUN_LOG = "customizer.log"
DATASET_DIR = "dataset"
BACKEND = "nemo-customizer"


def _timestamp() -> str:
    return datetime.now().isoformat()


class Artifacts:
    """Writes the files above, passing every value through the redactor."""

    def __init__(self, workdir: Path, redactor: Redactor) -> None:
        self.workdir = Path(workdir)
        self.redactor = redactor
        self.workdir.mkdir(parents=True, exist_ok=True)

    def _write_json(self, name: str, value: Any) -> Path:
        path = self.workdir / name
        path.write_text(json.dumps(self.redactor.value(value), indent=2) + "\n", encoding="utf-8")
        return path

    def submission(self, value: Mapping[str, Any]) -> Path:
        return self._write_json(SUBMISSION, dict(value))

    def deployment(self, value: Mapping[str, Any]) -> Path:
        return self._write_json(DEPLOYMENT, dict(value))

    def status(self, value: Mapping[str, Any]) -> None:
        line = json.dumps(self.redactor.value({"timestamp": _timestamp(), **value}))
        with (self.workdir / STATUS_LOG).open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def final_metrics(
        self,
        *,
        run_id: str,
        status: str,
        message: str | None,
        progress: float | None,
        collection_history: Sequence[Mapping[str, Any]],
        total_trajectory_groups: int,
        job_metadata: Mapping[str, Any],
        exit_code: int,
        deployment: Mapping[str, Any] | None,
    ) -> Path:
        """NAT's `final_metrics.json` (key order kept), plus `exit_code` and `deployment`."""
        runs = list(collection_history)
        averages = [float(r.get("avg_reward", 0.0) or 0.0) for r in runs]
        value = {
            "run_id": run_id,
            "timestamp": _timestamp(),
            "status": status,
            "message": message,
            "progress": progress,
            "num_collection_runs": len(runs),
            "total_trajectory_groups": total_trajectory_groups,
            "collection_summary": {
                "total_trajectories": sum(int(r.get("num_trajectories", 0)) for r in runs),
                "total_dpo_pairs": sum(int(r.get("num_dpo_pairs", 0)) for r in runs),
                "avg_reward": sum(averages) / len(averages) if averages else 0.0,
            },
            "job_metadata": dict(job_metadata),
            "exit_code": exit_code,
            "deployment": dict(deployment) if deployment else None,
        }
        return self._write_json(FINAL_METRICS, value)

    def attach_log(self, logger: logging.Logger) -> logging.Handler:
        """Add a redacting file handler for `customizer.log` to `logger`; returns it."""
        handler = logging.FileHandler(self.workdir / RUN_LOG, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(self.redactor)
        logger.addHandler(handler)
        return handler


def collection_from_pairs(run_id: str, pairs: Sequence[PreferencePair]) -> list[dict[str, Any]]:
    """One NAT-style collection entry describing `pairs` (used when the caller has no history)."""
    rewards = [float(p.reward) for p in pairs if isinstance(p.reward, int | float)]
    return [
        {
            "run_number": 0,
            "timestamp": _timestamp(),
            "run_id": run_id,
            "num_trajectories": len(pairs),
            "num_dpo_pairs": len(pairs),
            "avg_reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "min_reward": min(rewards) if rewards else 0.0,
            "max_reward": max(rewards) if rewards else 0.0,
        }
    ]


def trajectory_groups(pairs: Sequence[PreferencePair]) -> int:
    """Number of example groups (distinct `example_id`; a pair without one is its own group)."""
    ids = set()
    for i, p in enumerate(pairs):
        ids.add(p.metadata.get("example_id", f"__pair_{i}"))
    return len(ids)
