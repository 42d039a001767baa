"""The second write-up's setup through the gateway, with the official Anthropic Python SDK.

A FastAPI-style backend with 8 worker processes shares one service key; 200 free users
flood, 5 premium users chat (one call after another). Run by `tests/gateway/users.rs`
(`python_sdk_backend_with_many_users`) with:
  GATEWAY_URL     the gateway, e.g. http://127.0.0.1:PORT
  SERVICE_KEY     a `users = true` key that may claim `premium`
  SECONDS         how long the flood lasts (the premium users chat inside it)
  FREE_MAX_WAIT   the free tier's max wait, in seconds

Prints one JSON line with what it saw: premium latencies, free statuses and waits.
Bounded: every client has a timeout, every thread ends with the flood.
"""

import json
import multiprocessing
import os
import threading
import time

import anthropic

URL = os.environ["GATEWAY_URL"]
KEY = os.environ["SERVICE_KEY"]
SECONDS = float(os.environ["SECONDS"])
PROCESSES = 8
FREE_USERS = 200
PREMIUM_USERS = 5


def ask(client, user, tier=None):
    extra = {"x-fairgate-tier": tier} if tier else {}
    return client.messages.with_raw_response.create(
        model="claude-mock-1",
        max_tokens=64,
        messages=[{"role": "user", "content": "Hello"}],
        metadata={"user_id": user},
        extra_headers=extra,
    )


def new_client():
    return anthropic.Anthropic(base_url=URL, api_key=KEY, timeout=60.0, max_retries=0)


def free_user(client, user, until, out):
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            ask(client, user)
            out.append(("ok", time.monotonic() - started, None))
        except anthropic.APIStatusError as e:
            retry_after = e.response.headers.get("retry-after")
            out.append((e.status_code, time.monotonic() - started, retry_after))
            # The SDK's own retry would wait this long; the flood keeps coming at once.
        except anthropic.APIConnectionError as e:
            out.append(("connection", time.monotonic() - started, str(e)))


def premium_user(client, user, start, until, out):
    time.sleep(max(0.0, start - time.monotonic()))
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            raw = ask(client, user, tier="premium")
            took = time.monotonic() - started
            queued_ms = int(raw.headers.get("x-fairgate-queued-ms", "-1"))
            out.append(("ok", took, raw.headers.get("x-fairgate-tier"), queued_ms))
        except anthropic.APIStatusError as e:
            out.append((e.status_code, time.monotonic() - started, None))


def worker(index, ready, queue):
    # This worker's share of the users: 25 free users, and premium user `index` (of 5).
    free, premium = [], []
    users = [(free_user, f"free-{u}") for u in range(index, FREE_USERS, PROCESSES)]
    if index < PREMIUM_USERS:
        users.append((premium_user, f"premium-{index}"))
    # A backend's workers are up before its peak: every client is made (about 40 ms of CPU
    # each) before any process sends, so that what is measured is the peak, not 200 clients
    # being built on two cores.
    clients = [new_client() for _ in users]
    ready.wait(timeout=60)
    now = time.monotonic()
    until = now + SECONDS
    threads = []
    for (run, user), made in zip(users, clients):
        if run is premium_user:
            # Chats start once the flood has filled the free tier.
            args = (made, user, now + 2.0, until, premium)
        else:
            args = (made, user, until, free)
        threads.append(threading.Thread(target=run, args=args))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    queue.put({"free": free, "premium": premium})


if __name__ == "__main__":
    queue = multiprocessing.Queue()
    ready = multiprocessing.Barrier(PROCESSES)
    processes = [
        multiprocessing.Process(target=worker, args=(i, ready, queue)) for i in range(PROCESSES)
    ]
    for p in processes:
        p.start()
    results = [queue.get(timeout=SECONDS + 120) for _ in processes]
    for p in processes:
        p.join(timeout=30)
    free = [r for result in results for r in result["free"]]
    premium = [r for result in results for r in result["premium"]]
    print(json.dumps({"free": free, "premium": premium}), flush=True)
