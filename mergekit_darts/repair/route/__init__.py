"""The domain router: fitting (router), prompt-prefix pooling (prefix), training and the gate (train), the surgery's router step (step)."""
