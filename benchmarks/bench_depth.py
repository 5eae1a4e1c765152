"""Prototype measurement of a deeper correction (issue 18 lever 1, docs/quality.md): LoRA inside the
merged model's last k decoder blocks, trained with the DARTS module on the KL objective, the blocks'
frozen weights run forward from their cached input at every step.

    python benchmarks/bench_depth.py DEMO_DIR --depths 0 1 2 [--steps 500 --block-rank 8]

k = 0 is today's DARTS + KL on the cached final states. Prints and writes held-out KL gap closed per
domain and seconds per training step to benchmarks/results/quality_depth.json. Not a surgery option:
nothing here is exported (see docs/quality.md for what the numbers say).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import RESULTS_DIR, machine_info  # noqa: E402


class BlockLora(torch.nn.Module):
    """``out += B(A(x))`` on every Linear of the given blocks, through forward hooks; B = 0 at start."""

    def __init__(self, blocks, rank: int):
        super().__init__()
        self.adapters = torch.nn.ModuleDict()
        self.handles = []
        for b, block in enumerate(blocks):
            for name, linear in block.named_modules():
                if isinstance(linear, torch.nn.Linear):
                    key = f"{b}_{name.replace('.', '_')}"
                    down = torch.nn.Linear(linear.in_features, rank, bias=False)
                    up = torch.nn.Linear(rank, linear.out_features, bias=False)
                    torch.nn.init.zeros_(up.weight)
                    self.adapters[key] = torch.nn.Sequential(down, up)
                    self.handles.append(linear.register_forward_hook(
                        lambda module, args, out, k=key: out + self.adapters[k](args[0])))

    def remove(self):
        for handle in self.handles:
            handle.remove()


def capture_block_input(model, input_ids, mask, first_block: int):
    """(hidden [N, T, H], kwargs) entering decoder block ``first_block`` for the whole batch."""
    layers = model.model.layers
    store = {}

    def pre_hook(module, args, kwargs):
        store["hidden"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        store["kwargs"] = {k: v for k, v in kwargs.items() if k in ("attention_mask", "position_embeddings",
                                                                     "position_ids")}
        raise StopIteration  # nothing after this block is needed

    handle = layers[first_block].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model.model(input_ids=input_ids, attention_mask=mask.long(),
                        position_ids=torch.arange(input_ids.shape[1]).expand_as(input_ids), use_cache=False)
    except StopIteration:
        pass
    finally:
        handle.remove()
    return store["hidden"], store["kwargs"]


def index_kwargs(kwargs, index):
    out = {}
    for key, value in kwargs.items():
        if value is None:
            out[key] = None
        elif isinstance(value, tuple):
            out[key] = tuple(v[index] if v.shape[0] > 1 else v for v in value)
        else:
            out[key] = value[index] if value.shape[0] > 1 else value
    return out


def run_blocks(model, first_block, hidden, kwargs):
    for block in model.model.layers[first_block:]:
        out = block(hidden, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    return model.model.norm(hidden)


def measure(demo_dir, depth, steps, lr, block_rank):
    from transformers import AutoModelForCausalLM

    from mergekit_darts.pipeline import capture_step, parse_config_source
    from mergekit_darts.repair.heldout import held_out_kl, split_held_out
    from mergekit_darts.remote_code.surgery import DomainSurgery, SurgeryShape
    from mergekit_darts.repair.losses import kl_loss
    from mergekit_darts.settings import RunSettings

    with open(os.path.join(demo_dir, "demo.yml")) as handle:
        _, surgery = parse_config_source(handle.read(), {"loss": "kl", "steps": steps, "lr": lr})
    settings = RunSettings.resolve(surgery, None, progress=False)
    out = os.path.join(demo_dir, "merged")
    captured = capture_step(out, surgery, settings)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval().requires_grad_(False)
    layers = len(model.model.layers)
    merged_head = captured.merged_head.float()
    results = {}
    for name, data in captured.domains.items():
        n = data.merged_hidden.shape[0]
        train_idx, held_idx = split_held_out(n, surgery.held_out, settings.seed)
        first = layers - depth
        if depth:
            block_in, kwargs = capture_block_input(model, data.input_ids, data.attention_mask, first)
            check = run_blocks(model, first, block_in, kwargs)
            valid = data.attention_mask
            drift = float((check[valid] - data.merged_hidden[valid].float()).abs().max())
            assert drift < 1e-3, f"replayed blocks differ from the captured final states by {drift}"
        torch.manual_seed(settings.seed)
        module = DomainSurgery.from_shape(SurgeryShape(method="darts", rank=surgery.rank, head_rank=0,
                                                       max_positions=surgery.max_positions, content="relu"),
                                          hidden_size=data.merged_hidden.shape[-1], vocab_size=merged_head.shape[0])
        lora = BlockLora(model.model.layers[first:], block_rank) if depth else None
        params = list(module.parameters()) + (list(lora.parameters()) if lora else [])
        optimizer = torch.optim.Adam(params, lr=lr)
        mask = data.attention_mask[train_idx]
        target = data.expert_hidden[train_idx].float()[mask]
        expert_head = data.expert_head.float()

        def final_states(index):
            if not depth:
                return data.merged_hidden[index].float()
            return run_blocks(model, first, block_in[index], index_kwargs(kwargs, index))

        start = time.perf_counter()
        for _ in range(steps):
            corrected = module(final_states(train_idx), data.position_ids[train_idx])[mask]
            loss = kl_loss(corrected, target, expert_head, merged_head)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        seconds = (time.perf_counter() - start) / max(steps, 1)
        with torch.no_grad():
            held = {"merged": final_states(held_idx), "target": data.expert_hidden[held_idx],
                    "mask": data.attention_mask[held_idx], "position_ids": data.position_ids[held_idx]}
            kl = held_out_kl(module, held, expert_head, merged_head, 1024)
        # what the same correction gives when the blocks run without their LoRA: the baseline KL gap
        if depth:
            lora.remove()
            with torch.no_grad():
                base = data.merged_hidden[held_idx].float()[held["mask"]]
                before = float(kl_loss(base, data.expert_hidden[held_idx].float()[held["mask"]], expert_head, merged_head))
            kl["gap_closed"] = 1 - kl["after"] / before
        extra = sum(p.numel() for p in lora.parameters()) if lora else 0
        results[name] = {"gap_closed": kl["gap_closed"], "seconds_per_step": round(seconds, 4),
                         "block_parameters": extra}
        print(f"depth {depth} {name:9s} gap_closed {kl['gap_closed']:.3f} {seconds * 1000:.1f} ms/step "
              f"(+{extra:,} block parameters)", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo_dir")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--block-rank", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {str(k): measure(args.demo_dir, k, args.steps, args.lr, args.block_rank) for k in args.depths}
    path = os.path.join(RESULTS_DIR, "quality_depth.json")
    with open(path, "w") as handle:
        json.dump({"command": " ".join(sys.argv), "machine": machine_info(), "depths": results}, handle, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
