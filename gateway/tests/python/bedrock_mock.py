"""A mock of Claude on Amazon Bedrock's runtime that checks every request's signature with
botocore, the AWS SDK for Python.

Run by `tests/gateway/bedrock.rs` with:
  MOCK_ACCESS_KEY, MOCK_SECRET_KEY, MOCK_SESSION_TOKEN   the credentials callers must sign with
  MOCK_REGION                                            the region they must sign for

Prints `PORT <n>` once listening on 127.0.0.1. Each request's Authorization header is
recomputed with botocore's own `SigV4Auth` over the received method, path, signed headers and
timestamp, with the mock's credentials, and compared; `x-amz-content-sha256` must be the
body's SHA-256 and the session token must be the mock's. Any mismatch is answered 403, as
Bedrock does (`InvalidSignatureException` or `UnrecognizedClientException`).

Routes:
  POST /model/{id}/invoke                       a JSON message
  POST /model/{id}/invoke-with-response-stream  the same message as AWS event stream frames,
                                                sent in 7-byte pieces so frames split
  POST /model/{id}/count-tokens                 {"inputTokens": 42} for a well-formed
                                                {"input":{"invokeModel":{"body":<base64>}}}
  GET  /requests                                 what was received, as JSON (for the test)
A user message "throttle me" is answered 429 ThrottlingException; "break the stream" gets a
stream with a throttlingException exception event after the first text delta.
"""

import base64
import hashlib
import hmac
import json
import os
import re
import struct
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer

ACCESS_KEY = os.environ["MOCK_ACCESS_KEY"]
SECRET_KEY = os.environ["MOCK_SECRET_KEY"]
SESSION_TOKEN = os.environ.get("MOCK_SESSION_TOKEN") or None
REGION = os.environ["MOCK_REGION"]
TEXT = ["Hello", " from", " Bedrock", "."]
RECEIVED = []
LOCK = threading.Lock()

AUTH_RE = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, "
    r"SignedHeaders=([a-z0-9;-]+), Signature=([0-9a-f]{64})$"
)


def signature_problem(method, path, headers, body):
    """None when the request is signed right, else (exception type, message)."""
    auth = headers.get("authorization", "")
    match = AUTH_RE.match(auth)
    if not match:
        return ("IncompleteSignatureException", "Authorization header is malformed")
    key, _date, region, service, signed, _sig = match.groups()
    if key != ACCESS_KEY:
        return ("UnrecognizedClientException", "The security token included in the request is invalid.")
    if region != REGION or service != "bedrock":
        return ("InvalidSignatureException", f"Credential should be scoped to {REGION}/bedrock")
    names = signed.split(";")
    for required in ("host", "x-amz-date", "x-amz-content-sha256"):
        if required not in names:
            return ("InvalidSignatureException", f"{required} is not signed")
    if SESSION_TOKEN is not None and (
        "x-amz-security-token" not in names
        or headers.get("x-amz-security-token") != SESSION_TOKEN
    ):
        return ("UnrecognizedClientException", "The security token included in the request is invalid.")
    if headers.get("x-amz-content-sha256") != hashlib.sha256(body).hexdigest():
        return ("InvalidSignatureException", "x-amz-content-sha256 is not the body's hash")
    stamp = headers.get("x-amz-date", "")
    try:
        when = time.mktime(time.strptime(stamp, "%Y%m%dT%H%M%SZ")) - time.timezone
    except ValueError:
        return ("InvalidSignatureException", "bad x-amz-date")
    if abs(when - time.time()) > 300:
        return ("InvalidSignatureException", "Signature expired")
    # botocore recomputes the signature over what it would have signed itself.
    request = AWSRequest(
        method=method,
        url=f"http://{headers.get('host', '')}{path}",
        headers={name: headers.get(name, "") for name in names},
        data=body,
    )
    request.context["timestamp"] = stamp
    signer = SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY, SESSION_TOKEN), "bedrock", REGION)
    canonical = signer.canonical_request(request)
    string_to_sign = signer.string_to_sign(request, canonical)
    signature = signer.signature(string_to_sign, request)
    expected = (
        f"AWS4-HMAC-SHA256 Credential={signer.scope(request)}, "
        f"SignedHeaders={signer.signed_headers(signer.headers_to_sign(request))}, "
        f"Signature={signature}"
    )
    if not hmac.compare_digest(expected, auth):
        print(f"signature mismatch; botocore's canonical request:\n{canonical}", file=sys.stderr)
        return (
            "InvalidSignatureException",
            "The request signature we calculated does not match the signature you provided.",
        )
    return None


def frame(headers, payload):
    """One AWS event stream message with string headers, checksums by zlib."""
    block = b""
    for name, value in headers.items():
        name, value = name.encode(), value.encode()
        block += struct.pack(">B", len(name)) + name + b"\x07" + struct.pack(">H", len(value)) + value
    prelude = struct.pack(">II", 16 + len(block) + len(payload), len(block))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + block + payload
    return message + struct.pack(">I", zlib.crc32(message))


def chunk(event):
    data = base64.b64encode(json.dumps(event).encode()).decode()
    payload = json.dumps({"bytes": data, "p": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"}).encode()
    return frame(
        {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"},
        payload,
    )


def message(model):
    return {
        "id": "msg_bdrk_01mock",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": "".join(TEXT)}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": len(TEXT)},
    }


def stream_frames(model, broken):
    start = dict(message(model), content=[], stop_reason=None)
    start["usage"] = {"input_tokens": 12, "output_tokens": 1}
    frames = [
        chunk({"type": "message_start", "message": start}),
        chunk({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ]
    for i, piece in enumerate(TEXT):
        frames.append(chunk({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}))
        if broken and i == 0:
            frames.append(frame(
                {":exception-type": "throttlingException", ":content-type": "application/json", ":message-type": "exception"},
                json.dumps({"message": "Too many tokens, please wait before trying again."}).encode(),
            ))
            return frames
    frames += [
        chunk({"type": "content_block_stop", "index": 0}),
        chunk({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": len(TEXT)}}),
        chunk({"type": "message_stop", "amazon-bedrock-invocationMetrics": {"inputTokenCount": 12, "outputTokenCount": 4, "invocationLatency": 10, "firstByteLatency": 5}}),
    ]
    return frames


def self_check():
    """The frames are real: botocore's own event stream decoder reads them back."""
    buffer = EventStreamBuffer()
    frames = stream_frames("m", broken=False)
    buffer.add_data(b"".join(frames))
    decoded = list(buffer)
    assert len(decoded) == len(frames), decoded
    first = json.loads(base64.b64decode(json.loads(decoded[0].payload)["bytes"]))
    assert first["type"] == "message_start", first


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_json(self, status, body, error_type=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("x-amzn-requestid", "mock-request-1")
        if error_type:
            self.send_header("x-amzn-errortype", f"{error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/requests":
            with LOCK:
                self.send_json(200, RECEIVED)
        else:
            self.send_json(404, {"message": "not found"}, "ResourceNotFoundException")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        headers = {k.lower(): v for k, v in self.headers.items()}
        problem = signature_problem("POST", self.path, headers, body)
        with LOCK:
            RECEIVED.append({
                "path": self.path,
                "headers": headers,
                "body": body.decode("utf-8", "replace"),
                "status": 403 if problem else 200,
            })
        if problem:
            return self.send_json(403, {"message": problem[1]}, problem[0])
        route = re.match(r"^/model/([^/]+)/(invoke|invoke-with-response-stream|count-tokens)$", self.path)
        if not route:
            return self.send_json(404, {"message": "unknown operation"}, "UnknownOperationException")
        model = unquote(route.group(1))
        request = json.loads(body)
        if route.group(2) == "count-tokens":
            try:
                request = json.loads(base64.b64decode(request["input"]["invokeModel"]["body"], validate=True))
            except (KeyError, TypeError, ValueError):
                return self.send_json(400, {"message": "Malformed input request"}, "ValidationException")
        if "model" in request or "stream" in request or request.get("anthropic_version") != "bedrock-2023-05-31":
            return self.send_json(400, {"message": "Malformed input request"}, "ValidationException")
        said = json.dumps(request.get("messages", []))
        if "throttle me" in said:
            return self.send_json(429, {"message": "Too many requests, please wait before trying again."}, "ThrottlingException")
        if route.group(2) == "count-tokens":
            if "max_tokens" not in request or model.startswith(("us.", "eu.", "global.")):
                return self.send_json(400, {"message": "The provided model doesn't support counting tokens"}, "ValidationException")
            return self.send_json(200, {"inputTokens": 42})
        if route.group(2) == "invoke":
            return self.send_json(200, message(model))
        self.send_stream(b"".join(stream_frames(model, "break the stream" in said)))

    def send_stream(self, data):
        self.send_response(200)
        self.send_header("content-type", "application/vnd.amazon.eventstream")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("x-amzn-requestid", "mock-request-2")
        self.end_headers()
        for at in range(0, len(data), 7):
            piece = data[at:at + 7]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main():
    self_check()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
