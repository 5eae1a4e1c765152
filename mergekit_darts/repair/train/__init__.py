"""Training: one domain's correction on its cached states (``loop.py``: the training step), its
losses (one exact KL in ``kl.py``), data splits and the choice of lr and stopping step."""
