"""Foundations: what every layer shares and nothing engine-like.

The error tree and the one boundary where redis-py's and valkey-py's errors become ours
(`_errors`), key names (`_keys`), the clients accepted (`_clients`), everything taken from a
client library beyond its documented API (`_adapter`), the engine's clock (`_clock`), and
the vocabulary a primitive gives the engine (`_spec`). Imports only `aiolocks._scripts` and
itself. Read `_spec`, then `_errors` and `_adapter`.
"""
