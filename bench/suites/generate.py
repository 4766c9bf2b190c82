"""The benchmark suites of issue #20, generated from model definitions rather than picked by hand.

    python bench/suites/generate.py            # writes bench/suites/conv.json and gemm.json
    python bench/suites/generate.py --check    # regenerates and compares with the files (exit 1 on a difference)

conv.json: every distinct convolution layer of torchvision's classification, video and segmentation models of the
families the issue names, and of the wav2vec2 feature extractor, with the models that use it and how often.
gemm.json: every GEMM of the linear layers of Llama-3 8B / 70B, Mistral 7B, GPT-2 and BERT-large (forward, and the
two backward GEMMs) at the issue's token counts, and those of the torchvision models' nn.Linear layers.

Needs torch and torchvision, which are not dependencies of the project: run it from a virtual environment of its own
(`python3 -m venv venv-tv && venv-tv/bin/pip install torch torchvision`); the files name the versions used. The
models are built with their parameters on the meta device (no weights are downloaded, none stays in memory) and run
once in training mode at their standard input size (the crop size of their torchvision weights' transforms; video
clips of 16 frames; segmentation the weights' resize size, square); forward hooks on every nn.Conv1d/2d/3d and
nn.Linear record what each layer sees. The LLMs
are their published configs (below, as data); the wav2vec2 feature extractor is built here from its published
definition (torchaudio is not needed). Everything after the hooks (deduplication, classification, ids, order) is
plain Python, so tests/test_suites.py checks the files against it without torchvision.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHEMA = 1
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")

# ---- what the suites are made of ------------------------------------------------------------------------------
# The batch sizes: 32, and 8 for video.
BATCH = {"image": 32, "segmentation": 32, "video": 8, "audio": 32}
# torchvision model names per domain, as regular expressions over torchvision.models.list_models(): the families
# the issue names (EfficientNet b0-b4 only), every size of each.
FAMILIES = {
    "image": r"resnet\d+|resnext.*|wide_resnet.*|mobilenet_v[23].*|efficientnet_b[0-4]|efficientnet_v2_.*|convnext_.*"
             r"|regnet_.*|densenet.*|shufflenet_v2_.*|mnasnet.*|squeezenet.*|vgg.*|googlenet|inception_v3",
    "video": r"r3d_18|mc3_18|r2plus1d_18",
    "segmentation": r"deeplabv3_.*|fcn_.*",
}
# torchvision's video classification reference trains and evaluates on 16-frame clips (--clip-len 16); the weights'
# transforms give the frame size
VIDEO_FRAMES = 16
# wav2vec2's feature extractor, as published (torchaudio.models.wav2vec2_base; Hugging Face facebook/wav2vec2-base
# config.json: conv_dim 7 x 512, conv_kernel [10, 3, 3, 3, 3, 2, 2], conv_stride [5, 2, 2, 2, 2, 2, 2], conv_bias
# false; the large models have the same convolutions), on one second of 16 kHz audio
WAV2VEC2 = {"source": "torchaudio.models.wav2vec2_base / facebook/wav2vec2-base config.json",
            "channels": [512] * 7, "kernel": [10, 3, 3, 3, 3, 2, 2], "stride": [5, 2, 2, 2, 2, 2, 2], "samples": 16000}

# The LLMs, from their published Hugging Face config.json files.
LLMS = {
    "llama3_8b": {"source": "meta-llama/Meta-Llama-3-8B config.json", "kind": "llama", "hidden_size": 4096,
                  "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "num_hidden_layers": 32, "vocab_size": 128256},
    "llama3_70b": {"source": "meta-llama/Meta-Llama-3-70B config.json", "kind": "llama", "hidden_size": 8192,
                   "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
                   "num_hidden_layers": 80, "vocab_size": 128256},
    "mistral_7b": {"source": "mistralai/Mistral-7B-v0.1 config.json", "kind": "llama", "hidden_size": 4096,
                   "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "num_hidden_layers": 32, "vocab_size": 32000},
    "gpt2": {"source": "openai-community/gpt2 config.json (n_embd, n_head, n_layer, n_inner null = 4 x n_embd)",
             "kind": "gpt2", "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
             "num_hidden_layers": 12, "vocab_size": 50257},
    "bert_large": {"source": "google-bert/bert-large-uncased config.json", "kind": "bert", "hidden_size": 1024,
                   "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                   "vocab_size": 30522},
}
LLM_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)  # M: decode (1-32) to prefill (128-8192)
GEMM_DTYPES = ("fp16", "bf16")
# y = x W^T for x [M, in], W [out, in], as GEMMs (m, n, k, layout of A B D: r row-major, c column-major):
#   fwd         y [M, out]  = x [M, in] @ W^T          (W is [out, in] row-major: B column-major)
#   bwd_data    dx [M, in]  = dy [M, out] @ W          (W row-major [out, in] = B row-major)
#   bwd_weight  dW [out, in] = dy^T [out, M] @ x [M, in] (dy^T: A column-major)
LINEAR_PASSES = {"fwd": "rcr", "bwd_data": "rrr", "bwd_weight": "crr"}


# ---- layers as the hooks see them -----------------------------------------------------------------------------
def conv_record(mod, in_shape, out_shape, input_grad: bool) -> dict:
    """One convolution as a suite layer (logical sizes: batch n, channels c -> k, groups, input size, filter, stride,
    dilation, padding below / above) and the directions a training step runs on it: fwd and bwd_weight always,
    bwd_data when the layer's input needs a gradient (not on a model's input)."""
    rank = len(in_shape) - 2
    size, filt, stride, dil = list(in_shape[2:]), list(mod.kernel_size), list(mod.stride), list(mod.dilation)
    if isinstance(mod.padding, str):  # "valid" or "same" (PyTorch puts the odd element above)
        total = [d * (f - 1) if mod.padding == "same" else 0 for d, f in zip(dil, filt)]
        lo, hi = [t // 2 for t in total], [t - t // 2 for t in total]
    else:
        lo, hi = list(mod.padding), list(mod.padding)
    if mod.padding_mode != "zeros":  # padded by F.pad before the convolution, which sees no padding
        size, lo, hi = [s + a + b for s, a, b in zip(size, lo, hi)], [0] * rank, [0] * rank
    rec = {"rank": rank, "n": in_shape[0], "c": in_shape[1], "k": mod.out_channels, "groups": mod.groups,
           "in_size": size, "filter": filt, "stride": stride, "dilation": dil, "pad_lo": lo, "pad_hi": hi,
           "directions": [d for d in DIRECTIONS if d != "bwd_data" or input_grad]}
    if out_size(rec) != list(out_shape[2:]):
        raise AssertionError(f"{mod}: output {list(out_shape)}, but the suite's formula gives {out_size(rec)}")
    return rec


def linear_records(in_features: int, out_features: int, tokens: int, input_grad: bool = True) -> list[dict]:
    """The GEMMs of one linear layer at `tokens` rows: forward, and in training bwd_weight and (when its input needs
    a gradient) bwd_data."""
    dims = {"fwd": (tokens, out_features, in_features), "bwd_data": (tokens, in_features, out_features),
            "bwd_weight": (out_features, in_features, tokens)}
    return [{"pass": p, "m": m, "n": n, "k": k, "layout": LINEAR_PASSES[p]} for p, (m, n, k) in dims.items()
            if p != "bwd_data" or input_grad]


def record_model(model, example) -> tuple[list[dict], list[dict]]:
    """(conv records, GEMM records) of one forward pass of model on example, from forward hooks on every
    nn.Conv1d/2d/3d and nn.Linear (in the order they run; a module run twice counts twice)."""
    from torch import nn

    convs, gemms = [], []

    def on_conv(mod, inputs, output):
        convs.append(conv_record(mod, tuple(inputs[0].shape), tuple(output.shape), inputs[0].requires_grad))

    def on_linear(mod, inputs, output):
        x = inputs[0]
        tokens = 1
        for d in x.shape[:-1]:
            tokens *= d
        gemms.extend(linear_records(mod.in_features, mod.out_features, tokens, x.requires_grad))

    conv_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)  # and their subclasses (torchvision's video convolutions)
    handles = [m.register_forward_hook(on_conv) for m in model.modules() if isinstance(m, conv_types)]
    handles += [m.register_forward_hook(on_linear) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        model(example)
    finally:
        for h in handles:
            h.remove()
    return convs, gemms


# ---- suites from records (plain Python) ------------------------------------------------------------------------
CONV_FIELDS = ("rank", "n", "c", "k", "groups", "in_size", "filter", "stride", "dilation", "pad_lo", "pad_hi")


def out_size(layer: dict) -> list[int]:
    return [(s + a + b - d * (f - 1) - 1) // st + 1 for s, a, b, d, f, st in zip(
        layer["in_size"], layer["pad_lo"], layer["pad_hi"], layer["dilation"], layer["filter"], layer["stride"])]


def conv_class(layer: dict) -> str:
    """dense (one group), depthwise (a group per input channel, any channel multiplier) or grouped."""
    if layer["groups"] == 1:
        return "dense"
    return "depthwise" if layer["groups"] == layer["c"] else "grouped"


def conv_id(layer: dict) -> str:
    x = lambda v: "x".join(map(str, v))  # noqa: E731
    pad = x(layer["pad_lo"]) + ("" if layer["pad_lo"] == layer["pad_hi"] else "-" + x(layer["pad_hi"]))
    return (f"{layer['rank']}d_n{layer['n']}_c{layer['c']}_k{layer['k']}_g{layer['groups']}_{x(layer['in_size'])}"
            f"_f{x(layer['filter'])}_s{x(layer['stride'])}_p{pad}_d{x(layer['dilation'])}")


def conv_flops(layer: dict) -> int:
    """2 N K (C/G) prod(output) prod(filter): one direction's multiply-adds, twice."""
    flops = 2 * layer["n"] * layer["k"] * (layer["c"] // layer["groups"])
    for v in out_size(layer) + layer["filter"]:
        flops *= v
    return flops


def build_conv_suite(records: dict[str, list[dict]], header: dict) -> dict:
    """The suite from each model's records: one entry per distinct layer, the models using it and how often (uses),
    the union of the directions they run on it, its class, output size and id; sorted by rank, class, id."""
    layers = {}
    for model in sorted(records):
        for rec in records[model]:
            key = tuple(tuple(v) if isinstance(v, list) else v for v in (rec[f] for f in CONV_FIELDS))
            entry = layers.setdefault(key, {**{f: rec[f] for f in CONV_FIELDS}, "directions": set(), "uses": {}})
            entry["directions"].update(rec["directions"])
            entry["uses"][model] = entry["uses"].get(model, 0) + 1
    out = []
    for entry in layers.values():
        entry["directions"] = [d for d in DIRECTIONS if d in entry["directions"]]
        entry.update(id=conv_id(entry), cls=conv_class(entry), out_size=out_size(entry), flops=conv_flops(entry),
                     weight=sum(entry["uses"].values()))
        out.append(entry)
    classes = ("dense", "grouped", "depthwise")
    out.sort(key=lambda e: (e["rank"], classes.index(e["cls"]), *(e[f] for f in CONV_FIELDS[1:])))
    return {**header, "layers": [{k: e[k] for k in ("id", "cls", *CONV_FIELDS, "out_size", "directions", "flops",
                                                    "weight", "uses")} for e in out]}


def records_of_conv_suite(suite: dict) -> dict[str, list[dict]]:
    """Per-model records that give the suite back (each use of a layer as one record with the layer's directions)."""
    records: dict[str, list[dict]] = {}
    for layer in suite["layers"]:
        for model, count in layer["uses"].items():
            rec = {**{f: layer[f] for f in CONV_FIELDS}, "directions": layer["directions"]}
            records.setdefault(model, []).extend([rec] * count)
    return records


def gemm_id(e: dict) -> str:
    return f"{e['pass']}_{e['m']}x{e['n']}x{e['k']}_{e['layout']}"


def build_gemm_suite(records: dict[str, list[dict]], header: dict) -> dict:
    """One entry per distinct GEMM (pass, m, n, k, layout), the models using it and how often (uses); sorted by pass,
    m, n, k. Every entry runs in each of the header's dtypes."""
    shapes = {}
    for model in sorted(records):
        for rec in records[model]:
            key = (rec["pass"], rec["m"], rec["n"], rec["k"], rec["layout"])
            entry = shapes.setdefault(key, {"id": gemm_id(rec), **rec, "uses": {}})
            entry["uses"][model] = entry["uses"].get(model, 0) + 1
    order = {p: i for i, p in enumerate(LINEAR_PASSES)}
    out = sorted(shapes.values(), key=lambda e: (order[e["pass"]], e["m"], e["n"], e["k"]))
    for e in out:
        e["weight"] = sum(e["uses"].values())
    return {**header, "shapes": out}


def records_of_gemm_suite(suite: dict, models) -> dict[str, list[dict]]:
    records: dict[str, list[dict]] = {}
    for e in suite["shapes"]:
        for model, count in e["uses"].items():
            if model in models:
                rec = {f: e[f] for f in ("pass", "m", "n", "k", "layout")}
                records.setdefault(model, []).extend([rec] * count)
    return records


def llm_linears(cfg: dict) -> list[tuple[str, int, int, int]]:
    """(module, in_features, out_features, how many in the model) of every linear layer, as the Hugging Face
    implementation of the config's architecture defines them (no fused projections)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    if cfg["kind"] == "llama":  # LlamaForCausalLM / MistralForCausalLM
        hd = h // cfg["num_attention_heads"]
        kv = cfg["num_key_value_heads"] * hd
        per_layer = [("q_proj", h, h), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", h, h),
                     ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
    elif cfg["kind"] == "gpt2":  # GPT2LMHeadModel (Conv1D modules: linear layers)
        per_layer = [("attn.c_attn", h, 3 * h), ("attn.c_proj", h, h), ("mlp.c_fc", h, i), ("mlp.c_proj", i, h)]
    elif cfg["kind"] == "bert":  # BertForMaskedLM
        per_layer = [("attention.self.query", h, h), ("attention.self.key", h, h), ("attention.self.value", h, h),
                     ("attention.output.dense", h, h), ("intermediate.dense", h, i), ("output.dense", i, h)]
    else:
        raise ValueError(f"unknown architecture {cfg['kind']!r}")
    out = [(name, a, b, layers) for name, a, b in per_layer]
    if cfg["kind"] == "bert":
        out.append(("cls.predictions.transform.dense", h, h, 1))
    out.append(("lm_head" if cfg["kind"] != "bert" else "cls.predictions.decoder", h, cfg["vocab_size"], 1))
    return out


def llm_records() -> dict[str, list[dict]]:
    """Every GEMM of every LLM linear layer at every token count (each layer's count of modules as its uses)."""
    records = {}
    for model, cfg in LLMS.items():
        recs = []
        for _, a, b, count in llm_linears(cfg):
            for tokens in LLM_TOKENS:
                recs.extend(linear_records(a, b, tokens) * count)
        records[model] = recs
    return records


# ---- running the models (needs torchvision) --------------------------------------------------------------------
def wav2vec2_feature_extractor():
    from torch import nn

    layers, c = [], 1
    for k, f, s in zip(WAV2VEC2["channels"], WAV2VEC2["kernel"], WAV2VEC2["stride"]):
        layers += [nn.Conv1d(c, k, f, s, bias=False), nn.GELU()]
        c = k
    return nn.Sequential(*layers)


def torchvision_models() -> dict[str, dict]:
    """name -> {domain, input shape without the batch, batch, source} for every model of the families."""
    from torchvision import models

    found = {}
    for domain, module in (("image", models), ("video", models.video), ("segmentation", models.segmentation)):
        for name in sorted(models.list_models(module=module)):
            if not re.fullmatch(FAMILIES[domain], name):
                continue
            transforms = models.get_model_weights(name).DEFAULT.transforms()  # metadata only: no download
            if domain == "image":
                shape = [3, transforms.crop_size[0], transforms.crop_size[0]]
            elif domain == "video":
                shape = [3, VIDEO_FRAMES, *transforms.crop_size]
            else:
                shape = [3, transforms.resize_size[0], transforms.resize_size[0]]
            found[name] = {"domain": domain, "input": shape, "batch": BATCH[domain],
                           "source": f"torchvision.models.{'' if domain == 'image' else domain + '.'}{name}"}
    return found


@contextlib.contextmanager
def meta_tensors_of_modules():
    """Parameters and buffers made on the meta device as modules register them (each allocated on the CPU for a
    moment): models whose constructors compute with tensors (RegNet's widths) cannot be built under
    torch.device("meta"), and the largest would not fit in memory on the CPU."""
    from torch import nn

    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(self, name, param):
        if param is not None:
            param = nn.Parameter(param.to("meta"), param.requires_grad)
        register_parameter(self, name, param)

    def buffer(self, name, tensor, persistent=True):
        register_buffer(self, name, None if tensor is None else tensor.to("meta"), persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


def build_model(name: str, domain: str):
    from torchvision import models

    if domain == "segmentation":  # the configuration torchvision's own weights use (auxiliary head on)
        return models.get_model(name, weights=None, weights_backbone=None, aux_loss=True)
    return models.get_model(name, weights=None)


def generate() -> tuple[dict, dict]:
    import torch
    import torchvision

    catalog = torchvision_models()
    catalog["wav2vec2_feature_extractor"] = {"domain": "audio", "input": [1, WAV2VEC2["samples"]],
                                             "batch": BATCH["audio"], "source": WAV2VEC2["source"]}
    conv_recs, linear_recs = {}, {}
    for name, meta in catalog.items():
        with meta_tensors_of_modules():
            model = wav2vec2_feature_extractor() if meta["domain"] == "audio" else build_model(name, meta["domain"])
        model.train()
        convs, gemms = record_model(model, torch.empty(meta["batch"], *meta["input"], device="meta"))
        conv_recs[name] = convs
        if gemms:
            linear_recs[name] = gemms
        print(f"{name:32s} {len(convs):4d} convs, {len(gemms) // 3:3d} linears", file=sys.stderr)
    versions = {"torch": torch.__version__.split("+")[0], "torchvision": torchvision.__version__.split("+")[0]}
    conv_header = {"schema": SCHEMA, "generator": "bench/suites/generate.py", "sources": versions,
                   "note": "layers of one training step (fwd, bwd_weight; bwd_data where the input needs a gradient); "
                           "n is the batch (issue #20: 32, video 8); inputs: the torchvision weights' crop size, video "
                           "16 frames, segmentation the resize size as a square; uses: model -> how many of its layers",
                   "models": catalog}
    gemm_header = {"schema": SCHEMA, "generator": "bench/suites/generate.py", "sources": versions,
                   "note": "GEMMs of linear layers y = x W^T: fwd (rcr), bwd_data (rrr), bwd_weight (crr); LLMs at "
                           "every token count, torchvision models at batch 32; uses: model -> how many of its layers",
                   "dtypes": list(GEMM_DTYPES), "tokens": list(LLM_TOKENS), "llms": LLMS,
                   "torchvision_models": sorted(linear_recs)}
    return (build_conv_suite(conv_recs, conv_header),
            build_gemm_suite({**llm_records(), **linear_recs}, gemm_header))


def dump(suite: dict) -> str:
    """The file's text, deterministic and diff-friendly: one entry (layer, shape, model) per line, the entries last."""
    entries = "layers" if "layers" in suite else "shapes"

    def value(v) -> str:
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return "[\n" + ",\n".join("  " + json.dumps(e, sort_keys=True) for e in v) + "\n ]"
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(x, sort_keys=True)}"
                                       for k, x in sorted(v.items())) + "\n }"
        return json.dumps(v, sort_keys=True)

    keys = sorted(k for k in suite if k != entries) + [entries]
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(suite[k])}" for k in keys) + "\n}\n"


def write_or_check(path: Path, suite: dict, check: bool) -> int:
    """Write the suite's file (dump), or with check compare it with what is there; 1 on a difference."""
    text = dump(suite)
    count = len(suite.get("layers", suite.get("shapes")))
    if check:
        same = path.exists() and path.read_text() == text
        print(f"{path}: {'up to date' if same else 'DIFFERS from what the models give'} ({count} entries)")
        return int(not same)
    path.write_text(text)
    print(f"wrote {path}: {count} entries")
    return 0


def suite_main(doc: str, file_name: str, make, argv=None) -> int:
    """The command line of a one-file suite generator: write (or --check) --out/file_name from make()."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    ap.add_argument("--out", type=Path, default=HERE)
    a = ap.parse_args(argv)
    return write_or_check(a.out / file_name, make(), a.check)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    ap.add_argument("--out", type=Path, default=HERE)
    a = ap.parse_args(argv)
    conv, gemm = generate()
    status = 0
    for name, suite in (("conv.json", conv), ("gemm.json", gemm)):
        status |= write_or_check(a.out / name, suite, a.check)
    return status


if __name__ == "__main__":
    sys.exit(main())
