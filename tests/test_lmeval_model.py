"""lm-eval's ``darts`` model (mergekit_darts/evaluation/lmeval_model.py, issue 27): with
``darts_domain=auto`` every request is routed on its context alone, whatever else is in its batch.

The fixture is test_auto_routing's tiny directory with the strict router (threshold 1.0), under which
appending an answer often moves a prompt to another domain: exactly the case where routing on
context + continuation (what ``--model hf`` does) scores the choices of one question differently."""

import json
import os

import pytest
import torch

from loading_helpers import make_tiny_darts_dir
from test_auto_routing import _export_with_router
from test_modeling import load, tokenizer_for

# (question, choices): a multiple-choice document; the answer is the first choice
DOCS = [("how many apples are left if we have 5 and give 3 ?", ["2", "sunny", "13 apples and 4 pears in total", "is 8"]),
        ("def count ( list ) :", ["return a + b", "print ( x )", "sort ( list ) print ( list ) return", "sunny"]),
        ("the weather today is", ["sunny", "2", "print ( x )", "is 8"]),
        ("write a python function to add", ["return a + b", "13 apples and 4 pears in total", "print ( x )", "2"]),
        ("take 4 from 10 then", ["2", "is 8", "sunny", "return a + b"]),
        ("print ( list", ["print ( x )", "sunny", "2", "return a + b"])]
TASK = """task: darts_mc_test
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval_darts")
    path = str(root / "darts")
    modules = make_tiny_darts_dir(path)
    _export_with_router(path, modules, load(path), tokenizer_for(path), threshold=1.0)
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c}) + "\n" for q, c in DOCS))
    include = root / "tasks"
    include.mkdir()
    (include / "darts_mc_test.yaml").write_text(TASK.format(data=json.dumps(str(data))))
    return {"path": path, "include": str(include)}


def _lm(path, domain, batch_size=1, model="darts"):
    from lm_eval.api.registry import get_model

    import mergekit_darts.evaluation.lmeval_model  # noqa: F401  (registers "darts")

    return get_model(model)(pretrained=path, trust_remote_code=True, darts_domain=domain, device="cpu",
                            batch_size=batch_size)


def _choice_scores(lm, include):
    """{doc index: [loglikelihood of each choice]} through lm-eval's own multiple-choice task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=lm, tasks=["darts_mc_test"], log_samples=True, bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=include, include_defaults=False))
    return {s["doc_id"]: [resp[0][0] for resp in s["resps"]] for s in results["samples"]["darts_mc_test"]}


def _named(lm, domain):
    """``lm`` (lm-eval's hf model) scoring with ``domain`` as the model's default."""
    lm.model.set_darts_domain(domain)
    return lm


def test_auto_scores_every_choice_under_its_contexts_domain_at_any_batch_size(routed):
    from lm_eval.api.instance import Instance

    auto_one, auto_four = _lm(routed["path"], "auto", 1), _lm(routed["path"], "auto", 4)
    scores_one = _choice_scores(auto_one, routed["include"])
    scores_four = _choice_scores(auto_four, routed["include"])
    assert sorted(scores_one) == list(range(len(DOCS)))
    for doc in scores_one:
        assert scores_four[doc] == pytest.approx(scores_one[doc], abs=1e-5)  # batch size changes nothing

    picks = [auto_one.route(auto_one.tok_encode(question)) for question, _ in DOCS]
    assert {"math", "code", "none"} <= set(picks)
    assert sum(auto_one.route_counts.values()) == sum(len(c) for _, c in DOCS)
    # the fixture is the hard case: routed on context + answer, some documents' choices split domains
    model = auto_one.model
    whole = [[model.route_domains(torch.tensor([auto_one.tok_encode(f"{q} {c}")]))[0] for c in choices]
             for q, choices in DOCS]
    assert sum(len(set(domains)) > 1 for domains in whole) >= 3  # 5 of 6 when measured

    hf = _lm(routed["path"], "none", model="hf")  # lm-eval's own batching, one domain named per document
    for doc, ((question, choices), pick) in enumerate(zip(DOCS, picks)):
        requests = [Instance("loglikelihood", {}, (question, " " + choice), i) for i, choice in enumerate(choices)]
        named = {domain: [score for score, _ in _named(hf, domain).loglikelihood(requests)]
                 for domain in ("math", "code", "none")}
        assert scores_one[doc] == pytest.approx(named[pick], abs=1e-5), (question, pick)
        for other in {"math", "code", "none"} - {pick}:  # the domains really differ: the check has teeth
            assert scores_one[doc] != pytest.approx(named[other], abs=1e-3)


def test_hf_with_a_fixed_domain_equals_darts(routed):
    hf, darts = _lm(routed["path"], "code", model="hf"), _lm(routed["path"], "code", batch_size=4)
    expected, actual = _choice_scores(hf, routed["include"]), _choice_scores(darts, routed["include"])
    assert sorted(actual) == sorted(expected)
    for doc, scores in expected.items():
        assert actual[doc] == pytest.approx(scores, abs=1e-5)
    assert not darts.route_counts  # a named domain routes nothing


def test_rolling_and_generation_route_each_document_alone(routed):
    from lm_eval.api.instance import Instance

    texts = [question for question, _ in DOCS]
    auto, hf = _lm(routed["path"], "auto", 4), _lm(routed["path"], "none", model="hf")
    until = {"max_gen_toks": 5, "until": ["\n\n"]}
    rolling = auto.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    generated = auto.generate_until([Instance("generate_until", {}, (t, dict(until)), i) for i, t in enumerate(texts)])
    rolling_picks, generation_picks = [], []
    for text, score, generation in zip(texts, rolling, generated):
        rolling_picks.append(auto.route([auto.prefix_token_id] + auto.tok_encode(text)))  # the document is the prompt
        [expected] = _named(hf, rolling_picks[-1]).loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
        assert score == pytest.approx(expected, abs=1e-5)
        generation_picks.append(auto.route(auto.tok_batch_encode([text])[0][0].tolist()))
        [alone] = _named(hf, generation_picks[-1]).generate_until([Instance("generate_until", {}, (text, dict(until)), 0)])
        assert generation == alone
    assert len(set(rolling_picks)) > 1 and len(set(generation_picks)) > 1


def test_darts_model_needs_trust_remote_code_and_a_darts_directory(routed, tmp_path):
    from lm_eval.api.registry import get_model

    from mergekit_darts.errors import EvaluationError
    from mergekit_darts.evaluation.lmeval_model import DartsLM
    from mergekit_darts.tiny import make_random_model

    assert get_model("darts") is DartsLM
    with pytest.raises(EvaluationError, match="trust_remote_code=True"):
        DartsLM(pretrained=routed["path"], darts_domain="auto", device="cpu")
    plain = str(tmp_path / "plain")
    make_random_model(plain, seed=0)
    with pytest.raises(EvaluationError, match="not a mergekit-darts output"):
        DartsLM(pretrained=plain, trust_remote_code=True, device="cpu")


def test_lm_eval_command_line_with_the_darts_model(routed, tmp_path):
    """`python -m mergekit_darts.evaluation.lmeval_model run --model darts ...`: lm-eval's own command line."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mergekit_darts.evaluation.lmeval_model", "run", "--model", "darts", "--model_args",
         f"pretrained={routed['path']},trust_remote_code=True,darts_domain=auto", "--tasks", "darts_mc_test",
         "--include_path", routed["include"], "--device", "cpu", "--batch_size", "4", "--log_samples",
         "--output_path", str(tmp_path / "results")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    [samples] = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "results") for f in files
                 if f.startswith("samples_darts_mc_test")]
    with open(samples) as handle:
        scores = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in map(json.loads, handle)}
    expected = _choice_scores(_lm(routed["path"], "auto", 1), routed["include"])
    for doc, values in expected.items():
        assert [float(v) for v in scores[doc]] == pytest.approx(values, abs=1e-5)
