"""The names of choices the engine's options take that layers and loaders also know (host only, no jax): what
`EngineConfig` checks a value against, so the config reads them without importing the code behind them."""

KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # int8 and fp8 (e4m3) keep a float32 scale per token
LOAD_FORMATS = ("auto", "dummy")  # auto: the checkpoint's weights; dummy: random weights (loading/dummy.py)
