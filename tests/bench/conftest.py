"""The real-server fixtures of tests/server, reused so `bench serve` drives a real engine over loopback."""

from tests.server.conftest import chat_model_dir, chat_tokenizer_dir, server, servers  # noqa: F401
