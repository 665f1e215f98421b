"""The naive baseline: the checkpoint in `transformers`, `model.generate` per request under one lock.

No batching, no scheduler, no KV-cache management of our own: what you get from a few lines of FastAPI
around Hugging Face. It speaks just enough of the OpenAI chat API for the load generator (and the
`openai` client): POST /v1/chat/completions, streaming (TextIteratorStreamer, SSE, usage chunk) or not,
`max_tokens`, `temperature` (0 = greedy), `top_p`, `seed`, `min_tokens`, `ignore_eos`; GET /v1/models,
GET /health/ready.

    python -m benchmarks.naive_server --checkpoint build/checkpoints/demo-small --port 9100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer


def create_app(checkpoint: Path, model_name: str | None = None, threads: int = 0) -> FastAPI:
    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    served = model_name or checkpoint.name
    lock = asyncio.Lock()  # one generate at a time: the point of the baseline
    app = FastAPI(title="naive baseline")

    def generate_kwargs(body: dict[str, Any], prompt_len: int) -> dict[str, Any]:
        max_tokens = int(body.get("max_tokens") or 256)
        min_tokens = min(int(body.get("min_tokens") or 0), max_tokens)
        if body.get("ignore_eos"):
            min_tokens = max_tokens
        temperature = float(body.get("temperature", 1.0))
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "min_new_tokens": min_tokens,
                                  "pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p", 1.0)), top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kwargs

    def encode(body: dict[str, Any]) -> torch.Tensor:
        ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long)

    def run_generate(input_ids: torch.Tensor, kwargs: dict[str, Any], body: dict[str, Any]) -> torch.Tensor:
        if body.get("seed") is not None:
            torch.manual_seed(int(body["seed"]))
        with torch.inference_mode():
            return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)

    @app.get("/health/ready")
    @app.get("/health/live")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served, "object": "model", "owned_by": "naive"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        input_ids = encode(body)
        prompt_len = input_ids.shape[1]
        kwargs = generate_kwargs(body, prompt_len)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def usage(n: int) -> dict[str, int]:
            return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}

        def finish_reason(n: int) -> str:
            return "length" if n >= kwargs["max_new_tokens"] else "stop"

        if not body.get("stream"):
            async with lock:
                out = await asyncio.to_thread(run_generate, input_ids, kwargs, body)
            new = out[0, prompt_len:].tolist()
            text = tokenizer.decode(new, skip_special_tokens=True)
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": served,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": finish_reason(len(new))}],
                                 "usage": usage(len(new))})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                          "model": served, "choices": [{"index": 0, "delta": delta,
                                                                         "finish_reason": finish}]}) + "\n\n"

        async def events():
            async with lock:
                streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
                result: dict[str, Any] = {}

                def work() -> None:
                    try:
                        result["out"] = run_generate(input_ids, {**kwargs, "streamer": streamer}, body)
                    except Exception as exc:  # surfaced as an error event below
                        result["error"] = exc
                        streamer.end()

                thread = threading.Thread(target=work, daemon=True)
                thread.start()
                yield chunk({"role": "assistant", "content": ""})
                iterator = iter(streamer)
                while True:
                    text = await asyncio.to_thread(next, iterator, None)
                    if text is None:
                        break
                    if text:
                        yield chunk({"content": text})
                await asyncio.to_thread(thread.join)
            if "error" in result:
                yield "data: " + json.dumps({"error": {"message": str(result["error"]), "type": "server_error",
                                                       "param": None, "code": None}}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            n = int(result["out"].shape[1] - prompt_len)
            yield chunk({}, finish_reason(n))
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                             "model": served, "choices": [], "usage": usage(n)}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Naive baseline: transformers generate() behind a lock.")
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--model-name", help="model id to serve (default: the checkpoint dir's name)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    app = create_app(args.checkpoint, args.model_name, args.threads)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
