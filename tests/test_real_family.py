"""The real-weights benchmark's pieces (benchmarks/real_weights/real_family.py, real_table.py) on a tiny model:
the chat data, the answer-only fine-tune and its resume, and the table's rows through the real
mergekit-yaml pipeline. The SmolLM2 build itself is too slow for CI (docs/results.md, "real weights")."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "real_weights"))

import real_family  # noqa: E402
import real_table  # noqa: E402
from mergekit_darts.demo import tasks  # noqa: E402
from mergekit_darts.tiny import DEFAULT_WORDS, build_tokenizer, make_random_model  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    words = tasks.vocabulary([tasks.make_splits(d, 0, train=300, calib=50, test=10) for d in tasks.DOMAINS])
    return build_tokenizer([*DEFAULT_WORDS, *words])


def test_chat_splits_keep_test_and_calibration_fixed(tokenizer):
    small = real_family.chat_splits(tokenizer, train=20, test=10)
    large = real_family.chat_splits(tokenizer, train=200, test=10)
    for domain in tasks.DOMAINS:
        assert [e["chat"] for e in small[domain]["test"]] == [e["chat"] for e in large[domain]["test"]]
        assert [e["chat"] for e in small[domain]["calib"]] == [e["chat"] for e in large[domain]["calib"]]
        example = small[domain]["test"][0]
        assert example["chat"].endswith("assistant:") and example["prompt"] in example["chat"]


def test_answer_only_labels(tokenizer):
    examples = real_family.chat_splits(tokenizer, train=4, test=2)["math"]["train"][:3]
    input_ids, mask, labels = real_family.encode_answers(tokenizer, examples)
    for row, example in enumerate(examples):
        counted = labels[row][labels[row] != -100]
        assert tokenizer.decode(counted[:-1]) == example["completion"]
        assert counted[-1].item() == tokenizer.eos_token_id
        kept = input_ids[row][mask[row] == 1]
        assert tokenizer.decode(kept[: len(kept) - len(counted)]) == tokenizer.decode(
            tokenizer(example["chat"], add_special_tokens=False)["input_ids"])


def test_finetune_resumes_from_its_checkpoint(tokenizer, tmp_path, monkeypatch):
    base = str(tmp_path / "base")
    make_random_model(base, tokenizer=tokenizer, vocab_size=len(tokenizer), hidden_size=32)
    examples = real_family.chat_splits(tokenizer, train=16, test=2)["code"]["train"]
    out = str(tmp_path / "expert")
    encode, calls = real_family.encode_answers, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return encode(*args)

    monkeypatch.setattr(real_family, "encode_answers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        real_family.finetune_expert(base, tokenizer, examples, out, steps=5, seed=0, batch_size=2, checkpoint_every=2)
    assert not os.path.exists(out)
    with open(out + ".partial/progress.json") as handle:
        assert json.load(handle)["step"] == 2
    monkeypatch.setattr(real_family, "encode_answers", encode)
    progress = real_family.finetune_expert(base, tokenizer, examples, out, steps=5, seed=0, batch_size=2,
                                           checkpoint_every=2)
    assert progress["resumed_at"] == [2] and len(progress["losses"]) == 5
    assert os.path.exists(os.path.join(out, "config.json")) and not os.path.exists(out + ".partial")
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(out).state_dict()
    start = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert all(not torch.equal(tuned[k], start[k]) for k in start if k.endswith("down_proj.weight"))


def test_table_rows_through_the_pipeline(tokenizer, tmp_path):
    work = str(tmp_path / "work")
    make_random_model(os.path.join(work, "base"), tokenizer=tokenizer, vocab_size=len(tokenizer), hidden_size=32)
    record = real_family.build(work, steps={d: 2 for d in tasks.DOMAINS}, test=3, calib=10)
    assert set(record["experts"]) == set(tasks.DOMAINS)
    assert real_family.build(work, steps={d: 2 for d in tasks.DOMAINS}, test=3, calib=10) == record  # nothing redone
    table = real_table.run(work, ["base", "merge_ta", "extract_all8", "cli_ewl1"])
    assert set(table["rows"]) == {"base", "merge_ta", "extract_all8", "cli_ewl1"}
    # the mergekit-yaml command merged and repaired in one process, each stage timed
    assert list(table["reports"]["cli_ewl1"]["stages"]) == ["merge", "capture", *(f"train:{d}" for d in tasks.DOMAINS),
                                                            "router"]
    assert list(table["reports"]["extract_all8"]["stages"])[0] == "capture"
    assert all(set(scores) == set(tasks.DOMAINS) for scores in table["rows"].values())
    summary = table["reports"]["extract_all8"]
    assert summary["math"]["baseline"]["rank"] == 8 and summary["settings"]["steps"] == 0
    assert summary["math"]["held_out_kl"] is not None
    shares = table["routing"]["extract_all8"]
    assert set(shares) == {"16", "32", "64", "whole", "everyday_to_none"}
    with open(os.path.join(work, "table.json")) as handle:
        assert json.load(handle)["rows"] == table["rows"]
    assert "| Merged: task arithmetic (0.5 each) |" in real_table.markdown(table)
