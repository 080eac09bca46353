"""Each tool-call family's raw reply of text then two calls (the second's arguments nested),
the tools they call and the calls a parser reads in them; and a streamed chat's pieces gathered.
Shared by the server tests that make a model write these replies (a `choice` grammar of the
text, or a scripted checkpoint)."""

from __future__ import annotations

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

# Two declared tools, the second's argument nested, for replies of text then two calls.
TWO_TOOLS = [
    TOOLS[0],
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"where": {"type": "object"}}},
        },
    },
]
WHERE = {"days": [1, 2], "note": None}
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"where": WHERE})]
_W, _T = '{"city": "Paris"}', '{"where": {"days": [1, 2], "note": null}}'
_PY = '[get_weather(city="Paris"), get_time(where={"days": [1, 2], "note": None})]'
_XML = (
    "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=where>\n"
    '{"days": [1, 2], "note": null}\n</parameter>\n</function>\n</tool_call>'
)
_DS = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
_HARMONY = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
# family -> its raw reply of the two calls (text first where the family has text before a
# call), and that text
TWO_CALL_REPLIES = {
    "deepseek_v3": (
        f"Sure.<｜tool▁calls▁begin｜>{_DS.format('get_weather', _W)}{_DS.format('get_time', _T)}"
        "<｜tool▁calls▁end｜>",
        "Sure.",
    ),
    "granite": (
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {_W}}}, '
        f'{{"name": "get_time", "arguments": {_T}}}]',
        None,
    ),
    "hermes": (
        f'Sure. <tool_call>\n{{"name": "get_weather", "arguments": {_W}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_time", "arguments": {_T}}}\n</tool_call>',
        "Sure.",
    ),
    "llama3_json": (
        f'<|python_tag|>{{"name": "get_weather", "parameters": {_W}}}; '
        f'{{"name": "get_time", "parameters": {_T}}}',
        None,
    ),
    "llama4_pythonic": (f"Sure. <|python_start|>{_PY}<|python_end|>", "Sure."),
    "mistral": (
        f'Sure.[TOOL_CALLS][{{"name": "get_weather", "arguments": {_W}}}, '
        f'{{"name": "get_time", "arguments": {_T}}}]',
        "Sure.",
    ),
    "pythonic": (_PY, None),
    "qwen3_coder": (_XML, "Sure."),
    "qwen3_xml": (_XML, "Sure."),
    "openai": (
        _HARMONY.format("get_weather", _W) + "<|start|>assistant" + _HARMONY.format("get_time", _T),
        None,
    ),
}


def gathered(chunks) -> dict:
    """A streamed chat's reasoning, content, calls ([name, arguments joined]) and finish."""
    out = {"reasoning": "", "reasoning_content": "", "content": "", "calls": [], "finish": None}
    for chunk in chunks:
        choice = chunk.choices[0]
        delta = choice.delta.model_dump()
        for key in ("reasoning", "reasoning_content", "content"):
            out[key] += delta.get(key) or ""
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                out["calls"].append([call["function"]["name"], ""])
            out["calls"][-1][1] += call["function"].get("arguments") or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out
