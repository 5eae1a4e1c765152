"""Repair steps on a merged directory, by stage: ``capture/`` (models, placement, cache, calibration,
block inputs), ``train/`` (the modules' training loop, losses, selection), ``report/`` (held-out
measurements, figure, table, verdicts), plus the router's training and the parameter budget."""
