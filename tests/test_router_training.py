"""Training the router for the prompts it will see (issue 30, docs/routing.md "Training"): prefix
pooling, the conformal gate, the classifier chosen in cross-validation. Plain tensors, no model."""

import math

import pytest
import torch

from mergekit_darts.remote_code.routing import NO_ROUTE, pool_prompt_states
from mergekit_darts.repair.route.router import fit_router
from mergekit_darts.repair.route.prefix import (PromptStates, measured_prefixes, pool_prefixes, pooled_at,
                                                 training_prefixes)
from mergekit_darts.repair.route.train import conformal_threshold, train_router

HIDDEN = 32


def _states(generator, records, length, make_token):
    """PromptStates of ``records`` records of random lengths in [length // 2, length], zero padded."""
    lengths = torch.randint(length // 2, length + 1, (records,), generator=generator)
    hidden = torch.zeros(records, length, HIDDEN)
    for row, n in enumerate(lengths.tolist()):
        hidden[row, :n] = torch.stack([make_token(t) for t in range(n)])
    return PromptStates(hidden, lengths)


def test_prefix_pooling_is_the_shipped_pooling_of_the_cut_prompt():
    generator = torch.Generator().manual_seed(0)
    states = _states(generator, 6, 20, lambda t: torch.randn(HIDDEN, generator=generator))
    rows, lengths = training_prefixes(states, torch.Generator().manual_seed(1), count=5, shortest=4)
    assert rows.numel() == 6 * 6 and torch.equal(rows[:6], torch.arange(6))
    assert torch.equal(lengths[:6], states.lengths)  # every record whole, then its random prefixes
    assert (lengths >= 1).all() and (lengths <= states.lengths[rows]).all() and (lengths[6:] >= 4).all()
    pooled = pool_prefixes(states, rows, lengths)
    columns = torch.arange(states.hidden.shape[1])
    for i in range(rows.numel()):
        mask = (columns < lengths[i]).unsqueeze(0)
        assert torch.allclose(pooled[i], pool_prompt_states(states.hidden[rows[i]].unsqueeze(0), mask)[0], atol=1e-6)
    # measured lengths cut long records and keep short ones whole
    cut = measured_prefixes(states, (8, None))
    assert torch.equal(cut["8"][1], states.lengths.clamp(max=8)) and torch.equal(cut["all"][1], states.lengths)


def test_conformal_threshold_keeps_the_fallback_within_the_rate():
    scores = torch.linspace(0.1, 1.0, 10)
    assert conformal_threshold(scores, 0.05) == 0.0  # floor(0.05 * 11) = 0: nothing can fall back
    assert conformal_threshold(scores, 0.1) == pytest.approx(0.1)  # the lowest: none strictly below it
    assert conformal_threshold(scores, 0.2) == pytest.approx(0.2)  # one of ten below
    generator = torch.Generator().manual_seed(0)
    calibration, fresh = torch.rand(999, generator=generator), torch.rand(100_000, generator=generator)
    for rate in (0.01, 0.05, 0.2):
        threshold = conformal_threshold(calibration, rate)
        assert float((calibration < threshold).float().mean()) <= rate
        assert abs(float((fresh < threshold).float().mean()) - rate) < 0.02  # and close to it on new draws


def _overlapping(generator, records=40):
    """Two domains whose records open alike: domain ``a`` starts with 12 tokens that look like
    ``b``'s own (plus an offset of ``a``'s) and then turns to its own tokens; ``b`` is ``b``
    throughout. Whole records separate easily; their first tokens only by the offset."""
    a, b, offset = (torch.nn.functional.normalize(torch.randn(HIDDEN, generator=generator), dim=0) for _ in range(3))
    noise = lambda: 0.3 * torch.randn(HIDDEN, generator=generator)  # noqa: E731
    return {
        "a": _states(generator, records, 48, lambda t: (b + 0.7 * offset if t < 12 else a) + noise()),
        "b": _states(generator, records, 48, lambda t: b + noise()),
    }


def _split(states, held=10):
    return {name: (torch.arange(held, s.records), torch.arange(held)) for name, s in states.items()}


def test_prefix_trained_router_routes_short_prompts_the_whole_record_router_does_not():
    states = _overlapping(torch.Generator().manual_seed(0))
    splits = _split(states)
    router, entry = train_router(states, splits, seed=0)
    short = {name: pooled_at(s.subset(splits[name][1]), (8, None)) for name, s in states.items()}
    for index, name in enumerate(("a", "b")):
        assert (router.route(short[name]["8"]) == index).all(), name
        assert entry["by_prefix"]["16"]["accuracy"][name] == 1.0
    # the router before prefixes: nearest centroid on whole records, fixed gate
    whole = {name: pooled_at(s.subset(splits[name][0]), (None,))["all"] for name, s in states.items()}
    before = fit_router(whole, kind="centroid", threshold=0.02)
    assert (before.route(short["a"]["all"]) == 0).all() and (before.route(short["b"]["all"]) == 1).all()
    assert float((before.route(short["a"]["8"]) == 0).float().mean()) < 0.5  # a's openings look like b
    assert float((before.route(short["b"]["8"]) == NO_ROUTE).float().mean()) > 0.2  # short: below the gate


def test_cross_validation_keeps_the_probe_where_centroids_cannot_separate():
    """Two domains a small step apart along e0, each record shifted by a large random amount along
    e0 + e1: nearest centroid (the mean difference, e0) drowns in the shift; a linear probe can
    project it out (e0 - e1). With separated clusters both are perfect and the tie keeps the centroid."""
    generator = torch.Generator().manual_seed(0)
    center = 2 * torch.nn.functional.normalize(torch.randn(HIDDEN, generator=generator), dim=0)
    e0, e1 = torch.eye(HIDDEN)[0], torch.eye(HIDDEN)[1]
    states = {}
    for name, sign in (("p", 1.0), ("q", -1.0)):
        hidden = torch.stack([center + sign * 0.15 * e0 + torch.randn(1, generator=generator) * (e0 + e1)
                              + 0.05 * torch.randn(20, HIDDEN, generator=generator) for _ in range(40)])
        states[name] = PromptStates(hidden, torch.full((40,), 20))
    router, entry = train_router(states, _split(states), seed=0)
    selection = entry["calibration"]["selection"]
    assert router.kind == entry["kind"] == "logistic" and selection["logistic"]["mean"] > selection["centroid"]["mean"] + 0.2
    assert entry["mean_accuracy"] >= 0.9
    forced, _ = train_router(states, _split(states), kind="centroid", seed=0)
    assert forced.kind == "centroid"
    far = {name: PromptStates(s.hidden + 3 * torch.eye(HIDDEN)[2 + i], s.lengths) for i, (name, s) in enumerate(states.items())}
    assert train_router(far, _split(far), seed=0)[1]["kind"] == "centroid"


def test_gate_is_calibrated_out_of_fold_and_an_explicit_threshold_is_kept():
    generator = torch.Generator().manual_seed(3)
    centers = [torch.nn.functional.normalize(torch.randn(HIDDEN, generator=generator), dim=0) for _ in range(3)]
    states = {name: _states(generator, 60, 24, lambda t, c=c: c + 0.8 * torch.randn(HIDDEN, generator=generator))
              for name, c in zip(("x", "y", "z"), centers)}
    splits = _split(states, held=20)
    # the gate is the same for both classifiers: the closed-form one keeps the test quick
    strict, entry = train_router(states, splits, fallback_rate=0.2, kind="centroid", seed=0)
    loose, loose_entry = train_router(states, splits, fallback_rate=0.01, kind="centroid", seed=0)
    assert entry["calibration"]["threshold"] == "conformal" and entry["calibration"]["folds"] == 5
    per_prefix = entry["calibration"]["per_prefix_threshold"]
    assert strict.threshold == min(t for by_length in per_prefix.values() for t in by_length.values())
    assert strict.threshold > loose.threshold
    for name, shares in entry["calibration"]["out_of_fold_none_share"].items():
        for label, share in shares.items():  # every domain and length within the rate, out of fold
            assert share <= 0.2, (name, label)
    held_none = [v for s in entry["by_prefix"].values() for v in s["none_share"].values()]
    assert 0 < sum(held_none) / len(held_none) < 0.4  # and near it on the held-out records
    assert entry["out_of_domain"]["source"] == "swapped_domains"
    fixed, fixed_entry = train_router(states, splits, threshold=0.3, kind="centroid", seed=0)
    assert fixed.threshold == 0.3 and fixed.kind == "centroid" and fixed_entry["calibration"]["threshold"] == "explicit"
    again, again_entry = train_router(states, splits, fallback_rate=0.2, kind="centroid", seed=0)
    assert again_entry == entry and all(torch.equal(t, again.state_dict()[k]) for k, t in strict.state_dict().items())


def test_router_eval_sets_the_out_of_domain_side_and_one_record_domains_still_train():
    generator = torch.Generator().manual_seed(4)
    centers = [torch.nn.functional.normalize(torch.randn(HIDDEN, generator=generator), dim=0) for _ in range(3)]
    states = {name: _states(generator, 30, 16, lambda t, c=c: c + 0.3 * torch.randn(HIDDEN, generator=generator))
              for name, c in zip(("x", "y"), centers)}
    foreign = _states(generator, 25, 16, lambda t: centers[2] + 0.3 * torch.randn(HIDDEN, generator=generator))
    router, entry = train_router(states, _split(states), eval_states=foreign, seed=0)
    ood = entry["out_of_domain"]
    assert ood["source"] == "router_eval" and ood["records"] == 25 and ood["none_share"] == 1.0
    assert float((router.route(pooled_at(foreign)["all"]) == NO_ROUTE).float().mean()) == 1.0
    tiny = {name: s.subset(torch.arange(2)) for name, s in states.items()}
    one, one_entry = train_router(tiny, {n: (torch.tensor([0]), torch.tensor([1])) for n in tiny}, seed=0)
    assert one.kind == "centroid" and one_entry["calibration"]["threshold"].startswith("default")
    assert math.isclose(one.threshold, 0.02)


def _chat_family(generator, template=24, records=40):
    """Three domains whose records all open with the same ``template`` states (a chat template's
    system prompt and user header, which causal attention makes identical) and then carry their
    domain's tokens; ``everyday`` has the template and then tokens of none of the domains."""
    shared = [torch.randn(HIDDEN, generator=generator) for _ in range(template)]
    centres = {name: torch.nn.functional.normalize(torch.randn(HIDDEN, generator=generator), dim=0)
               for name in ("math", "code", "instruct", "everyday")}

    def family(name):
        return _states(generator, records, template + 30,
                       lambda t: shared[t] if t < template else centres[name] + 0.5 * torch.randn(HIDDEN, generator=generator))
    return {name: family(name) for name in centres}


def test_prefixes_count_after_a_shared_chat_template_so_foreign_requests_fall_back(monkeypatch):
    import mergekit_darts.repair.route.train as router_train
    from mergekit_darts.repair.route.prefix import shared_prefix_length

    states = _chat_family(torch.Generator().manual_seed(0))
    everyday = states.pop("everyday")
    assert shared_prefix_length(list(states.values())) == 24
    assert shared_prefix_length([states["math"].subset(torch.tensor([0]))]) == int(states["math"].lengths[0]) - 1
    noisy = PromptStates(states["code"].hidden + 1e-5 * torch.randn(states["code"].hidden.shape), states["code"].lengths)
    assert shared_prefix_length([states["math"], noisy]) == 24  # batched kernels' last bits
    # measured "16 tokens" are 16 after the template
    assert torch.equal(measured_prefixes(states["math"], (16,), shared=24)["16"][1], states["math"].lengths.clamp(max=40))
    rows, lengths = training_prefixes(states["math"], torch.Generator().manual_seed(1), count=4, shared=24)
    whole = states["math"].lengths[rows]
    assert (lengths >= torch.minimum(whole, torch.tensor(24 + 4))).all() and (lengths <= whole).all()

    splits = _split(states)
    router, entry = train_router(states, splits, seed=0)
    assert entry["calibration"]["shared_prefix_tokens"] == 24
    foreign = float((router.route(pooled_at(everyday, (None,))["all"]) == NO_ROUTE).float().mean())
    for index, name in enumerate(states):
        unseen = pooled_at(states[name].subset(splits[name][1]), (None,))["all"]
        routed = router.route(unseen)  # the conformal gate lets about 5 % of a domain fall back
        assert ((routed == index) | (routed == NO_ROUTE)).all() and int((routed == index).sum()) >= 9, name
    # prefixes counted from the first token teach the gate that bare template is in-domain
    monkeypatch.setattr(router_train, "shared_prefix_length", lambda states: 0)
    before, _ = train_router(states, splits, seed=0)
    foreign_before = float((before.route(pooled_at(everyday, (None,))["all"]) == NO_ROUTE).float().mean())
    # the template stays in the pooled state (the shipped pooling), so not every foreign request falls back
    assert foreign_before == 0.0 and foreign >= 0.2, (foreign, foreign_before)
