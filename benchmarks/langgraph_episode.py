"""A tool-calling agent team through LangGraph against ``precache serve``: its cached-token share.

Three agents on the three committed ``qv`` role adapters of the embedded SmolLM2, one LangGraph
graph per HotpotQA dev question: ``plan`` (thinks, tools offered) -> ``action`` (must call a tool:
``retrieve(entity)`` over the question's own paragraphs, or ``finish(answer)``) -> the tool runs ->
``reflect`` (judges, tools offered) -> end. Every agent is sent the same system prompt and tools,
so each prompt extends the one before it and the server reads it from the cache the previous
agent (another adapter) wrote. The share reported is the server's own count: ``cached_tokens`` /
``prompt_tokens`` per agent, summed over the questions (the OpenAI usage field, LangChain's
``usage_metadata["input_token_details"]["cache_read"]``).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/langgraph_episode.py --questions 10 \
        --json benchmarks/results/langgraph_episode.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

import precache
from precache.agents.data import load_questions
from precache.agents.tools import ToolEnv
from precache.resources import adapter_set
from precache.server import LiveServer, ServerConfig, create_app

SYSTEM = (
    "You answer questions with tools. Use retrieve to read about an entity, "
    "then finish with the answer. Keep every message short."
)
AGENTS = ("plan", "action", "reflect")


def episode(url: str, question) -> dict[str, dict]:
    """One question through the graph; the usage of each agent's request."""
    env = ToolEnv(question)

    @tool
    def retrieve(entity: str) -> str:
        """The paragraph about an entity."""
        return env.retrieve(entity).observation

    @tool
    def finish(answer: str) -> str:
        """Give the final answer."""
        return f"Answer given: {answer}"

    tools = [retrieve, finish]

    def model(adapter: str, **binding):
        llm = ChatOpenAI(base_url=url, api_key="unused", model=adapter, temperature=0, max_tokens=60)
        return llm.bind_tools(tools, **binding)

    llms = {
        "plan": model("plan"),
        "action": model("action", tool_choice="required", parallel_tool_calls=False),
        "reflect": model("reflect"),
    }

    def node(agent: str):
        return lambda state: {"messages": [llms[agent].invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    for agent in AGENTS:
        graph.add_node(agent, node(agent))
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "action")
    graph.add_edge("action", "tools")
    graph.add_edge("tools", "reflect")
    graph.add_edge("reflect", END)
    out = graph.compile().invoke({"messages": [SystemMessage(SYSTEM), HumanMessage(question.question)]})
    usage = {}
    for message in out["messages"]:
        agent = message.response_metadata.get("model_name") if hasattr(message, "response_metadata") else None
        if agent in AGENTS and message.usage_metadata:
            u = message.usage_metadata
            usage[agent] = {
                "prompt": u["input_tokens"],
                "cached": u["input_token_details"].get("cache_read", 0),
            }
    return usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=10, help="HotpotQA dev questions (default 10)")
    parser.add_argument("--method", default="prelrshared")
    parser.add_argument("--json", default=None, help="write the per-agent totals here")
    args = parser.parse_args()
    engine = precache.Engine(precache.load_model(), adapters=adapter_set("qv"), method=args.method)
    app = create_app(engine, ServerConfig(model_name="smol"))
    totals: dict[str, dict[str, int]] = defaultdict(lambda: {"prompt": 0, "cached": 0, "requests": 0})
    t0 = time.perf_counter()
    with LiveServer(app) as server:
        for question in load_questions("dev")[: args.questions]:
            for agent, u in episode(server.url, question).items():
                totals[agent]["prompt"] += u["prompt"]
                totals[agent]["cached"] += u["cached"]
                totals[agent]["requests"] += 1
    wall = time.perf_counter() - t0
    print(f"{args.questions} questions, {args.method}, {wall:.0f} s")
    print("| agent | requests | prompt tokens | cached tokens | cached share |")
    print("|---|---|---|---|---|")
    all_prompt = all_cached = 0
    for agent in AGENTS:
        t = totals[agent]
        all_prompt, all_cached = all_prompt + t["prompt"], all_cached + t["cached"]
        share = t["cached"] / t["prompt"] if t["prompt"] else 0.0
        print(f"| {agent} | {t['requests']} | {t['prompt']} | {t['cached']} | {share:.1%} |")
    print(f"| all | | {all_prompt} | {all_cached} | {all_cached / max(all_prompt, 1):.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"method": args.method, "questions": args.questions, "wall_s": wall, "agents": totals},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
