"""End to end: `python -m dpojax.main` trains, resumes exactly, evaluates, exports, and refuses bad
configs and data with one-line errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair
from dpojax.models.safetensors_io import load_tensors
from dpojax.models.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "tiny_test.py")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    rng = np.random.default_rng(0)
    words = ["good", "bad", "move", "board", "win", "draw", "play", "next"]

    def pair(i):
        prompt = " ".join(rng.choice(words, size=4)) + f" {i}?"
        return PreferencePair(
            prompt=prompt,
            chosen=" yes " + words[i % 8],
            rejected=" no " + words[(i + 3) % 8],
            metadata={},
        )

    write_pairs([pair(i) for i in range(24)], base / "train.jsonl", format="trl")
    write_pairs([pair(100 + i) for i in range(8)], base / "eval.jsonl", format="trl")
    return base, model


def _cli(workdir, *overrides, check=True, background=False, env_extra=None):
    cmd = [
        sys.executable,
        "-m",
        "dpojax.main",
        f"--config={RECIPE}",
        f"--workdir={workdir}",
        *overrides,
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    env.update(env_extra or {})
    if background:
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def _data(assets):
    base, model = assets
    return [
        f"--config.model.path={model}",
        f"--config.data.train_path={base / 'train.jsonl'}",
        f"--config.data.eval_path={base / 'eval.jsonl'}",
    ]


@pytest.mark.newest  # a whole run on each JAX / flax / orbax stack
def test_train_end_to_end_writes_everything(assets, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    work = tmp_path / "run"
    _cli(work, *_data(assets))
    assert sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    lines = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train] == list(range(1, 7))
    assert abs(train[0]["loss"] - np.log(2)) < 1e-5
    for key in (
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "learning_rate",
        "grad_norm",
        "tokens_per_s",
    ):
        assert key in train[-1]
    assert any(x["split"] == "eval" for x in lines)
    assert list((work / "tensorboard").rglob("events.out.tfevents*"))
    assert (work / "report.md").is_file() and list((work / "plots").glob("*.png"))
    summary = json.loads((work / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 6
    assert summary["attention"].startswith("auto on cpu: reference for rows under 512 tokens")
    assert summary["peak_host_rss_bytes"] > 100 * 2**20
    hf = transformers.AutoModelForCausalLM.from_pretrained(work / "export")
    with torch.no_grad():
        logits = hf(torch.tensor([[1, 5, 9]])).logits
    assert torch.isfinite(logits).all()
    assert (work / "export_best" / "config.json").is_file()
    # a model card in every export, not only on push (before: none)
    card = (work / "export" / "README.md").read_text()
    assert f'from_pretrained("{work / "export"}")' in card and "24 preference pairs" in card
    assert "## Final evaluation" in (work / "export_best" / "README.md").read_text()


@pytest.mark.newest
def test_sigterm_then_resume_is_bit_identical(assets, tmp_path):
    steps = [
        "--config.train.steps=300",
        "--config.train.eval_every=0",
        "--config.checkpoint.every_steps=100",
    ]
    full = tmp_path / "full"
    _cli(full, *_data(assets), *steps)
    stopped = tmp_path / "stopped"
    proc = _cli(stopped, *_data(assets), *steps, background=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        metrics = stopped / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 20:
            break
        time.sleep(0.02)
    time.sleep(np.random.default_rng().uniform(0.0, 0.3))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["status"] == "stopped by SIGTERM", summary
    assert 0 < summary["step"] < 300
    # The first run tokenized train and eval data into the workdir's token cache; the resumed
    # run reads them back (and still ends bit-identical to the uninterrupted run).
    assert len(list((stopped / "token_cache").glob("tokens-*.npz"))) == 2
    resumed = _cli(stopped, *_data(assets), *steps)
    assert resumed.stderr.count("(token cache hit)") == 2, resumed.stderr[-3000:]
    assert json.loads((stopped / "summary.json").read_text())["status"] == "completed"
    a = load_tensors(full / "export" / "model.safetensors")
    b = load_tensors(stopped / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    logged = [json.loads(x) for x in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in logged if x["split"] == "train"] == list(range(1, 301))


def test_evaluate_mode_matches_direct_computation(assets, tmp_path):
    import jax.numpy as jnp

    from dpojax.data.pair_files import read_pairs
    from dpojax.data.tokenize import tokenize_pairs
    from dpojax.models import from_pretrained

    base, model_dir = assets
    work = tmp_path / "eval"
    _cli(work, *_data(assets), "--config.mode=evaluate")
    rows = [json.loads(x) for x in (work / "evaluate" / "pairs.jsonl").read_text().splitlines()]
    metrics = json.loads((work / "evaluate" / "metrics.json").read_text())
    assert len(rows) == 8 and abs(metrics["loss"] - np.log(2)) < 1e-5
    model, tokenizer = from_pretrained(model_dir)
    pairs, _ = read_pairs(base / "eval.jsonl")
    tokenized = tokenize_pairs(pairs, tokenizer, max_length=64).pairs
    for row, pair in zip(rows, tokenized, strict=True):
        for which in ("chosen", "rejected"):
            seq = pair.sequence(which)
            mask = pair.completion_mask(which)
            logp = np.asarray(
                jnp.take_along_axis(
                    __import__("jax").nn.log_softmax(model(jnp.asarray(seq)[None])[0, :-1]),
                    jnp.asarray(seq[1:])[:, None],
                    axis=-1,
                )[:, 0]
            )
            expected = float((logp * mask[1:]).sum())
            assert row[f"policy_{which}_logp"] == pytest.approx(expected, abs=1e-4)
            assert row[f"ref_{which}_logp"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--config.train.stepz=3"], "stepz"),
        (["--config.loss.type=dpoo"], "config key 'loss.type': unknown loss"),
        (
            ["--config.reference.type=lora_base"],
            "config key 'reference.type' is 'lora_base' but LoRA is off",
        ),
        (["--config.mode=serve"], "config key 'mode' must be one of"),
        (
            ["--config.train.batch_size=5", "--config.train.grad_accum=2"],
            "must be divisible by train.grad_accum",
        ),
        (["--config.data.layout=zigzag"], "config key 'data.layout' must be one of"),
    ],
)
def test_validation_errors_are_one_line_and_nonzero(assets, tmp_path, overrides, message):
    proc = _cli(tmp_path / "bad", *_data(assets), *overrides, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_bad_data_names_file_and_line(assets, tmp_path):
    base, _ = assets
    bad = tmp_path / "bad.jsonl"
    lines = (base / "train.jsonl").read_text().splitlines()
    lines[2] = '{"prompt": "x", "chosen": "a"'
    bad.write_text("\n".join(lines) + "\n")
    proc = _cli(
        tmp_path / "w",
        *_data(assets),
        f"--config.data.train_path={bad}",
        "--config.data.strict=true",
        check=False,
    )
    assert proc.returncode == 3
    assert f"{bad}:3" in proc.stderr and "Traceback" not in proc.stderr


def test_batch_not_divisible_by_devices(assets, tmp_path):
    proc = _cli(
        tmp_path / "w",
        *_data(assets),
        "--config.mesh.data=-1",
        "--config.train.batch_size=3",
        check=False,
        env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    )
    assert proc.returncode == 2
    assert "not divisible by the 2 data-parallel devices" in proc.stderr


_CACHE_PROBE = """
import sys
import jax, jax.numpy as jnp
from dpojax.runtime import enable_compilation_cache
directory = enable_compilation_cache(sys.argv[1], sys.argv[2], min_compile_seconds=0.0)
jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(jnp.arange(5.0)).block_until_ready()
print(directory)
"""


def test_compilation_cache_is_written_under_the_workdir_and_reused(tmp_path):
    from dpojax.runtime import enable_compilation_cache

    assert enable_compilation_cache("", str(tmp_path)) is None

    def probe(path):
        out = subprocess.run(
            [sys.executable, "-c", _CACHE_PROBE, path, str(tmp_path)],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip().splitlines()[-1]

    cache = tmp_path / "jax_cache"
    assert probe("jax_cache") == str(cache)  # relative: under the workdir
    entries = sorted(p.name for p in cache.iterdir())
    assert entries  # even a sub-second CPU compilation is cached
    assert probe(str(cache)) == str(cache)  # absolute: as given; the same program is a hit
    assert sorted(p.name for p in cache.iterdir()) == entries
