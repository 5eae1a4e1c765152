"""Serving a repaired merge outside transformers: the per-request router in front of llama-server
(``proxy``, ``states``, ``requests``) and the GGUF files it serves (``gguf``). docs/serving.md."""
