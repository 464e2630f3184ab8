"""Engine clients: the `EngineClient` protocol servers see, the in-process `AsyncEngine`, and the `Router` that puts
one front before several engines."""
