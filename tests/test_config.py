"""The surgery: block schema: defaults from the paper, and errors that name their YAML path."""

import pytest

from mergekit_darts.config import SurgeryConfigError, parse_surgery_block, split_yaml

DOMAINS = {"math": {"model": "m", "calibration": {"path": "x.jsonl", "field": "question"}}}


def test_defaults_are_the_papers():
    cfg = parse_surgery_block({"domains": DOMAINS})
    assert (cfg.method, cfg.loss, cfg.rank, cfg.max_positions, cfg.steps, cfg.lr) == ("darts", "ewl1", 16, 512, 500, 1e-3)
    assert cfg.head_rank == 0 and cfg.domains["math"].calibration.samples == 50
    assert cfg.active_domain == "math"
    assert parse_surgery_block({"domains": DOMAINS, "default_domain": "none"}).active_domain == "none"


@pytest.mark.parametrize(
    "block, message",
    [
        ({"domains": DOMAINS, "rnak": 4}, "surgery.rnak: unknown key"),
        ({"domains": {"math": {"model": "m", "calibration": {"path": "x", "feild": "q"}}}},
         "surgery.domains.math.calibration.feild: unknown key"),
        ({"domains": DOMAINS, "rank": 0}, "surgery.rank:"),
        ({"domains": DOMAINS, "loss": "huber"}, "surgery.loss:"),
        ({"domains": DOMAINS, "method": "magic"}, "surgery.method:"),
        ({"domains": DOMAINS, "default_domain": "code"}, "default_domain 'code' is not a domain"),
        ({"domains": DOMAINS, "device": "gpu"}, "surgery.device: unknown device"),
        ({"domains": {}}, "surgery.domains: at least one domain"),
        ({"domains": {"my-domain": DOMAINS["math"]}}, "domain name 'my-domain'"),
        ({"domains": {"none": DOMAINS["math"]}}, "domain name 'none'"),
        ({"domains": {"math": {"model": "m", "calibration": {"path": "x", "texts": ["a"]}}}},
         "surgery.domains.math.calibration: give exactly one of"),
        ({"domains": {"math": {"model": "m", "calibration": {"samples": 5}}}}, "give exactly one of"),
        ({"domains": {"math": {"model": "m", "calibration": {"texts": ["a"], "samples": 0}}}},
         "surgery.domains.math.calibration.samples:"),
        ({"domains": {"math": {"calibration": {"texts": ["a"]}}}}, "surgery.domains.math.model: Field required"),
    ],
)
def test_errors_name_the_field(block, message):
    with pytest.raises(SurgeryConfigError) as error:
        parse_surgery_block(block)
    assert message in str(error.value)


def test_split_yaml_keeps_mergekit_part_untouched():
    merge, surgery = split_yaml("merge_method: linear\nmodels: []\nsurgery:\n  rank: 4\n")
    assert merge == {"merge_method": "linear", "models": []} and surgery == {"rank": 4}
    assert split_yaml("merge_method: linear\n")[1] is None
    with pytest.raises(SurgeryConfigError, match="mapping"):
        split_yaml("- a\n- b\n")


# issue 25 item 7: options that were accepted and silently ignored are errors naming both keys
IGNORED = [
    ({"head_rank": 4}, "head_rank together with loss"),
    ({"head_rank": 4, "loss": "l1"}, "head_rank together with loss"),
    ({"kl_target": "topk"}, "kl_target together with loss"),
    ({"kl_precision": "mixed", "loss": "ewl1"}, "kl_precision together with loss"),
    ({"kl_positions_per_step": 64}, "kl_positions_per_step together with loss"),
    ({"loss": "kl", "kl_top_k": 8}, "kl_top_k together with kl_target"),
    ({"lr": 0.01, "lr_candidates": [0.01, 0.1]}, "lr together with lr_candidates"),
    ({"eval_every": 5}, "eval_every together with early_stopping"),
    ({"patience": 2}, "patience together with early_stopping"),
    ({"validation": 0.3}, "validation together with early_stopping/lr_candidates"),
    ({"refit": False, "lr_candidates": [0.01]}, "refit together with early_stopping/lr_candidates"),
    ({"depth_rank": 4}, "depth_rank together with depth"),
    ({"router_threshold": 0.1}, "router_threshold together with router"),
    ({"router": False, "router_eval": {"texts": ["a"]}, "domains": {**DOMAINS, "code": DOMAINS["math"]}},
     "router_eval together with router"),
]


@pytest.mark.parametrize("settings, message", IGNORED, ids=[m.split(" together")[0] + f"-{i}" for i, (_, m) in enumerate(IGNORED)])
def test_ignored_option_combinations_are_errors(settings, message):
    with pytest.raises(SurgeryConfigError) as error:
        parse_surgery_block({"domains": DOMAINS, **settings})
    assert str(error.value).startswith("surgery: " + message), str(error.value)


@pytest.mark.parametrize("calibration, message", [
    ({"texts": ["a"], "field": "question"}, "'field' is not read for texts"),
    ({"texts": ["a"], "subset": "main"}, "'subset' is read only for 'dataset'"),
    ({"path": "x.jsonl", "split": "test"}, "'split' is read only for 'dataset'"),
    ({"path": "x.jsonl", "separator": "blank"}, "'separator' splits only a .txt 'path'"),
    ({"path": "x.jsonl", "field": "q", "template": "{q}"}, "'field' is not read with 'template'"),
    ({"texts": ["a"], "continue_tokens": 8, "continue_temperature": 0.7}, "'continue_temperature' is used only with"),
    ({"texts": ["a"], "synthesize_temperature": 0.7}, "'synthesize_temperature' is used only with synthesize"),
])
def test_ignored_calibration_keys_are_errors(calibration, message):
    with pytest.raises(SurgeryConfigError, match="surgery.domains.math.calibration: " + message):
        parse_surgery_block({"domains": {"math": {"model": "m", "calibration": calibration}}})


def test_the_combinations_that_are_used_stay_valid():
    cfg = parse_surgery_block({"domains": DOMAINS, "loss": "kl", "head_rank": 4, "kl_target": "topk", "kl_top_k": 8,
                               "early_stopping": True, "patience": 2, "eval_every": 5, "validation": 0.3,
                               "lr_candidates": [0.01, 0.1]})
    assert cfg.head_rank == 4 and cfg.lr_candidates == [0.01, 0.1]
    # a preset's lr gives way to lr_candidates (both written would be the error above)
    assert parse_surgery_block({"domains": DOMAINS, "preset": "best", "lr_candidates": [0.01, 0.1]}).loss == "kl"


@pytest.mark.parametrize("lr", [1.0e30, "1e30", 11.0])
def test_lr_is_bounded_and_named(lr):
    with pytest.raises(SurgeryConfigError, match=r"^surgery.lr: Input should be less than or equal to 10 \(got"):
        parse_surgery_block({"domains": DOMAINS, "lr": lr})
    with pytest.raises(SurgeryConfigError, match=r"^surgery.lr_candidates: .*<= 10"):
        parse_surgery_block({"domains": DOMAINS, "lr_candidates": [0.01, lr]})


# issue 25 item 8: YAML merge keys, which plain mergekit (yaml.safe_load) accepts
def test_yaml_merge_keys_are_expanded_and_written_keys_win():
    source = """
merge_method: linear
models: []
x-defaults: &expert
  model: /models/math
  calibration: {texts: ['a b'], samples: 1}
surgery:
  rank: 4
  domains:
    math:
      <<: *expert
    code:
      <<: *expert
      model: /models/code
"""
    merge, surgery = split_yaml(source)
    assert surgery["domains"]["math"] == {"model": "/models/math", "calibration": {"texts": ["a b"], "samples": 1}}
    assert surgery["domains"]["code"]["model"] == "/models/code"
    assert parse_surgery_block(surgery).domains["code"].calibration.samples == 1
    with pytest.raises(SurgeryConfigError, match="duplicate key 'model'"):  # written twice is still an error
        split_yaml(source.replace("      model: /models/code", "      model: /models/code\n      model: /models/x"))


# issue 25 item 2: a near miss of `surgery:` or an empty block would be a plain merge without a word
@pytest.mark.parametrize("text, message", [
    ("merge_method: linear\nsurgey:\n  rank: 4\n", "config: top-level key 'surgey' looks like a misspelled 'surgery'"),
    ("merge_method: linear\nSurgery:\n  rank: 4\n", "config: top-level key 'Surgery' looks like a misspelled"),
    ("merge_method: linear\nSURGERY:\n  rank: 4\n", "config: top-level key 'SURGERY' looks like a misspelled"),
    ("merge_method: linear\nsurgery:\n", "surgery: the block is empty"),
    ("merge_method: linear\nsurgery: {}\n", "surgery: the block is empty"),
])
def test_near_miss_and_empty_surgery_blocks_are_errors(text, message):
    from mergekit_darts.yaml_source import mentions_surgery

    with pytest.raises(SurgeryConfigError, match=message):
        split_yaml(text)
    assert mentions_surgery(text)  # the mergekit hook looks at these files at all


def test_plain_mergekit_configs_are_not_mistaken_for_surgery():
    from mergekit_darts.yaml_source import mentions_surgery

    plain = "merge_method: linear\nmodels:\n  - model: a\nsweep:\n  seeds: 2\ndtype: float16\n"
    assert not mentions_surgery(plain) and split_yaml(plain)[1] is None
