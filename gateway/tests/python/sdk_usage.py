"""The usage the official Anthropic Python SDK reads from its answers through the gateway.

Run by `tests/gateway/usage.rs` (`the_sdks_usage_is_what_usage_bills`) with:
  GATEWAY_URL     the gateway, e.g. http://127.0.0.1:PORT
  API_KEY         a client key of the gateway's keys file

Makes two messages.create calls and one messages.stream call, then prints one JSON line:
the input and output tokens the SDK's `usage` objects said, summed, and the calls made.

The client is the SDK at its defaults, as an application builds it: retries on, and its
HTTP client's own `Accept-Encoding: gzip, deflate` (so the mock upstream compresses, as the
API does, and the gateway must read the usage of compressed answers).
"""

import json
import os

import anthropic

client = anthropic.Anthropic(
    base_url=os.environ["GATEWAY_URL"],
    api_key=os.environ["API_KEY"],
)
request = dict(
    model="claude-mock-1",
    max_tokens=64,
    messages=[{"role": "user", "content": "Hello"}],
)

usages = []
for _ in range(2):
    usages.append(client.messages.create(**request).usage)
with client.messages.stream(**request) as stream:
    usages.append(stream.get_final_message().usage)

print(
    json.dumps(
        {
            "input_tokens": sum(u.input_tokens for u in usages),
            "output_tokens": sum(u.output_tokens for u in usages),
            "calls": len(usages),
        }
    ),
    flush=True,
)
