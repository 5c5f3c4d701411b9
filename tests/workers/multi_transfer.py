"""Worker: money transfers between accounts, each under a `RedisMultiLock`.

    python multi_transfer.py URL ACCOUNTS WORKER TASKS TRANSFERS SEED TIMEOUT

ACCOUNTS names ``acct:0`` .. ``acct:<ACCOUNTS-1>``, whose balances are the keys
``test:{acct:<i>}:balance``. TASKS tasks each make TRANSFERS transfers: 2 or 3 accounts
drawn at random, in random order, locked together (waiting at most TIMEOUT seconds); read
every balance, yield to the loop, move a random amount from the first to the others (a
read-modify-write that loses money if anyone else wrote meanwhile). Every fifth round a
task also audits one account under a plain `RedisMutex` on its name: reads the balance,
yields, reads again, and prints ``violation`` if it changed. Prints ``done WORKER <n>``
with the number of transfers made; exits 0.
"""

from __future__ import annotations

import asyncio
import random
import sys
from typing import Any

from _lockworker import connect, emit, run

from aiolocks import RedisMultiLock, RedisMutex


def balance(name: str) -> str:
    return f"test:{{{name}}}:balance"


async def transfers(
    client: Any, accounts: list[str], rng: random.Random, count: int, timeout: float
) -> int:
    done = 0
    for round_ in range(count):
        names = rng.sample(accounts, rng.choice((2, 3)))
        async with RedisMultiLock(client, names, ttl=5, timeout=timeout):
            values = [int(await client.get(balance(name)) or 0) for name in names]
            await asyncio.sleep(0)  # another writer would interleave here
            amount = rng.randint(0, max(0, values[0]))
            shares = [amount // (len(names) - 1)] * (len(names) - 1)
            shares[0] += amount - sum(shares)
            new = [values[0] - amount, *(v + s for v, s in zip(values[1:], shares, strict=True))]
            for name, value in zip(names, new, strict=True):
                await client.set(balance(name), value)
        done += 1
        if round_ % 5 == 0:
            name = rng.choice(accounts)
            async with RedisMutex(client, name, ttl=5, timeout=timeout):
                before = await client.get(balance(name))
                await asyncio.sleep(0.001)
                if await client.get(balance(name)) != before:
                    emit("violation", name)
    return done


async def main(argv: list[str]) -> int:
    url, accounts = argv[0], [f"acct:{i}" for i in range(int(argv[1]))]
    worker, tasks, count = int(argv[2]), int(argv[3]), int(argv[4])
    seed, timeout = int(argv[5]), float(argv[6])
    client = connect(url)
    try:
        rngs = [random.Random(seed * 1000 + task) for task in range(tasks)]
        made = await asyncio.gather(
            *(transfers(client, accounts, rng, count, timeout) for rng in rngs)
        )
        emit("done", worker, sum(made))
        return 0
    finally:
        await client.aclose()


if __name__ == "__main__":
    sys.exit(run(main(sys.argv[1:]), 120))
