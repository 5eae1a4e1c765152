"""Every check of issue 14 that must stop a run BEFORE mergekit merges anything: each one a one-line
error naming the field (or, for the expert that is the output itself, a warning).

In-process through ``pipeline.merge_and_repair`` with a ``run_merge`` that records calls (the checks
must leave it uncalled); one case runs the real ``mergekit-yaml`` to show the user sees one line.
"""

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import merge_yaml
from mergekit_darts.errors import DartsError

BIN = Path(sys.executable).parent


def _block(paths, tmp_path, domains_yaml=None, **settings):
    base = dict(rank=4, max_positions=32, steps=5, lr=0.01, cache_dir=str(tmp_path / "cache"))
    base.update(settings)
    lines = ["surgery:"] + [f"  {k}: {v}" for k, v in base.items()]
    lines += ["  domains:"] + (domains_yaml or [
        "    math:",
        f"      model: {paths['math']}",
        "      calibration: {texts: ['what is 3 plus 4 ?', 'how many apples are left ?']}",
        "    code:",
        f"      model: {paths['code']}",
        "      calibration: {texts: ['def sum list', 'write a python function']}",
    ])
    return merge_yaml(paths) + "\n".join(lines) + "\n"


def _fails_before_merge(source: str, out) -> str:
    """The run's error message; asserts mergekit was never called and nothing was written."""
    from mergekit_darts.pipeline import merge_and_repair

    calls = []
    with pytest.raises(DartsError) as info:
        merge_and_repair(source, str(out), lambda *args: calls.append(args))
    assert calls == [], "run_merge was called before the check"
    message = str(info.value)
    assert "\n" not in message
    assert not Path(out).exists() or Path(out) == Path("/sys")
    return message


@pytest.fixture(scope="module")
def odd_experts(tiny_family, tmp_path_factory):
    """A Mistral expert and a Llama expert with a shuffled tokenizer, both of the family's sizes."""
    from transformers import AutoConfig

    from mergekit_darts.tiny import DEFAULT_WORDS, build_tokenizer, make_random_model

    root = tmp_path_factory.mktemp("odd")
    reference = AutoConfig.from_pretrained(tiny_family["base"])
    sizes = dict(hidden_size=reference.hidden_size, vocab_size=reference.vocab_size)
    make_random_model(str(root / "mistral"), arch="mistral", **sizes)
    words = list(DEFAULT_WORDS)
    random.Random(0).shuffle(words)
    make_random_model(str(root / "shuffled"), tokenizer=build_tokenizer(words), **sizes)
    return {"mistral": str(root / "mistral"), "shuffled": str(root / "shuffled")}


@pytest.mark.parametrize("settings, field", [
    (dict(seed="1e25"), "surgery.seed"),
    (dict(seed=10**25), "surgery.seed"),
    (dict(rank=1000000000), "surgery.rank"),
    (dict(max_positions=1000000000), "surgery.max_positions"),
    (dict(rank=64), "surgery.rank"),  # above the tiny models' hidden size 32
    (dict(rank="true"), "surgery.rank"),
    (dict(steps="yes"), "surgery.steps"),
    (dict(lr="true"), "surgery.lr"),
], ids=["seed-1e25-string", "seed-1e25-int", "rank-1e9", "max_positions-1e9", "rank-above-hidden", "rank-true",
        "steps-yes", "lr-true"])
def test_bad_numbers_are_errors(tiny_family, tmp_path, settings, field):
    message = _fails_before_merge(_block(tiny_family, tmp_path, **settings), tmp_path / "out")
    assert message.startswith(field), message


def _with_continuations(tokens, max_positions=None):
    def edit(source):
        source = source.replace("'how many apples are left ?']}", f"'how many apples are left ?'], continue_tokens: {tokens}}}")
        return source if max_positions is None else source.replace("  max_positions: 32\n", max_positions)
    return edit


@pytest.mark.parametrize("settings, edit, expected", [
    (dict(steps=0, early_stopping="true"), None, "surgery: early_stopping together with steps: 0: nothing is trained"),
    (dict(steps=0, lr_candidates="[0.01, 0.1]"), lambda source: source.replace("  lr: 0.01\n", ""),
     "surgery: lr_candidates together with steps: 0"),
    (dict(steps=0), _with_continuations(32), "surgery.domains.math.calibration.continue_tokens: 32 leaves no room "
     "for a prompt under max_positions 32 (prompt and continuation share those positions: at most 31"),
    # not written: the tiny models' context (256), not the default 512, is what the run would use
    (dict(), _with_continuations(300, ""), "surgery.domains.math.calibration.continue_tokens: 300 leaves no room for a prompt under max_positions 256 "
     "(not written: the merged model's max_position_embeddings)"),
], ids=["steps-0-early-stopping", "steps-0-lr-candidates", "continue-tokens-written-max", "continue-tokens-model-max"])
def test_settings_that_would_be_ignored_or_capped_are_errors(tiny_family, tmp_path, settings, edit, expected):
    """Issue 46 item 8: accepted before, they "chose" between identical runs or were cut without a word."""
    source = _block(tiny_family, tmp_path, **settings)
    message = _fails_before_merge(edit(source) if edit else source, tmp_path / "out")
    assert message.startswith(expected), message


def test_the_longest_continuation_that_fits_is_accepted(tiny_family, tmp_path):
    from mergekit.config import MergeConfiguration

    from mergekit_darts.config import parse_surgery_block, split_yaml
    from mergekit_darts.preflight import check_before_merge
    from mergekit_darts.settings import RunSettings

    source = _with_continuations(31)(_block(tiny_family, tmp_path))
    merge_part, raw = split_yaml(source)
    surgery = parse_surgery_block(raw)
    check_before_merge(surgery, MergeConfiguration.model_validate(merge_part), RunSettings.resolve(surgery))


def test_device_that_is_not_there(tiny_family, tmp_path):
    device = "cuda:99" if torch.cuda.is_available() else "cuda"
    message = _fails_before_merge(_block(tiny_family, tmp_path, device=device), tmp_path / "out")
    assert message.startswith("surgery.device") and "CUDA" in message


def test_duplicate_domain_keys(tiny_family, tmp_path):
    domains = ["    math:", f"      model: {tiny_family['math']}", "      calibration: {texts: ['a b']}",
               "    math:", f"      model: {tiny_family['code']}", "      calibration: {texts: ['c d']}"]
    message = _fails_before_merge(_block(tiny_family, tmp_path, domains_yaml=domains), tmp_path / "out")
    assert "duplicate key 'math'" in message


@pytest.mark.parametrize("name", ["keys", "forward", "items", "training", "_modules"])
def test_domain_names_that_nn_moduledict_refuses(tiny_family, tmp_path, name):
    domains = [f"    {name}:", f"      model: {tiny_family['math']}", "      calibration: {texts: ['a b']}"]
    message = _fails_before_merge(_block(tiny_family, tmp_path, domains_yaml=domains), tmp_path / "out")
    assert message.startswith("surgery.domains") and repr(name) in message
    with pytest.raises(KeyError):  # what the emitted model would hit at load time
        torch.nn.ModuleDict({name: torch.nn.Linear(1, 1)})


def _with_expert(source: str, old: str, new: str) -> str:
    """``source`` with the surgery block's expert ``old`` replaced (the merge part keeps its models)."""
    merge, surgery = source.split("surgery:\n")
    return merge + "surgery:\n" + surgery.replace(f"model: {old}", f"model: {new}")


def test_expert_of_another_architecture(tiny_family, odd_experts, tmp_path):
    source = _with_expert(_block(tiny_family, tmp_path), tiny_family["code"], odd_experts["mistral"])
    message = _fails_before_merge(source, tmp_path / "out")
    assert message.startswith("surgery.domains.code.model") and "MistralForCausalLM" in message


def test_expert_with_another_tokenizer(tiny_family, odd_experts, tmp_path):
    source = _with_expert(_block(tiny_family, tmp_path), tiny_family["code"], odd_experts["shuffled"])
    message = _fails_before_merge(source, tmp_path / "out")
    assert message.startswith("surgery.domains.code.model") and "tokenizer" in message


def _with_writer(paths, tmp_path, writer):
    domains = ["    math:", f"      model: {paths['math']}",
               "      calibration: {texts: ['what is 3 plus 4 ?', 'how many apples are left ?'], "
               f"synthesize: 4, synthesize_writer: {writer}}}"]
    return _block(paths, tmp_path, domains_yaml=domains)


def test_synthesize_writer_is_checked_before_the_merge(tiny_family, odd_experts, tmp_path):
    message = _fails_before_merge(_with_writer(tiny_family, tmp_path, odd_experts["shuffled"]), tmp_path / "out")
    assert message.startswith("surgery.domains.math.calibration.synthesize_writer") and "tokenizer" in message
    message = _fails_before_merge(_with_writer(tiny_family, tmp_path, tmp_path / "nowhere"), tmp_path / "out")
    assert message.startswith("surgery.domains.math.calibration.synthesize_writer: no such directory"), message


def test_synthesize_beyond_what_it_would_cost_is_refused_before_the_merge(tiny_family, tmp_path):
    """Issue 34: ``synthesize: 10000000`` (the schema's maximum) on 8 prompts passed the checks, then grew
    to 4.9 GB with no output. 8 prompts, held_out 0.2: 6 train, so at most 600."""
    import yaml

    from mergekit_darts.config import SurgeryConfig
    from mergekit_darts.preflight import check_synthesis_cost

    texts = [f"question {i} : what is {i} plus {i} ?" for i in range(8)]

    def domains(synthesize):
        return ["    math:", f"      model: {tiny_family['math']}",
                f"      calibration: {{texts: {texts}, synthesize: {synthesize}}}"]

    message = _fails_before_merge(_block(tiny_family, tmp_path, domains_yaml=domains(10_000_000)), tmp_path / "out")
    assert message.startswith("surgery.domains.math.calibration.synthesize: 10000000 prompts from 6 training "), message
    assert "(600 here)" in message and "lower it or give more calibration prompts" in message
    for synthesize, refused in ((600, False), (601, True), (0, False)):
        source = yaml.safe_load(_block(tiny_family, tmp_path, domains_yaml=domains(synthesize)))["surgery"]
        surgery = SurgeryConfig.model_validate(source)
        if refused:
            with pytest.raises(DartsError, match="calibration.synthesize: 601 prompts"):
                check_synthesis_cost(surgery, {"math": 8})
        else:
            check_synthesis_cost(surgery, {"math": 8})


def _calibration_file(tmp_path, values):
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps({"question": value}) + "\n" for value in values))
    return path


@pytest.mark.parametrize("kind", ["empty texts", "null records", "unencodable records"])
def test_calibration_texts_that_give_nothing(tiny_family, tmp_path, kind):
    if kind == "empty texts":
        calibration = "{texts: ['', '   ']}"
    else:
        values = [None, None, None] if kind == "null records" else ["\ud800", "\udfff \ud800"]
        calibration = f"{{path: {_calibration_file(tmp_path, values)}, field: question}}"
    domains = ["    math:", f"      model: {tiny_family['math']}", f"      calibration: {calibration}"]
    message = _fails_before_merge(_block(tiny_family, tmp_path, domains_yaml=domains), tmp_path / "out")
    assert message.startswith("surgery.domains.math.calibration"), message


def test_read_only_output_directory(tiny_family, tmp_path):
    if os.geteuid() == 0:  # permissions do not bind root: a read-only file system does (sysfs)
        read_only, out = Path("/sys"), Path("/sys/darts-out")
    else:
        read_only = tmp_path / "locked"
        read_only.mkdir()
        read_only.chmod(0o555)
        out = read_only / "out"
    try:
        message = _fails_before_merge(_block(tiny_family, tmp_path), out)
    finally:
        if read_only != Path("/sys"):
            read_only.chmod(0o755)
    assert message.startswith("output directory") and str(read_only) in message and not out.exists()


def _digest(path) -> dict:
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): p.read_bytes() for p in files}


def _refused_before_merge(source: str, out, watched) -> str:
    """The run's error; asserts mergekit was never called and ``watched`` (an input) is byte for byte
    as it was."""
    from mergekit_darts.pipeline import merge_and_repair

    before = _digest(watched)
    calls = []
    with pytest.raises(DartsError) as info:
        merge_and_repair(source, str(out), lambda *args: calls.append(args))
    assert calls == [] and _digest(watched) == before
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture
def family_copy(tiny_family, tmp_path):
    """The family's base, math and code models copied into tmp_path/models (tests point outputs at them)."""
    import shutil

    root = tmp_path / "models"
    paths = {name: str(shutil.copytree(tiny_family[name], root / name)) for name in ("base", "math", "code")}
    return paths


@pytest.mark.parametrize("target", ["base by relative path", "base by symlink", "expert", "expert by symlink",
                                    "parent of the calibration file", "parent of the cache", "synthesize writer"])
def test_output_that_is_an_input_is_refused(family_copy, tmp_path, monkeypatch, target):
    """Issue 25 item 1: writing over base_model replaced it silently, over an expert after one warning."""
    paths = family_copy
    calibration = tmp_path / "data" / "math.txt"
    calibration.parent.mkdir()
    calibration.write_text("what is 3 plus 4 ?\nhow many apples are left ?\n")
    domains = ["    math:", f"      model: {paths['math']}", f"      calibration: {{path: {calibration}}}"]
    source = _block(paths, tmp_path, domains_yaml=domains)
    monkeypatch.chdir(tmp_path)
    if target == "base by relative path":
        out, watched, field = "models/./base", paths["base"], "base_model"
    elif target == "base by symlink":
        os.symlink(paths["base"], tmp_path / "link")
        out, watched, field = tmp_path / "link", paths["base"], "base_model"
    elif target == "expert":
        out, watched, field = paths["math"], paths["math"], "surgery.domains.math.model"
    elif target == "expert by symlink":
        os.symlink(paths["math"], tmp_path / "link")
        out, watched, field = "link", paths["math"], "surgery.domains.math.model"
    elif target == "parent of the calibration file":
        out, watched, field = tmp_path / "data", calibration, "surgery.domains.math.calibration.path"
    elif target == "synthesize writer":  # prompts written by another model: an input too
        writer = str(Path(paths["base"]).parent / "writer")
        import shutil

        shutil.copytree(paths["base"], writer)
        source = source.replace(f"calibration: {{path: {calibration}}}",
                                f"calibration: {{path: {calibration}, synthesize: 2, synthesize_writer: {writer}}}")
        out, watched, field = writer, writer, "surgery.domains.math.calibration.synthesize_writer"
    else:  # the capture cache would be deleted with the folder's old contents
        (tmp_path / "runs").mkdir()
        (tmp_path / "runs" / "notes.txt").write_text("kept")
        source = source.replace(f"cache_dir: {tmp_path / 'cache'}", f"cache_dir: {tmp_path / 'runs' / 'cache'}")
        out, watched, field = tmp_path / "runs", tmp_path / "runs", "surgery.cache_dir"
    message = _refused_before_merge(source, out, watched)
    assert message.startswith("output directory") and field in message and "choose another output" in message


def test_expert_that_is_the_merged_directory_is_refused_in_place(family_copy, tmp_path):
    from mergekit_darts.pipeline import run_surgery

    source = _block(family_copy, tmp_path)
    before = _digest(family_copy["code"])
    with pytest.raises(DartsError, match=r"merged model directory .* is surgery.domains.code.model"):
        run_surgery(source, family_copy["code"])
    assert _digest(family_copy["code"]) == before


def test_output_on_a_mount_point_is_refused(tiny_family, tmp_path, monkeypatch):
    """A mount point cannot be swapped with its staging sibling: refused before the merge, not after it
    (mounting needs privileges a test does not have: os.path.ismount answers for the folder)."""
    out = tmp_path / "mnt"
    out.mkdir()
    (out / "keep.txt").write_text("the mount's own file")
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: str(path) == str(out) or real_ismount(path))
    message = _refused_before_merge(_block(tiny_family, tmp_path), out, out)
    assert message.startswith("output directory") and "mount point" in message and "inside it" in message


@pytest.fixture(scope="module")
def odd_bases(tiny_family, tmp_path_factory):
    """The family's base without its chat template, and without any tokenizer files."""
    import shutil

    root = tmp_path_factory.mktemp("bases")
    plain = shutil.copytree(tiny_family["base"], root / "no-chat-template")
    (plain / "chat_template.jinja").unlink()
    bare = shutil.copytree(tiny_family["base"], root / "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bare / name).unlink()
    renamed = {}
    for name in ("base", "math", "code"):  # a family whose architecture mergekit merges but Darts does not wrap
        renamed[name] = str(shutil.copytree(tiny_family[name], root / "starcoder2" / name))
        config = json.loads((Path(renamed[name]) / "config.json").read_text())
        (Path(renamed[name]) / "config.json").write_text(json.dumps({**config, "architectures": ["Starcoder2ForCausalLM"]}))
    return {"no chat template": str(plain), "no tokenizer": str(bare), "unwrapped architecture": renamed}


def _records(tmp_path, values, name="records.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"question": value}) + "\n" for value in values))
    return path


LATE_FAILURES = {  # issue 25 item 6 (and 2, 11): each used to pass these checks and fail after the merge, or never
    "near-miss key surgey": (lambda s, p, t, b: s.replace("surgery:\n", "surgey:\n"), "config: top-level key 'surgey'"),
    "near-miss key Surgery": (lambda s, p, t, b: s.replace("surgery:\n", "Surgery:\n"), "config: top-level key 'Surgery'"),
    "empty surgery block": (lambda s, p, t, b: merge_yaml(p) + "surgery:\n", "surgery: the block is empty"),
    "list field value": (lambda s, p, t, b: _one_domain(s, p, f"{{path: {_records(t, [['a', 'b'], 'x'])}, field: question}}"),
                         "surgery.domains.math.calibration.field: record 1"),
    "integer field value": (lambda s, p, t, b: _one_domain(s, p, f"{{path: {_records(t, ['what is 3', 42])}, field: question}}"),
                            "surgery.domains.math.calibration.field: record 2"),
    "template attribute access": (
        lambda s, p, t, b: _one_domain(s, p, f"{{path: {_records(t, ['x'])}, template: '{{question.__class__.__mro__}}'}}"),
        "surgery.domains.math.calibration.template: placeholder {question.__class__.__mro__} is not a plain"),
    "template format spec": (
        lambda s, p, t, b: _one_domain(s, p, f"{{path: {_records(t, ['x'])}, template: '{{question:>1000000000000}}'}}"),
        "surgery.domains.math.calibration.template: placeholder {question:>1000000000000} is not a plain"),
    "calibration path is a directory": (lambda s, p, t, b: _one_domain(s, p, f"{{path: {t}}}"), "is a directory"),
    "all texts out of vocabulary": (lambda s, p, t, b: _one_domain(s, p, "{texts: ['zzz qqq', 'xyzzy plugh']}"),
                                    "surgery.domains.math.calibration: none of the 2 texts has a token"),
    "chat_template on a tokenizer without one": (
        lambda s, p, t, b: _one_domain(s.replace(p["base"], b["no chat template"]), p,
                                       "{texts: ['what is 3 plus 4 ?'], chat_template: true}"),
        "surgery.domains.math.calibration.chat_template: the merged model's tokenizer has no chat template"),
    "base model without a tokenizer": (lambda s, p, t, b: s.replace(p["base"], b["no tokenizer"]),
                                       "base_model: no tokenizer can be loaded"),
    "architecture Darts does not wrap": (
        lambda s, p, t, b: s.replace(p["base"], b["unwrapped architecture"]["base"]).replace(
            p["math"], b["unwrapped architecture"]["math"]).replace(p["code"], b["unwrapped architecture"]["code"]),
        "surgery: the merged model"),
    "depth beyond the layer count": (lambda s, p, t, b: s.replace("  domains:", "  depth: 3\n  domains:"),
                                     "surgery.depth: 3 exceeds the merged model's 2 decoder layers"),
    # issue 35 item 7: a block adapter rank beyond the hidden size (was accepted, then both domains got worse),
    # a preset's rank named as the preset's, a writer without tokenizer files (failed after the merge)
    "depth_rank beyond the hidden size": (lambda s, p, t, b: s.replace("  domains:", "  depth: 1\n  depth_rank: 999\n  domains:"),
                                          "surgery.depth_rank: 999 exceeds the merged model's hidden size"),
    # a preset fits the model itself (tests/test_preset_fit.py); a rank written beside it is still checked
    "preset best with a written rank too large": (
        lambda s, p, t, b: s.replace("  rank: 4\n", "  preset: best\n  rank: 64\n").replace("  lr: 0.01\n", ""),
        "surgery.rank: 64 exceeds the merged model's hidden size"),
    "synthesize_writer without tokenizer files": (
        lambda s, p, t, b: _with_writer(p, t, b["no tokenizer"]),
        "surgery.domains.math.calibration.synthesize_writer: no tokenizer can be loaded from"),
    "lr 1e30": (lambda s, p, t, b: s.replace("lr: 0.01", "lr: 1.0e30"), "surgery.lr: Input should be less than"),
    "lr_candidates with too few prompts": (
        lambda s, p, t, b: s.replace("lr: 0.01", "lr_candidates: [0.01, 0.1]"), "surgery.lr_candidates: domain math has 2"),
    "early_stopping with too few prompts": (
        lambda s, p, t, b: s.replace("  domains:", "  early_stopping: true\n  domains:"), "surgery.early_stopping: domain"),
    # mergekit's own validation runs first: a surgery error (rank 0) in the same file is not the one reported
    "merge_method nonsense": (lambda s, p, t, b: s.replace("task_arithmetic", "nonsense").replace("rank: 4", "rank: 0"),
                              "config.merge_method: mergekit has no merge method 'nonsense'; choose one of"),
    "no models": (lambda s, p, t, b: "\n".join(line for line in s.splitlines() if not line.startswith(("models:", "  - model", "    param"))) + "\n",
                  "config: mergekit refuses the merge part: Exactly one of 'models', 'slices', or 'modules'"),
}


def _one_domain(source, paths, calibration):
    """``source`` with a single math domain calibrated by ``calibration`` (YAML flow mapping)."""
    head = source.split("  domains:")[0]
    return head + f"  domains:\n    math:\n      model: {paths['math']}\n      calibration: {calibration}\n"


@pytest.mark.parametrize("case", list(LATE_FAILURES))
def test_late_failures_are_checked_before_merge(tiny_family, odd_bases, tmp_path, case):
    edit, expected = LATE_FAILURES[case]
    message = _fails_before_merge(edit(_block(tiny_family, tmp_path), tiny_family, tmp_path, odd_bases), tmp_path / "out")
    assert message.startswith(expected) or expected in message, message


def test_huge_single_line_text_is_cut_before_tokenizing(tiny_family, tmp_path):
    """Issue 25 item 9: a 30 MB single-line record took minutes and GBs per tokenization; only what
    max_positions can use is tokenized, and the tokens capture keeps are the same."""
    from mergekit.config import MergeConfiguration
    from transformers import AutoTokenizer

    from mergekit_darts.pipeline import parse_config_source
    from mergekit_darts.preflight import check_before_merge
    from mergekit_darts.settings import RunSettings

    line = "what is 3 plus 4 ? " * 1_600_000  # ~30 MB, one line
    path = tmp_path / "huge.txt"
    path.write_text(line + "\nhow many apples are left ?\n")
    source = _one_domain(_block(tiny_family, tmp_path), tiny_family, f"{{path: {path}}}")
    merge_part, surgery = parse_config_source(source)
    texts = check_before_merge(surgery, MergeConfiguration.model_validate(merge_part), RunSettings.resolve(surgery))
    cut = next(text for text in texts["math"] if text.startswith("what"))
    assert len(cut) < 100_000, len(cut)  # max_positions 32: a few thousand characters at most
    tokenizer = AutoTokenizer.from_pretrained(tiny_family["base"])
    ids = tokenizer(cut)["input_ids"]
    assert len(ids) > surgery.max_positions  # still counted as truncated by capture
    assert ids[:surgery.max_positions] == tokenizer(line[:100_000])["input_ids"][:surgery.max_positions]


def test_mergekit_yaml_near_miss_and_invalid_merge_are_one_line(tiny_family, tmp_path):
    """Through the real mergekit-yaml: a misspelled block (the hook must look at it at all) and mergekit's
    own schema error (mergekit-yaml raises it before run_merge), each one line, nothing written. (The
    other checks run in merge_and_repair, the same path as the CUDA case below.)"""
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    source = _block(tiny_family, tmp_path)
    cases = {
        "surgey": (source.replace("surgery:\n", "surgey:\n"), "config: top-level key 'surgey'"),
        "no models": (LATE_FAILURES["no models"][0](source, tiny_family, tmp_path, None), "Exactly one of 'models'"),
    }
    running = {}
    for name, (text, _) in cases.items():  # side by side: each run is mostly start-up (imports)
        cfg = tmp_path / f"{name.replace(' ', '_')}.yml"
        cfg.write_text(text)
        out = tmp_path / f"out-{name.replace(' ', '_')}"
        running[name] = (out, subprocess.Popen(
            [str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}))
    for name, (out, process) in running.items():
        _, stderr = process.communicate(timeout=600)
        errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
        assert process.returncode == 2 and len(errors) == 1 and cases[name][1] in errors[0], (name, stderr[-2000:])
        assert "Traceback" not in stderr and not out.exists(), name
    assert not any(name.startswith(".darts-staging-") for name in os.listdir(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_mergekit_yaml_reports_missing_cuda_in_one_line_before_merging(tiny_family, tmp_path):
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(_block(tiny_family, tmp_path, device="cuda"))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_DARTS_DISABLE"}
    result = subprocess.run([str(BIN / "mergekit-yaml"), str(cfg), str(out)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "surgery.device" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not out.exists()
    assert not any(name.startswith(".darts-staging-") for name in os.listdir(tmp_path))


def test_mistyped_local_model_paths_name_the_field_and_the_nearest_folder(tiny_family, tmp_path, monkeypatch):
    """Issue 35 item 1: `model: tiny_family/cod` went to the Hub ("couldn't connect to huggingface.co",
    32 s offline) and an absolute one to "Repo id must be in the form ..."; both are one line naming
    the field, the path and the existing sibling, before mergekit starts."""
    root, code = os.path.dirname(tiny_family["code"]), tiny_family["code"]
    family = os.path.basename(root)
    monkeypatch.chdir(os.path.dirname(root))
    source = _block(tiny_family, tmp_path)
    relative = source.replace(f"  - model: {code}\n", f"  - model: {family}/cod\n")
    message = _fails_before_merge(relative, tmp_path / "out")
    assert message == f"models[1].model: no such directory '{family}/cod' (did you mean '{family}/code'?)", message
    absolute = source.replace(f"  - model: {code}\n", f"  - model: {code[:-1]}\n")
    message = _fails_before_merge(absolute, tmp_path / "out")
    assert message == f"models[1].model: no such directory '{code[:-1]}' (did you mean '{code}'?)", message
    base = source.replace(f"base_model: {tiny_family['base']}", "base_model: ./nowhere/base")
    assert _fails_before_merge(base, tmp_path / "out") == "base_model: no such directory './nowhere/base'"
    expert = source.replace(f"      model: {code}\n", f"      model: {family}/cod\n")
    message = _fails_before_merge(expert, tmp_path / "out")
    assert message == f"surgery.domains.code.model: no such directory '{family}/cod' (did you mean '{family}/code'?)"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub id (no folder `someorg` here) still goes to mergekit/the Hub
    hub = source.replace(f"  - model: {code}\n", "  - model: someorg/some-model\n")
    message = _fails_before_merge(hub, tmp_path / "out")
    assert "no such directory" not in message and message.startswith("config: mergekit refuses the merge part"), message


def test_local_paths_and_hub_ids_are_told_apart(tmp_path, monkeypatch):
    from mergekit_darts.model_paths import looks_local, missing_local_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "family" / "code").mkdir(parents=True)
    (tmp_path / "weights.bin").write_text("x")
    assert [looks_local(p) for p in ("gpt2", "meta-llama/Llama-2-7b-hf", "family/cod", "./x", "../x", "/x", "~/x")] == \
        [False, False, True, True, True, True, True]
    assert missing_local_model("family/code") is None and missing_local_model("org/name") is None
    assert missing_local_model("family/cde") == "no such directory 'family/cde' (did you mean 'family/code'?)"
    assert missing_local_model("./weights.bin").startswith("'./weights.bin' is not a directory")
