"""OpenAI's Responses API through the official `openai` Python client, against a worker or a router
(base URL in argv[1]): text, instructions, streaming (the SDK's own event parser), function tools and
their results, structured output, stored conversations (`previous_response_id`, retrieve, delete,
`store: false`), and what is refused. Prints OK on success, raises on any failure."""
import json
import re
import sys

from openai import BadRequestError, NotFoundError, OpenAI

base = sys.argv[1]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
model = client.models.list().data[0].id

# A plain answer with instructions: one message item, usage in the Responses' words.
r = client.responses.create(model=model, input="What is the capital of France?", instructions="Answer in one short sentence.",
                            max_output_tokens=16, temperature=0)
assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete"), r
assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text", r
assert "Paris" in r.output_text and r.instructions == "Answer in one short sentence.", r
assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 16, r.usage
assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage

# Cut by max_output_tokens: incomplete, with the reason.
r = client.responses.create(model=model, input="Write a long story about the sea.", max_output_tokens=5, temperature=0)
assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
assert r.usage.output_tokens == 5, r.usage

# Log-probabilities when asked for, whole and streamed.
r = client.responses.create(model=model, input="Name a fruit.", max_output_tokens=6, temperature=0,
                            include=["message.output_text.logprobs"], top_logprobs=2)
lps = r.output[0].content[0].logprobs
assert len(lps) == 6 and all(len(l.top_logprobs) == 2 for l in lps), lps
with client.responses.stream(model=model, input="Name a fruit.", max_output_tokens=6, temperature=0,
                             include=["message.output_text.logprobs"], top_logprobs=2) as s:
    streamed = [lp for ev in s if ev.type == "response.output_text.delta" for lp in ev.logprobs]
assert [l.token for l in streamed] == [l.token for l in lps], (streamed, lps)

# Streamed: the SDK's own event parser assembles the same answer as the whole one.
whole = client.responses.create(model=model, input="Name a fruit.", max_output_tokens=12, temperature=0)
kinds, text = [], ""
with client.responses.stream(model=model, input="Name a fruit.", max_output_tokens=12, temperature=0) as s:
    for ev in s:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
    final = s.get_final_response()
assert kinds[:2] == ["response.created", "response.in_progress"], kinds
assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
assert "response.output_item.added" in kinds and "response.output_text.done" in kinds, kinds
assert text == final.output_text == whole.output_text, (text, final.output_text, whole.output_text)
assert [e for e in kinds if e.endswith(".delta")], kinds

tools = [{"type": "function", "name": "read_file", "description": "Read a text file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                         "required": ["path"], "additionalProperties": False}}]

# A forced function call: a function_call item whose arguments fit the schema.
r = client.responses.create(model=model, input="What is in notes.txt?", tools=tools, max_output_tokens=80,
                            temperature=0, tool_choice={"type": "function", "name": "read_file"})
calls = [o for o in r.output if o.type == "function_call"]
assert r.status == "completed" and len(calls) == 1 and calls[0].name == "read_file", r
assert set(json.loads(calls[0].arguments)) == {"path"} and calls[0].call_id, calls

# Cut by max_output_tokens inside the call: incomplete (its arguments may be half written), never
# markup as text.
cut = client.responses.create(model=model, input="What is in notes.txt?", tools=tools, max_output_tokens=14,
                              temperature=0, tool_choice={"type": "function", "name": "read_file"})
assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens", cut
assert all(o.name == "read_file" for o in cut.output if o.type == "function_call"), cut
assert "<tool" not in cut.output_text, cut
# Ids are unguessable (a stored response is read back by its id alone).
assert re.fullmatch(r"resp_[0-9a-f]{32}", r.id), r.id

# The same streamed: the arguments arrive as function_call_arguments events.
with client.responses.stream(model=model, input="What is in notes.txt?", tools=tools, max_output_tokens=80,
                             temperature=0, tool_choice="required", parallel_tool_calls=False) as s:
    kinds = [ev.type for ev in s]
    final = s.get_final_response()
assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds, kinds
fc = [o for o in final.output if o.type == "function_call"]
assert len(fc) == 1 and "path" in json.loads(fc[0].arguments), final

# The call's output goes back as an item (in the input, or after previous_response_id): the result's
# text reaches the prompt.
secret = "The password is zebra-4711. " * 5
follow = client.responses.create(model=model, previous_response_id=r.id, max_output_tokens=4, temperature=0,
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": secret}])
inline = client.responses.create(model=model, max_output_tokens=4, temperature=0, input=[
    {"role": "user", "content": "What is in notes.txt?"},
    {"type": "function_call", "call_id": calls[0].call_id, "name": "read_file", "arguments": calls[0].arguments},
    {"type": "function_call_output", "call_id": calls[0].call_id, "output": secret}])
bare = client.responses.create(model=model, input="What is in notes.txt?", max_output_tokens=4, temperature=0)
assert follow.usage.input_tokens == inline.usage.input_tokens > bare.usage.input_tokens + 25, (
    follow.usage, inline.usage, bare.usage)
assert follow.previous_response_id == r.id, follow

# Stored responses: retrieved, deleted (then gone); `store: false` keeps nothing.
assert client.responses.retrieve(follow.id).id == follow.id
client.responses.delete(follow.id)
for gone in (lambda: client.responses.retrieve(follow.id),
             lambda: client.responses.create(model=model, input="x", previous_response_id=follow.id, max_output_tokens=2)):
    try:
        gone()
        raise AssertionError("a deleted response was found")
    except NotFoundError:
        pass
unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
try:
    client.responses.retrieve(unstored.id)
    raise AssertionError("store: false was stored")
except NotFoundError:
    pass

# Structured output: text.format json_schema.
schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
          "required": ["city"], "additionalProperties": False}
r = client.responses.create(model=model, input="Pick a city.", max_output_tokens=30, temperature=0,
                            text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
assert json.loads(r.output_text)["city"] in ("Paris", "Rome"), r


# What is not served is refused with a 400 that names it.
def refused(want, **kw):
    args = dict(model=model, input="Hi", max_output_tokens=2)
    args.update(kw)
    try:
        client.responses.create(**args)
    except BadRequestError as e:
        assert want in str(e), (want, str(e))
        return
    raise AssertionError(f"expected a 400 naming {want}")


refused("web_search", tools=[{"type": "web_search"}])
refused("background", background=True)
refused("input_image", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}])
print("OK")
