"""DPO train-step benchmark: dpojax against TRL's DPOTrainer on the same model, data and loss.

    python scripts/bench_step.py --model tiny --data dense
    python scripts/bench_step.py --model large --data agent --warmup 2 --steps 4

One invocation builds a random Llama (dpojax `init_model`, exported with `save_pretrained`; both
frameworks load that directory), a word-level tokenizer whose vocabulary has exactly the model's
size (token id i is the word `w{i}`, so random token ids become text that tokenizes back to the
same ids in both pipelines; BOS is prepended and EOS appended to completions by each pipeline's own
convention), and random token-level preference pairs. Then, each in its own subprocess (separate
peak RSS, separate threads):
  peak    a jitted float32 matmul benchmark (best GFLOP/s over a few square sizes): the peak the
          model FLOP utilisation (MFU) is measured against
  dpojax  `tokenize_pairs` -> `BatchIterator` (the `--layout`) -> `Stepper.train`
  trl     `DPOTrainer` (scripts/bench_step_trl.py; when torch and trl are installed:
          `pip install -e .[bench]`)
Both train float32, constant learning rate, AdamW, grad-norm clip 1.0, no gradient checkpointing,
sigmoid loss with beta 0.1, a frozen (or precomputed, `--reference precomputed`, for both) reference,
on the same pairs in the same order. A step is timed end to end: building the batch on the host,
the update, and waiting for its result (dpojax) / the time between two `on_step_end` callbacks
(TRL: collation, forward, backward, optimizer, logging). dpojax runs `--warmup` steps and then one
step per batch shape of the timed steps that has not been compiled yet, so the timed steps never
compile; TRL runs `--warmup` steps. The peak and dpojax workers run with glibc's huge-page malloc
(`dpojax.xla_env.hugepage_malloc_env`), as `python -m dpojax.main` does; the TRL worker runs as
TRL users run it, or with it too under `--hugepage-malloc all`.

Data (`--data`):
  dense  8 pairs a step; prompt 64 + completion 64 tokens per sequence (large: 128 + 128)
  agent  TTC-like turns: a 512-1024-token prompt (conversation history; skewed towards short) and
         `--candidates` completions of 8-64 tokens (log-normal, median 16), every pair of them;
         12 pairs a step by default (two turns of 4 candidates)
tokens/s counts the tokens of both sequences of every pair (prompt + completion, the prompt twice),
so it measures the same work in both frameworks whatever dpojax's layout computes. MFU counts the
FLOPs a framework's batch needs (non-padding tokens, the attention its mask allows, the LM head on
scored tokens; x3 for the policy's forward + backward, +1 forward for a frozen reference).

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODELS = {
    "tiny": dict(
        hidden_size=256, num_layers=4, num_heads=4, intermediate_size=704, vocab_size=2048
    ),
    "large": dict(
        hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048, vocab_size=8192
    ),
}
DENSE_LENGTHS = {"tiny": (64, 64), "large": (128, 128)}  # (prompt, completion) tokens
SPECIAL = ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>")  # ids 0..3; word w{i} has id i >= 4
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_WORD = len(SPECIAL)
LAYOUT_CHOICES = ("auto", "padded", "packed", "prefix_shared", "grouped")
# Extra XLA CPU flags for the dpojax and peak workers unless --xla-flags says otherwise: none. On
# the development VM with jax 0.10.2, XLA's default (YNNPACK dot fusions) ran the large model's
# step 14% faster than `--xla_cpu_experimental_ynn_fusion_type=` (Eigen dots), equal on the tiny
# one (docs/benchmarks.md).
DEFAULT_XLA_FLAGS = ""


# ---------------------------------------------------------------------------------------------
# model, tokenizer and data (parent process)


def word_tokenizer(vocab_size: int):
    """A fast word-level tokenizer: `w{i}` <-> id i, whitespace-split, BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        model_max_length=1 << 20,
    )


def build_model_dir(path: Path, size: str, seed: int):
    """Writes the random model + tokenizer as a HF directory; returns its `ModelConfig`."""
    from dpojax.models import ModelConfig, init_model, save_pretrained

    dims = MODELS[size]
    config = ModelConfig(
        model_type="llama",
        num_kv_heads=dims["num_heads"],
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **dims,
    )
    save_pretrained(init_model(config, seed=seed), word_tokenizer(dims["vocab_size"]), path)
    return config


def _words(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_WORD, vocab, size=n).tolist()


def dense_data(n_pairs: int, prompt: int, completion: int, vocab: int, seed: int) -> list[dict]:
    """Token-level pairs: `prompt` tokens with BOS, completions of `completion` tokens with EOS."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_pairs):
        p = _words(rng, prompt - 1, vocab)
        c, r = _words(rng, completion - 1, vocab), _words(rng, completion - 1, vocab)
        out.append(dict(prompt=p, chosen=c, rejected=r, turn=i))
    return out


def agent_data(n_pairs: int, candidates: int, vocab: int, seed: int) -> list[dict]:
    """TTC-like turns: a long prompt, `candidates` short completions, every pair of them."""
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    turn = 0
    while len(out) < n_pairs:
        prompt_len = 512 + int(512 * rng.random() ** 2)  # 512..1024, more short than long
        p = _words(rng, prompt_len - 1, vocab)
        lengths = np.clip(np.rint(rng.lognormal(np.log(16), 0.6, candidates)), 8, 64)
        cands = [_words(rng, int(n) - 1, vocab) for n in lengths]
        for i in range(candidates):
            for j in range(i + 1, candidates):
                c, r = (i, j) if rng.random() < 0.5 else (j, i)
                out.append(dict(prompt=p, chosen=cands[c], rejected=cands[r], turn=turn))
        turn += 1
    return out[:n_pairs]


def text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def pair_texts(pair: dict) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text; each pipeline adds BOS and appends EOS itself."""
    return text(pair["prompt"]), " " + text(pair["chosen"]), " " + text(pair["rejected"])


def expected_sequences(pair: dict) -> tuple[list[int], list[int], int]:
    """(chosen sequence, rejected sequence, prompt length) in token ids."""
    prompt = [BOS_ID, *pair["prompt"]]
    return prompt + pair["chosen"] + [EOS_ID], prompt + pair["rejected"] + [EOS_ID], len(prompt)


# ---------------------------------------------------------------------------------------------
# work counting (the FLOP model is dpojax.train.flops)


def sequence_work(data: list[dict]) -> tuple[int, int, int]:
    """(tokens, causal attention pairs, scored tokens) of the pairs as 2 separate sequences each
    (what a padded trainer such as TRL computes, padding excluded)."""
    tokens = pairs = scored = 0
    for pair in data:
        for seq in ("chosen", "rejected"):
            n = 1 + len(pair["prompt"]) + len(pair[seq]) + 1
            tokens += n
            pairs += n * (n + 1) // 2
            scored += len(pair[seq]) + 1
    return tokens, pairs, scored


# ---------------------------------------------------------------------------------------------
# workers (subprocesses)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def timing_summary(times: list[float]) -> dict:
    return dict(
        s_per_step=sum(times) / len(times),
        s_per_step_median=statistics.median(times),
        s_per_step_min=min(times),
        s_per_step_max=max(times),
        step_times=[round(t, 4) for t in times],
    )


def worker_peak(spec: dict) -> dict:
    """Float32 matmul throughput of a jitted a @ b, per square size: the rate sustained over ~2 s
    of back-to-back calls (under the same load as the steps: the MFU reference) and the fastest
    single call (close to the idle machine's peak when the CPU is shared)."""
    import jax
    import jax.numpy as jnp

    sustained: dict[int, float] = {}
    best_call: dict[int, float] = {}
    matmul = jax.jit(lambda a, b: a @ b)
    for n in (512, 1024, 1536, 2048):
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        matmul(a, b).block_until_ready()
        fastest, calls = math.inf, 0
        start = time.perf_counter()
        while (now := time.perf_counter()) - start < 2.0:
            matmul(a, b).block_until_ready()
            fastest = min(fastest, time.perf_counter() - now)
            calls += 1
        sustained[n] = calls * 2 * n**3 / (time.perf_counter() - start) / 1e9
        best_call[n] = 2 * n**3 / fastest / 1e9
    return dict(
        matmul_peak_gflops=max(sustained.values()),
        matmul_sustained_gflops_by_size=sustained,
        matmul_best_call_gflops=max(best_call.values()),
        matmul_best_call_gflops_by_size=best_call,
    )


def check_tokens(got: list[tuple[list[int], list[int], int]], data: list[dict], who: str):
    for i, (pair, (c, r, k)) in enumerate(zip(data, got, strict=True)):
        want_c, want_r, want_k = expected_sequences(pair)
        if c != want_c or r != want_r or k != want_k:
            raise SystemExit(f"{who}: pair {i} tokenized differently from the benchmark's ids")


def _attention_used(spec: dict, row_length: int) -> str:
    """The attention implementation model.attention resolves to for rows of `row_length`."""
    import jax

    from dpojax.models.attention import resolve

    return resolve(spec.get("attention", "auto"), jax.default_backend(), row_length)


def worker_dpojax(spec: dict) -> dict:
    import jax

    from dpojax.data.layouts import Buckets
    from dpojax.data.pairs import PreferencePair
    from dpojax.data.pipeline import BatchIterator
    from dpojax.data.tokenize import tokenize_pairs
    from dpojax.jobs.build import stack_micro_batches
    from dpojax.models import from_pretrained
    from dpojax.train.flops import batch_work, step_flops
    from dpojax.train.forward import with_score_slots
    from dpojax.train.optim import make_optimizer
    from dpojax.train.reference import attach_reference, compute_reference_logps
    from dpojax.train.state import StepConfig, create_train_state
    from dpojax.train.step import Stepper

    t0 = time.perf_counter()
    data = json.loads(Path(spec["data_path"]).read_text())
    model, tokenizer = from_pretrained(spec["model_dir"], attention=spec.get("attention", "auto"))
    pairs = []
    for pair in data:
        prompt, chosen, rejected = pair_texts(pair)
        meta = {"example_id": str(pair["turn"]), "turn_id": 0}
        pairs.append(PreferencePair(prompt, chosen, rejected, meta))
    tokenized = tokenize_pairs(pairs, tokenizer).pairs
    check_tokens(
        [
            (
                p.sequence("chosen").tolist(),
                p.sequence("rejected").tolist(),
                min(p.chosen_prompt_len, p.rejected_prompt_len),
            )
            for p in tokenized
        ],
        data,
        "dpojax",
    )

    P, warmup, steps = spec["pairs_per_step"], spec["warmup"], spec["steps"]
    if spec["buckets"] == "fine":  # every multiple of 64 up to 2048, then powers of two
        buckets = Buckets(lengths=(*range(64, 2049, 64), 4096, 8192))
    else:
        buckets = Buckets()
    it = BatchIterator(
        tokenized,
        batch_pairs=P,
        layout=spec["layout"],
        buckets=buckets,
        shuffle=False,
        num_epochs=None,
        pad_id=tokenizer.pad_token_id,
    )
    chunk = spec["vocab_chunk"] or None
    cfg = StepConfig(
        reference=spec["reference"],
        loss=(("beta", 0.1), ("loss_type", "sigmoid")),
        vocab_chunk=chunk,
    )
    optimizer, schedule = make_optimizer(
        spec["learning_rate"], schedule="constant", max_grad_norm=1.0, name="adamw"
    )

    # per-pair log-probs of the initial model: the reference of every step when precomputed, else
    # of the first batch only (batch 0 holds pairs 0..P-1; compared with TRL's)
    ref_time = None
    ref_c = ref_r = None
    if spec["reference"] == "precomputed":
        start = time.perf_counter()
        ref_c, ref_r = compute_reference_logps(
            model,
            (it.batch(0, s) for s in range(warmup + steps)),
            len(tokenized),
            vocab_chunk=chunk,
        )
        ref_time = time.perf_counter() - start
        first = ref_c[:P], ref_r[:P]
    else:
        first = compute_reference_logps(model, [it.batch(0, 0)], P, vocab_chunk=chunk)
    logps = dict(chosen=first[0].tolist(), rejected=first[1].tolist())
    model_config = model.config

    graphdef, state = create_train_state(model, optimizer, cfg)
    del model
    stepper = Stepper(graphdef, optimizer, schedule, cfg, is_lora=False)

    def run(state, step):
        batch = with_score_slots(it.batch(0, step))  # once: the Stepper keeps a batch's slots
        if batch["pair_mask"].sum() != P:
            raise SystemExit(f"dpojax: batch {step} holds {batch['pair_mask'].sum():.0f} pairs")
        if ref_c is not None:
            batch = attach_reference(batch, ref_c, ref_r)
        state, metrics = stepper.train(state, stack_micro_batches([batch]))
        jax.block_until_ready((state, metrics))
        return state, metrics, batch

    setup_time = time.perf_counter() - t0
    start = time.perf_counter()

    def signature(batch):  # the step's input shapes: rows x length, and the LM head's slots
        slots = batch.get("score_slots")
        return batch["tokens"].shape, None if slots is None else slots.shape

    seen = set()
    for s in range(warmup):
        state, _, batch = run(state, s)
        seen.add(signature(batch))
    compile_steps = 0
    for s in range(warmup, warmup + steps):  # compile every timed shape before timing
        shape = signature(with_score_slots(it.batch(0, s)))
        if shape not in seen:
            seen.add(shape)
            state, _, _ = run(state, s)
            compile_steps += 1
    warm_time = time.perf_counter() - start
    compiles = stepper.train_cache_size()

    times, work, losses = [], [0, 0, 0], []
    shapes = []
    slots = head_positions = 0
    for s in range(warmup, warmup + steps):
        start = time.perf_counter()
        state, metrics, batch = run(state, s)
        times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
        w = batch_work(batch)
        work = [a + b for a, b in zip(work, w, strict=True)]
        shapes.append(list(batch["tokens"].shape))
        slots += batch["tokens"].size
        head_positions += batch.get("score_slots", batch["tokens"]).size
    recompiles = stepper.train_cache_size() - compiles
    flops = step_flops(model_config, *work, reference_forward=spec["reference"] == "frozen") / steps
    return dict(
        timing_summary(times),
        setup_s=setup_time,
        warm_s=warm_time,
        compile_steps=compile_steps,
        compiled_shapes=compiles,
        recompiles_in_timed_steps=recompiles,
        ref_precompute_s=ref_time,
        batch_shapes=shapes,
        attention=sorted({_attention_used(spec, s[-1]) for s in shapes}),
        computed_tokens_per_step=work[0] / steps,
        padding_fraction=1 - work[0] / slots,
        head_positions_per_step=head_positions / steps,  # rows x LM-head slots (score_slots)
        model_flops_per_step=flops,
        losses=losses,
        first_batch_logps=logps,
        peak_rss_gb=peak_rss_gb(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        jax_version=jax.__version__,
    )


def worker_trl(spec: dict) -> dict:
    """TRL's DPOTrainer on the spec: scripts/bench_step_trl.py (a worker runs this file as a
    script, so its folder is on sys.path)."""
    from bench_step_trl import run_trl

    return run_trl(spec)


WORKERS = {"peak": worker_peak, "dpojax": worker_dpojax, "trl": worker_trl}


# ---------------------------------------------------------------------------------------------
# parent


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_worker(name: str, spec_path: Path, workdir: Path, env: dict) -> dict:
    out = workdir / f"result_{name}.json"
    load = loadavg()
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--worker", name, "--spec", str(spec_path), "--out", str(out)]
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"worker {name} failed with exit status {proc.returncode}")
    result = json.loads(out.read_text())
    result.update(load_before=load, load_after=loadavg(), wall_s=time.perf_counter() - start)
    return result


def fmt(x, spec=",.0f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--data", choices=("dense", "agent"), default="dense")
    parser.add_argument(
        "--layout",
        choices=LAYOUT_CHOICES,
        default="auto",
        help="dpojax batch layout (auto: prefix_shared for dense, grouped for agent data)",
    )
    parser.add_argument("--reference", choices=("frozen", "precomputed"), default="frozen")
    parser.add_argument(
        "--seq",
        type=int,
        default=0,
        help="dense data: tokens per sequence, half prompt and half completion (default: the "
        "model's dense lengths, 128 tiny / 256 large)",
    )
    parser.add_argument(
        "--attention",
        choices=("auto", "reference", "flash", "pallas"),
        default="auto",
        help="dpojax's attention implementation (model.attention)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--pairs-per-step", type=int, default=None, help="dense 8, agent 12")
    parser.add_argument("--candidates", type=int, default=4, help="agent: completions per turn")
    parser.add_argument(
        "--buckets",
        choices=("fine", "pow2"),
        default="fine",
        help="dpojax row lengths: every multiple of 64 (fine) or powers of two (pow2)",
    )
    parser.add_argument(
        "--vocab-chunk", type=int, default=4096, help="dpojax StepConfig.vocab_chunk (0: none)"
    )
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--frameworks", default="dpojax,trl", help="comma-separated subset")
    parser.add_argument(
        "--xla-flags",
        default=None,
        help="extra XLA_FLAGS for the dpojax and peak workers, appended to the environment's "
        "(default: none)",
    )
    parser.add_argument(
        "--hugepage-malloc",
        choices=("dpojax", "all", "none"),
        default="dpojax",
        help="which workers run with glibc's huge-page malloc (dpojax.xla_env.HUGEPAGE_TUNABLE), "
        "as `python -m dpojax.main` does: the peak and dpojax workers (default), all three (TRL "
        "too, for a comparison under the same allocator), or none",
    )
    parser.add_argument(
        "--trl-omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of the TRL worker ('' leaves libgomp's default, spin-waiting: on a "
        "CPU shared with another job that makes torch several times slower)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the model, data and results here")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        result = WORKERS[args.worker](spec)
        Path(args.out).write_text(json.dumps(result))
        return

    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("--steps and --warmup must be >= 1")
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if "trl" in frameworks and not all(
        importlib.util.find_spec(m) for m in ("torch", "trl", "datasets")
    ):
        print("torch / trl not installed (pip install -e .[bench]): dpojax only")
        frameworks = [f for f in frameworks if f != "trl"]
    layout = args.layout
    if layout == "auto":
        layout = "prefix_shared" if args.data == "dense" else "grouped"
    pairs_per_step = args.pairs_per_step or (8 if args.data == "dense" else 12)
    n_pairs = (args.warmup + args.steps) * pairs_per_step
    vocab = MODELS[args.model]["vocab_size"]
    if args.data == "dense":
        prompt, completion = DENSE_LENGTHS[args.model]
        if args.seq:
            prompt, completion = args.seq // 2, args.seq - args.seq // 2
        data = dense_data(n_pairs, prompt, completion, vocab, args.seed)
    else:
        data = agent_data(n_pairs, args.candidates, vocab, args.seed)

    tmp = None
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_step_")
        workdir = Path(tmp.name)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    env.setdefault("JAX_PLATFORMS", "cpu")
    xla_flags = DEFAULT_XLA_FLAGS if args.xla_flags is None else args.xla_flags
    jax_env = dict(env, XLA_FLAGS=(env.get("XLA_FLAGS", "") + " " + xla_flags).strip())
    trl_env = dict(env)
    if args.trl_omp_wait_policy:
        trl_env["OMP_WAIT_POLICY"] = args.trl_omp_wait_policy
    if args.hugepage_malloc != "none":
        from dpojax.xla_env import hugepage_malloc_env

        jax_env = hugepage_malloc_env(jax_env) or jax_env
        if args.hugepage_malloc == "all":
            trl_env = hugepage_malloc_env(trl_env) or trl_env

    from dpojax.train.flops import step_flops

    config = build_model_dir(workdir / "model", args.model, args.seed)
    (workdir / "data.json").write_text(json.dumps(data))
    timed_data = data[args.warmup * pairs_per_step :]
    seq_tokens, seq_attention, seq_scored = sequence_work(timed_data)
    spec = dict(
        model_dir=str(workdir / "model"),
        data_path=str(workdir / "data.json"),
        layout=layout,
        reference=args.reference,
        pairs_per_step=pairs_per_step,
        warmup=args.warmup,
        steps=args.steps,
        buckets=args.buckets,
        vocab_chunk=args.vocab_chunk,
        learning_rate=args.learning_rate,
        attention=args.attention,
    )
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))

    results = {}
    if "dpojax" in frameworks:
        results["peak"] = run_worker("peak", spec_path, workdir, jax_env)
        results["dpojax"] = run_worker("dpojax", spec_path, workdir, jax_env)
    if "trl" in frameworks:
        results["trl"] = run_worker("trl", spec_path, workdir, trl_env)
    if tmp is not None:
        tmp.cleanup()

    tokens_per_step = seq_tokens / args.steps
    trl_flops = step_flops(
        config, seq_tokens, seq_attention, seq_scored, reference_forward=args.reference == "frozen"
    )
    trl_flops /= args.steps
    peak = results.get("peak", {}).get("matmul_peak_gflops")
    summary: dict = dict(
        model=args.model,
        data=args.data,
        layout=layout,
        reference=args.reference,
        buckets=args.buckets,
        vocab_chunk=args.vocab_chunk,
        pairs_per_step=pairs_per_step,
        warmup=args.warmup,
        steps=args.steps,
        sequence_tokens_per_step=tokens_per_step,
        cpu_count=os.cpu_count(),
        matmul_peak_gflops=peak,
        matmul_best_call_gflops=results.get("peak", {}).get("matmul_best_call_gflops"),
        xla_flags=jax_env["XLA_FLAGS"],
        glibc_tunables_dpojax=jax_env.get("GLIBC_TUNABLES", ""),
        glibc_tunables_trl=trl_env.get("GLIBC_TUNABLES", ""),
    )
    for name in ("dpojax", "trl"):
        r = results.get(name)
        if r is None:
            continue
        s = r["s_per_step"]
        summary.update(
            {
                f"{name}_s_per_step": s,
                f"{name}_s_per_step_median": r["s_per_step_median"],
                f"{name}_pairs_per_s": pairs_per_step / s,
                f"{name}_tokens_per_s": tokens_per_step / s,
                f"{name}_peak_rss_gb": r["peak_rss_gb"],
                f"{name}_load": f"{r['load_before']} -> {r['load_after']}",
                f"{name}_step_times": r["step_times"],
                f"{name}_ref_precompute_s": r["ref_precompute_s"],
            }
        )
    if "dpojax" in results:
        r = results["dpojax"]
        summary.update(
            mfu=r["model_flops_per_step"] / r["s_per_step"] / (peak * 1e9),
            dpojax_model_gflop_per_step=r["model_flops_per_step"] / 1e9,
            dpojax_computed_tokens_per_step=r["computed_tokens_per_step"],
            dpojax_head_positions_per_step=r["head_positions_per_step"],
            dpojax_padding_fraction=r["padding_fraction"],
            dpojax_batch_shapes=sorted({tuple(s) for s in r["batch_shapes"]}),
            dpojax_attention=r["attention"],
            dpojax_compile_steps=r["compile_steps"],
            dpojax_recompiles_in_timed_steps=r["recompiles_in_timed_steps"],
            dpojax_setup_s=r["setup_s"],
            dpojax_warm_s=r["warm_s"],
        )
    if "trl" in results:
        r = results["trl"]
        summary.update(
            trl_model_gflop_per_step=trl_flops / 1e9,
            trl_torch_threads=r["torch_threads"],
            trl_attn_implementation=r["attn_implementation"],
            trl_version=r["trl_version"],
            trl_omp_wait_policy=r["omp_wait_policy"],
            torch_version=r["torch_version"],
        )
        if peak:
            summary["trl_mfu"] = trl_flops / r["s_per_step"] / (peak * 1e9)
    if "dpojax" in results and "trl" in results:
        d, t = results["dpojax"], results["trl"]
        summary["ratio"] = t["s_per_step"] / d["s_per_step"]
        summary["ratio_median"] = t["s_per_step_median"] / d["s_per_step_median"]
        diffs = [
            abs(a - b)
            for k in ("chosen", "rejected")
            for a, b in zip(d["first_batch_logps"][k], t["first_batch_logps"][k], strict=True)
        ]
        mags = [abs(b) for k in ("chosen", "rejected") for b in t["first_batch_logps"][k]]
        summary["logps_max_abs_diff"] = max(diffs)
        summary["logps_max_rel_diff"] = max(
            x / max(m, 1e-30) for x, m in zip(diffs, mags, strict=True)
        )
        summary["logps_mean_abs"] = sum(mags) / len(mags)

    print(
        f"\n{args.model} model ({config.num_layers} layers, hidden {config.hidden_size}, vocab "
        f"{config.vocab_size}), {args.data} data, {pairs_per_step} pairs/step, "
        f"{tokens_per_step:,.0f} sequence tokens/step; dpojax layout {layout}, reference "
        f"{args.reference}; {args.warmup} warm-up + {args.steps} timed steps; matmul peak "
        f"{fmt(peak, '.1f')} GFLOP/s\n"
    )
    print("| framework | s/step (mean / median) | pairs/s | tokens/s | MFU | peak RSS GB | load |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in ("dpojax", "trl"):
        if name not in results:
            continue
        mfu = summary.get("mfu" if name == "dpojax" else "trl_mfu")
        print(
            f"| {name} | {summary[f'{name}_s_per_step']:.3f} / "
            f"{summary[f'{name}_s_per_step_median']:.3f} | "
            f"{summary[f'{name}_pairs_per_s']:.2f} | {summary[f'{name}_tokens_per_s']:,.0f} | "
            f"{fmt(mfu, '.0%')} | {summary[f'{name}_peak_rss_gb']:.2f} | {summary[f'{name}_load']} |"
        )
    if "ratio" in summary:
        print(
            f"\nratio dpojax/TRL (throughput): {summary['ratio']:.2f}x (medians "
            f"{summary['ratio_median']:.2f}x); first-batch log-probs: max |diff| "
            f"{summary['logps_max_abs_diff']:.2e} (mean |logp| {summary['logps_mean_abs']:.1f})"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
