"""Local stand-ins for the Hub models and datasets that README.md and examples/ name (nothing can be
downloaded here): for each Hub id a folder with a ``config.json`` of the real model's architecture and
shape and a tokenizer of its vocabulary size with or without a chat template, as the real one has; for each
dataset a folder that ``datasets.load_dataset(folder, subset, split=...)`` reads like the Hub repository
(its subsets, splits and fields). No weights: the pre-merge checks read configs, tokenizers and the
calibration data only (weight headers where files exist, which these have none of).

What each stand-in copies from its Hub model (the model cards and config.json files, as of 2026):

- Llama-2-7B family: LlamaForCausalLM, hidden 4096, 32 layers, a 32,000-token SentencePiece vocabulary;
  the base's tokenizer has no chat template, the chat model's has its [INST] template.
  WizardMath-7B-V1.0 added a ``[PAD]`` token: vocabulary 32,001.
- Meta-Llama-3-8B family: LlamaForCausalLM, hidden 4096, 32 layers, 8 key/value heads, 128,256 tokens;
  the Instruct model's tokenizer has its chat template.
- Qwen2.5-7B family: Qwen2ForCausalLM, hidden 3584, 28 layers, 4 key/value heads, config vocabulary
  152,064 (151,665 tokens in the tokenizer); every tokenizer of the family has the Qwen chat template.
"""

import json
import os
from typing import Dict, Optional

from mergekit_darts.tiny import DEFAULT_WORDS, SPECIAL_TOKENS

LLAMA2_CHAT = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
               "message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}"
               "{% endif %}{% endfor %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN_CHAT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
             "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=11008,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, vocab_size=32000,
              bos_token_id=1, eos_token_id=2)
LLAMA3 = dict(LLAMA2, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=8192,
              rope_theta=500000.0, vocab_size=128256, bos_token_id=128000, eos_token_id=128001)
QWEN25 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
              rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, vocab_size=152064,
              bos_token_id=151643, eos_token_id=151643, use_sliding_window=False)

# Hub id -> (config, tokenizer size, tokens added after the vocabulary, chat template or None)
MODELS = {
    "meta-llama/Llama-2-7b-hf": (LLAMA2, 32000, (), None),
    "meta-llama/Llama-2-7b-chat-hf": (LLAMA2, 32000, (), LLAMA2_CHAT),
    "RedHatAI/Llama-2-7b-gsm8k": (LLAMA2, 32000, (), None),
    "RedHatAI/Llama-2-7b-evolcodealpaca": (LLAMA2, 32000, (), None),
    "WizardLMTeam/WizardMath-7B-V1.0": (dict(LLAMA2, vocab_size=32001), 32000, ("[PAD]",), None),
    "meta-llama/Meta-Llama-3-8B": (LLAMA3, 128256, (), None),
    "meta-llama/Meta-Llama-3-8B-Instruct": (LLAMA3, 128256, (), LLAMA3_CHAT),
    "TIGER-Lab/MAmmoTH2-8B": (LLAMA3, 128256, (), None),
    "Qwen/Qwen2.5-7B": (dict(QWEN25, max_position_embeddings=131072), 151665, (), QWEN_CHAT),
    "Qwen/Qwen2.5-7B-Instruct": (QWEN25, 151665, (), QWEN_CHAT),
    "Qwen/Qwen2.5-Math-7B": (dict(QWEN25, max_position_embeddings=4096), 151665, (), QWEN_CHAT),
    "Qwen/Qwen2.5-Coder-7B": (QWEN25, 151665, (), QWEN_CHAT),
}

# Hub dataset id -> {subset or None: {split: fields}}
DATASETS = {
    "openai/gsm8k": {"main": {"train": ("question", "answer")}, "socratic": {"train": ("question", "answer")}},
    "tatsu-lab/alpaca": {None: {"train": ("instruction", "input", "output", "text")}},
    "google-research-datasets/mbpp": {"full": {"train": ("task_id", "text", "code"), "test": ("task_id", "text", "code")},
                                      "sanitized": {"train": ("task_id", "prompt", "code")}},
}

WORDS = [word for word in DEFAULT_WORDS if word not in SPECIAL_TOKENS]


def _tokenizer(size: int, added, chat_template: Optional[str]):
    """A word-level tokenizer of exactly ``size`` tokens (the demo's words, then fillers) plus ``added``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: Dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, *WORDS]:
        vocab.setdefault(token, len(vocab))
    for index in range(size - len(vocab)):
        vocab[f"w{index}"] = len(vocab)
    for token in added:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)
    if chat_template:
        fast.chat_template = chat_template
    return fast


def build_models(root: str, ids=None) -> Dict[str, str]:
    """A stand-in folder under ``root`` per Hub id (all of ``MODELS`` by default); returns id -> folder."""
    folders, tokenizers = {}, {}
    for hub_id in ids or MODELS:
        config, size, added, template = MODELS[hub_id]
        folder = os.path.join(root, hub_id.replace("/", "--"))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
            json.dump({**config, "torch_dtype": "bfloat16"}, handle)
        key = (size, added, template)
        if key not in tokenizers:
            tokenizers[key] = _tokenizer(size, added, template)
        tokenizers[key].save_pretrained(folder)
        folders[hub_id] = folder
    return folders


def _record(fields, index: int) -> dict:
    words = WORDS[index % 40: index % 40 + 12]
    return {field: (index if field == "task_id" else " ".join(words) + " ?") for field in fields}


def build_datasets(root: str, records: int = 60) -> Dict[str, str]:
    """A folder per Hub dataset, laid out as its Hub repository (a README's ``configs:`` for the subsets)."""
    folders = {}
    for dataset, subsets in DATASETS.items():
        folder = os.path.join(root, dataset.replace("/", "--"))
        configs = []
        for subset, splits in subsets.items():
            files = []
            for split, fields in splits.items():
                name = f"{subset or 'data'}/{split}.jsonl"
                os.makedirs(os.path.join(folder, os.path.dirname(name)), exist_ok=True)
                with open(os.path.join(folder, name), "w", encoding="utf-8") as handle:
                    handle.writelines(json.dumps(_record(fields, i)) + "\n" for i in range(records))
                files.append(f"  - split: {split}\n    path: {name}\n")
            configs.append(f"- config_name: {subset or 'default'}\n  data_files:\n" + "".join(files))
        with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as handle:
            handle.write("---\nconfigs:\n" + "".join(configs) + "---\n")
        folders[dataset] = folder
    return folders
