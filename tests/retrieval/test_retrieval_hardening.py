"""Issue 15, class 3 for the retrieval server: bounded bodies, 400s with the reason, --api-key."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from urllib.parse import urlparse

import psutil
import pytest

from sorl_megatron.common.http import RequestRejectedError, RetryPolicy
from sorl_megatron.retrieval import RetrievalClient
from tests.http_calls import call
from tests.served import served

CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
]
KEY = "retrieval-key-42"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("retr")
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    argv = lambda port: [sys.executable, "-m", "sorl_megatron.retrieval.server", "--corpus", str(corpus),  # noqa: E731
                         "--port", str(port), "--max-query-chars", "64", "--max-queries", "8", "--log-level", "warning"]
    with served(argv, d / "server.log", env={**os.environ, "SORL_RETRIEVAL_API_KEY": KEY}, timeout_s=60) as running:
        yield running


def _send_oversized(url: str, total: int, chunked: bool) -> int:
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    head = f"POST /retrieve HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {total}\r\n\r\n"
    sock.sendall(head.encode())
    block = b'{"queries": ["' + b"a" * (1024**2 - 14)
    frame = f"{len(block):x}\r\n".encode() + block + b"\r\n" if chunked else block
    sent = 0
    try:
        while sent < total:
            sock.sendall(frame)
            sent += len(block)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        answer = sock.recv(4096).decode(errors="replace")
    except ConnectionResetError:
        answer = ""
    sock.close()
    return int(answer.split()[1]) if answer.startswith("HTTP/1.1") else -1


def test_413_before_buffering_keeps_memory_flat(server):
    url, proc = server
    rss = psutil.Process(proc.pid)
    assert call(url, "POST", "/retrieve", {"queries": ["Paris"]}, AUTH)[0] == 200
    base = rss.memory_info().rss
    statuses = [_send_oversized(url, 100 * 1024**2, chunked=c) for c in (False, False, False, True, True, True)]
    grown = (rss.memory_info().rss - base) / 1024**2
    print(f"\n[retrieval body limit] statuses {statuses}; RSS grew {grown:.0f} MiB after six 100 MiB POSTs")
    assert statuses == [413] * 6
    assert grown < 128  # was ~64 MB kept per refused POST
    status, obj = call(url, "POST", "/retrieve", b"x" * (33 * 1024**2), AUTH)
    assert status == 413 and "--max-body-mb" in obj["error"]
    assert call(url, "POST", "/retrieve", {"queries": ["Paris"]}, AUTH)[0] == 200


@pytest.mark.parametrize(
    "body,msg",
    [
        ({"queries": ["x" * 65]}, "queries[0] has 65 characters > --max-query-chars 64"),
        ({"queries": ["a"] * 9}, "too many queries: 9 > --max-queries 8"),
        ({"queries": ["ok", "bad \ud800"]}, "queries[1] is not valid Unicode text: lone surrogate"),
        ({"queries": ["ok"], "topk": 10**30}, "'topk' must be an integer in [1, 100], got 100000000000000000"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"queries": ["a"], "topk": NaN}', "NaN is not a JSON number"),
        (b"", "empty"),
    ],
)
def test_bad_bodies_get_400_with_the_reason(server, body, msg):
    url, _ = server
    status, obj = call(url, "POST", "/retrieve", body, AUTH)
    assert status == 400 and msg in obj["error"]


def test_api_key(server, monkeypatch):
    url, _ = server
    assert call(url, "GET", "/health")[0] == 200  # open: probes need no key
    status, obj = call(url, "POST", "/retrieve", {"queries": ["Paris"]})
    assert status == 401 and "Unauthorized" in obj["error"]
    assert call(url, "POST", "/retrieve", {"queries": ["Paris"]}, {"Authorization": f"Bearer {KEY}x"})[0] == 401

    async def go(key):
        async with RetrievalClient(url, RetryPolicy(timeout_s=10, retries=0), api_key=key) as c:
            return await c.retrieve(["capital of Germany"], topk=1)

    assert asyncio.run(go(KEY))[0][0].id == "1"
    with pytest.raises(RequestRejectedError, match="401"):
        asyncio.run(go(None))
    monkeypatch.setenv("SORL_RETRIEVAL_API_KEY", KEY)  # the client falls back to the server's variable
    assert asyncio.run(go(None))[0][0].id == "1"


def test_cli_help_documents_new_flags():
    out = subprocess.run(
        [sys.executable, "-m", "sorl_megatron.retrieval.server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "--max-body-mb" in out.stdout and "--api-key" in out.stdout and "SORL_RETRIEVAL_API_KEY" in out.stdout


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--max-topk", "0"], "argument --max-topk: must be in [1, 1048576], got 0"),
        (["--topk", "1000"], "--topk must be an integer in [1, --max-topk 100], got 1000"),
        (["--topk", "0"], "argument --topk: must be in [1, 1048576], got 0"),
        (["--max-queries", "0"], "argument --max-queries: must be in [1, 1048576], got 0"),
        (["--max-query-chars", "-5"], "argument --max-query-chars: must be in [1, 16777216], got -5"),
        (["--max-body-mb", "-1"], "argument --max-body-mb: must be in [1, 16384], got -1"),
        (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
        (["--bm25-k1", "nan"], "argument --bm25-k1: must be in [0, 100], got nan"),
        (["--bm25-k1", "-1"], "argument --bm25-k1: must be in [0, 100], got -1"),
        (["--bm25-b", "1.5"], "argument --bm25-b: must be in [0, 1], got 1.5"),
        (["--bm25-b", "nan"], "argument --bm25-b: must be in [0, 1], got nan"),
    ],
)
def test_flags_out_of_range_refuse_to_start(argv, msg, tmp_path, capsys):
    """Each of these used to start a server that refused or broke every request."""
    from sorl_megatron.retrieval.server import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--corpus", str(tmp_path / "never_read.jsonl"), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"error: {msg}" in err, err


def test_nan_bm25_parameters_never_reach_the_scores():
    from sorl_megatron.retrieval import BM25Index, Passage

    passages = [Passage("0", "Paris is big"), Passage("1", "Berlin is big")]
    with pytest.raises(ValueError, match="--bm25-k1 must be a finite number"):
        BM25Index(passages, k1=float("nan"))
    index = BM25Index(passages, k1=0.0, b=1.0)  # the ends of the ranges are fine
    assert all(p.score is not None and p.score == p.score for p in index.search(["paris big"], 2)[0])


STOP_WORDS_ONLY = [{"id": "0", "contents": "The\nand of the"}, {"id": "1", "contents": "is a\nI"}]


def test_a_corpus_of_stop_words_is_refused_at_load(tmp_path):
    """bm25s died with 'max() arg is an empty sequence' while indexing it."""
    from sorl_megatron.retrieval import BM25Index

    corpus = tmp_path / "stop.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in STOP_WORDS_ONLY))
    with pytest.raises(ValueError, match=rf"{corpus}: no passage has a word BM25 can index"):
        BM25Index.from_jsonl(corpus)
    proc = subprocess.run(
        [sys.executable, "-m", "sorl_megatron.retrieval.server", "--corpus", str(corpus), "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --corpus {corpus}: {_no_terms()}"]
    (tmp_path / "one.jsonl").write_text(json.dumps({"id": "0", "contents": "the Eiffel tower"}) + "\n")
    assert len(BM25Index.from_jsonl(tmp_path / "one.jsonl")) == 1  # one indexable word is enough


def _no_terms() -> str:
    from sorl_megatron.retrieval.bm25 import NO_TERMS

    return NO_TERMS
