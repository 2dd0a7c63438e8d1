"""Anthropic Messages API <-> the router's chat form.

`to_chat(request)` turns an Anthropic conversation (system prompt, content blocks, `tool_use` /
`tool_result` blocks, tools with `input_schema`, `tool_choice`, `thinking`) into the OpenAI-shaped
messages and tools that `router.chat.normalize_messages` and the chat template take.  The HTTP layer
builds responses and stream events from the parsed output with `stop_reason`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from router.chat import ChatError

__all__ = ["AnthropicChat", "to_chat", "stop_reason"]


@dataclass
class AnthropicChat:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any  # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    enable_thinking: bool | None


def _blocks_text(blocks: Any, where: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, b in enumerate(blocks):
        if b.type == "text":
            parts.append(b.text)
        else:
            raise ChatError(f"{where}[{i}]: content of type {b.type!r} is not supported (text only)")
    return "\n".join(parts)


def to_chat(req: Any) -> AnthropicChat:
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        system = _blocks_text(req.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            text, reasoning, calls = [], [], []
            for j, b in enumerate(m.content):
                if b.type == "text":
                    text.append(b.text)
                elif b.type == "thinking":
                    reasoning.append(b.thinking)
                elif b.type == "tool_use":
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
                elif b.type == "redacted_thinking":
                    continue
                else:
                    raise ChatError(f"{where}[{j}]: an assistant turn cannot hold {b.type!r} blocks")
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
            continue
        # user turn: tool results become `tool` messages (in order), text stays a user message
        pending_text: list[str] = []
        for j, b in enumerate(m.content):
            if b.type == "text":
                pending_text.append(b.text)
            elif b.type == "tool_result":
                if pending_text:
                    messages.append({"role": "user", "content": "\n".join(pending_text)})
                    pending_text = []
                content = _blocks_text(b.content, f"{where}[{j}].content")
                if b.is_error:
                    content = f"Error: {content}"
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
            elif b.type in ("thinking", "redacted_thinking"):
                continue
            else:
                raise ChatError(f"{where}[{j}]: content of type {b.type!r} is not supported (text only)")
        if pending_text:
            messages.append({"role": "user", "content": "\n".join(pending_text)})
    tools = None
    if req.tools:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in req.tools]
    choice: Any = "auto"
    if req.tool_choice is not None:
        kind = req.tool_choice.type
        if kind == "any":
            choice = "required"
        elif kind == "none":
            choice = "none"
        elif kind == "tool":
            if not req.tool_choice.name:
                raise ChatError("tool_choice of type 'tool' needs a name")
            choice = {"type": "function", "function": {"name": req.tool_choice.name}}
    thinking = None
    if req.thinking is not None:
        thinking = req.thinking.type != "disabled"
    return AnthropicChat(messages=messages, tools=tools, tool_choice=choice, enable_thinking=thinking)


def stop_reason(finish_reason: str, has_tool_calls: bool, stop_sequence: str | None) -> str:
    if has_tool_calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"
