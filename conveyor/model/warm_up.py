"""`python -m conveyor.model.warm_up`: the one-time work of a new machine, done at set-up
(`make` runs it after installing) instead of at the first start of a server or test: the
compiled CPU kernels (kernels/, quant/), the matmul forms that run fastest here (measured on
a machine that is otherwise quiet, at torch's default thread count, for float32 and float64)
and the default model's config and tokenizer, which transformers converts from its GGUF once
(all cached under conveyor's cache folder). Safe to run again: what is cached is loaded, and
the matmul forms are measured again. Failures are reported and leave the set-up going; the
first start then does the work (or falls back, as it would anyway)."""

from __future__ import annotations

import logging
import sys
import time


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    start = time.monotonic()
    from conveyor.model import kernels, quant

    attention = kernels.load() is not None
    quantized = quant.kernels_available()
    import torch

    from conveyor.model.layers import keep_measured_forms

    try:
        for dtype in (torch.float32, torch.float64):
            keep_measured_forms(dtype)
        forms = "measured"
    except OSError as error:  # a read-only cache: each process measures for itself
        forms = f"not kept ({error})"
    try:
        from conveyor.model.config import ModelConfig, load_tokenizer

        load_tokenizer(ModelConfig.from_hf(None))
        model = "ready"
    except Exception as error:  # noqa: BLE001 - the first start will say it again
        model = f"not prepared ({type(error).__name__}: {error})"
    print(
        f"conveyor warm-up: attention kernels {'built' if attention else 'unavailable'}, "
        f"quantized kernels {'built' if quantized else 'unavailable'}, matmul forms {forms}, "
        f"default model {model} "
        f"({time.monotonic() - start:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
