"""The weight-sync package without a model: the bucketing loop, the factory, and the tensor and
disk transports against a server that records what it is sent (the servers' side of each
transport is tests/rollout/test_weight_updates.py and test_weight_sync_distributed.py; every
rank's export is tests/engine/test_weight_sync.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from aiohttp import web

from sorl_megatron.common.background import BackgroundServer
from sorl_megatron.common.buckets import buckets
from sorl_megatron.common.fp8 import quantize_hf_tensor
from sorl_megatron.rollout.server_facts import SESSIONS_SINCE, parse_version
from sorl_megatron.weight_sync import disk, tensor
from sorl_megatron.weight_sync.base import SyncTargets
from sorl_megatron.weight_sync.distributed import DistributedWeightSync
from sorl_megatron.weight_sync.factory import TRANSPORTS, make_weight_sync
from sorl_megatron.weight_sync.wire import deserialize_named_tensors


def settings(transport: str = "tensor", flush_idle_timeout_s: float = 2.0, **kw) -> SimpleNamespace:
    """The rollout settings a transport reads (duck-typed like the recipe's rollout section)."""
    sync = SimpleNamespace(transport=transport, timeout_s=30.0, init_timeout_s=20.0, bucket_mb=1, master_address=None)
    base = dict(weight_sync=sync, precision="fp32", urls=[], retries=0, health_timeout_s=5.0,
                async_=SimpleNamespace(flush_idle_timeout_s=flush_idle_timeout_s))
    return SimpleNamespace(**{**base, **kw})


class Recorder:
    """A rollout server that answers every weight-sync call with success and records it; its
    ``/server_info`` is ``info`` (SGLang ``version``: 0.5.21 has weight-update sessions, older
    releases answer 404 for them); ``busy``: ``/flush_cache`` answers 400, as SGLang's while
    requests run, and records the query."""

    def __init__(self, **info):
        self.calls: list[tuple[str, dict | None]] = []
        self.info = {"version": "0.5.21", "tp_size": 1, "skip_tokenizer_init": False, "quantization": None, **info}
        self.busy = False
        app = web.Application(client_max_size=64 * 1024**2)
        paths = ["/update_weights_from_tensor", "/update_weights_from_disk", "/update_weight_version"]
        if (parse_version(self.info["version"]) or (0,)) >= SESSIONS_SINCE:
            paths += ["/begin_weight_update", "/end_weight_update"]
        for path in paths:
            app.router.add_post(path, self.record)
        app.router.add_post("/flush_cache", self.flush)
        app.router.add_get("/server_info", self.server_info)
        self.server = BackgroundServer(app, "127.0.0.1", 0).start()

    async def record(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.calls.append((request.path, json.loads(raw) if raw else None))
        return web.json_response({"success": True, "message": ""})

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response(self.info)

    async def flush(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, dict(request.query)))
        if self.busy:
            return web.Response(status=400, text="Timed out waiting for idle state.")
        return web.Response(text="Cache flushed.")

    @property
    def url(self) -> str:
        return self.server.url

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]


@pytest.fixture
def recorders():
    rs = [Recorder() for _ in range(2)]
    yield rs
    for r in rs:
        r.server.stop()


def test_buckets_keep_fp8_pairs_bound_size_and_mark_the_last():
    w = torch.ones(256, 256)
    named = [*quantize_hf_tensor("model.layers.0.self_attn.q_proj.weight", w), ("model.norm.weight", torch.ones(8))]
    out = list(buckets(named, bucket_bytes=256 * 256))  # the fp8 weight alone fills a bucket; its scale joins it
    assert [([n for n, _ in b], last) for b, last in out] == [
        (["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv"], False),
        (["model.norm.weight"], True),
    ]
    many = [(f"t{i}", torch.ones(10)) for i in range(7)]
    assert [(len(b), last) for b, last in buckets(many, bucket_bytes=120)] == [(3, False), (3, False), (1, True)]
    assert list(buckets([], 1)) == []
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        next(buckets(many, 0))


def test_a_bucket_is_yielded_before_the_tensor_after_the_next_is_taken():
    """An export's gathers run between the sends: a full bucket goes as soon as the tensor that
    does not fit has arrived, before the export is asked for one more."""
    taken: list[int] = []

    def export():
        for i in range(4):
            taken.append(i)
            yield f"t{i}", torch.ones(10)

    it = buckets(export(), bucket_bytes=40)  # one tensor per bucket
    assert [n for n, _ in next(it)[0]] == ["t0"] and taken == [0, 1]
    assert [n for n, _ in next(it)[0]] == ["t1"] and taken == [0, 1, 2]


def test_the_factory_is_the_one_reader_of_the_transport_name(tmp_path):
    assert sorted(TRANSPORTS) == ["disk", "distributed", "tensor"]
    assert isinstance(make_weight_sync(settings("distributed"), tmp_path), DistributedWeightSync)
    assert isinstance(make_weight_sync(settings("tensor"), tmp_path), tensor.TensorWeightSync)
    assert isinstance(make_weight_sync(settings("disk"), tmp_path), disk.DiskWeightSync)
    with pytest.raises(ValueError, match=r"rollout.weight_sync.transport: 'nccl' is not one of"):
        make_weight_sync(settings("nccl"), tmp_path)


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.weight": torch.randn(64, 64, generator=g) for i in range(3)}


def test_tensor_sync_posts_each_bucket_and_follows_the_targets_of_each_call(recorders, tmp_path, monkeypatch):
    """Begin, one body per bucket (the version and the cache flush on the last only), end; each
    sync to the URLs of its own call (a restarted server comes back on a new one)."""
    monkeypatch.setattr(tensor, "iter_hf_weights", lambda model: iter(list(model.items())))
    wsync = make_weight_sync(settings(), tmp_path)
    wsync.bucket_bytes = 2 * 64 * 64 * 4  # two tensors a bucket
    first, second = state(1), state(2)
    stats = wsync.sync(first, SyncTargets((recorders[0].url,)), "step_1")
    assert stats.bytes_sent == 3 * 64 * 64 * 4
    wsync.sync(second, SyncTargets((recorders[1].url,)), "step_2")
    for rec, sent, version in ((recorders[0], first, "step_1"), (recorders[1], second, "step_2")):
        assert rec.paths() == ["/begin_weight_update", "/update_weights_from_tensor", "/update_weights_from_tensor",
                               "/end_weight_update"]
        bodies = [b for p, b in rec.calls if p == "/update_weights_from_tensor"]
        assert [(b["flush_cache"], b["weight_version"]) for b in bodies] == [(False, None), (True, version)]
        got = {}
        for b in bodies:
            assert b["load_format"] == "safetensors" and len(b["serialized_named_tensors"]) == 1
            got.update(deserialize_named_tensors(b["serialized_named_tensors"][0], "safetensors"))
        assert sorted(got) == sorted(sent) and all(torch.equal(got[k], v) for k, v in sent.items())


def test_tensor_sync_sends_fp8_pairs_to_external_fp8_servers(recorders, tmp_path, monkeypatch):
    monkeypatch.setattr(tensor, "iter_hf_weights", lambda model: iter(list(model.items())))
    sent = {"model.layers.0.mlp.up_proj.weight": torch.randn(256, 256), "model.norm.weight": torch.ones(8)}
    targets = SyncTargets((recorders[0].url,))
    make_weight_sync(settings(precision="fp8"), tmp_path).sync(sent, targets, "embedded")  # quantizes itself
    make_weight_sync(settings(precision="fp8", urls=[recorders[0].url]), tmp_path).sync(sent, targets, "external")
    bodies = [b for p, b in recorders[0].calls if p == "/update_weights_from_tensor"]
    embedded, external = (deserialize_named_tensors(b["serialized_named_tensors"][0], "safetensors") for b in bodies)
    assert {k: v.dtype for k, v in embedded.items()} == {k: torch.float32 for k in sent}
    expected = dict(pair for n, t in sent.items() for pair in quantize_hf_tensor(n, t))
    assert sorted(external) == sorted(expected) and all(torch.equal(external[k], v) for k, v in expected.items())
    assert external["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn


def test_disk_sync_writes_then_asks_each_server_to_reload(recorders, tmp_path, monkeypatch):
    written: list[tuple[object, str, bool]] = []
    monkeypatch.setattr(disk, "save_hf_checkpoint", lambda model, out, fp8: written.append((model, out, fp8)))
    monkeypatch.chdir(tmp_path)
    wsync = make_weight_sync(settings("disk"), Path("run"))  # relative: the servers get it absolute
    assert wsync.sync("model", SyncTargets(tuple(r.url for r in recorders)), "step_3").bytes_sent == 0
    out = str(tmp_path / "run" / "weights_sync")
    assert written == [("model", out, False)]
    for rec in recorders:  # the reload does not flush (SGLang's would fail while requests run): a bounded flush does
        assert rec.calls == [("/update_weights_from_disk",
                              {"model_path": out, "weight_version": "step_3", "flush_cache": False}),
                             ("/flush_cache", {})]


def test_a_failed_tensor_sync_closes_the_update_and_raises(recorders, tmp_path):
    async def go():
        from sorl_megatron.rollout.client import RolloutClient

        def broken():
            yield "a", torch.ones(4)
            yield "b", torch.ones(4)  # "a" goes now, alone in its bucket
            raise RuntimeError("the export failed")

        async with RolloutClient(recorders[0].url) as c:
            await tensor.send_tensors(c, broken(), "never", bucket_bytes=1)

    with pytest.raises(RuntimeError, match="the export failed"):
        asyncio.run(go())
    assert recorders[0].paths() == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    assert recorders[0].calls[1][1]["weight_version"] is None  # the version never came


def test_the_server_side_modules_pull_in_no_trainer_code():
    """The rollout server imports ``weight_sync.group`` and ``weight_sync.wire``: neither (nor
    the package's ``__init__``) may load megatron, the bridge's models or the transports."""
    code = ("import sys; import sorl_megatron.weight_sync.group, sorl_megatron.weight_sync.wire; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'mbridge') or m in ("
            "'sorl_megatron.bridge.model', 'sorl_megatron.rollout.client', 'sorl_megatron.weight_sync.base')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ----- what the servers are: version, flags, weight format (rollout.server_facts) -----


def run_client(url_or_urls, fn):
    from sorl_megatron.rollout.client import RolloutClient

    async def go():
        async with RolloutClient(url_or_urls) as c:
            return await fn(c)

    return asyncio.run(go())


def test_weight_update_sessions_only_where_the_servers_version_has_them(tmp_path, monkeypatch):
    """SGLang 0.5.21 takes updates between /begin_weight_update and /end_weight_update (and
    refuses them outside); 0.5.18 has neither endpoint (404): the sync reads the version first."""
    monkeypatch.setattr(tensor, "iter_hf_weights", lambda model: iter(list(model.items())))
    old, new = Recorder(version="0.5.18"), Recorder(version="0.5.21.post1")
    try:
        for rec in (old, new):
            make_weight_sync(settings(), tmp_path).sync(state(1), SyncTargets((rec.url,)), "step_1")
        assert old.paths() == ["/update_weights_from_tensor"]
        assert new.paths() == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    finally:
        old.server.stop()
        new.server.stop()


def test_a_server_this_trainer_cannot_use_is_refused_naming_it():
    from sorl_megatron.rollout.server_facts import ServerMismatchError

    cases = [({"version": "0.5.10"}, r"reports SGLang version '0\.5\.10'; this trainer needs SGLang >= 0\.5\.18"),
             ({"version": None}, r"version None"),
             ({"skip_tokenizer_init": True}, r"--skip-tokenizer-init: SGLang then refuses every request with stop")]
    for info, msg in cases:
        rec = Recorder(**info)
        try:
            with pytest.raises(ServerMismatchError, match=msg) as err:
                run_client(rec.url, lambda c: c.check_for_rollouts())
            assert rec.url in str(err.value)
        finally:
            rec.server.stop()
    old, new = Recorder(version="0.5.18"), Recorder()
    try:
        with pytest.raises(ServerMismatchError, match="both sides of 0.5.21"):
            run_client([old.url, new.url], lambda c: c.begin_weight_update())
    finally:
        old.server.stop()
        new.server.stop()


def checkpoint(root: Path, name: str, quantization_config: dict | None = None) -> str:
    d = root / name
    d.mkdir()
    cfg = {"model_type": "qwen3_moe"}
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_the_sync_sends_the_weight_format_the_server_stores(tmp_path):
    """Block-FP8 pairs only into a server started from an FP8-serialized checkpoint (SGLang's
    block quantization); a BF16 checkpoint with --quantization fp8 is quantized online, which a
    sync cannot write: refused with the command that makes the right checkpoint."""
    from sorl_megatron.common.fp8 import fp8_quantization_config
    from sorl_megatron.rollout.server_facts import ServerFacts, ServerMismatchError, served_weight_format

    bf16 = checkpoint(tmp_path, "bf16")
    fp8 = checkpoint(tmp_path, "fp8", fp8_quantization_config())
    odd = checkpoint(tmp_path, "odd", {**fp8_quantization_config(), "weight_block_size": [64, 64]})
    facts = lambda path, q=None: ServerFacts("http://s", "0.5.21", quantization=q, model_path=path)  # noqa: E731
    assert served_weight_format(facts(fp8, "fp8"), "fp8") == "block_fp8"
    assert served_weight_format(facts(fp8), "fp8") == "block_fp8"  # SGLang reads the method from config.json
    assert served_weight_format(facts(bf16), "bf16") == "bf16"
    assert served_weight_format(facts(str(tmp_path / "elsewhere")), "bf16") == "bf16"  # unreadable, unquantized
    refused = [(facts(bf16, "fp8"), "fp8", r"quantizes a BF16 checkpoint online .*tools/convert.py megatron-to-hf"),
               (facts(bf16), "fp8", r"rollout.precision is fp8 but .* serves the BF16 checkpoint"),
               (facts(fp8), "bf16", r"set rollout.precision: fp8"),
               (facts(odd), "fp8", r"weight_block_size \[64, 64\]"),
               (facts(str(tmp_path / "elsewhere"), "fp8"), "fp8", r"cannot be read from the trainer")]
    for f, precision, msg in refused:
        with pytest.raises(ServerMismatchError, match=msg):
            served_weight_format(f, precision)

    from sorl_megatron.weight_sync.distributed import begin_update

    good, bad = Recorder(model_path=fp8, quantization="fp8"), Recorder(model_path=bf16, quantization="fp8")
    try:
        fmt = run_client(good.url, lambda c: begin_update(c, settings(precision="fp8", urls=[good.url])))
        assert fmt == "block_fp8"
        with pytest.raises(ServerMismatchError, match="online"):
            run_client(bad.url, lambda c: begin_update(c, settings(precision="fp8", urls=[bad.url])))
        assert bad.paths() == []  # refused before the sync opened
    finally:
        good.server.stop()
        bad.server.stop()


def test_the_flush_after_a_sync_waits_for_idle_bounded_and_never_fails_it(recorders, tmp_path, monkeypatch, caplog):
    """SGLang answers /flush_cache 400 while requests run (async with rollout.async.pause_mode in_place or off): the
    sync then leaves the flush to a background call each server holds until idle
    (?timeout=rollout.async.flush_idle_timeout_s), and a server still busy after it is a warning, never a
    failed sync; idle servers flush at once."""
    from sorl_megatron.weight_sync.distributed import end_update

    monkeypatch.setattr(disk, "save_hf_checkpoint", lambda model, out, fp8: None)
    recorders[0].busy = True
    with caplog.at_level("INFO"):
        make_weight_sync(settings("disk", flush_idle_timeout_s=1.5), tmp_path).sync(
            "model", SyncTargets((recorders[0].url,)), "step_1")  # returns: the flush waits elsewhere
        deadline = time.monotonic() + 30
        while "prefix cache not flushed" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    flushes = [q for p, q in recorders[0].calls if p == "/flush_cache"]
    assert flushes == [{}, {"timeout": "1.5"}]
    assert "Timed out waiting for idle state" in caplog.text
    run_client(recorders[1].url, lambda c: end_update(c, "step_2", True, 3.0))
    assert recorders[1].paths() == ["/update_weight_version", "/end_weight_update", "/flush_cache"]
    assert recorders[1].calls[-1][1] == {}  # idle: flushed at once
