"""Family v2's pieces (benchmarks/real_weights/family_v2_tasks.py, real_family_v2.py, real_table_v2.py) on a tiny random
Llama: the new domains' generators and exact scorers, the LoRA expert merged into its weights, the
paper's merges through mergekit, the extract's share of the gap, and the resume of every stage. The
SmolLM2 build itself takes CPU-hours (benchmarks/real_weights/README.md, "Family v2")."""

import datetime
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "real_weights"))

import family_v2_tasks  # noqa: E402
import real_family  # noqa: E402
import real_family_v2  # noqa: E402
import real_table_v2  # noqa: E402
from mergekit_darts.demo import tasks  # noqa: E402
from mergekit_darts.tiny import DEFAULT_WORDS, build_tokenizer, make_random_model  # noqa: E402

DOMAINS = family_v2_tasks.DOMAINS
TRAIN = 16  # two steps of 8 chats
LINEARS = tuple(f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def weights(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def tokenizer():
    splits = [family_v2_tasks.make_splits(d, 0, train=TRAIN, calib=10, test=3) for d in DOMAINS]
    return build_tokenizer([*DEFAULT_WORDS, *tasks.vocabulary(splits)])


@pytest.fixture(scope="module")
def work(tmp_path_factory, tokenizer):
    """A tiny family v2: a random base and its five experts (two steps each), three of the merges."""
    work = str(tmp_path_factory.mktemp("family_v2"))
    make_random_model(os.path.join(work, "base"), tokenizer=tokenizer, vocab_size=len(tokenizer), hidden_size=32)
    record = real_family_v2.build_experts(work, steps={d: 2 for d in DOMAINS}, test=3, calib=10, train=TRAIN)
    assert set(record["experts"]) == set(DOMAINS)
    real_family_v2.build_merges(work, ["all5_linear", "three_ta_1.0", "all5_dare_ties_0.3"])
    return work


def test_new_domains_score_their_reference_and_nothing_else():
    for domain in family_v2_tasks.NEW_DOMAINS:
        examples = family_v2_tasks.make_splits(domain, 0, train=50, calib=10, test=40)["test"]
        right = [example["completion"] for example in examples]
        wrong = [text.rsplit(" ", 1)[0] + " 0" for text in right]  # the result replaced
        assert all(family_v2_tasks.score_completions(domain, examples, [f"  {t} " for t in right]))
        assert not any(family_v2_tasks.score_completions(domain, examples, wrong))
    instruct = tasks.make_splits("instruct", 0, train=5, calib=5, test=5)["test"]
    assert family_v2_tasks.score_completions("instruct", instruct, [e["completion"] for e in instruct]) == [True] * 5
    with pytest.raises(ValueError, match="unknown family v2 domain 'poems'"):
        family_v2_tasks.make_splits("poems")


def test_units_and_dates_references_are_right():
    """Each reference recomputed another way: python arithmetic, and datetime in a year without 29 February."""
    for example in family_v2_tasks.make_splits("units", 1, train=10, calib=10, test=200)["test"]:
        left, result = example["completion"].split(" = ")
        count, unit = result.split()
        assert eval(left) == int(count) and unit in example["prompt"].split(" to ")[1]
    months = [name for name, _ in family_v2_tasks.MONTHS]
    for example in family_v2_tasks.make_splits("dates", 1, train=10, calib=10, test=200)["test"]:
        words = example["prompt"].split()  # what date|day is N days after|before START ? answer :
        offset, sign = int(words[3]), 1 if words[5] == "after" else -1
        assert 1 <= offset <= family_v2_tasks.DATES_MAX_OFFSET
        result = example["completion"].split(" = ")[1]
        if words[1] == "day":
            start = family_v2_tasks.WEEKDAYS.index(words[6])
            assert result == family_v2_tasks.WEEKDAYS[(start + sign * offset) % 7]
            continue
        start = datetime.date(2023, months.index(words[6]) + 1, int(words[7]))
        end = start + datetime.timedelta(days=sign * offset)
        assert result == f"{months[end.month - 1]} {end.day}"


def test_splits_keep_test_and_calibration_fixed():
    for domain in family_v2_tasks.NEW_DOMAINS:
        small = family_v2_tasks.make_splits(domain, 0, train=20, calib=10, test=10)
        large = family_v2_tasks.make_splits(domain, 0, train=3000, calib=10, test=10)
        assert small["test"] == large["test"] and small["calib"] == large["calib"]
        held = {e["prompt"] for e in large["test"] + large["calib"]}
        assert len(held) == 20 and not held & {e["prompt"] for e in large["train"]}
        assert len(large["train"]) == 3000  # units has fewer distinct prompts: its train set repeats


def test_lora_expert_is_a_plain_model_that_moves_only_its_linears(work):
    files = os.listdir(os.path.join(work, "expert_dates"))
    assert "config.json" in files and "adapter_config.json" not in files  # merge_and_unload: no PEFT left
    with open(os.path.join(work, "family.json")) as handle:
        record = json.load(handle)["experts"]
    assert record["dates"]["lora"]["r"] == 16 and record["math"]["lora"] is None
    base, lora, full = weights(os.path.join(work, "base")), weights(os.path.join(work, "expert_dates")), \
        weights(os.path.join(work, "expert_units"))
    moved = {name for name in base if not torch.equal(base[name], lora[name])}
    targets = {name for name in base if name.endswith(LINEARS)}
    assert moved == targets  # every block linear of every layer, nothing else (no norm, no embedding)
    assert {name for name in base if not torch.equal(base[name], full[name])} > targets  # whole-model experts


def test_lora_finetune_resumes_from_adapter_checkpoints(work, tokenizer, tmp_path, monkeypatch):
    examples = real_family.chat_splits(tokenizer, train=8, test=2, calib=2, domains=["dates"],
                                       make_splits=family_v2_tasks.make_splits)["dates"]["train"]
    out, encode, calls = str(tmp_path / "expert"), real_family.encode_answers, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return encode(*args)

    monkeypatch.setattr(real_family, "encode_answers", interrupted)
    settings = dict(steps=3, seed=0, batch_size=2, checkpoint_every=2, lr=1e-3, lora=real_family_v2.LORA)
    with pytest.raises(KeyboardInterrupt):
        real_family.finetune_expert(os.path.join(work, "base"), tokenizer, examples, out, **settings)
    from safetensors.torch import load_file

    saved = load_file(out + ".partial/weights.safetensors")
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)  # the adapters only
    monkeypatch.setattr(real_family, "encode_answers", encode)
    progress = real_family.finetune_expert(os.path.join(work, "base"), tokenizer, examples, out, **settings)
    assert progress["resumed_at"] == [2] and len(progress["step_seconds"]) == 3
    assert not os.path.exists(out + ".partial") and "adapter_config.json" not in os.listdir(out)


def test_a_partial_build_trains_the_full_builds_experts_and_refuses_uncovered_merges(work, tmp_path):
    import shutil

    shutil.copytree(os.path.join(work, "base"), os.path.join(tmp_path, "base"))
    record = real_family_v2.build_experts(str(tmp_path), steps={d: 2 for d in DOMAINS}, test=3, calib=10,
                                          train=TRAIN, domains=("code",))
    assert set(record["experts"]) == {"code"} and not os.path.exists(os.path.join(tmp_path, "expert_math"))
    assert set(os.listdir(os.path.join(tmp_path, "data"))) == {f"{d}.json" for d in DOMAINS}
    partial, full = weights(os.path.join(tmp_path, "expert_code")), weights(os.path.join(work, "expert_code"))
    assert all(torch.equal(partial[name], full[name]) for name in full)  # the seed of its place in the family
    with pytest.raises(SystemExit, match=r"\['all5_linear'\] merge experts that --domains math,code,instruct leaves out"):
        real_family_v2.main(["--workdir", str(tmp_path), "--domains", "instruct,code,math", "--merges", "all5_linear"])
    with pytest.raises(SystemExit, match="unknown \\['poems'\\]"):
        real_family_v2.main(["--workdir", str(tmp_path), "--domains", "math,poems"])


def test_merges_are_mergekits_and_are_not_redone(work):
    import yaml

    folder = os.path.join(work, "merges")
    with open(os.path.join(folder, "all5_dare_ties_0.3.yml")) as handle:
        config = yaml.safe_load(handle)
    assert config["merge_method"] == "dare_ties" and len(config["models"]) == 5
    assert all(m["parameters"] == {"weight": 1.0, "density": 0.3} for m in config["models"])
    base = weights(os.path.join(work, "base"))
    experts = {d: weights(os.path.join(work, f"expert_{d}")) for d in DOMAINS}
    linear, arithmetic = weights(os.path.join(folder, "all5_linear")), weights(os.path.join(folder, "three_ta_1.0"))
    for name in base:
        assert torch.allclose(linear[name], sum(experts[d][name] for d in DOMAINS) / 5, atol=1e-6)
        summed = base[name] + sum(experts[d][name] - base[name] for d in real_family_v2.THREE)
        assert torch.allclose(arithmetic[name], summed, atol=1e-5)
    stamp = os.path.getmtime(os.path.join(folder, "all5_linear", "config.json"))
    real_family_v2.build_merges(work, ["all5_linear"])
    assert os.path.getmtime(os.path.join(folder, "all5_linear", "config.json")) == stamp


def test_extract_at_full_rank_gives_the_experts_block_linears(work):
    merge = os.path.join(work, "merges", "all5_linear")
    extracted = real_family_v2.extracted_model(merge, os.path.join(work, "expert_units"), rank=32).state_dict()
    expert, merged = weights(os.path.join(work, "expert_units")), weights(merge)
    for name, tensor in extracted.items():
        target = expert[name] if ".layers." in name and name.endswith("proj.weight") else merged[name]
        assert torch.allclose(tensor, target, atol=1e-5), name


def test_gap_shares():
    shares = real_family_v2.gap_shares({"a": 20, "b": 50, "c": 10}, {"a": 60, "b": 50, "c": 30}, {"a": 40, "b": 50, "c": 34})
    assert shares == {"a": 0.5, "b": None, "c": 1.2}


def test_scores_best_merges_and_the_extract_share_resume(work):
    names = ["all5_linear", "three_ta_1.0", "all5_dare_ties_0.3"]
    scores = real_family_v2.Scores(work)
    real_family_v2.score_references(work, names, scores)
    assert set(scores.data["rows"]["base"]) == set(DOMAINS) and set(scores.data["rows"]["experts"]) == set(DOMAINS)
    assert set(scores.data["rows"]["merge:three_ta_1.0"]) == set(real_family_v2.THREE)
    summary = real_family_v2.measure_extract(work, names, scores)
    assert set(summary) == {"all5", "three"} and summary["three"]["merge"] == "three_ta_1.0"
    assert set(summary["all5"]["per_method"]) == {"linear", "dare_ties"}
    assert set(summary["all5"]["extract8_share"]) == set(DOMAINS)
    reread = real_family_v2.Scores(work)  # read back from the file: nothing is scored again
    assert reread.data["best"] == json.loads(json.dumps(summary))
    assert reread.row("base", lambda: pytest.fail("a stored row was scored again")) == scores.data["rows"]["base"]


def test_extract_curve_scores_each_rank_once_with_its_size(work, monkeypatch):
    scores = real_family_v2.Scores(work)
    real_family_v2.score_references(work, ["all5_linear"], scores)
    curve = real_family_v2.measure_curve(work, "all5_linear", [1, 2], scores)
    assert set(curve) == {1, 2} and set(curve[1]["scores"]) == set(DOMAINS)
    assert scores.data["rows"]["extract2:all5_linear"] == curve[2]["scores"]
    # the size counts the two factors of every block linear: twice the rank, twice the size
    merged = weights(os.path.join(work, "merges", "all5_linear"))
    factors = sum(t.shape[0] + t.shape[1] for n, t in merged.items() if ".layers." in n and n.endswith("proj.weight"))
    from safetensors.torch import load_file

    merge_dir = os.path.join(work, "merges", "all5_linear")
    model = sum(t.numel() for name in os.listdir(merge_dir) if name.endswith(".safetensors")
                for t in load_file(os.path.join(merge_dir, name)).values())  # a tied head is stored once
    assert curve[1]["size_percent"] == round(100 * factors / model, 4)
    assert abs(curve[2]["size_percent"] - 2 * curve[1]["size_percent"]) < 1e-3
    monkeypatch.setattr(real_family_v2, "extract_scores", lambda *a, **k: pytest.fail("a rank was scored again"))
    assert real_family_v2.measure_curve(work, "all5_linear", [1, 2], real_family_v2.Scores(work))[2]["scores"] == curve[2]["scores"]
    # a rerun with fewer ranks keeps the others in scores.json's curve
    real_family_v2.measure_curve(work, "all5_linear", [2], real_family_v2.Scores(work))
    assert set(real_family_v2.Scores(work).data["curve"]["all5_linear"]) == {"1", "2"}


def test_table_declares_the_issues_rows_and_resumes(work, monkeypatch):
    rows = real_table_v2.declared_rows("all5_ta_0.5")
    assert {f"all5_ta_0.5/{key}" for key in ("standard_l1", "standard_ewl1", "darts_l1", "darts_ewl1", "darts_kl",
                                              "extract_r1", "extract_r4", "extract_r8", "extract_r16", "extract_r64",
                                              "preset", "preset_synth")} <= set(rows)
    assert {"three_linear/darts_ewl1", "three_linear/extract_r8", "three_linear/preset"} <= set(rows)
    assert len(rows) == len(real_table_v2.REPAIRS) + len(real_table_v2.OTHER_MERGE_ROWS) * (len(real_family_v2.MERGES) - 1)
    assert real_table_v2.declared_rows("all5_ta_0.5", seed=3) == [
        "all5_ta_0.5/standard_l1", "all5_ta_0.5/darts_ewl1", "all5_ta_0.5/preset"]
    table = real_table_v2.run(work, ["three_ta_1.0/extract_r8"])
    assert set(table["rows"]["three_ta_1.0/extract_r8"]) == set(real_family_v2.THREE)
    assert table["reports"]["three_ta_1.0/extract_r8"]["math"]["baseline"]["rank"] == 8
    import mergekit_darts.pipeline

    monkeypatch.setattr(mergekit_darts.pipeline, "run_surgery", lambda *a, **k: pytest.fail("a row ran again"))
    assert real_table_v2.run(work, ["three_ta_1.0/extract_r8"])["rows"] == table["rows"]
    text = real_table_v2.markdown(work, table)
    assert "three_ta_1.0: Data-free extract, rank 8 in every block" in text and "| base |" in text

    # the size-quality picture from the same work folder: the row's size and each expert's share kept
    import size_quality

    found = size_quality.points(real_family_v2.Scores(work).data, table, "three_ta_1.0")
    assert [p["row"] for p in found] == ["plain merge", "extract_r8"]
    curve_points = size_quality.points(real_family_v2.Scores(work).data, table, "all5_linear")
    assert [p["row"] for p in curve_points] == ["plain merge", "extract r1 (curve)", "extract r2 (curve)"]
    experts, repaired = real_family_v2.Scores(work).data["rows"]["experts"], table["rows"]["three_ta_1.0/extract_r8"]
    assert found[1]["kept"] == {d: round(repaired[d] / experts[d], 3) for d in repaired if experts[d]}
    assert found[1]["size_percent"] == table["size_percent"]["three_ta_1.0/extract_r8"]
    assert all(0 < size < 100 for size in found[1]["size_percent"].values())
    picture = os.path.join(work, "size_quality.png")
    size_quality.main(["--workdir", str(work), "--merge", "three_ta_1.0", "--out", picture])
    with open(picture, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_row_can_repair_some_of_its_merges_domains(work):
    """--domains math: the surgery trains math alone (its own default: routing needs two domains) and scores
    math alone, under the row's key with [math]; a domain the merge lacks stops the run."""
    table = real_table_v2.run(work, ["three_ta_1.0/extract_r1"], table_name="only.json", only=["math"])
    key = "three_ta_1.0/extract_r1[math]"
    assert list(table["rows"]) == [key]
    assert set(table["rows"][key]) == {"math"} and set(table["size_percent"][key]) == {"math"}
    assert set(table["reports"][key]) - {"surgery_seconds", "settings", "stages"} == {"math"}
    assert table["labels"][key].endswith("(math only)")
    with open(os.path.join(work, "repaired_three_ta_1.0", "darts_report.json")) as handle:
        assert set(json.load(handle)["domains"]) == {"math"}
    with pytest.raises(SystemExit, match="units"):
        real_table_v2.run(work, ["three_ta_1.0/extract_r1"], table_name="only.json", only=["units"])


def test_one_command_builds_the_family_first_then_the_rows(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(real_family_v2, "main", lambda argv: calls.append(("family", argv)))
    monkeypatch.setattr(real_table_v2, "run", lambda workdir, rows, seed, table, only: calls.append(("rows", rows, only))
                        or {"rows": {}, "labels": {}, "seconds": {}})
    monkeypatch.setattr(real_table_v2, "markdown", lambda workdir, table: "")
    real_table_v2.main(["--workdir", str(tmp_path), "--build", "--rows", "all5_linear/extract_r8"])
    assert calls == [("family", ["--workdir", str(tmp_path), "--threads", "2"]),
                     ("rows", ["all5_linear/extract_r8"], None)]
    calls.clear()
    real_table_v2.main(["--workdir", str(tmp_path), "--rows", "all5_linear/extract_r8", "--domains", "math,units"])
    assert calls == [("rows", ["all5_linear/extract_r8"], ["math", "units"])]
    # without a best merge in scores.json, naming the rows is enough; the default rows need it, and say so
    calls.clear()
    with pytest.raises(SystemExit, match="no best five-expert merge"):
        real_table_v2.main(["--workdir", str(tmp_path)])


def test_seed_summary_pairs_the_papers_rows_over_seed_tables(tmp_path):
    """table_v2.json is seed 0, table_v2_seedN.json seed N; a row missing from a seed is not counted."""
    domains = real_family_v2.DOMAINS
    for seed in range(4):
        rows = {"m/standard_l1": {d: 50.0 + seed for d in domains}, "m/darts_ewl1": {d: 10.0 + seed for d in domains}}
        if seed == 3:
            del rows["m/darts_ewl1"]
        name = "table_v2.json" if seed == 0 else f"table_v2_seed{seed}.json"
        (tmp_path / name).write_text(json.dumps({"rows": rows, "cpu_seconds": {"m/standard_l1": 100 + seed}}))
    (tmp_path / "table_v2_seedx.json").write_text("not a table")
    summary = real_table_v2.seed_summary(str(tmp_path), "m")
    assert summary["rows"]["standard_l1"]["seeds"] == [0, 1, 2, 3]
    assert summary["rows"]["darts_ewl1"]["seeds"] == [0, 1, 2]
    assert summary["rows"]["standard_l1"]["mean"][domains[0]] == 51.5
    assert summary["rows"]["standard_l1"]["cpu_seconds"] == [100, 101, 102, 103]
    p = summary["mann_whitney"]["by_domain"][domains[0]]["p"]
    assert p == pytest.approx(2 / 35)  # 4 against 3, fully separated: the exact two-sided p
    text = real_table_v2.seed_markdown(summary)
    assert "| standard_l1 | 4 | 51.5 (50–53)" in text and "Mann–Whitney p" in text


def test_seed_summary_of_a_three_expert_merge_reads_its_own_domains(tmp_path):
    domains = real_family_v2.MERGES["three_linear"][0]
    assert len(domains) < len(real_family_v2.DOMAINS)
    for seed in range(3):
        rows = {f"three_linear/{key}": {d: 10.0 * seed + i for i, d in enumerate(domains)}
                for key in ("standard_l1", "darts_ewl1")}
        (tmp_path / ("table_v2.json" if seed == 0 else f"table_v2_seed{seed}.json")).write_text(json.dumps({"rows": rows}))
    summary = real_table_v2.seed_summary(str(tmp_path), "three_linear")
    assert summary["domains"] == list(domains)
    assert set(summary["rows"]["darts_ewl1"]["mean"]) == set(domains)
    assert summary["rows"]["darts_ewl1"]["mean"][domains[1]] == 11.0
    assert set(summary["mann_whitney"]["by_domain"]) == set(domains)
    text = real_table_v2.seed_markdown(summary)
    assert text.splitlines()[0] == "| row | seeds | " + " | ".join(domains) + " |"
