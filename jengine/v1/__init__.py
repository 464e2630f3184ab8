"""Generated code of the `jengine.v1` wire contract (proto/jengine/v1); made by scripts/gen_proto.py."""
