"""Diagnostic: LayerNorm over the last dim of ConvNeXt-T's rows on the GPU, PyTorch's kernel against compositions of
torch ops (the affine left out: it folds into the linear layer after it) and torch.compile's kernel.

    python3 bench/benchmarks/layernorm_probe.py        # JSON to $OUT/ln_probe.json (default /tmp)

Rows are ConvNeXt-T's at batch 32 and 224 x 224: stage s (0..3) has 32 * (56 / 2^s)^2 rows of 96 * 2^s channels.
Each variant runs 10 times per CUDA graph replay; the time is the median of 7 rounds of 20 replays, per call.
max_err: the largest difference from a float64 LayerNorm of the same fp16 input (rows with means around +-2 and a
standard deviation of 0.7). Results: bench/results/layernorm_probe_h200/.
"""
import json
import os

import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = "cuda"
eps = 1e-6  # ConvNeXt's
shapes = [(32 * (56 >> s) ** 2, 96 << s) for s in range(4)]


def ln(x, g, b):
    return F.layer_norm(x, (x.shape[-1],), g, b, eps)


def ln_plain(x, g, b):
    return F.layer_norm(x, (x.shape[-1],), None, None, eps)


def vm16(x, g, b):
    v, m = torch.var_mean(x, -1, keepdim=True, correction=0)
    r = torch.rsqrt(v.float() + eps)
    return torch.addcmul((-m.float() * r).to(x.dtype), x, r.to(x.dtype))


def vm32(x, g, b):
    v, m = torch.var_mean(x.float(), -1, keepdim=True, correction=0)
    r = torch.rsqrt(v + eps)
    return torch.addcmul((-m * r).to(x.dtype), x, r.to(x.dtype))


def mean_sq(x, g, b):  # two reductions, accumulated in float32
    m = x.mean(-1, keepdim=True, dtype=torch.float32)
    q = (x * x).mean(-1, keepdim=True, dtype=torch.float32)
    r = torch.rsqrt(q - m * m + eps)
    return torch.addcmul((-m * r).to(x.dtype), x, r.to(x.dtype))


compiled = torch.compile(ln_plain)
variants = {"layer_norm": ln, "layer_norm_no_affine": ln_plain, "var_mean_fp16": vm16, "var_mean_fp32": vm32,
            "mean_dtype_fp32": mean_sq, "compiled_layer_norm": compiled}


def graph_time(fn, args, reps=200):
    """Microseconds per call: 10 calls per graph replay, the median of 7 rounds of reps // 10 replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and torch.compile's compilation) outside the capture
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(reps // 10):
            graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / reps)
    return sorted(times)[len(times) // 2]


out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": []}
for M, C in shapes:
    mu = torch.randn(M, 1, device=dev) * 2
    x = (torch.randn(M, C, device=dev) * 0.7 + mu).half()
    g, b = torch.randn(C, device=dev).half(), torch.randn(C, device=dev).half()
    x64 = x.double()
    ref = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, keepdim=True, unbiased=False) + eps)
    row = {"M": M, "C": C, "bytes_mb": 2 * M * C * 2 / 1e6}
    for name, fn in variants.items():
        y = fn(x, g, b)
        if name == "layer_norm":
            err = ((y.double() - (ref * g.double() + b.double())).abs().max()).item()
        else:
            err = ((y.double() - ref).abs().max()).item()
        row[name] = {"us": graph_time(fn, (x, g, b)), "max_err": err}
    out["rows"].append(row)
    print(json.dumps(row), flush=True)
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ln_probe.json"), "w"), indent=1)
