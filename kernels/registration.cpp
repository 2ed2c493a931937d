// Schema of the C++ kernel library: namespace ascend_kernels holds the CPU kernels that the
// portable torch.ops.ascend.* ops call when this library is loaded (see kernels/__init__.py).
#include <torch/library.h>

namespace {
int64_t version() { return 1; }
}  // namespace

TORCH_LIBRARY(ascend_kernels, m) {
  m.def("version", &version);
}
