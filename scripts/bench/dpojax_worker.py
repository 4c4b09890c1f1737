"""dpojax's side of the step benchmark, run in its own subprocess: `tokenize_pairs` ->
`BatchIterator` (the spec's layout) -> `Stepper.train`. Warm-up steps first, then one step per
batch shape of the timed steps that has not been compiled yet, so the timed steps never compile;
a timed step builds the batch on the host, runs the update and waits for its result."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from .measure import peak_rss_gb, timing_summary
from .synthetic import check_tokens, pair_texts


def _tokenized_pairs(data: list[dict], tokenizer) -> list:
    """The pairs through dpojax's tokenizer, checked against the benchmark's token ids."""
    from dpojax.data.pairs import PreferencePair
    from dpojax.data.tokenize import tokenize_pairs

    pairs = []
    for pair in data:
        prompt, chosen, rejected = pair_texts(pair)
        meta = {"example_id": str(pair["turn"]), "turn_id": 0}
        pairs.append(PreferencePair(prompt, chosen, rejected, meta))
    tokenized = tokenize_pairs(pairs, tokenizer).pairs
    got = [
        (
            p.sequence("chosen").tolist(),
            p.sequence("rejected").tolist(),
            min(p.chosen_prompt_len, p.rejected_prompt_len),
        )
        for p in tokenized
    ]
    check_tokens(got, data, "dpojax")
    return tokenized


def _batches(spec: dict, tokenized: list, pad_id: int):
    from dpojax.data.layouts import Buckets
    from dpojax.data.pipeline import BatchIterator

    if spec["buckets"] == "fine":  # every multiple of 64 up to 2048, then powers of two
        buckets = Buckets(lengths=(*range(64, 2049, 64), 4096, 8192))
    else:
        buckets = Buckets()
    return BatchIterator(
        tokenized,
        batch_pairs=spec["pairs_per_step"],
        layout=spec["layout"],
        buckets=buckets,
        shuffle=False,
        num_epochs=None,
        pad_id=pad_id,
    )


def _reference_logps(spec: dict, model, batches, n_pairs: int, chunk: int | None):
    """Per-pair log-probs of the initial model: the reference of every step when precomputed
    (with the seconds that took), else of the first batch only (pairs 0..P-1: compared with
    TRL's). Returns (all chosen, all rejected or None, seconds or None, first-batch log-probs)."""
    from dpojax.train.reference import compute_reference_logps

    P, n_steps = spec["pairs_per_step"], spec["warmup"] + spec["steps"]
    if spec["reference"] != "precomputed":
        first = compute_reference_logps(model, [batches.batch(0, 0)], P, vocab_chunk=chunk)
        return None, None, None, first
    start = time.perf_counter()
    ref_c, ref_r = compute_reference_logps(
        model, (batches.batch(0, s) for s in range(n_steps)), n_pairs, vocab_chunk=chunk
    )
    return ref_c, ref_r, time.perf_counter() - start, (ref_c[:P], ref_r[:P])


@dataclass
class StepRunner:
    """One benchmark step: batch `step` of the iterator (score slots, reference attached) through
    `Stepper.train`, waited for."""

    stepper: object
    batches: object
    pairs_per_step: int
    reference: tuple | None  # (chosen, rejected) precomputed log-probs
    build_times: list = field(default_factory=list)  # seconds building each step's host batch

    def batch(self, step: int) -> dict:
        from dpojax.train.batches import with_score_slots

        return with_score_slots(self.batches.batch(0, step))

    def __call__(self, state, step: int):
        import jax

        from dpojax.train.batches import stack_micro_batches
        from dpojax.train.reference import attach_reference

        start = time.perf_counter()
        batch = self.batch(step)  # once: the Stepper keeps a batch's slots
        if batch["pair_mask"].sum() != self.pairs_per_step:
            raise SystemExit(f"dpojax: batch {step} holds {batch['pair_mask'].sum():.0f} pairs")
        if self.reference is not None:
            batch = attach_reference(batch, *self.reference)
        stacked = stack_micro_batches([batch])
        self.build_times.append(time.perf_counter() - start)
        state, metrics = self.stepper.train(state, stacked)
        jax.block_until_ready((state, metrics))
        return state, metrics, batch


def signature(batch: dict):
    """The step's input shapes: rows x length, and the LM head's slots."""
    slots = batch.get("score_slots")
    return batch["tokens"].shape, None if slots is None else slots.shape


def warm_up(run: StepRunner, state, warmup: int, steps: int):
    """`warmup` steps, then one step per not yet compiled shape of the timed steps. Returns the
    state, the number of extra compiling steps and the seconds all of it took."""
    start = time.perf_counter()
    seen = set()
    for s in range(warmup):
        state, _, batch = run(state, s)
        seen.add(signature(batch))
    compile_steps = 0
    for s in range(warmup, warmup + steps):
        shape = signature(run.batch(s))
        if shape not in seen:
            seen.add(shape)
            state, _, _ = run(state, s)
            compile_steps += 1
    return state, compile_steps, time.perf_counter() - start


def timed_steps(run: StepRunner, state, warmup: int, steps: int) -> dict:
    """The timed steps: their times, losses, batch shapes and the work their batches hold."""
    from dpojax.train.flops import batch_work

    out = dict(times=[], losses=[], shapes=[], work=[0, 0, 0], slots=0, head_positions=0)
    run.build_times.clear()
    for s in range(warmup, warmup + steps):
        start = time.perf_counter()
        state, metrics, batch = run(state, s)
        out["times"].append(time.perf_counter() - start)
        out["losses"].append(float(metrics["loss"]))
        out["work"] = [a + b for a, b in zip(out["work"], batch_work(batch), strict=True)]
        out["shapes"].append(list(batch["tokens"].shape))
        out["slots"] += batch["tokens"].size
        out["head_positions"] += batch.get("score_slots", batch["tokens"]).size
    out["state"] = state
    out["build_times"] = list(run.build_times)
    return out


def _placed(run: StepRunner, step: int) -> dict:
    """Batch `step` as the train loop's prefetch thread leaves it: stacked, reference attached,
    on the devices."""
    import jax

    from dpojax.train.batches import stack_micro_batches
    from dpojax.train.reference import attach_reference

    batch = run.batch(step)
    if run.reference is not None:
        batch = attach_reference(batch, *run.reference)
    return jax.device_put(run.stepper.put(stack_micro_batches([batch]), micro_axis=True)[0])


def device_seconds(run: StepRunner, state, warmup: int, steps: int) -> tuple[object, float]:
    """(state, seconds per step of the compiled step alone): the timed steps' batches placed on
    the devices first, then run back to back and waited for once."""
    import jax

    placed = [_placed(run, s) for s in range(warmup, warmup + steps)]
    state, _ = run.stepper.train_placed(state, placed[0])  # compiles for placed arrays: untimed
    jax.block_until_ready((placed, state))
    start = time.perf_counter()
    for arrays in placed:
        state, metrics = run.stepper.train_placed(state, arrays)
    jax.block_until_ready((state, metrics))
    return state, (time.perf_counter() - start) / steps


def pipelined_seconds(run: StepRunner, state, warmup: int, steps: int, ahead: int = 2):
    """(state, step times, input waits) of the timed steps as `python -m dpojax.main` runs them:
    batches built and placed `ahead` steps ahead on a background thread (`dpojax.train.prefetch`),
    each step's metrics read while the next one runs. An input wait is the time the loop waited
    for the next placed batch."""
    import jax

    from dpojax.train.prefetch import Prefetcher

    order = iter(range(warmup, warmup + steps))
    prefetch = Prefetcher(lambda: _placed(run, next(order)), ahead)
    times, waits, pending = [], [], None
    try:
        last = time.perf_counter()
        for _ in range(steps):
            asked = time.perf_counter()
            arrays = prefetch.get()
            waits.append(time.perf_counter() - asked)
            state, metrics = run.stepper.train_placed(state, arrays)
            if pending is not None:
                jax.device_get(pending)
                now = time.perf_counter()
                times.append(now - last)
                last = now
            pending = metrics
        jax.device_get(pending)
        times.append(time.perf_counter() - last)
    finally:
        prefetch.close()
    return state, times, waits


def _attention_used(spec: dict, row_length: int) -> str:
    """The attention implementation model.attention resolves to for rows of `row_length`."""
    import jax

    from dpojax.models.attention import resolve

    return resolve(spec.get("attention", "auto"), jax.default_backend(), row_length)


def _stepper(spec: dict, model, chunk: int | None):
    """The train state and `Stepper` of the benchmark's settings (sigmoid loss, beta 0.1, AdamW,
    constant learning rate, grad-norm clip 1.0)."""
    from dpojax.train.loss_settings import LossSettings
    from dpojax.train.optim import make_optimizer
    from dpojax.train.reference_choice import KINDS
    from dpojax.train.state import StepConfig, create_train_state
    from dpojax.train.step import Stepper

    cfg = StepConfig(
        reference=KINDS[spec["reference"]](),
        loss=LossSettings(type="sigmoid", beta=0.1),
        vocab_chunk=chunk,
    )
    optimizer, schedule = make_optimizer(
        spec["learning_rate"], schedule="constant", max_grad_norm=1.0, name="adamw"
    )
    graphdef, state = create_train_state(model, optimizer, cfg)
    return state, Stepper(graphdef, optimizer, schedule, cfg, is_lora=False)


def worker_dpojax(spec: dict) -> dict:
    """Times dpojax's step on the spec's model and pairs; returns the worker's result."""
    import jax

    from dpojax.models import from_pretrained
    from dpojax.train.flops import step_flops

    t0 = time.perf_counter()
    data = json.loads(Path(spec["data_path"]).read_text())
    model, tokenizer = from_pretrained(spec["model_dir"], attention=spec.get("attention", "auto"))
    tokenized = _tokenized_pairs(data, tokenizer)
    batches = _batches(spec, tokenized, tokenizer.pad_token_id)
    chunk = spec["vocab_chunk"] or None
    ref_c, ref_r, ref_time, first = _reference_logps(spec, model, batches, len(tokenized), chunk)
    model_config = model.config
    state, stepper = _stepper(spec, model, chunk)
    del model
    reference = None if ref_c is None else (ref_c, ref_r)
    run = StepRunner(stepper, batches, spec["pairs_per_step"], reference)
    setup_time = time.perf_counter() - t0

    warmup, steps = spec["warmup"], spec["steps"]
    state, compile_steps, warm_time = warm_up(run, state, warmup, steps)
    compiles = stepper.train_cache_size()
    t = timed_steps(run, state, warmup, steps)
    recompiles = stepper.train_cache_size() - compiles
    state, device_s = device_seconds(run, t.pop("state"), warmup, steps)
    state, pipelined, waits = pipelined_seconds(run, state, warmup, steps)
    synchronous = sum(t["times"]) / steps
    flops = step_flops(model_config, *t["work"], reference_forward=spec["reference"] == "frozen")
    return dict(
        timing_summary(t["times"]),
        setup_s=setup_time,
        warm_s=warm_time,
        compile_steps=compile_steps,
        compiled_shapes=compiles,
        recompiles_in_timed_steps=recompiles,
        ref_precompute_s=ref_time,
        batch_shapes=t["shapes"],
        attention=sorted({_attention_used(spec, s[-1]) for s in t["shapes"]}),
        computed_tokens_per_step=t["work"][0] / steps,
        padding_fraction=1 - t["work"][0] / t["slots"],
        head_positions_per_step=t["head_positions"] / steps,  # rows x LM-head slots
        model_flops_per_step=flops / steps,
        losses=t["losses"],
        device_s_per_step=device_s,
        outside_s_per_step=synchronous - device_s,
        pipelined_s_per_step=sum(pipelined) / steps,
        pipelined_outside_s_per_step=sum(pipelined) / steps - device_s,
        outside_s_per_step_median=statistics.median(t["times"]) - device_s,
        pipelined_outside_s_per_step_median=statistics.median(pipelined) - device_s,
        host_batch_s_per_step_median=statistics.median(t["build_times"]),
        pipelined_input_wait_s_per_step_median=statistics.median(waits),
        pipelined_step_times=[round(x, 4) for x in pipelined],
        first_batch_logps=dict(chosen=first[0].tolist(), rejected=first[1].tolist()),
        peak_rss_gb=peak_rss_gb(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        jax_version=jax.__version__,
    )
