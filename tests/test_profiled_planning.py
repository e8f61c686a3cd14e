"""Planning a model from its own profile: no typed sizes, the parameter count transformers builds.

The stored profiles (memfit/catalog/profiles, made by ``make profiles`` from the stored config.json files) are
what a job planned from a model directory holding one of those configs reads: these tests run without torch.
Where a family has formulas too (Llama 3.1 8B), the profile and the formulas must agree tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from memfit.api.finetunejob import FineTuneJobSpec
from memfit.api.gpupool import pool_capacity
from memfit.api.plan import PlanResult
from memfit.api.vocabulary import Attention, Method, Precision
from memfit.catalog.model_configs import stored_config_path, stored_profile, stored_profile_names
from memfit.catalog.models import model_preset
from memfit.cli.main import main
from memfit.memory.activations import ActivationSetup
from memfit.memory.profiled_activations import model_activations
from memfit.planner.attention import planned_attention
from memfit.planner.longest import longest_sequence
from memfit.planner.search import PlanningError, plan_job
from memfit.profiled_model import ProfiledModel
from tests.planning_fixtures import A100_NODE, ONE_A100, WITH_FLASH_ATTN, job, pool
from tests.stored_models import STORED_TOTALS

ROOT = Path(__file__).resolve().parent.parent
INVENTORY = ROOT / "examples" / "inventory.yaml"
H100 = pool("h100", "NVIDIA-H100-80GB-HBM3", 1, 1, 2000)
DONE_MEANS = [
    "qwen3-8b",
    "qwen3-30b-a3b",
    "qwen3.5-27b",
    "gemma-4-31b",
    "gpt-oss-20b",
    "llama-4-scout",
    "ministral-3-8b",
]


def profiled(name: str) -> ProfiledModel:
    profile = stored_profile(name)
    assert profile is not None, f"no stored profile of {name}: run make profiles"
    return ProfiledModel(profile)


def test_every_stored_config_has_a_stored_profile() -> None:
    assert set(stored_profile_names()) == set(STORED_TOTALS)


@pytest.mark.parametrize("name", sorted(STORED_TOTALS))
def test_a_stored_profile_counts_what_transformers_builds(name: str) -> None:
    model = profiled(name)
    assert model.parameter_count == STORED_TOTALS[name]
    assert sum(count * _numel(shape) for shape, count in model.full_tensors()) == model.parameter_count
    assert sum(count * elements for elements, count in model.quantized_tensors()) == model.quantizable_parameters
    lora = sum(count * _numel(shape) for shape, count in model.lora_tensors(16, ("all-linear",)))
    assert lora == model.lora_parameters(16, ("all-linear",)) > 0


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def test_the_profile_of_llama_agrees_with_the_llama_formulas_tensor_by_tensor() -> None:
    model, shape = profiled("llama-3.1-8b"), model_preset("llama-3.1-8b")
    sizes = ("parameter_count", "quantizable_parameters", "embedding_parameters", "lm_head_parameters")
    sizes += ("norm_parameters", "layer_parameters", "largest_layer_parameters", "active_parameters_per_token")
    for size in sizes:
        assert getattr(model, size) == getattr(shape, size), size
    assert Counter(dict(model.full_tensors())) == Counter(dict(shape.full_tensors()))
    for targets in (("all-linear",),):
        assert Counter(dict(model.lora_tensors(16, targets))) == Counter(dict(shape.lora_tensors(16, targets)))
    assert Counter(dict(model.quantized_tensors())) == Counter(dict(shape.quantized_tensors()))
    assert model.forward_flops_per_token(4096) == shape.forward_flops_per_token(4096)


def test_moe_active_parameters_leave_out_the_idle_experts() -> None:
    model = profiled("qwen3-30b-a3b")
    assert 3.0e9 < model.active_parameters_per_token < 3.5e9  # "A3B": 3.3B active of 30.5B


def test_sliding_and_linear_attention_layers_attend_over_less_than_the_sequence() -> None:
    """Attention FLOPs grow with the sequence only in full-attention layers: gpt-oss's sliding half is
    bounded by its 128-token window, Qwen3.5's Gated DeltaNet layers have no quadratic term."""
    for name, full_layers in (("gpt-oss-20b", 12), ("qwen3.5-27b", 16)):
        model = profiled(name)
        width = model.profile.num_attention_heads * model.profile.head_dim
        growth = model.forward_flops_per_token(8192) - model.forward_flops_per_token(4096)
        assert growth == 2 * full_layers * 4096 * width, name


def _setup(method: Method, checkpointing: bool, micro_batch: int = 1, tokens: int = 4096) -> ActivationSetup:
    return ActivationSetup(method, Precision.BF16, checkpointing, micro_batch, tokens, Attention.SDPA)


def test_profiled_activations_compose_the_traced_terms() -> None:
    model = profiled("qwen3-8b")
    terms = model.activations.full
    layer = terms.layer("full_attention")
    estimate = model_activations(model, _setup(Method.FULL, False))
    outside = terms.outside.outside_layers.bytes(4096) + terms.outside.loss_backward.bytes(4096)
    assert estimate.loss_moment == outside + 36 * layer.saved.bytes(4096)
    during = terms.outside.outside_backward.bytes(4096)
    assert estimate.layer_moment == 36 * layer.saved.bytes(4096) + during + layer.backward_peak.bytes(4096)
    checkpointed = model_activations(model, _setup(Method.FULL, True))
    traced = model.activations.full_checkpointed
    kept = 36 * traced.layer("full_attention").saved.bytes(4096)
    outside = traced.outside.outside_layers.bytes(4096) + traced.outside.loss_backward.bytes(4096)
    assert checkpointed.loss_moment == kept + outside
    assert kept == 36 * 4096 * model.hidden_size * 2  # each layer keeps its output, the next one's input
    assert checkpointed.layer_moment < estimate.layer_moment / 10 and checkpointed.peak < estimate.peak / 4


def test_rows_scale_every_term_but_its_constant() -> None:
    model = profiled("qwen3-8b")
    one, four = (
        model_activations(model, _setup(Method.FULL, False)),
        model_activations(model, _setup(Method.FULL, False, 4)),
    )
    full = model.activations.full
    constant = full.outside.outside_layers.constant + full.outside.loss_backward.constant
    assert four.loss_moment == pytest.approx(4 * one.loss_moment - 3 * constant, abs=64)


def test_lora_plans_use_the_lora_terms() -> None:
    model = profiled("qwen3-8b")
    full, lora = (
        model_activations(model, _setup(Method.FULL, False)),
        model_activations(model, _setup(Method.LORA, False)),
    )
    assert lora.peak != full.peak
    assert lora.saved_per_layer == model.activations.lora.layer("full_attention").saved.bytes(4096)


def _claim_job(tmp_path: Path, name: str, **spec: Any) -> Path:
    """A job training the stored config ``name`` from a model directory on the claim ``models``: no sizes."""
    directory = tmp_path / "models" / name
    directory.mkdir(parents=True)
    path = stored_config_path(name)
    assert path is not None
    shutil.copy(path, directory / "config.json")
    document = {
        "apiVersion": "memfit.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": "profiled"},
        "spec": {
            "model": {"name": name, "source": {"pvc": "models", "path": name}},
            "dataset": {"source": {"pvc": "data", "path": "train.jsonl"}},
            "output": {"pvc": "out"},
            "method": "auto",
            "training": {"globalBatchSize": 16, "sequenceLength": 4096},
            **spec,
        },
    }
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(document))
    return job_file


@pytest.fixture(autouse=True)
def empty_profile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Nothing of the user's cache: a test that would profile shows it (no stored profile matched)."""
    cache = tmp_path / "profile-cache"
    monkeypatch.setenv("MEMFIT_PROFILE_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("name", DONE_MEANS)
@pytest.mark.slow
def test_memfit_plan_plans_a_model_directory_from_its_config_json(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], empty_profile_cache: Path
) -> None:
    job_file = _claim_job(tmp_path, name)
    code = main(["plan", str(job_file), "-i", str(INVENTORY), "--mount", f"models={tmp_path / 'models'}", "-o", "json"])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    result = json.loads(out)
    assert result["modelParameters"] == STORED_TOTALS[name]
    assert result["modelBasis"].startswith("profile of ") and err == ""  # the stored profile: nothing profiled
    assert not empty_profile_cache.exists()
    plans = [result["chosen"], *result["candidates"]] if result["chosen"] else []
    for plan in plans:
        assert plan["strategy"]["gradientCheckpointing"] or not plan["strategy"]["activationOffloading"]
        assert plan["parameterCount"] == STORED_TOTALS[name]


def test_gpt_oss_is_planned_with_eager_attention(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_file = _claim_job(tmp_path, "gpt-oss-20b")
    assert (
        main(["plan", str(job_file), "-i", str(INVENTORY), "--mount", f"models={tmp_path / 'models'}", "-o", "json"])
        == 0
    )
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["strategy"]["attention"] == "eager"


def test_the_table_names_what_the_plan_was_computed_from(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_file = _claim_job(tmp_path, "qwen3-8b")
    assert main(["plan", str(job_file), "-i", str(INVENTORY), "--mount", f"models={tmp_path / 'models'}"]) == 0
    out = capsys.readouterr().out
    assert "8.19B parameters" in out and "profile of Qwen3ForCausalLM" in out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"training": {"globalBatchSize": 16, "sequenceLength": 4096, "precision": "fp32"}}, "fp32"),
        ({"strategy": {"attention": "flex"}}, "traced its activations with sdpa attention"),
        ({"strategy": {"attention": "eager"}}, "traced its activations with sdpa attention"),
    ],
)
def test_what_the_profile_cannot_estimate_is_refused_in_one_line(
    spec: dict[str, Any], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_file = _claim_job(tmp_path, "qwen3-8b", **spec)
    assert main(["plan", str(job_file), "-i", str(INVENTORY), "--mount", f"models={tmp_path / 'models'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memfit plan: error: ") and err.count("\n") == 1 and message in err


def test_a_profiled_model_is_planned_with_its_layer_inputs_offloaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Activation offloading composes from the checkpointed terms: pinned, the layers' inputs of Qwen3-8B at
    8 x 8192 tokens leave the GPU (less GPU memory than without it) for pinned host memory."""
    plans = {}
    for offloading in (False, True):
        job_file = _claim_job(
            tmp_path / str(offloading),
            "qwen3-8b",
            method="lora",
            training={"globalBatchSize": 8, "sequenceLength": 8192},
            strategy={
                "microBatchSize": 8,
                "gradientCheckpointing": True,
                "activationOffloading": offloading,
                "chunkedLoss": True,
                "sequenceParallel": 1,
            },
        )
        mount = f"models={tmp_path / str(offloading) / 'models'}"
        assert main(["plan", str(job_file), "-i", str(INVENTORY), "--mount", mount, "-o", "json"]) == 0
        plans[offloading] = json.loads(capsys.readouterr().out)["chosen"]
    assert plans[True]["strategy"]["activationOffloading"]
    layers, inputs = 36, 8 * 8192 * 4096 * 2  # Qwen3-8B: 36 layers of hidden 4096, bf16
    saved = plans[False]["memory"]["perGPU"]["activations"] - plans[True]["memory"]["perGPU"]["activations"]
    assert (layers - 4) * inputs <= saved <= layers * inputs


def test_a_hub_model_without_sizes_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_file = _claim_job(tmp_path, "qwen3-8b")
    document = yaml.safe_load(job_file.read_text())
    document["spec"]["model"]["source"] = {"hub": "Qwen/Qwen3-8B"}
    job_file.write_text(yaml.safe_dump(document))
    assert main(["plan", str(job_file), "-i", str(INVENTORY)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not on a claim" in err


def test_a_claim_without_config_json_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_file = _claim_job(tmp_path, "qwen3-8b")
    (tmp_path / "models" / "qwen3-8b" / "config.json").unlink()
    assert main(["plan", str(job_file), "-i", str(INVENTORY), "--mount", f"models={tmp_path / 'models'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no config.json" in err


def test_a_stored_profile_is_a_preset() -> None:
    spec = job("qwen3-8b", method="lora")
    result = plan_job(spec, [A100_NODE])
    assert result.model_parameters == STORED_TOTALS["qwen3-8b"] and result.chosen is not None
    assert result.model_basis.startswith("profile of Qwen3ForCausalLM")


def test_random_init_needs_typed_sizes() -> None:
    """A preset that is only a stored profile has no typed sizes to build."""
    with pytest.raises(ValueError, match="randomInit builds the model from typed sizes"):
        FineTuneJobSpec.model_validate(
            {
                "model": {"name": "q", "randomInit": True, "architecture": {"preset": "qwen3-8b"}},
                "dataset": {"source": {"pvc": "d"}},
                "output": {"pvc": "o"},
            }  # fmt: skip
        )


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b", "mixtral-8x7b", "phi-3-mini"])
def test_a_formula_familys_preset_is_planned_from_its_profile_unless_pinned_beyond_it(name: str) -> None:
    """A preset of the six older families is planned from the profile of its stored config.json (generated from
    its typed sizes: the same parameters); pinned fp32, or an attention kernel the profile did not trace, it is
    counted by its family's formulas from the same typed sizes, and the plan says so."""
    profiled_plan = plan_job(job(name, method="lora"), [A100_NODE])
    assert profiled_plan.model_basis.startswith("profile of ") and profiled_plan.chosen is not None
    assert profiled_plan.model_parameters == model_preset(name).parameter_count == STORED_TOTALS[name]
    traced = profiled(name).default_attention
    other = Attention.EAGER if traced == Attention.SDPA else Attention.SDPA
    for pins in ({"training": {"globalBatchSize": 32, "sequenceLength": 2048, "precision": "fp32"}},
                 {"strategy": {"attention": other.value}}):  # fmt: skip
        typed = plan_job(job(name, method="lora", **pins), [A100_NODE])
        assert typed.model_basis.startswith("typed sizes") and typed.model_parameters == STORED_TOTALS[name]


def test_a_formula_familys_preset_trains_from_random_weights_as_profiled() -> None:
    """randomInit builds the preset's typed sizes; the trainer config carries them and the profile's fields,
    which the generated config.json states alike (the trainer checks the fields against what it builds)."""
    from memfit.contract.model_match import fields_mismatch
    from memfit_trainer.hf_config import transformers_config

    spec = job(
        "qwen2.5-0.5b",
        method="full",
        model={"name": "q", "randomInit": True, "architecture": {"preset": "qwen2.5-0.5b"}},
    )
    planned = spec.planned_model()
    assert isinstance(planned, ProfiledModel)
    built = transformers_config(model_preset("qwen2.5-0.5b")).to_dict()
    assert fields_mismatch(planned.planned_fields(), built, "q") is None


def test_without_a_profile_or_sizes_the_planner_says_how_to_get_one() -> None:
    spec = job("qwen3-8b")
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"architecture": None})})
    with pytest.raises(PlanningError, match="memfit plan --mount"):
        plan_job(spec, [ONE_A100])


def test_below_where_its_form_holds_a_term_is_the_larger_traced_neighbour() -> None:
    from memfit.profile import ActivationTerm

    term = ActivationTerm(per_token=1, per_token_squared=0, constant=0, valid_from=1000,
                          measured=((100, 500), (200, 300), (1000, 1000)), exact=True)  # fmt: skip
    assert (term.bytes(100), term.bytes(150), term.bytes(400), term.bytes(2000)) == (500, 500, 1000, 2000)


def test_gpt_oss_backward_holds_its_attention_scores_beyond_2048_tokens() -> None:
    """gpt-oss's eager attention (with sinks) materializes every layer's scores, sliding ones included: the
    profiler found the form change at 2048 tokens, traced longer counts, and solved the quadratic form there."""
    model = profiled("gpt-oss-20b")
    for layer in model.activations.full.layers:
        assert layer.backward_peak.exact and layer.backward_peak.valid_from == 2048
        assert layer.backward_peak.per_token_squared == 64 * 4  # 64 heads, fp32 scores


@pytest.mark.parametrize("name", sorted(STORED_TOTALS))
def test_every_stored_profile_traces_the_chunked_loss(name: str) -> None:
    """Every stored model's step ran with the trainer's chunked loss (its terms are in the profile), and
    activation offloading composes from the checkpointed terms: no technique is left untraced but the tiled MLP
    of a version-4 profile (traced from version 5 on)."""
    model = profiled(name)
    assert model.untraced_techniques == (frozenset({"tiled_mlp"}) if model.profile.version == 4 else frozenset())


def test_the_chunked_loss_spares_a_large_vocabulary_its_logits() -> None:
    """Gemma 3's 262,144-entry vocabulary: with the model's own loss, its fp32 logits (and more) stand on every
    layer's saved activations at the loss; the chunked loss holds one chunk of them."""
    model = profiled("gemma-3-12b")
    plain, chunked = (
        model_activations(model, dataclasses.replace(_setup(Method.FULL, True), chunked_loss=on))
        for on in (False, True)
    )
    fp32_logits = 4096 * model.profile.vocab_size * 4
    assert plain.loss_moment - chunked.loss_moment >= fp32_logits
    assert chunked.peak < plain.peak


def test_the_planner_chooses_the_chunked_loss_for_a_profiled_model_where_it_buys_a_fit() -> None:
    """Gemma 3 12B LoRA, micro-batches of 8 rows of 4096 tokens on one 80 GB A100: without the chunked loss the
    logits do not fit; the search turns it on by itself, and its plan is the one pinned with it."""

    def plan(**strategy: Any) -> PlanResult:
        pins = {"microBatchSize": 8, "gradientCheckpointing": True, **strategy}
        return plan_job(job("gemma-3-12b", "lora", batch=8, sequence=4096, strategy=pins), [ONE_A100])

    without, pinned, searched = plan(chunkedLoss=False), plan(chunkedLoss=True), plan()
    assert without.chosen is None and pinned.chosen is not None and searched.chosen is not None
    assert searched.chosen.strategy.chunked_loss
    assert searched.chosen.memory.per_gpu.total == pinned.chosen.memory.per_gpu.total


def test_a_term_no_form_reproduces_is_read_off_its_traced_counts() -> None:
    """The chunked loss's backward is the largest of several moments, each linear once a chunk of logits is
    full: no one form reproduces Llama 3.1 8B's. It is read off its traced counts (exact there), joined by
    straight lines and continued at the last one's slope, never below the first; the three-point quadratic it
    was once read from went negative past about 16K tokens."""
    term = profiled("llama-3.1-8b").activations.full.chunked_loss
    assert term is not None and not term.loss_backward.exact
    backward = term.loss_backward
    counts = sorted(backward.measured)
    assert all(backward.bytes(tokens) == traced for tokens, traced in counts)
    longer = [backward.bytes(tokens) for tokens in (128, 1000, 3000, 8192, 16384, 65536, 131072)]
    assert longer == sorted(longer) and longer[0] == counts[0][1]
    (before, before_bytes), (last, last_bytes) = counts[-2:]
    assert backward.bytes(2 * last - before) == 2 * last_bytes - before_bytes
    setup = ActivationSetup(Method.FULL, Precision.BF16, True, 8, 32768, Attention.SDPA, chunked_loss=True)
    activations = model_activations(profiled("llama-3.1-8b"), setup)
    assert activations.loss_moment > activations.kept_between_layers * 32  # every layer's input, and more


def _without_unmasked_terms(model: ProfiledModel) -> ProfiledModel:
    """The model as a version-4 profile plans it: packed rows' terms only."""
    activations = model.activations.model_copy(update={"unmasked": None, "tiled_mlp": None})
    return ProfiledModel(model.profile.model_copy(update={"version": 4, "activations": activations}))


def test_a_version_4_profile_still_loads_and_plans_only_its_traced_kernel() -> None:
    old = _without_unmasked_terms(profiled("llama-3.1-8b"))
    reread = ProfiledModel(type(old.profile).model_validate_json(old.profile.model_dump_json()))
    assert reread.profile.version == 4 and reread.untraced_techniques == {"tiled_mlp"}
    assert reread.basis.endswith("version 4: traced on packed rows only, no flash attention or tiled MLP")
    assert "holds no terms traced without a mask" in (
        reread.unplannable(Precision.BF16, Attention.FLASH, frozenset()) or ""
    )
    assert planned_attention(reread, pool_capacity(H100), 65536, WITH_FLASH_ATTN) == Attention.SDPA


def test_flash_is_refused_where_the_unmasked_terms_are_not_flash_attentions() -> None:
    """gpt-oss is traced on eager attention (its sinks), whose unmasked row still holds the scores."""
    problem = profiled("gpt-oss-20b").unplannable(Precision.BF16, Attention.FLASH, frozenset())
    assert problem is not None and "holds no terms traced without a mask on sdpa" in problem


def test_llama_plans_flash_on_an_h100_and_reaches_past_its_packed_sdpa_terms() -> None:
    """Traced on unmasked rows, Llama-3.1-8B plans flash attention on an H100 (no s² document mask): full
    fine-tuning on one H100 then reaches longer sequences than the same profile without those terms, whose
    SDPA mask binds (110,531 tokens when measured)."""
    model = profiled("llama-3.1-8b")
    assert model.plans_flash and model.unplannable(Precision.BF16, Attention.FLASH, frozenset()) is None
    spec = job("llama-3.1-8b", "full", batch=1, resources={"pool": H100.metadata.name})
    (flash,) = longest_sequence(spec, [H100], model=model, runtime=WITH_FLASH_ATTN)
    (sdpa,) = longest_sequence(spec, [H100], model=_without_unmasked_terms(model), runtime=WITH_FLASH_ATTN)
    assert sdpa.plan is not None and sdpa.plan.strategy.attention == Attention.SDPA
    assert flash.plan is not None and flash.plan.strategy.attention == Attention.FLASH
    assert sdpa.sequence_length is not None and flash.sequence_length is not None
    assert flash.sequence_length > 2 * sdpa.sequence_length


def test_flash_plans_the_unmasked_terms_and_sdpa_on_unmasked_batches_too() -> None:
    model = profiled("llama-3.1-8b")
    unmasked = model.activations.unmasked
    assert unmasked is not None
    layer = unmasked.full.layer("full_attention")
    assert layer.saved.per_token_squared == 0 and layer.backward_peak.per_token_squared == 0
    flash = model_activations(model, dataclasses.replace(_setup(Method.FULL, False), attention=Attention.FLASH))
    unpadded = model_activations(model, dataclasses.replace(_setup(Method.FULL, False), masked_batches=False))
    packed = model_activations(model, _setup(Method.FULL, False))
    assert flash == unpadded and flash.saved_per_layer == layer.saved.bytes(4096)
    assert flash.peak < packed.peak


def test_sequence_parallelism_splits_the_per_token_terms_not_the_mask() -> None:
    """Over P ranks a layer keeps its per-token bytes for ceil(s/P) tokens, the s² mask for the whole sequence,
    and one more query-sized tensor of its tokens (Ulysses' gathered-layout output and o_proj's input)."""
    model = profiled("llama-3.1-8b")
    layer = model.activations.full.layer("full_attention").saved
    tokens, ranks = 8191, 4
    local = -(-tokens // ranks)
    setup = dataclasses.replace(_setup(Method.FULL, False, tokens=tokens), sequence_parallel=ranks)
    query = model.profile.num_attention_heads * model.profile.head_dim
    expected = round(layer.per_token * local + layer.per_token_squared * tokens**2) + local * query * 2
    assert model_activations(model, setup).saved_per_layer == expected
    checkpointed = model_activations(model, dataclasses.replace(setup, gradient_checkpointing=True))
    assert checkpointed.kept_between_layers == local * model.hidden_size * 2


def test_more_ranks_than_key_value_heads_replicate_them() -> None:
    """Llama-3.1-8B has 8 key/value heads: over 16 ranks Ulysses gives each rank a copy of one (a replication
    factor of 2), so a layer keeps its keys' and values' chunk once more beside the query-sized copy."""
    model = profiled("llama-3.1-8b")
    profile = model.profile
    tokens = 16 * 1024

    def saved(ranks: int) -> int:
        setup = dataclasses.replace(_setup(Method.FULL, False, tokens=tokens), sequence_parallel=ranks)
        return model_activations(model, setup).saved_per_layer

    local = tokens // 16
    kv = profile.num_key_value_heads * profile.head_dim
    layer = model.activations.full.layer("full_attention").saved
    split = round(layer.per_token * local + layer.per_token_squared * tokens**2)
    query = profile.num_attention_heads * profile.head_dim
    assert saved(16) == split + local * (query + 2 * kv) * 2


def test_tiled_mlps_spare_a_long_sequence_its_mlp_activations() -> None:
    """With the trainer's tiled MLP (traced at whole tiles) a layer keeps no intermediate-size tensors, and its
    backward holds one tile's: at 300K tokens on flash attention, a layer saves the MLP's 4·t·i bf16 values less,
    and full fine-tuning's layer moment with checkpointing and offloading (where the recomputation saved them)
    falls by more than 3·t·i (the backward's gradient of the layer's input, t·h, takes some back): under an
    H100's memory, where untiled it is not."""
    model = profiled("llama-3.1-8b")
    assert "tiled_mlp" not in model.untraced_techniques
    tokens, intermediate = 300_000, 14336
    setup = dataclasses.replace(
        _setup(Method.FULL, True, tokens=tokens),
        attention=Attention.FLASH,
        activation_offloading=True,
        chunked_loss=True,
    )
    untiled = model_activations(model, setup)
    tiled = model_activations(model, dataclasses.replace(setup, tiled_mlp=True))
    plain = model_activations(model, dataclasses.replace(setup, gradient_checkpointing=False))
    plain_tiled = model_activations(model, dataclasses.replace(setup, gradient_checkpointing=False, tiled_mlp=True))
    assert plain.saved_per_layer - plain_tiled.saved_per_layer >= 4 * tokens * intermediate * 2
    assert untiled.layer_moment - tiled.layer_moment >= 3 * tokens * intermediate * 2
    assert tiled.peak < 72 * 2**30 < untiled.peak  # an H100's 80 GB less its headroom


@pytest.mark.parametrize(("gpus", "longest"), [(1, 300_000), (8, 1_048_576)])
@pytest.mark.slow
def test_llama_full_fine_tuning_reaches_issue_23s_lengths_on_h100s(gpus: int, longest: int) -> None:
    """Issue 23's figures, from the stored profile: Llama-3.1-8B full fine-tuning past 300K tokens on one H100
    (flash attention, with flash-attn installed, and tiled MLPs) and past 1M on eight (the sequence split over them)."""
    pools = [pool("h100", "NVIDIA-H100-80GB-HBM3", gpus, 1, 2000)]
    spec = job("llama-3.1-8b", "full", batch=1, resources={"pool": "h100"})
    (row,) = longest_sequence(spec, pools, model=profiled("llama-3.1-8b"), runtime=WITH_FLASH_ATTN)
    assert row.sequence_length is not None and row.sequence_length >= longest and row.plan is not None
    strategy = row.plan.strategy
    assert strategy.attention == Attention.FLASH and strategy.tiled_mlp
    assert strategy.sequence_parallel == gpus
