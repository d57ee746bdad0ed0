"""The agent frameworks' own clients against ``precache serve`` on loopback, on the embedded SmolLM2
with the committed ``qv`` role adapters: the openai SDK, LangChain (langchain-openai), LangGraph
and AutoGen (autogen-agentchat + autogen-ext). Each completes a tool round trip (the small model is
forced to call with ``tool_choice: required``; its arguments are checked against the tool's
schema), structured output parses into the asked type, and a three-agent LangGraph graph on three
adapters reads its later prompts from the cache the earlier agents wrote."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

import precache
from precache.resources import adapter_set
from tests.test_server_support import live

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the weather in Paris?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


def weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}, 21 degrees."


class City(BaseModel):
    name: str = Field(max_length=30)  # bounded: the answer fits max_tokens whatever the model writes
    country: str = Field(max_length=30)


@pytest.fixture(scope="module")
def served():
    engine = precache.Engine(precache.load_model(), adapters=adapter_set("qv"), method="prelrshared")
    with live(engine, model_name="smol") as (server, client):
        yield server, client


def test_openai_sdk_tool_round_trip_and_parse(served):
    _, client = served
    tools = [
        {
            "type": "function",
            "function": {"name": "weather", "description": weather.__doc__, "parameters": WEATHER_SCHEMA},
        }
    ]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model="action", messages=messages, tools=tools, tool_choice="required", temperature=0, max_tokens=60
    )
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_SCHEMA)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": weather(**args)},
    ]
    final = client.chat.completions.create(
        model="reflect", messages=messages, tools=tools, temperature=0, max_tokens=40
    )
    assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
    # the second prompt extends the first: it is read from the cache another adapter wrote
    assert final.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    parsed = client.chat.completions.parse(
        model="plan",
        messages=[{"role": "user", "content": "Name a city in France."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    assert isinstance(parsed.choices[0].message.parsed, City)


def test_langchain_tool_round_trip_and_structured_output(served):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    server, _ = served
    get_weather = tool(weather)
    llm = ChatOpenAI(base_url=server.url, api_key="unused", model="action", temperature=0, max_tokens=60)
    messages = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    ai = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(messages)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "weather"
    jsonschema.validate(ai.tool_calls[0]["args"], WEATHER_SCHEMA)
    messages += [
        ai,
        ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"]),
    ]
    final = llm.bind_tools([get_weather]).invoke(messages)  # the same tools: the same prompt prefix
    assert isinstance(final.content, str) and final.content
    assert final.usage_metadata["input_token_details"]["cache_read"] > 0
    roomy = ChatOpenAI(base_url=server.url, api_key="unused", model="action", temperature=0, max_tokens=150)
    structured = roomy.with_structured_output(City, method="json_schema")
    city = structured.invoke("Name a city in France.")
    assert isinstance(city, City)


def test_langgraph_three_agents_on_three_adapters_share_the_cache(served):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    server, _ = served
    get_weather = tool(weather)

    def model(adapter: str) -> ChatOpenAI:
        return ChatOpenAI(base_url=server.url, api_key="unused", model=adapter, temperature=0, max_tokens=60)

    # one forced call: a small model left free to add parallel calls runs on to max_tokens
    acting = model("action").bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)

    # every agent is sent the same tools, so every prompt starts with the same tool listing
    planning, reflecting = (model(a).bind_tools([get_weather]) for a in ("plan", "reflect"))

    def plan(state: MessagesState):
        return {"messages": [planning.invoke(state["messages"])]}

    def action(state: MessagesState):
        return {"messages": [acting.invoke(state["messages"])]}

    def reflect(state: MessagesState):
        return {"messages": [reflecting.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("plan", plan)
    graph.add_node("action", action)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_node("reflect", reflect)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "action")
    graph.add_edge("action", "tools")
    graph.add_edge("tools", "reflect")
    graph.add_edge("reflect", END)
    out = graph.compile().invoke({"messages": [SystemMessage(SYSTEM), HumanMessage(QUESTION)]})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["SystemMessage", "HumanMessage", "AIMessage", "AIMessage", "ToolMessage", "AIMessage"]
    plan_msg, action_msg, tool_msg, reflect_msg = out["messages"][2:]
    assert isinstance(action_msg, AIMessage) and action_msg.tool_calls[0]["name"] == "weather"
    assert isinstance(tool_msg, ToolMessage) and "sunny" in tool_msg.content
    for later in (action_msg, reflect_msg):  # each reads what the adapter before it cached
        usage = later.usage_metadata
        assert usage["input_token_details"]["cache_read"] >= usage["input_tokens"] // 2, usage
    assert plan_msg.response_metadata["model_name"] == "plan"


def test_autogen_tool_round_trip_structured_output_and_a_streaming_agent(served):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_core import CancellationToken
    from autogen_core.models import (
        AssistantMessage,
        FunctionExecutionResult,
        FunctionExecutionResultMessage,
        SystemMessage,
        UserMessage,
    )
    from autogen_core.tools import FunctionTool
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    server, _ = served
    model_info = {
        "vision": False,
        "function_calling": True,
        "json_output": True,
        "structured_output": True,
        "family": "unknown",
    }

    def autogen_client(adapter: str, **options) -> OpenAIChatCompletionClient:
        return OpenAIChatCompletionClient(
            model=adapter,
            base_url=server.url,
            api_key="unused",
            model_info=model_info,
            temperature=0,
            **options,
        )

    async def run():
        client = autogen_client("action", max_tokens=60)
        tool = FunctionTool(weather, description=weather.__doc__)
        messages = [SystemMessage(content=SYSTEM), UserMessage(content=QUESTION, source="user")]
        first = await client.create(messages, tools=[tool], tool_choice="required")
        assert first.finish_reason == "function_calls"
        call = first.content[0]
        args = json.loads(call.arguments)
        jsonschema.validate(args, WEATHER_SCHEMA)
        result = await tool.run_json(args, CancellationToken())
        messages += [
            AssistantMessage(content=first.content, source="action"),
            FunctionExecutionResultMessage(
                content=[FunctionExecutionResult(content=str(result), call_id=call.id, name=call.name)]
            ),
        ]
        final = await client.create(messages)
        assert isinstance(final.content, str) and final.content
        city = await client.create(
            [UserMessage(content="Name a city in France.", source="user")], json_output=City
        )
        City.model_validate_json(city.content)
        streaming = autogen_client("reflect", max_tokens=30, stream_options={"include_usage": True})
        agent = AssistantAgent(
            "reflect", model_client=streaming, model_client_stream=True, system_message=SYSTEM
        )
        out = await agent.run(task=QUESTION)
        assert out.messages[-1].content and out.messages[-1].models_usage.prompt_tokens > 0
        await client.close()
        await streaming.close()

    asyncio.run(run())
