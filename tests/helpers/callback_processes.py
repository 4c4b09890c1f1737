"""Subprocess for tests/unit/jobs/test_callbacks.py: one of 2 JAX processes (one CPU device each)
that run the callback dispatcher of a training run over 8 steps, as the training loop does:
`on_step_end`, then `agree()` at the step boundary, an evaluation when one is agreed.

    python tests/helpers/callback_processes.py PORT PROCESS_ID

Process 0's callback asks for an evaluation at step 2 and a stop at step 5; process 1's own
callback asks for a stop at step 1 (it must never run: hooks run on process 0 only); a callback
marked `all_processes` counts its calls on every process. Prints one JSON line: {"stopped_at",
"stop_by", "evaluated_at", "own_calls", "everywhere_calls"}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

from tests.helpers.processes import join  # noqa: E402


class Asks:
    """Asks for an evaluation at `evaluate_at` and a stop at `stop_at`; counts its calls."""

    def __init__(self, name, evaluate_at, stop_at):
        self.name, self.evaluate_at, self.stop_at, self.calls = name, evaluate_at, stop_at, 0

    def on_step_end(self, step, metrics):
        from dpojax.jobs.train.callbacks import EVALUATE, STOP

        self.calls += 1
        if step == self.stop_at:
            return STOP
        if step == self.evaluate_at:
            return EVALUATE
        return None


class Everywhere:
    all_processes = True

    def __init__(self):
        self.calls = 0

    def on_step_end(self, step, metrics):
        self.calls += 1


def main(port: int, process_id: int) -> None:
    join(port, process_id)
    from dpojax.jobs.train.callbacks import Dispatcher

    own = Asks("eager", 2, 5) if process_id == 0 else Asks("elsewhere", None, 1)
    everywhere = Everywhere()
    hooks = Dispatcher([own, everywhere])
    stopped_at, evaluated_at = None, []
    for step in range(8):
        hooks.call("on_step_end", step, {"loss": 1.0})
        hooks.agree()
        if hooks.evaluate:
            evaluated_at.append(step)
            hooks.evaluated()
        if hooks.stop_by:
            stopped_at = step
            break
    out = {
        "stopped_at": stopped_at,
        "stop_by": hooks.stop_by,
        "evaluated_at": evaluated_at,
        "own_calls": own.calls,
        "everywhere_calls": everywhere.calls,
    }
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
