"""Bad data is one line naming its file, line and field, before training: in the trainer's loading, in a stream
as read (or skipped and counted with ``onBadRecord: skip``), at ``memfit-train``'s start, in ``memfit run
--local`` and ``memfit data preview``; and a checkpoint's data fingerprint refuses a resume on other data."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

pytest.importorskip("datasets")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from memfit.api.vocabulary import OnBadRecord  # noqa: E402
from memfit.contract.termination import CONFIG_ERROR_PREFIX  # noqa: E402
from memfit_trainer.data import (  # noqa: E402
    BatchShape,
    DataError,
    DataPosition,
    DataSource,
    EmptyDatasetError,
    PackedBatches,
    load_records,
)
from memfit_trainer.records import MIB, RecordRules, check_json_files  # noqa: E402
from memfit_trainer.tokenizer import byte_level_tokenizer  # noqa: E402

GOOD_TEXT = '{"text": "a fine first record"}\n'
GOOD_CHAT = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


@dataclass(frozen=True)
class BadCase:
    """A data file whose line 2 is bad (or an empty file), the field the job reads, and the line it must get
    (after the file's path)."""

    content: bytes
    expected: str
    field: str = "textField"

    @property
    def name(self) -> str:
        return "text" if self.field == "textField" else "messages"


OVERSIZE = ('{"text": "' + "x" * (MIB + 10) + '"}\n').encode()
BAD_CASES = {
    "invalid JSON": BadCase(
        (GOOD_TEXT + '{"text": broken\n').encode(), ":2: record: invalid JSON: Expecting value (column 10)"
    ),
    "non-UTF-8 byte": BadCase(
        GOOD_TEXT.encode() + b'{"text": "caf\xe9"}\n', ":2: record: not UTF-8 (byte 0xe9 at byte 14)"
    ),
    "null text": BadCase((GOOD_TEXT + '{"text": null}\n').encode(), ":2: textField 'text': null, not a string"),
    "missing text": BadCase(
        (GOOD_TEXT + '{"body": "x"}\n').encode(), ":2: textField 'text': missing; the record's fields: ['body']"
    ),
    "non-string text": BadCase((GOOD_TEXT + '{"text": 7}\n').encode(), ":2: textField 'text': a number, not a string"),
    "not an object": BadCase((GOOD_TEXT + '["text"]\n').encode(), ":2: record: a list instead of a JSON object"),
    "oversize record": BadCase(
        GOOD_TEXT.encode() + OVERSIZE, ":2: record: larger than the limit of 1 MiB (dataset.maxRecordMib)"
    ),
    "bad chat message": BadCase(
        (GOOD_CHAT + '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}\n').encode(),
        ":2: messagesField 'messages': message 1: no content",
        field="messagesField",
    ),
    "chat messages not a list": BadCase(
        (GOOD_CHAT + '{"messages": "hello"}\n').encode(),
        ":2: messagesField 'messages': a string, not a non-empty list of messages",
        field="messagesField",
    ),
    "empty file": BadCase(b"", " has no records"),
}
CASES = pytest.mark.parametrize("case", BAD_CASES.values(), ids=BAD_CASES.keys())
CLI_SAMPLE = ("invalid JSON", "non-UTF-8 byte", "null text")
CLI_CASES = pytest.mark.parametrize("case", [BAD_CASES[name] for name in CLI_SAMPLE], ids=CLI_SAMPLE)
"""The commands (seconds each) on a sample: every case goes through the same check, tested in-process above."""


def write_case(case: BadCase, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "train.jsonl"
    path.write_bytes(case.content)
    return path


def expected_line(case: BadCase, path: Path) -> str:
    return f"dataset {str(path)!r}{case.expected}" if case is BAD_CASES["empty file"] else f"{path}{case.expected}"


def source_of(case: BadCase, path: Path, **options: object) -> DataSource:
    field = {"text_field": "text"} if case.field == "textField" else {"messages_field": "messages"}
    return DataSource(str(path), max_record_mib=1, **field, **options)  # type: ignore[arg-type]


@CASES
def test_a_bad_record_is_one_line_naming_its_file_line_and_field(case: BadCase, tmp_path: Path) -> None:
    path = write_case(case, tmp_path / "data")
    with pytest.raises(DataError) as refused:
        load_records(source_of(case, path), str(tmp_path / "cache"))
    assert str(refused.value) == expected_line(case, path)


@CASES
def test_a_streamed_bad_record_stops_where_it_is_read(case: BadCase, tmp_path: Path) -> None:
    path = write_case(case, tmp_path / "data")
    with pytest.raises(DataError) as refused:
        list(load_records(source_of(case, path, streaming=True)))  # the first record is read at load, line 2 later
    assert str(refused.value) == expected_line(case, path)


def mixed_file(tmp_path: Path) -> Path:
    """Lines 1, 3 and 6 are good, 2, 4 and 5 bad (a blank line is no record)."""
    lines = [b'{"text": "one"}', b'{"text": null}', b'{"text": "three"}', b"\xff", b'{"text": "five', b"",
             b'{"text": "six"}']  # fmt: skip
    path = tmp_path / "data" / "mixed.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("streaming", [False, True])
def test_skip_leaves_bad_records_out_and_counts_them(
    streaming: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = mixed_file(tmp_path)
    source = DataSource(str(path), text_field="text", streaming=streaming, on_bad_record=OnBadRecord.SKIP)
    records = load_records(source, str(tmp_path / "cache"))
    assert [record["text"] for record in records] == ["one", "three", "six"]
    said = capsys.readouterr().err.splitlines()
    assert said[:3] == [
        f"memfit-train: skipped bad record {path}:2: textField 'text': null, not a string (1 skipped so far)",
        f"memfit-train: skipped bad record {path}:4: record: not UTF-8 (byte 0xff at byte 1) (2 skipped so far)",
        f"memfit-train: skipped bad record {path}:5: record: invalid JSON: Unterminated string starting at "
        "(column 10) (3 skipped so far)",
    ]


def test_a_dataset_of_bad_records_only_is_refused_even_when_skipping(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": 1}\n{"text": 2}\n')
    with pytest.raises(EmptyDatasetError, match=r"bad.jsonl' has no records \(2 bad record\(s\) skipped\)$"):
        load_records(DataSource(str(path), text_field="text", on_bad_record=OnBadRecord.SKIP))


def test_an_oversize_record_is_never_held_whole(tmp_path: Path) -> None:
    """A 40 MiB record under a 1 MiB limit: the check holds a few times the limit at most, never the record."""
    path = tmp_path / "huge.jsonl"
    with path.open("w") as handle:
        handle.write(GOOD_TEXT)
        handle.write('{"text": "' + "x" * (40 * MIB) + '"}\n')
        handle.write(GOOD_TEXT)
    rules = RecordRules({"textField": "text"}, max_record_bytes=MIB, skip_bad=True)
    tracemalloc.start()
    try:
        skipped = check_json_files([str(path)], rules, str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert skipped.count == 1
    assert peak < 8 * MIB, peak


# --- parquet and arrow: the columns' types, from the schema ---------------------------------------------


def test_a_parquet_column_of_the_wrong_type_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(DataError) as refused:
        load_records(DataSource(str(path), text_field="text"))
    assert str(refused.value) == f"{path}: textField 'text': the column holds int64, not strings"


def test_an_arrow_messages_column_without_content_is_one_line(tmp_path: Path) -> None:
    from datasets import Dataset

    Dataset.from_list([{"messages": [{"role": "user", "text": "hi"}]}]).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"\.arrow: messagesField 'messages': the column holds list<item: struct<"):
        load_records(DataSource(str(tmp_path / "saved"), messages_field="messages"))


def test_a_null_in_a_parquet_string_column_names_its_record(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"text": ["fine", None]}), path)
    source = DataSource(str(path), text_field="text")
    with pytest.raises(DataError) as refused:
        PackedBatches(load_records(source), byte_level_tokenizer(), source, BatchShape(4, 1))
    assert str(refused.value) == f"{str(path)!r} record 1: textField 'text': null, not a string"


# --- the data's fingerprint, checked on resume --------------------------------------------------------------


def batches_of(path: Path, **options: object) -> PackedBatches:
    source = DataSource(str(path), text_field="text", **options)  # type: ignore[arg-type]
    return PackedBatches(load_records(source), byte_level_tokenizer(), source, BatchShape(16, 2, seed=3))


def write_texts(path: Path, count: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"record number {i} " * 3}) + "\n" for i in range(count)))
    return path


def test_the_fingerprint_is_of_the_data_and_its_order_not_of_where_it_is_mounted(tmp_path: Path) -> None:
    here = batches_of(write_texts(tmp_path / "a" / "train.jsonl", 40))
    elsewhere = batches_of(write_texts(tmp_path / "b" / "train.jsonl", 40))
    assert here.fingerprint == elsewhere.fingerprint
    per_epoch = here.micro_batches_per_epoch
    assert here.fingerprint["files"] == 1 and per_epoch is not None and here.fingerprint["blocks"] // 2 == per_epoch
    other_seed = PackedBatches(
        load_records(here.source), byte_level_tokenizer(), here.source, replace(here.shape, seed=4)
    )
    assert other_seed.fingerprint["sha256"] != here.fingerprint["sha256"]
    shrunk = batches_of(write_texts(tmp_path / "b" / "train.jsonl", 30))
    assert shrunk.fingerprint["sha256"] != here.fingerprint["sha256"]


def test_a_resume_on_other_data_is_refused_unless_it_changed_on_purpose(tmp_path: Path) -> None:
    path = write_texts(tmp_path / "data" / "train.jsonl", 40)
    written = batches_of(path).fingerprint
    write_texts(path, 30)
    with pytest.raises(DataError, match=r"the checkpoint was written on other data than .* set dataset.changed: true"):
        batches_of(path).check_resume(DataPosition(0, 1), 2, written)
    batches_of(path, changed=True).check_resume(DataPosition(0, 1), 2, written)


def test_a_position_past_the_end_of_the_epoch_is_refused_unless_the_data_changed_on_purpose(tmp_path: Path) -> None:
    path = write_texts(tmp_path / "data" / "train.jsonl", 40)
    batches = batches_of(path)
    blocks = batches.fingerprint["blocks"]
    batches.check_resume(DataPosition(0, blocks // 2), 2, batches.fingerprint)  # the epoch's last step: possible
    with pytest.raises(DataError, match=rf"resume position {blocks // 2 + 1} is past the end of epoch 0"):
        batches.check_resume(DataPosition(0, blocks // 2 + 1), 2, None)  # a marker written before fingerprints
    batches_of(path, changed=True).check_resume(DataPosition(0, blocks), 2, None)


# --- end to end: memfit-train, memfit run --local, memfit data preview ---------------------------------------


@pytest.mark.slow
def test_memfit_train_refuses_bad_data_before_the_process_group(tmp_path: Path) -> None:
    from tests.trainer.runs import make_config, run_single_process, write_config

    path = write_case(BAD_CASES["null text"], tmp_path / "data")
    config = make_config(tmp_path, data=path, world_size=1, engine="fsdp2", offload=False)
    done = run_single_process(write_config(config, tmp_path / "config.json"))
    assert done.returncode == 2, done.stderr[-3000:]
    line = expected_line(BAD_CASES["null text"], path)
    assert done.stderr.strip().splitlines() == [f"{CONFIG_ERROR_PREFIX}{line}"]
    message = json.loads(Path(config.termination_log).read_text())
    assert message["reason"] == "ConfigError" and message["message"] == line
    assert list(Path(config.output_dir).iterdir()) == []  # no checkpoint directory: training never started
    assert done.stdout == ""  # no metrics or data line: no process group, no model


JOB = """apiVersion: memfit.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: bad}}
spec:
  model:
    name: tiny
    randomInit: true
    architecture: {{family: llama, hiddenSize: 32, intermediateSize: 64, numLayers: 1, numAttentionHeads: 2,
                   numKeyValueHeads: 1, vocabSize: 258}}
  dataset:
    source: {{pvc: data, path: train.jsonl}}
    {field}: {name}
    maxRecordMib: 1
  training: {{globalBatchSize: 2, sequenceLength: 16, maxSteps: 2}}
  output: {{pvc: output, path: out/}}
"""


def bad_job(case: BadCase, tmp_path: Path) -> tuple[Path, Path]:
    data = write_case(case, tmp_path / "data")
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(field=case.field, name=case.name))
    return job, data


@pytest.mark.slow
@CLI_CASES
def test_memfit_run_local_refuses_bad_data_in_one_line_before_torchrun(
    case: BadCase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.cli import run_command
    from memfit.cli.main import main

    job, data = bad_job(case, tmp_path)
    monkeypatch.setattr(run_command, "_torchrun", lambda *args: pytest.fail("torchrun started"))
    assert main(["run", str(job), "--local", "--nproc", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"memfit run: error: {expected_line(case, data)}"


@pytest.mark.slow
@CLI_CASES
def test_memfit_data_preview_refuses_bad_data_in_one_line(
    case: BadCase, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.cli.main import main

    job, data = bad_job(case, tmp_path)
    assert main(["data", "preview", str(job)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"memfit data preview: error: {expected_line(case, data)}"]


@pytest.mark.slow
def test_a_shrunken_dataset_under_a_checkpoint_is_refused_on_resume(tmp_path: Path) -> None:
    """A run checkpointed at step 4, its corpus then cut to half: the rerun is refused in one line (exit 2, a
    ConfigError termination message) instead of moving on silently; with dataset.changed it resumes."""
    from tests.trainer.runs import make_config, run_single_process, write_config, write_corpus

    config = make_config(tmp_path, world_size=1, engine="fsdp2", offload=False, max_steps=4, checkpoint_every=2)
    first = run_single_process(write_config(config, tmp_path / "first.json"))
    assert first.returncode == 0, first.stderr[-3000:]
    write_corpus(Path(config.data.path), records=200)
    longer = config.model_copy(update={"training": config.training.model_copy(update={"max_steps": 8})})
    refused = run_single_process(write_config(longer, tmp_path / "longer.json"))
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{CONFIG_ERROR_PREFIX}the checkpoint was written on other data than "), line
    assert "(then: 1 file(s), " in line and "set dataset.changed: true" in line
    assert json.loads(Path(config.termination_log).read_text())["reason"] == "ConfigError"
    on_purpose = longer.model_copy(update={"data": longer.data.model_copy(update={"changed": True})})
    resumed = run_single_process(write_config(on_purpose, tmp_path / "changed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 4" in resumed.stdout


@pytest.mark.slow
def test_a_streamed_run_stops_at_a_bad_record_with_its_line_or_skips_it(tmp_path: Path) -> None:
    """Streamed, the record is found when the trainer reads it (not before): exit 2, its one line and a
    ConfigError termination message; with onBadRecord: skip the run trains on and says what it skipped."""
    from tests.trainer.runs import make_config, run_single_process, write_config, write_corpus

    data = write_corpus(tmp_path / "corpus.jsonl")
    with data.open("a") as handle:
        handle.write('{"text": null}\n')
    config = make_config(tmp_path, data=data, world_size=1, engine="fsdp2", offload=False, max_steps=2)
    streamed = config.model_copy(update={"data": config.data.model_copy(update={"streaming": True})})
    stopped = run_single_process(write_config(streamed, tmp_path / "stop.json"))
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    line = f"{data}:401: textField 'text': null, not a string"
    assert stopped.stderr.strip().splitlines()[-1] == f"{CONFIG_ERROR_PREFIX}{line}"
    assert json.loads(Path(config.termination_log).read_text()) == {"reason": "ConfigError", "message": line}
    skip = streamed.data.model_copy(update={"on_bad_record": OnBadRecord.SKIP})
    skipping = streamed.model_copy(update={"data": skip})
    skipped = run_single_process(write_config(skipping, tmp_path / "skip.json"))
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert f"memfit-train: skipped bad record {line} (1 skipped so far)" in skipped.stderr.splitlines()
