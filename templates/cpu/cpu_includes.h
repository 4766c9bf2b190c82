// The headers every cpu kernel source includes first (plain C++: included by the cpu families' main templates).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <omp.h>
#if defined(__F16C__)
#include <immintrin.h>  // fp16 conversions in one instruction where the arch has them
#endif

#include "tiledispatch_kernel.h"  // tiledispatch_abi.h and what every kernel shares
