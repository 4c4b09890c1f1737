"""Optimizers and learning-rate schedules (optax)."""

from __future__ import annotations

import optax

SCHEDULES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adamw", "adam", "sgd", "lion")


def make_schedule(
    learning_rate: float,
    *,
    schedule: str = "cosine",
    warmup_steps: int = 0,
    total_steps: int = 1,
    min_lr_ratio: float = 0.0,
) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then constant, linear decay or cosine decay to
    `min_lr_ratio * learning_rate` at `total_steps`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if learning_rate <= 0:
        raise ValueError(f"learning_rate must be positive, got {learning_rate}")
    decay_steps = max(total_steps - warmup_steps, 1)
    end = learning_rate * min_lr_ratio
    if schedule == "constant":
        main = optax.constant_schedule(learning_rate)
    elif schedule == "linear":
        main = optax.linear_schedule(learning_rate, end, decay_steps)
    else:
        main = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=min_lr_ratio)
    if warmup_steps <= 0:
        return main
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, main], [warmup_steps])


def make_optimizer(
    learning_rate: float = 5e-7,
    *,
    schedule: str = "cosine",
    warmup_steps: int = 0,
    total_steps: int = 1,
    min_lr_ratio: float = 0.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
    name: str = "adamw",
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule): global-norm clipping then AdamW (default), Adam, SGD or Lion."""
    lr = make_schedule(
        learning_rate,
        schedule=schedule,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        min_lr_ratio=min_lr_ratio,
    )
    if name == "adamw":
        tx = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    elif name == "adam":
        tx = optax.adam(lr, b1=b1, b2=b2, eps=eps)
    elif name == "sgd":
        tx = optax.sgd(lr)
    elif name == "lion":
        tx = optax.lion(lr, b1=b1, b2=b2, weight_decay=weight_decay)
    else:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {name!r}")
    if max_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
    return tx, lr
