"""Multi-token prediction (model/mtp.py): a Qwen3.5 checkpoint's `mtp.*` layer proposes drafts
(speculative_config {"method": "mtp"}). The checkpoints are the tiny random ones with a random
prediction layer added; its drafts are checked against the layer's definition computed with
transformers' own modules in float64 (its decoder layer of the model's full-attention kind,
the model's embedding, final hidden states and lm_head): draft 1 from the rows of every
position so far, draft 2 chained from draft 1 and the layer's output. The served tokens are
transformers' (verification decides every token), whatever was accepted."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import DEVICE_KWARGS, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file
from tiny import auto_class, make_tiny_checkpoint
from transformers import AutoConfig

from conveyor import LLMEngine, SamplingParams

MAX_TOKENS = 10
MTP = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
_LAYER_CLASSES = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5DecoderLayer",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeDecoderLayer",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextDecoderLayer",
}


def _layer_class(name: str):
    module, _, cls = _LAYER_CLASSES[name].rpartition(".")
    return getattr(__import__(module, fromlist=[cls]), cls)


class ReferenceMTP(torch.nn.Module):
    """The prediction layer as its definition reads, on transformers' modules (float64)."""

    def __init__(self, name: str, config, full_layer: int) -> None:
        super().__init__()
        text = config.get_text_config()
        text._attn_implementation = "sdpa"  # no mask: causal
        norm = type(_reference_norm(text))
        self.fc = torch.nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False)
        self.pre_fc_norm_embedding = norm(text.hidden_size, eps=text.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(text.hidden_size, eps=text.rms_norm_eps)
        self.layers = torch.nn.ModuleList([_layer_class(name)(text, full_layer)])
        self.norm = norm(text.hidden_size, eps=text.rms_norm_eps)
        for p in self.parameters():  # norms off their identity too
            torch.nn.init.normal_(p, std=0.3 if p.dim() == 1 else 0.15)
        self.double()

    def forward(self, embedded, hidden, position_embeddings):
        x = torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.layers[0](self.fc(x), position_embeddings=position_embeddings)
        return self.norm(x)


def _reference_norm(text_config):
    module = __import__(_layer_class_module(text_config), fromlist=["x"])
    names = [n for n in dir(module) if n.endswith("RMSNorm") and "Gated" not in n]
    cls = getattr(module, names[0])
    return cls(4)


def _layer_class_module(text_config) -> str:
    name = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}.get(
        text_config.model_type, text_config.model_type
    )
    return _LAYER_CLASSES[name].rpartition(".")[0]


def with_mtp_layer(name: str, path, dest):
    """A copy of the checkpoint at `path` with an `mtp.*` layer: its decoder layer the model's
    attention layer's tensors, fc and the norms random; (path, reference model, reference
    MTP)."""
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    full = text.layer_types.index("full_attention")
    torch.manual_seed(7)
    mtp = ReferenceMTP(name, config, full)
    model = auto_class(config).from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    )
    mtp.layers[0].load_state_dict(model.model.layers[full].state_dict())
    with torch.no_grad():  # its attention's output large enough that its KV decides drafts
        mtp.layers[0].self_attn.o_proj.weight.mul_(30)
    copy = shutil.copytree(path, dest)
    weights = load_file(copy / "model.safetensors")
    for key, tensor in mtp.state_dict().items():
        experts = key.rpartition("experts.")[0] + "experts."
        if key.endswith("experts.gate_up_proj"):  # stored per expert, as save_pretrained does
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                weights[f"mtp.{experts}{e}.gate_proj.weight"] = gate.contiguous()
                weights[f"mtp.{experts}{e}.up_proj.weight"] = up.contiguous()
        elif key.endswith("experts.down_proj"):
            for e, down in enumerate(tensor):
                weights[f"mtp.{experts}{e}.down_proj.weight"] = down.contiguous()
        else:
            weights[f"mtp.{key}"] = tensor.contiguous()
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    model = auto_class(config).from_pretrained(
        copy, dtype=torch.float64, experts_implementation="eager"
    )
    return str(copy), model, mtp


@torch.no_grad()
def reference_drafts(model, mtp, tokens: list[int]) -> list[int]:
    """Drafts 1 and 2 after `tokens` (prompt and output so far): the layer over every
    position's (next token, final hidden state), then its row of the last token chained."""
    base = model.model
    ids = torch.tensor([tokens])
    hidden = base(input_ids=ids).last_hidden_state[0]  # normed
    embed = base.get_input_embeddings()
    rotary = base.rotary_emb
    n = len(tokens)
    # rows 0 .. n - 2 read the token after them; row n - 1 the last sampled token (draft 1's
    # own input in the engine is that token at n - 1: tokens[n - 1] is it)
    e = embed(ids[0, 1:])  # rows 0 .. n - 2
    positions = torch.arange(n - 1)[None]
    y = mtp(e[None], hidden[None, : n - 1], rotary(e[None], positions))[0]
    first = int(model.lm_head(y[-1]).argmax())
    # chained: row n - 1 reads draft 1 and the layer's y of row n - 2, attending rows 0 .. n - 1
    e2 = torch.cat([e, embed(torch.tensor([first]))])
    h2 = torch.cat([hidden[: n - 1], y[-1:]])
    positions = torch.arange(n)[None]
    y2 = mtp(e2[None], h2[None], rotary(e2[None], positions))[0]
    return [first, int(model.lm_head(y2[-1]).argmax())]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def case(request, tmp_path_factory):
    name = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(name), name)
    path, model, mtp = with_mtp_layer(name, path, tmp_path_factory.mktemp(name) / "mtp")
    prompts = random_prompts(4, model.config.get_text_config().vocab_size, seed=5, max_len=30)
    from test_hybrid import exact_delta_rule

    with exact_delta_rule():
        reference = hf_greedy(model, prompts, MAX_TOKENS)
    return name, path, model, mtp, prompts, reference


def test_drafts_are_the_layers_and_tokens_transformers(case):
    """Every step's drafts for each request are the reference layer's drafts 1 and 2 after
    the request's tokens (float64), chunked prompts of 7 tokens included; the tokens served are
    transformers' greedy ones."""
    name, path, model, mtp, prompts, reference = case
    from test_hybrid import exact_delta_rule

    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, speculative_config=MTP, max_num_batched_tokens=7
    )
    assert engine.core.runner.model.mtp is not None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    seen: list = []
    done = run_all(engine, [(str(i), p, params) for i, p in enumerate(prompts)], seen)
    assert seen
    with exact_delta_rule():
        for tokens, drafts in seen:
            want = reference_drafts(model, mtp, tokens)
            assert drafts[0] == want[0], f"draft 1 after {len(tokens)} tokens"
            if len(drafts) > 1:
                assert drafts[1] == want[1], f"draft 2 after {len(tokens)} tokens"
    assert any(len(d) == 2 for _, d in seen)
    for i, (tokens, logprobs) in enumerate(reference):
        assert done[str(i)].token_ids == tokens
        mine = [pos[t].logprob for pos, t in zip(done[str(i)].logprobs, tokens, strict=True)]
        assert max(abs(a - b) for a, b in zip(mine, logprobs, strict=True)) < 2e-5
    assert engine.get_stats().spec.num_draft_tokens > 0


def test_mtp_is_refused_where_there_is_none(case, tmp_path):
    """A checkpoint without the layer, a family without one, a draft "model" that is another:
    ValueErrors that say so; the layer's KV blocks are counted in the cache's memory."""
    name, path, *_ = case
    plain = make_tiny_checkpoint(tmp_path / "plain", name)
    with pytest.raises(ValueError, match="stores no multi-token prediction layer"):
        LLMEngine(str(plain), dtype="float64", speculative_config=MTP)
    llama = make_tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="has no multi-token prediction layer"):
        LLMEngine(str(llama), dtype="float64", speculative_config=MTP)
    with pytest.raises(ValueError, match="'model' must be it"):
        LLMEngine(path, dtype="float64", speculative_config=MTP | {"model": str(llama)})
    with_layer = LLMEngine(path, dtype="float64", speculative_config=MTP)
    without = LLMEngine(path, dtype="float64")
    runner, base = with_layer.core.runner, without.core.runner
    attention_layers = sum(1 for c in base.kv_caches if isinstance(c, torch.Tensor))
    per_layer = base.kv_bytes_per_block() // attention_layers
    assert runner.kv_bytes_per_block() == base.kv_bytes_per_block() + per_layer


def test_the_same_bits_as_without_speculation_with_prefix_hits(case):
    """float32, blocks of 4, chunks of 7: with the layer's drafts verified every step, each
    prompt's tokens and top-5 logprobs are the bits of an engine without speculation, and so
    are a second round's that repeat the prompts (prefix hits on state snapshots: the layer's
    KV of the hit blocks was written by the first round)."""
    name, path, model, mtp, prompts, reference = case

    def logprobs(out):
        return [{t: lp.logprob for t, lp in pos.items()} for pos in out.logprobs]

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    kwargs = dict(dtype="float32", **DEVICE_KWARGS, block_size=4, max_num_batched_tokens=7)
    with_layer = LLMEngine(path, **kwargs, speculative_config=MTP)
    without = LLMEngine(path, **kwargs, enable_prefix_caching=False)
    for round_ in range(2):
        todo = [(f"{round_}-{i}", p, params) for i, p in enumerate(prompts)]
        hot, cold = run_all(with_layer, todo), run_all(without, todo)
        for key, out in cold.items():
            assert hot[key].token_ids == out.token_ids, f"{key}: tokens differ"
            assert logprobs(hot[key]) == logprobs(out), f"{key}: logprobs differ"
    assert with_layer.kv_cache.snapshots.hits > 0
    assert with_layer.get_stats().spec.num_draft_tokens > 0


def run_all(engine: LLMEngine, todo, seen: list | None = None) -> dict:
    """Steps until idle, checking block accounting after every step: each request's output;
    `seen` gets (tokens so far, drafts proposed) of every running request after each step."""
    for request in todo:
        engine.add_request(*request)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        for request in engine.scheduler.running if seen is not None else ():
            if request.spec_token_ids:
                seen.append((list(request.all_token_ids), list(request.spec_token_ids)))
        engine.check_integrity()
    return done


def test_a_float32_models_drafts_come_from_a_q8_copy_of_its_lm_head(case):
    """float32 on the CPU: the drafts' argmax runs over Q8_0 blocks of the lm_head (a quarter
    of its bytes), which agrees with the exact argmax on nearly every row; float64 keeps the
    exact one (the tests above compare its drafts exactly)."""
    from conveyor.model.quant import QuantLinear

    name, path, *_ = case
    model = LLMEngine(path, dtype="float32", speculative_config=MTP).core.runner.model
    head = model.mtp.draft_head
    assert isinstance(head, QuantLinear) and head.format == "q8"
    torch.manual_seed(0)
    y = torch.randn(256, model.config.hidden_size)
    exact = model.compute_logits(y).argmax(-1)
    assert (model.draft_tokens(y) == exact).float().mean() > 0.95
    exact64 = LLMEngine(path, dtype="float64", speculative_config=MTP).core.runner.model
    assert exact64.mtp.draft_head is None


# ---- a prediction layer stored after the model's (GLM-4.5, GLM-4.7-Flash, DeepSeek-V3) ----


def with_layer_after(name: str, path, dest):
    """A copy of the checkpoint at `path` with a prediction layer stored as transformers' and
    the releases' do, model.layers.{num_hidden_layers}.*: a decoder layer (the last one's
    tensors), enorm, hnorm, eh_proj and shared_head.norm (random), and the copies of the
    embedding and head DeepSeek-V3's carry; (path, model, transformers' MtpModel of it)."""
    from transformers.modeling_layers import MtpModel

    config = AutoConfig.from_pretrained(path)
    model = auto_class(config).from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    )
    text = model.config.get_text_config()
    text.num_mtp_layers = 1
    if getattr(text, "mlp_layer_types", None) is not None:  # GLM-4.7-Flash's: the last kind
        text.mtp_mlp_layer_types = text.mlp_layer_types[-1:]
    torch.manual_seed(11)
    mtp = MtpModel(model, 1).double().eval()
    layer = mtp.layers[0]
    layer.mtp_block.load_state_dict(model.model.layers[-1].state_dict())
    with torch.no_grad():
        for norm in (layer.enorm, layer.hnorm, layer.post_norm):
            norm.weight.normal_(1.0, 0.3)
        layer.eh_proj.weight.normal_(0.0, 0.15)
    copy = shutil.copytree(path, dest)
    weights = load_file(copy / "model.safetensors")
    last, first = text.num_hidden_layers - 1, f"model.layers.{text.num_hidden_layers}."
    for key in [k for k in weights if k.startswith(f"model.layers.{last}.")]:
        weights[first + key.removeprefix(f"model.layers.{last}.")] = weights[key].clone()
    own = {
        "enorm": layer.enorm, "hnorm": layer.hnorm, "eh_proj": layer.eh_proj,
        "shared_head.norm": layer.post_norm, "shared_head.head": model.lm_head,
        "embed_tokens": model.model.embed_tokens,
    }  # fmt: skip
    for key, module in own.items():
        weights[f"{first}{key}.weight"] = module.weight.detach().clone().contiguous()
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return str(copy), model, mtp


@torch.no_grad()
def transformers_draft(model, mtp, tokens: list[int]) -> int:
    """transformers' MtpModel's draft after `tokens`, its cache fresh: every position's row
    (the token after it, positions shifted by one as it runs them) at once."""
    from transformers.cache_utils import MtpCache

    ids, n = torch.tensor([tokens]), len(tokens)
    hidden = model.model(input_ids=ids).last_hidden_state
    cache = MtpCache(config=model.config.get_mtp_config())
    drafts, _, _ = mtp(
        input_ids=ids[:, 1:], last_hidden_states=hidden[:, : n - 1], attention_mask=None,
        position_ids=torch.arange(1, n)[None], mtp_cache=cache,
    )  # fmt: skip
    return int(drafts[0, 0])


@pytest.mark.parametrize("name", ["glm4_moe", "glm4_moe_lite", "deepseek_v3"])
def test_a_layer_after_the_models_drafts_as_transformers_mtp_model(name, tmp_path):
    """GLM-4.5's (attention with q/k/v biases, a mixture of experts), GLM-4.7-Flash's and
    DeepSeek-V3's (latent attention): every step's draft 1 equals transformers' MtpModel's
    (float64), two requests in chunks of 7 tokens (the layer's KV written by steps that sample
    nothing too); the tokens served are transformers' greedy ones."""
    path = make_tiny_checkpoint(tmp_path / "base", name)
    path, model, mtp = with_layer_after(name, path, tmp_path / "mtp")
    engine = LLMEngine(
        path, dtype="float64", **DEVICE_KWARGS, speculative_config=MTP, max_num_batched_tokens=7
    )
    prompts = [[5, 9, 13, 21, 8, 44, 3, 17, 99, 12, 61], [7, 7, 31, 2, 250, 18]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seen: list = []
    done = run_all(engine, [(str(i), p, params) for i, p in enumerate(prompts)], seen)
    assert len(seen) >= MAX_TOKENS
    for tokens, drafts in seen:
        assert drafts[0] == transformers_draft(model, mtp, tokens), f"after {len(tokens)} tokens"
    reference = hf_greedy(model, prompts, MAX_TOKENS)
    for i, (tokens, _) in enumerate(reference):
        assert done[str(i)].token_ids == tokens
