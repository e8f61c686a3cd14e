"""bf16 master weights and the optimizers' rules, from the spec to the engine: what the DeepSpeed config says
(memfit.render.deepspeed), what the trainer config accepts (TrainerConfig's DeepSpeed checks) and what the
trainer hands DeepSpeed (memfit_trainer.deepspeed_engine.engine_config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from memfit.api.loading import load_documents
from memfit.api.plan import Strategy
from memfit.contract.engines import DeepSpeedEngineSection
from memfit.contract.reader import load_config
from memfit.contract.trainer_config import TrainerConfig
from memfit.planner.search import plan_job
from memfit.render.deepspeed import deepspeed_config
from memfit.render.trainer_config import render_trainer_config
from memfit_trainer.deepspeed_engine import engine_config
from tests.planning_fixtures import job
from tests.trainer.runs import make_config

EXAMPLES = Path(__file__).parent.parent / "examples"
BF16_MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def strategy(stage: int, **kw: Any) -> Strategy:
    fields: dict[str, Any] = dict(method="full", pool="p", nodes=1, gpus_per_node=8, zero_stage=stage,
                                  offload_optimizer="none", offload_parameters="none", gradient_checkpointing=False,
                                  micro_batch_size=1, gradient_accumulation_steps=4, precision="bf16",
                                  optimizer="adamw", attention="sdpa", master_weights="bf16")  # fmt: skip
    fields.update(kw)
    return Strategy(**fields)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_render_bf16_masters(stage: int) -> None:
    """ZeRO 1-3: DeepSpeed's bf16 masters, gradients and optimizer states. ZeRO-0: no precision section at
    all, so that DeepSpeed's optimizer steps the bf16 weights themselves."""
    config = deepspeed_config(job("llama-3.1-8b", "full", batch=32), strategy(stage))
    if stage == 0:
        assert "bf16" not in config and "fp16" not in config
    else:
        assert config["bf16"] == BF16_MASTERS
    fp32 = deepspeed_config(job("llama-3.1-8b", "full", batch=32), strategy(stage, master_weights="fp32"))
    assert fp32["bf16"] == {"enabled": True}


def test_render_refuses_what_bf16_masters_cannot_run_with() -> None:
    spec = job("llama-3.1-8b", "full", batch=32)
    with pytest.raises(ValueError, match="masterWeights bf16 needs training.precision bf16"):
        deepspeed_config(spec, strategy(2, precision="fp16"))
    with pytest.raises(ValueError, match="masterWeights bf16 keeps the optimizer on the GPU"):
        deepspeed_config(spec, strategy(2, offload_optimizer="cpu"))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_engine_config_fills_in_the_masters_section(stage: int, tmp_path: Path) -> None:
    """A DeepSpeed section without precision gets the one the master weights need; at ZeRO-0 with bf16
    masters none (DeepSpeed would otherwise wrap the optimizer in fp32 masters)."""
    config = make_config(tmp_path, stage=stage, offload=False, master_weights="bf16")
    config = without_bf16(config)
    filled = engine_config(config, client=False)
    assert filled.get("bf16") == (None if stage == 0 else BF16_MASTERS)
    fp32 = make_config(tmp_path, stage=stage, offload=False)
    assert engine_config(without_bf16(fp32), client=False)["bf16"] == {"enabled": True}


def without_bf16(config: TrainerConfig) -> TrainerConfig:
    assert isinstance(config.engine, DeepSpeedEngineSection)
    deepspeed = {key: value for key, value in config.engine.config.items() if key != "bf16"}
    return config.model_copy(update={"engine": DeepSpeedEngineSection(config=deepspeed)})


def config_document(tmp_path: Path, stage: int, master_weights: str, bf16: dict[str, Any] | None, **training: Any):
    config = make_config(tmp_path, stage=stage, offload=False, master_weights=master_weights)
    document = config.to_api()
    document["engine"]["config"].pop("bf16", None)
    if bf16 is not None:
        document["engine"]["config"]["bf16"] = bf16
    document["training"].update(training)
    return document


@pytest.mark.parametrize(
    ("stage", "master_weights", "bf16", "training", "message"),
    [
        (0, "bf16", {"enabled": True}, {}, "at ZeRO-0 trains the bf16 weights themselves"),
        (2, "bf16", {"enabled": True}, {}, "needs deepspeed.bf16.bf16_master_weights_and_grads"),
        (2, "bf16", {"enabled": False}, {}, "needs deepspeed.bf16.bf16_master_weights_and_grads"),
        (2, "fp32", BF16_MASTERS, {}, "keeps bf16 master weights but training.masterWeights is fp32"),
        (2, "bf16", {"enabled": True, "bf16_optimizer_states": True}, {}, "bf16_optimizer_states needs"),
        (2, "bf16", BF16_MASTERS, {"precision": "fp32"}, "masterWeights bf16 needs training.precision bf16"),
    ],
)
def test_trainer_config_refuses_masters_its_deepspeed_section_does_not_keep(
    tmp_path: Path, stage: int, master_weights: str, bf16: dict[str, Any], training: dict[str, Any], message: str
) -> None:
    document = config_document(tmp_path, stage, master_weights, bf16, **training)
    with pytest.raises(ValidationError, match=message):
        TrainerConfig.model_validate(document)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainer_config_accepts_the_rendered_masters(tmp_path: Path, stage: int) -> None:
    for bf16 in (None, BF16_MASTERS if stage else {"enabled": False}):
        TrainerConfig.model_validate(config_document(tmp_path, stage, "bf16", bf16))


def test_trainer_config_refuses_an_fp16_section_with_bf16_keys(tmp_path: Path) -> None:
    document = config_document(tmp_path, 2, "fp32", None, precision="fp16")
    document["engine"]["config"]["fp16"] = {"enabled": True, "bf16_optimizer_states": True}
    with pytest.raises(ValidationError, match="deepspeed.fp16 cannot hold"):
        TrainerConfig.model_validate(document)


def test_bf16_master_plans_render_configs_the_trainer_loads(tmp_path: Path) -> None:
    """Every candidate of the examples with masterWeights bf16 pinned renders a trainer config that loads as
    it is (the DeepSpeed section agrees with training.masterWeights at every stage)."""
    pools = load_documents(EXAMPLES / "inventory.yaml").pools
    rendered = 0
    for name in ("llama-3.1-8b-lora.yaml", "custom-architecture.yaml", "tiny/job.yaml"):
        example = load_documents(EXAMPLES / name).jobs[0]
        spec = example.spec.model_copy(
            update={
                "strategy": example.spec.strategy.model_copy(update={"master_weights": "bf16"}),
                "training": example.spec.training.model_copy(update={"optimizer": "adamw"}),
            }
        )
        example = example.model_copy(update={"spec": spec})
        for candidate in plan_job(spec, pools).candidates:
            config = render_trainer_config(example, candidate)
            assert config.training.master_weights == "bf16"
            path = tmp_path / "config.json"
            path.write_text(config.to_json())
            assert load_config(path) == config
            rendered += 1
    assert rendered


# --- bitsandbytes optimizers never under optimizer offload ---------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw8bit", "paged_adamw8bit"])
def test_8bit_optimizer_with_optimizer_offload_is_refused_end_to_end(optimizer: str, tmp_path: Path) -> None:
    """bitsandbytes' optimizers keep their states on the GPU (and a paged one in CUDA managed memory): the
    spec, the renderer and the trainer config each refuse them with optimizer offload."""
    with pytest.raises(ValidationError, match="8-bit optimizers run on the GPU; they cannot be combined with"):
        job("llama-3.1-8b", "full", batch=32, training={"globalBatchSize": 32, "sequenceLength": 2048,
            "optimizer": optimizer}, strategy={"offloadOptimizer": "cpu"})  # fmt: skip
    spec = job("llama-3.1-8b", "full", batch=32)
    with pytest.raises(ValueError, match="8-bit optimizers run on the GPU"):
        deepspeed_config(spec, strategy(2, optimizer=optimizer, offload_optimizer="cpu", master_weights="fp32"))
    with pytest.raises(ValidationError, match=f"{optimizer} keeps its 8-bit states on the GPU: it cannot be offloaded"):
        make_config(tmp_path, stage=2, offload=True, optimizer=optimizer)
    plans = plan_job(
        job("llama-3.1-8b", "full", batch=32, training={"globalBatchSize": 32, "sequenceLength": 2048,
            "optimizer": optimizer}), load_documents(EXAMPLES / "inventory.yaml").pools,
    )  # fmt: skip
    assert all(c.strategy.offload_optimizer == "none" for c in [*plans.candidates, *plans.rejected])
