"""The demo's synthetic domains (generators, scorers); the code sandbox itself: tests/test_sandbox*.py."""

import pytest

from mergekit_darts.demo import tasks
from mergekit_darts.demo.family import build_tokenizer


@pytest.fixture(scope="module")
def splits():
    return {d: tasks.make_splits(d, seed=0, train=300, calib=50, test=40) for d in tasks.DOMAINS}


@pytest.mark.parametrize("domain", tasks.DOMAINS)
def test_splits_deterministic_and_disjoint(domain, splits):
    again = tasks.make_splits(domain, seed=0, train=300, calib=50, test=40)
    assert again == splits[domain]
    other = tasks.make_splits(domain, seed=1, train=300, calib=50, test=40)
    assert other["test"] != splits[domain]["test"]
    parts = {k: {ex["prompt"] for ex in v} for k, v in splits[domain].items()}
    assert len(parts["test"]) == 40 and len(parts["calib"]) == 50 and len(splits[domain]["train"]) == 300
    assert not parts["train"] & parts["test"]
    assert not parts["train"] & parts["calib"]
    assert not parts["calib"] & parts["test"]


def test_math_solutions_are_correct(splits):
    for example in splits["math"]["test"] + splits["math"]["calib"]:
        steps = example["completion"].split(" . ")
        for step in steps[:-1]:  # "a op b = c"
            left, right = step.split(" = ")
            assert eval(left) == int(right), example
        assert steps[-1] == f"#### {example['answer']}"
        assert tasks.score_math(example, example["completion"])


def test_math_answer_extraction():
    example = {"answer": "14"}
    assert tasks.extract_answer("2 + 3 = 5 . #### 14") == "14"
    assert tasks.extract_answer("#### -3 and more") == "-3"
    assert tasks.extract_answer("no answer 14") is None
    assert tasks.score_math(example, "9 + 5 = 14 . #### 14")
    assert not tasks.score_math(example, "9 + 5 = 14 .")  # the number must follow ####
    assert not tasks.score_math(example, "#### 15 #### 14")  # the first answer counts
    assert not tasks.score_math(example, "#### 141")


def test_code_reference_solutions_pass_hidden_tests(splits):
    from mergekit_darts.demo.evaluate import score_completions

    examples = splits["code"]["test"][:25]
    assert all(score_completions("code", examples, [ex["completion"] for ex in examples]))
    wrong = [ex["completion"].replace("return", "return 1 +", 1) for ex in examples[:5]]
    assert not any(score_completions("code", examples[:5], wrong))


def test_code_scoring():
    example = {"prompt": 'def solve ( x ) : " return x plus 3 " ;', "tests": "assert solve(1) == 4\nassert solve(-2) == 1"}
    assert tasks.score_code(example, "return x + 3")
    assert not tasks.score_code(example, "return x + 4")
    assert not tasks.score_code(example, "return ( x")  # syntax error
    assert not tasks.score_code(example, "")


def test_instruct_exact_match(splits):
    for example in splits["instruct"]["test"]:
        assert tasks.score_instruct(example, example["completion"])
        assert tasks.score_instruct(example, "  " + example["completion"] + " ")
    example = {"completion": "sun dog cat"}
    assert not tasks.score_instruct(example, "sun dog")
    assert not tasks.score_instruct(example, "sun dog cat cat")
    reverse = [ex for ex in splits["instruct"]["test"] if "reverse the words" in ex["prompt"]][0]
    words = reverse["prompt"].split(" : ")[2].split(" . ")[0].split()
    assert reverse["completion"].split() == words[::-1]


def test_tokenizer_round_trips_every_example(splits):
    words = tasks.vocabulary(splits.values())
    tok = build_tokenizer(words)
    for domain in tasks.DOMAINS:
        for example in splits[domain]["test"]:
            ids = tok(example["text"])["input_ids"]
            assert tok.unk_token_id not in ids
            assert tok.decode(ids, skip_special_tokens=True) == example["text"]
