"""Agent frameworks, unchanged, against pdserve (argv[1]: a worker's or a router's base URL; argv[2]: the
framework). Each runs a small realistic scenario at temperature 0: an agent loop with a function tool
and its result, streaming, structured output, and the Responses API where the framework uses it.
The checks are what the server decides (calls that fit their schemas, the loop's turns, the shapes
each framework parses), not what the 135M model knows. Prints OK on success, raises on any failure.
Run by tests/frameworks.rs with the pinned versions of xtask/test-requirements.txt."""
import asyncio
import json
import os
import sys

# litellm reads its model price list from the network unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

base, framework = sys.argv[1], sys.argv[2]
V1 = base + "/v1"
KEY = "unused"
CITIES = ["Paris", "Rome", "Oslo"]


def model_id():
    from openai import OpenAI
    return OpenAI(base_url=V1, api_key=KEY, max_retries=0).models.list().data[0].id


MODEL = model_id()
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                  "required": ["city"], "additionalProperties": False}
calls_made = []


def get_weather(city: str) -> str:
    calls_made.append(city)
    return f"It is sunny in {city}, 21 degrees."


def check_city(args):
    a = json.loads(args) if isinstance(args, str) else args
    assert set(a) == {"city"} and a["city"] in CITIES, a
    return a["city"]


def run_openai():
    """The openai SDK: a chat agent loop (forced call, the tool's result, an answer), streaming,
    `parse` with a Pydantic model, and the Responses API with a function call and its output."""
    from openai import OpenAI
    from pydantic import BaseModel

    c = OpenAI(base_url=V1, api_key=KEY, max_retries=0, timeout=600)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": WEATHER_SCHEMA, "strict": True}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_tokens=60)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, r
    call = ch.message.tool_calls[0]
    city = check_city(call.function.arguments)
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": get_weather(city)}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, temperature=0, max_tokens=24)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length"), r
    # Streamed with usage.
    text, usage = "", None
    for chunk in c.chat.completions.create(model=MODEL, messages=msgs[:1], temperature=0, max_tokens=16,
                                           stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert text and usage and usage.completion_tokens > 0, (text, usage)

    class Pick(BaseModel):
        city: str
        sunny: bool

    p = c.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Pick a city."}],
                                 response_format=Pick, temperature=0, max_tokens=40)
    assert isinstance(p.choices[0].message.parsed, Pick), p
    # The Responses API: a call, its output, an answer that follows from the stored response.
    rt = [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}]
    r = c.responses.create(model=MODEL, input="What is the weather in Rome?", tools=rt, tool_choice="required",
                           parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    fc = [o for o in r.output if o.type == "function_call"]
    assert len(fc) == 1, r
    city = check_city(fc[0].arguments)
    r2 = c.responses.create(model=MODEL, previous_response_id=r.id, tools=rt, temperature=0, max_output_tokens=24,
                            input=[{"type": "function_call_output", "call_id": fc[0].call_id,
                                    "output": get_weather(city)}])
    assert r2.output_text and r2.previous_response_id == r.id, r2
    pr = c.responses.parse(model=MODEL, input="Pick a city.", text_format=Pick, temperature=0, max_output_tokens=40)
    assert isinstance(pr.output_parsed, Pick), pr


def run_openai_agents():
    """openai-agents: an Agent with a function tool over the Responses API (its default model) and
    over chat completions, run to the end, streamed, and with a structured output type."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=V1, api_key=KEY, max_retries=0, timeout=600)

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return get_weather(city)

    settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=60, parallel_tool_calls=False)

    class Pick(BaseModel):
        city: str

    async def scenario():
        # One event loop for the whole run: the async client is bound to it.
        for model in (OpenAIResponsesModel(MODEL, client), OpenAIChatCompletionsModel(MODEL, client)):
            before = len(calls_made)
            agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[weather],
                          model=model, model_settings=settings, tool_use_behavior="stop_on_first_tool")
            result = await Runner.run(agent, "What is the weather in Oslo?")
            assert len(calls_made) == before + 1, (type(model).__name__, calls_made)
            assert "sunny" in str(result.final_output), result.final_output
            r = Runner.run_streamed(agent, "What is the weather in Paris?")
            kinds = [e.type async for e in r.stream_events()]
            assert "raw_response_event" in kinds and "sunny" in str(r.final_output), (kinds, r.final_output)
        agent = Agent(name="picker", instructions="Pick a city.", output_type=Pick,
                      model=OpenAIResponsesModel(MODEL, client),
                      model_settings=ModelSettings(temperature=0, max_tokens=40))
        out = (await Runner.run(agent, "Pick a city.")).final_output
        assert isinstance(out, Pick), out

    asyncio.run(scenario())


def run_pydantic_ai():
    """pydantic-ai: an agent whose structured output is a forced tool call, with a function tool it
    may use, over chat completions and the Responses API; streamed text."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=V1, api_key=KEY)

    class Pick(BaseModel):
        city: str
        sunny: bool

    for model in (OpenAIChatModel(MODEL, provider=provider), OpenAIResponsesModel(MODEL, provider=provider)):
        agent = Agent(model, output_type=Pick, model_settings={"temperature": 0, "max_tokens": 60})
        out = agent.run_sync("Pick a city and say whether it is sunny.").output
        assert isinstance(out, Pick), out
        plain = Agent(model, model_settings={"temperature": 0, "max_tokens": 16})

        async def streamed():
            async with plain.run_stream("Say hello.") as r:
                return "".join([t async for t in r.stream_text(delta=True)])

        assert asyncio.run(streamed()), "no streamed text"


def run_langchain():
    """langchain-openai: a bound tool forced, the tool's result as a ToolMessage, an answer;
    streaming; structured output."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    @tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return get_weather(city)

    llm = ChatOpenAI(model=MODEL, base_url=V1, api_key=KEY, temperature=0, max_tokens=60, max_retries=0)
    msgs = [HumanMessage("What is the weather in Rome?")]
    ai = llm.bind_tools([weather], tool_choice="required", parallel_tool_calls=False).invoke(msgs)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "weather", ai
    result = weather.invoke(ai.tool_calls[0]["args"])
    msgs += [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([weather]).invoke(msgs)
    assert isinstance(final.content, str) and final.content, final
    chunks = list(llm.stream("Say hello."))
    assert "".join(c.content for c in chunks), chunks

    class Pick(BaseModel):
        city: str

    out = llm.with_structured_output(Pick, method="json_schema").invoke("Pick a city.")
    assert isinstance(out, Pick), out
    out = llm.with_structured_output(Pick, method="function_calling").invoke("Pick a city.")
    assert isinstance(out, Pick), out


def run_instructor():
    """instructor: a Pydantic model through forced tool calls and through JSON schema output."""
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str
        degrees: int = Field(ge=-50, le=60)

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        c = instructor.from_openai(OpenAI(base_url=V1, api_key=KEY, max_retries=0), mode=mode)
        w = c.chat.completions.create(model=MODEL, response_model=Weather, max_retries=0, temperature=0,
                                      max_tokens=60, messages=[{"role": "user", "content": "Weather in Oslo?"}])
        assert isinstance(w, Weather) and -50 <= w.degrees <= 60, w


def run_anthropic():
    """anthropic: a forced tool_use, its tool_result, an answer; streaming; count_tokens."""
    from anthropic import Anthropic

    # Sampling settings are not in this client's signature (newer Claude models take none).
    T0 = {"temperature": 0}
    c = Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=600)
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = c.messages.create(model=MODEL, max_tokens=60, tools=tools, messages=msgs,
                          tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=T0)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1, m
    city = check_city(uses[0].input)
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                           "content": get_weather(city)}]}]
    m = c.messages.create(model=MODEL, max_tokens=24, tools=tools, messages=msgs, extra_body=T0)
    assert m.content and m.content[0].type == "text" and m.content[0].text, m
    with c.messages.stream(model=MODEL, max_tokens=16, messages=msgs[:1], extra_body=T0) as s:
        text = "".join(s.text_stream)
    assert text, "no streamed text"
    n = c.messages.count_tokens(model=MODEL, messages=msgs, tools=tools).input_tokens
    assert n > 20, n


def run_litellm():
    """litellm: OpenAI-compatible chat with a forced tool, its result and an answer; streaming; the
    Anthropic route to /v1/messages; the Responses API."""
    import litellm

    litellm.telemetry = False
    kw = dict(api_base=V1, api_key=KEY, temperature=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
    msgs = [{"role": "user", "content": "What is the weather in Rome?"}]
    r = litellm.completion(model="openai/" + MODEL, messages=msgs, tools=tools, tool_choice="required",
                           parallel_tool_calls=False, max_tokens=60, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, r
    call = ch.message.tool_calls[0]
    city = check_city(call.function.arguments)
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": get_weather(city)}]
    r = litellm.completion(model="openai/" + MODEL, messages=msgs, tools=tools, max_tokens=24, **kw)
    assert r.choices[0].message.content, r
    text = "".join(c.choices[0].delta.content or "" for c in
                   litellm.completion(model="openai/" + MODEL, messages=msgs[:1], max_tokens=16, stream=True, **kw))
    assert text, "no streamed text"
    r = litellm.completion(model="anthropic/" + MODEL, api_base=base, api_key=KEY, temperature=0, max_tokens=16,
                           messages=msgs[:1])
    assert r.choices[0].message.content, r
    r = litellm.responses(model="openai/" + MODEL, input="Say hello.", max_output_tokens=16, **kw)
    assert r.output and r.output[0].content[0].text, r


{
    "openai": run_openai,
    "openai-agents": run_openai_agents,
    "pydantic-ai": run_pydantic_ai,
    "langchain": run_langchain,
    "instructor": run_instructor,
    "anthropic": run_anthropic,
    "litellm": run_litellm,
}[framework]()
print("OK")
