"""DeepSeek's DSML tool calls through the official clients, against a worker started with
`--tool-parser deepseek_v4` (base URL in argv[1]): forced calls written in DSML by the grammar, typed
parameters, and streamed arguments that arrive in pieces (chat `tool_calls` deltas, Responses
`function_call_arguments.delta`, Messages `input_json_delta`) and join to the whole answer's arguments.
Run by tests/openai_client.rs; prints OK on success, raises on any failure."""
import json
import sys

from anthropic import Anthropic
from openai import OpenAI

base = sys.argv[1]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id

tools = [
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a text file",
        "parameters": {"type": "object",
                       "properties": {"path": {"type": "string", "maxLength": 40},
                                      "text": {"type": "string", "maxLength": 80}},
                       "required": ["path", "text"]}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List a directory",
        "parameters": {"type": "object",
                       "properties": {"dir": {"type": "string", "maxLength": 40},
                                      "depth": {"type": "integer", "minimum": 1, "maximum": 3}},
                       "required": ["dir", "depth"]}}},
]
ask = [{"role": "user", "content": "Write a short poem about the sea into poem.txt."}]
named = {"type": "function", "function": {"name": "write_file"}}
MARKUP = "｜DSML｜"

# The whole answer: one call, its arguments typed JSON (strings as strings).
r = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice=named,
                                   max_tokens=200, temperature=0)
c = r.choices[0]
assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 and r.usage.completion_tokens < 200, r
assert not c.message.content or MARKUP not in c.message.content, r
whole = c.message.tool_calls[0]
args = json.loads(whole.function.arguments)
assert whole.function.name == "write_file" and isinstance(args["path"], str) and isinstance(args["text"], str), whole

# Streamed: the call's head first (id, name, no arguments), then its arguments in several pieces as
# the model writes them, joined: the whole answer's.
head, pieces, content = None, [], ""
for chunk in client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice=named,
                                            max_tokens=200, temperature=0, stream=True):
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    content += d.content or ""
    for t in d.tool_calls or []:
        assert t.index == 0, t
        if t.id:
            assert head is None and t.function.name == "write_file" and t.function.arguments == "", t
            head = t
        else:
            assert head is not None, "arguments before the call's head"
            pieces.append(t.function.arguments)
assert head is not None and len(pieces) >= 3, (head, pieces)
assert "".join(pieces) == whole.function.arguments, (pieces, whole.function.arguments)
assert MARKUP not in content, content

# An integer parameter comes back as a number.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Show me the src folder."}],
                                   tools=tools, tool_choice={"type": "function", "function": {"name": "list_dir"}},
                                   max_tokens=300, temperature=0)
assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens < 300, r
a = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
assert isinstance(a["depth"], int) and 1 <= a["depth"] <= 3 and isinstance(a["dir"], str), a

# The Responses API: the call's item opens, its arguments arrive as several deltas, `done` holds them
# joined.
deltas, done = [], None
with client.responses.stream(model=model, input=ask[0]["content"], max_output_tokens=120, temperature=0,
                             tools=[{"type": "function", **t["function"]} for t in tools],
                             tool_choice={"type": "function", "name": "write_file"}) as s:
    for e in s:
        if e.type == "response.function_call_arguments.delta":
            deltas.append(e.delta)
        elif e.type == "response.function_call_arguments.done":
            done = e.arguments
    final = s.get_final_response()
assert len(deltas) >= 3 and "".join(deltas) == done, (deltas, done)
calls = [o for o in final.output if o.type == "function_call"]
assert len(calls) == 1 and calls[0].name == "write_file" and calls[0].arguments == done, final
json.loads(done)

# Anthropic's Messages API: the tool_use block's input arrives as several input_json_delta pieces.
anthropic = Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=600)
partial = []
with anthropic.messages.stream(model=model, max_tokens=200, extra_body={"temperature": 0}, messages=ask,
                               tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                                       "input_schema": t["function"]["parameters"]} for t in tools],
                               tool_choice={"type": "tool", "name": "write_file"}) as s:
    for e in s:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            partial.append(e.delta.partial_json)
    m = s.get_final_message()
uses = [b for b in m.content if b.type == "tool_use"]
assert len(uses) == 1 and m.stop_reason == "tool_use", m
assert len(partial) >= 3 and json.loads("".join(partial)) == uses[0].input, (partial, uses[0].input)

# No tools offered: no calls, whatever the text.
r = client.chat.completions.create(model=model, messages=ask, max_tokens=16, temperature=0)
assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length"), r
print("OK")
