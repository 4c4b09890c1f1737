"""The attention kernel of a plan: each attention implementation's core compiled alone — one
layer's attention, forward and forward + backward, at the step's shapes (a micro-batch's rows x
length, the model's heads), on the step's mesh and target — and its memory, FLOPs and bytes,
scaled to the step (layers x micro-batches, plus the forward passes the reference model and the
remat policy add) and set against the compiled step's figures.

The implementations are those `dpojax.models.attention` lists (`IMPLEMENTATIONS`): one that does
not compile for the target, or runs there only emulated (the Pallas kernels off TPU run in
interpret mode), is reported as not running, with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from dpojax.jobs.plan import comm_audit
from dpojax.models import ModelConfig, ModelConfigError, attention
from dpojax.models.attention import flash
from dpojax.models.attention.rule import TokenIds
from dpojax.models.sharding import ACTIVATION_RULES, constrain, context_size, spec_for
from dpojax.train import aot
from dpojax.train.flops import recompute_flops, step_flops
from dpojax.train.step import mesh_context

_Q = ("batch", "length", "heads", "head_dim")
_KV = ("batch", "kv_length", "kv", "head_dim")
_KV_SPLIT = ("batch", "length", "kv", "head_dim")  # split like the queries (`gathers_keys`)
_IDS = ("batch", "length")
# The figures each compile gives (per call): XLA's memory analysis and cost analysis (None where
# the backend has none: deviceless GPU), the HLO's bytes with loop trip counts (`memory_traffic`).
_FIELDS = ("temp_bytes", "compiled_flops", "compiled_bytes", "hlo_bytes")


def _sharded(shape, dtype, names, mesh) -> jax.ShapeDtypeStruct:
    spec = spec_for(names, shape, ACTIVATION_RULES, mesh)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _functions(mcfg: ModelConfig, implementation: str, platform: str, sliding: bool, seen: dict):
    """(forward, forward + backward) of one layer's attention as the model calls it: `Rows` built
    from the token ids, q, k, v and the output pinned to the activation layout. `seen` receives
    the `Rows` (its block and whether it runs interpreted)."""
    scalar = mcfg.query_pre_attn_scalar
    scale = float(scalar) ** -0.5 if scalar else mcfg.resolved_head_dim**-0.5

    def core(q, k, v, positions, segment_ids, parts):
        b, t = segment_ids.shape
        ids = TokenIds.of(b, t, positions=positions, segment_ids=segment_ids, parts=parts)
        rows = attention.rows(
            implementation, ids, mcfg.sliding_window, platform=platform,
            block=mcfg.attention_block or None,
        )  # fmt: skip
        seen["rows"] = rows

        def attend(q, k, v):
            names = _KV_SPLIT if attention.gathers_keys(rows.implementation) else _KV
            q, k, v = constrain(q, _Q), constrain(k, names), constrain(v, names)
            out = attention.attend(rows, q, k, v, scale=scale, sliding=sliding)
            return constrain(out, _Q)

        return attend, (q, k, v)

    def forward(q, k, v, positions, segment_ids, parts):
        attend, args = core(q, k, v, positions, segment_ids, parts)
        return attend(*args)

    def forward_backward(q, k, v, positions, segment_ids, parts, d_out):
        attend, args = core(q, k, v, positions, segment_ids, parts)
        out, pullback = jax.vjp(attend, *args)
        return out, pullback(d_out)

    return forward, forward_backward


def _compile(fn, args, mesh) -> dict[str, Any]:
    with mesh_context(mesh):
        lowered = jax.jit(fn).lower(*args)
    try:
        compiled = aot.compile_step(lowered)
    except aot.OutOfMemory as e:
        return {"fits": False, "temp_bytes": e.needed, "compile_seconds": e.seconds}
    return {
        "fits": True,
        "temp_bytes": compiled.memory["temp"],
        "compiled_flops": compiled.flops,
        "compiled_bytes": compiled.bytes_accessed,
        "hlo_bytes": comm_audit.memory_traffic(compiled.hlo_text),
        "compile_seconds": compiled.seconds,
    }


def _kernel_block(implementation: str, rows: attention.Rows | None, length: int) -> int | None:
    if rows is not None and rows.block:
        return int(rows.block)
    return flash.block_size(length) if implementation == "flash" else None


def core_figures(
    mcfg: ModelConfig, implementation: str, mesh, platform: str, rows: int, length: int
) -> dict[str, Any]:
    """One layer's attention of `implementation` compiled for (`rows`, `length`) rows on `mesh`:
    per layer kind (full, sliding) the forward's and the forward + backward's figures, the
    kernel's block; or `runs: False` with the reason (the model's config refusing the
    implementation, e.g. cudnn in float32, is one)."""
    try:
        mcfg = mcfg.replace(attention=implementation)
    except ModelConfigError as e:
        return _not_running(implementation, " ".join(str(e).split())[:500])
    context = context_size(mesh)
    if context > 1 and implementation not in attention.SPLIT_ROW_IMPLEMENTATIONS:
        return _not_running(
            implementation, f"does not run rows split over the context axis yet (context={context})"
        )
    dtype = jnp.dtype(mcfg.dtype)
    hd = mcfg.resolved_head_dim
    q = _sharded((rows, length, mcfg.num_heads, hd), dtype, _Q, mesh)
    kv_names = _KV_SPLIT if attention.gathers_keys(implementation, context) else _KV
    kv = _sharded((rows, length, mcfg.num_kv_heads, hd), dtype, kv_names, mesh)
    ids = [_sharded((rows, length), jnp.int32, _IDS, mesh)] * 3
    kinds = sorted({mcfg.layer_is_sliding(i) for i in range(mcfg.num_layers)})
    out: dict[str, Any] = {"implementation": implementation, "runs": True, "kinds": {}}
    for sliding in kinds:
        seen: dict = {}
        forward, both = _functions(mcfg, implementation, platform, sliding, seen)
        try:
            with mesh_context(mesh):
                jax.eval_shape(forward, q, kv, kv, *ids)
            if seen["rows"].interpret:
                return _not_running(implementation, "runs interpreted (emulated) on this target")
            figures = {
                "forward": _compile(forward, (q, kv, kv, *ids), mesh),
                "forward_backward": _compile(both, (q, kv, kv, *ids, q), mesh),
            }
        except Exception as e:  # an implementation the target's compiler refuses: a report row
            return _not_running(implementation, " ".join(str(e).split())[:500])
        out["block"] = _kernel_block(implementation, seen["rows"], length)
        out["kinds"]["sliding" if sliding else "full"] = figures
    return out


def _not_running(implementation: str, reason: str) -> dict[str, Any]:
    return {"implementation": implementation, "runs": False, "reason": reason}


def per_step(
    core: dict[str, Any], mcfg: ModelConfig, micro: int, forward_passes: int
) -> dict[str, Any]:
    """The step's attention work from one layer's `core`: every layer of every micro-batch runs
    forward + backward once and the forward `forward_passes` more times (the reference model's
    forward, the remat policy's rerun). Temporaries are the largest one layer's backward holds
    (layers run one after another); a figure some compile lacks is None."""
    layers = {
        kind: sum((mcfg.layer_is_sliding(i) == (kind == "sliding")) for i in range(mcfg.num_layers))
        for kind in core["kinds"]
    }
    totals: dict[str, Any] = {}
    for field in _FIELDS[1:]:
        total = 0.0
        for kind, figures in core["kinds"].items():
            parts = (figures["forward_backward"].get(field), figures["forward"].get(field))
            if None in parts:
                total = None
                break
            total += micro * layers[kind] * (parts[0] + forward_passes * parts[1])
        totals[field] = total
    both = [f["forward_backward"] for f in core["kinds"].values()]
    held = [f["temp_bytes"] for f in both if f["temp_bytes"] is not None]
    totals["temp_bytes"] = max(held) if held else None
    totals["fits"] = all(f["fits"] for f in both)
    totals["calls"] = {
        "forward_backward": micro * mcfg.num_layers,
        "forward": micro * mcfg.num_layers * forward_passes,
    }
    return totals


def shares(step_attention: dict[str, Any], train: dict[str, Any], model: dict[str, float]):
    """The attention's share of the train step (None where a figure is missing):

    - `hlo_bytes`: its HBM bytes of the step's, both counted from the HLO with loop trip counts;
    - `flops`: its compiled FLOPs (XLA's cost analysis of the core; none on deviceless GPU) of
      the step's executed FLOPs with the attention counted so: dpojax's FLOP model of the step
      (`model["step"]`, remat rerun included) less its attention pairs (`model["attention"]`)
      plus the compiled attention. XLA's cost analysis of the whole step counts a loop body once
      (scanned layers, vocabulary chunks), so it is no denominator;
    - `model_flops`: the attention pairs' FLOPs of the step's in dpojax's FLOP model.
    """

    def ratio(part, whole):
        return part / whole if part is not None and whole else None

    compiled = step_attention["compiled_flops"]
    rest = model["step"] - model["attention"]
    return {
        "hlo_bytes": ratio(step_attention["hlo_bytes"], train.get("hlo_bytes")),
        "flops": ratio(compiled, None if compiled is None else rest + compiled),
        "model_flops": ratio(model["attention"], model["step"]),
    }


@dataclasses.dataclass(frozen=True)
class AttentionSetting:
    """What a candidate's attention core is compiled for: the planned model, the step's mesh and
    platform, the train batch's [micro-batches, rows, length], whether the reference's forward
    runs (`StepConfig.reference_forward`) and the number of devices (the FLOP model counts the
    whole step, the compiles one device)."""

    model: ModelConfig
    mesh: Any
    platform: str
    batch_shape: tuple[int, int, int]
    reference_forward: bool
    devices: int


def step_figures(
    result: dict, setting: AttentionSetting, cores: dict, work: tuple, implementation: str = ""
) -> dict[str, Any]:
    """The attention kernel of `implementation` (default: the candidate's) in the step: its core
    compiled alone (`core_figures`, cached in `cores`), scaled to the step, and, where `result`
    holds the compiled step of that implementation, its shares of the step's bytes and FLOPs.
    Kept in `result["attention_kernel"]` and returned."""
    mcfg = setting.model
    implementation = implementation or mcfg.attention
    micro, rows, length = (int(n) for n in setting.batch_shape)
    key = (implementation, mcfg.attention_block, rows, length, setting.mesh.shape_tuple)
    if key not in cores:
        cores[key] = core_figures(
            mcfg, implementation, setting.mesh, setting.platform, rows, length
        )
    core = cores[key]
    figures = dict(core)
    if core["runs"]:
        ref_forward = setting.reference_forward
        rerun = recompute_flops(mcfg, 0, 1, mcfg.remat, implementation) > 0
        figures["per_step"] = per_step(core, mcfg, micro, ref_forward + rerun)
        own = result.get("attention") == implementation and "train" in result
        tokens, pairs, scored = work

        def executed(p: float) -> float:  # per device
            kw = dict(reference_forward=ref_forward)
            total = step_flops(mcfg, tokens, p, scored, **kw) + recompute_flops(
                mcfg, tokens, p, mcfg.remat, implementation
            )
            return total / setting.devices

        model = {"attention": executed(pairs) - executed(0), "step": executed(pairs)}
        train = result["train"] if own else {}  # the bytes share needs this step compiled
        figures["share"] = shares(figures["per_step"], train, model)
    if result.get("attention") == implementation:
        result["attention_kernel"] = figures
    return figures
