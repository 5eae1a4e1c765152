"""Where the router in front of an engine gets the prompt states its decision reads.

A repaired output's router (config.json ``darts.router``, tensors ``darts.router.*``) reads one of two
kinds of uncorrected states, pooled as ``normalize(mean_t h_t)`` over the prompt (remote_code/routing.py):

- ``states: "block_input"`` (``router_states: block_input``) with adapters in every block (``depth: all``):
  the token embeddings. Read here from OUT's own embedding matrix (a few rows per prompt, memory-mapped): no
  engine call, microseconds per request.
- ``states: "final"`` (the default): the plain merge's final-norm output. llama-server computes exactly that for
  ``/embeddings`` when started with ``--embeddings --pooling mean`` on the plain merge's GGUF (mean over
  the tokens, then the Euclidean norm: the same pooling), so a second llama-server on the same base GGUF
  answers it (one prefill of the prompt per request).
- ``local``: the emitted model in transformers, ``route_domains`` itself (any router, including
  ``block_input`` at a middle block, which no engine exposes); a forward of the plain merge's blocks
  per request on this process's device.
"""

import json
import os
import urllib.request
from typing import Callable, List, Optional

from mergekit_darts.errors import FormatError
from mergekit_darts.output.layout import NONE_DOMAIN, read_config, read_darts_entry, read_shape
from mergekit_darts.weight_files import DARTS_SHARD

ROUTER_TENSORS = ("weight", "bias", "centroids", "similarity_mean", "similarity_std")
SOURCES = ("embeddings", "engine", "local")


def _weight_files(out: str) -> List[str]:
    return sorted(os.path.join(out, name) for name in os.listdir(out)
                  if name.endswith(".safetensors") and name != DARTS_SHARD)


def load_router(out: str):
    """OUT's DomainRouter (float32, CPU) and the states it reads; FormatError when OUT has none."""
    import torch
    from safetensors import safe_open

    from mergekit_darts.remote_code.routing import DomainRouter

    entry = read_darts_entry(out)
    if not isinstance(entry.get("router"), dict):
        raise FormatError(f"{out}: has no router (config.json darts.router); re-run the surgery with "
                          "`router: true` in its surgery: block, or name each request's domain with darts_domain")
    depth = read_shape(entry)["depth"]
    router = DomainRouter.from_meta(entry["router"], read_config(out)["hidden_size"], blocks_adapted=depth > 0)
    with safe_open(os.path.join(out, DARTS_SHARD), "pt") as handle:
        for name in ROUTER_TENSORS:
            getattr(router, name).data.copy_(handle.get_tensor(f"darts.router.{name}").float())
    return router.eval(), depth


def default_source(out: str) -> str:
    """The cheapest source that gives OUT's router exactly its states: "embeddings" for a block-input
    router on every block, "engine" for a final-state router, "local" otherwise."""
    entry = read_darts_entry(out)
    router = entry.get("router") or {}
    depth = read_shape(entry)["depth"]
    layers = read_config(out).get("num_hidden_layers")
    if router.get("states", "final" if depth == 0 else "block_input") == "final":
        return "engine"
    return "embeddings" if depth == layers else "local"


class EmbeddingRows:
    """Token embedding rows of OUT's weights (``*embed_tokens.weight``), read on demand."""

    def __init__(self, out: str):
        from safetensors import safe_open

        for path in _weight_files(out):
            handle = safe_open(path, "pt")
            names = [name for name in handle.keys() if name.endswith("embed_tokens.weight")]
            if names:
                self.rows, self.name = handle.get_slice(names[0]), names[0]
                self.handle = handle
                return
        raise FormatError(f"{out}: no *embed_tokens.weight tensor in its safetensors files; route with "
                          "--states local")

    def pooled(self, ids: List[int]):
        import torch

        from mergekit_darts.remote_code.routing import pool_prompt_states

        vocab = self.rows.get_shape()[0]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary ({vocab} rows of {self.name})")
        states = torch.cat([self.rows[t:t + 1] for t in ids]).float()
        return pool_prompt_states(states.unsqueeze(0))


class EngineStates:
    """Pooled final-norm states from a llama-server started with ``--embeddings --pooling mean`` on the
    plain merge's GGUF (``POST /embeddings`` with the token ids; it returns the normalised mean)."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def pooled(self, ids: List[int]):
        import torch

        request = urllib.request.Request(self.url + "/embeddings", data=json.dumps({"content": list(ids)}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            answer = json.loads(response.read())
        vectors = answer[0]["embedding"]
        if len(vectors) != 1:
            raise RuntimeError(f"{self.url}/embeddings returned {len(vectors)} vectors for one prompt: start that "
                               "server with --embeddings --pooling mean")
        return torch.tensor(vectors, dtype=torch.float32)


class Router:
    """``pick(ids)`` -> the domain OUT's router chooses for the prompt's token ids ("none" below its gate),
    the decision ``darts_domain="auto"`` makes in transformers."""

    def __init__(self, out: str, source: Optional[str] = None, engine_states_url: Optional[str] = None):
        source = source or default_source(out)
        if source not in SOURCES:
            raise ValueError(f"states: {source!r} is not one of {SOURCES}")
        needed = default_source(out)
        if source == "embeddings" and needed != "embeddings":
            raise FormatError(f"{out}: its router reads states past the embeddings; use --states engine or local")
        if source == "engine" and needed != "engine":
            raise FormatError(f"{out}: its router does not read the final states an embeddings server returns; "
                              f"use --states {needed}")
        if source == "engine" and not engine_states_url:
            raise FormatError("--states-engine: the router reads the plain merge's final states; start a second "
                              "llama-server with --embeddings --pooling mean on the base GGUF and give its URL "
                              "(or use --states local)")
        self.source = source
        self._pick: Callable[[List[int]], str]
        if source == "local":
            self._pick = self._local(out)
            self.domains = self._model.darts_domains
            return
        self.router, _ = load_router(out)
        self.domains = list(self.router.domains)
        states = EmbeddingRows(out) if source == "embeddings" else EngineStates(engine_states_url)
        self._pick = lambda ids: self._decide(states.pooled(ids))

    def _decide(self, pooled) -> str:
        index = int(self.router(pooled=pooled)[0])
        return self.router.domains[index] if index >= 0 else NONE_DOMAIN

    def _local(self, out: str):
        import torch
        from transformers import AutoModelForCausalLM

        self._model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        return lambda ids: self._model.route_domains(torch.tensor([list(ids)]))[0]

    def pick(self, ids: List[int]) -> str:
        if not ids:
            raise ValueError("an empty prompt has no states to route on")
        return self._pick(ids)
