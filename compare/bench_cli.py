"""``vmkv bench serve``: a load client for any OpenAI-compatible server (ours, vLLM, SGLang, ...).

Sends a seeded workload (:mod:`vmkv.compare.workloads`) as streaming ``/v1/completions`` (or
``/v1/chat/completions``) requests at Poisson/gamma arrival times (``--request-rate``, ``inf`` = all
at once), optionally capped at ``--max-concurrency`` in flight, and measures from the client side, as
vLLM's ``benchmark_serving.py`` does: TTFT (send to first content chunk), ITL (gaps between content
chunks), TPOT ``(e2e - ttft) / (output_tokens - 1)``, E2E, request/output/total token throughput and
goodput under ``--slo``.  Output tokens come from the server's ``usage`` (``stream_options.include_usage``)
when it reports it, else from the number of content chunks.

Prompts: ``--prompt-format tokens`` sends random token ids (exact lengths; the requests of
:func:`vmkv.compare.workloads.generate`, the ones ``vmkv compare engine`` runs; the vocabulary size is
``--vocab-size``, or the ``vocab_size`` field of the model's card in ``GET /v1/models``, which vmkv's
server gives and other servers may not);
``text`` sends random common English words, about one token each (the server's ``usage`` gives the
real count).  ``ignore_eos`` (a vLLM extension our server supports) keeps output lengths exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
from pathlib import Path


from vmkv.compare import report
from vmkv.compare.metrics import SLO, RequestRecord, compute_serving_metrics
from vmkv.compare.workloads import TRACE_KINDS, Request, WorkloadSpec, generate, lengths_and_arrivals, trace_note

logger = logging.getLogger(__name__)

__all__ = ["add_arguments", "run", "build_requests", "for_sending", "make_client", "add_http_client_arg", "run_benchmark", "send_one", "model_cards",
           "vocab_size_of"]

# frequent English words, each one BPE token with a leading space in common tokenizers
_WORDS = ("the of and to in is was for on that with as by it at from his an be this are or not had but "
          "which have one you were her all their there been has when who more will if no out so said what "
          "up its about into than them can only other new some could time these two may then do first any "
          "my now such like our over man me even most made after also did many before must through back "
          "years where much your way well down should because each just those people how too little state "
          "good very make world still own see men work long get here between both life being under never "
          "day same another know while last might us great old year off come since against go came right").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{serve}")
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", required=False, default=None, help="model name sent in requests (default: "
                   "the first of GET /v1/models)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--workload", "--trace", default="random", choices=("random",) + TRACE_KINDS,
                   help="random: --input-len/--output-len and Poisson/gamma arrivals; azure-conv, azure-code: "
                        "the Azure LLM inference trace 2023, its first --num-prompts rows (lengths and "
                        "timestamps; capped to --max-model-len), as vmkv compare engine --workload replays it")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="a trace workload: rows capped to prompt + output <= this (default: the max_model_len "
                        "of the model's card in GET /v1/models, which vmkv serve gives; none if absent)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (inf = all at once); a trace: "
                   "its timestamps time-scaled so the rows' mean rate is this")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--input-len", default="256", help="N, A..B, lognormal:MEDIAN,SIGMA[,MIN,MAX], sharegpt-in")
    p.add_argument("--output-len", default="128", help="same forms (max_tokens; exact with ignore_eos)")
    p.add_argument("--prompt-format", default="text", choices=["text", "tokens"])
    p.add_argument("--vocab-size", type=int, default=None,
                   help="for --prompt-format tokens (default: the vocab_size of the model's card in "
                        "GET /v1/models, which vmkv serve gives)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    add_http_client_arg(p)
    p.add_argument("--slo", default=None, help="goodput SLO in ms, e.g. ttft:500,tpot:50")
    p.add_argument("--out", default=None, help="directory for bench.json and bench.md")


def add_http_client_arg(p) -> None:
    """``--http-client raw|httpx`` (``vmkv bench serve`` and ``vmkv compare serve``)."""
    p.add_argument("--http-client", default="raw", choices=["raw", "httpx"],
                   help="raw: HTTP/1.1 on asyncio streams, about half of httpx's CPU per streamed chunk "
                        "(vmkv.compare.sse_client); httpx: httpx.AsyncClient (default: %(default)s)")


def build_requests(args) -> list[Request]:
    """Seeded requests; ``meta["prompt"]`` holds the text or the token ids to send.

    ``--prompt-format tokens``: the requests of :func:`vmkv.compare.workloads.generate` (the same as
    ``vmkv compare engine`` runs for the same flags and vocabulary), through :func:`for_sending`.
    Raises:
        ValueError: ``--prompt-format tokens`` without a vocabulary size of at least 2.
    """
    spec = bench_spec(args)
    if args.prompt_format == "tokens":
        if not args.vocab_size or args.vocab_size < 2:
            raise ValueError("--prompt-format tokens needs --vocab-size (the model's vocabulary size)")
        reqs = for_sending(generate(spec, args.vocab_size))
        for r in reqs:
            r.request_id = r.request_id.replace("req-", "bench-", 1)
        return reqs
    in_lens, out_lens, arrivals, rngs = lengths_and_arrivals(spec)
    reqs = []
    for i in range(spec.num_requests):
        n = int(in_lens[i])
        prompt = " ".join(_WORDS[j] for j in rngs[3].integers(0, len(_WORDS), n))
        reqs.append(Request(f"bench-{i}", [], int(out_lens[i]), float(arrivals[i]), meta={"prompt": prompt,
                                                                                         "prompt_len": n}))
    return reqs


def bench_spec(args) -> WorkloadSpec:
    """The :class:`WorkloadSpec` of the command line (``--workload``, ``--num-prompts``, lengths, rate,
    seed; a trace capped at ``--max-model-len``)."""
    kind = getattr(args, "workload", "random")
    cap = getattr(args, "max_model_len", None) or 0
    return WorkloadSpec(kind=kind, num_requests=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, request_rate=args.request_rate, burstiness=args.burstiness,
                        seed=args.seed, max_model_len=cap if kind in TRACE_KINDS else 0)


def for_sending(requests: list[Request]) -> list[Request]:
    """``requests`` (token-id prompts, e.g. :func:`vmkv.compare.workloads.generate`'s) with the ``meta``
    :func:`run_benchmark` sends: ``prompt`` = the token ids, ``prompt_len``.  Changes them in place.

    Raises:
        ValueError: a request asks for ``n > 1`` samples (one stream per request is timed).
    """
    for r in requests:
        if r.n != 1:
            raise ValueError(f"request {r.request_id} asks for n={r.n}; the load client times one completion "
                             "per request (use a workload with n = 1)")
        r.meta.update(prompt=r.prompt_token_ids, prompt_len=r.prompt_len)
    return requests


def _payload(req: Request, args, model: str) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint.endswith("chat/completions"):
        if not isinstance(req.meta["prompt"], str):
            raise ValueError("/v1/chat/completions needs --prompt-format text")
        body["messages"] = [{"role": "user", "content": req.meta["prompt"]}]
    else:
        body["prompt"] = req.meta["prompt"]
        if not isinstance(req.meta["prompt"], str):
            # token-id prompts: ask for token ids back (vLLM's return_token_ids), so a model without a
            # tokenizer, whose text is empty, still streams one timed chunk per token
            body["return_token_ids"] = True
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


def _chunk_has_tokens(chunk: dict) -> bool:
    """A chunk that carries generated tokens: text, or (``return_token_ids``) token ids, which a model
    without a tokenizer streams with empty text."""
    choices = chunk.get("choices") or []
    return bool(_chunk_text(chunk)) or bool(choices and choices[0].get("token_ids"))


async def send_one(client, url: str, body: dict, req: Request, headers: dict) -> RequestRecord:
    """POST one streaming request and time its chunks (``time.perf_counter`` seconds)."""
    times: list[float] = []
    usage = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if _chunk_has_tokens(chunk):
                    times.append(time.perf_counter())
    except Exception as exc:  # any failure is recorded, the run goes on
        return RequestRecord(req.request_id, req.meta["prompt_len"], 0, start, None, None, success=False,
                             error=f"{type(exc).__name__}: {exc}")
    if not times:
        return RequestRecord(req.request_id, req.meta["prompt_len"], 0, start, None, None, success=False,
                             error="no content chunk received")
    out_tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") else len(times)
    prompt_len = int(usage["prompt_tokens"]) if usage and usage.get("prompt_tokens") else req.meta["prompt_len"]
    return RequestRecord(req.request_id, prompt_len, out_tokens, start, times[0], times[-1], times)


def make_client(args, num_requests: int, transport=None):
    """The client :func:`run_benchmark` sends through: ``--http-client raw`` (the default; ``transport``
    unset), :class:`vmkv.compare.sse_client.RawHTTPClient`, one connection per request, at most
    ``--timeout-s`` each; ``httpx``, an ``httpx.AsyncClient`` (``--timeout-s`` per read, a connection per
    request in flight: ``--max-concurrency`` or every request), always with a ``transport``."""
    if transport is None and getattr(args, "http_client", "raw") == "raw":
        from vmkv.compare.sse_client import RawHTTPClient

        return RawHTTPClient(args.timeout_s)
    import httpx

    limits = httpx.Limits(max_connections=args.max_concurrency or num_requests or 1)
    return httpx.AsyncClient(timeout=args.timeout_s, limits=limits, transport=transport)


async def run_benchmark(requests: list[Request], args, model: str, transport=None, on_done=None,
                        start_at: float | None = None, client=None) -> tuple[list, float]:
    """Send ``requests`` at their arrival offsets; returns ``(records, duration_s)``.

    ``start_at``: the ``time.perf_counter()`` instant the offsets count from (default: when the client is
    ready); on Linux it is ``CLOCK_MONOTONIC``, shared by the host's processes, so several client
    processes can split one workload.  The duration runs from it to the last finish.  ``client``: an open
    :func:`make_client` client to send through (default: one made and closed here).  Request bodies are
    built before the start, so the timed loop only sends and reads."""
    if client is None:
        async with make_client(args, len(requests), transport) as own:
            return await run_benchmark(requests, args, model, on_done=on_done, start_at=start_at, client=own)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + args.endpoint
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bodies = [_payload(req, args, model) for req in requests]
    start = time.perf_counter() if start_at is None else start_at

    async def launch(req: Request, body: dict) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
        if sem is None:
            rec = await send_one(client, url, body, req, headers)
        else:
            async with sem:
                rec = await send_one(client, url, body, req, headers)
        if on_done:
            on_done(rec)
        return rec

    records = await asyncio.gather(*(launch(r, b) for r, b in zip(requests, bodies)))
    ends = [r.finish_time for r in records if r.finish_time is not None]
    return list(records), max(max(ends, default=start) - start, 1e-9)


async def model_cards(base_url: str, api_key: str | None, transport=None) -> list[dict]:
    """The model cards of ``GET /v1/models`` (``data``).

    Raises:
        RuntimeError: the server lists no model.
        httpx.HTTPError: the server cannot be reached or answers an error.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30, transport=transport) as client:
        resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        if not data:
            raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
        return data


def vocab_size_of(cards: list[dict], model: str) -> int | None:
    """The ``vocab_size`` integer of ``model``'s card (vmkv's servers add it to the OpenAI fields), or
    None when the card has none (another server) or no card is named ``model``."""
    card = next((c for c in cards if c.get("id") == model), None)
    value = (card or {}).get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 2 else None


COLUMNS = ["metric", "mean", "p50", "p90", "p99"]


def _rows(m: dict) -> list[list[str]]:
    f = report.fmt_num
    return [[name, f(m[key]["mean"]), f(m[key]["p50"]), f(m[key]["p90"]), f(m[key]["p99"])]
            for name, key in (("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("ITL (ms)", "itl_ms"),
                              ("E2E (ms)", "e2e_ms"))]


def run(args, transport=None) -> int:
    console = report.console()
    if getattr(args, "bench_command", None) != "serve":
        console.print("usage: vmkv bench serve --base-url URL [--model NAME] ... (see vmkv bench serve --help)")
        return 2
    try:
        cards = None
        trace = getattr(args, "workload", "random") in TRACE_KINDS
        if args.model is None or (args.prompt_format == "tokens" and args.vocab_size is None) \
                or (trace and args.max_model_len is None):
            cards = asyncio.run(model_cards(args.base_url, args.api_key, transport))
        model = args.model or cards[0]["id"]
        if trace and args.max_model_len is None:
            card = next((c for c in cards if c.get("id") == model), None) or {}
            value = card.get("max_model_len")
            if isinstance(value, int) and value >= 2:
                args = argparse.Namespace(**{**vars(args), "max_model_len": value})
                console.print(f"max_model_len {value} (from {args.base_url}/v1/models)")
        if args.prompt_format == "tokens" and args.vocab_size is None:
            vocab = vocab_size_of(cards, model)
            if vocab is None:
                raise ValueError("--prompt-format tokens needs --vocab-size (the model's vocabulary size); "
                                 f"{args.base_url}/v1/models gives none for {model!r}")
            args = argparse.Namespace(**{**vars(args), "vocab_size": vocab})
            console.print(f"vocabulary size {vocab} (from {args.base_url}/v1/models)")
        requests = build_requests(args)
        if trace:
            console.print(trace_note(bench_spec(args)))
        if requests:
            _payload(requests[0], args, model)  # validates endpoint vs prompt format
    except (ValueError, RuntimeError, OSError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    except Exception as exc:  # connection errors of httpx
        console.print(f"[red]error:[/red] cannot reach {args.base_url}: {type(exc).__name__}: {exc}")
        return 2
    with report.progress(console) as prog:
        task = prog.add_task(f"{args.endpoint} @ {args.request_rate:g} req/s", total=len(requests))
        records, duration = asyncio.run(run_benchmark(requests, args, model, transport,
                                                      on_done=lambda _r: prog.advance(task)))
    m = compute_serving_metrics(records, duration, SLO.parse(args.slo))
    title = (f"{model} at {args.base_url}{args.endpoint}: {m['completed']} ok / {m['failed']} failed in "
             f"{duration:.2f} s; {m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} output tok/s, "
             f"{m['total_token_throughput']:.1f} total tok/s"
             + ("" if m["goodput"] is None else f", goodput {m['goodput']:.2f} req/s"))
    console.print(title)
    console.print(report.make_table("client-side latencies", COLUMNS, _rows(m)))
    errors = [r.error for r in records if not r.success]
    if errors:
        console.print(f"[yellow]first error:[/yellow] {errors[0]}")
    if args.out:
        out = Path(args.out)
        env = report.environment(seed=args.seed)
        t0 = min((r.arrival_time for r in records), default=0.0)
        raw = [{**r.to_dict(), "arrival_time": r.arrival_time - t0,
                "first_token_time": None if r.first_token_time is None else r.first_token_time - t0,
                "finish_time": None if r.finish_time is None else r.finish_time - t0,
                "token_times": [round(t - t0, 6) for t in r.token_times]} for r in records]
        report.write_json(out / "bench.json", {"kind": "bench-serve", "environment": env, "args": vars(args),
                                               "model": model, "metrics": m, "raw": raw})
        md = ["# vmkv bench serve", "", f"Command: `{env['command']}`", "", title, "",
              report.markdown_table(COLUMNS, _rows(m)), ""]
        (out / "bench.md").write_text("\n".join(md))
        console.print(f"wrote {out}/bench.json, bench.md")
    return 0 if not errors else 1
