"""Batch invariance end to end (LLM(..., batch_invariant=True), the default): a request's
tokens and every top-5 logprob are the same bits whether it runs alone, batched with others in
prefill chunks of another size mixed with decode rows, from the prefix cache, after being
preempted and recomputed, or verified in n-gram speculative drafts, or as a later prompt that
repeats its answer. On a float32 tiny random checkpoint, the same served `quantization="int8"`,
and a Q4_1 GGUF of it served quantized (on a CPU with AMX-BF16 their prompt tokens take the
bfloat16 tiles: model/prompt_route.py), with generated rows on AMX-INT8 tiles from 1 row and
from 64 (decode_tiles_from).

Also: seeded sampling (temperature, top-p) is batch-invariant; the sampler's top-p total mass
is the same bits alone and batched; and a negative control shows that with
batch_invariant=False the same comparisons do see differences (so they can fail)."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import gguf_util
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import CPU_BLOCK_SIZE
from conveyor.model import kernels
from conveyor.outputs import SamplingRow
from conveyor.sample import sampler as sampler_module
from conveyor.sample.sampler import Sampler

pytestmark = pytest.mark.skipif(
    kernels.load() is None, reason="the compiled CPU kernels are unavailable here"
)

VOCAB = 384
MAX_TOKENS = 12
MODELS = ["float32", "int8", "q4_1-gguf"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True, **overrides
    )


def make_prompts() -> list[list[int]]:
    """Lengths at 16-token block edges, and prompts sharing a 48-token prefix (whole blocks
    and a partial one), so that the prefix cache hits."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    plain = [tokens(n) for n in (15, 16, 17, 31, 32, 33, 47, 48, 49, 1, 2, 64)]
    prefix = tokens(48)
    shared = [
        prefix[:16] + tokens(1),
        prefix[:32] + tokens(15),
        prefix[:33],
        prefix + tokens(2),
        prefix + tokens(17),
    ]
    # One prompt that repeats itself, so n-gram lookup finds long drafts.
    loop = tokens(9)
    return plain + shared + [loop * 4]


PROMPTS = make_prompts()


# ---- models --------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True, params=[1, 64], ids=lambda n: f"int8_tiles_from_{n}")
def decode_tiles_from(request):
    """Every test twice: generated rows on AMX-INT8 tiles from 1 row (every call) and from 64
    (none here), the kernel plan's switch point (CONVEYOR_DECODE_TILES_FROM; where the CPU has
    no AMX-INT8 both runs take the VNNI panels). The tiles give the panels' bits, so no
    request's answer may depend on it."""
    ops = kernels.load()
    if request.param != 1 and ops is not None and not ops.cpu_features()["amx_int8"]:
        # The plan takes the tiles only on AMX-INT8 (model/plan.py: decode_tiles_from 0
        # elsewhere): the second pass would repeat the first one's runs, bit for bit.
        pytest.skip("no AMX-INT8 here: the tiles' switch point changes nothing")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONVEYOR_DECODE_TILES_FROM", str(request.param))
        yield request.param


@pytest.fixture(scope="module")
def q4_1_gguf(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf-q4_1") / "tiny-Q4_1.gguf"
    with pytest.MonkeyPatch.context() as patch:  # the writer lists F32 and Q8_0 only
        patch.setitem(gguf_util.QTYPES, "Q4_1", gguf.GGMLQuantizationType.Q4_1)
        patch.setitem(gguf_util.FILE_TYPES, "Q4_1", gguf.LlamaFileType.MOSTLY_Q4_1)
        return gguf_util.write_gguf(tiny_checkpoint("llama"), out, "Q4_1")


@pytest.fixture(scope="module")
def models(tiny_checkpoint, q4_1_gguf) -> dict[str, tuple[str, dict]]:
    """name -> (path, LLM keyword arguments)."""
    path = str(tiny_checkpoint("llama"))
    return {
        "float32": (path, dict(dtype="float32")),
        "int8": (path, dict(dtype="float32", quantization="int8")),
        "q4_1-gguf": (str(q4_1_gguf), dict(dtype="float32")),
    }


def make_llm(models, name: str, **kwargs) -> LLM:
    path, base = models[name]
    llm = LLM(path, **base, **kwargs)
    expected = {"float32": "none", "int8": "int8", "q4_1-gguf": "gguf"}[name]
    assert llm.engine.model_config.quantization == expected
    assert llm.engine.model_config.batch_invariant == kwargs.get("batch_invariant", True)
    return llm


# ---- comparing outputs ---------------------------------------------------------------------


def signature(output) -> tuple[list[int], list[dict[int, tuple[float, int]]]]:
    completion = output.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    logprobs = [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in completion.logprobs]
    return completion.token_ids, logprobs


def first_difference(got, want) -> str | None:
    """Where two signatures first differ (token, or any top-k logprob compared with ==)."""
    (tokens, logprobs), (want_tokens, want_logprobs) = got, want
    for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=False)):
        if a != b:
            return f"token {i}: {a} != {b}"
        if logprobs[i] != want_logprobs[i]:
            pairs = [
                (t, logprobs[i].get(t), want_logprobs[i].get(t))
                for t in sorted(set(logprobs[i]) | set(want_logprobs[i]))
                if logprobs[i].get(t) != want_logprobs[i].get(t)
            ]
            return f"logprobs at position {i}: (token, got, baseline) {pairs[:3]}"
    if len(tokens) != len(want_tokens):
        return f"lengths {len(tokens)} != {len(want_tokens)}"
    return None


def differences(outputs, baseline) -> list[str]:
    assert len(outputs) == len(baseline)
    found = []
    for i, (out, want) in enumerate(zip(outputs, baseline, strict=True)):
        where = first_difference(signature(out), want)
        if where is not None:
            found.append(f"request {i} (prompt of {len(PROMPTS[i])} tokens): {where}")
    return found


def assert_same(outputs, baseline, what: str) -> None:
    found = differences(outputs, baseline)
    assert not found, f"{what}: {len(found)} of {len(baseline)} requests differ:\n" + "\n".join(
        found
    )


def alone(models, name: str, prompts, params, **kwargs) -> list:
    """(a) Each request alone in a fresh LLM without prefix caching: the baseline."""
    results = []
    for prompt, p in zip(prompts, params, strict=True):
        llm = make_llm(models, name, enable_prefix_caching=False, **kwargs)
        try:
            (out,) = llm.generate([prompt], p, use_tqdm=False)
        finally:
            llm.shutdown()
        results.append(signature(out))
    return results


_BASELINES: dict[tuple, list] = {}


@pytest.fixture(scope="module")
def baseline(models):
    def get(name: str, batch_invariant: bool = True) -> list:
        key = (name, batch_invariant)
        if key not in _BASELINES:
            params = [greedy()] * len(PROMPTS)
            _BASELINES[key] = alone(models, name, PROMPTS, params, batch_invariant=batch_invariant)
        return _BASELINES[key]

    yield get
    _BASELINES.clear()


# ---- (b) batched, chunked, mixed with decode; (c) from the prefix cache --------------------


@pytest.mark.parametrize(
    ("name", "budget"), [("float32", 32), ("int8", 48), ("q4_1-gguf", 32), ("q4_1-gguf", 48)]
)
def test_batched_chunked_and_cached_requests_equal_each_alone(models, baseline, name, budget):
    want = baseline(name)
    with make_llm(models, name, max_num_batched_tokens=budget) as llm:
        batched = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert_same(batched, want, f"{name}, all together, budget {budget}")
        hits = llm.engine.get_stats().scheduler.prefix_cache_hits
        warm = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert llm.engine.get_stats().scheduler.prefix_cache_hits > hits, "no prefix-cache hit"
        assert_same(warm, want, f"{name}, again on the warm cache, budget {budget}")


# ---- a sliding-window family ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    """A tiny Gemma 3 (tests/tiny.py FAMILIES): a sliding layer with a window of 8 tokens and
    its own RoPE base, a global layer, (1 + w) norms around both sublayers, GeGLU."""
    from tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3"))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_sliding_window_family_is_batch_invariant(gemma3, quantization):
    """Gemma 3 in float32 and served quantized: each request alone against batched in chunks
    of 32, from the warm prefix cache, and preempted in a small cache, all compared with ==."""
    prompts = PROMPTS[:6] + PROMPTS[12:15]
    kwargs = dict(dtype="float32", quantization=quantization)
    want = []
    for prompt in prompts:
        with LLM(gemma3, **kwargs, enable_prefix_caching=False) as llm:
            assert llm.engine.model_config.parts.windows == (8, 0)
            want.append(signature(llm.generate([prompt], greedy(), use_tqdm=False)[0]))

    def check(outputs, what: str) -> None:
        found = [first_difference(signature(o), w) for o, w in zip(outputs, want, strict=True)]
        assert found == [None] * len(want), f"{quantization}, {what}: {found}"

    with LLM(gemma3, **kwargs, max_num_batched_tokens=32) as llm:
        check(llm.generate(prompts, greedy(), use_tqdm=False), "batched, budget 32")
        check(llm.generate(prompts, greedy(), use_tqdm=False), "again, from the prefix cache")
        assert llm.engine.get_stats().scheduler.prefix_cache_hits > 0
    with LLM(gemma3, **kwargs, num_blocks=7, max_num_batched_tokens=48) as llm:
        check(llm.generate(prompts, greedy(), use_tqdm=False), "preempted")
        assert llm.engine.get_stats().scheduler.num_preemptions_total > 0


# ---- (d) preemption ------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_preempted_requests_equal_each_alone(models, baseline, name):
    # The longest request (64 + 12 tokens) needs 3 blocks of the CPU's 32; 5 blocks hold two
    # at most (the baseline's block size: a decode row's softmax runs over groups of blocks).
    num_blocks = 2 * -(-(64 + 12) // CPU_BLOCK_SIZE) - 1
    with make_llm(models, name, num_blocks=num_blocks, max_num_batched_tokens=48) as llm:
        outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert llm.engine.get_stats().scheduler.num_preemptions_total > 0, "nothing preempted"
    assert_same(outputs, baseline(name), f"{name}, preempted under 9 blocks")


# ---- (e) n-gram speculative decoding --------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_speculative_requests_equal_each_alone(models, baseline, name):
    with make_llm(models, name, speculative_config=NGRAM, max_num_batched_tokens=48) as llm:
        outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        spec = llm.engine.get_stats().spec
        # Drafts were verified: requests ran steps of several rows each (all rejected for the
        # Q4_1 model here, accepted now and then for the others).
        assert spec.num_draft_tokens > 0
    assert_same(outputs, baseline(name), f"{name}, n-gram speculation")


# ---- (f) a prompt that repeats an answer ----------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "q4_1-gguf"])
def test_a_prompt_repeating_an_answer_equals_it_alone(models, name):
    """A chat's next turn: a prompt that holds an earlier request's answer gives the same bits
    on the warm prefix cache as alone. On a CPU with AMX-BF16 prompt tokens and generated ones
    take different routes (model/prompt_route.py; with AVX512-BF16 alone, their attention
    does), so the cache must not serve the answer's KV to the prompt that repeats it (their
    blocks are keyed apart)."""
    first = PROMPTS[1]  # 16 tokens, a block of 16: the answer fills blocks of its own
    with make_llm(models, name, block_size=16) as llm:
        runner = llm.engine.core.runner
        assert runner.model.prompt_route == bool(kernels.load().prompt_attention_isa())
        answer = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        (out,) = llm.generate([first], answer, use_tqdm=False)
        follow = first + list(out.outputs[0].token_ids) + [5, 6, 7]
        hits = llm.engine.get_stats().scheduler.prefix_cache_hits
        (warm,) = llm.generate([follow], greedy(), use_tqdm=False)
        assert llm.engine.get_stats().scheduler.prefix_cache_hits > hits, "no prefix-cache hit"
    (want,) = alone(models, name, [follow], [greedy()], block_size=16)
    assert first_difference(signature(warm), want) is None, first_difference(signature(warm), want)


# ---- seeded sampling -----------------------------------------------------------------------


def seeded(i: int, **overrides) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        seed=1000 + i,
        max_tokens=MAX_TOKENS,
        logprobs=5,
        ignore_eos=True,
        **overrides,
    )


@pytest.mark.parametrize("name", ["float32", "q4_1-gguf"])
@pytest.mark.parametrize(
    "overrides", [{}, {"top_p": 0.9}, {"top_p": 0.7, "top_k": 50}], ids=["temp", "top_p", "top_k_p"]
)
def test_seeded_sampling_is_the_same_alone_and_batched(models, name, overrides):
    prompts = PROMPTS[::2]
    params = [seeded(i, **overrides) for i in range(len(prompts))]
    with make_llm(models, name, enable_prefix_caching=False) as llm:
        want = [
            signature(llm.generate([p], sp, use_tqdm=False)[0])
            for p, sp in zip(prompts, params, strict=True)
        ]
    with make_llm(models, name, max_num_batched_tokens=32) as llm:
        batched = llm.generate(prompts, params, use_tqdm=False)
        warm = llm.generate(prompts, params, use_tqdm=False)
    for what, outputs in (("batched", batched), ("warm", warm)):
        found = [
            f"request {i}: {where}"
            for i, (out, w) in enumerate(zip(outputs, want, strict=True))
            if (where := first_difference(signature(out), w)) is not None
        ]
        assert not found, f"{name} {overrides}, {what}:\n" + "\n".join(found)
    # Sampling did sample: some request left the greedy path.
    with make_llm(models, name) as llm:
        greedy_out = llm.generate(prompts, greedy(), use_tqdm=False)
    assert any(signature(g)[0] != w[0] for g, w in zip(greedy_out, want, strict=True)), (
        "temperature 0.8 gave the greedy tokens everywhere"
    )


def test_top_p_total_mass_is_the_same_bits_alone_and_batched():
    """The sampler's top-p normalizer (logsumexp of the top-k-masked logits) over 64 rows of a
    49152-token vocabulary: torch's logsumexp gives some rows other bits alone than batched
    on this CPU; the sampler's _log_total must not."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=gen) * 4
    logits[::3, ::7] = float("-inf")  # top-k-masked rows
    for dtype in (torch.float32, torch.float64):
        x = logits.to(dtype)
        full = sampler_module._log_total(x)
        assert full.shape == (64, 1)
        reference = x.double().logsumexp(-1, keepdim=True)
        # float32: within 4e-6 of the value (~19 here): AVX2's vectorized sums of 49152 exps
        # ended 1.6e-5 off on a Zen 3 (the Xeons' AVX-512 ones within 1e-5); the bits alone vs
        # batched are what is tested.
        rtol = 4e-6 if dtype == torch.float32 else 1e-13
        torch.testing.assert_close(full.double(), reference, rtol=rtol, atol=0)
        for i in range(64):
            assert torch.equal(sampler_module._log_total(x[i : i + 1]), full[i : i + 1]), i
        for a, b in ((0, 5), (3, 40), (17, 18), (10, 64)):
            assert torch.equal(sampler_module._log_total(x[a:b]), full[a:b]), (a, b)


@pytest.mark.parametrize("top_k", [-1, 2000])
def test_seeded_top_p_sampler_rows_are_the_same_alone_and_batched(top_k):
    """The sampler on 64 rows of 49152 logits, each row seeded: the same tokens and logprobs
    alone, batched, and batched with rows of other parameters (which change the candidates)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49152, generator=gen) * 3
    sampler = Sampler(eos_token_ids=[2], seed=0)

    def rows(indices, params_of):
        return [
            SamplingRow(params_of(i), torch.Generator().manual_seed(500 + i), [], None, None)
            for i in indices
        ]

    def params_of(i):
        return SamplingParams(
            temperature=0.9, top_p=0.5 + (i % 5) * 0.1, top_k=top_k, seed=i, logprobs=3
        )

    every = list(range(64))
    full = sampler(logits, rows(every, params_of))
    for i in every:
        one = sampler(logits[i : i + 1], rows([i], params_of))
        assert one.token_ids == full.token_ids[i : i + 1], i
        assert one.logprobs == full.logprobs[i : i + 1], i

    # Mixed with rows asking for other top-k / top-p (a wider candidate set for the batch).
    def mixed_params(i):
        return params_of(i) if i % 2 else SamplingParams(temperature=1.0, top_k=4000, seed=i)

    mixed = sampler(logits, rows(every, mixed_params))
    assert [mixed.token_ids[i] for i in every if i % 2] == [
        full.token_ids[i] for i in every if i % 2
    ]


# ---- negative control ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "q4_1-gguf"])
def test_control_without_batch_invariance_the_comparisons_see_differences(models, baseline, name):
    """Expected to show the problem: with batch_invariant=False (the earlier kernels, chosen
    by row count, and key splits) the same comparisons as above find requests whose logprobs
    (or tokens) differ from the request alone, so the tests above can fail."""
    want = baseline(name, batch_invariant=False)
    found = []
    with make_llm(models, name, max_num_batched_tokens=32, batch_invariant=False) as llm:
        found += differences(llm.generate(PROMPTS, greedy(), use_tqdm=False), want)
        found += differences(llm.generate(PROMPTS, greedy(), use_tqdm=False), want)
    assert found, "batched and cached runs equal the requests alone even without invariance"
    print(f"{name}: {len(found)} of {2 * len(PROMPTS)} runs differ, e.g. {found[0]}")


# ---- a mixture of experts ------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (tests/tiny.py FAMILIES): a dense layer, then a mixture of 8 experts,
    3 per token, renormalised."""
    from tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe"))


@pytest.fixture(scope="module")
def qwen3_moe_q4_1(tmp_path_factory) -> str:
    """The same family as a Q4_1 GGUF (every layer a mixture, as llama.cpp's qwen3moe has)."""
    from tiny import make_tiny_checkpoint

    hf_dir = make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3_moe-all"), "qwen3_moe", decoder_sparse_step=1
    )
    out = tmp_path_factory.mktemp("gguf-moe") / "tiny-qwen3moe-Q4_1.gguf"
    with pytest.MonkeyPatch.context() as patch:  # the writer lists F32 and Q8_0 only
        patch.setitem(gguf_util.QTYPES, "Q4_1", gguf.GGMLQuantizationType.Q4_1)
        patch.setitem(gguf_util.FILE_TYPES, "Q4_1", gguf.LlamaFileType.MOSTLY_Q4_1)
        return str(gguf_util.write_gguf(hf_dir, out, "Q4_1"))


class RouteLog:
    """Records each step's expert choices of the MoE layers (MoEMLP.route's expert_ids) where
    the layers run as modules (CONVEYOR_COMPILED_LAYERS=0; the compiled MoE routes in C++)."""

    def __init__(self, llm) -> None:
        from conveyor.model.moe import MoEMLP

        self.steps: list[torch.Tensor] = []
        model = llm.engine.core.runner.model
        for module in model.modules():
            if isinstance(module, MoEMLP):
                route = module.route
                module.route = lambda x, route=route: self._kept(route(x))

    def _kept(self, routes):
        self.steps.append(routes.expert_ids.clone())
        return routes

    def overlapping_and_disjoint(self) -> tuple[bool, bool]:
        """Whether some step had two rows sharing an expert, and two rows sharing none."""
        overlap = disjoint = False
        for ids in self.steps:
            sets = [set(row.tolist()) for row in ids]
            for i, a in enumerate(sets):
                for b in sets[i + 1 :]:
                    overlap |= bool(a & b) and a != b
                    disjoint |= not (a & b)
        return overlap, disjoint


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    """A tiny GPT-OSS (tests/tiny.py FAMILIES): attention sinks, a sliding and a full layer,
    biased experts with the clamped SwiGLU, its router (top-k, then softmax)."""
    from tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss"))


# model fixture, quantization, its MoE layers
MOE_MODELS = {
    "qwen3_moe": ("qwen3_moe", "none", (False, True)),
    "qwen3_moe-int8": ("qwen3_moe", "int8", (False, True)),
    "qwen3_moe-q4_1-gguf": ("qwen3_moe_q4_1", "gguf", (True, True)),
    "gpt_oss": ("gpt_oss", "none", (True, True)),
}


@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_a_mixture_of_experts_is_batch_invariant(request, monkeypatch, name):
    """Qwen3-MoE in float32 and served quantized (int8, and a Q4_1 GGUF's experts), and GPT-OSS
    (attention sinks, biased experts) in float32, their layers compiled (the MoE in C++): each
    request alone against batched in chunks of 32 (steps whose rows route to overlapping and
    to disjoint experts, recorded from the same batches run as modules), from the warm prefix
    cache, preempted in a small cache, and verified in n-gram drafts, all compared with ==."""
    fixture, quantization, layers = MOE_MODELS[name]
    prompts = PROMPTS[:6] + PROMPTS[12:15] + PROMPTS[-1:]
    path = request.getfixturevalue(fixture)
    kwargs = dict(dtype="float32")
    if quantization == "int8":
        kwargs["quantization"] = "int8"
    want = []
    for prompt in prompts:
        with LLM(path, **kwargs, enable_prefix_caching=False) as llm:
            config = llm.engine.model_config
            assert (config.parts.moe_layers, config.quantization) == (layers, quantization)
            want.append(signature(llm.generate([prompt], greedy(), use_tqdm=False)[0]))

    def check(outputs, what: str) -> None:
        found = [first_difference(signature(o), w) for o, w in zip(outputs, want, strict=True)]
        assert found == [None] * len(want), f"{name}, {what}: {found}"

    with LLM(path, **kwargs, max_num_batched_tokens=32) as llm:
        before = kernels.load().kernel_runs()["moe/experts"]
        check(llm.generate(prompts, greedy(), use_tqdm=False), "batched, budget 32")
        assert kernels.load().kernel_runs()["moe/experts"] > before  # the compiled MoE ran
        check(llm.generate(prompts, greedy(), use_tqdm=False), "again, from the prefix cache")
        assert llm.engine.get_stats().scheduler.prefix_cache_hits > 0
    with LLM(path, **kwargs, num_blocks=7, max_num_batched_tokens=48) as llm:
        check(llm.generate(prompts, greedy(), use_tqdm=False), "preempted")
        assert llm.engine.get_stats().scheduler.num_preemptions_total > 0
    with LLM(path, **kwargs, speculative_config=NGRAM, max_num_batched_tokens=48) as llm:
        check(llm.generate(prompts, greedy(), use_tqdm=False), "n-gram speculation")
        assert llm.engine.get_stats().spec.num_draft_tokens > 0
    monkeypatch.setenv("CONVEYOR_COMPILED_LAYERS", "0")
    with LLM(path, **kwargs, max_num_batched_tokens=32) as llm:
        routes = RouteLog(llm)
        llm.generate(prompts, greedy(), use_tqdm=False)
        assert routes.overlapping_and_disjoint() == (True, True)


# ---- layers that run as modules: latent attention, Gemma 4 and 3n --------------------------


@pytest.fixture(scope="module")
def module_families(tmp_path_factory) -> dict:
    """Tiny checkpoints (tests/tiny.py FAMILIES) whose layers have no compiled form:
    DeepSeek-V3's latent attention (q_lora_rank, the latent and rope key cached, each head's
    query absorbed per head, a dense layer then a mixture); Gemma 4's per-layer heads, shared
    caches and per-layer inputs; Gemma 4's experts beside the MLP and values from the keys;
    Gemma 3n's AltUp streams, Laurel and gaussian top-k gates."""
    from tiny import make_tiny_checkpoint

    paths = {}

    def path(name: str) -> str:
        if name not in paths:
            paths[name] = str(make_tiny_checkpoint(tmp_path_factory.mktemp(name), name))
        return paths[name]

    return path


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma4", "gemma4-moe", "gemma3n"])
def test_module_run_layers_are_batch_invariant(module_families, family):
    """In float32: each request alone against batched in chunks of 32, from the warm prefix
    cache and preempted in a small cache, compared with ==."""
    path = module_families(family)
    prompts = PROMPTS[:6] + PROMPTS[12:15] + PROMPTS[-1:]
    with LLM(path, dtype="float32", enable_prefix_caching=False) as llm:
        assert llm.engine.model_config.parts.family == family.split("-")[0]
        want = [signature(llm.generate([p], greedy(), use_tqdm=False)[0]) for p in prompts]

    def check(outputs, what: str) -> None:
        found = [first_difference(signature(o), w) for o, w in zip(outputs, want, strict=True)]
        assert found == [None] * len(want), f"{family}, {what}: {found}"

    with LLM(path, dtype="float32", max_num_batched_tokens=32) as llm:
        check(llm.generate(prompts, greedy(), use_tqdm=False), "batched, budget 32")
        check(llm.generate(prompts, greedy(), use_tqdm=False), "again, from the prefix cache")
        assert llm.engine.get_stats().scheduler.prefix_cache_hits > 0
    with LLM(path, dtype="float32", num_blocks=7, max_num_batched_tokens=48) as llm:
        check(llm.generate(prompts, greedy(), use_tqdm=False), "preempted")
        assert llm.engine.get_stats().scheduler.num_preemptions_total > 0
