"""The network front ends of jengine: the OpenAI-compatible HTTP shim and the gRPC service, over one EngineClient."""
