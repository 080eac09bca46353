"""A hybrid model (Qwen3.5's gated delta nets beside attention) served by `conveyor serve` with
a vLLM user's serve line for it: concurrent completions from the openai client equal the
offline LLM's greedy answers (each request in its own state slot, whatever arrives beside
it), and a 16-bit state dtype, which conveyor does not offer, is refused at the command line."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
from conftest import DEVICE_FLAGS, random_prompts
from server_util import ServerProcess

from conveyor import LLM, SamplingParams

MAX_TOKENS = 12


def test_concurrent_completions_equal_the_offline_answers(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_5")
    prompts = random_prompts(6, 384, seed=9, max_len=40)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="32MiB")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [o.outputs[0].text for o in offline]
    llm.shutdown()
    args = [str(path), "--dtype", "float32", "--served-model-name", "tiny", *DEVICE_FLAGS]
    args += ["--mamba-ssm-cache-dtype", "float32", "--max-num-seqs", "4"]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")

        def complete(prompt: list[int]) -> str:
            reply = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return reply.choices[0].text

        with ThreadPoolExecutor(6) as pool:  # more requests than state slots: some wait
            answers = list(pool.map(complete, prompts))
        assert answers == expected
    finally:
        assert server.stop() == 0, (tmp_path / "server.log").read_text()[-2000:]


def test_a_16_bit_state_dtype_is_refused_at_the_command_line(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    command = [sys.executable, "-m", "conveyor", "serve", str(path)]
    result = subprocess.run(
        [*command, "--mamba-ssm-cache-dtype", "bfloat16"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "--mamba-ssm-cache-dtype" in result.stderr and "bfloat16" in result.stderr
