// The five functions of the C ABI (tiledispatch_abi.h) that every kernel library exports, defined once. A kernel's
// main template ends with one line that names its key and its own three entry points:
//
//   TD_EXPORT_KERNEL(R"TDKEY(<key JSON>)TDKEY", can_run, workspace_bytes, run)
//
//     can_run, run       int32_t (const td_args* args, char* reason, uint64_t reason_bytes): a td_status, the
//                        reason written on failure (run checks as can_run does, then launches once)
//     workspace_bytes    uint64_t (const td_args* args); td_no_workspace for a kernel that needs none
//
// td_abi_version() returns TD_ABI_VERSION, td_kernel_key() the key (TD_DEFINE_KERNEL_KEY, also written to the ELF
// section the runtime reads before loading), and td_can_run / td_workspace_bytes / td_run forward to the three.
// An argument that holds a comma (a template-id) goes in parentheses: (run_checked<can_run, run>).
#ifndef TILEDISPATCH_EXPORT_H
#define TILEDISPATCH_EXPORT_H

#include <cstdint>

#include "tiledispatch_abi.h"

static inline uint64_t td_no_workspace(const td_args*) { return 0; }

#define TD_EXPORT_KERNEL(KEY_JSON, CAN_RUN, WORKSPACE_BYTES, RUN)                                  \
  extern "C" {                                                                                     \
  TD_EXPORT uint32_t td_abi_version(void) { return TD_ABI_VERSION; }                               \
  TD_DEFINE_KERNEL_KEY(KEY_JSON)                                                                   \
  TD_EXPORT int32_t td_can_run(const td_args* args, char* reason, uint64_t reason_bytes) {         \
    return CAN_RUN(args, reason, reason_bytes);                                                    \
  }                                                                                                \
  TD_EXPORT uint64_t td_workspace_bytes(const td_args* args) { return WORKSPACE_BYTES(args); }     \
  TD_EXPORT int32_t td_run(const td_args* args, char* reason, uint64_t reason_bytes) {             \
    return RUN(args, reason, reason_bytes);                                                        \
  }                                                                                                \
  }  /* extern "C" */

#endif  // TILEDISPATCH_EXPORT_H
