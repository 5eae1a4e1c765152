"""Darts*ForCausalLM as users load it: remote code, generate with a KV cache, lm-eval (docs/design.md §2, §5).

Every Darts directory here is a tiny plain model plus random (non-trivial) surgery modules written by
export_surgery, and every expectation is an independent manual computation on the plain model.
"""

import json
import os
import shutil

import pytest
import torch

from helpers import realistic_padding
from mergekit_darts.output.export import export_surgery
from mergekit_darts.remote_code.surgery import DomainSurgery
from mergekit_darts.tiny import make_random_model

PAD = 2  # every fixture pads with eos, whose embedding row is not zero (helpers.realistic_padding)
MAX_POSITIONS = 6  # small, so test sequences also cover positions without a position correction
PROMPTS = ["how many apples are left", "def sum ( a , b ) : return a + b", "write a python function"]


def random_modules(config, domains=("math", "code"), head_rank=0, method="darts", seed=0):
    """One DomainSurgery per domain with every parameter random, so each correction is visible."""
    torch.manual_seed(seed)
    modules = {}
    for name in domains:
        module = DomainSurgery(config["hidden_size"], rank=4, max_positions=MAX_POSITIONS, method=method,
                               head_rank=head_rank, vocab_size=config["vocab_size"])
        with torch.no_grad():
            for param in module.parameters():
                param.normal_(0.0, 0.3)
        modules[name] = module
    return modules


def make_darts_dir(path, head_rank=0, method="darts", default_domain="math"):
    """Export random surgery into the plain model directory ``path``; returns the modules."""
    with open(os.path.join(path, "config.json")) as handle:
        config = json.load(handle)
    modules = random_modules(config, head_rank=head_rank, method=method)
    export_surgery(path, modules, {name: f"experts/{name}" for name in modules}, default_domain,
                   loss="kl" if head_rank else "ewl1")
    return modules


def load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def tokenizer_for(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


@torch.no_grad()
def manual_logits(plain, surgery, input_ids, position_ids=None):
    """lm_head(s(h, pos)) (+ the head correction) on the plain model's final-norm output."""
    hidden = plain(input_ids, output_hidden_states=True).hidden_states[-1]
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1]).expand(input_ids.shape)
    corrected = surgery(hidden, position_ids)
    logits = plain.lm_head(corrected)
    if surgery.head_rank:
        logits = logits + surgery.head_correction(corrected)
    return logits


@torch.no_grad()
def manual_greedy(plain, surgery, input_ids, new_tokens):
    """Greedy decoding without any cache: a full forward of the growing sequence per token."""
    ids = input_ids
    for _ in range(new_tokens):
        next_token = manual_logits(plain, surgery, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], dim=1)
    return ids


def greedy(model, **inputs):
    return model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=PAD)


@pytest.fixture(scope="module")
def darts_dir(tiny_family, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("darts") / "merged")
    shutil.copytree(tiny_family["merged"], path)
    realistic_padding(path)
    return path, make_darts_dir(path)


@pytest.fixture(scope="module")
def head_dir(tiny_family, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("darts_head") / "merged")
    shutil.copytree(tiny_family["merged"], path)
    realistic_padding(path)
    return path, make_darts_dir(path, head_rank=3)


@pytest.fixture(scope="module")
def plain(tiny_family):
    return load(tiny_family["merged"])


# ------------------------------------------------------------------------------------------- logits

@pytest.mark.parametrize("domain", ["math", "code"])
def test_logits_equal_manual_computation(darts_dir, plain, domain):
    path, modules = darts_dir
    model = load(path, trust_remote_code=True, darts_domain=domain)
    assert type(model).__name__ == "DartsLlamaForCausalLM" and model.darts_domain == domain
    ids = tokenizer_for(path)(PROMPTS[1], return_tensors="pt").input_ids  # longer than MAX_POSITIONS
    assert ids.shape[1] > MAX_POSITIONS
    expected = manual_logits(plain, modules[domain], ids)
    with torch.no_grad():
        out = model(ids, labels=ids)
        last = model(ids, logits_to_keep=1).logits
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, expected[:, -1:], rtol=1e-5, atol=1e-5)
    # labels/loss go through the corrected logits
    loss = torch.nn.functional.cross_entropy(expected[0, :-1], ids[0, 1:])
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out.logits, plain(ids).logits, atol=1e-3)


def test_explicit_position_ids_are_used(darts_dir, plain):
    path, modules = darts_dir
    model = load(path, trust_remote_code=True)
    ids = tokenizer_for(path)(PROMPTS[0], return_tensors="pt").input_ids
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0) + 2
    expected = manual_logits(plain, modules["math"], ids, position_ids.expand(ids.shape))
    with torch.no_grad():
        got = model(ids, position_ids=position_ids).logits
    # the merged model's own (rotary) positions shift too; RoPE is relative so only the surgery differs
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_none_equals_plain_merged_model_exactly(darts_dir, plain):
    path, _ = darts_dir
    model = load(path, trust_remote_code=True, darts_domain="none")
    assert model.darts_domain == "none"
    tokenizer = tokenizer_for(path)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, plain(**batch).logits)
    assert torch.equal(greedy(model, **batch), greedy(plain, **batch))


def test_set_darts_domain_and_unknown_domain(darts_dir, plain):
    path, modules = darts_dir
    model = load(path, trust_remote_code=True)
    assert model.darts_domain == "math" and sorted(model.darts_domains) == ["code", "math"]
    ids = tokenizer_for(path)(PROMPTS[0], return_tensors="pt").input_ids
    model.set_darts_domain("code")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, manual_logits(plain, modules["code"], ids))
        model.set_darts_domain("none")
        assert torch.equal(model(ids).logits, plain(ids).logits)
    with pytest.raises(ValueError, match=r"unknown domain 'physics'.*'math'.*'code'.*'none'"):
        model.set_darts_domain("physics")
    with pytest.raises(ValueError, match="physics"):
        load(path, trust_remote_code=True, darts_domain="physics")


def test_state_dict_keys(darts_dir):
    path, _ = darts_dir
    keys = {k for k in load(path, trust_remote_code=True).state_dict() if k.startswith("darts.")}
    assert keys == {f"darts.{d}.{p}" for d in ("math", "code") for p in ("down.weight", "up.weight", "position_bias")}


# ----------------------------------------------------------------------------------------- generate

@pytest.mark.parametrize("fixture", ["darts_dir", "head_dir"])
def test_generate_with_cache_matches_manual_decoding(request, plain, fixture):
    path, modules = request.getfixturevalue(fixture)
    model = load(path, trust_remote_code=True)
    ids = tokenizer_for(path)(PROMPTS[0], return_tensors="pt").input_ids  # 6 tokens + 8 new > MAX_POSITIONS
    with_cache = greedy(model, input_ids=ids, use_cache=True)
    assert torch.equal(with_cache, greedy(model, input_ids=ids, use_cache=False))
    assert torch.equal(with_cache, manual_greedy(plain, modules["math"], ids, 8))


@pytest.mark.parametrize("fixture", ["darts_dir", "head_dir"])
def test_left_padded_batch_equals_each_prompt_alone(request, plain, fixture):
    path, modules = request.getfixturevalue(fixture)
    model = load(path, trust_remote_code=True)
    tokenizer = tokenizer_for(path)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (batch.attention_mask == 0).any()  # really left padded
    together = greedy(model, **batch)[:, batch.input_ids.shape[1]:]
    for row, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        alone = greedy(model, input_ids=ids)[:, ids.shape[1]:]
        assert torch.equal(together[row:row + 1], alone), prompt
        assert torch.equal(alone, manual_greedy(plain, modules["math"], ids, 8)[:, ids.shape[1]:])


def test_generate_passes_position_ids(darts_dir):
    """The surgery relies on generate() handing position_ids to every cached step (not cache_position)."""
    path, _ = darts_dir
    model = load(path, trust_remote_code=True)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("position_ids")),
                                    with_kwargs=True)
    batch = tokenizer_for(path)(PROMPTS, return_tensors="pt", padding=True)
    greedy(model, **batch)
    assert len(seen) == 8 and all(p is not None for p in seen)
    first_real = batch.attention_mask.argmax(-1)
    assert torch.equal(seen[0][torch.arange(len(PROMPTS)), first_real], torch.zeros(len(PROMPTS), dtype=torch.long))
    assert torch.equal(seen[1][:, 0], batch.attention_mask.sum(-1))  # the first new token's position


def test_head_correction_is_applied(head_dir, plain):
    path, modules = head_dir
    model = load(path, trust_remote_code=True)
    ids = tokenizer_for(path)(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        got = model(ids).logits
        without_head = plain.lm_head(modules["math"](plain(ids, output_hidden_states=True).hidden_states[-1],
                                                     torch.arange(ids.shape[1]).unsqueeze(0)))
    torch.testing.assert_close(got, manual_logits(plain, modules["math"], ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, without_head, atol=1e-3)


# ------------------------------------------------------------------------------- loading and saving

def test_without_trust_remote_code_loads_plain_merged_model(darts_dir, plain):
    path, _ = darts_dir
    model = load(path)
    assert type(model).__name__ == "LlamaForCausalLM" and not hasattr(model, "darts")
    ids = tokenizer_for(path)(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_save_pretrained_round_trip(darts_dir, tmp_path):
    path, _ = darts_dir
    model = load(path, trust_remote_code=True, darts_domain="code")
    model.save_pretrained(tmp_path / "saved")
    for name in ("modeling_darts.py", "surgery.py"):
        assert os.path.exists(tmp_path / "saved" / name), name
    reloaded = load(str(tmp_path / "saved"), trust_remote_code=True)
    assert type(reloaded).__name__ == "DartsLlamaForCausalLM" and reloaded.darts_domain == "code"
    ids = tokenizer_for(path)(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_package_class_save_pretrained_carries_modeling_files(darts_dir, tmp_path):
    """Imported from the package (not remote code), the class still saves a self-contained directory."""
    from mergekit_darts.remote_code.modeling_darts import DartsLlamaForCausalLM

    path, _ = darts_dir
    model = DartsLlamaForCausalLM.from_pretrained(path, darts_domain="code").eval()
    model.save_pretrained(tmp_path / "saved")
    assert {"modeling_darts.py", "surgery.py"} <= set(os.listdir(tmp_path / "saved"))
    reloaded = load(str(tmp_path / "saved"), trust_remote_code=True)
    ids = tokenizer_for(path)(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_missing_darts_tensors_start_as_identity(merged_copy, plain):
    """A config naming domains whose tensors are absent loads as the plain model (zero init)."""
    make_darts_dir(merged_copy)
    index_path = os.path.join(merged_copy, "model.safetensors.index.json")
    with open(index_path) as handle:
        index = json.load(handle)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("darts.")}
    with open(index_path, "w") as handle:
        json.dump(index, handle)
    os.remove(os.path.join(merged_copy, "darts.safetensors"))

    model = load(merged_copy, trust_remote_code=True)
    for surgery in model.darts.values():
        assert torch.count_nonzero(surgery.up.weight) == 0 and torch.count_nonzero(surgery.position_bias) == 0
        assert torch.isfinite(surgery.down.weight).all() and surgery.down.weight.abs().max() > 0
    ids = tokenizer_for(merged_copy)(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=1e-6)


def test_bfloat16_load_keeps_surgery_in_float32(darts_dir):
    path, _ = darts_dir
    model = load(path, trust_remote_code=True, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.darts["math"].position_bias.dtype == torch.float32
    ids = tokenizer_for(path)(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(ids).logits.dtype == torch.bfloat16
        greedy(model, input_ids=ids)


# ------------------------------------------------------------------------------------ architectures

def make_other_model(path, model_type, seed=3):
    """A tiny random model of an architecture mergekit_darts.tiny does not build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mergekit_darts.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, num_local_experts=2, num_experts_per_tok=1,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mixtral"])
def test_architectures(tmp_path, arch):
    path = str(tmp_path / arch)
    if arch in ("llama", "mistral", "qwen2"):
        make_random_model(path, arch=arch, seed=3)
    else:
        make_other_model(path, arch)
    realistic_padding(path)
    plain = load(path)
    modules = make_darts_dir(path, head_rank=2)
    model = load(path, trust_remote_code=True)
    assert type(model).__name__ == "Darts" + type(plain).__name__
    tokenizer = tokenizer_for(path)
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, manual_logits(plain, modules["math"], ids),
                                   rtol=1e-5, atol=1e-5)
    generated = greedy(model, input_ids=ids)
    assert torch.equal(generated, greedy(model, input_ids=ids, use_cache=False))
    assert torch.equal(generated, manual_greedy(plain, modules["math"], ids, 8))
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    together = greedy(model, **batch)[:, batch.input_ids.shape[1]:]
    for row, prompt in enumerate(PROMPTS):
        alone = tokenizer(prompt, return_tensors="pt").input_ids
        assert torch.equal(together[row:row + 1], greedy(model, input_ids=alone)[:, alone.shape[1]:])


# ------------------------------------------------------------------------------------------- lm-eval

RECORDS = [
    {"question": "how many apples are left ?", "choices": ["1", "2", "3"], "label": 1},
    {"question": "def sum ( a , b ) :", "choices": ["return a + b", "print a", "return a - b"], "label": 0},
    {"question": "what is 2 plus 3 ?", "choices": ["5", "6", "7", "4"], "label": 0},
    {"question": "write a python function", "choices": ["def", "the", "sort list"], "label": 2},
]


def write_task(folder):
    """A multiple-choice task over a local JSONL file: works offline, no task index needed."""
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, "tiny_mc.jsonl")
    with open(data, "w") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in RECORDS)
    with open(os.path.join(folder, "tiny_mc.yaml"), "w") as handle:
        handle.write(
            "task: darts_tiny_mc\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            "doc_to_text: \"{{question}}\"\n"
            "doc_to_choice: \"{{choices}}\"\n"
            "doc_to_target: label\n"
            "metric_list:\n  - metric: acc\n"
        )
    return folder


@torch.no_grad()
def continuation_loglikelihood(model, tokenizer, context, continuation):
    """log p(continuation | context) the way lm-eval's HF model computes it (whole string encoded,
    split at the context's length; the last token is not fed)."""
    whole = tokenizer(context + continuation).input_ids
    n_context = len(tokenizer(context).input_ids)
    logprobs = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0].float(), dim=-1)
    return sum(logprobs[t - 1, whole[t]].item() for t in range(n_context, len(whole)))


def test_lm_eval_harness_loads_darts_domain(darts_dir, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    path, _ = darts_dir
    tasks = TaskManager(include_path=write_task(str(tmp_path / "task")), include_defaults=False)

    def evaluate(model_args):
        out = simple_evaluate(model="hf", model_args=model_args, tasks=["darts_tiny_mc"], task_manager=tasks,
                              batch_size=2, device="cpu", log_samples=True)
        samples = out["samples"]["darts_tiny_mc"]
        # filtered_resps: one (loglikelihood, is_greedy) per choice
        return {(s["doc_id"], i): r[0] for s in samples for i, r in enumerate(s["filtered_resps"])}

    corrected = evaluate(f"pretrained={path},trust_remote_code=True,darts_domain=code")
    uncorrected = evaluate(f"pretrained={path},trust_remote_code=True,darts_domain=none")
    plain = evaluate(f"pretrained={path}")

    model = load(path, trust_remote_code=True, darts_domain="code")
    tokenizer = tokenizer_for(path)
    for (doc_id, choice), loglikelihood in corrected.items():
        record = RECORDS[doc_id]
        expected = continuation_loglikelihood(model, tokenizer, record["question"], " " + record["choices"][choice])
        assert loglikelihood == pytest.approx(expected, abs=1e-4)
    for key, loglikelihood in uncorrected.items():
        assert loglikelihood == pytest.approx(plain[key], abs=1e-5)
    assert any(abs(corrected[k] - uncorrected[k]) > 1e-3 for k in corrected)


def test_resized_lm_head_keeps_the_head_correction_hook(head_dir):
    path, _ = head_dir
    model = load(path, trust_remote_code=True)
    ids = tokenizer_for(path)(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        before = model(ids).logits
        vocab = model.config.vocab_size
        model.resize_token_embeddings(vocab)  # same size: a new LM head module, same weights
        torch.testing.assert_close(model(ids).logits, before)
        model.resize_token_embeddings(vocab + 8)
        with pytest.raises(ValueError, match="head correction.*vocabulary"):
            model(ids)
        model.set_darts_domain("none")
        assert model(ids).logits.shape[-1] == vocab + 8
