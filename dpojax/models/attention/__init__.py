"""Attention implementations behind one interface, all with the layout rule of
docs/layouts.md#the-attention-rule:

| implementation | what | memory | where |
|---|---|---|---|
| `reference` | a [B, T, T] mask and causal query blocks over all keys up to each block's end | O(T^2) | short rows on CPU; the KV-cache decoder |
| `flash` | pure-JAX flash attention, custom VJP, skips fully masked blocks (on GPU: a fixed trip count, masking only) | O(T) | CPU and GPU; fallback everywhere |
| `pallas` | the same algorithm as Pallas kernels (forward and backward), grid-walked blocks, VMEM scratch | O(T) | TPU (Mosaic); GPU and CPU run it interpreted |
| `cudnn` | cuDNN's fused attention, for the rows its masks express (padded rows: sequence lengths) | O(T) | NVIDIA GPUs |

`model.attention = "auto"` picks per platform, row length and layout (`choose`). A model call builds one
`Rows` (the token ids; the masks for `reference`, the block tables for `pallas`, built once per
batch) and every layer calls `attend` with it.
"""

from __future__ import annotations

import flax.struct
import jax

from dpojax.models.attention import cudnn
from dpojax.models.attention.context import balanced, context_attention
from dpojax.models.attention.flash import flash_attention
from dpojax.models.attention.reference import attention_mask, dot_product_attention
from dpojax.models.attention.rule import TokenIds
from dpojax.models.model_config import ATTENTION_CHOICES as CHOICES
from dpojax.models.model_config import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS
from dpojax.models.model_config import ModelConfig
from dpojax.models.sharding import context_size, kernel_axes

# "auto" on a CPU: the reference below this row length (its [T, T] blocks are cheap and its large
# einsums fast), flash from it on: from 512 tokens flash is as fast in isolation and halves a
# padded step's peak memory (docs/benchmarks.md#attention-that-scales-flash-attention-and-the-pallas-kernels-2026-11-25).
CPU_FLASH_FROM = 512


# "auto" hands cuDNN heads up to this size (256 needs a Hopper GPU; a compile without a device
# cannot tell, so "auto" stays with flash there).
CUDNN_AUTO_HEAD_DIM = 128


def _ampere_or_later(platform: str) -> bool:
    """Whether this process's GPU runs cuDNN's fused attention (compute capability 8.0 or
    later; a T4 or V100 does not). True when the GPU is not this process's own (a plan for
    compile-only GPUs judges by its chip) or its capability is not known."""
    if platform != jax.default_backend():
        return True
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return capability is None or float(capability) >= 8.0
    except (TypeError, ValueError):
        return True


def resolve(
    choice: str,
    platform: str | None = None,
    length: int | None = None,
    *,
    cudnn_exact: bool = False,
) -> str:
    """The implementation `choice` means on `platform` (default: JAX's default backend) for rows
    of `length` tokens: "auto" is pallas on TPU; on GPU cudnn where it computes the rule exactly
    (`cudnn_exact`, from `choose`) and JAX finds cuDNN, else flash; on CPU the reference for
    short rows and flash from `CPU_FLASH_FROM` tokens. An explicit "cudnn" off a GPU is an
    error."""
    platform = platform or jax.default_backend()
    if choice != "auto":
        if choice not in IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {CHOICES}, got {choice!r}")
        if choice == "cudnn" and platform != "gpu":
            raise ValueError(
                f"model.attention='cudnn' runs cuDNN's fused attention on NVIDIA GPUs, not on "
                f"{platform}: use auto (pallas on TPU, flash or the reference on CPU)"
            )
        return choice
    if platform == "tpu":
        return "pallas"
    if platform == "gpu":
        usable = cudnn_exact and cudnn.available() and _ampere_or_later(platform)
        return "cudnn" if usable else "flash"
    if length is not None and length < CPU_FLASH_FROM:
        return "reference"
    return "flash"


def choose(
    config: ModelConfig, platform: str | None = None, length: int | None = None, *, plain=False
) -> str:
    """The implementation a model call with `config` runs on `platform` for rows of `length`
    tokens: `resolve`, told whether cuDNN computes the rule exactly for the call's rows (`plain`:
    one causal sequence per row, no segment ids; else the rows of `config.row_layout`); soft-
    capped scores with "auto" run the reference. A static decision (the config and the
    layout), never one taken from the values. An explicit "cudnn" where cuDNN is not exact
    is an error naming what to use instead."""
    layout = "padded" if plain else config.row_layout
    if config.attention == "cudnn" and not layout:
        raise ValueError(
            "model.attention='cudnn' on rows with segment ids of an unknown layout: cuDNN "
            "expresses padded rows only; set ModelConfig.row_layout (the training job sets it "
            "from data.layout) or use flash"
        )
    problem = config.cudnn_problem(layout) if layout else "layout unknown"
    if config.attention == "cudnn" and problem:
        raise ValueError(f"model.attention='cudnn': {problem}")
    exact = not problem and not config.attn_softcap
    exact = exact and config.resolved_head_dim <= CUDNN_AUTO_HEAD_DIM
    implementation = resolve(config.attention, platform, length, cudnn_exact=exact)
    if config.attn_softcap and config.attention == "auto":
        return "reference"  # soft-capped scores: the reference attention only
    return split_rows_choice(config.attention, implementation, context_size())


# What runs on rows split over a context axis: the reference (XLA's GSPMD partitions it: queries
# split, keys and values gathered), flash and the Pallas kernels (`context_attention`: keys and
# values all-gathered in `shard_map`). cuDNN's custom call sees whole rows only
# (docs/long_context.md).
SPLIT_ROW_IMPLEMENTATIONS = ("reference", "flash", "pallas")


def split_rows_choice(choice: str, implementation: str, context: int) -> str:
    """`implementation` (what `choice` resolved to) on rows split over `context` devices: itself
    where it runs split rows, flash for "auto", else a ValueError naming the keys."""
    if context == 1 or implementation in SPLIT_ROW_IMPLEMENTATIONS:
        return implementation
    if choice == "auto":
        return "flash"
    raise ValueError(
        f"model.attention={choice!r} does not run rows split over the context axis yet "
        f"(mesh.context={context}): use auto, flash, pallas or reference, or set mesh.context=1"
    )


def describe(config: ModelConfig, platform: str | None = None, context: int = 1) -> str:
    """What `config.attention` runs on `platform` for rows of `config.row_layout` split over
    `context` devices (mesh.context), in words (logged once per run and kept in its summary)."""
    platform = platform or jax.default_backend()
    choice = config.attention
    if choice == "auto" and platform == "cpu" and not config.attn_softcap:
        return (
            f"auto on cpu: reference for rows under {CPU_FLASH_FROM} tokens, flash from "
            f"{CPU_FLASH_FROM}"
        )
    resolved = choose(config, platform, plain=not config.row_layout)
    resolved = split_rows_choice(choice, resolved, context)
    return f"{resolved} (auto on {platform})" if choice == "auto" else resolved


@flax.struct.dataclass
class Rows:
    """What every layer's attention needs about a batch of rows (a pytree whose implementation
    and window are static, so it passes through `nnx.remat` and `jax.checkpoint`)."""

    implementation: str = flax.struct.field(pytree_node=False)
    ids: TokenIds
    window: int | None = flax.struct.field(pytree_node=False)
    # reference: the rule as [B, T, T] masks; pallas on whole rows: the block pairs its kernels
    # visit [B, n, n] (on split rows each device builds its own, in `context_attention`)
    full_mask: jax.Array | None = None
    sliding_mask: jax.Array | None = None
    interpret: bool = flax.struct.field(pytree_node=False, default=False)
    block: int | None = flax.struct.field(pytree_node=False, default=None)
    # flash on GPU: the static variant (fixed trip counts, no branch on the data)
    static: bool = flax.struct.field(pytree_node=False, default=False)
    # flash or pallas on split rows: the tokens are in causal load-balancing order (`context.order`)
    balanced: bool = flax.struct.field(pytree_node=False, default=False)


def rows(
    implementation: str,
    ids: TokenIds,
    window: int | None,
    *,
    platform: str | None = None,
    block: int | None = None,
    balanced: bool = False,
) -> Rows:
    """`Rows` for `implementation` (resolved already) on `platform` (default: JAX's default
    backend): the reference gets its [B, T, T] masks built once, the Pallas kernels their block
    tables (which block pairs they visit, for `block`: default the chip's; on rows split over a
    context axis each device builds its own) and run compiled on TPU, interpreted elsewhere;
    flash on a GPU runs its static variant (no loop bound or branch that depends on the data:
    `flash_attention(static=True)`). `balanced`: the tokens are in `context.order`."""
    b, t = ids.segment_ids.shape
    if implementation == "pallas":
        from dpojax.models.attention import pallas

        interpret = (platform or jax.default_backend()) != "tpu"
        if gathers_keys(implementation):
            return Rows(implementation, ids, window, interpret=interpret, block=block,
                        balanced=balanced)  # fmt: skip
        block = pallas.kernel_block(t, block, interpret=interpret)
        full = pallas.padded_table(ids, block, None)
        sliding = pallas.padded_table(ids, block, window) if window else None
        return Rows(implementation, ids, window, full, sliding, interpret, block)
    if implementation == "flash":
        static = (platform or jax.default_backend()) == "gpu"
        return Rows(implementation, ids, window, static=static, balanced=balanced)
    if implementation != "reference":  # cudnn: sequence lengths from the ids, in `attend`
        return Rows(implementation, ids, window)
    kw = dict(positions=ids.positions, segment_ids=ids.segment_ids, parts=ids.parts)
    full = attention_mask(b, t, **kw)
    sliding = attention_mask(b, t, sliding_window=window, **kw) if window else None
    return Rows(implementation, ids, window, full, sliding)


def attend(
    rows_: Rows,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    sliding: bool,
    cap: float | None = None,
) -> jax.Array:
    """Self-attention of q [B, T, H, D] over k, v [B, T, K, D] under the layout rule (and the
    sliding window on a sliding layer); [B, T, H, D] in q's dtype. Soft-capped scores (`cap`,
    Gemma 2) are computed by the reference implementation only."""
    window = rows_.window if sliding else None
    mask = rows_.sliding_mask if sliding else rows_.full_mask
    if rows_.implementation == "reference":
        return dot_product_attention(q, k, v, mask, scale, causal=True, cap=cap)
    if cap:
        raise ValueError(
            f"attention soft-capping runs in the reference attention, not {rows_.implementation}"
        )
    if gathers_keys(rows_.implementation):
        return context_attention(
            q, k, v, rows_.ids, implementation=rows_.implementation, scale=scale, window=window,
            static=rows_.static, is_balanced=rows_.balanced, block=rows_.block,
            interpret=rows_.interpret,
        )  # fmt: skip
    if rows_.implementation == "flash":
        return flash_attention(q, k, v, rows_.ids, scale=scale, window=window, static=rows_.static)
    if rows_.implementation == "cudnn":  # XLA partitions cuDNN's call itself (no shard_map)
        return cudnn.cudnn_attention(q, k, v, rows_.ids, scale=scale, window=window)
    return _pallas_on_mesh(
        q, k, v, rows_.ids, mask, scale=scale, window=window, block=rows_.block,
        interpret=rows_.interpret,
    )  # fmt: skip


def balances(implementation: str, length: int, *, experts: bool = False) -> bool:
    """Whether a model call hands `attend` its rows of `length` tokens in causal load-balancing
    order (`context.order`): flash or pallas on a mesh with a context axis, where the chunks are
    whole flash blocks; not for mixture-of-experts models (their router logits stay in row
    order)."""
    context = context_size()
    return gathers_keys(implementation, context) and not experts and balanced(length, context)


def gathers_keys(implementation: str, context: int | None = None) -> bool:
    """Whether `attend` gathers the keys and values of split rows itself (flash or pallas on a
    mesh with a context axis of `context` devices, default the current mesh's:
    `context_attention`), so the model hands them over split like the queries."""
    return implementation in ("flash", "pallas") and (context or context_size()) > 1


def _pallas_on_mesh(q, k, v, ids, visit, *, scale, window, block, interpret):
    """The Pallas kernels on every device's shard of the batch (and of the heads, when the tensor
    axis divides both the query and the KV heads): XLA cannot partition a kernel itself, so under
    a mesh (`jax.set_mesh`) the call is wrapped in `shard_map`."""
    from jax.sharding import PartitionSpec

    from dpojax.models.attention.pallas import pallas_attention

    def call(q, k, v, ids, visit):
        return pallas_attention(
            q, k, v, ids, scale=scale, window=window, block=block, interpret=interpret,
            visit=visit,
        )  # fmt: skip

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return call(q, k, v, ids, visit)
    batch, heads = kernel_axes(mesh, q.shape[2], k.shape[2])
    per_head = PartitionSpec(batch, None, heads, None)
    per_token = PartitionSpec(batch, None)
    sharded = jax.shard_map(
        call,
        mesh=mesh,
        in_specs=(
            per_head,
            per_head,
            per_head,
            TokenIds(per_token, per_token, per_token),
            PartitionSpec(batch, None, None),
        ),  # fmt: skip
        out_specs=per_head,
        check_vma=False,
    )
    return sharded(q, k, v, ids, visit)


__all__ = [
    "CHOICES",
    "balances",
    "IMPLEMENTATIONS",
    "Rows",
    "TokenIds",
    "attend",
    "attention_mask",
    "choose",
    "cudnn",
    "describe",
    "dot_product_attention",
    "flash_attention",
    "gathers_keys",
    "resolve",
    "rows",
    "split_rows_choice",
]
