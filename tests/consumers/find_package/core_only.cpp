// Consumer check: the core target alone (no Eigen, no CUDA) gives types and policies.
#include <kvevict/kvevict.hpp>

#include <cstdio>

int main() {
  auto p = kvevict::presets::restkv::defaults();
  const kvevict::status st = kvevict::presets::restkv::check(p);
  std::printf("core: restkv alpha %.2f -> %s\n", static_cast<double>(p.temporal.alpha), st.message());
  return st.ok() ? 0 : 1;
}
