"""Contended `RedisMutex` throughput on one server and on a 3-primary Cluster, one run.

    python benchmarks/bench_cluster.py [--kind valkey|redis] [--iterations 40] [--json PATH]

Starts, on free 127.0.0.1 ports, one server and a 3-primary cluster of the same binary
(the test suite's own harness, `tests/_cluster.py`). For 1, 10 and 1,000 distinct names:
4 processes x 8 tasks, each task ITERATIONS times acquire -> GET counter -> SET counter+1
-> release on the name `names[(task + i) % N]`, through a plain client or a RedisCluster
client. Reports acquisitions/s (first start to last end over all processes), whether every
counter came out exact, and, on the cluster: SPUBLISH calls per node, and the cluster-bus
pub/sub messages each node received per hand-off (CLUSTER INFO), beside the same count
for plain PUBLISH (what a non-sharded design sends) measured on the same cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import RedisCluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _cluster import Cluster  # noqa: E402  (the test harness, reused)
from _servers import ServerProcess, binary_path  # noqa: E402

from aiolocks import RedisMutex  # noqa: E402

PROCESSES, TASKS = 4, 8
NAME_COUNTS = (1, 10, 1000)
CAP_S = 300.0


def _client(url: str) -> Any:
    if url.startswith("cluster+"):
        return RedisCluster.from_url(url.removeprefix("cluster+"))
    return redis.asyncio.Redis.from_url(url)


async def worker(url: str, count: int, iterations: int, ident: int) -> None:
    """One process: TASKS tasks; prints `<start> <end> <acquisitions>` (monotonic)."""
    client = _client(url)
    names = [f"bench{i}" for i in range(count)]
    try:
        if await client.incr("{bench}:arrived") == PROCESSES:
            await client.rpush("{bench}:gate", *["go"] * PROCESSES)
        await client.blpop(["{bench}:gate"], timeout=60)
        mutexes = {name: RedisMutex(client, name, ttl=30, timeout=CAP_S) for name in names}

        async def task(index: int) -> None:
            for i in range(iterations):
                name = names[(ident * TASKS + index + i) % count]
                async with mutexes[name]:
                    counter = f"{{{name}}}:counter"
                    value = int(await client.get(counter) or 0)
                    await client.set(counter, value + 1)

        start = time.monotonic()
        await asyncio.gather(*(task(index) for index in range(TASKS)))
        print(start, time.monotonic(), TASKS * iterations, flush=True)
    finally:
        await client.aclose()


async def run(url: str, count: int, iterations: int) -> dict[str, Any]:
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--worker",
            url,
            str(count),
            str(iterations),
            str(ident),
            stdout=asyncio.subprocess.PIPE,
        )
        for ident in range(PROCESSES)
    ]
    outputs = [await asyncio.wait_for(proc.communicate(), CAP_S) for proc in procs]
    spans = [tuple(map(float, out.split())) for out, _ in outputs]
    if any(proc.returncode for proc in procs) or any(len(span) != 3 for span in spans):
        raise RuntimeError(f"a worker failed: {outputs}")
    first, last = min(span[0] for span in spans), max(span[1] for span in spans)
    total = int(sum(span[2] for span in spans))
    client = _client(url)
    try:
        counted = 0
        for i in range(count):
            counted += int(await client.get(f"{{bench{i}}}:counter") or 0)
    finally:
        await client.aclose()
    return {
        "names": count,
        "acquisitions": total,
        "acquisitions_per_s": round(total / (last - first), 1),
        "counters_exact": counted == total,
    }


async def bus_counts(cluster: Cluster) -> list[dict[str, int]]:
    """Per node: pub/sub messages over the cluster bus (CLUSTER INFO) and SPUBLISH calls."""
    counts = []
    for node in cluster.nodes:
        async with redis.asyncio.Redis(host="127.0.0.1", port=node.port) as client:
            info = (await client.execute_command("CLUSTER", "INFO")).decode()  # type: ignore[no-untyped-call]
            fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
            stats = await client.info("commandstats")

            bus = "cluster_stats_messages_{}_received"
            counts.append(
                {
                    "bus_publish_received": int(fields.get(bus.format("publish"), 0)),
                    "bus_publishshard_received": int(fields.get(bus.format("publishshard"), 0)),
                    "spublish_calls": int(stats.get("cmdstat_spublish", {}).get("calls", 0)),
                    "publish_calls": int(stats.get("cmdstat_publish", {}).get("calls", 0)),
                }
            )
    return counts


def _diff(after: list[dict[str, int]], before: list[dict[str, int]]) -> list[dict[str, int]]:
    return [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]


async def flush(cluster: Cluster | None, server: ServerProcess | None) -> None:
    if cluster is not None:
        await cluster.flushall()
    if server is not None:
        async with redis.asyncio.Redis.from_url(server.url) as client:
            await client.flushall()


async def main(kind: str, iterations: int) -> dict[str, Any]:
    binary = binary_path(kind)  # type: ignore[arg-type]
    if binary is None:
        raise SystemExit(f"no {kind} server binary here")
    server = ServerProcess(binary, kind=kind, notify=True).start()  # type: ignore[arg-type]
    cluster = Cluster(binary, kind=kind).start()  # type: ignore[arg-type]
    results: dict[str, Any] = {"one server": [], "3-node cluster": [], "pubsub": {}}
    try:
        for count in NAME_COUNTS:
            await flush(None, server)
            results["one server"].append(await run(server.url, count, iterations))
            await flush(cluster, None)
            before = await bus_counts(cluster)
            row = await run("cluster+" + cluster.startup_url, count, iterations)
            row["per_node"] = _diff(await bus_counts(cluster), before)
            results["3-node cluster"].append(row)
        # The same number of messages sent by plain PUBLISH, for comparison.
        before = await bus_counts(cluster)
        async with redis.asyncio.Redis(host="127.0.0.1", port=cluster.nodes[0].port) as client:
            for _ in range(1000):
                await client.publish("aiolocks:mutex:{bench0}:wake", "token 1 30000")
        results["pubsub"]["plain_publish_x1000_per_node"] = _diff(await bus_counts(cluster), before)
    finally:
        cluster.stop()
        server.stop()
    return results


def report(results: dict[str, Any]) -> None:
    print(f"{'names':>6} {'one server acq/s':>17} {'cluster acq/s':>14} {'x':>6}  exact")
    for single, clustered in zip(results["one server"], results["3-node cluster"], strict=True):
        ratio = clustered["acquisitions_per_s"] / single["acquisitions_per_s"]
        exact = single["counters_exact"] and clustered["counters_exact"]
        print(
            f"{single['names']:>6} {single['acquisitions_per_s']:>17.0f} "
            f"{clustered['acquisitions_per_s']:>14.0f} {ratio:>6.2f}  {exact}"
        )
    for row in results["3-node cluster"]:
        spub = [node["spublish_calls"] for node in row["per_node"]]
        bus = [
            node["bus_publish_received"] + node["bus_publishshard_received"]
            for node in row["per_node"]
        ]
        print(
            f"cluster, {row['names']} names: SPUBLISH per node {spub}, "
            f"bus messages received per node {bus}"
        )
    plain = results["pubsub"]["plain_publish_x1000_per_node"]
    print(
        "1000 plain PUBLISH on node 0: bus messages received per node "
        f"{[node['bus_publish_received'] for node in plain]}"
    )


def cli() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        url, count, iterations, ident = sys.argv[2], *map(int, sys.argv[3:6])
        asyncio.run(worker(url, count, iterations, ident))
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kind", default="valkey", choices=("valkey", "redis"))
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument(
        "--json", type=Path, default=Path(__file__).parent / "results" / "cluster.json"
    )
    args = parser.parse_args()
    loadavg = os.getloadavg()
    results = asyncio.run(main(args.kind, args.iterations))
    report(results)
    machine = {"nproc": os.cpu_count(), "loadavg_at_start": loadavg, "kind": args.kind}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    print(f"JSON written to {args.json}")


if __name__ == "__main__":
    cli()
