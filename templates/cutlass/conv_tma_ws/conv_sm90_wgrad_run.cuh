// bwd_weight's workspace_bytes and run (the ABI's td_workspace_bytes / td_run): plain CUDA included at the end of
// _conv_sm90_wgrad.j2 inside the kernel namespace, after prepare, split_of, wgrad_split and finalize_splits.
#pragma once

// S fp32 partials of rows x (taps x C), 256-byte rounded (split_of)
static uint64_t workspace_bytes(const td_args* args) {
  int device;
  typename Conv::Arguments arguments;
  if (prepare(args, false, &device, &arguments, nullptr, 0) != TD_OK) return 0;
  return uint64_t(split_of(args).bytes);
}

static int32_t run(const td_args* args, char* reason, uint64_t reason_bytes) {
  int device;
  typename Conv::Arguments arguments;
  int32_t status = prepare(args, true, &device, &arguments, reason, reason_bytes);
  if (status != TD_OK) return status;
  const Split sp = split_of(args);
  if (sp.bytes > args->workspace_bytes || !args->workspace || !aligned16(args->workspace))
    return fail(reason, reason_bytes, TD_INVALID_ARGUMENT, "bwd_weight needs a 16-byte aligned workspace of %llu "
                     "bytes (%d fp32 partials of dW, td_workspace_bytes), got %llu at %p",
                     (unsigned long long)sp.bytes, sp.splits, (unsigned long long)args->workspace_bytes,
                     args->workspace);
  cudaStream_t stream = static_cast<cudaStream_t>(args->stream);
  (void)cudaGetLastError();  // clear a stale error so that what follows is ours
  cudaError_t err = raise_smem_limit(device, wgrad_split);
  if (err != cudaSuccess) return cuda_fail(reason, reason_bytes, "cudaFuncSetAttribute", err);
  const int sms = sm_count(device);
  float* partials = static_cast<float*>(args->workspace);
  SplitParams params;
  params.kernel = ConvKernel::to_underlying_arguments(wgrad_arguments(args, partials, device, sms), nullptr);
  params.m_tiles = sp.m_tiles;
  params.tiles = sp.tiles;
  params.ktiles = sp.ktiles;
  params.splits = sp.splits;
  params.units = sp.tiles * sp.splits;
  params.rows = int(sp.rows);
  // persistent: as many CTAs as are resident at once, each looping over units
  const int ctas = std::min(params.units, sms * OCCUPANCY);
  err = launch(wgrad_split, dim3(unsigned(ctas), 1, 1), params, stream);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_fail(reason, reason_bytes, "wgrad_split launch", err);
  const int64_t elems = int64_t(args->tensors[T_W].shape[1]) * sp.cols;  // K x taps x C: W
  const int lanes = finalize_lanes(sp.splits);
  const int64_t threads = elems / 8 * lanes;
  const int blocks = int(std::min<int64_t>((threads + 255) / 256, int64_t(sms) * 8));
  finalize_splits<<<std::max(blocks, 1), 256, 0, stream>>>(
      partials, static_cast<T*>(args->tensors[T_W].data), elems, sp.rows * sp.cols, sp.splits, lanes,
      float(args->scalars[0]), float(args->scalars[1]));
  err = cudaGetLastError();
  return err == cudaSuccess ? TD_OK : cuda_fail(reason, reason_bytes, "finalize_splits launch", err);
}
