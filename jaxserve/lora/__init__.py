"""LoRA adapters served over one base model: the request type (`request.py`), PEFT's adapter format read and
checked (`peft_format.py`), the adapters' serving layout and device stack (`weights.py`), and the host bookkeeping
of the host cache and the device slots (`cache.py`). The layer arithmetic is `layers/lora.py`."""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
