"""Peak memory of the head correction (``head_rank > 0``) in a forward of the emitted model.

A forward returns logits [B, T, V]; the head correction adds ``head_up(head_down(h_hat))`` to them.
This measures how much memory that addition costs on top of the same forward without a head
correction, in units of one logits tensor (target: at most one extra logits-sized buffer).

Every measurement runs in a fresh Python subprocess: it loads the directory with
``trust_remote_code=True`` in the given dtype, runs one small warm-up forward, resets the kernel's
peak-RSS counter (``/proc/self/clear_refs``), reads its RSS, runs one ``torch.no_grad`` forward of
[batch, seq] random ids and reads the peak (``VmHWM``). The figure is peak - RSS before the forward.
glibc's mmap threshold is fixed at 64 KiB in the children (``MALLOC_MMAP_THRESHOLD_``) so freed
tensors leave RSS at once and the peak is that of live tensors.
Modes, interleaved and repeated:

* ``none``:    the head-correction directory with ``darts_domain="none"`` (plain merged model);
* ``no_head``: a directory whose surgery has ``head_rank=0`` (content + position correction only);
* ``head``:    the same surgery with ``head_rank`` > 0;
* ``head_legacy`` (only with ``--legacy-code DIR``): ``head`` with the modeling files from DIR, e.g.
  the previous release's (``git show <commit>:mergekit_darts/remote_code/modeling_darts.py``).

    python benchmarks/speed_memory/bench_head_memory.py                          # ~1-2 min on 2 cores
    python benchmarks/speed_memory/bench_head_memory.py --legacy-code /tmp/old_remote_code
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for _common
from _common import log, machine_info, median, print_table, run_json_child, write_json  # noqa: E402

MODES = ("none", "no_head", "head")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--head-rank", type=int, default=8)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=2, help="fresh subprocesses per mode and dtype")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--legacy-code", help="folder with an older modeling_darts.py + surgery.py to compare")
    p.add_argument("--out", help="results JSON path (default benchmarks/results/bench_head_memory.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------- child side

def status_bytes(key: str) -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(key + ":"))


def child(args) -> dict:
    import gc

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, trust_remote_code=True, dtype=dtype).eval()
    if args.child == "none":
        model.set_darts_domain("none")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, args.vocab, (args.batch, args.seq), generator=generator)
    with torch.no_grad():
        model(ids[:, :8])  # warm-up: kernels, lazily built buffers
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:  # "5": reset VmHWM to the current RSS
        handle.write("5")
    before = status_bytes("VmRSS")
    with torch.no_grad():
        logits = model(ids).logits
    peak = status_bytes("VmHWM")
    return {"mode": args.child, "dtype": args.dtype, "extra_bytes": peak - before,
            "logits_bytes": logits.numel() * logits.element_size(), "logits_dtype": str(logits.dtype)}


# ---------------------------------------------------------------------------------- parent side

def build_dirs(root: str, args, legacy_code=None) -> dict:
    import torch

    from mergekit_darts.output.export import export_surgery
    from mergekit_darts.remote_code.surgery import DomainSurgery
    from mergekit_darts.tiny import make_random_model

    plain = os.path.join(root, "plain")
    make_random_model(plain, arch="llama", seed=0, vocab_size=args.vocab, hidden_size=args.hidden,
                      layers=args.layers, max_position_embeddings=max(256, args.seq))
    dirs = {}
    for name, head_rank in (("no_head", 0), ("head", args.head_rank)):
        path = os.path.join(root, name)
        shutil.copytree(plain, path)
        torch.manual_seed(1)
        module = DomainSurgery(args.hidden, rank=8, max_positions=args.seq, head_rank=head_rank, vocab_size=args.vocab)
        with torch.no_grad():
            for param in module.parameters():
                param.normal_(0.0, 0.1)
        export_surgery(path, {"math": module}, {"math": "experts/math"}, "math", loss="kl" if head_rank else "ewl1")
        dirs[name] = path
    dirs["none"] = dirs["head"]
    if legacy_code:
        path = os.path.join(root, "head_legacy")
        shutil.copytree(dirs["head"], path)
        for name in ("modeling_darts.py", "surgery.py"):
            shutil.copy(os.path.join(legacy_code, name), os.path.join(path, name))
        dirs["head_legacy"] = path
    return dirs


def run_child(mode: str, model_dir: str, dtype: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model-dir", model_dir, "--dtype", dtype,
           "--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq),
           "--threads", str(args.threads)]
    # a fixed mmap threshold: every tensor over 64 KiB is its own mapping, returned to the OS when
    # freed, so the peak counts live tensors rather than what glibc's heap happened to keep
    return run_json_child(cmd, f"{mode}/{dtype}", MALLOC_MMAP_THRESHOLD_="65536")


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    modes = MODES + (("head_legacy",) if args.legacy_code else ())
    dtypes = args.dtypes.split(",")
    with tempfile.TemporaryDirectory() as root:
        log(f"building vocab={args.vocab} hidden={args.hidden} layers={args.layers} directories")
        dirs = build_dirs(root, args, args.legacy_code)
        samples = {(mode, dtype): [] for mode in modes for dtype in dtypes}
        logits_bytes = {}
        for repeat in range(args.repeats):
            for dtype in dtypes:
                for mode in modes:
                    result = run_child(mode, dirs[mode], dtype, args)
                    samples[(mode, dtype)].append(result["extra_bytes"])
                    logits_bytes[dtype] = result["logits_bytes"]
                    log(f"repeat {repeat} {dtype} {mode}: +{result['extra_bytes'] / 2**20:.1f} MiB")
    rows, results = [], []
    for dtype in dtypes:
        base = median(samples[("no_head", dtype)])
        for mode in modes:
            peak = median(samples[(mode, dtype)])
            entry = {"dtype": dtype, "mode": mode, "forward_extra_mib": peak / 2**20,
                     "samples_mib": [s / 2**20 for s in samples[(mode, dtype)]],
                     "over_no_head_logits": (peak - base) / logits_bytes[dtype]}
            results.append(entry)
            rows.append([dtype, mode, entry["forward_extra_mib"], logits_bytes[dtype] / 2**20,
                         entry["over_no_head_logits"]])
    print_table(f"Forward peak over RSS before it (median of {args.repeats}); batch {args.batch} x seq {args.seq} "
                f"x vocab {args.vocab}, head_rank {args.head_rank}",
                ["dtype", "mode", "peak MiB", "logits MiB", "head cost (x logits)"], rows)
    write_json("bench_head_memory", {
        "machine": machine_info(),
        "shape": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "batch": args.batch,
                  "seq": args.seq, "head_rank": args.head_rank},
        "method": "fresh subprocess per sample; VmHWM after clear_refs minus VmRSS before one no_grad forward",
        "head_cost_definition": "(peak(mode) - peak(no_head)) / bytes of the logits tensor",
        "legacy_code": args.legacy_code,
        "results": results,
    }, path=args.out)


if __name__ == "__main__":
    main()
