"""A stand-in rollout server process for fleet tests: ``/health``, ``/server_info`` and a ``/generate`` that
answers two tokens at once, its ``weight_version`` being its own port (so a test sees which
server, and which restart of it, answered). ``python -m tests.trainer.stub_rollout_server
--host H --port P``, as the fleet's ``EmbeddedServers`` starts a server."""

from __future__ import annotations

import argparse

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def generate(_: web.Request) -> web.Response:
        return web.json_response({"output_ids": [4, 5], "meta_info": {
            "id": "a", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
            "cached_tokens": 0, "weight_version": str(args.port),
            "output_token_logprobs": [[-1.0, 4, None], [-2.0, 5, None]]}})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.21", "tp_size": 1, "skip_tokenizer_init": False})

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    print(f"Running on http://{args.host}:{args.port}", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
