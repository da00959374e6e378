"""The official `openai` Python client against a running worker (base URL in argv[1]).
Run by tests/openai_client.rs; prints OK on success, raises on any failure."""
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
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
