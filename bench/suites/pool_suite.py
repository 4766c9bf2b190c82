"""The max pooling suite, generated from model definitions rather than picked by hand.

    python bench/suites/pool_suite.py            # writes bench/suites/maxpool.json
    python bench/suites/pool_suite.py --check    # regenerates and compares with the file

Every distinct max pooling (map, window, stride, padding, dilation, ceil_mode) of generate.py's torchvision
classification, video and segmentation models (its FAMILIES and input sizes, batch 32 and 8 for video) and of
torchvision's GoogLeNet and Inception v3 (which generate.py leaves out), in inference, with the models that use it
and how often. Needs torch and torchvision, as generate.py: the models are built on the meta device and run once
under a TorchFunctionMode that records each F.max_pool1d / 2d / 3d call.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import generate  # noqa: E402

EXTRA = r"googlenet|inception_v3"  # image models with max pooling beyond generate.py's families
FIELDS = ("n", "c", "in_size", "window", "stride", "padding", "dilation", "ceil_mode")


def _per_dim(value, rank: int) -> list:
    return [int(value)] * rank if isinstance(value, int) else [int(v) for v in value]


def record_model(model, example) -> list[dict]:
    """Every max pooling one inference pass of model on example runs, in order."""
    import torch
    from torch.overrides import TorchFunctionMode

    calls = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if re.fullmatch(r"max_pool[123]d", name):
                x, rank = args[0], int(name[-2])
                given = dict(zip(("kernel_size", "stride", "padding", "dilation", "ceil_mode"), args[1:]), **kwargs)
                window = _per_dim(given["kernel_size"], rank)
                stride = given.get("stride") or window
                calls.append({"n": x.shape[0], "c": x.shape[1], "in_size": list(x.shape[2:]), "window": window,
                              "stride": _per_dim(stride, rank), "padding": _per_dim(given.get("padding", 0), rank),
                              "dilation": _per_dim(given.get("dilation", 1), rank),
                              "ceil_mode": bool(given.get("ceil_mode", False))})
            return func(*args, **kwargs)

    with torch.no_grad(), Record():
        model(example)
    return calls


def pool_id(e: dict) -> str:
    dims = "x".join(map(str, e["in_size"]))
    geo = "_".join(f"{k[0]}{'x'.join(map(str, e[k]))}" for k in ("window", "stride", "padding", "dilation"))
    return f"pool{len(e['in_size'])}d_n{e['n']}_c{e['c']}_{dims}_{geo}{'_ceil' if e['ceil_mode'] else ''}"


def build_suite(records: dict[str, list[dict]], header: dict) -> dict:
    pools: dict = {}
    for model, calls in records.items():
        for e in calls:
            entry = pools.setdefault(pool_id(e), {"id": pool_id(e), **{f: e[f] for f in FIELDS}, "uses": {}})
            entry["uses"][model] = entry["uses"].get(model, 0) + 1
    return {**header, "shapes": [pools[k] for k in sorted(pools)]}


def generate_suite() -> dict:
    import torch
    import torchvision
    from torchvision import models

    catalog = generate.torchvision_models()
    for name in sorted(models.list_models(module=models)):
        if re.fullmatch(EXTRA, name):
            crop = models.get_model_weights(name).DEFAULT.transforms().crop_size[0]
            catalog[name] = {"domain": "image", "input": [3, crop, crop], "batch": generate.BATCH["image"],
                             "source": f"torchvision.models.{name}"}
    records = {}
    for name, meta in catalog.items():
        with generate.meta_tensors_of_modules():
            if name in ("googlenet", "inception_v3"):  # their auxiliary heads run in training only
                model = models.get_model(name, weights=None, aux_logits=False, init_weights=False)
            else:
                model = generate.build_model(name, meta["domain"])
        calls = record_model(model.eval(), torch.empty(meta["batch"], *meta["input"], device="meta"))
        if calls:
            records[name] = calls
            print(f"{name:32s} {len(calls):3d} max pools", file=sys.stderr)
    versions = {"torch": torch.__version__.split("+")[0], "torchvision": torchvision.__version__.split("+")[0]}
    header = {"schema": generate.SCHEMA, "generator": "bench/suites/pool_suite.py", "sources": versions,
              "note": "max poolings of one inference pass, torchvision models at generate.py's batch and input sizes; "
                      "uses: model -> how many of its poolings",
              "models": {k: v for k, v in catalog.items() if k in records}}
    return build_suite(records, header)


def main(argv=None) -> int:
    return generate.suite_main(__doc__, "maxpool.json", generate_suite, argv)

if __name__ == "__main__":
    sys.exit(main())
