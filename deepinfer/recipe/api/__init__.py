"""API codecs: each module parses one API's request body into the Conversation IR (Completions:
into raw prompts and generation parameters) and encodes canonical output events into that API's
response body or stream events."""

from __future__ import annotations

from deepinfer.recipe.api._output import GenerationError, new_id
from deepinfer.recipe.api.chat_completions import chat_completion_to_conversation
from deepinfer.recipe.api.chat_completions_encoder import ChatCompletionEncoder, build_chat_completion
from deepinfer.recipe.api.completions import CompletionEncoder, parse_completion_request
from deepinfer.recipe.api.error_bodies import (
    anthropic_error_body,
    anthropic_error_from,
    openai_error_body,
    openai_error_from,
)
from deepinfer.recipe.api.messages import (
    count_tokens_body,
    count_tokens_to_conversation,
    messages_to_conversation,
)
from deepinfer.recipe.api.messages_encoder import MessagesEncoder, build_message
from deepinfer.recipe.api.responses import (
    parse_responses_request,
    request_to_conversation,
    response_echo,
    responses_to_conversation,
)
from deepinfer.recipe.api.responses_encoder import ResponsesEncoder, build_response
from deepinfer.recipe.api.sse import SSE_DONE, sse_frame

__all__ = [
    "SSE_DONE",
    "ChatCompletionEncoder",
    "CompletionEncoder",
    "GenerationError",
    "MessagesEncoder",
    "ResponsesEncoder",
    "anthropic_error_body",
    "anthropic_error_from",
    "build_chat_completion",
    "build_message",
    "build_response",
    "chat_completion_to_conversation",
    "count_tokens_body",
    "count_tokens_to_conversation",
    "messages_to_conversation",
    "new_id",
    "openai_error_body",
    "openai_error_from",
    "parse_completion_request",
    "parse_responses_request",
    "request_to_conversation",
    "response_echo",
    "responses_to_conversation",
    "sse_frame",
]
