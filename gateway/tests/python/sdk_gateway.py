"""The official Anthropic Python SDK against the fairgate gateway (the mock upstream behind it).

Run by `tests/gateway/proxy.rs` (`python_sdk_against_the_gateway`) with:
  GATEWAY_URL     the gateway, e.g. http://127.0.0.1:PORT
  PREMIUM_KEY     a premium client key of the gateway's keys file
  GUEST_KEY       a guest client key (guest: 1 slot, a short max wait, a short retry-after,
                  its refusals retried)
  FREE_KEY        a free client key (free: 1 slot, 100 ms of wait, its refusals final)
  STREAM_TEXT     the text the mock streams
  MESSAGE_TEXT    the text of the mock's non-streaming answer

Prints one line per check and `N passed, 0 failed` at the end; exits non-zero on the first
failure. Bounded: every client has a timeout, the flood is a few calls.
"""

import asyncio
import os
import sys
import threading
import time

import anthropic

URL = os.environ["GATEWAY_URL"]
PREMIUM = os.environ["PREMIUM_KEY"]
GUEST = os.environ["GUEST_KEY"]
FREE = os.environ["FREE_KEY"]
STREAM_TEXT = os.environ["STREAM_TEXT"]
MESSAGE_TEXT = os.environ["MESSAGE_TEXT"]

passed = 0


def check(name, ok, detail=""):
    global passed
    if not ok:
        print(f"FAIL {name}: {detail}", flush=True)
        sys.exit(1)
    passed += 1
    print(f"ok {name}", flush=True)


def ask(client, **extra):
    return client.messages.create(
        model="claude-mock-1",
        max_tokens=64,
        messages=[{"role": "user", "content": "Hello"}],
        **extra,
    )


# messages.create, with x-api-key (the SDK's default) and with Authorization: Bearer.
client = anthropic.Anthropic(base_url=URL, api_key=PREMIUM, timeout=20.0, max_retries=0)
message = ask(client)
check("messages.create", message.content[0].text == MESSAGE_TEXT, repr(message))
check("usage", message.usage.input_tokens == 12 and message.usage.output_tokens == 7)

bearer = anthropic.Anthropic(base_url=URL, auth_token=PREMIUM, timeout=20.0, max_retries=0)
check("messages.create with a bearer token", ask(bearer).content[0].text == MESSAGE_TEXT)

raw = client.messages.with_raw_response.create(
    model="claude-mock-1", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
)
check(
    "request-id passes through",
    (raw.headers.get("request-id") or "").startswith("req_mock_"),
    dict(raw.headers),
)
check("with_raw_response reads x-fairgate-class", raw.headers.get("x-fairgate-class") == "critical")
check("raw.parse", raw.parse().content[0].text == MESSAGE_TEXT)


# The async client, as docs/python.md shows it: the call and the parse both awaited.
async def async_raw():
    aclient = anthropic.AsyncAnthropic(base_url=URL, api_key=PREMIUM, timeout=20.0, max_retries=0)
    raw = await aclient.messages.with_raw_response.create(
        model="claude-mock-1", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
    )
    return raw.headers.get("x-fairgate-budget-remaining"), await raw.parse()


left, parsed = asyncio.run(async_raw())
check("async with_raw_response reads the budget left", (left or "").isdigit(), repr(left))
check("async raw.parse", parsed.content[0].text == MESSAGE_TEXT, repr(parsed))

# messages.stream: the SDK assembles the events the gateway forwarded.
deltas = []
with client.messages.stream(
    model="claude-mock-1", max_tokens=64, messages=[{"role": "user", "content": "Hello"}]
) as stream:
    for text in stream.text_stream:
        deltas.append(text)
    final = stream.get_final_message()
check("messages.stream deltas", "".join(deltas) == STREAM_TEXT, repr(deltas))
check("messages.stream final message", final.content[0].text == STREAM_TEXT, repr(final))
check("messages.stream stop reason", final.stop_reason == "end_turn", repr(final))

# A stream its upstream cuts mid-way ends with the API's error event: the SDK at its
# defaults (retries on, gzip accepted) raises an API error, not a connection error.
sdk_default = anthropic.Anthropic(base_url=URL, api_key=PREMIUM)
try:
    with sdk_default.messages.stream(
        model="claude-mock-1",
        max_tokens=64,
        messages=[{"role": "user", "content": "Hello"}],
        extra_headers={"x-mock-reply": "stream-cut"},
    ) as stream:
        for _ in stream.text_stream:
            pass
    check("a cut stream raises", False, "it ended as if whole")
except anthropic.APIConnectionError as e:
    check("a cut stream raises an API error", False, repr(e))
except anthropic.APIStatusError as e:
    check("a cut stream raises an API error", e.body["error"]["type"] == "api_error", repr(e.body))

# Other /v1 paths are forwarded.
count = client.messages.count_tokens(
    model="claude-mock-1", messages=[{"role": "user", "content": "Hello"}]
)
check("messages.count_tokens", count.input_tokens == 12, repr(count))

# Message batches: the SDK fetches `results_url` itself, with the client's key, so it must
# name the gateway (`--public-url`), which answers only the key that created the batch.
def batch_request(custom_id):
    return {
        "custom_id": custom_id,
        "params": {
            "model": "claude-mock-1",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "Hello"}],
        },
    }


batch = client.messages.batches.create(requests=[batch_request("one"), batch_request("two")])
check("batches.create", batch.id.startswith("msgbatch_"), repr(batch))
check(
    "results_url names the gateway",
    batch.results_url == f"{URL}/v1/messages/batches/{batch.id}/results",
    repr(batch.results_url),
)
got = client.messages.batches.retrieve(batch.id)
check("batches.retrieve", got.id == batch.id and got.processing_status == "ended", repr(got))
# workspace_id: the SDK sends anthropic-workspace-id, which the gateway drops.
results = list(client.messages.batches.results(batch.id, workspace_id="wrkspc_someone_else"))
check(
    "batches.results",
    sorted(r.custom_id for r in results) == ["one", "two"]
    and all(r.result.type == "succeeded" for r in results),
    repr(results),
)
check("batches.results messages", results[0].result.message.content[0].text == MESSAGE_TEXT)
second = client.messages.batches.create(requests=[batch_request("three")])
listed = [b.id for b in client.messages.batches.list(limit=1)]
check("batches.list pages (auto-paging, one a page)", listed == [second.id, batch.id], repr(listed))

guest_client = anthropic.Anthropic(base_url=URL, api_key=GUEST, timeout=20.0, max_retries=0)
for name, attempt in [
    ("retrieve", lambda: guest_client.messages.batches.retrieve(batch.id)),
    ("results", lambda: list(guest_client.messages.batches.results(batch.id))),
    ("cancel", lambda: guest_client.messages.batches.cancel(batch.id)),
    ("delete", lambda: guest_client.messages.batches.delete(batch.id)),
]:
    try:
        attempt()
        check(f"another key's batches.{name} refused", False, "no error")
    except anthropic.NotFoundError as e:
        check(f"another key's batches.{name} refused", e.status_code == 404, repr(e))
check("another key lists none", list(guest_client.messages.batches.list()) == [])
deleted = client.messages.batches.delete(batch.id)
check("batches.delete", deleted.id == batch.id, repr(deleted))

# A bad key: the SDK's authentication error.
try:
    anthropic.Anthropic(base_url=URL, api_key="sk-nobody", max_retries=0).messages.create(
        model="claude-mock-1", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    )
    check("unknown key refused", False, "no error")
except anthropic.AuthenticationError as e:
    check("unknown key refused", e.status_code == 401, repr(e))


# A flood from the guest key: the gateway answers 529 with retry-after to the calls past the
# guest's one slot; with retries the SDK waits as told and every call succeeds.
def flood(n, max_retries, key=GUEST):
    results = [None] * n
    if max_retries is None:
        # The SDK at its defaults (2 retries).
        guest = anthropic.Anthropic(base_url=URL, api_key=key)
    else:
        guest = anthropic.Anthropic(
            base_url=URL, api_key=key, timeout=30.0, max_retries=max_retries
        )

    def one(i):
        try:
            results[i] = ask(guest)
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


started = time.monotonic()
results = flood(5, max_retries=10)
errors = [r for r in results if not isinstance(r, anthropic.types.Message)]
check("a guest flood succeeds through the SDK's retries", not errors, repr(errors))
print(f"  flood of 5 took {time.monotonic() - started:.2f}s", flush=True)

# Without retries some of the flood is refused, as the SDK's overloaded error (529) carrying
# the gateway's message.
results = flood(5, max_retries=0)
refused = [r for r in results if isinstance(r, anthropic.APIStatusError)]
check("without retries a flood is refused", len(refused) >= 1, repr(results))
overloaded_class = getattr(anthropic, "OverloadedError", anthropic.InternalServerError)
for e in refused:
    check("refused as overloaded (529)", e.status_code == 529, repr(e))
    check("the SDK's overloaded error", isinstance(e, overloaded_class), type(e).__name__)
    body = e.body if isinstance(e.body, dict) else {}
    error = body.get("error", {})
    check("an overloaded_error body", error.get("type") == "overloaded_error", repr(e.body))
    check("the gateway's message", "server busy" in error.get("message", ""), repr(e.body))
    check("retry-after given", e.response.headers.get("retry-after") is not None)
    break
others = [r for r in results if not isinstance(r, (anthropic.types.Message, anthropic.APIStatusError))]
check("no other failure", not others, repr(others))

# A flood on the free tier, whose refusals are final: the SDK at its defaults does not
# retry them (x-should-retry: false), so its user is told at once; the body has the
# write-up's fields and the request_id of the answer's header.
results = flood(5, max_retries=None, key=FREE)
refused = [r for r in results if isinstance(r, anthropic.APIStatusError)]
check("a free flood is refused in part", len(refused) >= 1, repr(results))
for e in refused:
    check("refused as overloaded (529)", e.status_code == 529, repr(e))
    check("told not to retry", e.response.headers.get("x-should-retry") == "false")
    body = e.body if isinstance(e.body, dict) else {}
    check("SERVER_BUSY beside the error", body.get("code") == "SERVER_BUSY", repr(body))
    check("retry_after in the body", isinstance(body.get("retry_after"), int), repr(body))
    check(
        "the request_id of the answer",
        body.get("request_id") == e.response.headers.get("request-id"),
        repr(body),
    )
    break
print(f"free refused {len(refused)}", flush=True)

print(f"{passed} passed, 0 failed", flush=True)
