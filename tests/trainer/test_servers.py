"""The trainer's embedded servers start on loopback and are always stopped (real processes)."""

import json
import urllib.error
import urllib.request

import pytest

from sorl_megatron.trainer.serving.servers import EmbeddedServers, retrieval_server_spec


def _corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    docs = [{"id": str(i), "contents": f'"Doc {i}"\nthe city of town{i} lies in land{i}'} for i in range(5)]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def _retrieve(url, query, key=None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"{url}/retrieve", data=json.dumps({"queries": [query], "topk": 1}).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_servers_stop_after_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("SORL_RETRIEVAL_API_KEY", raising=False)
    servers = EmbeddedServers(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with servers:
            url = servers.start(retrieval_server_spec(str(_corpus(tmp_path)), topk=1))
            assert url.startswith("http://127.0.0.1:")
            key = servers.api_keys["retrieval"]  # a random per-run key, not in argv
            assert len(key) >= 32 and key not in " ".join(servers.procs["retrieval"].args)
            with pytest.raises(urllib.error.HTTPError, match="401"):
                _retrieve(url, "town3")  # another local user, without the key
            assert "town3" in json.dumps(_retrieve(url, "town3", key))
            proc = servers.procs["retrieval"]
            raise RuntimeError("boom")
    assert proc.poll() is not None  # the child is gone
    assert servers.procs == {}
    assert (tmp_path / "servers" / "retrieval.log").exists()


def test_server_that_dies_at_start_is_reported_and_reaped(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    servers = EmbeddedServers(tmp_path)
    with pytest.raises(RuntimeError, match=r"embedded retrieval server failed to start .*retrieval.log"):
        servers.start(retrieval_server_spec(str(bad), topk=1))
    assert servers.procs == {}


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="retrieval.corpus"):
        retrieval_server_spec(str(tmp_path / "nope.jsonl"), topk=3)


def test_an_interrupted_run_reports_one_line_on_rank_0(capsys, monkeypatch):
    import signal

    from sorl_megatron.trainer.serving.servers import SignalInterrupt, report_interrupt

    monkeypatch.setenv("RANK", "0")
    assert report_interrupt(KeyboardInterrupt()) == 128 + signal.SIGINT
    # not the trainer's (rerun.RunInterrupted, which names its phase): before the run or after it
    assert capsys.readouterr().err == ("interrupted (Ctrl-C) before the run started or after it ended: nothing was "
                                       "lost; run the same command again\n")
    assert report_interrupt(SignalInterrupt(signal.SIGTERM)) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.startswith("interrupted (SIGTERM) before ")
    monkeypatch.setenv("RANK", "1")
    assert report_interrupt(KeyboardInterrupt()) == 130
    assert capsys.readouterr().err == ""


def test_deterministic_rollouts_reach_the_embedded_server_as_its_flag():
    from sorl_megatron.trainer.serving.servers import rollout_server_spec

    flag = "--enable-deterministic-inference"
    assert flag in rollout_server_spec("m", "fp32", False, 1, deterministic=True).args
    assert flag not in rollout_server_spec("m", "fp32", False, 1).args


def test_the_embedded_retrieval_server_takes_the_recipes_topk_as_its_cap(tmp_path):
    """retrieval.topk=1000 was accepted while the embedded server capped requests at 100, so
    every search was rejected as the run went on: the recipe's topk is its cap too."""
    from sorl_megatron.retrieval.server import parse_args

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "0", "contents": "a b"}\n')
    for topk, cap in ((3, 100), (1000, 1000)):
        args = retrieval_server_spec(str(corpus), topk).args
        assert args[args.index("--max-topk") + 1] == str(cap)
        parsed = parse_args(args)
        assert (parsed.topk, parsed.max_topk) == (topk, cap)


def test_a_server_whose_port_was_taken_before_it_bound_is_launched_again_on_another(tmp_path, monkeypatch):
    """The race behind EADDRINUSE with two test workers: the port free_port() returned is taken
    before the child binds it. Here a listening socket holds the first port handed out."""
    import socket

    from sorl_megatron.common import background
    from sorl_megatron.trainer.serving import servers as servers_mod

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    handed = []

    def first_taken(host="127.0.0.1"):
        port = taken if not handed else background.free_port(host)
        handed.append(port)
        return port

    monkeypatch.setattr(servers_mod, "free_port", first_taken)
    monkeypatch.delenv("SORL_RETRIEVAL_API_KEY", raising=False)
    try:
        with EmbeddedServers(tmp_path) as servers:
            url = servers.start(retrieval_server_spec(str(_corpus(tmp_path)), topk=1))
            assert handed[0] == taken and url.endswith(f":{handed[-1]}") and handed[-1] != taken
            assert "town3" in json.dumps(_retrieve(url, "town3", servers.api_keys["retrieval"]))
        log = (tmp_path / "servers" / "retrieval.log").read_text().lower()
        assert "address already in use" in log  # the first launch did fail on the held port
    finally:
        held.close()
