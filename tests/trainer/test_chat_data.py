"""What a chat fine-tune trains on: assistant-only targets for three real chat templates, prompt/completion
targets, unpacked rows, and packing whose loss and gradients equal those of the documents run one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from memfit.api.vocabulary import TrainOn  # noqa: E402
from memfit.model_shape import ModelFamily, ModelShape  # noqa: E402
from memfit_trainer.blocks import DOCUMENT, IDS, IGNORE_INDEX, LABELS, PADDING_DOCUMENT  # noqa: E402
from memfit_trainer.chat import ConversationTokenizer  # noqa: E402
from memfit_trainer.data import BatchShape, DataError, DataSource, PackedBatches, build_batches, load_records  # noqa: E402
from memfit_trainer.hf_config import transformers_config  # noqa: E402
from memfit_trainer.tokenizer import (  # noqa: E402
    TokenizerLoadError,
    byte_level_tokenizer,
    check_vocabulary,
    load_tokenizer,  # noqa: E402
)
from tests.trainer.chat_families import FAMILIES, write_tokenizer  # noqa: E402

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And one two three?"},
    {"role": "assistant", "content": "Four five."},
]
ANSWERS = ["The capital of France is Paris.", "Four five."]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_tokenizer(request, tmp_path_factory):
    family = FAMILIES[request.param]
    directory = write_tokenizer(family, tmp_path_factory.mktemp(family.name))
    return family, load_tokenizer(str(directory))


def trained_spans(tokenizer, ids: list[int], trained: list[bool]) -> list[str]:
    """The decoded runs of consecutive targets."""
    spans, run = [], []
    for token, is_target in zip([*ids, -1], [*trained, False], strict=True):
        if is_target:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def test_assistant_turns_and_their_end_of_turn_are_the_only_targets(family_tokenizer) -> None:
    family, tokenizer = family_tokenizer
    tokens = ConversationTokenizer(tokenizer, TrainOn.ASSISTANT)(CONVERSATION, "record 0")
    assert tokens.ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert trained_spans(tokenizer, tokens.ids, tokens.trained) == [a + family.end_of_turn for a in ANSWERS]
    context = tokenizer.decode([t for t, trained in zip(tokens.ids, tokens.trained, strict=True) if not trained])
    assert context.count(family.assistant_header) == 2  # the headers stay context
    assert "What is the capital of France?" in context and "You are a helpful assistant." in context


def test_train_on_all_targets_every_token(family_tokenizer) -> None:
    _, tokenizer = family_tokenizer
    tokens = ConversationTokenizer(tokenizer, TrainOn.ALL)(CONVERSATION, "record 0")
    assert all(tokens.trained) and len(tokens.ids) > 20


def test_template_that_rewrites_earlier_turns_is_refused_naming_the_record() -> None:
    tokenizer = byte_level_tokenizer()
    # Renders only the last user message: earlier turns vanish once another follows.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last or m['role'] != 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="record 7: the chat template renders messages 0..0 differently"):
        ConversationTokenizer(tokenizer, TrainOn.ASSISTANT)(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "record 7"
        )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def batches_of(path: Path, tokenizer, tmp_path: Path, sequence_length: int, **fields) -> PackedBatches:
    source = DataSource(str(path), **fields)
    return PackedBatches(
        load_records(source, str(tmp_path / "cache")),
        tokenizer,
        source,
        BatchShape(sequence_length, 2),
        shuffle=False,
    )


def test_packed_chat_blocks_target_only_assistant_tokens(family_tokenizer, tmp_path: Path) -> None:
    _, tokenizer = family_tokenizer
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 6)
    blocks = list(batches_of(path, tokenizer, tmp_path, 64, messages_field="messages").blocks())
    document = ConversationTokenizer(tokenizer, TrainOn.ASSISTANT)(CONVERSATION, "record 0")
    ids, labels = np.concatenate([b[IDS] for b in blocks]), np.concatenate([b[LABELS] for b in blocks])
    expected_ids = np.tile(document.ids, 6)[: len(ids)]
    expected_labels = np.where(np.tile(document.trained, 6), np.tile(document.ids, 6), IGNORE_INDEX)[: len(ids)]
    expected_labels[:: len(document.ids)] = IGNORE_INDEX  # documents' first tokens
    expected_labels[::64] = IGNORE_INDEX  # rows' first tokens (a document's continuation)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_array_equal(labels, expected_labels)


def test_prompt_completion_targets_the_completion_and_eos(tmp_path: Path) -> None:
    tokenizer = byte_level_tokenizer()
    path = write_jsonl(tmp_path / "pc.jsonl", [{"p": "question? ", "c": "answer."}] * 8)
    fields = {"prompt_field": "p", "completion_field": "c"}
    block = next(batches_of(path, tokenizer, tmp_path, 20, packing=False, **fields).blocks())
    targets = [int(t) for t in block[LABELS] if t != IGNORE_INDEX]
    assert tokenizer.decode(targets) == "answer.<|endoftext|>"
    everything = next(batches_of(path, tokenizer, tmp_path, 20, packing=False, train_on=TrainOn.ALL, **fields).blocks())
    assert (
        tokenizer.decode([int(t) for t in everything[LABELS] if t != IGNORE_INDEX]) == "uestion? answer.<|endoftext|>"
    )


def test_unpacked_rows_are_truncated_padded_and_counted(tmp_path: Path) -> None:
    tokenizer = byte_level_tokenizer()
    texts = ["a" * 5, "b" * 30]  # 6 and 31 tokens with EOS, in rows of 16
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    batches = batches_of(path, tokenizer, tmp_path, 16, text_field="text", packing=False)
    _, batch = next(batches.iterate())
    assert batch["attention_mask"].tolist() == [[1] * 6 + [0] * 10, [1] * 16]
    assert (batch["labels"][0, 6:] == IGNORE_INDEX).all() and (
        batch["input_ids"][0, 6:] == tokenizer.pad_token_id
    ).all()
    stats = batches.statistics
    assert stats is not None
    assert stats.truncated_share == pytest.approx((31 - 16) / 37)
    assert stats.padded_share == pytest.approx(10 / 32)
    assert "position_ids" not in batch


def test_vocabulary_must_fit_the_model(family_tokenizer) -> None:
    _, tokenizer = family_tokenizer
    check_vocabulary(tokenizer, len(tokenizer))
    with pytest.raises(TokenizerLoadError, match=f"has {len(tokenizer)} token ids but the model's vocabSize is 300"):
        check_vocabulary(tokenizer, 300)


# --- packing keeps documents apart -------------------------------------------------------------------


def tiny_llama(attention: str, vocab: int):
    from transformers import AutoModelForCausalLM

    shape = ModelShape(ModelFamily.LLAMA, 32, 64, 2, 4, 2, vocab)
    config = transformers_config(shape, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float64)


def summed_loss_and_grads(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Cross-entropy summed over the batch's targets, and its gradients."""
    model.zero_grad()
    targets = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    loss = model(**batch).loss * targets
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_loss_and_gradients_equal_the_documents_one_by_one(attention: str, tmp_path: Path) -> None:
    tokenizer = byte_level_tokenizer()
    texts = ["first document, short.", "the second one is a little longer than that.", "third!", "x" * 40]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    batches = batches_of(path, tokenizer, tmp_path, 32, text_field="text")
    blocks = np.stack(list(batches.blocks()))
    _, packed = next(batches.iterate())
    model = tiny_llama(attention, 258)
    packed_loss, packed_grads = summed_loss_and_grads(model, packed)

    # The same target tokens, each document piece run alone.
    alone_loss, alone_grads = torch.zeros(()), None
    for row in blocks[:2]:
        for document in np.unique(row[DOCUMENT]):
            piece = row[:, row[DOCUMENT] == document]
            batch = {"input_ids": torch.from_numpy(piece[IDS][None]).long(),
                     "labels": torch.from_numpy(piece[LABELS][None]).long()}  # fmt: skip
            if (batch["labels"][:, 1:] == IGNORE_INDEX).all():
                continue
            loss, grads = summed_loss_and_grads(model, batch)
            alone_loss += loss
            alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads, strict=True)]
    assert alone_grads is not None
    torch.testing.assert_close(packed_loss, alone_loss)
    for packed_grad, alone_grad in zip(packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(packed_grad, alone_grad)

    # Control: the same rows attending across documents (plain positions) give another loss.
    crossing = {"input_ids": packed["input_ids"], "labels": packed["labels"]}
    crossing_loss, _ = summed_loss_and_grads(model, crossing)
    assert not torch.allclose(crossing_loss, alone_loss)


def test_padding_is_never_attended(tmp_path: Path) -> None:
    tokenizer = byte_level_tokenizer()
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "short"}, {"text": "a longer document here"}])
    batches = batches_of(path, tokenizer, tmp_path, 32, text_field="text", packing=False)
    _, batch = next(batches.iterate())
    model = tiny_llama("sdpa", 258)
    loss, _ = summed_loss_and_grads(model, batch)
    # Other pad ids (no targets, masked from attention) leave the loss unchanged.
    repadded = dict(batch, input_ids=torch.where(batch["attention_mask"].bool(), batch["input_ids"], 65))
    assert torch.equal(repadded["input_ids"] != batch["input_ids"], batch["attention_mask"] == 0)
    torch.testing.assert_close(summed_loss_and_grads(model, repadded)[0], loss)
    assert (np.stack(list(batches.blocks()))[:, DOCUMENT] == PADDING_DOCUMENT).any()


def test_bad_chat_record_is_a_data_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}] * 2)
    with pytest.raises(DataError, match="record 0: the conversation opens with an assistant message"):
        build_batches(DataSource(str(path), messages_field="messages"), byte_level_tokenizer(), BatchShape(8, 1),
                      cache_dir=str(tmp_path / "c"))  # fmt: skip
