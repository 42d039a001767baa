"""The attacks of `tests/gateway/attacks.rs`, as one script that prints a figure per attack,
so a gateway binary can be measured before and after a change (`docs/gateway/attacks.md`).

    cargo build --release -p fairgate-gateway
    python3 gateway/scripts/attacks.py target/release/fairgate-gateway

Pass `old` after the binary for a gateway without `--admin` (the example before it became
the `fairgate-gateway` program). Everything runs on loopback: a mock upstream in this
process (it reads paths as a lenient server does), the gateway as a child process (killed
at the end), the attackers as threads. Raises its own open-files limit for the 10,000
idle sockets. Takes about a minute.
"""
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BIN = sys.argv[1]
KIND = sys.argv[2] if len(sys.argv) > 2 else "new"
PREMIUM, GUEST = "sk-gw-premium-1", "sk-gw-guest-1"
MSG = b'{"id":"msg","type":"message","content":[]}'


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Mock(BaseHTTPRequestHandler):
    in_flight = 0
    max_in_flight = 0
    calls = 0
    lock = threading.Lock()
    delay = 0.0

    def log_message(self, *a):
        pass

    def norm(self):
        path = urllib.parse.unquote(self.path.split("?")[0])
        segs = []
        for s in path.split("/"):
            s = s.split(";")[0]
            if s in ("", "."):
                continue
            if s == "..":
                if segs:
                    segs.pop()
                continue
            segs.append(s)
        return "/" + "/".join(segs)

    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        with Mock.lock:
            Mock.calls += 1
            Mock.in_flight += 1
            Mock.max_in_flight = max(Mock.max_in_flight, Mock.in_flight)
        try:
            time.sleep(Mock.delay)
            body = MSG if self.norm() == "/v1/messages" else b'{"input_tokens":1}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        finally:
            with Mock.lock:
                Mock.in_flight -= 1

    do_GET = do_POST


mock = ThreadingHTTPServer(("127.0.0.1", 0), Mock)
threading.Thread(target=mock.serve_forever, daemon=True).start()
UP = f"http://127.0.0.1:{mock.server_address[1]}"

KEYS = f"""
[[keys]]
key = "{PREMIUM}"
tenant = "team-premium"
tier = "premium"

[[keys]]
key = "{GUEST}"
tenant = "team-guest"
tier = "guest"

[limits]
global_max = 30

[[tiers]]
name = "guest"
cap = 5
max_wait_ms = 8000
"""


def start(extra_keys=""):
    path = f"/tmp/attack-keys-{os.getpid()}.toml"
    open(path, "w").write(KEYS + extra_keys)
    port = free_port()
    args = [BIN, "--listen", f"127.0.0.1:{port}", "--upstream", UP, "--keys", path]
    admin = None
    if KIND == "new":
        admin = free_port()
        args += ["--admin", f"127.0.0.1:{admin}"]
    env = dict(os.environ, ANTHROPIC_API_KEY="sk-up", RUST_LOG="warn")
    p = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=open("/tmp/attack-gw.log", "w"))
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if p.poll() is not None:
                return p, port, admin
            time.sleep(0.05)
    return p, port, admin


def rss(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def request(port, raw, timeout=5.0, body=b""):
    s = socket.create_connection(("127.0.0.1", port), 5)
    s.settimeout(timeout)
    try:
        s.sendall(raw + body)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    finally:
        s.close()
    try:
        return int(data.split(b" ")[1]), data
    except Exception:
        return 0, data


def post(path, key, body=b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"Hello"}]}', method="POST"):
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode(), body


results = {}

# The attacks share one gateway process, in this order (D last but one: its idle sockets
# would slow the others; I last: it stops the gateway).

# A. 80 x 31 MiB bodies with made-up keys: peak RSS and 5 s after.
p, port, admin = start()
base = rss(p.pid)
peak = [base]
stop = threading.Event()


def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss(p.pid))
        time.sleep(0.01)


threading.Thread(target=sample, daemon=True).start()
SIZE = 31 << 20


def big(i):
    try:
        s = socket.create_connection(("127.0.0.1", port), 5)
        s.settimeout(10)
        s.sendall(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: sk-made-up-{i}\r\ncontent-length: {SIZE}\r\n\r\n".encode())
        chunk = b"a" * (1 << 20)
        for _ in range(31):
            s.sendall(chunk)
        s.recv(100)
        s.close()
    except OSError:
        pass


threads = [threading.Thread(target=big, args=(i,)) for i in range(80)]
for t in threads:
    t.start()
for t in threads:
    t.join()
stop.set()
time.sleep(5)
results["A_bad_key_80x31MiB"] = f"RSS before {base/1e6:.0f} MB, peak {peak[0]/1e6:.0f} MB, 5 s after {rss(p.pid)/1e6:.0f} MB"

# B. trickled head: how long is it kept open (max 15 s)?
def open_for(sender, limit=15.0):
    s = socket.create_connection(("127.0.0.1", port), 5)
    t0 = time.time()
    s.settimeout(0.2)
    for b in sender:
        try:
            s.sendall(b)
        except OSError:
            break
        try:
            if s.recv(100) == b"":
                break
        except socket.timeout:
            pass
        except OSError:
            break
        if time.time() - t0 > limit:
            break
    s.close()
    return time.time() - t0


def trickle():
    while True:
        yield b"X"
        time.sleep(0.8)


results["B_trickled_head_open_s"] = f"{open_for(trickle()):.1f} (capped at 15)"


def stall():
    head, _ = post("/v1/messages", PREMIUM)
    yield head.replace(b"content-length: ", b"content-length: 1000\r\nx-old-length: ") + b"0123456789"
    while True:
        yield b""
        time.sleep(0.5)


results["C_stalled_body_open_s"] = f"{open_for(stall()):.1f} (capped at 15)"

# F. /metrics on the API port.
st, data = request(port, b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
results["F_metrics_on_api_port"] = f"{st} ({'tenant names shown' if b'team-' in data else 'no tenant names'})"

# G. guesses per second from one client, 2 s.
t0 = time.time()
n = 0
codes = {}
while time.time() - t0 < 2:
    h, b = post("/v1/messages", f"sk-guess-{n}")
    st, _ = request(port, h, body=b)
    codes[st] = codes.get(st, 0) + 1
    n += 1
checked = codes.get(401, 0)
results["G_guesses"] = f"{n/2:.0f} requests/s, {checked/2:.0f} keys checked/s ({codes})"

# H. 200 MB with a valid key.
def huge():
    s = socket.create_connection(("127.0.0.1", port), 5)
    s.settimeout(10)
    size = 200_000_000
    try:
        s.sendall(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: {PREMIUM}\r\ncontent-length: {size}\r\n\r\n".encode())
        chunk = b"a" * (1 << 20)
        sent = 0
        while sent < size:
            s.sendall(chunk[: min(len(chunk), size - sent)])
            sent += len(chunk)
        data = s.recv(200)
        return data.split(b"\r\n")[0].decode()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        s.close()


results["H_200MB_valid_key"] = huge()

# E. path spellings, guest cap 5, mock normalising, 8 spellings x 5.
Mock.delay = 0.5
Mock.max_in_flight = 0
Mock.calls = 0
spellings = ["/v1/messages", "/v1/messages/", "/v1//messages", "/v1/./messages", "/v1/messages;x", "/v1/%6Dessages", "//v1/messages", "/v1/x/../messages"]
out = []


def spell(path):
    h, b = post(path, GUEST)
    out.append((path, request(port, h, timeout=20, body=b)[0]))


threads = [threading.Thread(target=spell, args=(sp,)) for sp in spellings for _ in range(5)]
for t in threads:
    t.start()
for t in threads:
    t.join()
refused = sum(1 for _, s in out if s in (400, 404))
results["E_spellings"] = f"40 guest calls, cap 5: upstream saw {Mock.max_in_flight} at once, {Mock.calls} calls; gateway refused {refused}"
dots = []
Mock.calls = 0
for path in ["/v1/../../x", "/v1/%2e%2e/x"]:
    st, _ = request(port, f"GET {path} HTTP/1.1\r\nhost: x\r\nx-api-key: {PREMIUM}\r\nconnection: close\r\n\r\n".encode())
    dots.append(st)
results["E_dot_segments"] = f"statuses {dots}, forwarded {Mock.calls}"
Mock.delay = 0

# D. 10,000 idle connections, then a call.
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
idle = []
t0 = time.time()
for i in range(10_000):
    try:
        idle.append(socket.create_connection(("127.0.0.1", port), 5))
    except OSError:
        break
opened = time.time() - t0
time.sleep(0.5)
t0 = time.time()
h, b = post("/v1/messages", PREMIUM)
try:
    st, _ = request(port, h, timeout=10, body=b)
except OSError as e:
    st = str(e)
took = time.time() - t0
fds = len(os.listdir(f"/proc/{p.pid}/fd"))
results["D_10k_idle"] = f"{len(idle)} idle opened in {opened:.1f} s; a call: {st} in {took*1000:.0f} ms; gateway fds {fds}, RSS {rss(p.pid)/1e6:.0f} MB"
for s in idle:
    s.close()
time.sleep(1)

# I. SIGTERM with a half-sent request.
half = socket.create_connection(("127.0.0.1", port), 5)
half.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: " + PREMIUM.encode() + b"\r\ncontent-length: 1000\r\n\r\n0123456789")
time.sleep(0.2)
t0 = time.time()
p.send_signal(signal.SIGTERM)
try:
    p.wait(40)
    results["I_sigterm_half_sent_exit_s"] = f"{time.time()-t0:.2f}"
except subprocess.TimeoutExpired:
    results["I_sigterm_half_sent_exit_s"] = "> 40"
    p.kill()
half.close()

# J. bad keys files: refused at start, or accepted?
configs = {
    "window = 0": KEYS.replace("global_max = 30", "global_max = 30\nwindow = 0"),
    "duplicate tiers": KEYS + '\n[[tiers]]\nname = "guest"\ncap = 3\nmax_wait_ms = 100\n',
    "retry_after_ms = 18446744073709551": KEYS.replace("global_max = 30", "global_max = 30\nretry_after_ms = 18446744073709551"),
    "non-ASCII key": KEYS.replace(PREMIUM, "sk-\u00e9t\u00e9"),
    "NUL key": KEYS.replace(f'"{PREMIUM}"', '"sk-nul\\u0000x"'),
    "numeric key": KEYS.replace(f'"{PREMIUM}"', "987654321012"),
}
for name, text in configs.items():
    path = f"/tmp/attack-cfg-{os.getpid()}.toml"
    open(path, "w").write(text)
    port2 = free_port()
    args = [BIN, "--listen", f"127.0.0.1:{port2}", "--upstream", UP, "--keys", path]
    if KIND == "new":
        args += ["--admin", f"127.0.0.1:{free_port()}"]
    q = subprocess.Popen(args, env=dict(os.environ, ANTHROPIC_API_KEY="x"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = q.communicate(timeout=2)
        msg = err.decode().strip().splitlines()[-1]
        results[f"J_config {name}"] = f"refused: {msg[-110:]}" + (" [KEY ECHOED]" if "987654321012" in msg else "")
    except subprocess.TimeoutExpired:
        q.kill()
        q.communicate()
        results[f"J_config {name}"] = "accepted (started)"

for k, v in results.items():
    print(f"{k}: {v}")
