"""OpenAI-style request bodies the router accepts, and the body it forwards to llama-server.

The router reads four fields (the prompt, ``stream``, ``darts_domain`` and ``lora``) and checks each
here; every other field goes to the engine unchanged, which checks its own. A request carries one
prompt (the router picks one domain per request) and no ``lora`` list of its own (the router writes
it: every loaded adapter, the chosen domain's at scale 1 and the others at 0, as llama-server keeps
an unlisted adapter at its global scale otherwise).
"""

from typing import Dict, List, Optional

AUTO, NONE = "auto", "none"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
MAX_BODY_BYTES = 8 * 1024 * 1024


class RequestError(ValueError):
    """A request the router refuses: HTTP 400 with this message, naming the field."""


def _text_parts(content, where: str) -> str:
    """A message's ``content``: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise RequestError(f"{where}: expected a string or a list of {{\"type\": \"text\", \"text\": ...}} parts "
                       "(this router routes text prompts only)")


def chat_messages(body: dict) -> List[Dict[str, str]]:
    """``messages`` as a list of {role, content} with string contents (what a chat template reads)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of {\"role\": ..., \"content\": ...} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}]: expected an object with a string \"role\"")
        checked.append({"role": message["role"], "content": _text_parts(message.get("content", ""),
                                                                        f"messages[{i}].content")})
    return checked


def completion_prompt(body: dict):
    """``prompt``: one string, or one list of token ids (a list of prompts is refused: one domain each)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in prompt)):
        return prompt
    raise RequestError("prompt: expected one non-empty string or one list of token ids (the router picks one "
                       "domain per request: send several prompts as several requests)")


def requested_domain(body: dict, domains: List[str]) -> str:
    """``darts_domain``: "auto" (default: the router picks), "none" (the plain merge) or a domain name."""
    value = body.get("darts_domain", AUTO)
    if value not in (AUTO, NONE, *domains):
        raise RequestError(f"darts_domain: {value!r} is not one of {[AUTO, NONE, *domains]}")
    return value


def check_body(endpoint: str, body) -> None:
    """The fields the router reads; raises RequestError naming the first bad one."""
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object")
    if "lora" in body:
        raise RequestError("lora: set by the router from the domain it picks; name a domain with "
                           "\"darts_domain\" instead")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise RequestError("stream: expected true or false")
    if endpoint == CHAT:
        chat_messages(body)
    else:
        completion_prompt(body)


def forwarded_body(body: dict, adapters: Dict[str, int], domain: str, prompt_ids: Optional[List[int]] = None) -> dict:
    """The body for llama-server: ours without ``darts_domain``, with a ``lora`` list naming every loaded
    adapter (``adapters``: domain -> llama-server adapter id), ``domain``'s at scale 1 ("none": all 0).
    ``prompt_ids``: a completion's prompt as the token ids the router routed on, so the engine generates
    from exactly the tokens the decision read."""
    forwarded = {key: value for key, value in body.items() if key != "darts_domain"}
    forwarded["lora"] = [{"id": index, "scale": 1.0 if name == domain else 0.0}
                         for name, index in sorted(adapters.items(), key=lambda item: item[1])]
    if prompt_ids is not None:
        forwarded["prompt"] = list(prompt_ids)
    return forwarded
