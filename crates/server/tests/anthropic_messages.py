"""Anthropic's Messages API through the official `anthropic` Python client, against a worker or a router
(base URL in argv[1]). Run by tests/openai_client.rs and tests/routed.rs; prints OK on success, raises on
any failure."""
import json
import sys

from anthropic import Anthropic, BadRequestError, NotFoundError

base = sys.argv[1]
client = Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=600)
model = "SmolLM2-135M-Instruct"
# Sampling settings are not in the client's signature (newer Claude models take none): sent as extra fields.
T0 = {"temperature": 0}

# A plain answer, with a system prompt: text content, end_turn, usage in Anthropic's words.
m = client.messages.create(model=model, max_tokens=16, extra_body=T0, system="Answer in one short sentence.",
                           messages=[{"role": "user", "content": "What is the capital of France?"}])
assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
assert m.content[0].type == "text" and "Paris" in m.content[0].text, m
assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0 and m.usage.input_tokens > 0, m

# A stop sequence: named in the answer.
m = client.messages.create(model=model, max_tokens=32, extra_body=T0, stop_sequences=["France"],
                           messages=[{"role": "user", "content": "What is the capital of France?"}])
assert m.stop_reason == "stop_sequence" and m.stop_sequence == "France", m
assert "France" not in m.content[0].text, m

# Streamed: the SDK assembles the events into the same answer.
with client.messages.stream(model=model, max_tokens=16, extra_body=T0,
                            messages=[{"role": "user", "content": "What is the capital of France?"}]) as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
assert "Paris" in streamed and final.content[0].text == streamed, (streamed, final)
assert final.usage.output_tokens > 0, final

# Structured output (`output_config.format`): the text is JSON that fits the schema.
schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
m = client.messages.create(model=model, max_tokens=40, extra_body=T0,
                           output_config={"format": {"type": "json_schema", "schema": schema}},
                           messages=[{"role": "user", "content": "Pick a city as JSON."}])
v = json.loads(m.content[0].text)
assert v["city"] in ("Paris", "Rome") and isinstance(v["sunny"], bool), m

tools = [{"name": "read_file", "description": "Read a text file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                           "required": ["path"], "additionalProperties": False}}]
ask = [{"role": "user", "content": "What is in notes.txt?"}]

# A forced tool: a tool_use block whose input fits the schema, stop_reason tool_use.
m = client.messages.create(model=model, max_tokens=80, extra_body=T0, tools=tools, messages=ask,
                           tool_choice={"type": "tool", "name": "read_file"})
uses = [b for b in m.content if b.type == "tool_use"]
assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "read_file", m
assert set(uses[0].input) == {"path"} and isinstance(uses[0].input["path"], str), m

# Cut by max_tokens inside the call: stop_reason max_tokens, never markup as text.
m = client.messages.create(model=model, max_tokens=14, extra_body=T0, tools=tools, messages=ask,
                           tool_choice={"type": "tool", "name": "read_file"})
assert m.stop_reason == "max_tokens", m
assert all("<tool" not in b.text for b in m.content if b.type == "text"), m

# The same, streamed: the input_json_delta events assemble into the input.
with client.messages.stream(model=model, max_tokens=80, extra_body=T0, tools=tools, messages=ask,
                            tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
    final = s.get_final_message()
uses = [b for b in final.content if b.type == "tool_use"]
assert final.stop_reason == "tool_use" and len(uses) == 1 and "path" in uses[0].input, final

# A tool_result goes back into the conversation and reaches the prompt: a longer result, a longer prompt.
def with_result(text):
    return client.messages.create(model=model, max_tokens=4, extra_body=T0, messages=ask + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                           "input": {"path": "notes.txt"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": text}]}])


def prompt_tokens(m):
    return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


short, long = with_result("x"), with_result("The password is zebra-4711. " * 5)
assert short.content[0].type == "text", short
assert prompt_tokens(long) - prompt_tokens(short) >= 25, (short.usage, long.usage)


# What is not served is refused with a 400 that names it.
def refused(want, **kw):
    args = dict(model=model, max_tokens=4, messages=ask)
    args.update(kw)
    try:
        client.messages.create(**args)
    except BadRequestError as e:
        assert want in str(e), (want, str(e))
        return
    raise AssertionError(f"expected a 400 naming {want}")


# Errors come in Anthropic's shape (the SDK reads the type), with this project's word beside it.
try:
    client.messages.create(model=model, max_tokens=4, messages=[])
    raise AssertionError("an empty conversation was taken")
except BadRequestError as e:
    assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body
    assert e.body["error"]["pdserve_type"] == "invalid_request" and e.body["error"]["message"], e.body
try:
    client.messages.create(model="no-such-model", max_tokens=4, messages=ask)
    raise AssertionError("an unknown model was taken")
except NotFoundError as e:
    assert e.body["error"]["type"] == "not_found_error", e.body

# `cache_control` is taken wherever Anthropic allows it, tools included (the prefix cache is
# automatic: every prompt's tokens are kept for the next request that starts with them).
cached = [dict(tools[0], cache_control={"type": "ephemeral"})]
m = client.messages.create(model=model, max_tokens=4, extra_body=T0, tools=cached,
                           system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                           messages=[{"role": "user", "content": [
                               {"type": "text", "text": "What is in notes.txt?", "cache_control": {"type": "ephemeral"}}]}])
assert m.usage.output_tokens > 0, m

# count_tokens: the prompt a request would have, tools and system included, as its usage counts it.
n = client.messages.count_tokens(model=model, messages=ask, tools=tools).input_tokens
m = client.messages.create(model=model, max_tokens=1, extra_body=T0, messages=ask, tools=tools)
assert n == prompt_tokens(m) and n > client.messages.count_tokens(model=model, messages=ask).input_tokens, (n, m.usage)

refused("thinking", thinking={"type": "enabled", "budget_tokens": 1024})
refused("output_config.effort", output_config={"effort": "high"})
refused("image", messages=[{"role": "user", "content": [{"type": "image", "source": {
    "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
refused("not in `tools`", tools=tools, tool_choice={"type": "tool", "name": "rm"})
print("OK")
