"""mode=plan: the real train step compiled ahead of time for a TPU topology (libtpu's compiler on
this CPU host) and for the local devices, from a config.json alone; figures, "does not fit" rows,
the search, plan.json; and the helpers behind them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpojax.config import default_config, frozen, validate
from dpojax.hardware.chips import CHIPS, chip_for, gpu_memory_fraction
from dpojax.hardware.gpu_targets import SPECS, parse, plugin_installed, target_config
from dpojax.jobs import build
from dpojax.models.model_config import config_to_hf
from dpojax.models.tiny import tiny_config
from dpojax.runtime import tpu_host_env
from dpojax.train.aot import parse_out_of_memory

ROOT = Path(__file__).resolve().parents[3]


def _architecture(directory: Path, **overrides) -> Path:
    """A model directory holding only config.json (no weights, no tokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    hf = config_to_hf(tiny_config("llama", **overrides))
    (directory / "config.json").write_text(json.dumps(hf))
    return directory


def _plan_cli(workdir: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "dpojax.main",
        f"--config={ROOT / 'configs' / 'tiny_test.py'}",
        f"--workdir={workdir}",
        "--config.mode=plan",
        f"--config.model.path={model}",
        "--config.mesh.data=1",
        "--config.mesh.fsdp=-1",
        *extra,
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


@pytest.mark.slow
@pytest.mark.newest
def test_plan_compiles_the_train_step_for_a_tpu_slice(tmp_path):
    model = _architecture(tmp_path / "model")
    proc = _plan_cli(tmp_path / "run", model, "--config.plan.target=tpu:v5e:2x2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan for tpu:v5e:2x2 (4 devices, TPU v5e, 16.0 GiB each)" in proc.stdout
    report = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert report["devices"] == 4 and report["platform"] == "tpu" and report["recipe_fits"]
    assert report["chip"]["bf16_flops"] == 197e12 and report["versions"]["libtpu"]
    (recipe,) = report["candidates"]
    assert recipe["label"] == "recipe" and recipe["fits"] and recipe["compute_dtype"] == "bfloat16"
    assert recipe["mesh"] == {"data": 1, "fsdp": 4, "context": 1, "tensor": 1}
    # the Pallas kernels, with v5e's 256-token blocks cut to the 64-token row rounded up to 128
    assert recipe["attention"] == "pallas" and recipe["attention_block"] == 128
    # tiny_test: 4 pairs of up to 64 tokens, padded layout: 8 rows of 64 tokens, half scored
    assert recipe["batch"] | {"tokens": 0} == {
        "layout": "padded",
        "pairs_per_step": 4,
        "micro_batches": 1,
        "rows": 8,
        "row_length": 64,
        "tokens": 0,
        "scored_tokens": 256,
    }
    state = recipe["state_bytes_per_device"]
    assert state["optimizer"] == pytest.approx(2 * state["parameters"], rel=0.01)  # Adam moments
    # a frozen copy of the float32 policy, in the bf16 compute dtype on the TPU
    assert state["reference"] == pytest.approx(state["parameters"] / 2, rel=0.01)
    train = recipe["train"]
    assert (
        train["compile_seconds"] > 0
        and train["total_bytes"] > train["memory_bytes"]["argument"] / 2
    )
    assert train["compiled_flops"] > 0 and train["compiled_bytes"] > 0
    assert recipe["model_flops_per_device"] == pytest.approx(recipe["model_flops_per_step"] / 4)
    roof = recipe["roofline"]
    terms = (roof["compute_seconds"], roof["memory_seconds"], roof["communication_seconds"])
    assert roof["step_seconds_bound"] == max(terms) and roof["step_seconds_serial"] == sum(terms)
    assert 0 < roof["mfu_bound"] <= 1
    assert roof["bound_by"] in ("compute", "memory", "communication")
    _check_audit(train["communication"], {"fsdp"})
    assert "communication of recipe (train step, per device):" in proc.stdout
    assert "WARNING" not in proc.stdout
    kernels = _check_attention(report, recipe, calls=(2, 2))  # 2 layers; reference forward
    assert kernels["pallas"]["block"] == 128 and kernels["pallas"]["share_of"] == "recipe"
    assert kernels["flash"]["runs"] and kernels["reference"]["runs"]
    assert "attention (the recipe's shapes, per device" in proc.stdout


def _check_attention(report: dict, recipe: dict, calls: tuple[int, int]) -> dict[str, dict]:
    """Every implementation's kernel is reported (the step's own with its shares of the step,
    each in (0, 1]); those that run have positive bytes and FLOPs, the others a reason."""
    from dpojax.models.attention import IMPLEMENTATIONS

    kernels = {k["implementation"]: k for k in report["attention_implementations"]}
    assert list(kernels) == list(IMPLEMENTATIONS)
    own = recipe["attention_kernel"]
    assert own["implementation"] == recipe["attention"] and own["per_step"]["fits"]
    assert own["per_step"]["calls"] == dict(
        zip(("forward_backward", "forward"), calls, strict=True)
    )
    assert kernels[recipe["attention"]]["share"] == own["share"]
    for key in ("hlo_bytes", "flops", "model_flops"):
        assert 0 < own["share"][key] <= 1, own["share"]
    # the step's executed FLOPs per device with the compiled attention in the model's place
    executed = recipe["model_flops_per_device"] + recipe["recompute_flops_per_device"]
    compiled = own["per_step"]["compiled_flops"]
    rest = executed * (1 - own["share"]["model_flops"])
    assert own["share"]["flops"] == pytest.approx(compiled / (rest + compiled))
    for kernel in kernels.values():
        if not kernel["runs"]:
            assert kernel["reason"]
            continue
        step = kernel["per_step"]
        assert step["hlo_bytes"] > 0 and step["compiled_flops"] > 0 and step["temp_bytes"] >= 0
        assert 0 < kernel["share"]["model_flops"] <= 1
        if kernel["share_of"] is None:  # no step of this implementation compiled: no bytes share
            assert kernel["share"]["hlo_bytes"] is None
    return kernels


def _check_audit(comm: dict, axes: set[str]) -> None:
    """A sharded step's audit: weight all-gathers and gradient reductions over the sharded axes,
    counted and sized, none carrying activations of the whole batch."""
    assert comm["warnings"] == [] and comm["collectives_per_step"] > 0
    kinds = {e["kind"] for e in comm["collectives"]}
    assert "all-gather" in kinds and kinds & {"reduce-scatter", "all-reduce"}
    for e in comm["collectives"]:
        assert set(e["axes"].split("+")) <= axes and e["count_per_step"] >= 1
        assert e["operand_bytes"] > 0 and e["link"] == "local" and not e["activation_sized"]
    assert set(comm["per_axis"]) <= axes
    total = sum(a["moved_bytes_per_device"] for a in comm["per_axis"].values())
    assert total == pytest.approx(comm["moved_bytes_per_device"]) and total > 0


needs_cuda_plugin = pytest.mark.skipif(
    not plugin_installed(),
    reason="needs the gpu-plan extra (JAX's CUDA plugin; .ci/run installs it)",
)


@needs_cuda_plugin
@pytest.mark.slow
def test_plan_compiles_the_train_step_for_gpus_without_one(tmp_path):
    model = _architecture(tmp_path / "model")
    proc = _plan_cli(
        tmp_path / "run", model, "--config.plan.target=gpu:h100:8", "--config.train.batch_size=8"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan for gpu:h100:8 (8 devices, NVIDIA H100 SXM, 74.5 GiB each)" in proc.stdout
    report = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert report["platform"] == "gpu" and report["devices"] == 8 and report["recipe_fits"]
    assert report["usable_memory"] == {
        "bytes": 0.75 * 80e9,
        "fraction": 0.75,
        "source": "JAX's default memory fraction (75%)",
    }
    assert any("cost analysis is not available" in note for note in report["notes"])
    (recipe,) = report["candidates"]
    # padded rows in bfloat16: cuDNN's fused attention where JAX finds cuDNN (the extra has it)
    from dpojax.models.attention import cudnn

    assert recipe["compute_dtype"] == "bfloat16"
    assert recipe["attention"] == ("cudnn" if cudnn.available() else "flash")
    assert recipe["attention_block"] is None
    assert recipe["mesh"] == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    train = recipe["train"]
    assert train["compiled_flops"] is None and train["compiled_bytes"] is None
    assert 0 < train["total_bytes"] < train["usable_bytes"] and train["fits"]
    _check_audit(train["communication"], {"fsdp"})
    roof = recipe["roofline"]
    assert roof["communication_seconds"] > 0 and train["hlo_bytes"] > 0
    assert roof["memory_seconds"] == pytest.approx(train["hlo_bytes"] / 3.35e12)
    terms = (roof["compute_seconds"], roof["memory_seconds"], roof["communication_seconds"])
    assert roof["step_seconds_bound"] == max(terms)


@needs_cuda_plugin
@pytest.mark.slow
def test_gpu_plan_over_two_hosts_counts_dcn(tmp_path):
    model = _architecture(tmp_path / "model")
    proc = _plan_cli(
        tmp_path / "run",
        model,
        "--config.plan.target=gpu:h100:2x8",
        "--config.train.batch_size=16",
        "--config.mesh.data=2",
        "--config.mesh.fsdp=8",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "plan.json").read_text())
    (recipe,) = report["candidates"]
    assert report["devices"] == 16 and recipe["mesh"] == {
        "data": 2,
        "fsdp": 8,
        "context": 1,
        "tensor": 1,
    }
    comm = recipe["train"]["communication"]
    assert comm["warnings"] == []
    links = {e["axes"]: e["link"] for e in comm["collectives"]}
    assert links.get("fsdp") == "local" and "dcn" in {links.get("data"), links.get("data+fsdp")}
    assert comm["moved_bytes_per_link"]["dcn"] > 0


@pytest.mark.slow
def test_a_recipe_that_does_not_fit_is_a_row_not_a_crash(tmp_path):
    """600k x 4096 float32 embeddings and head with Adam: ~29 GiB of state per v5e chip."""
    model = _architecture(
        tmp_path / "model",
        vocab_size=600_000,
        hidden_size=4096,
        intermediate_size=512,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        tie_word_embeddings=False,
    )
    proc = _plan_cli(
        tmp_path / "run", model, "--config.plan.target=tpu:v5e:2x2", "--config.data.max_length=32"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "plan.json").read_text())
    (recipe,) = report["candidates"]
    assert not report["recipe_fits"] and not recipe["fits"]
    train = recipe["train"]
    assert "memory" in train["message"].lower()
    assert train["available_bytes"] == pytest.approx(15.75 * 2**30)
    assert train["needed_bytes"] > train["available_bytes"] > 0
    assert " NO " in proc.stdout


@pytest.mark.slow
def test_search_ranks_the_nearest_changes(tmp_path):
    model = _architecture(tmp_path / "model")
    proc = _plan_cli(
        tmp_path / "run",
        model,
        "--config.plan.target=tpu:v5e:2x2",
        "--config.plan.search=True",
        "--config.plan.max_candidates=4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "plan.json").read_text())
    labels = [c["label"] for c in report["candidates"]]
    assert sorted(labels) == sorted(
        ["recipe", "remat=attention", "remat=dots_no_batch", "remat=dots"]
    )
    bounds = [c["roofline"]["mfu_bound"] for c in report["candidates"]]
    assert bounds == sorted(bounds, reverse=True)  # all fit: best roofline first
    remats = {c["label"]: c["remat"] for c in report["candidates"]}
    assert remats["remat=attention"] == "attention" and remats["recipe"] == "none"


@pytest.mark.slow
def test_local_target_compiles_for_this_process(tmp_path):
    from dpojax.jobs.plan import plan

    config = default_config()
    config.mode = "plan"
    config.model.path = str(_architecture(tmp_path / "model"))
    config.data.max_length = 32
    config.train.batch_size = 16
    config.train.grad_accum = 2
    config.data.eval_path = str(tmp_path / "model" / "config.json")  # any file: eval is planned
    config.mesh.data = 1
    config.mesh.fsdp = -1
    assert validate(config, num_devices=8) == []
    report = plan(frozen(config), tmp_path / "run")
    (recipe,) = report["candidates"]
    assert report["platform"] == "cpu" and report["chip"] is None and report["devices"] == 8
    assert recipe["compute_dtype"] == "float32"  # auto on a CPU
    assert recipe["batch"]["micro_batches"] == 2 and recipe["batch"]["rows"] == 16
    assert recipe["train"]["fits"] and recipe["eval"]["fits"]
    assert "roofline" not in recipe  # no published peaks for a CPU
    # 2 micro-batches x 2 layers; the reference model's forward and remat's rerun (none here)
    kernels = _check_attention(report, recipe, calls=(4, 4))
    assert recipe["attention"] == "reference"  # auto at 32 tokens on a CPU
    assert kernels["flash"]["share_of"] is None and kernels["flash"]["block"] == 32
    assert kernels["pallas"]["runs"] is False  # interpreted off TPU


@pytest.mark.slow
def test_a_precomputed_reference_is_planned_without_its_forward(tmp_path):
    """The steps of reference.type=precomputed read the reference's log-probs from the batch (the
    plan, and so auto-fit, once failed on the missing key); no reference forward is counted."""
    from dpojax.jobs.plan import plan

    flops = {}
    for kind in ("frozen", "precomputed"):
        config = default_config()
        config.mode = "plan"
        config.model.path = str(_architecture(tmp_path / "model"))
        config.data.max_length = 32
        config.train.batch_size = 8
        config.reference.type = kind
        config.mesh.data = 1
        config.mesh.fsdp = -1
        assert validate(config, num_devices=8) == []
        (recipe,) = plan(frozen(config), tmp_path / kind)["candidates"]
        assert recipe["train"]["fits"]
        assert ("eval" in recipe) == (kind == "precomputed")  # the precomputing pass is planned
        flops[kind] = recipe["model_flops_per_step"]
    assert flops["precomputed"] < 0.8 * flops["frozen"]


def test_plan_errors_name_the_key(tmp_path):
    config = default_config()
    config.mode = "plan"
    errors = "\n".join(validate(config, num_devices=1))
    assert "mode 'plan' needs config key 'model.path'" in errors
    config.model.path = str(_architecture(tmp_path / "model"))
    config.plan.target = "gpu:h100"
    config.plan.completion_fraction = 1.5
    errors = "\n".join(validate(config, num_devices=1))
    assert "config key 'plan.target': plan.target 'gpu:h100': use gpu:<chip>:<gpus>" in errors
    assert "'plan.completion_fraction' must be in (0, 1)" in errors
    for bad in ("gpu:h900:8", "gpu:h100:16", "gpu:h100:0x8"):
        config.plan.target = bad
        assert "config key 'plan.target'" in "\n".join(validate(config, num_devices=1)), bad
    config.plan.target = "cuda:8"
    errors = "\n".join(validate(config, num_devices=1))
    assert "'plan.target' must be 'local', 'tpu:<topology>'" in errors
    assert "'plan.completion_fraction' must be in (0, 1)" in errors
    config.plan.target, config.plan.completion_fraction = "tpu:v5e:2x2", 0.5
    config.mesh.data, config.mesh.tensor = 1, 3  # 3 does not divide 4 TPU chips: the job says so
    assert validate(config, num_devices=1) == []


@pytest.mark.slow
def test_mesh_that_the_slice_cannot_hold_exits_2(tmp_path):
    model = _architecture(tmp_path / "model")
    proc = _plan_cli(
        tmp_path / "run", model, "--config.plan.target=tpu:v5e:2x2", "--config.mesh.tensor=3"
    )
    assert proc.returncode == 2
    assert "do not divide the target's 4 devices" in proc.stderr


def test_out_of_memory_messages_are_parsed():
    gib = 2**30
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (21.80G) exceeds available HBM (15.75G)."
    )
    assert parse_out_of_memory(message) == (pytest.approx(21.80 * gib), pytest.approx(15.75 * gib))
    used = "Ran out of memory in memory space hbm. Used 20.5G of 15.75G hbm."
    assert parse_out_of_memory(used) == (pytest.approx(20.5 * gib), pytest.approx(15.75 * gib))
    assert parse_out_of_memory("something else") == (None, None)


def test_chips_and_tpu_host_environment():
    assert chip_for("TPU v5 lite") is CHIPS["v5e"] and chip_for("v5p") is CHIPS["v5p"]
    assert chip_for("TPU v4") is CHIPS["v4"] and chip_for("NVIDIA H100 80GB HBM3") is CHIPS["h100"]
    assert chip_for("cpu") is None
    # device kinds are matched exactly: a PCIe or NVL H100 never gets the SXM figures
    assert chip_for("NVIDIA H100 PCIe") is CHIPS["h100-pcie"]
    assert CHIPS["h100-pcie"].bf16_flops == 756e12 and CHIPS["h100-pcie"].hbm_bandwidth == 2.0e12
    assert chip_for("NVIDIA H100 NVL") is CHIPS["h100-nvl"] and CHIPS["h100-nvl"].hbm_bytes == 94e9
    assert chip_for("NVIDIA H100 something new") is None
    assert CHIPS["v4"].hbm_bandwidth == 1200e9 and chip_for("TPU v6 lite") is CHIPS["v6e"]
    assert chip_for("NVIDIA B200") is CHIPS["b200"] and chip_for("NVIDIA H200") is CHIPS["h200"]
    assert tpu_host_env("v5e:2x2")["TPU_ACCELERATOR_TYPE"] == "v5litepod-4"
    assert tpu_host_env("v5p:2x2x1")["TPU_ACCELERATOR_TYPE"] == "v5p-8"  # TensorCores
    assert tpu_host_env("v6e:2x4")["TPU_WORKER_HOSTNAMES"] == "localhost"


@pytest.mark.parametrize(
    "dtype, platform, expected",
    [
        ("auto", "cpu", "float32"),
        ("auto", "tpu", "bfloat16"),
        ("auto", "gpu", "bfloat16"),
        ("float32", "tpu", "float32"),
    ],
)
def test_auto_compute_dtype(dtype, platform, expected):
    config = default_config()
    config.model.dtype = dtype
    assert build.compute_dtype(config, platform) == expected


def test_the_small_gpus_are_targets_and_a_t4_computes_in_float16(monkeypatch):
    """l4, t4 and a100-40gb: their published figures, their compute-only target protos;
    model.dtype=auto on a T4 (no bfloat16) is float16 and model.attention=auto flash (cuDNN's
    fused attention needs Ampere), on a planned T4 and on this process's own."""
    import types

    from dpojax.hardware import gpu_targets
    from dpojax.hardware.chips import CHIPS, chip_for
    from dpojax.models import attention

    assert gpu_targets.parse("gpu:l4:1") == ("l4", 1, 1)
    assert chip_for("Tesla T4") is CHIPS["t4"] and chip_for("NVIDIA L4") is CHIPS["l4"]
    assert (CHIPS["l4"].hbm_bytes, CHIPS["t4"].hbm_bytes, CHIPS["a100-40gb"].hbm_bytes) == (
        24e9,
        16e9,
        40e9,
    )
    proto = gpu_targets.target_config(gpu_targets.SPECS["t4"])
    assert "major: 7 minor: 5" in proto and "threads_per_core_limit: 1024" in proto
    assert "threads_per_core_limit: 1536" in gpu_targets.target_config(gpu_targets.SPECS["l4"])
    config = default_config()
    config.model.dtype = "auto"
    assert build.compute_dtype(config, "gpu", CHIPS["t4"]) == "float16"
    assert build.compute_dtype(config, "gpu", CHIPS["l4"]) == "bfloat16"
    config.model.dtype = "bfloat16"  # said, not overridden
    assert build.compute_dtype(config, "gpu", CHIPS["t4"]) == "bfloat16"
    from dpojax.jobs.plan import Target, _dtype_notes

    def notes(chip):
        return _dtype_notes(config, Target(f"gpu:{chip}:1", [], CHIPS[chip], "gpu"))

    # a bfloat16 recipe on a T4 is planned as said, with a warning that XLA emulates it there
    (note,) = notes("t4")
    assert "no bfloat16 arithmetic" in note and "model.dtype=auto computes in float16" in note
    assert notes("l4") == []
    config.model.dtype = "auto"
    assert notes("t4") == []
    assert not CHIPS["t4"].fused_attention and CHIPS["l4"].fused_attention
    monkeypatch.setattr(attention.cudnn, "available", lambda: True)
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    for capability, expected in (("7.5", "flash"), ("8.9", "cudnn")):
        gpu = types.SimpleNamespace(compute_capability=capability)
        monkeypatch.setattr(attention.jax, "devices", lambda gpu=gpu: [gpu])
        assert attention.resolve("auto", "gpu", 2048, cudnn_exact=True) == expected


def test_gpu_memory_fraction_follows_jax_settings():
    assert gpu_memory_fraction({}) == (0.75, "JAX's default memory fraction (75%)")
    fraction, why = gpu_memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"})
    assert fraction == 0.9 and "XLA_PYTHON_CLIENT_MEM_FRACTION=.9" in why
    assert gpu_memory_fraction({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})[0] == 0.75
    assert gpu_memory_fraction({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})[0] == 1.0
    with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='lots'"):
        gpu_memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"})


def test_gpu_target_configs_name_their_chips():
    for name, spec in SPECS.items():
        text = target_config(spec)
        assert f'device_description_str: "{spec.device_kind}"' in text
        assert f"core_count: {spec.sm_count}" in text
        assert chip_for(spec.device_kind) is CHIPS[name]  # the compiled devices' kind -> figures
    assert parse("gpu:h100:8") == ("h100", 1, 8) and parse("gpu:b200:2x8") == ("b200", 2, 8)


def test_search_tries_the_attention_implementations_and_blocks():
    """After the memory-saving changes: each other attention implementation the target runs and,
    with the Pallas kernels, each other block size."""
    from dpojax.jobs.plan import Target, candidates

    config = default_config()
    tpu = Target("tpu:v5p:2x2x1", [None] * 4, CHIPS["v5p"], "tpu")
    labels = [c.label for c in candidates(frozen(config), 4, tpu)]
    assert labels[-4:] == [
        "model.attention=flash",
        "model.attention=reference",
        "model.attention_block=128",
        "model.attention_block=256",
    ]  # v5p's own block is 512
    gpu = Target("gpu:h100:8", [None] * 8, CHIPS["h100"], "gpu")
    labels = [c.label for c in candidates(frozen(config), 8, gpu)]
    assert labels[-1] == "model.attention=reference" and "model.attention=pallas" not in labels
    assert not any(
        c.attention for c in candidates(frozen(config), 4)
    )  # no target: the recipe's own


def _context_config(tmp_path: Path):
    """The tiny recipe planned for the 8 local (fake) devices with mesh.context=2, the rest on
    data, and v5e's figures for the roofline."""
    config = default_config()
    config.mode = "plan"
    config.model.path = str(_architecture(tmp_path / "model"))
    config.data.max_length = 32
    config.train.batch_size = 4
    config.mesh.data = -1
    config.mesh.context = 2
    config.plan.chip = "v5e"
    return config


def test_plan_config_check_accepts_a_context_axis(tmp_path):
    from dpojax.jobs.plan.candidates import mesh_sizes

    config = _context_config(tmp_path)
    assert validate(config, num_devices=8) == []
    assert mesh_sizes(config, 8) == (4, 1, 2, 1)
    config.plan.row_length = 102  # the rows the plan pads to split into 2 * 2 chunks too
    assert any("'plan.row_length' (102) does not divide" in e for e in validate(config))
    config.plan.row_length = 128
    assert validate(config, num_devices=8) == []
    config.mesh.data, config.mesh.context = 4, -1  # the remaining devices: not for context
    assert any("'mesh.context' must be a positive size" in e for e in validate(config))


@pytest.mark.slow
def test_local_plan_with_a_context_axis_audits_its_collectives(tmp_path):
    """Rows split over context=2 (data=4): the step compiles, the report names the mesh and the
    audit attributes collectives (the K/V gathers, the embed shards) to the context axis."""
    from dpojax.jobs.plan import plan

    report = plan(frozen(_context_config(tmp_path)), tmp_path / "run")
    (recipe,) = report["candidates"]
    assert recipe["mesh"] == {"data": 4, "fsdp": 1, "context": 2, "tensor": 1}
    assert recipe["train"]["fits"] and recipe["attention"] in ("reference", "flash")
    comm = recipe["train"]["communication"]
    over_context = [e for e in comm["collectives"] if "context" in e["axes"].split("+")]
    assert over_context and all(e["count_per_step"] >= 1 for e in over_context)
    assert sum(e["moved_bytes_per_device"] for e in over_context) > 0
    context_axes = {e["axes"] for e in over_context}
    assert all(comm["per_axis"][a]["moved_bytes_per_device"] >= 0 for a in context_axes)
    seconds = recipe["roofline"]["communication_seconds_per_axis"]
    assert sum(seconds[a] for a in context_axes) > 0
    assert sum(seconds.values()) == pytest.approx(recipe["roofline"]["communication_seconds"])
    kernels = {k["implementation"]: k for k in report["attention_implementations"]}
    assert not kernels["pallas"]["runs"] and kernels["flash"]["runs"]
    overlap = recipe["roofline"]["context_overlap"]
    assert overlap["communication_seconds"] == pytest.approx(sum(seconds[a] for a in context_axes))
    assert 0 < overlap["hideable_share"] <= 1
    saved = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert saved["candidates"][0]["mesh"]["context"] == 2


def test_context_overlap_is_the_attention_compute_over_the_context_communication():
    """The roofline's context_overlap: the seconds of every collective over the context axis
    (alone or with others), the compute term times attention's share of the model FLOPs, and
    their ratio capped at 1; nothing without a context axis."""
    from dpojax.jobs.plan import _context_overlap

    def result(per_axis):
        roofline = {"compute_seconds": 8.0, "communication_seconds_per_axis": per_axis}
        return {"roofline": roofline, "attention_kernel": {"share": {"model_flops": 0.5}}}

    r = result({"context": 3.0, "fsdp+context": 2.0, "data": 7.0})
    _context_overlap(r)
    assert r["roofline"]["context_overlap"] == {
        "communication_seconds": 5.0,
        "attention_compute_seconds": 4.0,
        "hideable_share": 0.8,
    }
    r = result({"context": 0.5})
    _context_overlap(r)
    assert r["roofline"]["context_overlap"]["hideable_share"] == 1.0
    r = result({"fsdp": 1.0})
    _context_overlap(r)
    assert "context_overlap" not in r["roofline"]


def test_longest_row_doubles_then_bisects_to_the_fitting_length():
    """With the fit decided by a threshold (max_length <= 640 fits), the search from the
    recipe's 32 tokens doubles to 1024 (the first miss), then bisects on multiples of 128:
    768 misses, 640 fits; each compile is one pair per data-parallel group, one micro-batch."""
    from dpojax.jobs.plan import Candidate
    from dpojax.jobs.plan.longest import longest_row

    config = default_config()
    config.data.max_length = 32
    config.train.batch_size, config.train.grad_accum = 16, 2
    seen = []

    def compile_one(c, candidate):
        seen.append((c.data.max_length, c.train.batch_size, c.train.grad_accum, candidate))
        n = c.data.max_length
        fits = n <= 640
        return {
            "fits": fits,
            "batch": {"row_length": n, "rows": 2},
            "train": {"total_bytes": n * 1000} if fits else {"needed_bytes": n * 1000},
        }

    base = Candidate("recipe", "full", (2, 2, 2, 1), 2, "float32")
    found = longest_row(frozen(config), base, 2048, compile_one)
    assert [s[0] for s in seen] == [32, 64, 128, 256, 512, 1024, 768, 640]
    assert {s[1:3] for s in seen} == {(4, 1)}  # 4 = data x fsdp pairs, one micro-batch
    assert {s[3].grad_accum for s in seen} == {1} and seen[0][3].mesh == base.mesh
    assert found["longest_max_length"] == 640 and found["memory_bytes"] == 640_000
    assert found["first_not_fitting_max_length"] == 768
    assert found["first_not_fitting_bytes"] == 768_000 and found["search_step"] == 128
    assert [c["max_length"] for c in found["compiles"]] == [s[0] for s in seen]
    # context 128: lengths are multiples of lcm(2 * 128, 128) = 256 (768, then 512 = good)
    seen.clear()
    found = longest_row(
        frozen(config), dataclasses.replace(base, mesh=(1, 1, 128, 1)), 2048, compile_one
    )
    assert found["search_step"] == 256 and found["longest_max_length"] == 512
    assert [s[0] for s in seen] == [32, 64, 128, 256, 512, 1024, 768]
    # nothing fits: the recipe's own length is the first that does not
    seen.clear()
    config.data.max_length = 1024
    found = longest_row(frozen(config), base, 2048, compile_one)
    assert found["longest_max_length"] is None and found["first_not_fitting_max_length"] == 1024
    assert len(seen) == 1


@pytest.mark.slow
def test_plan_longest_row_compiles_up_to_the_models_positions(tmp_path, monkeypatch):
    """plan.longest_row on the local devices with context=2 and v5e's memory: the tiny model
    (128 positions) fits every length, so the search doubles 32 -> 128 and stops at the bound;
    with the chip's usable memory set between the compiled peaks at 64 and 128 tokens, 64 is
    the longest that fits and 128 the first that does not (the plan's own fit decision)."""
    from dpojax.hardware import chips
    from dpojax.jobs import plan as plan_module

    config = _context_config(tmp_path)
    config.model.path = str(_architecture(tmp_path / "short", max_position_embeddings=128))
    config.plan.longest_row = True
    assert validate(config, num_devices=8) == []
    found = plan_module.plan(frozen(config), tmp_path / "run")["longest_row"]
    assert [c["max_length"] for c in found["compiles"]] == [32, 64, 128]
    assert [c["row_length"] for c in found["compiles"]] == [32, 64, 128]
    assert all(c["fits"] and c["total_bytes"] > 0 for c in found["compiles"])
    memory = [c["total_bytes"] for c in found["compiles"]]
    assert memory == sorted(memory) and memory[-1] > memory[1]  # longer rows need more
    assert found["longest_max_length"] == 128 and found["first_not_fitting_max_length"] is None
    assert found["pairs_per_step"] == 4 and found["memory_bytes"] == memory[-1]
    usable = (memory[1] + memory[2]) / 2
    small = dataclasses.replace(
        chips.CHIPS["v5e"], hbm_bytes=usable / (1 - chips.RESERVED_FRACTION)
    )
    monkeypatch.setattr(plan_module, "chip_for", lambda name: small)
    found = plan_module.plan(frozen(config), tmp_path / "small")["longest_row"]
    assert [c["fits"] for c in found["compiles"]] == [True, True, False]
    assert found["longest_max_length"] == 64 and found["memory_bytes"] == memory[1]
    assert found["first_not_fitting_max_length"] == 128
    assert found["first_not_fitting_bytes"] == memory[2]


def test_search_moves_devices_between_fsdp_and_the_context_axis():
    """plan.search's context candidates: twice the context from fsdp (or from data where fsdp is
    odd), a recipe's context folded back into fsdp; none where the rows do not divide by
    2 * context, the data-parallel devices no longer split the pairs, or the attention is one
    that cannot run split rows (cuDNN)."""
    from dpojax.jobs.plan import candidates

    config = default_config()
    config.data.max_length, config.train.batch_size = 64, 8
    config.mesh.data, config.mesh.fsdp = 1, -1

    def meshes(devices=8):
        return {
            c.label: c.mesh for c in candidates(frozen(config), devices) if "context" in c.label
        }

    assert meshes() == {"mesh.context=2": (1, 4, 2, 1)}
    config.mesh.data, config.mesh.fsdp, config.mesh.context = -1, 1, 2  # (4, 1, 2, 1)
    assert meshes() == {"mesh.context=4": (2, 1, 4, 1), "mesh.context=1": (4, 2, 1, 1)}
    config.train.batch_size = 4  # 4 pairs over 8 data x fsdp devices: no fold
    assert meshes() == {"mesh.context=4": (2, 1, 4, 1)}
    config.data.max_length = 36  # rows of 16, 32 and 36 tokens: 36 is no multiple of 8
    assert meshes() == {}
    config.data.max_length, config.model.attention = 64, "pallas"  # runs split rows too
    assert meshes() == {"mesh.context=4": (2, 1, 4, 1)}
    config.model.attention = "cudnn"  # sees whole rows only
    assert meshes() == {}


@pytest.mark.slow
def test_search_ranks_a_context_candidate(tmp_path, monkeypatch):
    """A search on the 8 local devices (v5e's figures for the roofline) compiles the recipe
    (fsdp=8) and its mesh.context=2 candidate (fsdp=4 x context=2) and ranks both."""
    from dpojax.jobs import plan as plan_module

    real = plan_module.candidates

    def two(config, devices, target=None):
        return [c for c in real(config, devices, target) if c.label in ("recipe", "mesh.context=2")]

    monkeypatch.setattr(plan_module, "candidates", two)
    config = _context_config(tmp_path)
    config.mesh.data, config.mesh.fsdp, config.mesh.context = 1, -1, 1
    config.train.batch_size = 8  # split over fsdp 8, and 4
    config.plan.search = True
    report = plan_module.plan(frozen(config), tmp_path / "run")
    ranked = report["candidates"]
    assert sorted(c["label"] for c in ranked) == ["mesh.context=2", "recipe"]
    assert ranked == sorted(ranked, key=plan_module._rank)
    bounds = [c["roofline"]["mfu_bound"] for c in ranked]
    assert all(c["fits"] for c in ranked) and bounds == sorted(bounds, reverse=True)
    split = next(c for c in ranked if c["label"] == "mesh.context=2")
    assert split["mesh"] == {"data": 1, "fsdp": 4, "context": 2, "tensor": 1}
    assert "context" in split["roofline"]["communication_seconds_per_axis"]
    assert split["attention"] in ("reference", "flash")
