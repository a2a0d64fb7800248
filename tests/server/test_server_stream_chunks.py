"""The fast SSE chunk encoder (``serving.StreamChunks``) writes byte for byte what the pydantic response
models write, for every kind of choice a stream sends (random texts, finish and stop reasons, token ids,
usage)."""

from __future__ import annotations

import random

import pytest

from vmkv.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from vmkv.server.serving import StreamChunks, sse

_TEXTS = ["", " hello", "a\"quote\\ and \n newline", "caf\u00e9 \u4e2d\u6587 \U0001f600", "\t\x01\x1f", "</s>"]


@pytest.mark.parametrize("seed", range(20))
def test_fast_chunks_equal_the_pydantic_models(seed):
    rng = random.Random(seed)
    request_id = rng.choice(["cmpl-abc", "chatcmpl-\u00e9\"x", "r"])
    created, model = rng.randint(0, 2 ** 31), rng.choice(["tiny-llama", "m\"odel\u00e9"])
    for _ in range(20):
        index = rng.randint(0, 300)
        text = rng.choice(_TEXTS)
        reason = rng.choice([None, "stop", "length", "abort"])
        stop_reason = rng.choice([None, "STOP", 7, "\u00e9\n"])
        ids = rng.choice([None, [], [rng.randint(0, 10 ** 6) for _ in range(rng.randint(1, 4))]])
        usage = rng.choice([None, UsageInfo(prompt_tokens=3, completion_tokens=5, total_tokens=8),
                            UsageInfo(prompt_tokens=1, completion_tokens=0, total_tokens=1,
                                      prompt_tokens_details={"cached_tokens": 0})])
        want = sse(CompletionStreamResponse(id=request_id, created=created, model=model, usage=usage, choices=[
            CompletionStreamChoice(index=index, text=text, finish_reason=reason, stop_reason=stop_reason,
                                   token_ids=ids)]))
        assert StreamChunks(request_id, created, model, chat=False).event(
            index, text, reason, stop_reason, ids, usage) == want
        want = sse(ChatCompletionChunk(id=request_id, created=created, model=model, usage=usage, choices=[
            ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text), finish_reason=reason,
                                       stop_reason=stop_reason)]))
        assert StreamChunks(request_id, created, model, chat=True).event(
            index, text, reason, stop_reason, None, usage) == want
