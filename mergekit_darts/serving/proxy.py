"""``mergekit-darts serve``: an OpenAI-compatible router in front of llama-server (docs/serving.md).

Each ``POST /v1/completions`` or ``/v1/chat/completions`` is tokenized with OUT's own tokenizer (a chat
with its chat template and the generation prompt, as ``apply_chat_template`` writes it for
transformers), routed by OUT's router (``states.Router``) unless the request names ``darts_domain``, and
forwarded to llama-server with a ``lora`` list that applies only that domain's adapter. A completion is
forwarded as the token ids it was routed on. The answer (each chunk, when streaming) gets a
``darts_domain`` field and an ``X-Darts-Domain`` header. ``GET /v1/models``, ``/health`` and
``/lora-adapters`` are passed through; every other path is a 404.
"""

import http.client
import json
import logging
import os
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional

from mergekit_darts.serving.requests import (AUTO, CHAT, COMPLETIONS, ENDPOINTS, MAX_BODY_BYTES, RequestError,
                                             chat_messages, check_body, completion_prompt, forwarded_body,
                                             requested_domain)

LOG = logging.getLogger(__name__)
PASSED_THROUGH = ("/v1/models", "/health", "/lora-adapters")


def engine_adapters(engine_url: str, domains: List[str], given: Optional[Dict[str, int]] = None,
                    timeout: float = 30.0) -> Dict[str, int]:
    """domain -> llama-server adapter id, from ``GET /lora-adapters``: the adapter whose file is named
    ``<domain>.gguf`` or ``lora-<domain>.gguf`` (``export-gguf`` writes the latter), unless ``given``."""
    with urllib.request.urlopen(engine_url.rstrip("/") + "/lora-adapters", timeout=timeout) as response:
        loaded = json.loads(response.read())
    ids = {entry["id"] for entry in loaded}
    found = dict(given or {})
    for entry in loaded:
        stem = os.path.basename(entry["path"]).rsplit(".gguf", 1)[0]
        for domain in domains:
            if domain not in found and stem in (domain, f"lora-{domain}"):
                found[domain] = entry["id"]
    missing = [domain for domain in domains if domain not in found]
    if missing:
        raise ValueError(f"--engine {engine_url}: no LoRA adapter for {', '.join(missing)} among "
                         f"{[entry['path'] for entry in loaded]}; start llama-server with --lora lora-<domain>.gguf "
                         "for each domain, or map them with --adapter DOMAIN=ID")
    wrong = {domain: index for domain, index in found.items() if index not in ids}
    if wrong:
        raise ValueError(f"--adapter: ids {wrong} are not loaded in {engine_url} (it has {sorted(ids)})")
    return found


class RoutedProxy:
    """The routing and forwarding, apart from HTTP so that tests drive it directly."""

    def __init__(self, router, tokenizer, engine_url: str, adapters: Dict[str, int], timeout: float = 600.0):
        self.router, self.tokenizer, self.adapters, self.timeout = router, tokenizer, adapters, timeout
        parsed = urllib.parse.urlsplit(engine_url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"--engine: expected http://HOST:PORT, got {engine_url!r}")
        self.engine_host, self.engine_port = parsed.hostname, parsed.port or 80
        self.counts: Dict[str, int] = {}
        self._lock = threading.Lock()

    def prompt_ids(self, endpoint: str, body: dict) -> List[int]:
        if endpoint == CHAT:
            encoded = self.tokenizer.apply_chat_template(chat_messages(body), add_generation_prompt=True,
                                                         tokenize=True, return_dict=True)
            return list(encoded["input_ids"])
        prompt = completion_prompt(body)
        return list(prompt) if isinstance(prompt, list) else list(self.tokenizer(prompt)["input_ids"])

    def route(self, endpoint: str, body) -> tuple:
        """(domain, body for the engine) of a request; RequestError for a bad one."""
        check_body(endpoint, body)
        domain = requested_domain(body, list(self.router.domains))
        ids = self.prompt_ids(endpoint, body)
        if domain == AUTO:
            try:
                domain = self.router.pick(ids)
            except ValueError as error:  # a token id outside the vocabulary, an empty prompt
                raise RequestError(f"prompt: {error}") from None
        with self._lock:
            self.counts[domain] = self.counts.get(domain, 0) + 1
        return domain, forwarded_body(body, self.adapters, domain, ids if endpoint == COMPLETIONS else None)

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.engine_host, self.engine_port, timeout=self.timeout)


def with_domain(line: bytes, domain: str) -> bytes:
    """An SSE line ``data: {...}`` with ``"darts_domain"`` added; other lines unchanged."""
    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
        return line
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return line
    if isinstance(chunk, dict):
        chunk["darts_domain"] = domain
        return b"data: " + json.dumps(chunk).encode() + b"\n"
    return line


def make_handler(proxy: RoutedProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body leave in two writes: without TCP_NODELAY the body waits for the client's
        # delayed ACK (~40 ms a request on Linux)
        disable_nagle_algorithm = True

        def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
            LOG.debug(format, *args)

        def _reply(self, status: int, payload: dict, domain: Optional[str] = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if domain is not None:
                self.send_header("X-Darts-Domain", domain)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._reply(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path.split("?")[0] not in PASSED_THROUGH:
                return self._error(404, f"{self.path}: not served here (POST {' or '.join(ENDPOINTS)})")
            connection = proxy.connect()
            try:
                connection.request("GET", self.path)
                answer = connection.getresponse()
                data = answer.read()
            except OSError as error:
                return self._error(502, f"engine unreachable: {error}")
            finally:
                connection.close()
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.getheader("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802
            endpoint = self.path.split("?")[0]
            if endpoint not in ENDPOINTS:
                return self._error(404, f"{self.path}: not served here (POST {' or '.join(ENDPOINTS)})")
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._error(411, "Content-Length: required")
            if not 0 < length <= MAX_BODY_BYTES:
                return self._error(413, f"body: {length} bytes; at most {MAX_BODY_BYTES}")
            try:
                body = json.loads(self.rfile.read(length))
                domain, forwarded = proxy.route(endpoint, body)
            except ValueError as error:  # RequestError, or a body that is not JSON
                message = str(error) if isinstance(error, RequestError) else f"body: not valid JSON ({error})"
                return self._error(400, message)
            connection = proxy.connect()
            try:
                connection.request("POST", endpoint, json.dumps(forwarded), {"Content-Type": "application/json"})
                answer = connection.getresponse()
                if forwarded.get("stream") and answer.status == 200:
                    return self._stream(answer, domain)
                data = answer.read()
            except OSError as error:
                return self._error(502, f"engine unreachable: {error}")
            finally:
                connection.close()
            try:
                payload = json.loads(data)
            except ValueError:
                payload = {"error": {"message": data.decode(errors="replace"), "code": answer.status}}
            if answer.status == 200 and isinstance(payload, dict):
                payload["darts_domain"] = domain
            self._reply(answer.status, payload, domain)

        def _stream(self, answer, domain: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.send_header("X-Darts-Domain", domain)
            self.end_headers()
            self.close_connection = True
            while True:
                line = answer.readline()
                if not line:
                    break
                self.wfile.write(with_domain(line, domain))
                if line.strip() == b"":
                    self.wfile.flush()

    return Handler


def serve(proxy: RoutedProxy, host: str = "127.0.0.1", port: int = 8090) -> ThreadingHTTPServer:
    """A started-but-not-serving HTTP server (call ``serve_forever``); port 0 picks a free one."""
    server = ThreadingHTTPServer((host, port), make_handler(proxy))
    server.daemon_threads = True
    return server
