"""README's gRPC examples against a live service: the Python stub snippet runs as written (the address pointed at
the test server), and what its grpcurl lines name (services through reflection, the request JSON) exists."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from jengine.v1 import jengine_pb2 as pb
from tests.server.grpc_fixtures import API_KEY, GrpcHarness, start_harness, stop_harness

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _block_after(marker: str, language: str) -> str:
    start = README.index(marker)
    return re.search(rf"```{language}\n(.*?)```", README[start:], re.S).group(1)


@pytest.fixture(scope="module")
def harness(chat_model_dir: Path) -> Iterator[GrpcHarness]:
    started = start_harness(chat_model_dir)
    yield started
    stop_harness(started)


def test_the_python_example_streams_a_chat(harness: GrpcHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _block_after("**gRPC.**", "python")
    assert "localhost:50051" in code
    monkeypatch.setenv("JENGINE_API_KEY", API_KEY)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace("localhost:50051", harness.address), "README.md", "exec"), {})
    assert printed.getvalue()
    assert harness.wait_idle()


def test_the_grpcurl_lines_name_what_reflection_serves(harness: GrpcHarness) -> None:
    words = shlex.split(_block_after("**gRPC.**", "bash").replace("\\\n", " "), comments=True)
    starts = [i for i, word in enumerate(words) if word == "grpcurl"] + [len(words)]
    commands = [words[a:b] for a, b in zip(starts, starts[1:])]
    assert len(commands) == 3
    database = ProtoReflectionDescriptorDatabase(harness.channel)
    services = set(database.get_services())
    assert {"jengine.v1.Engine", "grpc.health.v1.Health"} <= services
    for words in commands:
        if "-d" in words:
            request = json_format.Parse(words[words.index("-d") + 1], pb.GenerateRequest())  # field names exist
            assert request.messages.messages[0].content == "Hello" and request.sampling.max_tokens == 16
        method = next((w for w in words if w.startswith("jengine.v1.Engine")), None)
        if method:
            service, _, name = method.partition("/")
            descriptor = database.FindFileContainingSymbol(service)
            assert service in services and descriptor is not None
            if name:
                assert name in [m.name for m in pb.DESCRIPTOR.services_by_name["Engine"].methods]
