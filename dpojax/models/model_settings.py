"""The model settings: the config's `model.*` and `lora.*` groups, beside the models that read
them. Each field carries its default, doc, choices (from the modules that own them: dtypes, remat
policies, attention implementations, quantization schemes, the scan) and range; the config tree
(`dpojax.config.tree`) takes the groups as they are, and `dpojax.jobs.build` reads both the
policy and a separate reference with one loader call from them.
"""

from __future__ import annotations

import dataclasses

from dpojax.models.model_config import ATTENTION_CHOICES, DTYPES, REMAT_POLICIES
from dpojax.models.quant import SCHEMES as QUANT_SCHEMES
from dpojax.models.scan import SCAN_CHOICES
from dpojax.schema import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, setting


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The policy model."""

    path: str = setting(
        "",
        "The policy: a local Hugging Face directory, or a Hub id org/name[@revision] (downloaded "
        "through the Hugging Face cache; HF_TOKEN, HF_HUB_OFFLINE, HF_ENDPOINT apply).",
    )
    dtype: str = setting(
        "auto",
        "Compute dtype; auto: bfloat16 on TPUs and GPUs, float32 on CPUs (the loss, log-softmax "
        "and norms stay float32).",
        choices=("auto", *DTYPES),
    )
    param_dtype: str = setting(
        "float32", "Storage dtype of the parameters and optimizer state.", choices=DTYPES
    )
    remat: str = setting(
        "none",
        "Recompute each decoder layer's activations in the backward pass.",
        choices=REMAT_POLICIES,
    )
    scan_layers: str = setting(
        "auto",
        "Stack the decoder layers' parameters per layer kind and run them with one scan, so XLA "
        "compiles one period of layers instead of all (docs/benchmarks.md, scanned layers); "
        "auto: on for TPUs and GPUs where the layer kinds repeat with a period dividing the "
        "layer count (not Gemma 3 1B/4B, not Qwen2 with a sliding window on upper layers); on "
        "CPUs only with model.remat set (the scan holds the least there; with jax 0.10.2 the "
        "per-layer loop lets XLA recompute every layer at once and remat saves almost nothing).",
        choices=SCAN_CHOICES,
    )
    attention: str = setting(
        "auto",
        "Attention implementation: reference (a [T, T] mask), flash (pure JAX, memory linear in T), "
        "pallas (a kernel; TPU) or cudnn (cuDNN's fused attention; NVIDIA GPUs, data.layout="
        "padded, bf16/fp16); auto: pallas on TPU, on GPU cudnn where it is exact and flash "
        "elsewhere, on CPU the reference for rows under 512 tokens and flash from there "
        "(docs/layouts.md#attention-implementations).",
        choices=ATTENTION_CHOICES,
    )
    attention_block: int = setting(
        0,
        "The Pallas kernels' query and key block in tokens, a multiple of 128; 0: the TPU "
        "generation's own (docs/layouts.md#attention-implementations).",
        range=NON_NEGATIVE,
    )
    quantization: str = setting(
        "none",
        "Store the frozen base's attention and MLP projections quantized under LoRA (needs "
        "lora.rank > 0): int8 (absmax per block) or nf4 (QLoRA's NormalFloat4), dequantized to "
        "the compute dtype inside each matmul; embeddings, norms, the LM head and the adapters "
        "stay in model.param_dtype (docs/quantization.md).",
        choices=QUANT_SCHEMES,
    )
    quantization_block: int = setting(
        64,
        "Inputs per quantization scale of model.quantization (one float32 scale per block of a "
        "projection's input dimension and output column); must divide every projection's input "
        "size (even for nf4).",
        range=AT_LEAST_ONE,
    )


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters on the policy (rank 0: full fine-tuning)."""

    rank: int = setting(0, "Adapter rank; 0 turns LoRA off.", range=NON_NEGATIVE)
    alpha: float = setting(
        16.0, "Adapter scale numerator (the update is alpha / rank * B A).", range=POSITIVE
    )
    targets: tuple = setting(
        ("q_proj", "k_proj", "v_proj", "o_proj"), "Projections that get adapters."
    )
