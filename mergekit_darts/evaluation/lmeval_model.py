"""lm-eval's ``darts`` model: HFLM with ``darts_domain="auto"`` routed per request, on its context only.

lm-eval's ``hf`` model hands the emitted model whole batches of ``context + continuation`` tokens,
right-padded and without an attention mask, so ``auto`` would route each request on its answer as
well as its question (the choices of one question can land in different domains) and, with
``batch_size`` > 1, on the padding the other requests in the batch bring. Here every request is
routed before any scoring, by the model's own router (``route_domains``), on the tokens of its context
alone (the last ``max_length`` of them), one context per call, and remembered per context:

- loglikelihood: requests are grouped by routed domain and each group is scored by HFLM's own
  batching with that domain named, so all choices of a document share its context's domain and the
  numbers do not depend on the batch size or on which requests share a batch;
- loglikelihood_rolling (perplexity): each document is routed on its text (there is no prompt);
- generate_until: each prompt is routed alone and ``generate`` gets one domain name per row.

A fixed domain (``darts_domain=math``) is scored exactly as by ``hf``. Use it as
``lm_eval.simple_evaluate(model="darts", model_args="pretrained=out,trust_remote_code=True,darts_domain=auto")``
after importing this module, or from the shell:
``python -m mergekit_darts.evaluation.lmeval_model run --model darts --model_args ... --tasks ...``
(lm-eval's own command line with this model registered).
"""

import collections
import contextlib
import hashlib
from typing import Dict, List, Optional, Sequence

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from mergekit_darts.errors import EvaluationError
from mergekit_darts.output.layout import AUTO_DOMAIN

MODEL_NAME = "darts"


@register_model(MODEL_NAME)
class DartsLM(HFLM):
    """HFLM for a mergekit-darts directory; ``darts_domain`` is a domain, "none" or "auto"."""

    def __init__(self, pretrained, darts_domain: Optional[str] = None, **kwargs):
        if not kwargs.get("trust_remote_code"):
            raise EvaluationError(
                f"--model {MODEL_NAME}: {pretrained} is scored by the Python code in that directory "
                "(modeling_darts.py ...); add trust_remote_code=True to the model arguments if you trust it")
        if darts_domain is not None:
            kwargs["darts_domain"] = darts_domain  # validated by the model when it loads
        super().__init__(pretrained, **kwargs)
        if not hasattr(self.model, "route_domains"):
            raise EvaluationError(f"--model {MODEL_NAME}: {pretrained} is not a mergekit-darts output "
                                  "(its model has no darts domains); use --model hf")
        self.darts_domain = self.model.darts_domain
        if self.darts_domain == AUTO_DOMAIN and self.world_size > 1:
            # each process would score a different set of domain groups, and HFLM's batch-size search
            # and rolling windows synchronise the processes once per group
            raise EvaluationError(f"--model {MODEL_NAME} with darts_domain=auto runs in one process; launch it "
                                  "without data parallelism (accelerate launch) or name a domain")
        self.route_counts: Dict[str, int] = collections.Counter()  # requests scored per routed domain
        self._routes: Dict[bytes, str] = {}
        self._scoring_domain: Optional[str] = None  # set while a routed group is scored

    # ------------------------------------------------------------------------------ routing

    def route(self, tokens: Sequence[int]) -> str:
        """The domain ``auto`` picks for ``tokens`` (the last ``max_length``) routed alone; cached."""
        tokens = list(tokens)[-self.max_length:]
        key = hashlib.sha1(torch.tensor(tokens, dtype=torch.long).numpy().tobytes()).digest()
        if key not in self._routes:
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
            with torch.no_grad():
                self._routes[key] = self.model.route_domains(ids, torch.ones_like(ids))[0]
        return self._routes[key]

    @property
    def _routing(self) -> bool:
        return self.darts_domain == AUTO_DOMAIN and self._scoring_domain is None

    @contextlib.contextmanager
    def _scoring(self, domain: str):
        """Score with ``domain`` active (lm-eval calls the model as ``model(input_ids)``)."""
        self._scoring_domain = domain
        self.model.set_darts_domain(domain)
        try:
            yield
        finally:
            self._scoring_domain = None
            self.model.set_darts_domain(self.darts_domain)

    def _by_domain(self, items: list, domains: List[str], score) -> list:
        """``score(group)`` for each routed domain's group of ``items``, results back in order."""
        results: list = [None] * len(items)
        for domain in sorted(set(domains)):
            rows = [i for i, d in enumerate(domains) if d == domain]
            with self._scoring(domain):
                for row, result in zip(rows, score([items[i] for i in rows]), strict=True):
                    results[row] = result
            self.route_counts[domain] += len(rows)
        return results

    # ------------------------------------------------------------------------------ lm-eval's entry points

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if not self._routing:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        # request = ((context, continuation), context tokens, continuation tokens); the context tokens
        # are the context string's own encoding, the same for every continuation of a document
        domains = [self.route(context) for _, context, _ in requests]
        return self._by_domain(list(requests), domains, lambda group: super(DartsLM, self)._loglikelihood_tokens(
            group, disable_tqdm=disable_tqdm, override_bs=override_bs))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        if not self._routing:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        domains = [self.route([self.prefix_token_id] + self.tok_encode(request.args[0])) for request in requests]
        return self._by_domain(list(requests), domains, lambda group: super(DartsLM, self).loglikelihood_rolling(
            group, disable_tqdm=disable_tqdm))

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if not self._routing:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        mask = generation_kwargs.get("attention_mask")
        rows = [ids if mask is None else ids[mask[row].bool()] for row, ids in enumerate(context)]
        domains = [self.route(ids.tolist()) for ids in rows]  # each prompt alone, without its padding
        for domain in domains:
            self.route_counts[domain] += 1
        return super()._model_generate(context, max_length, stop, darts_domain=domains, **generation_kwargs)


def main() -> None:
    """lm-eval's command line with the ``darts`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
