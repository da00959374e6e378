"""The official `openai` Python client against a running worker (base URL in argv[1]).
Run by tests/openai_client.rs; prints OK on success, raises on any failure."""
import json
import sys
import urllib.request

from openai import BadRequestError, OpenAI

base = sys.argv[1]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
model = client.models.list().data[0].id

# Chat, non-streaming.
r = client.chat.completions.create(model=model, temperature=0, max_tokens=20,
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
assert "Paris" in r.choices[0].message.content, r
assert r.choices[0].finish_reason == "stop", r
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

# Chat, streaming, with usage.
text, usage, finish = "", None, None
for chunk in client.chat.completions.create(model=model, temperature=0, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "What is the capital of France?"}]):
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        text += c.delta.content or ""
        finish = c.finish_reason or finish
assert "Paris" in text and finish == "stop" and usage and usage.completion_tokens > 0, (text, finish, usage)

# Completions with a stop sequence.
r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0, stop=[" Paris"])
assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].text, r

# echo: the prompt comes back ahead of the answer, streamed or not, from text or token ids.
prompt = "The capital of France is"
r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True)
plain = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
assert r.choices[0].text == prompt + plain, (r, plain)
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True) if c.choices)
assert streamed == prompt + plain, (streamed, plain)
ids = json.loads(urllib.request.urlopen(urllib.request.Request(
    base + "/tokenize", data=json.dumps({"prompt": prompt}).encode(),
    headers={"content-type": "application/json"})).read())["tokens"]
r = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, echo=True)
assert r.choices[0].text == prompt + plain, r
# suffix: this model has no fill-in-the-middle tokens, and says so.
try:
    client.completions.create(model=model, prompt="def f(", suffix="    return x", max_tokens=4)
    raise AssertionError("expected a 400 for suffix")
except BadRequestError as e:
    assert "fill-in-the-middle" in str(e), e

# A seeded sampling request gives the same text twice.
kw = dict(model=model, temperature=0.9, seed=77, max_tokens=24, messages=[{"role": "user", "content": "Tell me a joke."}])
a = client.chat.completions.create(**kw).choices[0].message.content
b = client.chat.completions.create(**kw).choices[0].message.content
assert a == b and a, (a, b)

# An error comes back as the client's typed exception with our JSON body.
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    raise AssertionError("expected NotFoundError")
except Exception as e:
    assert type(e).__name__ == "NotFoundError", repr(e)
print("OK")
