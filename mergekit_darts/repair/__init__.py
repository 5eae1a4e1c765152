"""Repair steps on a merged directory: calibration texts, capture, losses, training, bias report."""
