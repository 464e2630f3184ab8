"""The engine: the core step (schedule → run → update), its thread, and the front ends' request/output handling."""
