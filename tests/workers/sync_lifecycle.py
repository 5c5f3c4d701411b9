"""A process of tests/test_sync_processes.py: how a sync user's process waits, exits and
forks. `python sync_lifecycle.py MODE URL NAME`:

    wait   wait for the mutex in the main thread (prints `waiting`); Ctrl-C (SIGINT) ends
           the wait: prints `interrupted`, exits 0 at the end of its stdin
    exit   acquire in the main thread and in another thread, print `held`, and end without
           releasing either (the interpreter's exit releases them)
    fork   hold the mutex, fork (as Celery's prefork pool does after import), and in the
           child: not held there, busy for it, then take another name with a 0.5 s ttl for
           1.5 s (renewed by the child's own loop) and release it; prints `child ok FENCE`
"""

from __future__ import annotations

import os
import sys
import threading

import redis

from aiolocks.sync import RedisMutex


def emit(*fields: object) -> None:
    print(" ".join(str(field) for field in fields), flush=True)


def main() -> None:
    mode, url, name = sys.argv[1:4]
    client = redis.Redis.from_url(url)
    mutex = RedisMutex(client, name, local_handoff=0)
    if mode == "wait":
        emit("waiting")
        try:
            mutex.acquire()
        except KeyboardInterrupt:
            emit("interrupted")
            sys.stdin.readline()  # the test looks at the queue while this process lives
            return
        emit("acquired")
    elif mode == "exit":
        mutex_b = RedisMutex(client, name + "-b")
        taken = threading.Event()

        def hold() -> None:
            mutex_b.acquire()
            taken.set()

        threading.Thread(target=hold).start()
        mutex.acquire()
        taken.wait(10)
        emit("held", mutex.fencing_token)
    elif mode == "fork":
        mutex.acquire()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(client, mutex, name)
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        mutex.release()
        emit("parent ok", os.waitstatus_to_exitcode(status))


def _child(client: redis.Redis, inherited: RedisMutex, name: str) -> int:
    assert not inherited.held(), "the parent's holding is not the child's"
    assert not inherited.acquire(blocking=False), "the parent holds it"
    other = RedisMutex(client, name + "-child", ttl=0.5)
    with other:
        assert not other.lost.wait(1.5), "renewed by the child's own loop"
        fence = other.fencing_token
    emit("child ok", fence)
    return 0


if __name__ == "__main__":
    main()
