"""Issue 31, item 9: tensor-update bodies one at a time in memory, payloads of the wrong type a 400.

The type checks run against the in-process server; the memory bound against a subprocess
server, whose peak RSS (``VmHWM``) is its own.
"""

from __future__ import annotations

import base64
import http.client
import io
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from sorl_megatron.sglang_cpu.options import EngineConfig, ServerOptions
from sorl_megatron.sglang_cpu.server import start_rollout_server
from tests.http_calls import call
from tests.rollout.server_process import server_process

PROMPT = [5, 6, 7, 8, 9, 10, 11]
MiB = 1024**2


def torch_payload(obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()], "load_format": "torch"}


@pytest.fixture(scope="module")
def server(moe_dir):
    srv = start_rollout_server(EngineConfig(model_path=str(moe_dir)), options=ServerOptions(weight_body_wait_s=1.0))
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "obj, why",
    [
        (5, "holds a int"),
        ("model.norm.weight", "holds a str"),
        (torch.zeros(3), "holds a Tensor"),
        (None, "holds a NoneType"),
        ([("model.norm.weight", 1.0)], "entry 0 is not a (name, tensor) pair"),
        ({7: torch.zeros(3)}, "entry 0 is not a (name, tensor) pair"),
        ([("model.norm.weight", torch.zeros(3))] * 2, "names tensor 'model.norm.weight' twice"),
    ],
)
def test_torch_payload_of_the_wrong_type_is_400(server, obj, why):
    status, obj = call(server.url, "POST", "/update_weights_from_tensor", torch_payload(obj))
    assert status == 400, obj  # torch.save(5) was a 500 (TypeError: 'int' object is not iterable)
    assert why in obj["message"], obj
    assert "twice" in why or "expected a list of (name, tensor) pairs or a {name: tensor} dict" in obj["message"]
    assert call(server.url, "GET", "/health")[0] == 200


def test_a_valid_torch_payload_still_applies(server):
    name = "model.norm.weight"
    new = server.engine.served.state[name] + 0.25
    assert call(server.url, "POST", "/begin_weight_update", {})[0] == 200
    try:
        status, obj = call(server.url, "POST", "/update_weights_from_tensor", torch_payload([(name, new)]))
    finally:
        assert call(server.url, "POST", "/end_weight_update", {})[0] == 200
    assert status == 200, obj
    assert torch.equal(server.engine.served.state[name], new)


def test_a_body_waiting_past_its_turn_gets_503_with_retry_after(server):
    """A body being received holds the turn; another one waits at most --weight-body-wait-s
    (1 s here), and /generate is not held up by either."""
    host, port = server.url.removeprefix("http://").split(":")
    slow = socket.create_connection((host, int(port)), timeout=30)
    slow.sendall(b"POST /update_weights_from_tensor HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"serialized")  # and then nothing: the turn is held
    try:
        time.sleep(0.3)  # the server has the request and its turn
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        t0 = time.monotonic()
        conn.request("POST", "/update_weights_from_tensor", body=b"{}", headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        text, waited = r.read().decode(), time.monotonic() - t0
        conn.close()
        assert r.status == 503 and "--weight-body-wait-s" in text, text
        assert r.getheader("Retry-After") == "1"
        assert 0.9 < waited < 30
        gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        status, out = call(server.url, "POST", "/generate", gen)
        assert status == 200 and len(out["output_ids"]) == 2
    finally:
        slow.close()  # the held request ends (its client left): the turn is free again
    deadline = time.monotonic() + 30
    while True:
        status, obj = call(server.url, "POST", "/update_weights_from_tensor", torch_payload(5))
        if status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 400, obj


# ----- memory: one body at a time (subprocess server) -----


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


@pytest.fixture(scope="module")
def proc_server(moe_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("bodies") / "server.log"
    with server_process(moe_dir, log, "--weight-body-wait-s", "300") as running:
        yield running


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_concurrent_tensor_bodies_are_held_one_at_a_time(proc_server):
    """Three 96 MiB bodies sent at once peak no higher than one alone (they were buffered side
    by side: 3 x 900 MiB peaked at 5.7 GB). Each is a complete safetensors payload whose
    tensor the model does not have, outside a weight-update session, so each is read, decoded,
    then refused (400)."""
    url, proc = proc_server
    tensor = torch.zeros(18 * MiB)  # 72 MiB of float32: 96 MiB of base64
    body = (b'{"serialized_named_tensors": ["' + base64.b64encode(save({"not.a.weight": tensor}))
            + b'"], "weight_version": "x"}')
    del tensor
    size = len(body)
    assert size > 95 * MiB

    def post(box: list) -> None:
        box.append(call(url, "POST", "/update_weights_from_tensor", body, timeout=600))

    for _ in range(2):  # one at a time: the peak that a single body costs
        one: list = []
        post(one)
        assert one[0][0] == 400, one
    alone = _peak_rss(proc.pid)
    boxes = [[] for _ in range(3)]
    threads = [threading.Thread(target=post, args=(b,)) for b in boxes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together = _peak_rss(proc.pid)
    grown = (together - alone) / MiB
    print(f"\n[tensor bodies] peak RSS {alone / MiB:.0f} MiB after {size / MiB:.0f} MiB bodies one by one, "
          f"{together / MiB:.0f} MiB after three at once (+{grown:.0f} MiB)")
    assert [b[0][0] for b in boxes] == [400] * 3, boxes
    assert grown < 0.5 * size / MiB  # side by side: about +2 bodies (+2.2 measured)
    assert call(url, "GET", "/health")[0] == 200
