"""One greedy request through each API with the real SDKs, streamed or not: its text, the prompt
tokens its engine served from cache, and the prompt's length."""

from __future__ import annotations

import anthropic
import openai

from tests.pd.cluster import MODEL

APIS = ("chat", "completions", "responses", "messages")
MAX_TOKENS = 8


Answer = tuple[str, int, int]  # text, cached prompt tokens, prompt tokens


def ask(url: str, api: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> Answer:
    if api == "messages":
        return _messages(url, prompt, stream, max_tokens)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    if api == "chat":
        request = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if not stream:
            reply = client.chat.completions.create(**request)
            usage = reply.usage
            return (
                reply.choices[0].message.content or "",
                usage.prompt_tokens_details.cached_tokens,
                usage.prompt_tokens,
            )
        text, cached, prompt_tokens = "", -1, -1
        for chunk in client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                cached, prompt_tokens = (
                    chunk.usage.prompt_tokens_details.cached_tokens,
                    chunk.usage.prompt_tokens,
                )
        return text, cached, prompt_tokens
    if api == "completions":
        request = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if not stream:
            completion = client.completions.create(**request)
            usage = completion.usage
            return completion.choices[0].text, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens
        text, cached, prompt_tokens = "", -1, -1
        for chunk in client.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        ):
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                cached, prompt_tokens = (
                    chunk.usage.prompt_tokens_details.cached_tokens,
                    chunk.usage.prompt_tokens,
                )
        return text, cached, prompt_tokens
    request = {"model": MODEL, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0}
    if not stream:
        response = client.responses.create(**request)
        usage = response.usage
        return response.output_text, usage.input_tokens_details.cached_tokens, usage.input_tokens
    text, cached, prompt_tokens = "", -1, -1
    for event in client.responses.create(**request, stream=True):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            usage = event.response.usage
            cached, prompt_tokens = usage.input_tokens_details.cached_tokens, usage.input_tokens
    return text, cached, prompt_tokens


def _messages(url: str, prompt: str, stream: bool, max_tokens: int) -> Answer:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "extra_body": {"temperature": 0},  # this SDK version no longer takes it as an argument
    }
    if not stream:
        message = client.messages.create(**request)
        text = "".join(block.text for block in message.content if block.type == "text")
        cached = message.usage.cache_read_input_tokens or 0
        return text, cached, message.usage.input_tokens + cached
    text, cached, prompt_tokens = "", -1, -1
    for event in client.messages.create(**request, stream=True):
        if event.type == "message_start":
            usage = event.message.usage
            cached = usage.cache_read_input_tokens or 0
            prompt_tokens = usage.input_tokens + cached
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
    return text, cached, prompt_tokens
