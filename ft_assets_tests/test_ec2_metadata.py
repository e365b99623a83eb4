"""The worker's EC2 metadata (IMDSv2), against a fake metadata server on loopback.

The instance id becomes the run tag the idle-shutdown sensor reads; the spot ``instance-action``
notice becomes the SIGTERM that makes the recipe checkpoint and exit (``Preempted``), as ECS or an
operator's SIGTERM does.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from ft_assets import layout
from ft_assets.data.chat_encoding import ChatEncoder
from ft_assets.data.tokenizing import tokenize_and_pack
from ft_assets.manifests import read_manifest
from ft_assets.providers import ec2_metadata
from ft_assets.providers.ec2_metadata import WORKER_TAG, SpotNoticeWatcher, worker_instance_tag
from ft_assets.storage import LocalStore
from ft_assets.training.config import TrainingConfig
from ft_assets.training.preemption import Preempted, SigtermFlag
from ft_assets.training.recipe import train

NOTICE = {"action": "terminate", "time": "2026-12-01T12:00:00Z"}


class FakeImds(http.server.BaseHTTPRequestHandler):
    spot_notice: dict | None = None  # set on the class by a test to announce the reclaim

    def do_PUT(self):
        ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._reply(200 if ok else 400, b"token-123")

    def do_GET(self):
        if self.headers.get("X-aws-ec2-metadata-token") != "token-123":
            return self._reply(401, b"")
        if self.path == "/latest/meta-data/instance-id":
            return self._reply(200, b"i-0123456789abcdef0")
        if self.path == "/latest/meta-data/spot/instance-action" and FakeImds.spot_notice is not None:
            return self._reply(200, json.dumps(FakeImds.spot_notice).encode())
        self._reply(404, b"")

    def _reply(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def imds(monkeypatch):
    FakeImds.spot_notice = None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeImds)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{server.server_port}/")
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    yield FakeImds
    server.shutdown()
    server.server_close()


@pytest.mark.integration  # a stand-in metadata service on loopback
def test_worker_instance_tag_reads_imdsv2(imds, monkeypatch):
    assert worker_instance_tag() == {WORKER_TAG: "i-0123456789abcdef0"}
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert worker_instance_tag() == {}


def test_worker_instance_tag_off_ec2(monkeypatch):
    with socket.socket() as probe:  # a port nobody listens on: refused at once, like a machine off EC2
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{port}")
    assert worker_instance_tag() == {}
    with SigtermFlag() as flag, SpotNoticeWatcher(poll_s=0.01) as watcher:
        time.sleep(0.3)
    assert not flag.requested and watcher.notice is None  # the watcher gave up quietly


@pytest.mark.integration  # a stand-in metadata service on loopback
def test_a_spot_notice_becomes_the_sigterm_path(imds):
    said = []
    with SigtermFlag() as flag, SpotNoticeWatcher(poll_s=0.02, log=said.append) as watcher:
        time.sleep(0.2)
        assert not flag.requested  # 404: no notice yet
        imds.spot_notice = NOTICE
        deadline = time.monotonic() + 5
        while not flag.requested and time.monotonic() < deadline:
            time.sleep(0.01)
    assert flag.requested and watcher.notice == NOTICE
    assert said == [
        "spot notice: EC2 will terminate this instance at 2026-12-01T12:00:00Z; checkpointing and stopping (as on SIGTERM)"
    ]


@pytest.mark.integration  # a stand-in metadata service on loopback
def test_training_checkpoints_and_stops_on_a_spot_notice(imds, tmp_path, monkeypatch):
    from ft_assets_tests.tiny import build_tiny_model

    monkeypatch.setattr(ec2_metadata, "SPOT_POLL_S", 0.02)  # the recipe's watcher polls every 20 ms, not 5 s

    model_dir = build_tiny_model(tmp_path / "tiny")
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    rows = (
        (f"r{i}", [{"role": "user", "content": f"Ping {i}"}, {"role": "assistant", "content": "pong"}])
        for i in range(64)
    )
    (tmp_path / "shards").mkdir()
    tokenize_and_pack(rows, encoder, 64, tmp_path / "shards", "train")
    store, run = LocalStore(tmp_path / "store"), "runs/t/v/train/r"
    steps = []

    def announce_at_step_3(metrics):
        steps.append(metrics["step"])
        if metrics["step"] == 3:
            imds.spot_notice = NOTICE

    config = TrainingConfig(method="lora", max_steps=400, per_device_batch_size=1, logging_steps=1, save_steps=1000)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(Preempted) as stopped:
            train(
                config,
                model_dir,
                tmp_path / "shards",
                store,
                run,
                tmp_path / "work",
                log=print,
                on_metrics=announce_at_step_3,
            )
    finally:
        torch.set_num_threads(threads)
    step = stopped.value.step
    assert 3 <= step < 400 and steps[-1] == step  # stopped at a step boundary soon after the notice
    assert read_manifest(store, layout.checkpoint(run, step)).meta["step"] == step  # and checkpointed there first
