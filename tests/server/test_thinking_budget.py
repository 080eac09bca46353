"""A thinking budget ends the reasoning by forcing its closing marker (vLLM's
thinking_token_budget; Anthropic's thinking.budget_tokens): a scripted checkpoint that thinks
`o k o k ...` without end writes [/THINK] once its reasoning has the budget's tokens, then
answers `Paris`, through the real clients, whole and streamed."""

from __future__ import annotations

import anthropic
import openai
import pytest
from server_util import ServerProcess
from test_special_markers import joined
from tiny import MARKER_SPECIALS, endless_thinking_script, make_scripted_checkpoint

MODEL = "tiny"
HI = [{"role": "user", "content": "Where?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("budget")
    script = endless_thinking_script()  # Anthropic's least budget is 1024 tokens
    path = make_scripted_checkpoint(
        folder / "ckpt", script, MARKER_SPECIALS, max_position_embeddings=2048
    )
    args = [str(path), "--dtype", "float32", "--served-model-name", MODEL]
    proc = ServerProcess([*args, "--reasoning-parser", "mistral"], folder / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def chat(client, **fields):
    return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40, **fields)


def test_without_a_budget_the_model_thinks_until_max_tokens(client):
    choice = chat(client).choices[0]
    assert choice.message.model_dump()["reasoning"] == "ok" * 19 + "o"
    assert choice.message.content is None and choice.finish_reason == "length"


@pytest.mark.parametrize("budget, reasoning", [(0, ""), (1, "o"), (5, "okoko")])
def test_budget_forces_the_end_of_the_reasoning(client, budget, reasoning):
    body = {"thinking_token_budget": budget}
    choice = chat(client, extra_body=body).choices[0]
    assert (choice.message.model_dump().get("reasoning") or "", choice.message.content) == (
        reasoning,
        "Paris",
    )
    assert choice.finish_reason == "stop"
    # [THINK], the budget's tokens, [/THINK], P a r i s and the end of the turn
    assert chat(client, extra_body=body).usage.completion_tokens == budget + 8
    assert joined(chat(client, extra_body=body, stream=True)) == (reasoning, "Paris")


def test_budget_out_of_range_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body={"thinking_token_budget": -1})
    assert "thinking_token_budget" in str(caught.value)


def test_messages_api_budget_tokens(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = client.messages.create(model=MODEL, max_tokens=1100, messages=HI, thinking=thinking)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "ok" * 512
    assert message.content[1].text == "Paris" and message.stop_reason == "end_turn"


@pytest.mark.parametrize(
    "thinking, max_tokens",
    [
        ({"type": "enabled", "budget_tokens": 1023}, 2000),
        ({"type": "enabled", "budget_tokens": 1024}, 1024),
    ],
)
def test_messages_api_budget_out_of_range_is_a_400_naming_it(server, thinking, max_tokens):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=max_tokens, messages=HI, thinking=thinking)
    assert "budget_tokens" in str(caught.value)
