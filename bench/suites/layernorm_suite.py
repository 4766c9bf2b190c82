"""The LayerNorm suite, generated from model definitions rather than picked by hand.

    python bench/suites/layernorm_suite.py            # writes bench/suites/layernorm.json
    python bench/suites/layernorm_suite.py --check    # regenerates and compares with the file

Every distinct layer norm (rows x normalized columns) of torchvision's models that have them (ConvNeXt, Swin,
Swin V2, ViT, MaxViT: every size) at batch 32 and their weights' crop size, in inference, and of GPT-2 and BERT-large
(their published configs, generate.py's LLMS) at generate.py's token counts, with the models that use it and how
often. Llama and Mistral normalize with RMSNorm, not LayerNorm: not in this suite.

Needs torch and torchvision, as generate.py (whose helpers it uses): the models are built with their parameters on
the meta device and run once under a TorchFunctionMode that records each F.layer_norm call's shape.
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import generate  # noqa: E402

FAMILIES = r"convnext_.*|swin_.*|vit_.*|maxvit_.*"
BATCH = 32


def torchvision_models() -> dict[str, dict]:
    from torchvision import models

    found = {}
    for name in sorted(models.list_models(module=models)):
        if re.fullmatch(FAMILIES, name):
            crop = models.get_model_weights(name).DEFAULT.transforms().crop_size[0]  # metadata only: no download
            found[name] = {"input": [3, crop, crop], "batch": BATCH, "source": f"torchvision.models.{name}"}
    return found


def record_model(model, example) -> list[tuple[int, int]]:
    """(rows, cols) of every layer norm one inference pass of model on example runs, in order."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    calls = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (F.layer_norm, torch.layer_norm):
                shape = args[1] if len(args) > 1 else (kwargs or {})["normalized_shape"]
                shape = (shape,) if isinstance(shape, int) else tuple(shape)
                cols = math.prod(shape)
                calls.append((args[0].numel() // cols, cols))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        model(example)
    return calls


def llm_records() -> dict[str, list[tuple[int, int]]]:
    """GPT-2: ln_1 and ln_2 per layer, ln_f; BERT: the embeddings' and two per layer, and the MLM head's."""
    records = {}
    for model, cfg in generate.LLMS.items():
        if cfg["kind"] == "llama":
            continue
        per_model = 2 * cfg["num_hidden_layers"] + (1 if cfg["kind"] == "gpt2" else 2)
        records[model] = [(tokens, cfg["hidden_size"]) for tokens in generate.LLM_TOKENS for _ in range(per_model)]
    return records


def build_suite(records: dict[str, list[tuple[int, int]]], header: dict) -> dict:
    shapes: dict = {}
    for model, calls in records.items():
        for rows, cols in calls:
            entry = shapes.setdefault((cols, rows), {"id": f"ln_{rows}x{cols}", "rows": rows, "cols": cols,
                                                     "uses": {}})
            entry["uses"][model] = entry["uses"].get(model, 0) + 1
    return {**header, "shapes": [shapes[k] for k in sorted(shapes)]}


def generate_suite() -> dict:
    import torch
    import torchvision

    catalog = torchvision_models()
    records = {}
    for name, meta in catalog.items():
        with generate.meta_tensors_of_modules():
            model = generate.build_model(name, "image").eval()
        size = getattr(model, "image_size", None)  # a ViT built without weights takes its own size (vit_h_14: 224)
        if size is not None:
            meta["input"] = [3, size, size]
        records[name] = record_model(model, torch.empty(meta["batch"], *meta["input"], device="meta"))
        print(f"{name:24s} {len(records[name]):4d} layer norms", file=sys.stderr)
    records.update(llm_records())
    versions = {"torch": torch.__version__.split("+")[0], "torchvision": torchvision.__version__.split("+")[0]}
    header = {"schema": generate.SCHEMA, "generator": "bench/suites/layernorm_suite.py", "sources": versions,
              "note": "layer norms over the last dim (rows x cols) of one inference pass: torchvision models at batch "
                      "32 and their weights' crop size, GPT-2 and BERT-large at every token count; uses: model -> how "
                      "many of its layer norms",
              "models": catalog, "llms": {k: v for k, v in generate.LLMS.items() if v["kind"] != "llama"},
              "tokens": list(generate.LLM_TOKENS)}
    return build_suite(records, header)


def main(argv=None) -> int:
    return generate.suite_main(__doc__, "layernorm.json", generate_suite, argv)

if __name__ == "__main__":
    sys.exit(main())
