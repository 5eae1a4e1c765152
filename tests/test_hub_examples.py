"""The README's YAML and every merge config in examples/ pass the pre-merge checks as a user runs them:
through the real ``mergekit-yaml`` entry, against local stand-ins of the Hub models and datasets they name
(``hub_standins.py``: each model's architecture, shape, vocabulary size and chat-template presence; each
dataset's subsets, splits and fields), with every Hub id rewritten to its stand-in's folder. The run stops
where the merge would start. A few edits of the same configs show the stand-ins are strict enough to
refuse what the real models would: no chat template, a mergekit template name that does not exist, an
expert with another vocabulary size (WizardMath-7B-V1.0's 32,001 tokens)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hub_standins import DATASETS, MODELS, build_datasets, build_models

REPO = Path(__file__).resolve().parents[1]
MODEL_KEYS = ("model", "base_model", "synthesize_writer")

# one interpreter for every config: mergekit-yaml's own click command, its pre-merge checks run, then a stop
RUNNER = r"""
import json, sys
import mergekit_darts.preflight as preflight
from mergekit.scripts.run_yaml import main

class ChecksPassed(Exception):
    pass

checks = preflight.check_before_merge

def check_then_stop(*args, **kwargs):
    checks(*args, **kwargs)
    raise ChecksPassed()

preflight.check_before_merge = check_then_stop
for name, config, out in json.loads(sys.argv[1]):
    try:
        main([config, out], standalone_mode=False)
        result = "not stopped"
    except ChecksPassed:
        result = "passed"
    except Exception as error:  # noqa: BLE001 - the one-line click error of a refusal, or anything else
        result = "refused: " + (getattr(error, "message", None) or f"{type(error).__name__}: {error}")
    print("RESULT " + json.dumps([name, result]), flush=True)
"""


def readme_configs():
    """The README's whole configs (yaml blocks with a merge part and a surgery: block), by line."""
    from test_docs import blocks

    found = {}
    for page, line, lang, code, marker, _ in blocks(REPO / "README.md"):
        if lang == "yaml" and marker is None:
            data = yaml.safe_load(code)
            if isinstance(data, dict) and "surgery" in data and "merge_method" in data:
                found[f"README.md:{line}"] = code
    return found


def example_configs():
    """Every merge config in examples/ (a sweep file is checked by tests/test_sweep.py and the doc test)."""
    found = {}
    for path in sorted((REPO / "examples").glob("*.yml")):
        data = yaml.safe_load(path.read_text())
        if "sweep" not in data:
            found[f"examples/{path.name}"] = path.read_text()
    return found


def localized(text: str, models, datasets) -> str:
    """The config with each Hub model and dataset id replaced by its stand-in's folder (an id without a
    stand-in fails: add it to hub_standins.py with the real model's facts)."""
    def walk(node, key=None):
        if isinstance(node, dict):
            return {k: walk(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, key) for v in node]
        if key in MODEL_KEYS and isinstance(node, str):
            assert node in models, f"no stand-in for the Hub model {node!r} (tests/hub_standins.py)"
            return models[node]
        if key == "dataset" and isinstance(node, str):
            assert node in datasets, f"no stand-in for the Hub dataset {node!r} (tests/hub_standins.py)"
            return datasets[node]
        return node
    return yaml.safe_dump(walk(yaml.safe_load(text)), sort_keys=False)


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return root, build_models(str(root / "models")), build_datasets(str(root / "datasets"))


def _variants():
    """(name, config text, expected result prefix): every shipped config, and the edits that must fail."""
    readme = readme_configs()
    assert readme, "the README shows no whole config"
    shipped = {**readme, **example_configs()}
    assert set(shipped) >= {"examples/paper_llama2_7b.yml", "examples/llama3_8b.yml", "examples/qwen2_5_7b.yml"}
    cases = [(name, text, "passed") for name, text in shipped.items()]
    first = next(iter(readme.values()))
    assert "chat_template: auto" in first and "chat_template: true" in first
    cases.append(("README without mergekit's chat_template key", first.replace("chat_template: auto", ""),
                  "refused: surgery.domains.instruct.calibration.chat_template: the merged model's tokenizer "
                  "has no chat template"))
    cases.append(("README with a template mergekit does not have", first.replace("chat_template: auto",
                                                                                  "chat_template: llama2"),
                  "refused: config.chat_template: mergekit refuses 'llama2'"))
    cases.append(("README with auto and no chat template among its models", first.replace(
        "meta-llama/Llama-2-7b-chat-hf", "RedHatAI/Llama-2-7b-evolcodealpaca"),
        "refused: surgery.domains.instruct.calibration.chat_template: the merge's chat_template: auto finds no"))
    paper = shipped["examples/paper_llama2_7b.yml"]
    cases.append(("the paper's example with WizardMath-7B-V1.0", paper.replace(
        "RedHatAI/Llama-2-7b-gsm8k", "WizardLMTeam/WizardMath-7B-V1.0"),
        "refused: surgery.domains.math.model: expert '"))
    return cases


def test_readme_and_examples_pass_the_pre_merge_checks_against_hub_shaped_standins(standins, tmp_path):
    """Target of issue 54: a user copies the README's YAML (or an example), the Hub ids are the real
    models' shapes, and the checks before the merge pass; the edits that the real models would refuse
    are refused, each in one line naming the field."""
    root, models, datasets = standins
    cases, jobs = _variants(), []
    for index, (name, text, _) in enumerate(cases):
        config = tmp_path / f"config{index}.yml"
        config.write_text(localized(text, models, datasets))
        jobs.append([name, str(config), str(tmp_path / f"out{index}")])
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(root / "datasets-cache"),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    results = dict(json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines()
                   if line.startswith("RESULT "))
    assert len(results) == len(cases), result.stderr[-3000:]
    for name, _, expected in cases:
        assert results[name].startswith(expected), f"{name}: {results[name]}"
    assert "32001" in results["the paper's example with WizardMath-7B-V1.0"]
    assert not any((tmp_path / f"out{index}").exists() for index in range(len(cases)))  # nothing was merged


def test_every_hub_id_of_the_shipped_configs_has_a_standin():
    """The stand-ins cover every model and dataset the README and examples/ name (and nothing stale)."""
    named_models, named_datasets = set(), set()

    def walk(node, key=None):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif key in MODEL_KEYS and isinstance(node, str):
            named_models.add(node)
        elif key == "dataset" and isinstance(node, str):
            named_datasets.add(node)
    for text in {**readme_configs(), **example_configs()}.values():
        walk(yaml.safe_load(text))
    assert named_models <= set(MODELS) and named_datasets == set(DATASETS)
    assert set(MODELS) - named_models == {"WizardLMTeam/WizardMath-7B-V1.0"}  # kept for the refusal above
