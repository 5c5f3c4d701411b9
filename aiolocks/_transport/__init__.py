"""The per-client runner: how a script call reaches Redis and its reply comes back.

`ScriptRunner` (`_runner`) sends every script and command the engine makes, by EVALSHA,
auto-pipelined on one link, within the in-flight limit; it knows nothing of locks.
Imports `_base` and `_scripts` only. `_runner` is the whole layer: read it top to bottom.
"""
