"""The offline API in vLLM's shape::

    from vmkv import LLM, SamplingParams
    llm = LLM(kv_backend="vmem")                      # default model: SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(outs[0].outputs[0].text)
    llm.chat([{"role": "user", "content": "What is the capital of France?"}])
"""

from __future__ import annotations

import dataclasses

import itertools
from typing import Any, Union

from vmkv.engine.input_processor import check_cache_salt
from vmkv.engine.llm_engine import LLMEngine
from vmkv.engine.outputs import CompletionOutput, RequestOutput
from vmkv.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

PromptType = Union[str, dict]


class LLM:
    """An engine plus a loop that runs it until every request finishes.

    Args:
        model: HF model directory or ``.gguf`` file; ``None``: the default model.
        kv_backend: ``"paged"`` or ``"vmem"`` (``backend=`` is accepted too).
        device: ``"cpu"``/``"cuda"``; ``None``: CUDA when available.
        dtype: ``"float32"``/``"float16"``/``"bfloat16"``; ``None``: bf16 on CUDA, fp32 on CPU.
        **knobs: fields of CacheConfig / SchedulerConfig / EngineConfig (``memory_bytes``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``block_size``,
            ``page_size_bytes``, ``layout``, ``driver``, ``enable_prefix_caching``, ``seed``,
            ``random_weights``, ...).
    """

    def __init__(self, model: str | None = None, kv_backend: str = "paged", device: str | None = None,
                 dtype: str | None = None, **knobs: Any) -> None:
        if "backend" in knobs:  # the name `vmkv generate/serve --backend` and create_kv_cache use
            backend = knobs.pop("backend")
            if kv_backend not in ("paged", backend):
                raise TypeError(f"give the KV backend once: kv_backend={kv_backend!r} and backend={backend!r}")
            kv_backend = backend
        self.engine = LLMEngine.from_args(model, kv_backend, device, dtype, **knobs)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, *,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate completions for one or more prompts, returned in prompt order.

        A request that failed while running (an exception in its processing, or in the forward of
        a batch it was part of) comes back finished with ``error`` set and ``finish_reason="error"``;
        the other prompts are unaffected.

        Args:
            prompts: a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` (optionally
                with ``"prompt"``), or a list of them (vLLM's TextPrompt / TokensPrompt).  A dict
                may carry ``"cache_salt": str``: prefix-cache isolation, see
                :meth:`LLMEngine.add_request`.
            params: one :class:`SamplingParams` for all, a list with one per prompt, or ``None``
                for the defaults.
            use_tqdm: show a progress bar of finished requests.
            sampling_params: vLLM's name for ``params`` (either may be given).
        Raises:
            ValueError: a malformed prompt, or a params list of the wrong length; no prompt of the
                call is run then.
            PromptTooLongError: a prompt does not fit ``max_model_len`` (nothing is run either).
            TypeError: both ``params`` and ``sampling_params`` given; ``prompts`` not a str, dict
                or list; ``params`` not a SamplingParams, a list of them or None.
        """
        if params is not None and sampling_params is not None:
            raise TypeError("give the sampling parameters once: params or sampling_params, not both")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a prompt dict or a list of them, got "
                            f"{type(prompts).__name__}: {prompts!r}"[:300])
        prompts = list(prompts)
        params_list = self._params_list(params if params is not None else sampling_params, len(prompts))
        # only final outputs are returned: no per-step output objects (vLLM's LLM does the same)
        params_list = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        parsed = [self._parse_prompt(prompt) for prompt in prompts]
        request_ids: list[str] = []
        try:
            for (text, token_ids, salt), p in zip(parsed, params_list):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, text, p, prompt_token_ids=token_ids, cache_salt=salt)
                request_ids.append(rid)
        except BaseException:
            for rid in request_ids:  # a bad prompt rejects the whole call: nothing stays queued
                self.engine.abort_request(rid)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *,
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or a list of conversations.

        Each conversation is a list of ``{"role": "system"|"user"|"assistant", "content": str}``
        rendered with the tokenizer's chat template (ending in the generation prompt).
        Raises:
            ValueError: empty or malformed messages, or no chat template.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of message dicts or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(c)} for c in conversations]
        return self.generate(prompts, params if params is not None else sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _params_list(params, num: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(num)]
        if isinstance(params, SamplingParams):
            return [params] * num
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"params (sampling_params) must be a SamplingParams, a list of them or None, got "
                            f"{type(params).__name__}: {params!r}"[:300] + "; e.g. SamplingParams(max_tokens=1)")
        params = list(params)
        if len(params) != num:
            raise ValueError(f"got {len(params)} SamplingParams for {num} prompts; give one or one per prompt")
        return params

    @staticmethod
    def _parse_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None, str | None]:
        """``(text, token_ids, cache_salt)`` of one prompt."""
        if isinstance(prompt, str):
            return prompt, None, None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            check_cache_salt(salt)
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt
            if "prompt" in prompt:
                return prompt["prompt"], None, salt
        raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids' or 'prompt', got {prompt!r}")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        bar = _progress(len(request_ids)) if use_tqdm else None
        try:
            while pending and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in pending:                  # interrupted: do not leave requests holding KV
                self.engine.abort_request(rid)
        return [final[r] for r in request_ids if r in final]


def _progress(total: int):
    try:
        from tqdm.auto import tqdm  # noqa: PLC0415
    except ImportError:  # pragma: no cover - tqdm ships with transformers' dependencies
        return None
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, leave=False)
