"""The reference model as a typed choice: one small record per kind, each holding only the
settings that mean something for it.

  FrozenReference       a copy of the initial policy (its base under LoRA), or of `path`, a
                        separate model; held in the train state, run in every micro-batch
  LoraBaseReference     the policy's own base with its LoRA adapters off; nothing held
  PrecomputedReference  the log-probs of the initial policy (or of `path`) computed once before
                        training, cached under `cache_dir`, carried in the batch; no forward
                        pass in the step

TR-DPO (`sync`) exists on the two kinds whose reference the step runs. Where a reference is read
from (`path`, `cache_dir`) is not part of a record's equality or hash: the compiled step does not
depend on it, so a loop's rounds, whose reference moves from checkpoint to checkpoint, keep
reusing one `Stepper` (`dpojax.jobs.train.trainer.StepperCache`). The config's
`reference.*` keys become one of them in `reference_choice` (the config checks refuse the
combinations no record can hold before any compute: a path with lora_base, TR-DPO with
precomputed). A reference-free loss (`LossSettings.without_reference`) is not a kind: whatever the
kind, no reference is then held or run (`StepConfig.reference_forward`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class Sync:
    """TR-DPO (TRL sync_ref_model): every `every` optimizer steps the reference moves toward the
    policy, ref = alpha * policy + (1 - alpha) * ref (`dpojax.train.state.sync_reference`)."""

    every: int
    alpha: float = 0.6


@dataclasses.dataclass(frozen=True)
class FrozenReference:
    """A frozen copy of the initial policy, or of the separate model at `path`."""

    kind: ClassVar[str] = "frozen"
    runs_forward: ClassVar[bool] = True  # the step runs the reference model
    # a separate model (local directory or Hub id); "": the initial policy
    path: str = dataclasses.field(default="", compare=False)
    sync: Sync | None = None


@dataclasses.dataclass(frozen=True)
class LoraBaseReference:
    """The policy's base under LoRA (the adapters off): no copy is held."""

    kind: ClassVar[str] = "lora_base"
    runs_forward: ClassVar[bool] = True
    path: ClassVar[str] = ""  # always the policy's own base
    sync: Sync | None = None


@dataclasses.dataclass(frozen=True)
class PrecomputedReference:
    """Log-probs computed once before training (of the initial policy, or of `path`)."""

    kind: ClassVar[str] = "precomputed"
    runs_forward: ClassVar[bool] = False  # its log-probs ride in the batch
    path: str = dataclasses.field(default="", compare=False)
    cache_dir: str = dataclasses.field(default="", compare=False)  # "": WORKDIR/reference_cache
    sync: ClassVar[None] = None  # the log-probs are fixed


Reference = FrozenReference | LoraBaseReference | PrecomputedReference
KINDS: dict[str, type] = {
    cls.kind: cls for cls in (FrozenReference, LoraBaseReference, PrecomputedReference)
}
REFERENCE_TYPES = tuple(KINDS)


def reference_choice(settings: Any) -> Reference:
    """The reference the config's `reference.*` keys (`settings`: the group, typed or a
    ConfigDict) describe. Raises ValueError, naming the key, for a combination no kind holds."""
    kind = settings.type
    if kind not in KINDS:
        raise ValueError(
            f"config key 'reference.type' must be one of {', '.join(KINDS)}; got {kind!r}"
        )
    sync = Sync(int(settings.sync_every), float(settings.sync_alpha))
    sync = sync if sync.every else None
    if kind == "precomputed":
        if sync is not None:
            raise ValueError(
                "config key 'reference.sync_every' (TR-DPO) needs a reference the step runs: "
                "reference.type=precomputed computes its log-probs once"
            )
        return PrecomputedReference(path=settings.path, cache_dir=settings.cache_dir)
    if kind == "lora_base":
        if settings.path:
            raise ValueError(
                "config key 'reference.path' must be empty with reference.type=lora_base"
            )
        return LoraBaseReference(sync=sync)
    return FrozenReference(path=settings.path, sync=sync)
