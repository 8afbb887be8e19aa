"""benchmarks/agent_trace.py: its scripted session is a Messages conversation depctl reads as a chat, turn by turn."""

from __future__ import annotations

from benchmarks.agent_trace import STEPS, SYSTEM, TOOLS, conversation
from depctl_runtime.api.messages import MessagesRequest, to_chat


def test_every_turn_of_the_trace_is_a_messages_request_depctl_reads():
    for turn in range(len(STEPS) + 1):
        body = {"model": "m", "max_tokens": 8, "system": SYSTEM, "tools": TOOLS, "messages": conversation(turn)}
        chat = to_chat(MessagesRequest.model_validate(body))
        calls = [c for m in chat.messages for c in m.tool_calls or ()]
        results = [m.tool_call_id for m in chat.messages if m.role == "tool"]
        assert [c.function.name for c in calls] == [name for name, _, _ in STEPS[:turn]]
        assert results == [c.id for c in calls]  # every call answered, in order
    assert "return a - b" in conversation(len(STEPS))[2]["content"][0]["content"]  # the file the edits quote
