"""`mergekit-darts push`: refuses incomplete directories, uploads complete ones through huggingface_hub
to a local stand-in of the Hub API (127.0.0.1 only) that records every request."""

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mergekit_darts.output.push import PushError, check_publishable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HubStandIn(BaseHTTPRequestHandler):
    """Just enough of the Hub's REST API for create_repo + upload_folder (huggingface_hub 2.x): every
    file is declared "regular" at preupload, so its bytes arrive base64 inside the NDJSON commit."""

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, status, payload):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.requests.append(("GET", self.path, self.headers.get("authorization"), None))
        self._reply(404, {"error": f"stand-in has no GET {self.path}"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.requests.append(("POST", self.path, self.headers.get("authorization"), body))
        path = self.path.split("?")[0]
        base = f"http://127.0.0.1:{self.server.server_port}"
        if path == "/api/repos/create":
            data = json.loads(body)
            repo_id = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
            self.server.created.append(data)
            return self._reply(200, {"url": f"{base}/{repo_id}", "name": repo_id})
        if path == "/api/validate-yaml":
            return self._reply(200, {"errors": [], "warnings": []})
        if path.startswith("/api/models/") and "/preupload/" in path:
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                                "oid": None} for f in files]})
        if path.startswith("/api/models/") and "/commit/" in path:
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    value = item["value"]
                    assert value["encoding"] == "base64"
                    self.server.files[value["path"]] = base64.b64decode(value["content"])
                elif item["key"] == "header":
                    self.server.commit_header = item["value"]
            repo_id = path[len("/api/models/"):].split("/commit/")[0]
            return self._reply(200, {"commitUrl": f"{base}/{repo_id}/commit/{'a' * 40}", "commitOid": "a" * 40,
                                     "pullRequestUrl": None})
        return self._reply(404, {"error": f"stand-in has no POST {path}"})


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubStandIn)
    server.requests, server.created, server.files, server.commit_header = [], [], {}, None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def darts_out(tiny_family, tmp_path_factory):
    from helpers import quick_surgery_output

    root = tmp_path_factory.mktemp("push")
    return quick_surgery_output(tiny_family, root / "out", root / "cache")


def _copy(src, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(src, dest)
    return dest


def _push_cli(args, endpoint, token="hf_standin_token"):
    """The real command in a fresh process: HF_ENDPOINT is read when huggingface_hub is imported."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "PYTHONPATH": REPO,
           "HF_HOME": os.path.join(os.path.dirname(args[0]), "hf_home"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-c", "from mergekit_darts.cli import main; main()", "push", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_push_uploads_every_file_to_the_hub_stand_in(darts_out, hub, tmp_path):
    endpoint = f"http://127.0.0.1:{hub.server_port}"
    result = _push_cli([darts_out, "me/tiny-merge", "--private"], endpoint)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"to {endpoint}/me/tiny-merge" in result.stdout
    assert len(hub.created) == 1 and hub.created[0]["name"] == "tiny-merge"
    assert hub.created[0]["organization"] == "me" and hub.created[0]["visibility"] == "private"
    local = {n: open(os.path.join(darts_out, n), "rb").read() for n in os.listdir(darts_out)
             if os.path.isfile(os.path.join(darts_out, n))}
    assert hub.files == local  # every file, byte for byte
    for name in ("config.json", "darts.safetensors", "model.safetensors.index.json", "modeling_darts.py",
                 "surgery.py", "README.md"):
        assert name in hub.files
    assert hub.commit_header["summary"] == "Upload a mergekit-darts merge"
    posts = [(path.split("?")[0], auth) for method, path, auth, _ in hub.requests if method == "POST"]
    assert [p for p, _ in posts][:1] == ["/api/repos/create"] and any("/commit/main" in p for p, _ in posts)
    assert all(auth == "Bearer hf_standin_token" for _, auth in posts)
    # huggingface_hub 2.x also GETs its agent-harness registry for the user agent (a 404 is fine)
    assert {path for method, path, _, _ in hub.requests if method == "GET"} <= {"/api/agent-harnesses"}


def test_push_refuses_half_written_directories_before_any_request(darts_out, hub, tmp_path):
    def refused(directory, match):
        with pytest.raises(PushError, match=match):
            check_publishable(str(directory))

    out = _copy(darts_out, tmp_path / "a")
    (out / ".darts-staging-abc").mkdir()
    refused(out, "interrupted surgery")

    out = _copy(darts_out, tmp_path / "b")
    os.remove(out / "darts.safetensors")
    refused(out, "names darts.safetensors, which is missing")

    out = _copy(darts_out, tmp_path / "c")
    data = (out / "model-00001-of-00001.safetensors").read_bytes()
    (out / "model-00001-of-00001.safetensors").write_bytes(data[: len(data) // 2])
    refused(out, "truncated")

    out = _copy(darts_out, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    config["darts"] = "broken"
    (out / "config.json").write_text(json.dumps(config))
    refused(out, "no 'darts' entry")

    out = _copy(darts_out, tmp_path / "e")
    config = json.loads((out / "config.json").read_text())
    config["darts"]["domains"]["code"] = "/models/code"  # a domain without tensors
    (out / "config.json").write_text(json.dumps(config))
    refused(out, "maps no darts.code.down.weight")

    out = _copy(darts_out, tmp_path / "f")
    os.remove(out / "README.md")
    refused(out, "no model card")

    out = _copy(darts_out, tmp_path / "g")
    os.remove(out / "modeling_darts.py")
    refused(out, "model code")

    # through the command: one "Error:" line, exit status 2, and the Hub never contacted
    endpoint = f"http://127.0.0.1:{hub.server_port}"
    result = _push_cli([str(out), "me/tiny-merge"], endpoint)
    assert result.returncode == 2 and "Error:" in result.stderr and "model code" in result.stderr
    assert "Traceback" not in result.stderr
    assert hub.requests == []


def test_push_needs_a_token_and_the_network(darts_out, hub):
    endpoint = f"http://127.0.0.1:{hub.server_port}"
    result = _push_cli([darts_out, "me/tiny-merge"], endpoint, token=None)  # a fresh HF_HOME: no stored token
    assert result.returncode == 2 and "HF_TOKEN" in result.stderr and hub.requests == []
    from mergekit_darts.output import push as push_module

    summary = check_publishable(darts_out)
    assert summary["domains"] == ["math"] and summary["files"] >= 10
    import huggingface_hub

    assert huggingface_hub.constants.HF_HUB_OFFLINE  # conftest: the test session runs offline
    with pytest.raises(PushError, match="HF_HUB_OFFLINE"):
        push_module.push(darts_out, "me/tiny-merge", token="t", endpoint=endpoint)
    assert hub.requests == []


def test_check_only_uploads_nothing(darts_out, hub):
    result = _push_cli([darts_out, "me/tiny-merge", "--check-only"], f"http://127.0.0.1:{hub.server_port}")
    assert result.returncode == 0 and "complete" in result.stdout and hub.requests == []
