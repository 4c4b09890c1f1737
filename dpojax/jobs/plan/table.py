"""The text table `mode=plan` prints (`dpojax.jobs.plan`): the candidates, best first; each
attention implementation's kernel; the largest collectives of the best candidate's step."""

from __future__ import annotations

from typing import Any

from dpojax.models.sharding import MESH_AXES


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def format_table(report: dict[str, Any]) -> str:
    """The candidates as a fixed-width table, best first."""
    chip = report["chip"]
    head = f"plan for {report['target']} ({report['devices']} devices"
    head += f", {chip['name']}, {chip['hbm_bytes'] / 2**30:.1f} GiB each)" if chip else ")"
    rows = [head, "mesh: " + " x ".join(MESH_AXES), ""]
    columns = (
        "candidate",
        "mesh",
        "fits",
        "GiB/device",
        "params",
        "opt",
        "temp",
        "TFLOP/dev",
        "comm GB",
        "step s >=",
        "bound by",
        "MFU <=",
        "compile s",
    )
    rows.append("  ".join(f"{c:>12}" if i else f"{c:<22}" for i, c in enumerate(columns)))
    for r in report["candidates"]:
        train, state, roof = r["train"], r["state_bytes_per_device"], r.get("roofline") or {}
        total = train.get("total_bytes") or train.get("needed_bytes")
        cells = (
            r["label"][:22],
            "x".join(str(r["mesh"].get(a, 1)) for a in MESH_AXES),
            "yes" if r["fits"] else "NO",
            _gib(total),
            _gib(state["parameters"] + state["reference"]),
            _gib(state["optimizer"]),
            _gib(
                (train.get("memory_bytes") or {}).get("temp", train.get("needed_temporaries_bytes"))
            ),
            f"{r['model_flops_per_device'] / 1e12:.2f}",
            _comm_gb(train),
            f"{roof['step_seconds_bound']:.3f}" if roof else "-",
            roof.get("bound_by", "-"),
            f"{roof['mfu_bound']:.0%}" if roof.get("mfu_bound") is not None else "-",
            f"{train['compile_seconds']:.1f}" if "compile_seconds" in train else "-",
        )
        rows.append("  ".join(f"{c:>12}" if i else f"{c:<22}" for i, c in enumerate(cells)))
    rows += [
        "",
        "attention (the recipe's shapes, per device; share: of that implementation's step):",
    ]
    rows += attention_table(report.get("attention_implementations") or [])
    best = report["candidates"][0]
    rows += ["", f"communication of {best['label']} (train step, per device):"]
    seconds = (best.get("roofline") or {}).get("communication_seconds_per_axis")
    rows += communication_table(best["train"].get("communication"), seconds)
    overlap = (best.get("roofline") or {}).get("context_overlap")
    if overlap:
        rows.append(
            f"  context axis: {overlap['communication_seconds']:.3f} s of communication, "
            f"{overlap['attention_compute_seconds']:.3f} s of attention compute: "
            f"{overlap['hideable_share']:.0%} of it can hide behind attention"
        )
    for r in report["candidates"]:
        for warning in (r["train"].get("communication") or {}).get("warnings", []):
            rows.append(f"WARNING ({r['label']}): {warning}")
    return "\n".join(rows)


def _share(share: dict | None, key: str) -> str:
    value = (share or {}).get(key)
    return "n/a" if value is None else f"{value:.1%}"


def attention_table(kernels: list[dict]) -> list[str]:
    """Each attention implementation's kernel: its block, one layer's forward + backward
    temporaries, its bytes and FLOPs per step and their shares of the step (XLA's FLOPs: n/a
    where the backend has no cost analysis; model: dpojax's FLOP model)."""
    head = ("implementation", "block", "temp GiB", "GB/step", "bytes %", "TFLOP/step", "FLOPs %")
    lines = ["  " + "".join(f"{h:>12}" if i else f"{h:<16}" for i, h in enumerate(head))]
    lines[0] += "  model FLOPs %"
    for k in kernels:
        if not k["runs"]:
            lines.append(f"  {k['implementation']:<16}does not run here: {k['reason'][:90]}")
            continue
        step = k["per_step"]
        flops = step["compiled_flops"]
        cells = (
            k["implementation"],
            str(k.get("block") or "-"),
            _gib(step["temp_bytes"]) + ("" if step["fits"] else " OOM"),
            f"{step['hlo_bytes'] / 1e9:.2f}" if step["hlo_bytes"] is not None else "n/a",
            _share(k.get("share"), "hlo_bytes"),
            "n/a" if flops is None else f"{flops / 1e12:.3f}",
            _share(k.get("share"), "flops"),
        )
        model = _share(k.get("share"), "model_flops")
        lines.append(
            "  "
            + "".join(f"{c:>12}" if i else f"{c:<16}" for i, c in enumerate(cells))
            + f"  {model:>13}"
        )
    return lines


def _comm_gb(train: dict) -> str:
    comm = train.get("communication")
    return "-" if comm is None else f"{comm['moved_bytes_per_device'] / 1e9:.2f}"


def communication_table(
    comm: dict | None, seconds: dict | None = None, limit: int = 12
) -> list[str]:
    """The largest collectives of an audit and its totals per mesh axis (with the seconds they
    take on their links, where the roofline has them), as text lines."""
    if comm is None:
        return ["  (not compiled)"]
    lines = [f"  {'kind':<20}{'axes':<14}{'link':<7}{'per step':>9}{'GB moved':>10}  operand"]
    for e in comm["collectives"][:limit]:
        shapes = " + ".join(e["operand_shapes"])
        lines.append(
            f"  {e['kind']:<20}{e['axes']:<14}{e['link']:<7}{e['count_per_step']:>9}"
            f"{e['moved_bytes_per_device'] / 1e9:>10.3f}  {shapes[:60]}"
        )
    if len(comm["collectives"]) > limit:
        lines.append(f"  ... {len(comm['collectives']) - limit} more kinds in plan.json")
    for axes, total in comm["per_axis"].items():
        time = "" if seconds is None else f", >= {seconds.get(axes, 0.0):.4f} s"
        lines.append(
            f"  total over {axes}: {total['collectives_per_step']} collectives, "
            f"{total['moved_bytes_per_device'] / 1e9:.3f} GB per device{time}"
        )
    return lines
