"""Report: held-out bias and KL before/after surgery, the bias figure, the summary table, verdicts."""
