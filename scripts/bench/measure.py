"""What the benchmark measures besides the steps: the matmul peak that the model FLOP utilisation
is measured against, peak memory, the machine's load, and the summary of a run's step times."""

from __future__ import annotations

import math
import os
import resource
import statistics
import time


def peak_rss_gb() -> float:
    """This process's peak resident memory in GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timing_summary(times: list[float]) -> dict:
    return dict(
        s_per_step=sum(times) / len(times),
        s_per_step_median=statistics.median(times),
        s_per_step_min=min(times),
        s_per_step_max=max(times),
        step_times=[round(t, 4) for t in times],
    )


def matmul_peak(spec: dict) -> dict:
    """Float32 matmul throughput of a jitted a @ b, per square size: the rate sustained over ~2 s
    of back-to-back calls (under the same load as the steps: the MFU reference) and the fastest
    single call (close to the idle machine's peak when the CPU is shared). `spec` is unused: the
    peak worker takes the run's spec as every worker does."""
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
