# Device check: one GPU worker (`pdserve-server --device cuda`) under N concurrent streaming chat
# completions; every request must end (completed or an explicit error) within its deadline.
#   python3 serve_load.py BIN_DIR MODEL_DIR STREAMS[,STREAMS...] MAX_TOKENS
# Prints, per concurrency: completed / errors / hung, output tokens/s through HTTP, TTFT p50, and
# the worker's count of steps that returned picks only.
import concurrent.futures as cf
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

B, MODEL, STREAMS, MAX_TOKENS = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4])
PORT = 18090
proc = subprocess.Popen(
    [f"{B}/pdserve-server", "--port", str(PORT), "--device", os.environ.get("DEVICE", "cuda"), "--model", MODEL,
     "--kv-blocks", os.environ.get("KV_BLOCKS", "8192"),
     "--exit-on-stdin-eof"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
start = time.time()
while True:
    line = proc.stdout.readline()
    if not line or time.time() - start > 120:
        raise SystemExit("the GPU worker did not start")
    print(f"[worker] {line.rstrip()}")
    if line.startswith("listening on"):
        break
log = []
threading.Thread(target=lambda: [log.append(l) for l in proc.stdout], daemon=True).start()


def get(path):
    c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, r.read().decode()


model_id = json.loads(get("/v1/models")[1])["data"][0]["id"]


def one(i, tag):
    """(outcome, output tokens, TTFT s): outcome is completed, error or hung."""
    body = json.dumps({"model": model_id, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "temperature": 0, "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": f"Request {tag}-{i}: tell me a long story."}]})
    t0 = time.time()
    ttft, tokens = None, 0
    try:
        c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return "error", 0, None
        finished = False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                return "error", tokens, ttft
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                if ch.get("delta", {}).get("content") and ttft is None:
                    ttft = time.time() - t0
                finished |= ch.get("finish_reason") is not None
        return ("completed" if finished else "error"), tokens, ttft
    except (TimeoutError, OSError):
        return "hung", tokens, ttft


ok = True
for n in STREAMS:
    t = time.time()
    with cf.ThreadPoolExecutor(n) as ex:
        res = list(ex.map(lambda i: one(i, f"{n}x{t:.0f}"), range(n)))
    dt = time.time() - t
    count = {k: sum(r[0] == k for r in res) for k in ("completed", "error", "hung")}
    toks = sum(r[1] for r in res)
    ttfts = [r[2] for r in res if r[2] is not None]
    print(f"{n} concurrent streams x {MAX_TOKENS} tokens: {count}, {toks} output tokens in {dt:.2f} s = "
          f"{toks / dt:.0f} tok/s through HTTP; TTFT p50 {statistics.median(ttfts) * 1e3 if ttfts else 0:.0f} ms")
    ok &= count["completed"] == n
metrics = get("/metrics")[1]
for l in metrics.splitlines():
    if l.startswith(("engine_greedy_pick_steps_total", "engine_step_seconds_count", "tokens_generated_total")):
        print(l)
print("ready:", get("/health/ready"))
print("in flight after the runs:", get("/debug/requests")[1][:300])
proc.stdin.close()
proc.wait(timeout=30)
print("SERVE PASS" if ok else "SERVE FAIL")
