"""Every causal-LM model type the installed ``transformers`` registers is profiled and planned, or refused in one
line: a tiny config.json of each (tests.trainer.every_causal_lm) goes through the profiler in-process
(``memfit_trainer.profile.profile``: the model built on the meta device, its tensors, what bitsandbytes
quantizes, what peft's ``all-linear`` adapts, a traced training step of its own code) and the planner
(``memfit.planner.search.plan_job`` on a ``ProfiledModel``), as ``memfit plan`` plans a model directory.

Tracing every setup at every token count, as a real profile does, takes minutes per model; here each model
traces one step of LoRA at :data:`TOKENS` tokens (of full fine-tuning where that fails), each term its measured
point (as ``activation_profile.solve`` keeps a term no form reproduces), and a LoRA job (full fine-tuning where
the LoRA step failed) is planned where such a point is exact: one row of :data:`TOKENS` tokens per micro-batch,
gradient checkpointing off. A model whose full fine-tuning step alone would fail is not caught here. The models
are profiled in two processes (``memfit_trainer.trace_workers``).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.planner.search import PlanningError, plan_job
from memfit.profile import ActivationProfile, ActivationTerm, ActivationTerms, LayerActivations, OutsideTerms
from memfit.profiled_model import ProfiledModel
from tests.planning_fixtures import A100_NODE
from tests.trainer.every_causal_lm import causal_lm_types, tiny_config

TOKENS = 16
ENCODER_DECODER = "is an encoder-decoder model"
ENCODER = "is an encoder, not a causal language model"
FAKE_TRACE = "which a trace on fake tensors cannot know"
STEP_FAILS = "a traced training step fails in its own code"
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        ["bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "musicgen"],
        ENCODER_DECODER,
    ),
    **dict.fromkeys(["musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "whisper"], ENCODER_DECODER),
    **dict.fromkeys(
        ["bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert"],
        ENCODER,
    ),
    **dict.fromkeys(
        ["rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl"],
        ENCODER,
    ),
    "xmod": ENCODER,
    "reformer": "make sure that `is_decoder=True`",  # an encoder unless its config says otherwise
    "blt": "states no hidden_size, num_hidden_layers",  # byte-level encoder, decoder and latent transformer
    "gemma3n": "needs a package not installed",  # its vision tower is timm's
    "hrm_text": "cannot tell the decoder's",  # two recurrent stacks of layers, neither of the config's depth
    "longcat_flash": "cannot tell the decoder's",  # 28 layers of two sub-layers each: 56 "hidden layers"
    "xlm": "cannot tell the decoder's",  # its layers are parallel lists of attentions, norms and FFNs
    **dict.fromkeys(["dbrx", "jetmoe", "qwen4_exp", "qwen4_exp_text"], FAKE_TRACE),  # routing by tensor values
    "git": STEP_FAILS,  # its causal LM expects image features before the text
    "xlnet": STEP_FAILS,  # its relative positions stay fp32 in a bf16 model
    # The traced copy of the model is not the model: its layers cut by the profiler, the text model built from a
    # config the auto class does not map (memfit_trainer.activation_profile):
    "emu3": STEP_FAILS,  # Emu3TextConfig: the auto class maps only the composite Emu3Config
    "mllama": STEP_FAILS,  # MllamaTextConfig, likewise
    "openai-gpt": STEP_FAILS,  # its blocks return a list, where the layer hooks expect a tensor or tuple
    "zamba": STEP_FAILS,  # one hybrid layer kept: transformers wants the shared block tied to a second
    "zamba2": STEP_FAILS,  # its shared block's adapters keyed by the whole model's hybrid layer ids (KeyError)
    "xlstm": "cannot tell the decoder's 1 layers",  # its depth is num_blocks, the copy cuts num_hidden_layers
    "gemma4_assistant": STEP_FAILS,  # its layers reuse the keys of layers the cut leaves out
    "gemma4_unified_assistant": STEP_FAILS,
}
"""Model types refused, and what the one line says."""
NO_LORA: dict[str, str] = {
    "ctrl": "a leaf Variable that requires grad is being used in an in-place operation",  # scales its embedding
}
"""Model types planned for full fine-tuning only, and why their LoRA step fails (its input made to need a
gradient, as gradient checkpointing makes it)."""


def point(value: int) -> ActivationTerm:
    return ActivationTerm(per_token=0, per_token_squared=0, constant=0, measured=((TOKENS, value),), exact=False)


def one_step_terms(trace: Any, attention: str) -> ActivationTerms:
    """The terms of one traced step, each its measured point (a type traced at several layers: the most of them,
    as ``activation_profile`` plans it)."""
    from memfit_trainer.activation_profile import layers_by_type

    kinds = [layer.layer_type for layer in trace.layers]
    return ActivationTerms(
        outside=OutsideTerms(
            outside_layers=point(trace.outside_layers),
            loss_backward=point(trace.loss_backward),
            outside_backward=point(trace.outside_backward),
        ),
        chunked_loss=None,
        layers=tuple(
            LayerActivations(
                layer_type=kind,
                attention=attention,
                saved=point(max(trace.layers[i].saved for i in indices)),
                backward_peak=point(max(trace.layers[i].backward_peak for i in indices)),
            )
            for kind, indices in layers_by_type(kinds).items()
        ),
    )


def one_step_activations(config: dict[str, Any]) -> ActivationProfile:
    """What the profiler's ``activation_profile`` traces, cut to one step: of LoRA (its terms standing in for
    full fine-tuning's, and for the checkpointed setups, which the jobs here pin off), or of full fine-tuning
    where the LoRA step fails (recorded as the profiler records it)."""
    from memfit_trainer.activation_profile import (
        DEFAULT_LORA,
        DTYPE,
        FULL,
        MESSAGE_LENGTH,
        Setup,
        TracedModel,
        lora_of,
        trace,
    )

    model = TracedModel.of(config, (TOKENS,))
    lora = DEFAULT_LORA
    try:
        lora = lora_of(model.text, model.kinds, model.attention)
        adapted = one_step_terms(
            trace(model.text, model.kinds, TOKENS, model.attention, Setup(lora=lora)), model.attention
        )
        full, failure = adapted, None
    except Exception as error:  # as the profiler records a LoRA step failing in the model's own code
        adapted, failure = None, " ".join(f"{type(error).__name__}: {error}".split())[:MESSAGE_LENGTH]
        full = one_step_terms(trace(model.text, model.kinds, TOKENS, model.attention, FULL), model.attention)
    return ActivationProfile(
        dtype=DTYPE,
        micro_batch=1,
        attention=model.attention,
        full=full,
        full_checkpointed=full,
        lora=adapted,
        lora_checkpointed=adapted,
        lora_rank=lora.rank,
        lora_dropout=lora.dropout,
        lora_failure=failure,
    )


def job(method: str) -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate(
        {
            "model": {"name": "model", "source": {"pvc": "models"}},
            "dataset": {"source": {"pvc": "data"}},
            "method": method,
            "training": {"globalBatchSize": 8, "sequenceLength": TOKENS},
            "strategy": {"gradientCheckpointing": False, "microBatchSize": 1},
            "output": {"pvc": "out"},
        }
    )


def outcome(model_type: str) -> str:
    """``planned``, ``planned without LoRA: why``, ``refused: the line``, or ``failed: what was raised``."""
    try:
        return _outcome(model_type)
    except Exception as error:  # reported by the test, with the rest (it may not cross processes as raised)
        return f"failed: {type(error).__name__}: {' '.join(str(error).split())}"


def _outcome(model_type: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit_trainer import profile as profiler
    from memfit_trainer.activation_profile import ProfileError

    config = tiny_config(model_type)
    try:
        with mock.patch.object(profiler, "activation_profile", one_step_activations):
            result = profiler.profile(config, activations=True)
    except ProfileError as error:
        return f"refused: {error}"
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**profiler.transformers_fields(config)))
    if result.total_parameters != sum(parameter.numel() for parameter in built.parameters()):
        return f"counted {result.total_parameters} parameters, transformers builds {built.num_parameters()}"
    assert result.activations is not None
    failure = result.activations.lora_failure
    try:
        chosen = plan_job(job("full" if failure else "lora"), [A100_NODE], model=ProfiledModel(result)).chosen
    except PlanningError as error:
        return f"not planned: {error}"
    if chosen is None:
        return "not planned: no plan fits"
    return f"planned without LoRA: {failure}" if failure else "planned"


@pytest.mark.slow
def test_every_causal_lm_is_planned_or_refused_in_one_line() -> None:
    from memfit_trainer.trace_workers import trace_workers

    types = causal_lm_types()
    with trace_workers(2) as pool:
        outcomes = dict(zip(types, pool.map(outcome, types), strict=True))
    assert all("\n" not in line for line in outcomes.values())
    refused = {model_type: line for model_type, line in outcomes.items() if line.startswith("refused: ")}
    assert refused.keys() == REFUSED.keys(), {t: outcomes[t] for t in refused.keys() ^ REFUSED.keys()}
    assert {t: line for t, line in refused.items() if REFUSED[t] not in line} == {}
    no_lora = {t: line for t, line in outcomes.items() if line.startswith("planned without LoRA: ")}
    assert no_lora.keys() == NO_LORA.keys(), {t: outcomes[t] for t in no_lora.keys() ^ NO_LORA.keys()}
    assert {t: line for t, line in no_lora.items() if NO_LORA[t] not in line} == {}
    others = {t: line for t, line in outcomes.items() if t not in REFUSED and t not in NO_LORA}
    assert {t: line for t, line in others.items() if line != "planned"} == {}
