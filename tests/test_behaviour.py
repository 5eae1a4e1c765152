"""The report's behaviour figures (docs/quality.md, "Behaviour"): greedy continuations of held-out prompts
compared with the expert's, from the cached states; checked against real ``generate`` calls."""

import shutil

import pytest
import torch

from helpers import merge_yaml

from mergekit_darts.repair.report.behaviour import decision_positions, held_out_behaviour

TEXTS = ["what is 1 plus 2 ?", "how many apples are left", "add 3 and 4", "the sum of two numbers",
         "count the apples", "what is 5 minus 1 ?"]


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


@pytest.fixture(scope="module")
def continued_output(tiny_family, tmp_path_factory):
    """The tiny merge repaired (kl, 40 steps) on 6 prompts continued by the expert; half held out."""
    from mergekit_darts.pipeline import run_surgery

    root = tmp_path_factory.mktemp("behaviour")
    out = root / "out"
    shutil.copytree(tiny_family["merged"], out)
    config = merge_yaml(tiny_family) + (
        "surgery:\n  rank: 4\n  max_positions: 24\n  steps: 40\n  lr: 0.01\n  loss: kl\n  device: cpu\n"
        f"  dtype: float32\n  seed: 0\n  held_out: 0.5\n  cache_dir: {root / 'cache'}\n  domains:\n"
        f"    math:\n      model: {tiny_family['math']}\n"
        f"      calibration: {{texts: {TEXTS}, samples: 6, continue_tokens: 5}}\n")
    return str(out), run_surgery(config, str(out))


def _greedy(model, ids, budget, eos):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=budget, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
    return out[:out.index(eos)] if eos in out else out


def test_report_figures_equal_real_generation(continued_output, tiny_family):
    """Exact match and first disagreement from the report equal what ``generate`` gives for the plain
    merge and the corrected model against the expert; the top-1 agreement equals a forward pass of the
    exported model along the expert's continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_darts.repair.train.split import split_held_out

    out, report = continued_output
    behaviour = report["domains"]["math"]["behaviour"]
    assert behaviour["prompts"] == 3 and behaviour["budget"] == 5
    tokenizer = AutoTokenizer.from_pretrained(out)
    eos = tokenizer.eos_token_id
    _, held = split_held_out(len(TEXTS), 0.5, 0)
    prompts = [tokenizer(TEXTS[i])["input_ids"] for i in held.tolist()]
    expert = AutoModelForCausalLM.from_pretrained(tiny_family["math"], dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, darts_domain="math").eval()
    targets = [_greedy(expert, p, 5, eos) for p in prompts]
    for label, domain in (("before", "none"), ("after", "math")):
        model.set_darts_domain(domain)
        exact, first, agreement = [], [], []
        for prompt, target in zip(prompts, targets):
            mine = _greedy(model, prompt, 5, eos)
            exact.append(mine == target)
            first.append(next((k for k, (a, b) in enumerate(zip(mine, target + [eos])) if a != b),
                              len(target)))
            # teacher forced along the expert's continuation (+ its stop when it stopped early)
            decisions = target + ([eos] if len(target) < 5 else [])
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + target])).logits[0]
            picks = logits[len(prompt) - 1:len(prompt) - 1 + len(decisions)].argmax(-1).tolist()
            agreement.append(sum(a == b for a, b in zip(picks, decisions)) / len(decisions))
        measured = behaviour[label]
        assert measured["exact_match"] == pytest.approx(sum(exact) / 3)
        assert measured["first_disagreement"] == pytest.approx(sum(first) / 3)
        assert measured["top1_agreement"] == pytest.approx(sum(agreement) / 3)


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
