// kvevict::compiled: the "lkv_restkv" group of kvevict/backends/cpu/compiled.hpp (src/cpu/instantiate.hpp).
#define KVEVICT_COMPILED_UNIT_lkv_restkv 1
#include "instantiate.hpp"
