"""tests/served.py, the helper that starts a test's own server process: a port taken between
free_port() and the child's bind costs a relaunch, not a failed test (the race that two test
workers hit)."""

import json
import socket
import sys

from sorl_megatron.common import background
from tests import served as served_mod


def test_a_server_whose_port_is_taken_is_started_again_on_another(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": '"Paris"\nthe capital of France'}) + "\n")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    handed = []

    def first_taken(host="127.0.0.1"):
        handed.append(held.getsockname()[1] if not handed else background.free_port(host))
        return handed[-1]

    monkeypatch.setattr(served_mod, "free_port", first_taken)
    argv = lambda port: [sys.executable, "-m", "sorl_megatron.retrieval.server", "--corpus", str(corpus),  # noqa: E731
                         "--port", str(port)]
    try:
        with served_mod.served(argv, tmp_path / "server.log", timeout_s=60) as (url, proc):
            assert len(handed) == 2 and url.endswith(f":{handed[1]}") and proc.poll() is None
        assert "address already in use" in (tmp_path / "server.log").read_text().lower()
    finally:
        held.close()
