"""``memfit data preview``: rendering (unit) and end to end on chat data with three real chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.cli.data_preview import TARGET_CLOSE, TARGET_OPEN, sequence_text
from memfit.cli.main import main
from tests.trainer.chat_families import FAMILIES, write_tokenizer

CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]


def token(text: str, trained: bool, document: int) -> dict:
    return {"id": 0, "text": text, "trained": trained, "document": document}


def test_sequence_text_marks_targets_and_document_starts() -> None:
    tokens = [token("Q", False, 3), token("A", True, 3), token("B", True, 4), token("<pad>", False, -1)]
    assert (
        sequence_text(tokens).plain
        == f"\n⟪doc 3⟫\nQ{TARGET_OPEN}A{TARGET_CLOSE}\n⟪doc 4⟫\n{TARGET_OPEN}B{TARGET_CLOSE}"
    )


def job_file(tmp_path: Path, dataset: str, model: str, sequence_length: int = 64) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(f"""apiVersion: memfit.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: preview}}
spec:
  model:
{model}
  dataset:
{dataset}
  training: {{globalBatchSize: 1, sequenceLength: {sequence_length}}}
  output: {{pvc: output, path: out/}}
""")
    (tmp_path / "data").mkdir(exist_ok=True)
    return path


TINY_MODEL = """    name: tiny
    randomInit: true
    architecture: {family: llama, hiddenSize: 32, intermediateSize: 64, numLayers: 1, numAttentionHeads: 2,
                   numKeyValueHeads: 1, vocabSize: 512}"""


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = job_file(tmp_path, "    source: {pvc: data, path: missing.jsonl}\n    textField: text", TINY_MODEL)
    assert main(["data", "preview", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing.jsonl" in err and "does not exist" in err
    assert main(["data", "preview", str(path), "-n", "0"]) == 2


@pytest.mark.slow  # a chat template per family: about 6 s each
@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_chat_preview_marks_only_assistant_tokens(
    family_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    family = FAMILIES[family_name]
    write_tokenizer(family, tmp_path / "data" / "tokenizer")
    path = job_file(
        tmp_path,
        "    source: {pvc: data, path: chat.jsonl}\n    messagesField: messages",
        TINY_MODEL + "\n    tokenizer: ./tokenizer-placeholder",
        sequence_length=256,
    )
    # The tokenizer is a local directory (a hub id would need the network).
    path.write_text(path.read_text().replace("./tokenizer-placeholder", str(tmp_path / "data" / "tokenizer")))
    rows = "".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(16))
    (tmp_path / "data" / "chat.jsonl").write_text(rows)

    assert main(["data", "preview", str(path), "-n", "1", "-o", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (sequence,) = result["sequences"]
    first_document = [t for t in sequence if t["document"] == sequence[0]["document"]]
    trained = "".join(t["text"] for t in first_document if t["trained"])
    assert trained == "Paris." + family.end_of_turn
    assert result["statistics"]["records"] == 16

    assert main(["data", "preview", str(path), "-n", "1"]) == 0
    text = capsys.readouterr().out
    assert f"{TARGET_OPEN}Paris.{family.end_of_turn}{TARGET_CLOSE}" in text
    assert text.count(TARGET_OPEN) == text.count("Paris.")  # nothing but the answers is marked
