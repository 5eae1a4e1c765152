"""Capture: calibration texts -> token ids -> the merged model's and each expert's final states and
entropies (and ``depth``'s block inputs), one model in memory at a time, cached on disk."""
