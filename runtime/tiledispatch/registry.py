"""The registry: the kernels of one bundle, matched, ranked and launched.

load(bundle) verifies every kernel file's sha256 and its embedded key against the manifest before
anything runs. Selection ranks the kernels whose signature matches the problem and takes the first whose own
td_can_run accepts it. run() launches exactly one kernel, once.
"""
from __future__ import annotations

import importlib
import statistics
import threading
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from . import abi, arrays, bundle, learned, selection, tuning
from . import backends
from .ops import get as ops_get
from .ops import conv as conv_op
from .ops.conv import ConvProblem
from .ops.gemm import GemmProblem, clamp_pair
from .ops.layernorm import DEFAULT_EPS, LayerNormProblem
from .ops.maxpool import MaxPoolProblem
from .plan import _CALLS, BoundedCache, Launcher, Plan, fingerprint, prints3, replay, stream_now
from .errors import BundleError, InvalidInputError, UnsupportedProblemError
from .spec.key import KernelKey


CACHE_SIZE = 2048  # entries of each of the registry's caches (launches, selections, candidate lists): a training
# step keeps two launch entries per distinct layer and direction (the prepared launch and the remembered call)
TUNE_TOP = 12  # kernels timed by tuning: on held-out H100 shapes the fastest of the learned top 12 was within
               # 10% of the best on 99.5% of them (runtime/tiledispatch/models/cutlass_sm90a_gemm.json)
TUNE_MARGIN = 0.97  # tuning replaces the ranking's pick only with a kernel this much faster: two timings of
                   # one kernel differ by a few percent
NO_CLAMP = (float("-inf"), float("inf"))
NO_PRINT = (None, None)  # fingerprint(None)
_SEQUENCES = (tuple, list)  # the residuals gemm()'s fast path takes
_thread_id = threading.get_ident


class Kernel:
    """One kernel of a bundle: its key, file and loaded library. load() passes the library it loaded from
    the file's checked bytes; without one, the file at path is loaded as it is (tools and tests)."""

    def __init__(self, key: KernelKey, path: Path, origin: str = "",
                 library: Optional[abi.KernelLibrary] = None):
        self.key, self.name, self.path, self.origin = key, key.name, path, origin
        try:
            self.library = library or abi.KernelLibrary(path)
        except OSError as e:
            raise BundleError(f"{path}: cannot be loaded: {e}") from None
        if self.library.abi_version() != abi.ABI_VERSION:
            raise BundleError(f"{path}: ABI version {self.library.abi_version()}, runtime has {abi.ABI_VERSION}")
        embedded = self.library.key_json()
        if embedded != key.to_json():
            raise BundleError(f"{path}: the library reports key {bundle.describe_key(embedded)}, the manifest says "
                              f"{key.name}")

    def __repr__(self) -> str:
        return f"Kernel({self.name})"


class Registry:
    """autotune: when a launch needs a kernel choice and no tuning record exists for it, time the best
    few candidates on the call's own data first (Registry.tune) and remember the winner."""

    jit = None  # on-demand kernels, off by default: load(bundle, jit=True) (tiledispatch.generator.jit)

    def __init__(self, kernels: list[Kernel], backend: str, arch: str, manifest: Optional[dict] = None, *,
                 autotune: bool = False, tuning_cache: Optional[tuning.TuningCache] = None):
        self.kernels = kernels
        self.ops = {k.key.signature.op for k in kernels}  # e.g. {"gemm", "conv"}
        self.backend, self.arch = backend, arch
        self.manifest = manifest or {}
        self.device = backends.get(backend).device
        # The fast path (README, "Repeated calls"): a public call's tensor fingerprints and options -> its
        # prepared Launcher, per thread (a Plan's td_args are rewritten by each launch) and, on a GPU, per
        # current stream (a launch uses the workspace of the stream it was prepared on); the selection for a
        # problem and operand layout; the kernels that can run it. The first two depend on the tuning record
        # and autotune: all are emptied when those change (clear_caches).
        self._launches = BoundedCache(CACHE_SIZE)
        self._selections = BoundedCache(CACHE_SIZE)
        self._explained = BoundedCache(CACHE_SIZE)
        self._groups: Optional[tuple] = None  # (kernel count, _signature_groups)
        self._matching_lists: dict = {}  # matching signatures -> their kernels (_matching)
        self._autotune = autotune
        self._tuning = tuning_cache or tuning.TuningCache(tuning.default_path())
        self._device_identity: Optional[str] = None
        self._checked_runnable = False
        self._workspaces: dict = {}  # (device, stream) -> [(buffer, bytes)], grow-only
        self.models: Optional[Path] = None  # the folder of learned models given to use_models, or None

    def __len__(self) -> int:
        return len(self.kernels)

    # -- caches -----------------------------------------------------------------------------------
    @property
    def autotune(self) -> bool:
        return self._autotune

    @autotune.setter
    def autotune(self, value: bool) -> None:
        self._autotune = value
        self.clear_caches()

    @property
    def tuning(self) -> tuning.TuningCache:
        return self._tuning

    @tuning.setter
    def tuning(self, value: tuning.TuningCache) -> None:
        self._tuning = value
        self.clear_caches()

    def use_models(self, models: Union[str, Path, None]) -> None:
        """Rank this registry's kernels with the learned models of a folder (<backend>_<arch>_<task>.json, as
        bench/sweeps/train.py --out writes them) instead of the shipped ones, for the tasks it has a file for;
        None: the shipped ones again. Its files for this backend and arch are read now: InvalidInputError names a
        folder or a file that cannot be used."""
        self.models = check_models(models, self.backend, self.arch)
        self.clear_caches()

    def ranked(self, problem, kernels) -> list:
        """The kernels in this registry's learned order: by the shipped models, or by those of the folder given to
        use_models for the tasks it has a file for (selection.learned)."""
        return selection.learned(problem, kernels, self.models)

    def clear_caches(self) -> None:
        """Forget prepared launches, selections and candidate lists (done when autotune, the tuning cache or its
        records change through this registry; call it after editing the tuning record by other means)."""
        self._launches.clear()
        self._selections.clear()
        self._explained.clear()

    def cache_info(self) -> dict:
        """Entries, bound, hits and misses of the launch, selection and candidate caches."""
        return {"launches": self._launches.info(), "selections": self._selections.info(),
                "candidates": self._explained.info()}

    def _resolve(self, kernel: Union[Kernel, str, None]) -> Optional[Kernel]:
        """A kernel argument (a Kernel, a kernel name or None) as a Kernel or None."""
        if kernel is None or isinstance(kernel, Kernel):
            return kernel
        if isinstance(kernel, str):
            return self.kernel(kernel)
        raise InvalidInputError(f"kernel must be a Kernel of this registry or a kernel name, got {kernel!r}")

    def kernel(self, name: str) -> Kernel:
        for k in self.kernels:
            if k.name == name:
                return k
        if self.jit is not None:
            return self.jit.add_named(self, name)
        raise UnsupportedProblemError(f"no kernel named {name} in this registry")

    # -- matching ---------------------------------------------------------------------------------
    def explain(self, problem, operands=None) -> list[tuple[Kernel, Optional[str]]]:
        """Each kernel with the reason it cannot run the problem (None when it can). Cached per problem and
        operand layout (what td_can_run looks at: shapes, strides, dtypes, pointer alignment)."""
        key = (problem, None if operands is None else operands.layout_key())
        explained = self._explained.get(key)
        if explained is None:
            explained = self._explain(problem, operands)
            self._explained.put(key, explained)
        return list(explained)

    def _explain(self, problem, operands) -> list[tuple[Kernel, Optional[str]]]:
        per_signature = self._per_signature(problem, operands)
        out = []
        for kern in self.kernels:
            reason, args = per_signature[kern.key.signature]
            if reason is None:
                status, why = kern.library.can_run(args)
                reason = None if status == abi.OK else why
            out.append((kern, reason))
        return out

    def _per_signature(self, problem, operands) -> dict:
        """signature -> (why its kernels cannot run the problem, or None; their ABI arguments where they match).
        Both depend on the key's signature alone (the op modules' mismatch and make_args), and td_can_run takes
        the arguments as const: one of each per signature, not per kernel."""
        ops = ops_get(problem.op)
        out = {}
        for sig, kernels in self._signature_groups().items():
            key = kernels[0][1].key
            reason = problem.mismatch(key)
            out[sig] = (reason, None if reason else ops.make_args(problem, key, operands))
        return out

    def candidates(self, problem, operands=None) -> list[Kernel]:
        return [k for k, reason in self.explain(problem, operands) if reason is None]

    def supports(self, problem) -> bool:
        return bool(self.candidates(problem))

    def select(self, problem, ranker: Union[str, Callable] = "auto", operands=None) -> Kernel:
        """The best kernel for the problem. ranker "auto": this device's tuning record for the problem
        when there is one, else "learned" (a shipped model where one covers the kernels, else "analytic")."""
        named = isinstance(ranker, str)
        if named and ranker != "auto" and ranker not in selection.RANKERS:
            raise InvalidInputError(f"unknown ranker {ranker!r} (known: auto, {', '.join(selection.RANKERS)})")
        key = (problem, None if operands is None else operands.layout_key(), ranker)
        chosen = self._selections.get(key) if named else None  # a function's ranking may change: not cached
        if chosen is not None:
            return chosen
        rank = (self.ranked if ranker in ("auto", "learned") else selection.RANKERS[ranker]) if named else ranker
        chosen = self._first_that_runs(problem, operands, rank) if named and not (
            ranker == "auto" and self.tuning.records()) else None
        if chosen is None:
            fits = self._fits(problem, operands)
            chosen = (ranker == "auto" and self._tuned(problem, fits)) or rank(problem, fits)[0]
        if named:
            self._selections.put(key, chosen)
        return chosen

    def _first_that_runs(self, problem, operands, rank) -> Optional[Kernel]:
        """The first kernel, in the ranker's order of the kernels whose signature matches, that td_can_run
        accepts: the same kernel as ranking the candidates (a named ranker orders by a per-kernel score, so a
        subset keeps its order), asking td_can_run of a few kernels instead of every one. None where the
        candidates are known already (explain() cached them), or none runs (the caller's path then explains
        why, or has the JIT add a kernel)."""
        if self._explained.get((problem, None if operands is None else operands.layout_key())) is not None:
            return None
        kernels = self._matching(problem)
        make_args = ops_get(problem.op).make_args
        args: dict = {}  # signature -> the ABI arguments (make_args), made for the signatures of kernels asked
        for kern in rank(problem, list(kernels)) if kernels else ():
            sig = kern.key.signature
            sig_args = args.get(sig)
            if sig_args is None:
                sig_args = args[sig] = make_args(problem, kern.key, operands)
            if kern.library.can_run(sig_args)[0] == abi.OK:
                return kern
        return None

    def _matching(self, problem) -> list[Kernel]:
        """The kernels whose signature matches the problem (its mismatch), in the bundle's order: one list per
        set of matching signatures, made once."""
        groups = self._signature_groups()
        matching = tuple(sig for sig, group in groups.items() if problem.mismatch(group[0][1].key) is None)
        found = self._matching_lists.get(matching)
        if found is None:
            pairs = groups[matching[0]] if len(matching) == 1 else sorted(
                pair for sig in matching for pair in groups[sig])
            found = self._matching_lists[matching] = [kern for _, kern in pairs]
        return found

    def _signature_groups(self) -> dict:
        """signature -> [(index in self.kernels, kernel)], made again (and the matching lists forgotten) when
        kernels were added (the JIT appends)."""
        if self._groups is None or self._groups[0] != len(self.kernels):
            groups: dict = {}
            for i, kern in enumerate(self.kernels):
                groups.setdefault(kern.key.signature, []).append((i, kern))
            self._groups = (len(self.kernels), groups)
            self._matching_lists = {}
        return self._groups[1]

    def tune(self, problem, operands, *, top: int = TUNE_TOP, stream=None, num_threads: int = 0, **scalars) -> Kernel:
        """Time the `top` best-ranked candidates on these operands (a dict or the op's Operands), remember
        the fastest in the tuning cache for this device and return it. The output is written by the timing
        launches; with beta != 0 its contents are restored afterwards."""
        if isinstance(operands, dict):
            operands = ops_get(problem.op).operands_for(problem, operands)
        self._check_device(operands)
        return self._tune(problem, operands, self._fits(problem, operands), top=top, stream=stream,
                          num_threads=num_threads, **scalars)

    def _fits(self, problem, operands) -> list[Kernel]:
        explained = self.explain(problem, operands)
        fits = [k for k, reason in explained if reason is None]
        if not fits and self.jit is not None and self.jit.add_for(self, problem):
            explained = self.explain(problem, operands)
            fits = [k for k, reason in explained if reason is None]
        if not fits:
            raise UnsupportedProblemError(_no_kernel_message(problem, explained))
        return fits

    def _identity(self) -> str:
        if self._device_identity is None:
            self._device_identity = backends.get(self.backend).driver.identity()
        return self._device_identity

    def tuning_record(self, problem, fits: list[Kernel]) -> Optional[dict]:
        """This device's tuning record for the problem and these candidates (winner, measured times), if any."""
        if not self.tuning.records():  # nothing recorded: no need to ask the device who it is
            return None
        return self.tuning.get(self._identity(), tuning.problem_key(problem, [k.name for k in fits]))

    def selection_models(self) -> dict:
        """Per task of the bundle's kernels: the learned model that ranks them now (file, version, the kernels it
        covers but never saw) and the one the bundle recorded when it was built (manifest "selection_models";
        None for a bundle built before bundles recorded it)."""
        now = bundle.selection_models([k.key for k in self.kernels], self.models)
        recorded = self.manifest.get("selection_models")
        return {task: {"now": model, "built_with": None if recorded is None else recorded.get(task)}
                for task, model in now.items()}

    def _tuned(self, problem, fits: list[Kernel]) -> Optional[Kernel]:
        """The kernel this device's tuning record names for the problem and these candidates, if any."""
        if not self.tuning.records():  # nothing recorded: no need to ask the device who it is
            return None
        rec = self.tuning.get(self._identity(), tuning.problem_key(problem, [k.name for k in fits]))
        return next((k for k in fits if rec and k.name == rec.get("kernel")), None)

    def _tune(self, problem, operands, fits: list[Kernel], *, top: int, stream, num_threads: int,
              **scalars) -> Kernel:
        keep = bool(scalars.get("beta", 0))  # the timing launches overwrite the output beta reads
        if keep and not arrays.copyable(operands.out):
            raise InvalidInputError(f"tuning with beta != 0 restores the output afterwards: pass numpy, torch or "
                                    f"cupy arrays, not {type(operands.out).__name__}")
        saved = arrays.snapshot(operands.out) if keep else None
        measured, launches = {}, {}  # in rank order
        for kern in self.ranked(problem, fits)[:max(1, top)]:
            # launched as a prepared call launches it: the host's cost per call is the public fast path's, which
            # differs by kernel (a TMA kernel's launch encodes descriptors), so a host-bound caller is timed right
            plan = Plan(self, problem, kern, stream=stream, num_threads=num_threads, **scalars)
            try:
                plan.prepare(operands)
                measured[kern.name] = tuning.measure(plan.launch, self.device, plan.launch_stream)
            except UnsupportedProblemError:  # refused (e.g. by CUTLASS): not a candidate after all
                continue
            launches[kern.name] = (plan.launch, plan.launch_stream)
        if not measured:
            raise UnsupportedProblemError(f"every candidate refused {problem} at launch")
        winner = self._confirmed_winner(measured, launches)
        if saved is not None:
            arrays.restore(operands.out, saved)
        self.tuning.put(self._identity(), tuning.problem_key(problem, [k.name for k in fits]),
                        tuning.record(winner, measured))
        self.clear_caches()  # the record changes what "auto" selects
        return self.kernel(winner)

    def _confirmed_winner(self, measured: dict, launches: dict) -> str:
        """The ranking's pick (the first of `measured`, in rank order), unless another candidate beats it by more
        than timing noise (TUNE_MARGIN) in every way tuning.measure timed them (at the caller's pace and, on a GPU,
        queued), also after timing both twice more, interleaved: tuning never trades the ranker's choice for a
        kernel that was faster only by chance, or only when the host keeps up. The two kernels' times become the
        medians of their timings."""
        first = next(iter(measured))

        def ratio(name: str) -> float:  # the challenger's worst time against the pick's
            return max(measured[name][how] / measured[first][how] for how in measured[first])

        challenger = min(measured, key=ratio)
        if challenger == first or ratio(challenger) >= TUNE_MARGIN:
            return first
        samples = {first: [measured[first]], challenger: [measured[challenger]]}
        for _ in range(2):
            for name in samples:
                launch, stream = launches[name]
                samples[name].append(tuning.measure(launch, self.device, stream))
        for name, taken in samples.items():
            measured[name] = {how: statistics.median(t[how] for t in taken) for how in taken[0]}
        return challenger if ratio(challenger) < TUNE_MARGIN else first

    def _choose(self, problem, operands, *, stream, num_threads: int, scalars: dict) -> Kernel:
        """The kernel for a launch without a named kernel: a tuning record, else (autotune) a tuning run
        on this call's data, else the learned / analytic ranking. Cached per problem and operand layout."""
        key = (problem, operands.layout_key(), "launch")
        chosen = self._selections.get(key)
        if chosen is not None:
            return chosen
        if not self.autotune and not self.tuning.records():  # the ranking alone decides
            chosen = self._first_that_runs(problem, operands, self.ranked)
            if chosen is not None:
                self._selections.put(key, chosen)
                return chosen
        fits = self._fits(problem, operands)
        chosen = self._tuned(problem, fits)
        if chosen is None and self.autotune:
            if not scalars.get("beta", 0) or arrays.copyable(operands.out):
                return self._tune(problem, operands, fits, top=TUNE_TOP, stream=stream, num_threads=num_threads,
                                  **scalars)  # recorded: the next call finds the record
            return self.ranked(problem, fits)[0]  # not cached: a later call may be able to tune
        chosen = chosen or self.ranked(problem, fits)[0]
        self._selections.put(key, chosen)
        return chosen

    # -- running ----------------------------------------------------------------------------------
    def run(self, problem, operands, *, kernel: Union[Kernel, str, None] = None, stream=None,
            num_threads: int = 0, **scalars) -> Kernel:
        """Launch one kernel once; operands is the op module's Operands or a dict of arrays (for GEMM:
        a, b, out, and optionally c, bias, residuals). Returns the kernel used."""
        if not isinstance(problem, (GemmProblem, ConvProblem, LayerNormProblem, MaxPoolProblem)):
            raise InvalidInputError(f"problem must be a GemmProblem, ConvProblem, LayerNormProblem or MaxPoolProblem, "
                                    f"got {type(problem).__name__}")
        ops = ops_get(problem.op)
        if isinstance(operands, dict):
            operands = ops.operands_for(problem, operands)
        elif not isinstance(operands, ops.Operands):
            raise InvalidInputError(f"operands must be a dict of arrays or the {problem.op} module's Operands, got "
                                    f"{type(operands).__name__}")
        return self._launch(problem, operands, kernel=kernel, stream=stream, num_threads=num_threads,
                            **scalars).kernel

    def _launch(self, problem, operands, *, kernel, stream, num_threads: int, **scalars) -> Plan:
        """Select a kernel (unless one is named), prepare a Plan on the checked operands and launch it once;
        the Plan, for the launch caches."""
        kernel = self._resolve(kernel)
        if kernel is None:
            self._check_device(operands)
            kernel = self._choose(problem, operands, stream=stream, num_threads=num_threads, scalars=scalars)
        plan = Plan(self, problem, kernel, stream=stream, num_threads=num_threads, **scalars)
        plan.prepare(operands)
        plan.launch()
        return plan

    def plan(self, problem, *, kernel: Union[Kernel, str, None] = None, stream=None, num_threads: int = 0,
             **scalars) -> Plan:
        """A Plan: the problem bound to one kernel (the selected one unless given), for repeated launches
        that only swap pointers while the tensors' shapes, strides and dtypes stay the same."""
        kernel = self._resolve(kernel)
        return Plan(self, problem, kernel or self.select(problem), stream=stream, num_threads=num_threads,
                    **scalars)

    def gemm(self, a, b, out=None, *, c=None, bias=None, residuals=(), alpha: float = 1.0, beta: float = 0.0,
             activation: str = "identity", clamp=NO_CLAMP, kernel=None, stream=None, num_threads: int = 0):
        """out = act(alpha * a @ b + beta * c + bias + sum(residuals)); returns out (allocated if None).

        A call with out given whose tensors and options match an earlier call's (shapes, strides,
        dtypes, devices, alignment) reuses that call's prepared launch and only swaps pointers (and alpha /
        beta when they changed)."""
        if type(clamp) is not tuple:
            clamp = clamp_pair(clamp)
        key = None
        if out is not None and type(residuals) in _SEQUENCES:  # the fast path: as little Python as possible
            # between the call and td_run. The key holds everything the full checks below look at except the
            # pointers and the values of alpha and beta (the Launcher checks and swaps those when they change),
            # with the types of the options where equal values of other types (True == 1) must be refused.
            try:
                (pa, pb, pout), prints = prints3(a, b, out)
                fc = NO_PRINT if c is None else fingerprint(c)
                fbias = NO_PRINT if bias is None else fingerprint(bias)
                key = (_thread_id(), activation, beta != 0, clamp if clamp is NO_CLAMP else
                       (clamp, type(clamp[0]), type(clamp[1])), kernel if kernel is None or type(kernel) is str
                       else kernel.name, stream, type(stream), num_threads, type(num_threads),
                       stream_now(a) if stream is None and self.device != "cpu" else None,
                       prints, fc[1], fbias[1])
                ptrs = (pa, pb, fc[0], pout, fbias[0])
                if residuals:
                    rprints = [fingerprint(r) for r in residuals]
                    key += tuple(p[1] for p in rprints)
                    ptrs += tuple(p[0] for p in rprints)
                launcher = self._launches.get(key)
            except Exception:  # an argument that cannot be fingerprinted or hashed: the full checks below say
                key = launcher = None  # what is wrong with it
            if launcher is not None:
                replay(self._launches, key, launcher, ptrs, alpha, beta)
                return out
        from .ops import gemm as gemm_op

        given_alpha, given_beta = alpha, beta
        alpha, beta = gemm_op.real_scalar("alpha", alpha), gemm_op.real_scalar("beta", beta)
        if beta != 0 and c is None:
            raise InvalidInputError("beta != 0 needs c")
        if self.device != "cpu" and type(a) is np.ndarray:
            return self._gemm_from_host(a, b, out, c=c, bias=bias, residuals=residuals, alpha=alpha, beta=beta,
                                        activation=activation, clamp=clamp, kernel=kernel, num_threads=num_threads)
        problem, operands = gemm_op.operands(a, b, out, c, bias, residuals, activation)
        self._check_device(operands)
        plan = self._launch(problem, operands, kernel=kernel, stream=stream, num_threads=num_threads, alpha=alpha,
                            beta=beta, clamp=clamp)
        launcher = _CALLS.launcher = Launcher(plan, given_alpha, given_beta)
        if key is not None:
            self._launches.put(key, launcher)
        return operands.out

    def _gemm_from_host(self, a, b, out, *, c, bias, residuals, **options):
        """numpy arrays on a GPU bundle: explicit copies to the device, one launch on the default stream,
        a wait, and the result copied back into the numpy output."""
        from . import cuda
        from .ops import gemm as gemm_op

        host = [x for x in (a, b, out, c, bias, *residuals) if x is not None]
        if any(type(x) is not np.ndarray for x in host):
            raise InvalidInputError("mix of numpy and device arrays: pass all numpy or all device arrays")
        _, ops = gemm_op.operands(a, b, out, c, bias, residuals, options["activation"])  # checks, allocates out
        dev = {id(x): cuda.DeviceArray(x) for x in (a, b, c, bias, *residuals) if x is not None}
        dev_out = dev.get(id(ops.out)) or cuda.DeviceArray(ops.out, copy=False)
        self.gemm(dev[id(a)], dev[id(b)], dev_out, c=dev.get(id(c)), bias=dev.get(id(bias)),
                  residuals=tuple(dev[id(r)] for r in residuals), stream=0, **options)
        cuda.synchronize(0)
        return dev_out.to_host(out=ops.out)

    def conv_fwd(self, x, w, out=None, **options):
        """y = act(alpha * conv(x, w) + beta * out + bias + sum(residuals)) (grouped, 1-3D); options: alpha, beta,
        bias ([K] or [G, K/G]), residuals (a tuple of arrays shaped like y), activation (as gemm()'s), clamp
        ((low, high), activation "clamp"), kernel, stream, num_threads and the geometry (ops.conv.operands and
        fwd). The kernel chosen fuses exactly this epilogue; UnsupportedProblemError when no kernel of the bundle
        does. Repeated calls are cached as gemm()'s are."""
        return conv_op.run(self, "fwd", x, w, out, out, options)

    def conv_bwd_data(self, dy, w, out=None, **options):
        """dx = alpha * conv_bwd_data(dy, w) + beta * out; without out, give in_size."""
        return conv_op.run(self, "bwd_data", out, w, dy, out, options)

    def conv_bwd_weight(self, x, dy, out=None, **options):
        """dw = alpha * conv_bwd_weight(x, dy) + beta * out; without out, give filter_size."""
        return conv_op.run(self, "bwd_weight", x, out, dy, out, options)

    def layer_norm(self, x, weight=None, bias=None, out=None, *, eps: float = DEFAULT_EPS, kernel=None, stream=None,
                   num_threads: int = 0):
        """out = (x - mean) / sqrt(var + eps) * weight + bias over x's last dim, per row (the variance biased, as
        torch's; weight and bias [cols], each optional); returns out (allocated like x if None; it may be x).
        Repeated calls whose arrays and options match an earlier call's reuse its prepared launch."""
        from .ops import layernorm as ln_op

        key = launcher = None
        try:  # the fast path, as gemm()'s: the key holds all the full checks look at except the pointers
            prints = [fingerprint(t) for t in (x, weight, bias, out)]
            if out is not None:
                key = ("layernorm", _thread_id(), type(eps), eps, kernel if kernel is None or type(kernel) is str
                       else kernel.name, stream, type(stream), num_threads, type(num_threads),
                       stream_now(x) if stream is None and self.device != "cpu" else None,
                       *(p[1] for p in prints))
                launcher = self._launches.get(key)
        except Exception:  # an argument that cannot be fingerprinted or hashed: the checks below say what is wrong
            key = launcher = None
        if launcher is not None:
            replay(self._launches, key, launcher, tuple(p[0] for p in prints), None, None)
            return out
        problem, operands = ln_op.operands(x, weight, bias, out)
        self._check_device(operands)
        plan = self._launch(problem, operands, kernel=kernel, stream=stream, num_threads=num_threads, eps=eps)
        launcher = _CALLS.launcher = Launcher(plan, None, None)
        if key is not None:
            self._launches.put(key, launcher)
        return operands.out

    def max_pool(self, x, window, stride=None, padding=0, dilation=1, *, ceil_mode: bool = False, out=None,
                 kernel=None, stream=None, num_threads: int = 0):
        """Max pooling of a channels-last map x [N, spatial..., C] (1 to 3 spatial dims), as torch's
        F.max_pool1d/2d/3d on the same data (window, stride (default: the window), padding, dilation: an int or
        one per dim; ceil_mode); returns out [N, out_spatial..., C] (allocated if None). Repeated calls whose
        arrays and options match an earlier call's reuse its prepared launch."""
        from .ops import maxpool as pool_op

        key = launcher = None
        try:  # the fast path, as gemm()'s
            prints = (fingerprint(x), fingerprint(out))
            if out is not None:
                key = ("maxpool", _thread_id(), repr((window, stride, padding, dilation, ceil_mode)),
                       kernel if kernel is None or type(kernel) is str else kernel.name, stream, type(stream),
                       num_threads, type(num_threads), stream_now(x) if stream is None and self.device != "cpu" else
                       None, prints[0][1], prints[1][1])
                launcher = self._launches.get(key)
        except Exception:  # an argument that cannot be fingerprinted or hashed: the checks below say what is wrong
            key = launcher = None
        if launcher is not None:
            replay(self._launches, key, launcher, (prints[0][0], prints[1][0]), None, None)
            return out
        problem, operands = pool_op.operands(x, window, stride, padding, dilation, ceil_mode, out)
        self._check_device(operands)
        plan = self._launch(problem, operands, kernel=kernel, stream=stream, num_threads=num_threads)
        launcher = _CALLS.launcher = Launcher(plan, None, None)
        if key is not None:
            self._launches.put(key, launcher)
        return operands.out

    def workspace(self, nbytes: int, like, stream=None) -> int:
        """A device buffer of at least nbytes, allocated once per device and stream (kernels running at once on
        two streams must not share scratch memory) and grown, never per call. Outgrown buffers stay alive, so a
        Plan that holds an older pointer stays valid."""
        slot = (str(getattr(like, "device", None)), stream)
        buffers = self._workspaces.setdefault(slot, [])
        if not buffers or buffers[-1][1] < nbytes:
            size = max(nbytes, 2 * buffers[-1][1] if buffers else 0)
            buffers.append((backends.get(self.backend).driver.allocate(size, like), size))
        obj = buffers[-1][0]
        return obj.data_ptr() if hasattr(obj, "data_ptr") else obj.data.ptr

    def _check_device(self, operands) -> None:
        devices = {v.device for v in operands.all()}
        if devices != {self.device}:
            raise InvalidInputError(f"this {self.backend} bundle runs on {self.device} memory; the arrays are on "
                                    f"{', '.join(sorted(devices))}")
        if not self._checked_runnable:
            ok, why = backends.get(self.backend).runnable(self.arch)
            if not ok:
                raise BundleError(f"bundle built for {self.backend}/{self.arch} cannot run here: {why}")
            self._checked_runnable = True


def _no_kernel_message(problem, explained) -> str:
    lines = [f"no kernel can run {problem}"]

    def distance(item):  # closest kernels first: same dtypes, then same layout
        sig = item[0].key.signature
        return (sig.dtype_a != getattr(problem, "dtype_a", None), sig.layout != getattr(problem, "layout", None),
                item[0].name)

    explained = sorted(explained, key=distance)
    for kern, reason in explained[:8]:
        lines.append(f"  {kern.name}: {reason}")
    if len(explained) > 8:
        lines.append(f"  ... and {len(explained) - 8} more")
    if not explained:
        lines.append("  (the registry is empty)")
    return "\n".join(lines)


def load(bundle_dir: Union[str, Path], *, autotune: bool = False,
         tuning_cache: Optional[tuning.TuningCache] = None, jit: Union[bool, dict] = False,
         models: Union[str, Path, None] = None) -> Registry:
    """Load a bundle; autotune: see Registry; tuning_cache: where tuning records live (default:
    tuning.default_path()); jit: True (or a dict of tiledispatch.build options) builds the kernels a problem or a
    kernel name needs that the bundle lacks (tiledispatch.generator.jit), off by default; models: a folder of learned
    ranking models to use instead of the shipped ones (Registry.use_models). Checked in this order
    (README, "Trust model"): the manifest's structure, then per kernel: its path confined to the bundle, its bytes read once, their sha256 and their static embedded
    key, and only then dlopen of a sealed copy of those bytes, its ABI version and its td_kernel_key()."""
    manifest = bundle.read_manifest(bundle_dir)
    kernels = []
    for e in manifest["kernels"]:
        data = bundle.read_kernel(bundle_dir, e)
        try:
            library = abi.KernelLibrary.from_image(data, e["sha256"], e["_path"])
        except OSError as err:
            raise BundleError(f"{e['_path']}: cannot be loaded: {err}") from None
        kernels.append(Kernel(e["_key"], e["_path"], e.get("origin", ""), library))
    if not kernels:
        raise BundleError(f"{bundle_dir}: the bundle has no kernels")
    registry = Registry(kernels, manifest["backend"], manifest["arch"], manifest, autotune=autotune,
                        tuning_cache=tuning_cache)
    registry.use_models(models)
    registry.jit = on_demand(jit)
    return registry


def check_models(models, backend: str, arch: str) -> Optional[Path]:
    """use_models' folder, resolved, with each of its model files for this backend and arch read: None for
    None; InvalidInputError naming the folder or the file that cannot be used."""
    if models is None:
        return None
    folder = Path(models).resolve()
    if not folder.is_dir():
        raise InvalidInputError(f"models: {models} is not a folder of model files")
    for task in learned.TASKS:
        path = folder / f"{backend}_{arch}_{task}.json"
        if path.exists():
            try:
                learned.model_for(backend, arch, task, folder)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise InvalidInputError(f"models: {path} cannot be used: {e}") from None
    return folder


def on_demand(option):
    """load()'s jit option as the generator's on-demand builder, or None when off. The generator (the `build`
    extra) is imported only when asked for: the runtime runs without it."""
    if option is False or option is None:
        return None
    try:
        jit = importlib.import_module("tiledispatch.generator.jit")
    except ImportError as e:
        raise InvalidInputError(f"jit needs the generator and its dependencies (pip install 'tiledispatch[build]'): "
                                f"{e}") from None
    return jit.on_demand(option)
