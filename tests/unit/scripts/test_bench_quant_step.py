"""scripts/bench_quant_step.py: its cases are configs the schema takes, differing only in the
quantization, and the summary's ratio to the bfloat16 base."""

from __future__ import annotations

from dpojax import api
from tests.helpers.repo_files import load_file

bench = load_file("scripts/bench_quant_step.py")


def test_the_cases_are_valid_configs_that_differ_only_in_the_quantization():
    args = bench._parse(["--hidden", "256", "--block", "32", "--pairs", "2"])
    configs = {c: api.config(None, bench.overrides(args, c, "m", "p.jsonl")) for c in bench.CASES}
    assert {c: cfg.model.quantization for c, cfg in configs.items()} == {c: c for c in bench.CASES}
    assert configs["nf4"].model.quantization_block == 32
    assert configs["nf4"].reference.type == "lora_base"
    assert len(configs["nf4"].lora.targets) == 7
    assert configs["nf4"].train.batch_size == 2
    for c in ("int8", "nf4"):
        configs[c].model.quantization = "none"
        assert configs[c].to_dict() == configs["none"].to_dict()


def test_the_summary_takes_medians_and_the_ratio_to_the_bf16_base():
    step_1 = dict(loss_1=0.69, logps_chosen_1=-1.0, logps_rejected_1=-2.0)
    times = (("none", 1.0), ("nf4", 3.0), ("none", 2.0), ("nf4", 4.0), ("none", 3.0))
    runs = [
        dict(case=c, median_s=s, step_s=[s, s + 1], compile_s=1.0, peak_rss_mib=9.0, **step_1)
        for c, s in times
    ]
    out = bench.summarize(runs, ["none", "nf4"])
    assert out["none"]["median_s"] == 2.0 and out["nf4"]["median_s"] == 3.5
    assert out["nf4"]["x_bf16_median"] == 1.75
    assert out["nf4"]["fastest_s"] == 3.0 and out["nf4"]["x_bf16_fastest"] == 3.0
