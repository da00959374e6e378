"""Tool calling and structured output through the official `openai` Python client, against a worker
or a router (base URL in argv[1]; argv[2]: how many seeded json_schema samples, default 100).
Run by tests/openai_client.rs and tests/routed.rs; prints OK on success, raises on any failure."""
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from openai import BadRequestError, NotFoundError, OpenAI

base = sys.argv[1]
samples = int(sys.argv[2]) if len(sys.argv) > 2 else 100
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id
# One model by id (the SDK's models.retrieve), on a worker or a router; another id is a 404.
assert client.models.retrieve(model).id == model
try:
    client.models.retrieve("no-such-model")
    raise AssertionError("an unknown model was found")
except NotFoundError as e:
    assert e.status_code == 404, e

tools = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                       "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List a directory",
        "parameters": {"type": "object",
                       "properties": {"dir": {"type": "string", "maxLength": 40},
                                      "depth": {"type": "integer", "minimum": 1, "maximum": 3}},
                       "required": ["dir", "depth"], "additionalProperties": False}}},
]
ask = [{"role": "user", "content": "What is in notes.txt?"}]


def check_call(call):
    assert call.id and call.type == "function", call
    a = json.loads(call.function.arguments)
    if call.function.name == "read_file":
        assert set(a) == {"path"} and isinstance(a["path"], str) and len(a["path"]) <= 40, a
    else:
        assert call.function.name == "list_dir", call
        assert set(a) == {"dir", "depth"} and isinstance(a["depth"], int) and 1 <= a["depth"] <= 3, a


# A named tool_choice: a call to that function, its arguments fitting the schema.
r = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=80, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "read_file"}})
c = r.choices[0]
assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, r
assert c.message.tool_calls[0].function.name == "read_file", r
check_call(c.message.tool_calls[0])

# `required`: a call to one of the tools (one, as parallel calls are off).
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Show me the src folder."}],
                                   tools=tools, tool_choice="required", parallel_tool_calls=False,
                                   max_tokens=120, temperature=0)
c = r.choices[0]
assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, r
check_call(c.message.tool_calls[0])

# `required` with parallel calls allowed (the default): valid calls, at most the server's limit (8), and
# `tool_calls` as the end; the grammar lets the model end after any call (it is never forced into a
# second one), so how many it makes is the model's choice.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Show me the src folder."}],
                                   tools=tools, tool_choice="required", max_tokens=400, temperature=0)
c = r.choices[0]
assert c.finish_reason == "tool_calls" and 1 <= len(c.message.tool_calls) <= 8 and not c.message.content, r
for call in c.message.tool_calls:
    check_call(call)
assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls), r

# A call cut by max_tokens is a call with its arguments as far as they were written (OpenAI's
# behaviour), ending `tool_calls`; cut before its name is whole, nothing (never markup as text).
cuts = []
for max_tokens in range(8, 40):
    r = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=max_tokens, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "read_file"}})
    c = r.choices[0]
    assert not c.message.content or "<tool" not in c.message.content, r
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, r
        assert c.message.tool_calls[0].function.name == "read_file", r
        cuts.append(c.message.tool_calls[0].function.arguments)
    else:
        assert c.finish_reason == "length" and r.usage.completion_tokens == max_tokens, r
assert any(a.startswith('{"') and not a.endswith("}") for a in cuts), cuts

# Under a grammar, top_logprobs lists only tokens that could have been sampled.
r = client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=30, temperature=0,
                                   tool_choice="required", logprobs=True, top_logprobs=5)
for t in r.choices[0].logprobs.content:
    assert all(isinstance(x.logprob, float) and x.logprob > -1e30 for x in t.top_logprobs), t

# `strict` tools under auto: the grammar takes hold only at a call's opener, so an answer in prose is
# the same as without it.
poem = [{"role": "user", "content": "Write a short poem about the sea."}]
loose = client.chat.completions.create(model=model, messages=poem, tools=tools, max_tokens=30, temperature=0)
strict = [dict(t, function=dict(t["function"], strict=True)) for t in tools]
tight = client.chat.completions.create(model=model, messages=poem, tools=strict, max_tokens=30, temperature=0)
assert tight.choices[0].message.content == loose.choices[0].message.content, (tight, loose)

# Streamed: the tool_calls deltas assemble into a valid call.
parts, finish = {}, None
for chunk in client.chat.completions.create(model=model, messages=ask, tools=tools, max_tokens=80, temperature=0,
                                            stream=True,
                                            tool_choice={"type": "function", "function": {"name": "list_dir"}}):
    for ch in chunk.choices:
        for tc in ch.delta.tool_calls or []:
            p = parts.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            p["id"] = tc.id or p["id"]
            if tc.function:
                p["name"] += tc.function.name or ""
                p["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
assert finish == "tool_calls" and len(parts) == 1 and parts[0]["id"], (finish, parts)
assert parts[0]["name"] == "list_dir", parts
a = json.loads(parts[0]["arguments"])
assert set(a) == {"dir", "depth"} and 1 <= a["depth"] <= 3, a

# A conversation with an assistant call and the tool's result: the result's text reaches the prompt.
secret = "zebra-4711"
conv = ask + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": json.dumps({"path": "notes.txt"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": f"The password is {secret}."},
]


def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


tokens = post("/tokenize", {"model": model, "messages": conv, "tools": tools})["tokens"]
prompt = post("/detokenize", {"model": model, "tokens": tokens})["prompt"]
assert secret in prompt and "read_file" in prompt and "notes.txt" in prompt, prompt
r = client.chat.completions.create(model=model, messages=conv, tools=tools, max_tokens=16, temperature=0)
assert r.usage.prompt_tokens == len(tokens), (r.usage, len(tokens))

# json_schema: every seeded sample at temperature 1 validates.
schema = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                         "rivers": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                         "capital": {"type": "boolean"}},
          "required": ["city", "population", "rivers", "capital"], "additionalProperties": False}


def sample(seed):
    r = client.chat.completions.create(
        model=model, seed=seed, temperature=1, max_tokens=200,
        messages=[{"role": "user", "content": "Describe a European city as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", (seed, r)
    v = json.loads(text)
    assert set(v) == set(schema["properties"]), (seed, text)
    assert v["city"] in ("Paris", "Rome", "Oslo") and isinstance(v["capital"], bool), (seed, text)
    assert isinstance(v["population"], int) and 0 <= v["population"] <= 99999999, (seed, text)
    assert len(v["rivers"]) <= 3 and all(isinstance(x, str) and len(x) <= 12 for x in v["rivers"]), (seed, text)
    return text


with ThreadPoolExecutor(32) as pool:
    texts = list(pool.map(sample, range(samples)))
assert len(set(texts)) > 1, "temperature 1 with different seeds gave one answer"

# json_object: a JSON object.
r = client.chat.completions.create(model=model, temperature=0, max_tokens=150, response_format={"type": "json_object"},
                                   messages=[{"role": "user", "content": 'Answer {"name": "Ada"} and nothing else.'}])
assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict), r

# guided_choice (vLLM's extension): exactly one of the choices.
r = client.chat.completions.create(model=model, temperature=0, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]},
                                   messages=[{"role": "user", "content": "Is Paris in France?"}])
assert r.choices[0].message.content in ("yes", "no"), r


# n > 1: choices of one prompt, each with its index; seeded choices differ from one another.
def hit_tokens():
    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("prefix_cache_tokens_total") and 'result="hit"' in line:
                return float(line.rsplit(" ", 1)[1])
    return None  # a router: the workers count their own hits


long_ask = [{"role": "user", "content": "Write a haiku about rivers. " + "Rivers run to the sea. " * 20}]
before = hit_tokens()
r = client.chat.completions.create(model=model, messages=long_ask, max_tokens=12, temperature=1, seed=5, n=3)
assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) > 1, r
assert r.usage.completion_tokens >= 3 and r.usage.prompt_tokens > 100, r.usage
after = hit_tokens()
if before is not None:
    # Choices 1 and 2 found the prompt's full blocks cached by choice 0.
    assert after - before >= 2 * 96, (before, after)
texts, finishes = {}, {}
for chunk in client.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=1, seed=9, n=2,
                                            stream=True):
    for ch in chunk.choices:
        texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        if ch.finish_reason:
            finishes[ch.index] = ch.finish_reason
assert sorted(texts) == [0, 1] and sorted(finishes) == [0, 1] and all(texts.values()), (texts, finishes)
r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=1, seed=3, n=2)
assert [c.index for c in r.choices] == [0, 1] and all(c.text for c in r.choices), r

# What is not served is refused with a 400 that names it, never ignored.
def refused(want, **kw):
    try:
        client.chat.completions.create(model=model, messages=ask, max_tokens=4, **kw)
    except BadRequestError as e:
        assert want in str(e), (want, str(e))
        return
    raise AssertionError(f"expected a 400 naming {want}")


refused("fancy_option", extra_body={"fancy_option": 1})
refused("yaml", response_format={"type": "yaml"})
refused("tool_choice", tool_choice="required")
refused("not in `tools`", tools=tools, tool_choice={"type": "function", "function": {"name": "rm"}})
refused("constraint", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}})
refused("constraint", response_format={"type": "json_schema", "json_schema": {
    "name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}})
print("OK")
