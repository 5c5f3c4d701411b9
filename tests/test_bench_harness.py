"""The benchmarks' client-side command counter: what it reports is what the server ran."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import redis.asyncio
from _servers import ServerProcess

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_bench_harness", BENCHMARKS / "_harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_parse_commands_reads_a_pipeline_buffer() -> None:
    harness = _harness()
    packed = (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n"
        b"*2\r\n$6\r\nCLIENT\r\n$7\r\nSETINFO\r\n"
        b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n0\r\n$6\r\n\r\n\r\n\r\n"
    )
    assert harness.parse_commands(packed) == ["set", "client|setinfo", "evalsha"]


async def test_counting_pool_counts_each_command_of_a_pipeline(
    valkey_plain: ServerProcess,
) -> None:
    harness = _harness()
    log = harness.CommandLog()
    client: redis.asyncio.Redis = harness.counted_client(valkey_plain.url, log)
    admin = redis.asyncio.Redis.from_url(valkey_plain.url)
    try:
        await client.ping()
        mark = log.mark()
        before = await harness.server_calls(admin)
        pipe = client.pipeline(transaction=False)
        pipe.set("bench-test:k", 1)
        pipe.get("bench-test:k")
        pipe.get("bench-test:k")
        await pipe.execute()
        after = await harness.server_calls(admin)
        counted = harness.count(log.commands_since(mark), before, after, workload=0)
    finally:
        await client.aclose()
        await admin.delete("bench-test:k")
        await admin.aclose()
    assert counted.client_by_command == {"get": 2, "set": 1}
    assert counted.server_by_command == {"get": 2, "set": 1}
    assert log.connections_made == 1
