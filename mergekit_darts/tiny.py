"""Tiny random model families for tests, benchmarks and offline examples.

Nothing can be downloaded on the dev/CI machines, so every test builds its models here: a small
word-level tokenizer, a random base model of a supported architecture, and "experts" that are the
base plus a seeded random delta (a stand-in for a fine-tune). All saved as safetensors.
"""

import os
from typing import Dict, Iterable, List, Optional

import torch

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
DEFAULT_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have not are but "
    "what all were when we there can been has more if will one so no out up do about which their "
    "question answer code def return print sum list sort reverse count words number plus minus "
    "times add subtract multiply total each has apples pears how many left give take then write "
    "function python input output value string int float true false none if else for while in "
    "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = ( ) : , . ? ! # \" ' [ ] { }"
).split()


def build_tokenizer(words: Optional[Iterable[str]] = None, chat_template: bool = True):
    """A word-level PreTrainedTokenizerFast over ``words`` (+ special tokens).

    It splits on whitespace only, so ``####``, ``==`` and ``(`` stay single tokens and
    decode(encode(text)) == text for single-spaced text (no decoder: tokens are joined with spaces).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab: Dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, *(words or DEFAULT_WORDS)]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 256, hidden_size: int = 32, layers: int = 2,
                max_position_embeddings: int = 256, tie_word_embeddings: bool = False):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(f"arch: unknown tiny architecture {arch!r}; use llama, mistral or qwen2")


def make_random_model(path: str, arch: str = "llama", seed: int = 0, tokenizer=None, **config_kwargs):
    """Save a random causal LM (+ tokenizer) to ``path``; returns the model."""
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer or build_tokenizer()
    config_kwargs.setdefault("vocab_size", max(len(tokenizer), 8))
    config = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def make_expert(base_path: str, path: str, seed: int, scale: float = 0.05, final_norm_scale: float = 0.0):
    """Save base + a seeded random delta (a stand-in for a fine-tune) to ``path``.

    ``scale`` is relative to each tensor's own standard deviation so every layer moves comparably.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_path)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = param.float().std().item() if param.numel() > 1 else 1.0
            if param.dim() == 1:  # norms: keep them near 1 unless asked
                delta = torch.randn(param.shape, generator=generator) * final_norm_scale
            else:
                delta = torch.randn(param.shape, generator=generator) * scale * max(std, 1e-3)
            param.add_(delta.to(param.dtype))
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(path)
    return model


def make_family(root: str, arch: str = "llama", domains: List[str] = ("math", "code"), seed: int = 0,
                scale: float = 0.3, **config_kwargs) -> Dict[str, str]:
    """A base model and one expert per domain under ``root``; returns {"base": path, domain: path}."""
    paths = {"base": os.path.join(root, "base")}
    make_random_model(paths["base"], arch=arch, seed=seed, **config_kwargs)
    for index, domain in enumerate(domains):
        paths[domain] = os.path.join(root, domain)
        make_expert(paths["base"], paths[domain], seed=seed + 1 + index, scale=scale)
    return paths


def make_low_rank_expert(base_path: str, path: str, seed: int, targets: Iterable[str] = ("q_proj", "v_proj"),
                         rank: int = 2, scale: float = 0.5) -> str:
    """Save base + a seeded rank-``rank`` delta on the ``targets`` linears only (every other tensor the
    base's, byte for byte) to ``path``: what a PEFT LoRA on q/v merged with ``merge_and_unload`` gives."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(base_path, path)
    weights_file = os.path.join(path, "model.safetensors")
    tensors = load_file(weights_file)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in targets:
            out_features, in_features = tensor.shape
            left = torch.randn(out_features, rank, generator=generator)
            right = torch.randn(rank, in_features, generator=generator)
            delta = left @ right * (scale * tensor.float().std() / rank ** 0.5)
            tensors[name] = (tensor.float() + delta).to(tensor.dtype)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return path
