// Process-wide facts of the build. (The instruction-set path is chosen in
// isa_select.cpp; the thread count travels with each call: parallel.cpp.)
#include "transformer_linear/runtime.h"

namespace tl {

bool built_with_cuda() {
#ifdef TL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace tl
