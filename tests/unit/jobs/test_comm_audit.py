"""The communication audit on HLO text written by hand: each form of device groups, loop trip
counts (nested loops multiply; a loop without one matters only if it holds a collective), bytes
moved per device, totals per axis and per link, and the
warning for a collective that carries the global token dimension."""

from __future__ import annotations

import pytest

from dpojax.jobs.plan.comm_audit import Layout, audit, axes_of, memory_traffic, moved_bytes

MESH = {"data": 2, "fsdp": 2, "tensor": 2}  # device d sits at (d // 4, d // 2 % 2, d % 2)

HLO = """HloModule jit_train_step, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%inner_body (p: (s32[], bf16[4,64])) -> (s32[], bf16[4,64]) {
  %p = (s32[], bf16[4,64]) parameter(0)
  %w = bf16[4,64]{1,0} get-tuple-element(%p), index=1
  %ag = bf16[8,64]{1,0} all-gather(%w), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true
  ROOT %t = (s32[], bf16[4,64]) tuple(%i, %w)
}

%inner_cond (p: (s32[], bf16[4,64])) -> pred[] {
  %p = (s32[], bf16[4,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (p: (s32[], bf16[4,64])) -> (s32[], bf16[4,64]) {
  %p = (s32[], bf16[4,64]) parameter(0)
  %loop = (s32[], bf16[4,64]) while(%p), condition=%inner_cond, body=%inner_body
  %x = f32[16,2048,32]{2,1,0} get-tuple-element(%q), index=0
  %ar = f32[16,2048,32]{2,1,0} all-reduce(%x), channel_id=2, replica_groups={{0,2},{1,3},{4,6},{5,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], bf16[4,64]) tuple(%i, %w)
}

%outer_cond (p: (s32[], bf16[4,64])) -> pred[] {
  %p = (s32[], bf16[4,64]) parameter(0)
  ROOT %c = pred[] constant(true)
}

%quiet_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  ROOT %same = (s32[], f32[8]) copy(%p)
}

ENTRY %main (a: bf16[4,64], g: f32[32,64]) -> f32[16,64] {
  %a = bf16[4,64]{1,0} parameter(0)
  %g = f32[32,64]{1,0} parameter(1)
  %outer = (s32[], bf16[4,64]) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"4"}}
  %ids = s32[8,2048]{1,0} parameter(2)
  %h = bf16[8,2048,32]{2,1,0} parameter(3)
  %ag-ids = s32[16,2048]{1,0} all-gather(%ids), channel_id=5, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %ag-h-start = (bf16[8,2048,32], bf16[16,2048,32]) all-gather-start(%h), channel_id=6, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %ag-h-done = bf16[16,2048,32]{2,1,0} all-gather-done(%ag-h-start)
  %quiet = (s32[], f32[8]) while(%init2), condition=%outer_cond, body=%quiet_body
  %rs = f32[16,64]{1,0} reduce-scatter(%g), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}, to_apply=%add
  %cp-start = (f32[16,64], f32[16,64]) collective-permute-start(%rs), channel_id=4, source_target_pairs={{0,4},{4,0}}
  %cp-done = f32[16,64]{1,0} collective-permute-done(%cp-start)
  ROOT %out = f32[16,64]{1,0} add(%cp-done, %cp-done)
}
"""


def _by_kind(report):
    """The collectives by kind; all-gathers of the batch (operands with 2048 tokens) apart."""
    return {
        e["kind"] + ("/batch" if e["kind"] == "all-gather" and "2048" in str(e) else ""): e
        for e in report["collectives"]
    }


def test_collectives_with_their_axes_counts_and_bytes():
    layout = Layout(MESH, hosts=(0, 0, 0, 0, 1, 1, 1, 1), token_shapes=((16, 2048),))
    report = audit(HLO, layout)
    rows = _by_kind(report)
    assert set(rows) == {
        "all-gather",
        "all-gather/batch",
        "all-reduce",
        "reduce-scatter",
        "collective-permute",
    }
    # the all-gather in a 3-trip loop inside a 4-trip loop: 12 per step; iota groups of 2
    gather = rows["all-gather"]
    assert gather["count_per_step"] == 12 and gather["axes"] == "tensor"
    assert gather["operand_shapes"] == ["bf16[4,64]"] and gather["operand_bytes"] == 512
    assert gather["moved_bytes_per_device"] == 12 * 512 * (2 - 1)
    assert gather["link"] == "local" and not gather["activation_sized"]
    # listed groups {0,2}: fsdp; an activation of the whole batch (16 rows of 2048 tokens)
    reduce = rows["all-reduce"]
    assert reduce["count_per_step"] == 4 and reduce["axes"] == "fsdp"
    assert reduce["moved_bytes_per_device"] == 4 * 2 * (16 * 2048 * 32 * 4) / 2
    assert reduce["activation_sized"]
    # mesh form: axis_0 of a [2, 4] device grid pairs d with d + 4: the data axis, across hosts
    scatter = rows["reduce-scatter"]
    assert scatter["axes"] == "data" and scatter["link"] == "dcn"
    assert scatter["count_per_step"] == 1 and scatter["moved_bytes_per_device"] == 32 * 64 * 4 / 2
    permute = rows["collective-permute"]
    assert permute["axes"] == "data" and permute["moved_bytes_per_device"] == 16 * 64 * 4
    assert report["per_axis"]["tensor"] == {
        "collectives_per_step": 12,
        "moved_bytes_per_device": 6144.0,
    }
    # an all-gather of activations to the whole batch is flagged (what it gathers is checked),
    # one of the batch's token ids is not (no feature dimension)
    gathers = [
        e for e in report["collectives"] if e["kind"] == "all-gather" and e["axes"] == "data"
    ]
    flagged = {e["operand_shapes"][0]: e["activation_sized"] for e in gathers}
    assert flagged == {"bf16[8,2048,32]": True, "s32[8,2048]": False}
    assert {e["link"] for e in gathers} == {"dcn"}
    gathered = 8 * 2048 * (32 * 2 + 4)
    assert report["moved_bytes_per_link"]["dcn"] == 32 * 64 * 2 + 16 * 64 * 4 + gathered
    assert report["collectives_per_step"] == 12 + 4 + 1 + 1 + 2
    assert [w.split(" (")[0] for w in report["warnings"]] == [
        "all-reduce of f32[16,2048,32] over fsdp",
        "all-gather of bf16[8,2048,32] over data",
    ]


def test_weight_shapes_and_an_unsplit_batch_raise_no_warning():
    weights = Layout(MESH, token_shapes=((16, 2048),), weight_shapes=frozenset({(16, 2048, 32)}))
    assert audit(HLO, weights)["warnings"] == []
    assert audit(HLO, Layout(MESH))["warnings"] == []


def test_a_loop_without_a_trip_count_is_counted_once_and_said():
    text = HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    report = audit(text, Layout(MESH))
    assert _by_kind(report)["all-reduce"]["count_per_step"] == 1
    assert report["warnings"] == ["1 loop(s) without a known trip count were counted once"]


def test_axes_of_groups():
    assert axes_of([[0, 1, 2, 3, 4, 5, 6, 7]], MESH) == ["data", "fsdp", "tensor"]
    assert axes_of([[0, 2, 4, 6], [1, 3, 5, 7]], MESH) == ["data", "fsdp"]
    assert axes_of([[0], [1]], MESH) == []
    assert axes_of(None, MESH) is None


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("all-reduce", 2 * 100 * 3 / 4),
        ("all-gather", 300),
        ("reduce-scatter", 75),
        ("all-to-all", 75),
        ("collective-permute", 100),
    ],
)
def test_moved_bytes(kind, expected):
    assert moved_bytes(kind, 100, 4) == expected
    assert moved_bytes(kind, 100, 1) == 0


TRAFFIC = """HloModule m

%fused (x: f32[100]) -> f32[100] {
  %x = f32[100]{0} parameter(0)
  %y = f32[100]{0} multiply(%x, %x)
  ROOT %z = f32[100]{0} add(%y, %x)
}

%body (p: (s32[], f32[100])) -> (s32[], f32[100]) {
  %p = (s32[], f32[100]) parameter(0)
  %v = f32[100]{0} get-tuple-element(%p), index=1
  %w = bf16[100]{0} convert(%v)
  ROOT %t = (s32[], f32[100]) tuple(%i, %v)
}

%cond (p: (s32[], f32[100])) -> pred[] {
  %p = (s32[], f32[100]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[100]) -> f32[100] {
  %a = f32[100]{0} parameter(0)
  %f = f32[100]{0} fusion(%a), kind=kLoop, calls=%fused
  %loop = (s32[], f32[100]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[100]{0} copy(%f)
}
"""


def test_memory_traffic_counts_fusions_at_their_boundary_and_loops_by_trip_count():
    fusion = 400 + 400  # reads a, writes f; its multiply and add stay on chip
    convert = 5 * (400 + 200)  # five trips: reads v (f32), writes w (bf16)
    copy = 400 + 400
    assert memory_traffic(TRAFFIC) == fusion + convert + copy


SLICED = """HloModule m

%fused_slice (w: f32[10,100], i: s32[]) -> f32[1,100] {
  %w = f32[10,100]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %s = f32[1,100]{1,0} dynamic-slice(%w, %i, %z), dynamic_slice_sizes={1,100}
}

%nested (w: f32[10,100], i: s32[]) -> f32[1,100] {
  %w = f32[10,100]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %r = f32[1,100]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  ROOT %n = f32[1,100]{1,0} negate(%r)
}

%fused_update (acc: f32[10,100], u: f32[1,100], i: s32[]) -> f32[10,100] {
  %acc = f32[10,100]{1,0} parameter(0)
  %u = f32[1,100]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %old = f32[1,100]{1,0} dynamic-slice(%acc, %i, %z), dynamic_slice_sizes={1,100}
  %x = f32[1,100]{1,0} exponential(%u)
  %e = f32[1,100]{1,0} add(%old, %x)
  ROOT %d = f32[10,100]{1,0} dynamic-update-slice(%acc, %e, %i, %z)
}

%body (p: (s32[], f32[10,100], f32[10,100])) -> (s32[], f32[10,100], f32[10,100]) {
  %p = (s32[], f32[10,100], f32[10,100]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[10,100]{1,0} get-tuple-element(%p), index=1
  %acc = f32[10,100]{1,0} get-tuple-element(%p), index=2
  %row = f32[1,100]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %new = f32[10,100]{1,0} fusion(%acc, %row, %i), kind=kLoop, calls=%fused_update
  %wrapped = f32[1,100]{1,0} fusion(%w, %i), kind=kLoop, calls=%nested
  %z = s32[] constant(0)
  %raw = f32[1,100]{1,0} dynamic-slice(%w, %i, %z), dynamic_slice_sizes={1,100}
  ROOT %t = (s32[], f32[10,100], f32[10,100]) tuple(%i, %w, %new)
}

%cond (p: (s32[], f32[10,100], f32[10,100])) -> pred[] {
  %p = (s32[], f32[10,100], f32[10,100]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: (s32[], f32[10,100], f32[10,100])) -> (s32[], f32[10,100], f32[10,100]) {
  %a = (s32[], f32[10,100], f32[10,100]) parameter(0)
  ROOT %loop = (s32[], f32[10,100], f32[10,100]) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
}
"""


def test_memory_traffic_counts_a_slice_per_trip_not_the_array():
    """A loop walking the rows of a [10, 100] array (as flash attention walks blocks and scanned
    layers their stacked weights) reads a row per trip; an in-place update of an accumulator
    (flash attention's output blocks) reads and writes the rows it updates."""
    row = 400
    slice_fusion = row + 4 + row  # reads one row (and the index), writes it
    # reads the accumulator's row, the row to add and the index; writes the row in place
    update_fusion = row + row + 4 + row
    raw_slice = 2 * row
    nested = row + 4 + row  # a fusion whose nested fusion slices the array: the row too
    assert memory_traffic(SLICED) == 10 * (slice_fusion + update_fusion + raw_slice + nested)
