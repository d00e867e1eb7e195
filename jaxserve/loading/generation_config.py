"""generation_config.json: the extra EOS ids and the sampling defaults a checkpoint ships, chosen as vLLM's
`--generation-config` chooses them.

"auto" reads the model directory's file; "vllm" uses vLLM's neutral sampling defaults instead of the file's, but
(as in vLLM) still stops at the file's EOS ids; any other value is a directory whose file is read instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxserve.config import token_ids

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field, the keys vLLM takes as sampling defaults
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_file(option: str, model_dir: Path) -> Path:
    """The generation_config.json that `option` ("auto", "vllm" or a directory) selects for the model in `model_dir`."""
    if option in ("auto", "vllm"):
        return model_dir / FILE_NAME
    file = Path(option) / FILE_NAME
    if not file.is_file():
        raise ValueError(f"generation_config {option!r} is neither 'auto', 'vllm' nor a directory with {FILE_NAME}")
    return file


def read_generation_config(file: Path) -> dict[str, Any]:
    """The content of `file`, or {} if the model ships none."""
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from err


def generation_eos_token_ids(generation_config: dict[str, Any]) -> tuple[int, ...]:
    return token_ids(generation_config.get("eos_token_id"))


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams defaults that `generation_config` sets, under SamplingParams' names (`max_tokens`)."""
    return {field: generation_config[key] for key, field in SAMPLING_KEYS.items()
            if generation_config.get(key) is not None}
