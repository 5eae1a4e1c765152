"""``mergekit-darts serve``: OUT's router in front of llama-server (docs/serving.md#routed-serving).

The routing and request rewriting are tested against a stand-in engine that answers as llama-server
does (``/lora-adapters``, ``/v1/completions`` and ``/v1/chat/completions`` with and without streaming,
``/embeddings`` with mean pooling computed by the plain merge in transformers); the real engine runs in
``test_real_llama_server`` when a llama-server binary is given (LLAMA_SERVER) and in
benchmarks/serving/routed_llama_server.py.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from helpers import QUICK_TEXTS, merge_yaml

SURGERY = ("surgery:\n  rank: 2\n  max_positions: 16\n  steps: {steps}\n  lr: 0.01\n  device: cpu\n"
           "  dtype: float32\n  loss: kl\n{blocks}  router: true\n  cache_dir: {cache}\n  domains:\n")


def repaired(family, root, depth, steps=0):
    from mergekit_darts.pipeline import run_surgery

    out = root / f"out_depth_{depth}"
    shutil.copytree(family["merged"], out)
    blocks = "".join(f"    {name}:\n      model: {family[name]}\n"
                     f"      calibration: {{texts: {QUICK_TEXTS[name]}, samples: 3}}\n" for name in ("math", "code"))
    adapters = (f"  depth: {depth}\n  depth_rank: 2\n  adapter_init: delta\n  router_states: block_input\n"
                if depth else "")
    run_surgery(merge_yaml(family) + SURGERY.format(steps=steps, blocks=adapters, cache=root / "cache") + blocks, str(out))
    return str(out)


@pytest.fixture(scope="module")
def outputs(tiny_family, tmp_path_factory):
    """Repaired tiny merges whose routers read the embeddings (depth all, ``router_states: block_input``),
    the final states (depth 0, the default states) and a middle block's input (depth 1, block_input)."""
    root = tmp_path_factory.mktemp("serving")
    return {"all": repaired(tiny_family, root, "all"), 0: repaired(tiny_family, root, 0, steps=2),
            1: repaired(tiny_family, root, 1)}


def prompts(vocab, count=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=generator)),),
                          generator=generator).tolist() for _ in range(count)]


def transformers_routes(out, ids_list):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    return [model.route_domains(torch.tensor([ids]))[0] for ids in ids_list]


class StandInEngine:
    """A llama-server stand-in on a free localhost port: adapters ``lora-math.gguf`` (id 0) and
    ``lora-code.gguf`` (id 1); completions echo the body they got; ``/embeddings`` pools the plain
    merge's final-norm states (mean, then L2) as llama-server's mean pooling does."""

    def __init__(self, merged=None, adapters=("lora-math.gguf", "lora-code.gguf")):
        self.bodies, self.model = [], None
        if merged is not None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def send(self, payload, status=200):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/lora-adapters":
                    return self.send([{"id": i, "path": f"/models/{name}", "scale": 0.0} for i, name in enumerate(adapters)])
                self.send({"data": [{"id": "base.gguf"}]} if self.path == "/v1/models" else {"status": "ok"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/embeddings":
                    with torch.no_grad():
                        states = engine.model.model(input_ids=torch.tensor([body["content"]])).last_hidden_state[0]
                    return self.send([{"index": 0, "embedding": [torch.nn.functional.normalize(states.mean(0), dim=0).tolist()]}])
                engine.bodies.append(body)
                if not body.get("stream"):
                    return self.send({"object": "text_completion", "choices": [{"text": "ok"}], "echo": body})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for piece in ("o", "k"):
                    self.wfile.write(b"data: " + json.dumps({"choices": [{"text": piece}]}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def running(outputs):
    """(router URL, stand-in engine) for the depth-all output, the router serving on a free port."""
    from transformers import AutoTokenizer

    from mergekit_darts.serving.proxy import RoutedProxy, engine_adapters, serve
    from mergekit_darts.serving.states import Router

    engine = StandInEngine()
    router = Router(outputs["all"])
    proxy = RoutedProxy(router, AutoTokenizer.from_pretrained(outputs["all"]), engine.url,
                        engine_adapters(engine.url, router.domains))
    server = serve(proxy, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", engine, proxy
    server.shutdown()
    server.server_close()
    engine.close()


def post(url, path, body, raw=None):
    request = urllib.request.Request(url + path, data=raw if raw is not None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_sources_follow_what_the_router_reads(outputs):
    from mergekit_darts.errors import FormatError
    from mergekit_darts.serving.states import Router, default_source

    assert default_source(outputs["all"]) == "embeddings"
    assert default_source(outputs[0]) == "engine"
    assert default_source(outputs[1]) == "local"
    with pytest.raises(FormatError, match="--states-engine"):
        Router(outputs[0])
    with pytest.raises(FormatError, match="past the embeddings"):
        Router(outputs[1], "embeddings")
    with pytest.raises(FormatError, match="final states"):
        Router(outputs["all"], "engine", "http://127.0.0.1:9")


def test_embedding_rows_route_as_transformers(outputs):
    """The router in front of the engine picks, from OUT's embedding rows alone, the domain the emitted
    model's ``route_domains`` picks (the decision ``darts_domain="auto"`` makes), "none" included."""
    from mergekit_darts.serving.states import Router

    router = Router(outputs["all"])
    ids_list = prompts(125)  # the tiny family's vocabulary
    picked = [router.pick(ids) for ids in ids_list]
    assert picked == transformers_routes(outputs["all"], ids_list)
    assert len(set(picked)) >= 2, picked  # the prompts exercise more than one decision
    with pytest.raises(ValueError, match="outside the vocabulary"):
        router.pick([10_000])


def test_engine_states_and_local_route_as_transformers(outputs, tiny_family):
    """A final-state router reads a llama-server embeddings endpoint (mean pooling on the plain merge);
    a middle-block router runs OUT in transformers: both decide as ``route_domains``."""
    from mergekit_darts.serving.states import Router

    engine = StandInEngine(merged=tiny_family["merged"])
    try:
        ids_list = prompts(125, count=25, seed=1)
        assert [Router(outputs[0], "engine", engine.url).pick(ids) for ids in ids_list] == transformers_routes(outputs[0], ids_list)
    finally:
        engine.close()
    local = Router(outputs[1], "local")
    assert [local.pick(ids) for ids in ids_list] == transformers_routes(outputs[1], ids_list)


def test_requests_are_routed_and_forwarded_with_every_adapter_listed(running, outputs):
    url, engine, proxy = running
    ids_list = prompts(125, count=12, seed=2)
    expected = transformers_routes(outputs["all"], ids_list)
    for ids, want in zip(ids_list, expected):
        status, headers, data = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0})
        answer = json.loads(data)
        assert status == 200 and answer["darts_domain"] == want and headers["X-Darts-Domain"] == want
        sent = engine.bodies[-1]
        assert sent["prompt"] == ids and sent["max_tokens"] == 4 and "darts_domain" not in sent
        assert sent["lora"] == [{"id": 0, "scale": float(want == "math")}, {"id": 1, "scale": float(want == "code")}]
    # a string prompt is forwarded as the token ids it was routed on; the request may name its domain
    status, _, data = post(url, "/v1/completions", {"prompt": "add 3 and 4", "darts_domain": "code"})
    assert json.loads(data)["darts_domain"] == "code" and engine.bodies[-1]["lora"][1]["scale"] == 1.0
    from transformers import AutoTokenizer

    assert engine.bodies[-1]["prompt"] == AutoTokenizer.from_pretrained(outputs["all"])("add 3 and 4")["input_ids"]
    status, _, data = post(url, "/v1/completions", {"prompt": "add 3 and 4", "darts_domain": "none"})
    assert json.loads(data)["darts_domain"] == "none" and all(e["scale"] == 0.0 for e in engine.bodies[-1]["lora"])
    # a chat is routed on its chat-templated tokens and forwarded as messages (the engine templates it)
    messages = [{"role": "user", "content": [{"type": "text", "text": "write code to reverse a list"}]}]
    status, headers, data = post(url, "/v1/chat/completions", {"messages": messages})
    assert status == 200 and engine.bodies[-1]["messages"] == messages and "prompt" not in engine.bodies[-1]
    assert proxy.counts[json.loads(data)["darts_domain"]] >= 1


def test_streaming_chunks_name_the_domain(running):
    url, engine, _ = running
    status, headers, data = post(url, "/v1/completions", {"prompt": [3, 4, 5], "stream": True, "darts_domain": "math"})
    lines = [line for line in data.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and headers["Content-Type"] == "text/event-stream" and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["o", "k"] and {c["darts_domain"] for c in chunks} == {"math"}
    assert engine.bodies[-1]["stream"] is True


@pytest.mark.parametrize("path, body, raw, status, field", [
    ("/v1/completions", {"prompt": [1, 2], "lora": [{"id": 0, "scale": 1}]}, None, 400, "lora:"),
    ("/v1/completions", {"prompt": ["a", "b"]}, None, 400, "prompt:"),
    ("/v1/completions", {"prompt": ""}, None, 400, "prompt:"),
    ("/v1/completions", {"prompt": [1, -2]}, None, 400, "prompt:"),
    ("/v1/completions", {"prompt": [10_000]}, None, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "darts_domain": "poetry"}, None, 400, "darts_domain:"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400, "stream:"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "messages:"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
     "messages[0].content"),
    ("/v1/completions", None, b"{not json", 400, "not valid JSON"),
    ("/v1/completions", None, b"[1, 2]", 400, "body:"),
    ("/v1/embeddings", {"input": "x"}, None, 404, "not served here"),
])
def test_bad_requests_are_refused_naming_the_field(running, path, body, raw, status, field):
    url, engine, _ = running
    before = len(engine.bodies)
    got, _, data = post(url, path, body, raw)
    assert got == status and field in json.loads(data)["error"]["message"]
    assert len(engine.bodies) == before  # nothing reached the engine


def test_passthrough_and_adapter_mapping(running, outputs):
    from mergekit_darts.serving.proxy import engine_adapters

    url, engine, _ = running
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        assert json.loads(response.read())["data"][0]["id"] == "base.gguf"
    assert engine_adapters(engine.url, ["math", "code"]) == {"math": 0, "code": 1}
    assert engine_adapters(engine.url, ["math", "code"], {"math": 1, "code": 0}) == {"math": 1, "code": 0}
    other = StandInEngine(adapters=("lora-math.gguf",))
    try:
        with pytest.raises(ValueError, match="no LoRA adapter for code"):
            engine_adapters(other.url, ["math", "code"])
        with pytest.raises(ValueError, match="not loaded"):
            engine_adapters(other.url, ["math", "code"], {"code": 5})
    finally:
        other.close()


def test_serve_command_says_why_it_did_not_start(outputs):
    """An unreachable engine and a final-state router without an embeddings engine: one line, exit 1."""
    command = [os.path.join(os.path.dirname(sys.executable), "mergekit-darts"), "serve"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for target, expected in ((outputs["all"], "unreachable"), (outputs[0], "--states-engine")):
        result = subprocess.run(command + [target, "--engine", "http://127.0.0.1:9"], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode != 0 and expected in result.stderr, result.stderr
        assert result.stderr.strip().count("\n") == 0, result.stderr


@pytest.mark.skipif(not os.environ.get("LLAMA_SERVER"), reason="no llama-server binary given (LLAMA_SERVER=path; "
                    "benchmarks/serving/routed_llama_server.py builds one from llama.cpp's source)")
def test_real_llama_server(tmp_path):
    """The router in front of a real llama-server, by the benchmark's quick path: a repaired SmolLM2 pair
    (the demo's toy tokenizer has no llama.cpp pre-tokenizer) through export-gguf and the real converters
    (LLAMA_SERVER inside llama.cpp's build/bin), routing and greedy answers against transformers. About
    25 minutes on 2 cores, most of it the pair's repair."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "serving", "routed_llama_server.py")
    result = subprocess.run([sys.executable, script, "--llama-server", os.environ["LLAMA_SERVER"], "--quick",
                             "--workdir", str(tmp_path), "--output", str(tmp_path / "result.json")],
                            capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads((tmp_path / "result.json").read_text())
    assert figures["same_domain_share"] >= 0.99 and figures["unexplained_mismatches"] == 0
    assert figures["same_tokens_share"] >= 0.9  # the rest: near ties the two float32 sides order differently
