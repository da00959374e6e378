# Device check: the same greedy chat completion from a GPU worker and a CPU worker, then 8 at once on the GPU.
import json, subprocess, sys, time, urllib.request, concurrent.futures as cf
B = sys.argv[1]; model = sys.argv[2]
def start(port, device):
    p = subprocess.Popen([f"{B}/pdserve-server", "--port", str(port), "--device", device, "--model", model,
                          "--kv-blocks", "512", "--exit-on-stdin-eof"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t = time.time()
    while time.time() - t < 60:
        line = p.stdout.readline()
        if not line: break
        print(f"[{device}] {line.rstrip()}")
        if line.startswith("listening on"): return p
    raise SystemExit(f"{device} worker did not start")
def model_id(port):
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())["data"][0]["id"]
def chat(port, text, n=32):
    body = json.dumps({"model": model_id(port), "messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0}).encode()
    r = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"content-type": "application/json"}), timeout=60)
    return json.loads(r.read())
gpu = start(18080, "cuda"); cpu = start(18081, "cpu")
prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.", "Explain what a GPU is in one sentence."]
same = 0
for q in prompts:
    g = chat(18080, q); c = chat(18081, q)
    gt, ct = g["choices"][0]["message"]["content"], c["choices"][0]["message"]["content"]
    same += gt == ct
    print(json.dumps({"prompt": q, "gpu": gt, "cpu": ct, "equal": gt == ct, "gpu_timings": g.get("timings")}))
print(f"GPU text == CPU text on {same}/{len(prompts)} prompts (CPU uses f32 weights, GPU bf16)")
t = time.time()
with cf.ThreadPoolExecutor(16) as ex:
    outs = list(ex.map(lambda i: chat(18080, prompts[i % 4], 64), range(16)))
dt = time.time() - t
toks = sum(o["usage"]["completion_tokens"] for o in outs)
print(f"16 concurrent requests on the GPU worker: all 200, {toks} tokens in {dt:.2f} s ({toks/dt:.0f} tok/s through HTTP)")
print(urllib.request.urlopen("http://127.0.0.1:18080/health/ready", timeout=10).read().decode()[:200])
for p in (gpu, cpu): p.stdin.close(); p.wait(timeout=30)
print("SERVE PASS")
