"""Publish an output directory to the Hugging Face Hub, after checking that it is complete.

``check_publishable`` reads only file names, JSON and safetensors headers (torch-free, seconds on a
7B directory) and refuses what would publish a broken model: the staging folder of an interrupted
surgery, a shard the index names but the folder lacks or holds truncated, a config whose ``darts``
entry does not describe the tensors present, missing model code, no model card. ``push`` then runs
``huggingface_hub``'s ``create_repo`` (``exist_ok``) and ``upload_folder``; the token comes from the
usual places (``HF_TOKEN``, ``hf auth login``) and the endpoint from ``HF_ENDPOINT``.
"""

import os
from typing import Dict, Optional

from mergekit_darts.errors import DartsError, FormatError, first_line
from mergekit_darts.output.card import CARD_BEGIN
from mergekit_darts.output.check import RERUN, check_directory, check_output_dir, shard_problem
from mergekit_darts.output.layout import (
    CARD, DARTS_KEY, DARTS_SHARD, DARTS_TENSOR_PREFIX, DOMAIN_KEY, INDEX, MODELING_FILES, NONE_DOMAIN, STAGING_PREFIX,
    read_config, read_json,
)



class PushError(DartsError):
    """The directory cannot be published as it is, or the Hub refused the upload."""


def check_publishable(out_dir: str) -> Dict[str, object]:
    """Raise PushError naming the first reason ``out_dir`` is not a complete mergekit-darts output;
    return a summary ({"domains": [...], "files": N, "bytes": B}) when it is."""
    try:
        check_directory(out_dir)
    except FormatError as error:
        raise PushError(str(error)) from None
    names = sorted(os.listdir(out_dir))
    leftovers = [n for n in names if n.startswith(STAGING_PREFIX)]
    if leftovers:
        raise PushError(f"{out_dir}: {leftovers[0]} is left over from an interrupted surgery, so the directory may "
                        f"be half-written; {RERUN}")
    try:
        config = read_config(out_dir)
        entry = check_output_dir(out_dir, weights=False)  # shards: checked below
    except FormatError as error:
        raise PushError(f"{error}; `push` publishes mergekit-darts outputs (`hf upload` publishes anything)") from None
    domains = entry.get("domains")
    if not isinstance(domains, dict) or not domains:
        raise PushError(f"{out_dir}/config.json: the '{DARTS_KEY}' entry names no domains; {RERUN}")
    active = config.get(DOMAIN_KEY, NONE_DOMAIN)
    if active != NONE_DOMAIN and active not in domains:
        raise PushError(f"{out_dir}/config.json: {DOMAIN_KEY}={active!r} is not one of its domains {sorted(domains)}")
    if not os.path.isfile(os.path.join(out_dir, INDEX)):
        raise PushError(f"{out_dir}: no {INDEX}; {RERUN}")
    try:
        weight_map = read_json(os.path.join(out_dir, INDEX))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PushError(f"{os.path.join(out_dir, INDEX)}: unreadable ({error}); {RERUN}") from None
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(out_dir, shard)
        if not os.path.isfile(path):
            raise PushError(f"{out_dir}: {INDEX} names {shard}, which is missing; {RERUN}")
        problem = shard_problem(path)
        if problem:
            raise PushError(f"{os.path.join(out_dir, shard)}: {problem}; {RERUN}")
    missing_tensors = [f"{DARTS_TENSOR_PREFIX}{d}.{p}" for d in domains for p in ("down.weight", "up.weight")
                       if weight_map.get(f"{DARTS_TENSOR_PREFIX}{d}.{p}") != DARTS_SHARD]
    if missing_tensors:
        raise PushError(f"{out_dir}: config.json names domains {sorted(domains)} but {INDEX} maps no "
                        f"{missing_tensors[0]} to {DARTS_SHARD}; {RERUN}")
    absent = [n for n in MODELING_FILES if n not in names]
    if absent or not config.get("auto_map"):
        raise PushError(f"{out_dir}: the model code ({', '.join(absent) or 'auto_map in config.json'}) is missing, "
                        f"so trust_remote_code loading would fail; {RERUN}")
    card = os.path.join(out_dir, CARD)
    if not os.path.isfile(card) or CARD_BEGIN not in _read(card):
        raise PushError(f"{out_dir}: no model card ({CARD} with the 'Representation surgery' section that says how "
                        f"to load the domains); {RERUN}")
    files = [n for n in names if os.path.isfile(os.path.join(out_dir, n))]
    return {"domains": list(domains), "files": len(files),
            "bytes": sum(os.path.getsize(os.path.join(out_dir, n)) for n in files)}


def push(out_dir: str, repo_id: str, private: bool = False, token: Optional[str] = None,
         commit_message: str = "Upload a mergekit-darts merge", endpoint: Optional[str] = None) -> Dict[str, object]:
    """Check ``out_dir`` (``check_publishable``), create ``repo_id`` if needed, upload the folder.

    Returns {"url", "commit", "files", ...}. ``endpoint`` defaults to ``HF_ENDPOINT`` read now (so a
    variable set after huggingface_hub was imported still counts), else huggingface.co.
    """
    summary = check_publishable(out_dir)
    import huggingface_hub
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise PushError("push: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it (HF_HUB_OFFLINE=0)")
    token = token or huggingface_hub.get_token()
    if not token:
        raise PushError("push: no Hugging Face token; set HF_TOKEN or run `hf auth login` (a token with write access)")
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=url.repo_id, folder_path=out_dir, repo_type="model",
                                   commit_message=commit_message)
    except (HfHubHTTPError, OfflineModeIsEnabled) as error:
        raise PushError(f"push {repo_id}: the Hub refused: {first_line(error)}") from None
    except Exception as error:  # noqa: BLE001 - connection refused, DNS, TLS, timeouts: httpx/requests alike
        raise PushError(f"push {repo_id}: cannot reach the Hub at {api.endpoint} ({type(error).__name__}: "
                        f"{first_line(error)}); check the network, HF_ENDPOINT and any proxy, then push again") from None
    return {"url": str(url), "repo_id": url.repo_id, "commit": getattr(commit, "oid", None), **summary}



def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()
