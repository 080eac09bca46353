"""`conveyor bench throughput`: offline throughput of `LLM.generate` on a whole workload at
once, as `vllm bench throughput` measures it. Outputs ignore EOS, so their lengths are exact,
except those constrained to a JSON schema (json-schema), which end when their JSON does."""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from conveyor.bench.datasets import sample_requests


class ThroughputResult(NamedTuple):
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def tokens_per_second(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    @property
    def output_tokens_per_second(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    def as_dict(self) -> dict:
        """vLLM's keys (elapsed_time, requests_per_second, tokens_per_second, ...) and more."""
        return {
            "elapsed_time": self.elapsed_s,
            "num_requests": self.num_requests,
            "total_num_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "total_input_tokens": self.num_prompt_tokens,
            "total_output_tokens": self.num_output_tokens,
            "requests_per_second": self.requests_per_second,
            "tokens_per_second": self.tokens_per_second,
            "output_tokens_per_second": self.output_tokens_per_second,
        }


def run(args: argparse.Namespace) -> ThroughputResult:
    from conveyor.entrypoints.args import engine_args
    from conveyor.entrypoints.llm import LLM
    from conveyor.sampling_params import SamplingParams
    from conveyor.structured import StructuredOutputs

    llm = LLM(engine_args(args))
    requests = sample_requests(args, llm.get_tokenizer())
    # vLLM's sampling for this benchmark: temperature 1, no top-p cut, exact output lengths.
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=1.0,
            ignore_eos=r.schema is None,
            max_tokens=r.output_len,
            structured_outputs=None if r.schema is None else StructuredOutputs(json=r.schema),
        )
        for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(
        [r.prompt_token_ids for r in requests], params, use_tqdm=not args.disable_tqdm
    )
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        num_requests=len(outputs),
        num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        num_output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        elapsed_s=elapsed,
    )


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(
        f"Throughput: {result.requests_per_second:.2f} requests/s, "
        f"{result.tokens_per_second:.2f} total tokens/s, "
        f"{result.output_tokens_per_second:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result.num_prompt_tokens}")
    print(f"Total num output tokens:  {result.num_output_tokens}")
    if args.save_result:
        print(f"Results saved to {save_result(args, result)}")
    return 0


def save_result(args: argparse.Namespace, result: ThroughputResult) -> Path:
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    data = result.as_dict() | {
        "date": date,
        "backend": "conveyor-throughput",
        "model": args.model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "dtype": args.dtype,
        "device": args.device,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
    }
    name = args.result_filename or f"conveyor-throughput-{date}.json"
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path
