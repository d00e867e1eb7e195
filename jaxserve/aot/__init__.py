"""`jaxserve compile`: the engine's steps compiled for GPU and TPU targets that are not attached (`targets.py`)."""
