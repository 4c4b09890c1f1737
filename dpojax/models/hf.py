"""Hugging Face checkpoint interop: a local HF directory <-> a dpojax `CausalLM`.

`from_pretrained` reads config.json, model.safetensors (or a sharded index) and the tokenizer files
of a local directory (a Hub id is first resolved to its snapshot in the Hugging Face cache): no
torch. `save_pretrained` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

Why one module of this length: reading and writing a checkpoint (tensors, sharded indexes, dtypes,
tied and fused weights, the tokenizer files) are mirror images checked against each other by the
round-trip tests; the tensor names are `dpojax.models.hf_names`, the Hub `dpojax.models.hub`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpojax.models import quant
from dpojax.models.hf_names import (
    SAME,
    all_names,
    expected_shapes,
    from_checkpoint,
    hf_name,
    tensor_maps,
    to_checkpoint,
)
from dpojax.models.hub import prequantized_problem, resolve_model_dir
from dpojax.models.layers import QuantParam
from dpojax.models.model_config import ModelConfig, ModelConfigError, config_from_hf, config_to_hf
from dpojax.models.safetensors_io import ModelFileError, TensorReader, save_tensors, tensor_shapes
from dpojax.models.scan import STACK, layer_path, unstack_flat
from dpojax.models.scan import resolve as resolve_scan
from dpojax.models.sharding import DEFAULT_RULES, MeshAxes, named_shardings
from dpojax.models.transformer import (
    CausalLM,
    abstract_model,
    check_quant_block,
    is_quantized_kernel,
    merge_lora,
)

log = logging.getLogger(__name__)
__all__ = ["from_pretrained", "hf_name", "load_params", "read_config", "save_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Tensors some checkpoints carry that hold no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path}: invalid JSON at line {e.lineno} ({e.msg})") from None


def read_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The ModelConfig of a local HF directory, from its config.json."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise ModelFileError(
            f"{path}: no config.json; expected a local Hugging Face model directory"
        )
    raw = _read_json(cfg_path)
    problem = prequantized_problem(path, raw) if isinstance(raw, dict) else ""
    if problem:
        raise ModelFileError(problem)
    return config_from_hf(raw, source=str(cfg_path), **overrides)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    if (path / INDEX_FILE).is_file():
        index = _read_json(path / INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelFileError(f"{path / INDEX_FILE}: field 'weight_map' is missing")
        files = {}
        for name, file in weight_map.items():
            if not (path / file).is_file():
                raise ModelFileError(
                    f"{path / INDEX_FILE}: tensor {name!r} is mapped to {file}, which does not exist"
                )
            files[name] = path / file
        return files
    if (path / SINGLE_FILE).is_file():
        return {name: path / SINGLE_FILE for name in tensor_shapes(path / SINGLE_FILE)}
    if list(path.glob("*.bin")) or list(path.glob("*.pth")):
        raise ModelFileError(
            f"{path}: only PyTorch .bin weights found; dpojax reads safetensors. Convert with "
            "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)"
        )
    raise ModelFileError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _check_tensors(path: Path, model: CausalLM, files: dict[str, Path], maps, shapes) -> None:
    """Every tensor the model needs is there with its shape, and nothing else is."""
    shapes_in = {file: tensor_shapes(file) for file in set(files.values())}
    for m in maps:
        for name, want in zip(m.names, expected_shapes(m, shapes), strict=True):
            if name not in files:
                raise ModelFileError(
                    f"{path}: tensor {name!r} is missing from the checkpoint (needed by "
                    f"config.json's model_type {model.config.model_type!r})"
                )
            got = shapes_in[files[name]][name]
            if got != want:
                raise ModelFileError(
                    f"{files[name]}: tensor {name!r} has shape {got}, but config.json implies "
                    f"{want}"
                )
    used = all_names(maps)
    extra = sorted(
        n
        for n in files
        if n not in used
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and model.config.tie_word_embeddings)
    )
    if extra:
        raise ModelFileError(
            f"{path}: tensors not used by the model built from config.json: {extra[:5]}"
            + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            + " (does config.json match the weights? e.g. attention_bias, tie_word_embeddings)"
        )


def load_params(
    model: CausalLM,
    path: str | os.PathLike,
    *,
    shardings: nnx.State | None = None,
    quantization: tuple[str, int] | None = None,
) -> CausalLM:
    """A copy of `model` (concrete or abstract) holding the weights of the HF directory `path`.

    Every parameter must be present with the shape config.json implies; tensors the model does not
    use are an error (they signal a config that does not match the weights). Each parameter is
    read from the files and placed (on its shards) before the next is read.

    With `quantization` = (scheme, block), `model` is the unquantized model and the result is
    `quantize_model(result, scheme, block)`, bit for bit, without the float model ever existing:
    each projection kernel (each layer's, when the layers are scanned) is quantized as it is read
    and only its codes and scales are kept, so host and device hold the quantized model plus one
    kernel in full precision (docs/quantization.md, "Loading"). `shardings` are then those of the
    quantized model."""
    path = Path(path)
    files = _tensor_files(path)
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    shapes = {p: tuple(var.shape) for p, var in flat}
    layer_shapes = _per_layer(model.config, shapes, lambda shape, g: shape[1:])
    maps = tensor_maps(model.config, layer_shapes)
    _check_tensors(path, model, files, maps, layer_shapes)
    if quantization is not None:
        graphdef = nnx.graphdef(abstract_model(_quantized_config(model, quantization)))
    placer = _Placer(dict(flat), shardings, quantization)
    by_rows = {m.params[0]: m.names[0] for m in maps if placer.by_rows(m)}
    with TensorReader(files, transient=True) as reader:
        for p, name in by_rows.items():
            placer.put_rows(p, name, reader)
        rest = {p: shape for p, shape in shapes.items() if p not in by_rows}
        if model.config.scan_layers:
            values = _read_stacked(model.config, maps, reader.get, rest, placer.per_layer)
        else:
            values = _read_looped([m for m in maps if m.params[0] not in by_rows], reader.get)
        for p, layer, arr in values:
            placer.put(p, layer, arr)
            del arr  # not held while the next one is read
    placer.warn_unusual(path)
    return nnx.merge(graphdef, nnx.from_flat_state(placer.loaded(flat)))


def _quantized_config(model: CausalLM, quantization: tuple[str, int]) -> ModelConfig:
    """The config of `model` with its projections quantized, after a `ConfigProblem` naming the
    first kernel whose input size the block does not cut (as `quantize_model` names it)."""
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if is_quantized_kernel(p):
            check_quant_block(p, tuple(var.shape), *quantization)
    scheme, block = quantization
    return model.config.replace(quantization=scheme, quantization_block=block)


def _replicated(sharding):
    """A replicated sharding on `sharding`'s mesh (None for None)."""
    return None if sharding is None else NamedSharding(sharding.mesh, PartitionSpec())


def _lead_dropped(sharding):
    """`sharding` (a NamedSharding of a stacked [layers, ...] array) for one layer's slice."""
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))


def _set_layer(stacked, part, layer):
    return jax.lax.dynamic_update_index_in_dim(stacked, part, layer, 0)


_set_layer_donated = jax.jit(_set_layer, donate_argnums=0)


def _set_rows(value, part, start, axis):
    return jax.lax.dynamic_update_slice_in_dim(value, part, start, axis)


_set_rows_donated = jax.jit(_set_rows, static_argnums=3, donate_argnums=0)
# A plain parameter larger than this (the embeddings, an untied LM head) is read in chunks of
# about this many bytes into its device buffer, so the host never holds it whole.
ROW_CHUNK_BYTES = 64 * 1024**2


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim` (None elsewhere): it hands the heap's freed pages back to the
    system, which glibc otherwise keeps after a kernel's full-precision buffers are freed."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # a libc without it (musl)
        return None


def release_freed_memory() -> None:
    """Return memory freed on the host to the system now (a no-op where libc cannot)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache
def _quantizer(out_shardings):
    return jax.jit(quant.quantize, static_argnums=(1, 2), out_shardings=out_shardings)


class _Placer:
    """Puts read parameters on their devices (with their shardings), quantizing projection
    kernels as they come when asked to (one kernel, or one layer of a stacked kernel, in full
    precision at a time)."""

    def __init__(self, variables, shardings, quantization):
        self.variables = variables
        self.sharding_of = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
        self.quantization = quantization
        self.values: dict[tuple, Any] = {}
        self.unusual: dict[str, list[str]] = {}

    def per_layer(self, p: tuple) -> bool:
        """Whether a stacked parameter is to be given one layer at a time (a quantized kernel)."""
        return self.quantization is not None and is_quantized_kernel(p)

    def by_rows(self, m) -> bool:
        """Whether map `m`'s one tensor is read in row chunks (`put_rows`): a large plain one."""
        plain = len(m.params) == 1 and len(m.names) == 1 and m.kind == SAME
        if not plain or m.params[0] not in self.variables:  # a layer's, when they are stacked
            return False
        var = self.variables[m.params[0]]
        nbytes = int(np.prod(var.shape)) * np.dtype(var.dtype).itemsize
        return (
            len(var.shape) == 2 and not self.per_layer(m.params[0]) and nbytes > 2 * ROW_CHUNK_BYTES
        )

    def put_rows(self, p: tuple, name: str, reader: TensorReader) -> None:
        """The tensor `name` read in row chunks into the device buffer of `p` (a kernel [in, out]
        is the tensor [out, in] transposed: its chunks are columns)."""
        var = self.variables[p]
        rows, cols = reader.shape(name)
        step = max(1, ROW_CHUNK_BYTES // (cols * np.dtype(var.dtype).itemsize))
        axis = 1 if p[-1] == "kernel" else 0
        sharding = self.sharding_of.get(p)
        value = jnp.zeros(var.shape, var.dtype, device=sharding)
        for start in range(0, rows, step):
            part = reader.get_rows(name, start, min(rows, start + step))
            self._note(p, part)
            part = part.astype(var.dtype, copy=False)
            part = self._place(part.T if axis else part, _replicated(sharding))
            value = _set_rows_donated(value, part, start, axis).block_until_ready()
            del part
        self.values[p] = value

    def _note(self, p: tuple, arr: np.ndarray) -> None:
        if arr.dtype.kind in "iub" or arr.dtype == np.float64:
            names = self.unusual.setdefault(str(arr.dtype), [])
            if not names or names[-1] != "/".join(map(str, p)):
                names.append("/".join(map(str, p)))

    def put(self, p: tuple, layer: int | None, arr: np.ndarray) -> None:
        self._note(p, arr)
        arr = arr.astype(self.variables[p].dtype, copy=False)  # no copy where it is one
        if not self.per_layer(p):
            self.values[p] = self._place(arr, self.sharding_of.get(p)).block_until_ready()
            return
        owner = p[:-1]
        codes_sharding = self.sharding_of.get(owner + ("codes",))
        scales_sharding = self.sharding_of.get(owner + ("scales",))
        if layer is not None and codes_sharding is not None:
            codes_sharding = _lead_dropped(codes_sharding)
            scales_sharding = _lead_dropped(scales_sharding)
        kernel = self._place(arr, codes_sharding)  # codes [in or in/2, out] split as the kernel
        del arr
        out = (codes_sharding, scales_sharding) if codes_sharding is not None else None
        codes, scales = jax.block_until_ready(_quantizer(out)(kernel, *self.quantization))
        kernel.delete()  # one kernel in full precision at a time, its temporaries gone with it
        release_freed_memory()  # and their pages given back, so the next one does not add to them
        if layer is None:
            self.values[owner + ("codes",)], self.values[owner + ("scales",)] = codes, scales
            return
        for name, part in (("codes", codes), ("scales", scales)):
            key = owner + (name,)
            if layer == 0:
                shape = (self.variables[p].shape[0], *part.shape)
                sharding = self.sharding_of.get(key)
                self.values[key] = jnp.zeros(shape, part.dtype, device=sharding)
            self.values[key] = _set_layer_donated(self.values[key], part, layer).block_until_ready()

    @staticmethod
    def _place(arr: np.ndarray, sharding) -> jax.Array:
        if sharding is None:
            return jax.device_put(arr)  # one copy (jnp.asarray made two of a bfloat16 array)
        return jax.make_array_from_callback(arr.shape, sharding, lambda idx, a=arr: a[idx])

    def loaded(self, flat) -> list[tuple]:
        """The (path, variable) pairs of the loaded model, in `flat`'s order."""
        out = []
        for p, var in flat:
            if p in self.values:
                out.append((p, var.replace(self.values[p])))
                continue
            meta = var.get_metadata()
            for name in ("codes", "scales"):
                out.append((p[:-1] + (name,), QuantParam(self.values[p[:-1] + (name,)], **meta)))
        return out

    def warn_unusual(self, path: Path) -> None:
        for kind, names in self.unusual.items():
            log.warning(
                "%s: %d parameters are stored as %s and were cast to the parameter dtype "
                "(first: %s)%s",
                path,
                len(names),
                kind,
                names[0],
                "; integer weights are usually quantized: load the unquantized model"
                if kind not in ("float64",)
                else "",
            )


def _per_layer(config: ModelConfig, flat: Mapping[tuple, Any], take) -> dict[tuple, Any]:
    """`flat` keyed by the unscanned model's paths (`dpojax.models.scan.unstack_flat`)."""
    if not config.scan_layers:
        return dict(flat)
    period = config.scan_period()[0]
    return unstack_flat(flat, period, config.num_layers // period, take)


def _read_looped(maps, read):
    """(path, None, value) of every parameter, read map by map; no value is referenced here once
    the next is asked for."""
    for m in maps:
        values = from_checkpoint(m, read)
        for p in list(values):
            yield p, None, values.pop(p)


def _read_stacked(config: ModelConfig, maps, read, shapes: Mapping[tuple, tuple], per_layer):
    """(path, layer, value) of every parameter of a scanned model, each stacked parameter read
    layer by layer from the checkpoint (one parameter on the host at a time); a stacked one for
    which `per_layer(path)` holds comes one layer at a time (layer 0, 1, ...), every other whole
    (layer None)."""
    map_of = {p: m for m in maps for p in m.params}
    period = config.scan_period()[0]
    for p in shapes:
        if p[0] != STACK:
            yield p, None, from_checkpoint(map_of[p], read)[p]
            continue
        rows = [layer_path(p, g, period) for g in range(shapes[p][0])]
        if per_layer(p):
            for g, q in enumerate(rows):
                yield p, g, from_checkpoint(map_of[q], read)[q]
        else:
            yield p, None, np.stack([from_checkpoint(map_of[q], read)[q] for q in rows])


# Where AutoTokenizer's choice is known without its model-config machinery: a tokenizer_config.json
# that names a generic tokenizers-backed class, no custom code, and a model type that
# transformers 5 maps to no other class for such a checkpoint (not qwen2, whose hub class it
# overrides; not mistral, which may use mistral-common).
_GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")
_DIRECT_TOKENIZER_MODEL_TYPES = ("llama", "qwen3")


def _json_or_empty(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def direct_tokenizer_class(path: str | os.PathLike):
    """transformers' generic fast tokenizer class when it is what AutoTokenizer would load for
    the checkpoint in `path`, else None.

    AutoTokenizer reads the model's config.json through transformers' configuration classes, which
    import torch whenever it is installed (~0.35 GB of memory and seconds of start-up that a JAX
    process does not need). For the common case, a `tokenizer.json` saved with the generic class
    (Llama 3 checkpoints, dpojax's tiny models), the answer is known from two JSON files.
    """
    path = Path(path)
    tok_config = _json_or_empty(path / "tokenizer_config.json")
    model_type = _json_or_empty(path / "config.json").get("model_type")
    if (
        tok_config.get("tokenizer_class") not in _GENERIC_TOKENIZERS
        or "auto_map" in tok_config
        or model_type not in _DIRECT_TOKENIZER_MODEL_TYPES
        or not (path / "tokenizer.json").is_file()
    ):
        return None
    import transformers

    return transformers.TokenizersBackend


def _with_eos(tokenizer, path: Path):
    """`tokenizer` with its EOS token: a folder without tokenizer_config.json leaves the tokenizer
    without one (and every completion without its EOS); it is then the token of the model's
    `eos_token_id` (config.json, else generation_config.json). Neither: an error naming the fix."""
    if tokenizer.eos_token is not None:
        return tokenizer
    for name in ("config.json", "generation_config.json"):
        eos = _json_or_empty(path / name).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and 0 <= eos < len(tokenizer):
            token = tokenizer.convert_ids_to_tokens(eos)
            log.warning("%s: the tokenizer names no EOS token; using %r (%s)", path, token, name)
            tokenizer.eos_token = token
            return tokenizer
    raise ModelFileError(
        f"{path}: the tokenizer has no EOS token and config.json names no eos_token_id, so "
        "completions could not be ended: copy the model's tokenizer_config.json into the folder"
    )


def load_tokenizer(path: str | os.PathLike):
    """The HF tokenizer saved in a local directory, offline: the class transformers.AutoTokenizer
    picks, without importing torch where that class is known (`direct_tokenizer_class`)."""
    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelFileError(
            f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass tokenizer=False to "
            "load the weights alone"
        )
    cls = direct_tokenizer_class(path)
    if cls is None:
        import transformers

        cls = transformers.AutoTokenizer
    try:
        tokenizer = cls.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        present = [f for f in TOKENIZER_FILES if (path / f).is_file()]
        missing = [f for f in TOKENIZER_FILES if f not in present]
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(": ")
        raise ModelFileError(
            f"{path}: cannot load the tokenizer ({first}); the directory has "
            f"{', '.join(present) or 'no tokenizer file'} but not {', '.join(missing)}: copy the "
            "model's tokenizer.json (or tokenizer.model) into it"
        ) from None
    return _with_eos(tokenizer, path)


def from_pretrained(
    path: str | os.PathLike,
    dtype: str = "float32",
    *,
    param_dtype: str | None = None,
    remat: str = "none",
    attention: str = "auto",
    attention_block: int = 0,
    row_layout: str = "",
    scan_layers: str | bool = False,
    tokenizer: bool = True,
    mesh: Mesh | None = None,
    rules: Mapping[str, MeshAxes] = DEFAULT_RULES,
    quantization: str = "none",
    quantization_block: int = 64,
) -> tuple[CausalLM, Any]:
    """Loads a local HF directory, or a Hub id `org/name[@revision]` (`dpojax.models.hub`), as
    (model, tokenizer).

    `dtype` is the compute dtype and, unless `param_dtype` is given, the parameter dtype;
    `attention` the implementation (`dpojax.models.attention`), `attention_block` the Pallas
    kernels' block (0: the chip's), `row_layout` the batch layout of the rows it will be called
    with (data.layout; "" = any: cuDNN attention only on plain causal rows) and `scan_layers` True, False or "auto" (on for TPUs and GPUs
    where the layer kinds allow it, `dpojax.models.scan`). With a
    `mesh`, each parameter is placed directly with the sharding its logical axes imply. With
    `quantization` int8 or nf4 the attention and MLP projections are quantized as they are read
    (`load_params`; `quantize_model`'s result without the float model in memory). The
    tokenizer is None when `tokenizer=False`.
    """
    path = resolve_model_dir(path)
    try:
        config = read_config(
            path, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat, attention=attention,
            attention_block=attention_block, row_layout=row_layout,
        )  # fmt: skip
        platform = config.target_platform or jax.default_backend()
        scan = resolve_scan(scan_layers, config.scan_period()[0], platform, remat=config.remat)
        config = config.replace(scan_layers=scan)
    except ModelConfigError as e:
        raise ModelFileError(str(e)) from None
    abstract = abstract_model(config)
    quantize = None if quantization == "none" else (quantization, quantization_block)
    shardings = None
    if mesh is not None:
        target = (
            abstract if quantize is None else abstract_model(_quantized_config(abstract, quantize))
        )
        shardings = named_shardings(target, mesh, rules)
    model = load_params(abstract, path, shardings=shardings, quantization=quantize)
    if not tokenizer:
        return model, None
    loaded = load_tokenizer(path)
    check_special_ids(loaded, config.vocab_size, path)
    return model, loaded


def check_special_ids(tokenizer, vocab_size: int, path: str | os.PathLike) -> None:
    """`ModelFileError` naming the tokenizer when its EOS, BOS or pad id is outside the model's
    vocabulary (an embedding row that does not exist: the loss would be NaN at the first step)."""
    for name in ("eos", "bos", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if isinstance(token_id, int) and not 0 <= token_id < vocab_size:
            token = getattr(tokenizer, f"{name}_token", None)
            raise ModelFileError(
                f"{path}: the tokenizer's {name.upper()} token {token!r} has id {token_id}, "
                f"outside the model's vocabulary of {vocab_size} (config.json vocab_size): the "
                "tokenizer files (tokenizer.json, tokenizer_config.json) do not belong to these "
                "weights; copy the model's own tokenizer into the folder"
            )


def model_tensors(
    model: CausalLM, dtype: str | None = None, *, keep: bool = True
) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named numpy arrays ([out, in] weights, experts one tensor
    each, Phi-3's projections fused), gathered to host. Parameters spread over several
    processes are gathered one at a time (every process must call this); with `keep=False` this
    process only takes part in the gathers and keeps nothing (so only the writing process holds
    the whole model in host memory)."""
    from jax.experimental import multihost_utils

    values = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        if not value.is_fully_addressable:
            value = multihost_utils.process_allgather(value, tiled=True)
        if not keep:
            continue
        arr = np.asarray(jax.device_get(value))
        values[p] = arr.astype(jnp.dtype(dtype)) if dtype is not None else arr
    values = _per_layer(model.config, values, lambda arr, g: arr[g])
    out = {}
    for m in tensor_maps(model.config, {p: v.shape for p, v in values.items()}):
        out.update(to_checkpoint(m, values))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_pretrained(
    model: CausalLM,
    tokenizer: Any,
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Writes `model` (and `tokenizer`, unless None) as a HF directory that transformers loads.

    LoRA adapters, if any, are merged into the weights.

    Weights are saved in `dtype` (default: the parameter dtype), split into shards with an index
    when they exceed `max_shard_bytes`. Only process 0 writes; every process must call this.
    """
    path = Path(path)
    model = merge_lora(model)
    tensors = model_tensors(model, dtype, keep=jax.process_index() == 0)
    if jax.process_index() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    save_dtype = dtype or config.param_dtype
    (path / "config.json").write_text(json.dumps(config_to_hf(config, dtype=save_dtype), indent=2))
    for stale in list(path.glob("model*.safetensors")) + [path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    if len(shards) == 1:
        save_tensors(shards[0], path / SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_tensors(shard, path / file)
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(a.nbytes for a in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    generation = {
        k: v
        for k, v in (
            ("bos_token_id", config.bos_token_id),
            ("eos_token_id", config.eos_token_id),
            ("pad_token_id", config.pad_token_id),
        )
        if v is not None
    }
    if generation:
        eos = generation.get("eos_token_id")
        if isinstance(eos, tuple):
            generation["eos_token_id"] = list(eos)
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
