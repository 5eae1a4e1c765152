"""The report's behaviour figures (docs/quality.md, "Behaviour"): greedy continuations of held-out prompts
compared with the expert's, from the cached states; checked against real ``generate`` calls."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from helpers import merge_yaml

from mergekit_darts.repair.report.behaviour import (MIN_BEHAVIOUR_PROMPTS, decision_positions, held_out_behaviour,
                                                   judged)

TEXTS = ["what is 1 plus 2 ?", "how many apples are left", "add 3 and 4", "the sum of two numbers",
         "count the apples", "what is 5 minus 1 ?", "give 2 pears then take 1", "multiply 6 and 7",
         "how many pears are there ?", "write the total of 8 and 9"]


def _one_hot_states(tokens, width):
    """States whose top-1 token through an identity head is ``tokens`` (one row)."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), width).float()


def test_decision_positions_cover_the_continuation_and_the_stop():
    # prompt of 3 tokens, 2 continuation tokens: positions 2 and 3 predict them, 4 predicts the stop
    assert decision_positions(3, 5, budget=4) == [2, 3, 4]
    assert decision_positions(3, 5, budget=2) == [2, 3]  # the budget ended it: no stop decision
    assert decision_positions(3, 3, budget=4) == [2]  # the expert stopped at once


def test_figures_on_hand_made_states():
    """Identity heads, one-hot states: each state names the token its model predicts next."""
    vocab, head = 10, torch.eye(10)
    # row 0: prompt [1, 4], the expert writes [7, 8] then stops (its top-1 there: 2); row 1: [1, 6] -> [5], stop 0
    ids = torch.tensor([[1, 4, 7, 8], [1, 6, 5, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    prompts = torch.tensor([2, 2])
    expert = torch.stack([_one_hot_states([0, 7, 8, 2], vocab), _one_hot_states([0, 5, 0, 0], vocab)])
    merged = torch.stack([_one_hot_states([0, 7, 3, 2], vocab), _one_hot_states([0, 5, 0, 0], vocab)])

    result = held_out_behaviour(ids, mask, prompts, merged, expert, expert, head, head, budget=3, max_positions=16)
    assert result["prompts"] == 2 and result["stopped_before_budget"] == 1.0 and result["expert_tokens"] == 1.5
    # merge: row 0 agrees on 7 and the stop, not on 8 (first disagreement at 1); row 1 exact (its length, 1)
    assert result["before"] == pytest.approx({"exact_match": 0.5, "top1_agreement": (2 / 3 + 1) / 2,
                                              "first_disagreement": 1.0})
    assert result["after"] == pytest.approx({"exact_match": 1.0, "top1_agreement": 1.0, "first_disagreement": 1.5})

    # budget 2: row 0 ends at the budget, so its stop is no decision; row 1 still stopped before it
    result = held_out_behaviour(ids, mask, prompts, merged, expert, expert, head, head, budget=2, max_positions=16)
    assert result["stopped_before_budget"] == 0.5
    assert result["before"] == pytest.approx({"exact_match": 0.5, "top1_agreement": 0.75, "first_disagreement": 1.0})

    # a wrong stop: the merge would write 5 where the expert stopped
    wrong_stop = _one_hot_states([0, 7, 8, 5], vocab)[None]
    result = held_out_behaviour(ids[:1], mask[:1], prompts[:1], wrong_stop, expert[:1], expert[:1], head, head,
                                budget=3, max_positions=16)
    assert result["before"] == pytest.approx({"exact_match": 0.0, "top1_agreement": 2 / 3, "first_disagreement": 2.0})

    # a head correction is added to the corrected logits only
    shift = lambda states: torch.roll(states, 1, dims=-1) * 10  # noqa: E731 - predicts token + 1
    result = held_out_behaviour(ids, mask, prompts, merged, expert, expert, head, head, budget=3, max_positions=16,
                                head_correction=shift)
    assert result["after"]["exact_match"] == 0.0 and result["before"]["exact_match"] == 0.5

    # no budget, or no room left under max_positions: nothing to compare
    assert held_out_behaviour(ids, mask, prompts, merged, expert, expert, head, head, budget=0,
                              max_positions=16) is None
    assert held_out_behaviour(ids, mask, prompts, merged, expert, expert, head, head, budget=3,
                              max_positions=2) is None


def test_an_empty_continuation_is_left_out_and_too_few_prompts_are_no_score():
    vocab, head = 10, torch.eye(10)
    # row 0: prompt [1, 4], the expert writes [7, 8] and stops; row 1: prompt [1, 6], the expert stops at once
    ids = torch.tensor([[1, 4, 7, 8], [1, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    prompts = torch.tensor([2, 2])
    expert = torch.stack([_one_hot_states([0, 7, 8, 2], vocab), _one_hot_states([0, 2, 0, 0], vocab)])
    result = held_out_behaviour(ids, mask, prompts, expert, expert, expert, head, head, budget=3, max_positions=16)
    # the empty row would be a perfect match on nothing: it is counted, not scored
    assert result["prompts"] == 1 and result["empty_continuations"] == 1 and result["expert_tokens"] == 2.0
    assert result["before"]["exact_match"] == 1.0 and result["before"]["first_disagreement"] == 2.0
    assert judged(result, min_prompts=1) is result

    shown = judged(result)  # one prompt: fewer than the minimum, so no score, the counts beside the reason
    assert "before" not in shown and "after" not in shown
    assert shown["prompts"] == 1 and shown["empty_continuations"] == 1
    assert f"fewer than the {MIN_BEHAVIOUR_PROMPTS}" in shown["not_measured"]

    only_empty = held_out_behaviour(ids[1:], mask[1:], prompts[1:], expert[1:], expert[1:], expert[1:], head, head,
                                    budget=3, max_positions=16)
    assert only_empty == {"prompts": 0, "empty_continuations": 1, "budget": 3}
    assert "the expert ends every held-out prompt at once" in judged(only_empty)["not_measured"]
    assert "leaves room" in judged(None)["not_measured"]


def test_the_minimum_is_the_one_docs_quality_states():
    page = (Path(__file__).resolve().parents[1] / "docs" / "quality.md").read_text()
    assert f"at least **{MIN_BEHAVIOUR_PROMPTS} scored prompts**" in page and "MIN_BEHAVIOUR_PROMPTS" in page


def test_prefixes_are_cut_from_long_held_out_records_only():
    from mergekit_darts.repair.capture.prefixes import held_out_prefixes
    from mergekit_darts.repair.capture.prompts import split_held_out

    ids = [list(range(n)) for n in (30, 5, 32, 12, 32, 31, 8, 32, 20, 32)]
    records, cut = held_out_prefixes(ids, 0.5, 3, continue_tokens=16, max_positions=32)
    train, held = split_held_out(len(ids), 0.5, 3)
    assert set(records.tolist()) == {i for i in held.tolist() if len(ids[i]) > 16}
    assert not set(records.tolist()) & set(train.tolist())  # training records are never cut
    assert all(c == ids[i][:16] for i, c in zip(records.tolist(), cut))
    # no continuation, or no token left before it: nothing to cut
    assert held_out_prefixes(ids, 0.5, 3, continue_tokens=0, max_positions=32)[1] == []
    assert held_out_prefixes(ids, 0.5, 3, continue_tokens=32, max_positions=32)[1] == []


# the offline example's prompt-style calibration file (short questions): every prompt leaves room
DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "mergekit_darts" / "demo" / "math_prompts.jsonl"


def _demo_questions():
    return [json.loads(line)["question"] for line in DEMO_PROMPTS.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def continued_output(tiny_family, tmp_path_factory):
    """The tiny merge repaired (kl, 40 steps) on the 30 prompts of the offline example's math file,
    continued by the expert; a fifth (6) held out."""
    from mergekit_darts.pipeline import run_surgery

    root = tmp_path_factory.mktemp("behaviour")
    out = root / "out"
    shutil.copytree(tiny_family["merged"], out)
    config = merge_yaml(tiny_family) + (
        "surgery:\n  rank: 4\n  max_positions: 24\n  steps: 40\n  lr: 0.01\n  loss: kl\n  device: cpu\n"
        f"  dtype: float32\n  seed: 0\n  held_out: 0.2\n  cache_dir: {root / 'cache'}\n  domains:\n"
        f"    math:\n      model: {tiny_family['math']}\n"
        f"      calibration: {{path: {DEMO_PROMPTS}, field: question, samples: 30, continue_tokens: 5}}\n")
    return str(out), run_surgery(config, str(out))


DOC_WORDS = "the sum of apples and pears is the total count how many are left then give take write".split()
# document-style calibration: every record (41 tokens with BOS) is longer than max_positions (32)
DOCS = [" ".join(random.Random(i).choices(DOC_WORDS, k=40)) for i in range(10)]


@pytest.fixture(scope="module")
def documents_output(tiny_family, tmp_path_factory):
    """The tiny merge repaired (kl, 40 steps) on 10 documents, continue_tokens 16; half held out."""
    from mergekit_darts.pipeline import run_surgery

    root = tmp_path_factory.mktemp("documents")
    out = root / "out"
    shutil.copytree(tiny_family["merged"], out)
    config = _documents_config(tiny_family, root)
    return str(out), run_surgery(config, str(out)), config


def _documents_config(family, root, extra=""):
    """A document-style calibration file (one record a line, field ``text``) under ``root``, and the config."""
    docs = Path(root) / "documents.jsonl"
    docs.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS))
    cache = Path(root) / "cache"
    return merge_yaml(family) + (
        f"surgery:\n  rank: 4\n  max_positions: 32\n  steps: 40\n  lr: 0.01\n  loss: kl\n  device: cpu\n{extra}"
        f"  dtype: float32\n  seed: 0\n  held_out: 0.5\n  cache_dir: {cache}\n  domains:\n"
        f"    math:\n      model: {family['math']}\n"
        f"      calibration: {{path: {docs}, samples: 10, continue_tokens: 16}}\n")


def _greedy(model, ids, budget, eos):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=budget, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
    return out[:out.index(eos)] if eos in out else out


def check_against_generation(out, expert_dir, behaviour, prompts, budget):
    """Exact match and first disagreement from the report equal what ``generate`` gives for the plain
    merge and the corrected model against the expert on ``prompts``; the top-1 agreement equals a
    forward pass of the exported model along the expert's continuation. Prompts the expert ends at
    once are left out of the figures and counted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eos = AutoTokenizer.from_pretrained(out).eos_token_id
    expert = AutoModelForCausalLM.from_pretrained(expert_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="math").eval()
    targets = [_greedy(expert, p, budget, eos) for p in prompts]
    kept = [(p, t) for p, t in zip(prompts, targets) if t]
    assert behaviour["empty_continuations"] == len(prompts) - len(kept)
    assert behaviour["prompts"] == len(kept) and behaviour["budget"] == budget
    for label, domain in (("before", "none"), ("after", "math")):
        model.set_darts_domain(domain)
        exact, first, agreement = [], [], []
        for prompt, target in kept:
            mine = _greedy(model, prompt, budget, eos)
            exact.append(mine == target)
            first.append(next((k for k, (a, b) in enumerate(zip(mine, target + [eos])) if a != b),
                              len(target)))
            # teacher forced along the expert's continuation (+ its stop when it stopped early)
            decisions = target + ([eos] if len(target) < budget else [])
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + target])).logits[0]
            picks = logits[len(prompt) - 1:len(prompt) - 1 + len(decisions)].argmax(-1).tolist()
            agreement.append(sum(a == b for a, b in zip(picks, decisions)) / len(decisions))
        measured = behaviour[label]
        assert measured["exact_match"] == pytest.approx(sum(exact) / len(kept))
        assert measured["first_disagreement"] == pytest.approx(sum(first) / len(kept))
        assert measured["top1_agreement"] == pytest.approx(sum(agreement) / len(kept))


def test_report_figures_equal_real_generation(continued_output, tiny_family):
    """Prompt-style calibration: every held-out prompt leaves room, so each is measured whole."""
    from transformers import AutoTokenizer

    from mergekit_darts.repair.train.split import split_held_out

    out, report = continued_output
    behaviour = report["domains"]["math"]["behaviour"]
    assert behaviour["prefixes"] == 0 and behaviour["prompts"] >= MIN_BEHAVIOUR_PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(out)
    questions = _demo_questions()
    _, held = split_held_out(len(questions), 0.2, 0)
    assert held.numel() == 6
    prompts = [tokenizer(questions[i])["input_ids"] for i in held.tolist()]
    check_against_generation(out, tiny_family["math"], behaviour, prompts, 5)


def test_table_and_card_show_the_behaviour(continued_output):
    from mergekit_darts.repair.report.table import render_report

    out, report = continued_output
    table = render_report(out, plot=False)
    before, after = report["domains"]["math"]["behaviour"]["before"], report["domains"]["math"]["behaviour"]["after"]
    assert "exact match" in table and f"{before['top1_agreement']:.3f} -> {after['top1_agreement']:.3f}" in table
    card = open(f"{out}/README.md", encoding="utf-8").read()
    assert f"(top-1 agreement {before['top1_agreement']:.2f} → {after['top1_agreement']:.2f})" in card


def test_without_continuations_the_report_says_why(merged_copy, tiny_family, tmp_path):
    from mergekit_darts.pipeline import run_surgery

    config = merge_yaml(tiny_family) + (
        "surgery:\n  rank: 2\n  max_positions: 16\n  steps: 2\n  device: cpu\n  dtype: float32\n"
        f"  cache_dir: {tmp_path / 'cache'}\n  domains:\n    math:\n      model: {tiny_family['math']}\n"
        f"      calibration: {{texts: {TEXTS[:3]}, samples: 3}}\n")
    behaviour = run_surgery(config, merged_copy)["domains"]["math"]["behaviour"]
    assert "continue_tokens is 0" in behaviour["not_measured"]


def test_document_figures_are_taken_on_held_out_prefixes(documents_output, tiny_family):
    """Document-style calibration: no held-out record leaves room for a continuation, so each is
    measured on its first max_positions - continue_tokens tokens, continued by the expert; the figures
    equal real generation from those prefixes. Training keeps its own records only."""
    from transformers import AutoTokenizer

    from mergekit_darts.repair.train.split import split_held_out

    out, report, _ = documents_output
    entry = report["domains"]["math"]
    assert entry["calibration"]["truncated"] == 10
    assert entry["calibration"]["train"] == 5 and entry["calibration"]["held_out"] == 5  # no prefix row trains
    behaviour = entry["behaviour"]
    assert behaviour["prefixes"] == 5 and "before" in behaviour and "not_measured" not in behaviour
    tokenizer = AutoTokenizer.from_pretrained(out)
    _, held = split_held_out(len(DOCS), 0.5, 0)
    prompts = [tokenizer(DOCS[i])["input_ids"][:32 - 16] for i in held.tolist()]
    check_against_generation(out, tiny_family["math"], behaviour, prompts, 16)


def test_document_prefixes_with_depth_equal_real_generation(tiny_family, tmp_path):
    """With ``depth`` the corrected prefix states come from the frozen tail on the prefixes' block
    inputs: still what the exported model generates."""
    from transformers import AutoTokenizer

    from mergekit_darts.pipeline import run_surgery
    from mergekit_darts.repair.train.split import split_held_out

    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    config = _documents_config(tiny_family, tmp_path, "  depth: 1\n  depth_rank: 2\n")
    behaviour = run_surgery(config, str(out))["domains"]["math"]["behaviour"]
    assert behaviour["prefixes"] == 5
    tokenizer = AutoTokenizer.from_pretrained(out)
    _, held = split_held_out(len(DOCS), 0.5, 0)
    prompts = [tokenizer(DOCS[i])["input_ids"][:32 - 16] for i in held.tolist()]
    check_against_generation(str(out), tiny_family["math"], behaviour, prompts, 16)


def test_document_prefixes_come_from_the_cache_on_a_rerun(documents_output, tiny_family, tmp_path, caplog):
    import logging

    from mergekit_darts.pipeline import run_surgery

    out, report, config = documents_output
    again = tmp_path / "again"
    shutil.copytree(tiny_family["merged"], again)
    with caplog.at_level(logging.INFO):
        rerun = run_surgery(config, str(again))
    assert "expert.math-prefixes" in caplog.text and "merged.math-prefixes" in caplog.text
    assert "continue · math-prefixes" not in caplog.text  # nothing generated again
    assert all("capture cache: hit" in record.getMessage() for record in caplog.records
               if "math-prefixes" in record.getMessage())
    assert rerun["domains"]["math"]["behaviour"] == report["domains"]["math"]["behaviour"]


def test_an_expert_that_ends_every_prompt_at_once_gets_no_score(tiny_family, tmp_path):
    """An expert whose every token is a stop token writes nothing: the report counts the empty
    continuations and says why there is no figure; the table and the card show it."""
    from mergekit_darts.pipeline import run_surgery
    from mergekit_darts.repair.report.table import render_report

    expert = tmp_path / "expert"
    shutil.copytree(tiny_family["math"], expert)
    vocab = json.loads((expert / "config.json").read_text())["vocab_size"]
    (expert / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(vocab))}))
    out = tmp_path / "out"
    shutil.copytree(tiny_family["merged"], out)
    config = merge_yaml(tiny_family) + (
        "surgery:\n  rank: 2\n  max_positions: 24\n  steps: 2\n  loss: kl\n  device: cpu\n  dtype: float32\n"
        f"  seed: 0\n  held_out: 0.5\n  cache_dir: {tmp_path / 'cache'}\n  domains:\n    math:\n"
        f"      model: {expert}\n      calibration: {{texts: {TEXTS}, samples: 10, continue_tokens: 5}}\n")
    behaviour = run_surgery(config, str(out))["domains"]["math"]["behaviour"]
    assert behaviour["prompts"] == 0 and behaviour["empty_continuations"] == 5 and "before" not in behaviour
    assert "the expert ends every held-out prompt at once" in behaviour["not_measured"]
    table = render_report(str(out), plot=False)
    assert "not measured" in table and "behaviour math: not measured: the expert ends every" in table
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "not measured (0 prompts with a continuation, 5 the expert ended at once)" in card


def test_verdict_follows_the_behaviour_figures_of_a_real_report(continued_output):
    """Issue 46 item 1: "improved" only when the objective improved and the greedy exact match and top-1
    agreement got no worse; the same real entry with its behaviour figures made worse is "mixed", saying
    why, and with them unmoved "improved" on its KL with the tie said (issue 54)."""
    import copy

    from mergekit_darts.repair.report.verdict import domain_verdict

    _, report = continued_output
    entry = report["domains"]["math"]
    behaviour, verdict = entry["behaviour"], entry["verdict"]
    moves = [behaviour["after"][key] - behaviour["before"][key] for key in ("exact_match", "top1_agreement")]
    improved_kl = entry["held_out_kl"]["after"] < entry["held_out_kl"]["before"]
    expected = ("mixed" if min(moves) < 0 else "improved") if improved_kl else "worse"  # a tie: the KL decides
    assert verdict["status"] == expected
    assert improved_kl and entry["no_regret"]["kept"] == "trained"  # 40 kl steps help on this family
    worse = copy.deepcopy(entry)
    worse["behaviour"]["after"]["exact_match"] = worse["behaviour"]["before"]["exact_match"] - 0.2
    mixed = domain_verdict(worse, "kl")
    assert mixed["status"] == "mixed" and "greedy exact match" in mixed["why"] and "KL to expert improved" in mixed["why"]
    still = copy.deepcopy(entry)
    still["behaviour"]["after"] = dict(still["behaviour"]["before"])
    tied = domain_verdict(still, "kl")
    assert tied["status"] == "improved" and "why" not in tied
    assert tied["behaviour_tie"].startswith(f"no greedy decision changed on the {behaviour['prompts']} held-out prompts")
