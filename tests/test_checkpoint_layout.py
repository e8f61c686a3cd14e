"""Which checkpoint layout converts into which: the pure rule the trainer follows and the operator's re-plan
Event reports (memfit.contract.layout.CheckpointLayout.converts_to), and the marker's record of a layout."""

from __future__ import annotations

import pytest

from memfit.api.vocabulary import Engine, MasterWeights, Method, Precision
from memfit.contract.layout import CheckpointLayout


def _deepspeed(
    stage: int,
    world: int,
    method: Method = Method.FULL,
    precision: Precision = Precision.BF16,
    masters: MasterWeights = MasterWeights.FP32,
) -> CheckpointLayout:
    return CheckpointLayout.of_run(method, precision, stage, world, masters, Engine.DEEPSPEED)


FSDP2 = CheckpointLayout.of_run(Method.FULL, Precision.BF16, 3, 8, MasterWeights.FP32, Engine.FSDP2)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (_deepspeed(2, 2), _deepspeed(3, 1)),
        (_deepspeed(3, 8), _deepspeed(3, 4)),
        (_deepspeed(3, 8), FSDP2),
        (_deepspeed(1, 8), _deepspeed(2, 4)),
        (_deepspeed(1, 2), _deepspeed(1, 16)),
        (_deepspeed(2, 2), FSDP2),
        (_deepspeed(2, 2, Method.LORA), _deepspeed(3, 4, Method.LORA)),
        (FSDP2, FSDP2),
        (_deepspeed(2, 2), _deepspeed(2, 2)),
    ],
)
def test_deepspeed_zero_partitions_convert_to_another_stage_world_size_or_fsdp2(
    source: CheckpointLayout, target: CheckpointLayout
) -> None:
    assert source.converts_to(target) is None


@pytest.mark.parametrize(
    ("source", "target", "reason"),
    [
        (_deepspeed(2, 2), _deepspeed(2, 2, Method.LORA), "the method changed (full to lora)"),
        (_deepspeed(2, 2, Method.QLORA), FSDP2, "the method changed (qlora to full)"),
        (_deepspeed(2, 2), _deepspeed(2, 2, precision=Precision.FP16), "the precision changed (bf16 to fp16)"),
        (_deepspeed(2, 2), _deepspeed(3, 2, masters=MasterWeights.BF16), "the master weights changed (fp32 to bf16)"),
        (FSDP2, _deepspeed(2, 2), "no conversion from fsdp2"),
        (_deepspeed(0, 2), _deepspeed(2, 2), "ZeRO stages 1-3 only"),
        (_deepspeed(2, 2), _deepspeed(0, 1), "ZeRO stages 1-3 only"),
        (_deepspeed(3, 2), _deepspeed(2, 2), "loads into ZeRO-3 or fsdp2 only"),
        (_deepspeed(2, 2, masters=MasterWeights.BF16), _deepspeed(3, 1, masters=MasterWeights.BF16), "fp32 master"),
    ],
)
def test_a_conversion_that_does_not_exist_says_why(
    source: CheckpointLayout, target: CheckpointLayout, reason: str
) -> None:
    said = source.converts_to(target)
    assert said is not None and reason in said


@pytest.mark.parametrize("layout", [_deepspeed(2, 2), _deepspeed(3, 4, masters=MasterWeights.BF16), FSDP2])
def test_a_marker_records_the_layout_it_was_written_by(layout: CheckpointLayout) -> None:
    assert CheckpointLayout.from_dict(layout.to_dict()) == layout


def test_a_malformed_marker_layout_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="not a checkpoint layout"):
        CheckpointLayout.from_dict({"method": "full", "precision": "bf16", "zeroStage": "two", "worldSize": 2})
