"""The official Anthropic Python SDK, served by Claude on Amazon Bedrock through fairgate's
Bedrock layer.

Makes a message, a stream, a token count and a throttled call.

Run by `tests/gateway/bedrock.rs` (`the_anthropic_python_sdk_is_served_by_bedrock`) with:
  GATEWAY_URL   a server that sends every call through the layer to a Bedrock mock

Prints one line per check and `N passed, M failed`.
"""

import os

import anthropic

client = anthropic.Anthropic(
    base_url=os.environ["GATEWAY_URL"],
    api_key="sk-ant-stays-behind",
    timeout=20.0,
    max_retries=0,
)
request = dict(model="claude-sonnet-4-5", max_tokens=64)
passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"))
    if ok:
        passed += 1
    else:
        failed += 1


message = client.messages.create(messages=[{"role": "user", "content": "Hi"}], **request)
check("a message", message.content[0].text == "Hello from Bedrock.", message)

with client.messages.stream(messages=[{"role": "user", "content": "Hi"}], **request) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
check(
    "a stream",
    text == "Hello from Bedrock." and final.stop_reason == "end_turn",
    (text, final),
)

count = client.messages.count_tokens(
    model="claude-sonnet-4-5", messages=[{"role": "user", "content": "Hi"}]
)
check("counted", count.input_tokens == 42, count)

try:
    client.messages.create(messages=[{"role": "user", "content": "throttle me"}], **request)
    check("throttled", False, "no error")
except anthropic.RateLimitError as e:
    check("throttled", e.status_code == 429 and e.body["error"]["type"] == "rate_limit_error", e)

print(f"{passed} passed, {failed} failed")
