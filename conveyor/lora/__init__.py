"""Multi-LoRA serving: PEFT adapters on one base model, many of them in one batch.

    request.py   LoRARequest (vLLM's spelling) and LoRAConfig (max_loras, max_lora_rank, ...)
    adapter.py   a PEFT folder read and checked against the model's shapes (LoRAAdapter)
    registry.py  the adapters in host memory, by id (the engine core's, and the front end's check)
    slots.py     the resident set: stacked A/B tensors per layer and projection, max_loras slots
                 (LRU), and each step's deltas added to the projections' outputs per row group

The base model is never changed: each targeted projection's output gets
`(x @ A^T) @ B^T * scaling` added for the rows of the requests that name an adapter, on top
of whatever kernel (float panels, quantized blocks) computed it.
"""

from conveyor.config import LoRAConfig
from conveyor.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
