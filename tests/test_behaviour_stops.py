"""Behaviour figures with several stop ids (issue 45, ask 6): Llama-3's generation config stops on
``<|eot_id|>`` and ``<|end_of_text|>`` alike, so a model that stops on the other one where the expert
stopped has stopped too, and its continuation equals the expert's. Checked by hand and through a run
whose figures are compared with real ``generate`` calls that stop on every id of the generation config."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import merge_yaml
from mergekit_darts.repair.report.behaviour import held_out_behaviour

BUDGET = 5
DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "mergekit_darts" / "demo" / "math_prompts.jsonl"


def _one_hot_states(tokens, width):
    return torch.nn.functional.one_hot(torch.tensor(tokens), width).float()


def test_a_stop_on_any_stop_id_is_the_expert_s_stop():
    """Identity heads, one-hot states: prompt [1, 4], the expert writes 7 and stops on 2; the merge
    writes 7 and would stop on 9, the corrected model writes 7 and then 5 (no stop)."""
    vocab, head = 10, torch.eye(10)
    ids, mask, prompts = torch.tensor([[1, 4, 7]]), torch.ones(1, 3, dtype=torch.bool), torch.tensor([2])
    expert = _one_hot_states([0, 7, 2], vocab)[None]
    merged = _one_hot_states([0, 7, 9], vocab)[None]
    corrected = _one_hot_states([0, 7, 5], vocab)[None]

    def figures(stop_ids):
        return held_out_behaviour(ids, mask, prompts, merged, corrected, expert, head, head, budget=3,
                                  max_positions=16, stop_ids=stop_ids)

    both = figures([2, 9])
    assert both["before"] == pytest.approx({"exact_match": 1.0, "top1_agreement": 1.0, "first_disagreement": 1.0})
    assert both["after"] == pytest.approx({"exact_match": 0.0, "top1_agreement": 0.5, "first_disagreement": 1.0})
    for only_the_expert_s in ([2], None):  # 9 is no stop: the merge writes it and goes on
        assert figures(only_the_expert_s)["before"] == pytest.approx(
            {"exact_match": 0.0, "top1_agreement": 0.5, "first_disagreement": 1.0})
    # a stop id where the expert wrote a token is a wrong token, not a stop
    early = held_out_behaviour(ids, mask, prompts, _one_hot_states([0, 9, 2], vocab)[None], corrected, expert, head,
                               head, budget=3, max_positions=16, stop_ids=[2, 9])
    assert early["before"] == pytest.approx({"exact_match": 0.0, "top1_agreement": 0.5, "first_disagreement": 0.0})


def _greedy(model, prompt, stops):
    """The continuation ``generate`` writes with the model's own generation config (every stop id in
    it), cut before its stop; and whether it stopped before the budget."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=BUDGET, do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
    cut = next((k for k, token in enumerate(out) if token in stops), None)
    return (out, False) if cut is None else (out[:cut], True)


def _two_stop_ids(expert, merged, prompts):
    """Two tokens ``a`` (the expert's) and ``b`` (the merge's) that their greedy continuations of one
    prompt write at the first position where they differ, neither written before there."""
    for prompt in prompts:
        mine, _ = _greedy(merged, prompt, {2})
        theirs, _ = _greedy(expert, prompt, {2})
        for k, (a, b) in enumerate(zip(theirs, mine)):
            if a != b:
                if a not in theirs[:k] and b not in theirs[:k] and min(a, b) > 3:
                    return a, b
                break
    raise AssertionError("no prompt where the expert and the merge part ways on two fresh tokens")


def test_report_counts_a_stop_on_the_other_stop_id_as_the_expert_s_stop(tiny_family, tmp_path):
    """The expert's and the merge's generation configs stop on [eos, a, b], where the expert writes a and
    the merge b after the same tokens: both stop there, an exact match. The report's figures equal
    what ``generate`` gives (stopping on every id of the generation config) for the plain merge and
    the corrected model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_darts.pipeline import run_surgery
    from mergekit_darts.repair.train.split import split_held_out

    questions = [json.loads(line)["question"] for line in DEMO_PROMPTS.read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(tiny_family["merged"])
    _, held = split_held_out(len(questions), 0.2, 0)
    prompts = [tokenizer(questions[i])["input_ids"] for i in held.tolist()]
    plain = AutoModelForCausalLM.from_pretrained(tiny_family["merged"]).eval()
    expert_model = AutoModelForCausalLM.from_pretrained(tiny_family["math"]).eval()
    a, b = _two_stop_ids(expert_model, plain, prompts)
    stops = [2, a, b]
    expert, out = tmp_path / "expert", tmp_path / "out"
    shutil.copytree(tiny_family["math"], expert)
    shutil.copytree(tiny_family["merged"], out)
    for directory in (expert, out):  # as Llama-3: config.json names one eos, the generation config several
        (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": stops}))
    config = merge_yaml(tiny_family) + (
        "surgery:\n  rank: 4\n  max_positions: 24\n  steps: 20\n  lr: 0.01\n  loss: kl\n  device: cpu\n"
        f"  dtype: float32\n  seed: 0\n  held_out: 0.2\n  cache_dir: {tmp_path / 'cache'}\n  domains:\n"
        f"    math:\n      model: {expert}\n"
        f"      calibration: {{path: {DEMO_PROMPTS}, field: question, samples: 30, continue_tokens: {BUDGET}}}\n")
    behaviour = run_surgery(config, str(out))["domains"]["math"]["behaviour"]

    expert_model = AutoModelForCausalLM.from_pretrained(expert).eval()
    assert expert_model.generation_config.eos_token_id == stops
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    targets = [_greedy(expert_model, prompt, set(stops)) for prompt in prompts]
    kept = [(prompt, target) for prompt, target in zip(prompts, targets) if target[0]]
    assert behaviour["prompts"] == len(kept) >= 5
    for label, domain in (("before", "none"), ("after", "math")):
        model.set_darts_domain(domain)
        exact, first, agreement, other_stop = [], [], [], 0
        for prompt, (target, stopped) in kept:
            mine, mine_stopped = _greedy(model, prompt, set(stops))
            exact.append((mine, mine_stopped) == (target, stopped))
            ours = mine + (["stop"] if mine_stopped else [])
            theirs = target + (["stop"] if stopped else [])
            first.append(next((k for k, (x, y) in enumerate(zip(ours, theirs)) if x != y), len(target)))
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + target])).logits[0]
            picks = logits[len(prompt) - 1:len(prompt) + len(target)].argmax(-1).tolist()
            decisions = [pick == token for pick, token in zip(picks, target)]
            if stopped:
                decisions.append(picks[len(target)] in stops)
                full = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=BUDGET, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
                expert_full = expert_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=BUDGET,
                                                    do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
                if mine == target and mine_stopped and full[len(mine)] != expert_full[len(target)]:
                    other_stop += 1  # stopped where the expert did, on another stop id
            agreement.append(sum(decisions) / len(decisions))
        measured = behaviour[label]
        assert measured["exact_match"] == pytest.approx(sum(exact) / len(kept)), label
        assert measured["first_disagreement"] == pytest.approx(sum(first) / len(kept)), label
        assert measured["top1_agreement"] == pytest.approx(sum(agreement) / len(kept)), label
        if label == "before":  # the case this is about occurs: the plain merge stops on b where the expert wrote a
            assert other_stop >= 1
