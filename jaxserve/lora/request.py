"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and directory: `lora_path` holds PEFT's `adapter_config.json` and
    `adapter_model.safetensors`. `lora_int_id` (>= 1) identifies the adapter to the engine's caches, as in vLLM;
    requests naming one id with another path are refused while the first is cached."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path must name its directory, "
                             f"got {self.lora_path!r}")
