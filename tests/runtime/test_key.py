import itertools
import json

import pytest

from tiledispatch.spec.key import (ACTIVATIONS, Algorithm, Epilogue, KernelKey, Signature, kernel_name,
                                   parse_kernel_name)


def gemm_key(**sig_changes) -> KernelKey:
    sig = dict(op="gemm", dtype_a="fp16", dtype_b="fp16", dtype_c="fp16", dtype_acc="fp32", layout="rcr")
    sig.update(sig_changes)
    return KernelKey(Signature(**sig), Algorithm((96, 256, 256), "packed", mma=(8, 32, 1)), "cpu", "x86v4")


def test_name_round_trip_over_signature_space():
    keys = []
    for act, bias, res, layout in itertools.product(ACTIVATIONS, (False, True), (0, 2), ("rcr", "ccr")):
        keys.append(gemm_key(layout=layout, epilogue=Epilogue(act, bias, res)))
    for direction, dims in itertools.product(("fwd", "bwd_data", "bwd_weight"), (1, 2, 3)):
        keys.append(gemm_key(op="conv", layout="nhwgc", direction=direction, spatial_dims=dims))
    names = {kernel_name(k) for k in keys}
    assert len(names) == len(keys), "two keys share a name"
    for k in keys:
        assert parse_kernel_name(k.name) == k
        assert KernelKey.from_json(k.to_json()) == k
        assert k.name.replace("_", "").isalnum()


def test_algorithm_fields_and_extras_round_trip():
    vocab = {"pipeline": ["tma_ws_cooperative", "packed"], "scheduler": ["stream_k", "default"],
             "extras": {"cutlass": {"epilogue_schedule": {"type": "enum", "values": ["tma", "no_smem"]},
                                    "swap_ab": {"type": "bool"}, "align": {"type": "int"}}}}
    alg = Algorithm((128, 256, 64), "tma_ws_cooperative", warps=(2, 1, 1), mma=(64, 256, 16), scheduler="stream_k",
                    split_k=3, cluster=(2, 1, 1), stages=4,
                    extras=(("cutlass.swap_ab", True), ("cutlass.epilogue_schedule", "no_smem"), ("cutlass.align", 8)))
    key = KernelKey(gemm_key().signature, alg, "cutlass", "sm90a")
    assert parse_kernel_name(key.name, vocab) == key
    assert "pmawscooperative" not in key.name and "ptmawscooperative" in key.name


def test_keys_are_hashable_and_json_is_canonical():
    a, b = gemm_key(), gemm_key()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.to_json() == b.to_json()
    assert json.loads(a.to_json())["schema"] == 1


@pytest.mark.parametrize("change, message", [
    (dict(dtype_a="fp17"), "dtype_a: unknown value 'fp17'"),
    (dict(layout="rxr"), "layout: unknown value 'rxr'"),
    (dict(op="conv", layout="rcr", direction="fwd", spatial_dims=2), "layout: unknown value 'rcr'"),
    (dict(op="conv", layout="nhwgc", direction="fwd", spatial_dims=4), "spatial_dims: unknown value 4"),
])
def test_unknown_enum_values_are_errors(change, message):
    with pytest.raises(ValueError) as e:
        gemm_key(**change)
    assert message in str(e.value)
    with pytest.raises(ValueError, match="epilogue.activation: unknown value 'gelu'"):
        Epilogue("gelu")


def test_bad_triples_and_schema_are_errors():
    with pytest.raises(ValueError, match="tile: expected three positive integers"):
        Algorithm((0, 256, 256), "packed")
    d = gemm_key().to_dict()
    d["schema"] = 99
    with pytest.raises(ValueError, match="schema 99"):
        KernelKey.from_dict(d)
    d = gemm_key().to_dict()
    d["signature"]["tile_m"] = 4
    with pytest.raises(ValueError, match="unknown fields"):
        KernelKey.from_dict(d)


@pytest.mark.parametrize("name", [
    "gemm_fp16",
    "gemm_fp16xfp16xfp16xfp32_rcr_identity_cpu_x86v4_t96x256x256_w1x1x1_i8x32x1_pnosuch_sdefault_k1_c1x1x1_st0",
    "gemm_fp16xfp16xfp16xfp32_rcr_identity_cpu_x86v4_t96x256x256_w1x1x1_i8x32x1_ppacked_sdefault_k1_c1x1x1_st00",
])
def test_parse_rejects_non_names(name):
    with pytest.raises(ValueError):
        parse_kernel_name(name)


def test_an_extra_at_its_default_is_the_same_kernel():
    from tiledispatch.generator import rules

    extras = rules.backend_rules("ck_tile")["extras"]
    name, spec = next((n, s) for n, s in extras.items() if "default" in s)
    base = KernelKey(gemm_key().signature, Algorithm((256, 256, 32), "compv3", warps=(2, 2, 1), mma=(32, 32, 16),
                                                     scheduler="intrawave"), "ck_tile", "gfx942")
    spelled = base.replace(algorithm=Algorithm((256, 256, 32), "compv3", warps=(2, 2, 1), mma=(32, 32, 16),
                                               scheduler="intrawave", extras=((f"ck_tile.{name}", spec["default"]),)))
    assert spelled == base and spelled.name == base.name
