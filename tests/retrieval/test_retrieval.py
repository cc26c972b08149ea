import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from sorl_megatron.common.http import RequestRejectedError, RetryPolicy
from sorl_megatron.retrieval import BM25Index, RetrievalClient, format_passages, read_corpus
from sorl_megatron.retrieval.server import RetrievalServerConfig, start_retrieval_server

CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "2", "contents": '"Lyon"\nLyon is a city in France known for cuisine.'},
    {"id": "3", "contents": '"Cat"\nThe cat is a small domesticated carnivorous mammal.'},
]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    return path


@pytest.fixture(scope="module")
def server(corpus_file):
    srv = start_retrieval_server(BM25Index.from_jsonl(corpus_file), RetrievalServerConfig(port=0, max_query_chars=64))
    yield srv
    srv.stop()


def run(coro):
    return asyncio.run(coro)


def test_read_corpus_and_format(corpus_file, tmp_path):
    passages = list(read_corpus(corpus_file))
    assert [p.id for p in passages] == ["0", "1", "2", "3"]
    assert passages[0].title == '"Paris"' and passages[0].text.startswith("Paris is")
    text = format_passages(passages[:2])
    assert text == (
        'Doc 1(Title: "Paris") Paris is the capital and largest city of France.\n'
        'Doc 2(Title: "Berlin") Berlin is the capital of Germany.\n'
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "contents": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(read_corpus(bad))


def test_corpus_errors_name_file_and_line(tmp_path):
    """Issue 15, class 6: a non-UTF-8 corpus used to fail without naming file or line."""
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"id": "0", "contents": "ok"}\n\n{"id": "1", "contents": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:3: not valid UTF-8 \(invalid continuation byte at byte 28"):
        list(read_corpus(latin1))
    null = tmp_path / "null.jsonl"
    null.write_text('{"id": "0", "contents": null}\n')
    with pytest.raises(ValueError, match=r"null.jsonl:1: 'contents' must be a string, got None"):
        list(read_corpus(null))
    bom = tmp_path / "bom.jsonl"  # a byte-order mark is not an error
    bom.write_bytes(b'\xef\xbb\xbf{"id": "0", "contents": "\\"T\\"\\ncaf\xc3\xa9"}\n')
    assert [p.contents for p in read_corpus(bom)] == ['"T"\ncafé']


def test_index_ranks_and_scores(corpus_file):
    index = BM25Index.from_jsonl(corpus_file)
    hits = index.search(["capital of Germany", "france city"], topk=2)
    assert hits[0][0].id == "1" and hits[0][0].score > hits[0][1].score
    assert {h.id for h in hits[1]} == {"0", "2"}
    assert index.search(["zzzz"], topk=10)[0][0].score == 0.0
    assert len(index.search(["zzzz"], topk=10)[0]) == len(CORPUS)  # topk clamps to corpus size
    # stop words only: bm25s itself raises on these (an RL policy emits them while exploring)
    mixed = index.search(["is a", "the", "capital of Germany"], topk=2)
    assert [[p.score for p in row] for row in mixed[:2]] == [[0.0, 0.0], [0.0, 0.0]]
    assert mixed[2][0].id == "1" and mixed[2][0].score > 0


def test_client_topk_and_scores(server):
    async def go():
        async with RetrievalClient(server.url) as client:
            return await client.retrieve(["capital of Germany", "domesticated mammal", "is the"], topk=3)

    res = run(go())
    assert [len(r) for r in res] == [3, 3, 3]
    assert res[0][0].id == "1" and res[1][0].id == "3"
    scores = [p.score for p in res[0]]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0


def test_raw_api_shape_without_scores(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{server.url}/retrieve", json={"queries": ["Lyon"], "topk": 1}) as r:
                return r.status, await r.json()

    status, body = run(go())
    assert status == 200
    assert body["result"] == [[{"id": "2", "contents": CORPUS[2]["contents"]}]]


@pytest.mark.parametrize(
    "payload,msg",
    [
        ({"queries": ["  "], "topk": 1}, "queries[0] is empty"),
        ({"queries": ["x" * 65], "topk": 1}, "65 characters"),
        ({"queries": [], "topk": 1}, "non-empty list"),
        ({"queries": ["ok"], "topk": 0}, "topk"),
        ({"queries": [3], "topk": 1}, "expected a string"),
    ],
)
def test_bad_requests_get_400(server, payload, msg):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{server.url}/retrieve", json=payload) as r:
                return r.status, await r.json()

    status, body = run(go())
    assert status == 400 and msg in body["error"]


def test_client_surfaces_400_and_malformed_json(server):
    async def go():
        async with RetrievalClient(server.url, RetryPolicy(timeout_s=5, retries=0)) as c:
            with pytest.raises(RequestRejectedError, match="empty") as ei:
                await c.retrieve([""])
            assert ei.value.status == 400
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{server.url}/retrieve", data=b"{not json") as r:
                    assert r.status == 400 and "JSON" in (await r.json())["error"]
            # server still alive after bad requests
            assert (await c.retrieve(["Paris"], topk=1))[0][0].id == "0"

    run(go())


def test_cli_help_documents_flags():
    out = subprocess.run(
        [sys.executable, "-m", "sorl_megatron.retrieval.server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for flag in ("--corpus", "--host", "--port", "--topk", "--max-topk", "--max-queries", "--max-query-chars"):
        assert flag in out.stdout


def test_cli_server_subprocess(corpus_file, tmp_path):
    from tests.served import served

    argv = lambda port: [sys.executable, "-m", "sorl_megatron.retrieval.server", "--corpus",  # noqa: E731
                         str(corpus_file), "--port", str(port)]
    with served(argv, tmp_path / "server.log", timeout_s=60) as (url, _):

        async def go():
            async with RetrievalClient(url) as c:
                return await c.retrieve(["capital of France"], topk=2)

        assert run(go())[0][0].id == "0"


def test_client_takes_the_search_r1_endpoint_url():
    from sorl_megatron.retrieval.client import RetrievalClient

    for url in ("http://127.0.0.1:8000/retrieve", "http://127.0.0.1:8000/retrieve/", "http://127.0.0.1:8000"):
        assert RetrievalClient(url).url == "http://127.0.0.1:8000"
