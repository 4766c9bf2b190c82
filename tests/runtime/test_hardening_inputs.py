"""Hostile arrays and arguments get a clear InvalidInputError (or a correct result), never a crash, a write into
memory the caller did not hand out for writing, or a wrong result: read-only and self-overlapping outputs,
outputs that alias inputs (also on the repeated-call fast paths), num_threads, sizes that overflow the ABI's
int64, and assorted bad arguments. cpu backend, numpy and (where installed) torch CPU tensors."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tiledispatch as td
from tiledispatch import abi, reference
from tiledispatch.ops import conv as conv_op
from tiledispatch.ops import gemm as gemm_op

from conftest import build_cpu_bundle

SET = """\
schema: 1
name: hard_inputs
description: one small cpu kernel per op, layout, epilogue and conv direction
groups:
  - backend: cpu
    op: gemm
    dtype: [fp32, fp16]
    layout: [rcr, rrr]
    tile: [24, 64, 64]
    mma: [4, 16, 1]
    pipeline: packed
  - backend: cpu
    op: gemm
    dtype: fp32
    layout: rcr
    epilogue: {activation: clamp, residuals: 1}
    tile: [24, 64, 64]
    mma: [4, 16, 1]
    pipeline: packed
  - backend: cpu
    op: conv
    direction: [fwd, bwd_data, bwd_weight]
    spatial_dims: 2
    dtype: fp32
    layout: nhwgc
    tile: [32, 32, 64]
    mma: [4, 16, 1]
    pipeline: packed
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    build = tmp_path_factory.mktemp("inputs")
    build_cpu_bundle(build, "hard_inputs", SET)
    return build / "hard_inputs"


@pytest.fixture(scope="module")
def reg(bundle):
    return td.load(bundle)


def rand(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(dtype)


def close(got, want, tol=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want), np.abs(got - want).max()


def isolated(bundle, code: str) -> str:
    """Run code (with `reg` loaded from the bundle) in a fresh interpreter: what crashed the caller's process
    before the fix must not take the test run down with it. Returns stdout; the process must exit 0."""
    prelude = f"import numpy as np, tiledispatch as td\nreg = td.load({str(bundle)!r})\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


GEO = {"padding": 1}  # 3x3 filters, same-size outputs


def conv_arrays(seed=0):
    """x [N, H, W, G, C/G], w [G, K/G, Y, X, C/G], dy [N, H, W, G, K/G] with C/G = K/G (so every tensor of
    the same-size convolution can stand in for another)."""
    return rand(2, 6, 5, 2, 8, seed=seed), rand(2, 8, 3, 3, 8, seed=seed + 1), rand(2, 6, 5, 2, 8, seed=seed + 2)


def run_conv(reg, direction, x, w, dy, out):
    if direction == "fwd":
        return reg.conv_fwd(x, w, out, **GEO)
    if direction == "bwd_data":
        return reg.conv_bwd_data(dy, w, out, **GEO)
    return reg.conv_bwd_weight(x, dy, out, **GEO)


WRITTEN = {"fwd": "y", "bwd_data": "x", "bwd_weight": "w"}


# -- 1. outputs must be writable ---------------------------------------------------------------------------------
def test_read_only_output_is_refused_and_left_alone(reg):
    a, w = rand(32, 16), rand(24, 16)
    out = np.zeros((32, 24), np.float32)
    out.flags.writeable = False
    with pytest.raises(td.InvalidInputError, match="out is read-only"):
        reg.gemm(a, w.T, out=out)
    assert not out.any()


def test_broadcast_output_is_refused_and_its_source_left_alone(reg):
    a, w = rand(32, 16), rand(24, 16)
    src = np.zeros(24, np.float32)
    with pytest.raises(td.InvalidInputError, match="out is read-only"):
        reg.gemm(a, w.T, out=np.broadcast_to(src, (32, 24)))
    writable = np.lib.stride_tricks.as_strided(src, (32, 24), (0, 4))  # every row is src, and writable
    assert writable.flags.writeable
    with pytest.raises(td.InvalidInputError, match=r"out has shape \[32, 24\] with strides \[0, 1\]: some of its "
                                                   r"elements share memory"):
        reg.gemm(a, w.T, out=writable)
    batched = np.lib.stride_tricks.as_strided(np.zeros((32, 24), np.float32), (3, 32, 24), (0, 96, 4))
    with pytest.raises(td.InvalidInputError, match="share memory"):
        reg.gemm(rand(3, 32, 16), w.T, out=batched)
    assert not src.any()


def test_read_only_memmap_output_is_refused_not_a_crash(bundle, tmp_path):
    path = tmp_path / "out.bin"
    np.zeros((32, 24), np.float32).tofile(path)
    out = isolated(bundle, f"""
        a, w = np.ones((32, 16), np.float32), np.ones((24, 16), np.float32)
        out = np.memmap({str(path)!r}, np.float32, "r", shape=(32, 24))
        try:
            reg.gemm(a, w.T, out=out)
            print("written")
        except td.InvalidInputError as e:
            print("refused:", e)
    """)
    assert out.startswith("refused: out is read-only"), out
    assert not np.fromfile(path, np.float32).any()


def test_read_only_memmap_after_a_writable_one_is_refused(bundle, tmp_path):
    """numpy subclasses take the generic fingerprint: it must tell a read-only memmap from a writable one."""
    path = tmp_path / "out.bin"
    np.zeros((32, 24), np.float32).tofile(path)
    out = isolated(bundle, f"""
        a, w = np.ones((32, 16), np.float32), np.ones((24, 16), np.float32)
        reg.gemm(a, w.T, out=np.memmap({str(tmp_path / "rw.bin")!r}, np.float32, "w+", shape=(32, 24)))
        try:
            reg.gemm(a, w.T, out=np.memmap({str(path)!r}, np.float32, "r", shape=(32, 24)))
            print("written")
        except td.InvalidInputError as e:
            print("refused:", e)
    """)
    assert out.startswith("refused: out is read-only"), out


def test_read_only_output_is_refused_on_the_fast_paths(reg):
    a, w = rand(32, 16), rand(24, 16)
    out = np.zeros((32, 24), np.float32)
    reg.gemm(a, w.T, out=out)  # a plan for these fingerprints is now cached
    frozen = np.zeros((32, 24), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(td.InvalidInputError, match="out is read-only"):
        reg.gemm(a, w.T, out=frozen)
    same_memory = out.view()
    same_memory.flags.writeable = False
    before = out.copy()
    with pytest.raises(td.InvalidInputError, match="out is read-only"):
        reg.gemm(rand(32, 16, seed=5), w.T, out=same_memory)
    np.testing.assert_array_equal(out, before)
    plan = reg.plan(td.GemmProblem(32, 24, 16, "fp32", "fp32", "fp32", "rcr"))
    plan({"a": a, "b": w.T, "out": out})
    with pytest.raises(td.InvalidInputError, match="out is read-only"):
        plan({"a": a, "b": w.T, "out": frozen})
    assert not frozen.any()


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_conv_outputs_must_be_writable(reg, direction):
    x, w, dy = conv_arrays()
    role = WRITTEN[direction]
    shape = {"x": x, "w": w, "y": dy}[role].shape
    frozen = np.zeros(shape, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(td.InvalidInputError, match=f"{role} is read-only"):
        run_conv(reg, direction, x, w, dy, frozen)
    src = np.zeros(shape[1:], np.float32)
    broadcast = np.lib.stride_tricks.as_strided(src, shape, (0, *src.strides))  # writable, batch stride 0
    with pytest.raises(td.InvalidInputError, match=f"{role} has shape .* some of its elements share memory"):
        run_conv(reg, direction, x, w, dy, broadcast)
    assert not frozen.any() and not src.any()


# -- 2. outputs must not overlap inputs ----------------------------------------------------------------------------
def test_gemm_output_aliasing_an_input_is_refused(reg):
    a, w = rand(32, 32), rand(32, 32, seed=1)
    a0, w0 = a.copy(), w.copy()
    with pytest.raises(td.InvalidInputError, match="out overlaps A in memory"):
        reg.gemm(a, w.T, out=a)
    with pytest.raises(td.InvalidInputError, match="out overlaps B"):
        reg.gemm(a, w.T, out=w)  # w.T is B; w is the same memory, row-major
    big = rand(64, 32, seed=2)
    big0 = big.copy()
    with pytest.raises(td.InvalidInputError, match="out overlaps A"):
        reg.gemm(big[:32], w.T, out=big[16:48])  # a partial overlap
    with pytest.raises(td.InvalidInputError, match="out overlaps C"):
        reg.gemm(a, w.T, out=big[1:33], c=big[:32], beta=1.0)
    with pytest.raises(td.InvalidInputError, match="out overlaps residual 0"):
        reg.gemm(a, w.T, out=big[:32], residuals=(big[8:40],), activation="clamp", clamp=(-1.0, 1.0))
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(w, w0)
    np.testing.assert_array_equal(big, big0)


def test_c_may_be_the_output_itself(reg):
    a, w, c = rand(32, 16), rand(24, 16, seed=1), rand(32, 24, seed=2)
    want = reference.gemm(a, w.T, c, beta=0.5)
    d = c.copy()
    reg.gemm(a, w.T, out=d, c=d, beta=0.5)
    close(d, want)
    d = c.copy()
    reg.gemm(a, w.T, out=d, c=d, beta=0.5)  # again, through the cached plan
    close(d, want)


def test_aliasing_is_refused_on_the_fast_paths(reg):
    a, w, d = rand(32, 32), rand(32, 32, seed=1), np.zeros((32, 32), np.float32)
    reg.gemm(a, w.T, out=d)  # caches a plan whose fingerprints a also has
    a0 = a.copy()
    with pytest.raises(td.InvalidInputError, match="out overlaps A"):
        reg.gemm(a, w.T, out=a)
    np.testing.assert_array_equal(a, a0)
    reg.gemm(a, w.T, out=d)  # the plan still serves good calls
    close(d, a.astype(np.float64) @ w.T)

    big = rand(64, 32, seed=3)
    c, out = rand(32, 32, seed=4), np.zeros((32, 32), np.float32)
    reg.gemm(a, w.T, out=out, c=c, beta=1.0)
    with pytest.raises(td.InvalidInputError, match="out overlaps C"):
        reg.gemm(a, w.T, out=big[8:40], c=big[:32], beta=1.0)  # same fingerprints, overlapping pointers

    plan = reg.plan(td.GemmProblem(32, 32, 32, "fp32", "fp32", "fp32", "rcr"))
    plan({"a": a, "b": w.T, "out": d})
    with pytest.raises(td.InvalidInputError, match="out overlaps B"):
        plan({"a": a, "b": w.T, "out": w})
    plan({"a": a, "b": w.T, "out": d})
    close(d, a.astype(np.float64) @ w.T)


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_conv_output_aliasing_an_input_is_refused(reg, direction):
    x, w, dy = conv_arrays()
    role = WRITTEN[direction]
    if direction == "fwd":  # y written over x (same shape)
        out, overlapped = x, "x"
    elif direction == "bwd_data":  # dx written over dy
        out, overlapped = dy, "y"
    else:  # dw written over the last elements of x and past them
        buf = np.concatenate([x.reshape(-1), np.zeros(w.size, np.float32)])
        x = buf[:x.size].reshape(x.shape)
        out, overlapped = buf[x.size - 100:x.size - 100 + w.size].reshape(w.shape), "x"
    saved = x.copy(), dy.copy()
    with pytest.raises(td.InvalidInputError, match=f"{role} overlaps {overlapped} in memory"):
        run_conv(reg, direction, x, w, dy, out)
    np.testing.assert_array_equal(x, saved[0])
    np.testing.assert_array_equal(dy, saved[1])


def test_pointwise_conv_run_as_gemm_refuses_aliasing(reg):
    x = rand(2, 4, 4, 1, 16, dtype=np.float16)  # fp16 pointwise: runs on the bundle's GEMM kernels
    w = rand(1, 16, 1, 1, 16, seed=1, dtype=np.float16)
    y = reg.conv_fwd(x, w)
    close(y, reference.conv_fwd(x, w, (1, 1), (1, 1), (0, 0), (0, 0)), 3e-3)
    x0 = x.copy()
    with pytest.raises(td.InvalidInputError, match="y overlaps x"):
        reg.conv_fwd(x, w, x)
    np.testing.assert_array_equal(x, x0)


def test_conv_plan_swaps_pointers_and_checks_overlap(reg):
    x, w, dy = conv_arrays()
    y = np.zeros_like(dy)
    problem = conv_op.ConvProblem("fwd", 2, 2, 16, 16, (6, 5), (3, 3), 1, 1, 1, 1, "fp32", "fp32", "fp32")
    plan = reg.plan(problem)
    plan({"x": x, "w": w, "y": y})
    close(y, reference.conv_fwd(x, w, (1, 1), (1, 1), (1, 1), (1, 1)))
    with pytest.raises(td.InvalidInputError, match="y overlaps x"):
        plan({"x": x, "w": w, "y": x})


# -- torch tensors -------------------------------------------------------------------------------------------------
def test_torch_outputs_and_autograd(reg):
    torch = pytest.importorskip("torch")
    a, w = torch.from_numpy(rand(32, 16)), torch.from_numpy(rand(24, 16, seed=1))
    src = torch.zeros(24)
    with pytest.raises(td.InvalidInputError, match="share memory"):
        reg.gemm(a, w.T, out=src.expand(32, 24))
    assert not src.any()
    sq = torch.from_numpy(rand(32, 32, seed=2))
    with pytest.raises(td.InvalidInputError, match="out overlaps A"):
        reg.gemm(sq, torch.from_numpy(rand(32, 32, seed=3)).T, out=sq)
    w.requires_grad_(True)
    with pytest.raises(td.InvalidInputError, match="B: the tensor requires grad"):
        reg.gemm(a, w.T)
    out = torch.empty(32, 24)
    with torch.no_grad():
        reg.gemm(a, w.T, out=out)  # allowed without grad mode, as torch's own out= functions do
        reg.gemm(a, w.T, out=out)
    close(out.numpy(), a.numpy().astype(np.float64) @ w.detach().numpy().T)
    with pytest.raises(td.InvalidInputError, match="requires grad"):
        reg.gemm(a, w.T, out=out)  # the cached plan, now in grad mode
    neg = torch._neg_view(a)
    with pytest.raises(td.InvalidInputError, match="negative or conjugate bit"):
        reg.gemm(neg, w.detach().T)
    with pytest.raises(td.InvalidInputError, match="meta tensor"):
        reg.gemm(torch.empty(32, 16, device="meta"), w.detach().T)
    with pytest.raises(td.InvalidInputError, match="layout torch.sparse_coo"):
        reg.gemm(a.to_sparse(), w.detach().T)
    with pytest.warns(UserWarning):  # torch: nested tensors are a prototype
        nested = torch.nested.nested_tensor([a, a])
    with pytest.raises(td.InvalidInputError, match="nested tensors are not supported"):
        reg.gemm(nested, w.detach().T, out=torch.empty(32, 24))


# -- 3. num_threads ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 1025, 2**40, 1.5, True, "2", None])  # crashing counts: in a subprocess below
def test_num_threads_is_validated(reg, bad):
    a, w = rand(32, 16), rand(24, 16)
    with pytest.raises(td.InvalidInputError, match="num_threads must be an integer from 0 .* to 1024"):
        reg.gemm(a, w.T, num_threads=bad)
    with pytest.raises(td.InvalidInputError, match="num_threads must be"):
        reg.gemm(a, w.T, out=np.zeros((32, 24), np.float32), num_threads=bad)
    x, w, dy = conv_arrays()
    with pytest.raises(td.InvalidInputError, match="num_threads must be"):
        reg.conv_fwd(x, w, num_threads=bad, **GEO)
    with pytest.raises(td.InvalidInputError, match="num_threads must be"):
        reg.plan(td.GemmProblem(32, 24, 16, "fp32", "fp32", "fp32", "rcr"), num_threads=bad)


def test_huge_num_threads_does_not_crash_the_process(bundle):
    out = isolated(bundle, """
        a, w = np.ones((64, 64), np.float32), np.ones((64, 64), np.float32)
        for n in (100000, 2**31 - 1):
            try:
                reg.gemm(a, w.T, num_threads=n)
                print("ran")
            except td.InvalidInputError as e:
                print("refused")
    """)
    assert out.split() == ["refused", "refused"]


def test_kernels_refuse_bad_num_threads_from_c(reg):
    """A C caller bypasses the Python checks: every cpu kernel refuses them itself, with a reason."""
    conv_p = {d: conv_op.ConvProblem(d, 2, 2, 16, 16, (6, 5), (3, 3), 1, 1, 1, 1, "fp32", "fp32", "fp32")
              for d in ("fwd", "bwd_data", "bwd_weight")}
    for kern in reg.kernels:
        sig = kern.key.signature
        if sig.op == "gemm":
            p = gemm_op.GemmProblem(32, 24, 16, sig.dtype_a, sig.dtype_b, sig.dtype_c, sig.layout, 1, sig.epilogue)
            args = gemm_op.make_args(p, kern.key, alpha=1.0)
        else:
            args = conv_op.make_args(conv_p[sig.direction], kern.key)
        for n in (0, 1, 1024):
            args.num_threads = n
            assert kern.library.can_run(args)[0] == abi.OK, (kern.name, n)
        for n in (-1, 1025, 100000, 2**31 - 1):
            args.num_threads = n
            status, reason = kern.library.can_run(args)
            assert status == abi.INVALID_ARGUMENT and "num_threads must be 0 (OpenMP's default) to 1024" in reason, \
                (kern.name, n, reason)


# -- 4. sizes that overflow the ABI's int64 ----------------------------------------------------------------------
def test_problem_descriptors_refuse_sizes_past_int64(reg):
    with pytest.raises(td.InvalidInputError, match="more than an int64 byte count holds"):
        td.GemmProblem(2**32, 2**32, 1, "fp32", "fp32", "fp32", "rcr")
    with pytest.raises(td.InvalidInputError, match="GEMM A would have 1 x 4611686018427387904 x 1 elements of 4 bytes"):
        td.GemmProblem(2**62, 1, 1, "fp32", "fp32", "fp32", "rcr")
    with pytest.raises(td.InvalidInputError, match="more than an int64"):
        reg.supports(td.GemmProblem(2**64 + 1, 8, 8, "fp32", "fp32", "fp32", "rcr"))  # wrapped to 1 in the ABI
    with pytest.raises(td.InvalidInputError, match="conv x would have"):
        td.ConvProblem("fwd", 2**40, 1, 2**20, 2**20, (2**20, 2**20), (1, 1), 1, 1, 0, 0, "fp32", "fp32", "fp32")
    with pytest.raises(td.InvalidInputError, match="conv stride must be <= 2147483647"):
        td.ConvProblem("fwd", 1, 1, 4, 4, (8,), (3,), 2**62, 1, 0, 0, "fp32", "fp32", "fp32")
    assert td.GemmProblem(np.int64(8), 8, 8, "fp32", "fp32", "fp32", "rcr") == \
        td.GemmProblem(8, 8, 8, "fp32", "fp32", "fp32", "rcr")


def test_kernels_refuse_overflowing_shapes_and_strides_from_c(reg):
    kern = next(k for k in reg.kernels if k.name.startswith("gemm_fp32xfp32xfp32xfp32_rcr_identity"))
    p = gemm_op.GemmProblem(8, 8, 8, "fp32", "fp32", "fp32", "rcr")
    args = gemm_op.make_args(p, kern.key)
    for slot in (0, 1, 2, 3):  # batch 2^40 of 2^30 x 2^30 tensors: M, N, K are below 2^31, the products are not
        args.tensors[slot].shape[0] = 2**40
        args.tensors[slot].shape[1] = args.tensors[slot].shape[2] = 2**30
    args.tensors[4].shape[0], args.tensors[4].shape[1] = 2**40, 2**30
    status, reason = kern.library.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "overflow int64" in reason, reason
    args = gemm_op.make_args(gemm_op.GemmProblem(8, 8, 8, "fp32", "fp32", "fp32", "rcr", 4), kern.key)
    args.tensors[0].stride[0] = 2**62  # batch stride: 3 x 2^62 elements past the pointer
    status, reason = kern.library.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "A: its element count or byte offsets" in reason, reason

    conv = next(k for k in reg.kernels if k.key.signature.op == "conv" and k.key.signature.direction == "fwd")
    cp = conv_op.ConvProblem("fwd", 2, 1, 4, 4, (8, 8), (3, 3), 1, 1, 1, 1, "fp32", "fp32", "fp32")
    args = conv_op.make_args(cp, conv.key)
    args.params[1] = 2**62  # a stride the kernels' index products would overflow with
    status, reason = conv.library.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "must be at most 2147483647" in reason, reason
    args = conv_op.make_args(cp, conv.key)
    args.tensors[0].stride[0] = 2**61  # X's batch stride: 2^61 elements of 4 bytes
    status, reason = conv.library.can_run(args)
    assert status == abi.INVALID_ARGUMENT and "X: its element count or byte offsets" in reason, reason


def test_huge_stride_bwd_data_runs_as_its_equivalent(reg, bundle):
    """A stride larger than the padded input: one output pixel. The phase split runs over the padded input,
    not over 2^62 phases (which aborted the process)."""
    out = isolated(bundle, """
        from tiledispatch import reference
        rng = np.random.default_rng(0)
        dy, w = rng.uniform(-1, 1, (1, 1, 1, 1, 8)).astype(np.float32), rng.uniform(-1, 1, (1, 8, 3, 3, 4)).astype(np.float32)
        dx = reg.conv_bwd_data(dy, w, in_size=(5, 4), stride=2**31 - 1, padding=1)
        want = reference.conv_bwd_data(dy, w, (5, 4), (2**31 - 1,) * 2, (1, 1), (1, 1), (1, 1))
        print(np.linalg.norm(dx - want) / np.linalg.norm(want))
    """)
    assert float(out) < 1e-5, out
    kern = next(k for k in reg.kernels if k.key.signature.op == "conv" and k.key.signature.direction == "bwd_data")
    cp = conv_op.ConvProblem("bwd_data", 1, 1, 4, 4, (2**12, 2**12), (1, 1), 2**12 - 1, 1, 0, 0,
                             "fp32", "fp32", "fp32")
    status, reason = kern.library.can_run(conv_op.make_args(cp, kern.key))
    assert status == abi.UNSUPPORTED and "stride phases" in reason, reason


def test_allocated_outputs_are_size_checked_first(reg):
    one = np.ones((1, 1), np.float32)
    a, b = np.broadcast_to(one, (2**24, 1)), np.broadcast_to(one, (1, 2**24))  # read-only inputs are fine
    with pytest.raises(td.InvalidInputError, match=r"out \(\[16777216, 16777216\] fp32\) would take 1.0 PiB"):
        reg.gemm(a, b)
    a, b = np.broadcast_to(one, (2**31, 1)), np.broadcast_to(one, (1, 2**31))
    with pytest.raises(td.InvalidInputError, match="would take 16.0 EiB, more than an int64 byte count holds"):
        reg.gemm(a, b)
    x = np.broadcast_to(np.ones((1, 1, 1, 1, 4), np.float32), (2**14, 2**12, 2**12, 1, 4))
    with pytest.raises(td.InvalidInputError, match=r"y \(\[16384, 4096, 4096, 1, 4\] fp32\) would take 4.0 TiB"):
        reg.conv_fwd(x, rand(1, 4, 1, 1, 4))


# -- 5. other hostile arguments -----------------------------------------------------------------------------------
def test_bad_scalars_and_options_are_refused(reg):
    a, w, c = rand(32, 16), rand(24, 16, seed=1), rand(32, 24, seed=2)
    res = (rand(32, 24, seed=3),)
    cases = [
        (dict(alpha=float("nan")), "alpha must be finite"),
        (dict(alpha=float("inf")), "alpha must be finite"),
        (dict(alpha="2"), "alpha must be a real number"),
        (dict(alpha=1j), "alpha must be a real number"),
        (dict(c=c, beta=float("nan")), "beta must be finite"),
        (dict(activation="clamp", residuals=res, clamp=(float("nan"), 1.0)), r"clamp low must be a number \(not NaN\)"),
        (dict(activation="clamp", residuals=res, clamp=(0, 1, 2)), r"clamp must be a pair \(low, high\)"),
        (dict(activation="clamp", residuals=res, clamp=(1.0, 0.0)), "clamp needs low <= high"),
        (dict(clamp=None), "clamp must be a pair"),
        (dict(activation=None), "unknown activation None"),
        (dict(residuals=None), "residuals must be a list or tuple of arrays, got NoneType"),
        (dict(residuals=c), "residuals must be a list or tuple of arrays, got ndarray"),
        (dict(kernel=5), "kernel must be a Kernel of this registry or a kernel name, got 5"),
        (dict(activation=["relu"]), r"unknown activation \['relu'\]"),  # unhashable: no plan-cache TypeError
        (dict(alpha=[1.0]), "alpha must be a real number"),
        (dict(beta=np.ones((2, 2))), "beta must be a real number"),  # not numpy's ambiguous-truth ValueError
        (dict(stream="s"), "stream must be a raw CUDA/HIP stream handle"),
    ]
    for out in (None, np.zeros((32, 24), np.float32)):
        for kwargs, message in cases:
            with pytest.raises(td.InvalidInputError, match=message):
                reg.gemm(a, w.T, out=out, **kwargs)
    clamp_res = reg.gemm(a, w.T, activation="clamp", residuals=res, clamp=(-0.5, float("inf")))  # inf: no bound
    close(clamp_res, reference.gemm(a, w.T, residuals=res, activation="clamp", clamp=(-0.5, np.inf)))
    x, w4, _ = conv_arrays()
    for kwargs, message in [(dict(alpha=float("nan")), "alpha must be finite"),
                            (dict(beta=np.ones(3)), "beta must be a real number"),
                            (dict(stride=1.0), "conv stride must be an integer or 2 integers"),
                            (dict(stride=True), "conv stride must be an integer"),
                            (dict(foo=1), r"conv fwd: unknown option\(s\) foo")]:
        with pytest.raises(td.InvalidInputError, match=message):
            reg.conv_fwd(x, w4, padding=1, **kwargs)
    y = reg.conv_fwd(x, w4, padding=np.int64(1), stride=(np.int32(1), 1))  # numpy integers are integers
    close(y, reference.conv_fwd(x, w4, (1, 1), (1, 1), (1, 1), (1, 1)))
    with pytest.raises(td.InvalidInputError, match="conv in_size must be an integer or 2 integers"):
        reg.conv_bwd_data(rand(2, 6, 5, 2, 8), w4, in_size="ab", padding=1)
    dx = reg.conv_bwd_data(rand(2, 6, 6, 2, 8), w4, in_size=6, padding=1)  # one int: every spatial dim
    assert dx.shape == (2, 6, 6, 2, 8)
    with pytest.raises(td.InvalidInputError, match="GEMM epilogue must be an Epilogue"):
        td.GemmProblem(8, 8, 8, "fp32", "fp32", "fp32", "rcr", 1, "relu")
    with pytest.raises(td.InvalidInputError, match="GEMM tensors are a dict"):
        reg.plan(td.GemmProblem(8, 8, 8, "fp32", "fp32", "fp32", "rcr"))([a, w.T])
    with pytest.raises(td.InvalidInputError, match="problem must be a GemmProblem, ConvProblem, LayerNormProblem or "
                                                   "MaxPoolProblem, got str"):
        reg.run("gemm", {"a": a, "b": w.T, "out": np.zeros((32, 24), np.float32)})
    with pytest.raises(td.InvalidInputError, match="operands must be a dict of arrays or the gemm module's Operands"):
        reg.run(td.GemmProblem(32, 24, 16, "fp32", "fp32", "fp32", "rcr"), [a, w.T])


def test_unusable_numpy_arrays_are_refused(reg):
    a, w = rand(32, 16), rand(24, 16, seed=1)
    with pytest.raises(td.InvalidInputError, match="A: masked arrays are not supported"):
        reg.gemm(np.ma.masked_array(a, mask=a > 0), w.T)
    buf = np.zeros(a.nbytes + 1, np.uint8)
    unaligned = buf[1:].view(np.float32).reshape(a.shape)
    with pytest.raises(td.InvalidInputError, match="A: the data pointer .* not aligned to the element size 4"):
        reg.gemm(unaligned, w.T)
    huge = np.lib.stride_tricks.as_strided(a, (3, 32, 16), (2**62, 64, 4))
    with pytest.raises(td.InvalidInputError, match="spans more bytes than an int64 offset can address"):
        reg.gemm(huge, w.T)
    for bad, message in [([[1.0]], "A: expected a numpy array, torch tensor or cupy array, got list"),
                         (np.float32(1), "got float32"),
                         (np.array(1.0, np.float32), r"A must be 2-D .* got shape \(\)"),
                         (rand(1, 1, 32, 16), r"A must be 2-D .* got shape \(1, 1, 32, 16\)"),
                         (a.astype(">f4"), "numpy dtype >f4 has no tiledispatch equivalent"),
                         (np.zeros((0, 16), np.float32), r"A has shape \(0, 16\): every size must be >= 1")]:
        with pytest.raises(td.InvalidInputError, match=message):
            reg.gemm(bad, w.T)


def test_negative_strides_give_right_results(reg):
    """Negative strides are supported on the cpu backend (the kernels index with signed int64 offsets)."""
    a, w = rand(32, 16), rand(24, 16, seed=1)
    close(reg.gemm(a[::-1], w.T), a[::-1].astype(np.float64) @ w.T)
    close(reg.gemm(a, w[::-1].T), a.astype(np.float64) @ w[::-1].T)
    out = np.zeros((32, 24), np.float32)
    reg.gemm(a, w.T, out=out[::-1])
    close(out[::-1], a.astype(np.float64) @ w.T)
    g = ((1, 1), (1, 1), (1, 1), (1, 1))
    x, wc, dy = conv_arrays()
    close(reg.conv_fwd(x[:, ::-1, ::-1], wc[:, ::-1], padding=1), reference.conv_fwd(x[:, ::-1, ::-1], wc[:, ::-1], *g))
    dx = np.zeros_like(x)
    reg.conv_bwd_data(dy[::-1], wc, dx[:, :, ::-1], padding=1)
    close(dx[:, :, ::-1], reference.conv_bwd_data(dy[::-1], wc, (6, 5), *g))
    dw = np.zeros_like(wc)
    reg.conv_bwd_weight(x[:, ::-1], dy, dw[:, ::-1], padding=1)
    close(dw[:, ::-1], reference.conv_bwd_weight(x[:, ::-1], dy, (3, 3), *g))
