"""Request bodies of the HTTP API as pydantic models (they also make the OpenAPI schema).

Fields the router uses are typed strictly (a string is not a number, a number is not a string);
fields it does not know are allowed and ignored, because real clients send many (`user`, `store`,
`metadata`, `cache_prompt`, ...).  Names follow the OpenAI and Anthropic APIs, plus llama-server's
extensions (`top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`, `n_predict`, `chat_template_kwargs`,
`reasoning_format`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

__all__ = [
    "ChatCompletionRequest", "CompletionRequest", "AnthropicMessagesRequest", "AnthropicCountTokensRequest",
]

# A finite number: pydantic's float accepts ints; strict rejects strings and booleans.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MAX_STOP = 64
StopStr = Annotated[StrictStr, Field(min_length=1, max_length=1024)]
ToolName = Annotated[StrictStr, Field(min_length=1, max_length=128)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- sampling (shared) ------------------------------------------------------------------------------

class _Sampling(_Open):
    temperature: Annotated[Number, Field(ge=0, le=100)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=1 << 20)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[Number, Field(gt=0, le=100)] | None = None
    repeat_last_n: Annotated[StrictInt, Field(ge=-1, le=1 << 24)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    seed: Annotated[StrictInt, Field(ge=-1, le=(1 << 64) - 1)] | None = None


DraftCount = Annotated[StrictInt, Field(ge=0, le=256)]
DraftMargin = Annotated[Number, Field(ge=0, le=1)]


class SpeculativeRequest(_Closed):
    """Per-request speculative decoding knobs, as an object: `{"n_max", "n_min", "p_min" | "margin"}`.

    llama-server's names: n_max (most draft tokens per step; 0 = no speculation), n_min (shorter
    drafts are not verified).  `p_min` / `margin` both set the worker's draft_margin: drafting stops
    at the first token whose top-1 - top-2 draft probability is below it.  (llama-server's p_min
    tests the top-1 probability alone; the margin is never larger, so it cuts at least as early.)"""
    n_max: DraftCount | None = None
    n_min: DraftCount | None = None
    p_min: DraftMargin | None = None
    margin: DraftMargin | None = None


class _FlatSpeculative(BaseModel):
    """llama-server's flat spellings of the same knobs: `"speculative.n_max": 4` at the top level."""
    speculative_n_max: DraftCount | None = Field(default=None, alias="speculative.n_max")
    speculative_n_min: DraftCount | None = Field(default=None, alias="speculative.n_min")
    speculative_p_min: DraftMargin | None = Field(default=None, alias="speculative.p_min")


class StreamOptions(_Closed):
    include_usage: StrictBool | None = None


# ---- OpenAI chat ------------------------------------------------------------------------------------

class TextPart(_Closed):
    type: Literal["text"]
    text: StrictStr


class ImageUrlPart(_Closed):
    type: Literal["image_url"]
    image_url: Any = None


class InputAudioPart(_Closed):
    type: Literal["input_audio"]
    input_audio: Any = None


UserPart = Annotated[Union[TextPart, ImageUrlPart, InputAudioPart], Field(discriminator="type")]


class FunctionCall(_Closed):
    name: ToolName
    arguments: StrictStr = "{}"


class ToolCallIn(_Closed):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Open):
    role: Literal["system", "developer"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None


class UserMessage(_Open):
    role: Literal["user"]
    content: StrictStr | list[UserPart]
    name: StrictStr | None = None


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: StrictStr | None = None
    name: StrictStr | None = None


class ToolMessage(_Open):
    role: Literal["tool"]
    content: StrictStr | list[TextPart]
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


class FunctionDef(_Open):
    name: Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Closed):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Closed):
    name: ToolName


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_Sampling, _FlatSpeculative):
    model: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=100_000)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 24)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 24)] | None = None
    n_predict: Annotated[StrictInt, Field(ge=-1, le=1 << 24)] | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: Literal["none", "auto", "deepseek"] | None = None
    enable_thinking: StrictBool | None = None
    speculative: SpeculativeRequest | None = None


# ---- OpenAI completions -----------------------------------------------------------------------------

TokenId = Annotated[StrictInt, Field(ge=0, le=0x7FFFFFFF)]


class CompletionRequest(_Sampling, _FlatSpeculative):
    model: StrictStr | None = None
    prompt: StrictStr | Annotated[list[TokenId], Field(min_length=1, max_length=1 << 24)] | \
        Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 24)] | None = None
    n_predict: Annotated[StrictInt, Field(ge=-1, le=1 << 24)] | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    speculative: SpeculativeRequest | None = None


# ---- Anthropic Messages -----------------------------------------------------------------------------

class ATextBlock(_Open):
    type: Literal["text"]
    text: StrictStr


class AImageBlock(_Open):
    type: Literal["image", "document"]


class AToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: StrictStr
    name: ToolName
    input: dict[str, Any]


class AToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[Annotated[Union[ATextBlock, AImageBlock], Field(discriminator="type")]] | None = None
    is_error: StrictBool | None = None


class AThinkingBlock(_Open):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class ARedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"]
    data: StrictStr | None = None


ABlock = Annotated[Union[ATextBlock, AImageBlock, AToolUseBlock, AToolResultBlock, AThinkingBlock,
                         ARedactedThinkingBlock], Field(discriminator="type")]


class AMessage(_Open):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ABlock]


class ATool(_Open):
    name: Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class AToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: StrictBool | None = None


class AThinking(_Open):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=0)] | None = None


class _AnthropicConversation(_Open):
    model: StrictStr
    messages: Annotated[list[AMessage], Field(min_length=1, max_length=100_000)]
    system: StrictStr | list[ATextBlock] | None = None
    tools: Annotated[list[ATool], Field(max_length=512)] | None = None
    tool_choice: AToolChoice | None = None
    thinking: AThinking | None = None


class AnthropicMessagesRequest(_AnthropicConversation, _FlatSpeculative):
    max_tokens: Annotated[StrictInt, Field(ge=1, le=1 << 24)]
    stream: StrictBool = False
    stop_sequences: Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=1 << 20)] | None = None
    metadata: dict[str, Any] | None = None
    speculative: SpeculativeRequest | None = None


class AnthropicCountTokensRequest(_AnthropicConversation):
    pass
