"""A learned model is tied to the kernels it knows: every kernel of a preselected set that a shipped model ranks
must be one it was trained on (its card lists them), and bundles record the model version that ranks them."""
from __future__ import annotations

import json

import pytest

from tiledispatch import backends, bundle, learned
from tiledispatch.generator import kernelset
from tiledispatch.spec.key import parse_kernel_name


def shipped_models() -> list[learned.Model]:
    return [learned.Model(json.loads(p.read_text()), str(p)) for p in sorted(learned.MODELS_DIR.glob("*.json"))]


def set_keys(name: str, backend: str, arch: str) -> list:
    try:
        return [e.key for e in kernelset.load([name], backend, arch)]
    except Exception:  # noqa: BLE001 - the set declares nothing for this backend / arch
        return []


def test_models_list_the_kernels_they_were_trained_on():
    models = shipped_models()
    assert models, "no shipped model"
    for model in models:
        assert model.kernel_names, f"{model.task} model of {model.applies_to['backend']}: its card lists no kernels"
        assert all(model.applies(None, parse_kernel_name(n)) for n in model.kernel_names)


def test_preselected_sets_hold_no_kernel_their_model_never_saw():
    unseen, covered = {}, 0
    for model in shipped_models():
        backend, arch = model.applies_to["backend"], model.applies_to["arch"]
        for name in sorted(kernelset.available_sets()):
            keys = [k for k in set_keys(name, backend, arch) if learned.task_of(k) == model.task]
            covered += sum(model.applies(None, k) for k in keys)
            if model.unseen(keys):
                unseen[f"{name} ({backend}/{arch} {model.task}, model {model.version})"] = model.unseen(keys)
    assert covered > 50  # fp16_rcr_full alone: 53 kernels the cutlass sm90a GEMM model ranks
    assert not unseen, "kernels a model ranks but was never trained on (sweep and retrain):\n" + "\n".join(
        f"{where}: {', '.join(names)}" for where, names in unseen.items())


def test_a_kernel_missing_from_the_card_is_reported():
    path = learned.model_path("cutlass", "sm90a", "gemm")
    data = json.loads(path.read_text())
    keys = [e.key for e in kernelset.load(["fp16_rcr_full"], "cutlass", "sm90a")]
    dropped = data["trained"]["kernel_names"].pop(3)
    assert learned.Model(data).unseen(keys) == [dropped]
    # epilogues and bf16 share the trained algorithms: the fused set's kernels count as seen
    fused = [e.key for e in kernelset.load(["fp16_rcr_fused"], "cutlass", "sm90a")]
    assert not learned.Model(json.loads(path.read_text())).unseen(fused)
    del data["trained"]["kernel_names"]  # an older card: nothing is known to have been seen
    assert len(learned.Model(data).unseen(keys)) == len(keys)


def test_bundles_record_the_model_that_ranks_them():
    model = learned.model_for("cutlass", "sm90a", "gemm")
    keys = [e.key for e in kernelset.load(["fp16_rcr_essential"], "cutlass", "sm90a")]
    recorded = bundle.selection_models(keys)
    assert recorded == {"gemm": {"model": "cutlass_sm90a_gemm.json", "version": model.version,
                                 "covers": sum(model.applies(None, k) for k in keys), "unseen": []}}
    assert model.version.startswith(model.meta["date"])
    conv = [e.key for e in kernelset.load(["conv_fp16_all_essential"], "cutlass", "sm90a")]
    tasks = bundle.selection_models(conv)
    assert {"conv_fwd", "conv_bwd_data", "conv_bwd_weight"} <= set(tasks)
    assert all(tasks[t] is None for t in tasks if learned.model_for("cutlass", "sm90a", t) is None)
