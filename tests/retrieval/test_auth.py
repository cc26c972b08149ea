"""--api-key on the embedded servers (common/serving.py): every method on every path needs the
key except GET/HEAD of the health probes, and an empty key is refused instead of meaning "no
authentication"."""

from __future__ import annotations

import importlib

import pytest
from aiohttp import web

from sorl_megatron.common.background import BackgroundServer
from sorl_megatron.common.serving import api_key_middleware, api_key_middlewares, check_api_key
from sorl_megatron.retrieval import BM25Index, Passage
from sorl_megatron.retrieval.server import RetrievalServerConfig, build_app, parse_args
from tests.http_calls import call

KEY = "sweep-key-7"
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
# paths no route serves, and near misses of the open ones
STRAY_PATHS = ("/nope", "/healthz", "/health/", "/health/../retrieve", "/Health")


def _serve(app: web.Application) -> BackgroundServer:
    return BackgroundServer(app, "127.0.0.1", 0).start()


def _paths(app: web.Application) -> list[str]:
    return sorted({r.resource.canonical for r in app.router.routes()} | set(STRAY_PATHS))


def _sweep(url: str, paths, headers=None) -> dict[tuple[str, str], int]:
    return {(m, p): call(url, m, p, b"{}", headers, timeout=30)[0] for p in paths for m in METHODS}


def _open(method: str, path: str, open_paths) -> bool:
    return method in ("GET", "HEAD") and path in open_paths


def _check_sweep(url: str, paths, open_paths) -> None:
    without = _sweep(url, paths)
    wrong = _sweep(url, paths, {"Authorization": f"Bearer {KEY}x"})
    for (method, path), status in without.items():
        if _open(method, path, open_paths):
            assert status != 401, (method, path, status)
        else:
            assert status == 401, (method, path, status)  # OPTIONS answered 200 without the key before
            assert wrong[method, path] == 401, (method, path, wrong[method, path])


def test_the_middleware_on_a_small_app():
    async def ok(_):
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[api_key_middleware(KEY)])
    app.router.add_get("/health", ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_post("/generate", ok)
    app.router.add_route("*", "/flush_cache", ok)  # any method, as the rollout server's
    srv = _serve(app)
    try:
        _check_sweep(srv.url, _paths(app), ("/health", "/health_generate"))
        with_key = _sweep(srv.url, _paths(app), {"Authorization": f"Bearer {KEY}"})
        assert with_key["OPTIONS", "/flush_cache"] == 200 and with_key["POST", "/generate"] == 200
        assert with_key["GET", "/nope"] == 404  # a stranger without the key does not learn the routes (401)
    finally:
        srv.stop()


@pytest.mark.parametrize("key", ["", "a\nb", "\udcff"])
def test_unusable_keys_are_refused(key):
    for make in (check_api_key, api_key_middleware, api_key_middlewares):
        with pytest.raises(ValueError, match="--api-key must be a non-empty printable string"):
            make(key)
    with pytest.raises(ValueError, match="--api-key"):
        RetrievalServerConfig(api_key=key)
    assert api_key_middlewares(None) == []


def test_retrieval_cli_refuses_an_empty_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SORL_RETRIEVAL_API_KEY", raising=False)
    with pytest.raises(SystemExit) as info:
        parse_args(["--corpus", str(tmp_path / "c.jsonl"), "--api-key", ""])
    assert info.value.code == 2
    assert "error: --api-key must be a non-empty printable string" in capsys.readouterr().err


def test_every_route_of_the_retrieval_server_with_every_method():
    index = BM25Index([Passage("0", '"Paris"\nParis is the capital of France.')])
    app = build_app(index, RetrievalServerConfig(port=0, api_key=KEY))
    srv = _serve(app)
    try:
        paths = _paths(app)
        assert "/retrieve" in paths and "/health" in paths
        _check_sweep(srv.url, paths, ("/health",))
        auth = {"Authorization": f"Bearer {KEY}"}
        assert call(srv.url, "POST", "/retrieve", {"queries": ["Paris"]}, auth)[0] == 200
        assert call(srv.url, "GET", "/health_generate")[0] == 401  # not open on this server
    finally:
        srv.stop()


ROLLOUT_APP_MODULES = (
    "sorl_megatron.rollout.server", "sorl_megatron.sglang_cpu.app", "sorl_megatron.sglang_cpu.server",
)


def _rollout_server_module(candidates=ROLLOUT_APP_MODULES):
    # The rollout server's app is moving from rollout/server.py to the sglang_cpu package: the
    # first module that has both build_app and ServerOptions.
    for name in candidates:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(mod, "build_app") and hasattr(mod, "ServerOptions"):
            return mod
    pytest.fail(f"no rollout server app in {candidates}")


class _NoEngine:
    """Stands in for the engine: build_app may take its methods, a handler that calls one fails."""

    def __getattr__(self, name):
        def called(*args, **kwargs):
            raise AssertionError(f"engine.{name} called by a request without the key")

        return called


def test_every_route_of_the_rollout_server_needs_the_key():
    """The real app over a stub engine: without the key no handler runs, so none touches it."""
    mod = _rollout_server_module()
    app = mod.build_app(_NoEngine(), mod.ServerOptions(api_key=KEY))
    paths = [p for p in _paths(app) if p not in ("/health", "/health_generate")]  # they read the engine
    assert "/update_weights_from_tensor" in paths and "/flush_cache" in paths
    srv = _serve(app)
    try:
        _check_sweep(srv.url, paths, ())
    finally:
        srv.stop()
