"""A user workflow defined outside dpojax, loaded by import path in the tests."""

from dpojax.data.events import TTCEvent


class CountingWorkflow:
    """Asks for K candidates per prompt and scores a candidate by its length (a toy reward)."""

    name = "counting"

    def __init__(self, prompts=("Count to three:", "Say yes:"), candidates=4, fail_runs=()):
        self.prompts, self.candidates, self.fail_runs = list(prompts), candidates, set(fail_runs)

    def collect(self, generate, *, run_id, seed):
        if any(run_id.endswith(f"run{i}") for i in self.fail_runs):
            raise RuntimeError(f"simulated failure in {run_id}")
        outputs = generate(self.prompts, self.candidates)
        return [
            TTCEvent(
                example_id=f"{run_id}-{i}",
                turn_id="0",
                turn_index=0,
                candidate_index=k,
                input=prompt,
                output=text,
                score=float(len(text)),
                name="dpo_candidate_move",
            )
            for i, (prompt, outs) in enumerate(zip(self.prompts, outputs, strict=True))
            for k, text in enumerate(outs)
            if text.strip()
        ]

    def evaluate(self, greedy):
        texts = greedy(self.prompts)
        return {"mean_length": sum(len(t) for t in texts) / len(texts)}
