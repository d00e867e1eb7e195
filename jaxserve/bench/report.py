"""What every `jaxserve bench` command shares around its measurement: the tokenizer it builds prompts with, the
`vllm bench`-style printed block, and the result JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence


def load_tokenizer(model: str | None):
    """The HF tokenizer of `model` (a HF dir, store dir or hub id) or of the default model, without loading
    weights."""
    from transformers import AutoTokenizer

    from jaxserve.loading import DEFAULT_MODEL, checkpoint_root, hub

    if model not in (None, DEFAULT_MODEL):
        path = hub.snapshot(model, what="tokenizer").path if hub.is_hub_id(model) else Path(model)
        if path.is_dir() and ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
            return AutoTokenizer.from_pretrained(str(path))
        from jaxserve.loading import load_model

        return load_model(model).tokenizer
    store = checkpoint_root() / DEFAULT_MODEL
    if (store / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(store))
    from jaxserve.loading import load_model  # converts the GGUF once, then the store has the tokenizer

    return load_model(None).tokenizer


def print_block(title: str, rows: Sequence[tuple[str, str]], width: int = 50) -> None:
    """`vllm bench`-style block: a '=' title bar, label/value rows, '-' section bars for rows with no value."""
    print("{s:{c}^{n}}".format(s=f" {title} ", n=width, c="="))
    for label, value in rows:
        if value == "":
            print("{s:{c}^{n}}".format(s=label, n=width, c="-"))
        else:
            pad = max(width - len(value), len(label) + 1)
            print(f"{label:<{pad}}{value}")
    print("=" * width, flush=True)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Writes `payload` as indented JSON (numpy values as lists), making the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n", encoding="utf-8")
    return path


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
