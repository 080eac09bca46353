"""Multi-LoRA: greedy tokens (and logprobs within 1e-6) of requests under random PEFT adapters
equal transformers + peft's for each adapter (float64, tiny random checkpoints), with three
adapters and the base model mixed in one batch: in one step, with chunked prefill, prefix-cache
hits, preemption, fewer slots than adapters (LRU loads), n-gram speculative decoding, and on
GGUF base models (dequantized in float64; served quantized in float32)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_KWARGS, assert_matches_reference, hf_greedy, random_prompts
from lora_util import ADAPTERS, make_adapter, peft_model

from conveyor import LLM, LLMEngine, SamplingParams
from conveyor.lora import LoRARequest

MAX_TOKENS = 8
NAMES = [None, *ADAPTERS]  # prompt i runs under NAMES[i % 4] (None: the base model)


def greedy(num: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0) for _ in range(num)]


@pytest.fixture(scope="module")
def case(tiny_checkpoint, tmp_path_factory):
    """The base checkpoint, its adapters, prompts (the last two repeat earlier prompts under
    other adapters), each prompt's adapter and the transformers + peft reference."""
    base = tiny_checkpoint("llama")
    folder = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: make_adapter(base, folder / name, seed=i + 1, **config)
        for i, (name, config) in enumerate(ADAPTERS.items())
    }
    prompts = random_prompts(8, 384, seed=5)
    prompts += [prompts[2], prompts[3]]  # the same prompt under another adapter
    names = [NAMES[i % 4] for i in range(8)] + ["attn", None]
    models = {name: peft_model(base, adapters.get(name)) for name in NAMES}
    reference = [
        hf_greedy(models[n], [p], MAX_TOKENS)[0] for n, p in zip(names, prompts, strict=True)
    ]
    base_reference = hf_greedy(models[None], prompts, MAX_TOKENS)
    requests = {n: LoRARequest(n, i, str(adapters[n])) for i, n in enumerate(NAMES) if n}
    loras = [requests.get(n) for n in names]
    return base, adapters, prompts, loras, reference, base_reference


def test_adapters_change_the_reference(case):
    """The adapters' deltas are large enough that dropping them changes the tokens."""
    *_, loras, reference, base_reference = case
    changed = [
        r[0] != b[0] for lora, r, b in zip(loras, reference, base_reference, strict=True) if lora
    ]
    assert sum(changed) >= len(changed) - 1


def test_three_adapters_and_the_base_in_one_step_match_peft(case):
    base, _, prompts, loras, reference, _ = case
    llm = LLM(str(base), dtype="float64", **DEVICE_KWARGS, enable_lora=True, max_loras=3,
              max_lora_rank=8, max_num_batched_tokens=4096, record_trace=True)  # fmt: skip
    outputs = llm.generate(prompts, greedy(len(prompts)), use_tqdm=False, lora_request=loras)
    assert len(llm.engine.trace[0].num_scheduled_tokens) == len(prompts)  # all in one step
    assert_matches_reference(outputs, reference)
    assert llm.engine.runner.lora.num_loads == 3


def test_chunks_prefix_hits_preemption_and_lru_slots_match_peft(case):
    """A budget of 16 tokens chunks the prompts, 9 blocks of 16 preempt, two slots for three
    adapters load them again and again, and a second run hits the prefix cache."""
    base, _, prompts, loras, reference, _ = case
    engine = LLMEngine(str(base), dtype="float64", **DEVICE_KWARGS, enable_lora=True, max_loras=2,
                       max_lora_rank=8, max_num_batched_tokens=16, num_blocks=9, block_size=16,
                       record_trace=True)  # fmt: skip
    for run in range(2):
        done = _run(engine, prompts, loras, f"run{run}-")
        assert_matches_reference(done, reference)
    stats = engine.get_stats().scheduler
    assert stats.num_preemptions_total > 0, "nothing preempted"
    assert stats.prefix_cache_hits > 0, "no prefix-cache hit"
    assert engine.runner.lora.num_loads > 3, "two slots for three adapters never reloaded"
    by_id = {f"run{r}-{i}": lora for r in range(2) for i, lora in enumerate(loras)}
    for step in engine.trace:  # the running batch never names more adapters than slots
        named = {by_id[i].lora_int_id for i in step.num_scheduled_tokens if by_id[i]}
        assert len(named) <= 2
    engine.check_integrity()


def _run(engine, prompts, loras, prefix: str):
    for i, (prompt, lora, params) in enumerate(
        zip(prompts, loras, greedy(len(prompts)), strict=True)
    ):
        engine.add_request(f"{prefix}{i}", prompt, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]


def test_the_same_prompt_under_two_adapters_shares_no_kv_block(case):
    base, _, prompts, loras, _, _ = case
    engine = LLMEngine(str(base), dtype="float64", **DEVICE_KWARGS, enable_lora=True,
                       max_loras=2, max_lora_rank=8)  # fmt: skip
    prompt, attn, mlp = prompts[2], loras[1], loras[2]  # the longest prompt
    cached = {}
    for request_id, lora in [("a", attn), ("b", mlp), ("c", None), ("d", mlp), ("e", None)]:
        _run_one(engine, request_id, prompt, lora, cached)
    hit = (len(prompt) - 1) // 16 * 16
    assert hit > 0
    assert cached == {"a": 0, "b": 0, "c": 0, "d": hit, "e": hit}


def _run_one(engine, request_id, prompt, lora, cached) -> None:
    engine.add_request(request_id, prompt, greedy(1)[0], lora_request=lora)
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached[out.request_id] = out.num_cached_tokens


def test_ngram_speculative_decoding_with_adapters_matches_peft(case):
    base, _, prompts, loras, reference, _ = case
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(str(base), dtype="float64", **DEVICE_KWARGS, enable_lora=True, max_loras=3,
              max_lora_rank=8, speculative_config=spec)  # fmt: skip
    outputs = llm.generate(prompts, greedy(len(prompts)), use_tqdm=False, lora_request=loras)
    assert llm.engine.get_stats().spec.num_draft_tokens > 0, "no draft was verified"
    assert_matches_reference(outputs, reference)


def test_structured_output_under_an_adapter(case):
    base, *_, loras, _, _ = case
    llm = LLM(str(base), dtype="float64", **DEVICE_KWARGS, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs={"regex": "[a-f]{3,6}"}
    )
    outputs = llm.generate(["The quick"] * 2, params, use_tqdm=False, lora_request=[loras[1], None])
    for out in outputs:
        text = out.outputs[0].text
        assert 3 <= len(text) <= 6 and set(text) <= set("abcdef"), text


@pytest.fixture(scope="module")
def gguf_case(tiny_checkpoint, tmp_path_factory):
    """The tiny llama as a Q8_0 GGUF, and an adapter made on it."""
    from gguf_util import transformers_config, write_gguf

    path = write_gguf(tiny_checkpoint("llama"), tmp_path_factory.mktemp("gguf") / "t.gguf", "Q8_0")
    config = transformers_config(path, tiny_checkpoint("llama"))  # its llama3 RoPE too
    adapter = make_adapter(path.parent, tmp_path_factory.mktemp("gguf-lora"), seed=7,
                           gguf_file=path.name, config=config, **ADAPTERS["all"])  # fmt: skip
    prompts = random_prompts(4, 384, seed=6, max_len=30)
    lora = LoRARequest("all", 1, str(adapter))
    models = [peft_model(path.parent, a, path.name, config) for a in (adapter, None)]
    reference, base_reference = (hf_greedy(m, prompts, MAX_TOKENS) for m in models)
    return path, prompts, lora, reference, base_reference, config


def test_adapter_on_a_dequantized_gguf_matches_peft(gguf_case):
    path, prompts, lora, reference, base_reference, _ = gguf_case
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS, enable_lora=True, max_lora_rank=8,
              max_num_batched_tokens=16)  # fmt: skip
    loras = [lora, None, lora, None]
    outputs = llm.generate(prompts, greedy(4), use_tqdm=False, lora_request=loras)
    want = [r if lora else b for r, b, lora in zip(reference, base_reference, loras, strict=True)]
    assert_matches_reference(outputs, want)


def test_adapter_on_a_quantized_base_keeps_it_quantized(gguf_case):
    """float32 serves the Q8_0 blocks as they are (int8 activations in the block kernels),
    with the deltas added in float32: teacher-forced on peft's greedy tokens, the logprobs
    are peft's (on the dequantized model) up to the activations' rounding, far closer than
    the base model's (the delta dropped would miss by ~2 nats a token)."""
    from conveyor.model import quant
    from conveyor.model.quant import QuantLinear

    if DEVICE_KWARGS["device"] != "cpu" or not quant.kernels_available():
        pytest.skip("the quantized CPU kernels do not run here")
    path, prompts, lora, reference, _, config = gguf_case
    llm = LLM(str(path), dtype="float32", enable_lora=True, max_lora_rank=8)
    assert isinstance(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    sequences = [p + r[0] for p, r in zip(prompts, reference, strict=True)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(sequences, params, use_tqdm=False, lora_request=lora)
    models = [peft_model(path.parent, a, path.name, config) for a in (lora.lora_path, None)]
    for out, seq in zip(outputs, sequences, strict=True):
        got = torch.tensor(
            [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
        )
        with_lora, without = (_teacher_forced(m, seq) for m in models)
        error = (got.double() - with_lora).abs()
        # Measured: mean 0.016-0.025, max < 0.08; the base model's own rounding is the same
        # size, and the adapter moves them by 1.5-3.5 on average.
        assert error.mean() < 0.1 and error.max() < 0.25, error
        assert (with_lora - without).abs().mean() > 10 * error.mean()


def _teacher_forced(model, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def test_adapter_steps_run_the_compiled_layers_and_the_modules_alike(case, monkeypatch):
    """With LoRA on, steps with and without adapter rows run the compiled decoder layers (which
    add the deltas after each projection); with the compiled layers off, the modules' hooks add
    the same deltas: both equal transformers + peft."""
    if DEVICE_KWARGS["device"] != "cpu":
        pytest.skip("the compiled layers run on the CPU")
    base, _, prompts, loras, reference, base_reference = case
    llm = LLM(str(base), dtype="float64", enable_lora=True, max_lora_rank=8)
    model = llm.engine.runner.model
    calls = []
    original = model._compiled_form
    model._compiled_form = lambda x, meta: calls.append(original(x, meta)) or calls[-1]
    out = llm.generate(prompts[:1], greedy(1), use_tqdm=False)
    assert_matches_reference(out, base_reference[:1])
    if not model._compiled:
        pytest.skip("the compiled kernels do not build here")
    assert all(form is not None for form in calls[1:]), "decode steps left the compiled layers"
    calls.clear()
    out = llm.generate(prompts[1:2], greedy(1), use_tqdm=False, lora_request=loras[1])
    assert_matches_reference(out, reference[1:2])
    assert all(form is not None for form in calls[1:]), "adapter steps left the compiled layers"
    llm.shutdown()
    monkeypatch.setenv("CONVEYOR_COMPILED_LAYERS", "0")
    modules = LLM(str(base), dtype="float64", enable_lora=True, max_lora_rank=8)
    out = modules.generate(prompts[1:2], greedy(1), use_tqdm=False, lora_request=loras[1])
    assert not modules.engine.runner.model._compiled
    assert_matches_reference(out, reference[1:2])


def test_adapters_in_an_engine_core_process_match_peft_and_are_listed(case):
    """LLMEngine(engine_process=True): add_lora reaches the core process (list_loras shows it,
    generation with it equals transformers + peft), and remove_lora forgets it there and in
    the front end; steps the core made while a call waited are not lost."""
    base, _, prompts, loras, reference, _ = case
    engine = LLMEngine(str(base), dtype="float64", **DEVICE_KWARGS, enable_lora=True,
                       max_loras=2, max_lora_rank=8, engine_process=True)  # fmt: skip
    try:
        first, second = loras[1], loras[2]
        assert engine.list_loras() == set()
        assert engine.add_lora(first)
        assert engine.list_loras() == {first.lora_int_id}
        engine.add_request("a", prompts[1], greedy(1)[0], lora_request=first)
        engine.add_request("b", prompts[2], greedy(1)[0], lora_request=second)
        engine.step()
        assert engine.list_loras() == {first.lora_int_id, second.lora_int_id}  # mid-run
        with pytest.raises(ValueError, match="in use"):
            engine.remove_lora(first.lora_int_id)
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o for o in engine.step() if o.finished}
        assert_matches_reference([done["a"], done["b"]], reference[1:3])
        assert engine.remove_lora(first.lora_int_id)
        assert not engine.remove_lora(first.lora_int_id)
        assert engine.list_loras() == {second.lora_int_id}
    finally:
        engine.shutdown()
