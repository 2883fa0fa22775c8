// kvevict Python binding without the CUDA backend (no nvcc at build time): CUDA tensors are
// refused with a message that says so.
#include "binding.hpp"

namespace kvevict_py {

bool cuda_built() { return false; }

kvevict::status make_cuda_evictor(const std::string&, const param_map&, const std::string&, int device,
                                  std::unique_ptr<evictor_iface>*) {
  return kvevict::status::error(kvevict::errc::not_supported,
                                "the tensors are on cuda:%d, but this kvevict module was built without the CUDA backend "
                                "(build with nvcc and KVEVICT_ENABLE_CUDA=ON, or pass CPU tensors)",
                                device);
}

}  // namespace kvevict_py
