"""Device meshes and sharding rules: tensor and expert parallelism within an engine, multi-host start-up."""
