"""Calibration loading: every file format, inline texts, datasets, sampling, templates, errors."""

import json
import logging

import pytest

from mergekit_darts.repair.capture.calibration import apply_chat_template, load_calibration_texts
from mergekit_darts.config import CalibrationConfig, SurgeryConfigError

RECORDS = [{"question": f"how many apples {i} ?", "answer": str(i)} for i in range(5)]
QUESTIONS = [r["question"] for r in RECORDS]


def load(seed=0, where="surgery.domains.math.calibration", **kwargs):
    return load_calibration_texts(CalibrationConfig(**kwargs), seed=seed, where=where)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "cal.jsonl", RECORDS)


def test_jsonl(jsonl):
    assert load(path=jsonl, field="question") == QUESTIONS


def test_json_list_of_objects(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(RECORDS))
    assert load(path=str(path), field="question") == QUESTIONS


def test_txt_one_per_line_skips_blank_lines(tmp_path):
    path = tmp_path / "cal.txt"
    path.write_text("first sample\n\nsecond sample\nthird\n")
    assert load(path=str(path)) == ["first sample", "second sample", "third"]
    with pytest.raises(ValueError, match="'field' is not read for a .txt path"):  # it would be ignored: an error
        load(path=str(path), field="question")


def test_txt_blank_line_separated(tmp_path):
    path = tmp_path / "cal.txt"
    path.write_text("def f():\n    return 1\n\n\nline one\nline two\n  \nlast\n")
    assert load(path=str(path), separator="blank") == ["def f():\n    return 1", "line one\nline two", "last"]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "cal.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    assert load(path=str(path), field="question") == QUESTIONS


def test_csv(tmp_path):
    path = tmp_path / "cal.csv"
    path.write_text('question,answer\n"a, quoted one",1\nplain,2\n')
    assert load(path=str(path), field="question") == ["a, quoted one", "plain"]


def test_inline_texts():
    assert load(texts=["one", "two"]) == ["one", "two"]


def test_dataset_directory_loads_through_datasets(tmp_path, monkeypatch):
    import datasets

    # Keep the arrow cache inside the test's temp dir.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    data = tmp_path / "ds"
    data.mkdir()
    write_jsonl(data / "train.jsonl", RECORDS)
    assert load(dataset=str(data), split="train", field="question") == QUESTIONS


def test_dataset_not_cached_offline_is_a_clear_error():
    with pytest.raises(SurgeryConfigError) as info:
        load(dataset="no-such-org/no-such-dataset", field="question")
    message = str(info.value)
    assert message.startswith("surgery.domains.math.calibration.dataset:")
    assert "no-such-org/no-such-dataset" in message and "cache" in message and "path:" in message


def test_sampling_is_seeded_and_deterministic(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [{"text": f"sample {i}"} for i in range(100)])
    first = load(path=path, samples=10, seed=3)
    assert len(first) == 10 and len(set(first)) == 10
    assert first == load(path=path, samples=10, seed=3)
    assert first != load(path=path, samples=10, seed=4)


def test_fewer_records_than_samples_warns_and_uses_all(jsonl, caplog):
    with caplog.at_level(logging.WARNING, logger="mergekit_darts.repair.capture.calibration"):
        texts = load(path=jsonl, field="question", samples=50)
    assert texts == QUESTIONS
    assert "fewer than samples=50" in caplog.text and "surgery.domains.math.calibration" in caplog.text


def test_template_formats_record_fields(jsonl):
    texts = load(path=jsonl, template="Question: {question}\nAnswer:")
    assert texts == [f"Question: {q}\nAnswer:" for q in QUESTIONS]
    # Text-only sources expose their text as {text}.
    assert load(texts=["x"], template="<{text}>") == ["<x>"]


def test_template_unknown_placeholder_names_template(jsonl):
    with pytest.raises(SurgeryConfigError) as info:
        load(path=jsonl, template="Q: {questoin}")
    message = str(info.value)
    assert "calibration.template" in message and "'Q: {questoin}'" in message
    assert "answer" in message and "question" in message  # the fields that exist


def test_chat_template_renders_user_turn_with_generation_prompt():
    from mergekit_darts.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    assert apply_chat_template(["what is 2 + 3"], tokenizer) == ["<s>user: what is 2 + 3\n<s>assistant:"]
    with pytest.raises(SurgeryConfigError, match="no chat template"):
        apply_chat_template(["x"], build_tokenizer(chat_template=False))


def test_missing_file_names_path(tmp_path):
    with pytest.raises(SurgeryConfigError) as info:
        load(path=str(tmp_path / "x.jsonl"))
    assert str(info.value).startswith("surgery.domains.math.calibration.path: no such file")
    assert "x.jsonl" in str(info.value)


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("e.txt", "\n\n"), ("e.json", "[]"), ("e.csv", "a,b\n")])
def test_empty_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(SurgeryConfigError, match=r"calibration: .*is empty"):
        load(path=str(path))


def test_records_without_field_list_existing_fields(jsonl):
    with pytest.raises(SurgeryConfigError) as info:
        load(path=jsonl, field="prompt")
    message = str(info.value)
    assert message.startswith("surgery.domains.math.calibration.field:")
    assert "'prompt'" in message and "['answer', 'question']" in message and "cal.jsonl" in message


def test_bad_json_line_and_unsupported_extension(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(SurgeryConfigError, match="line 2 is not valid JSON"):
        load(path=str(bad))
    other = tmp_path / "cal.xml"
    other.write_text("<x/>")
    with pytest.raises(SurgeryConfigError, match="unsupported file type"):
        load(path=str(other))
