// kvevict::compiled: the "snapkv" group of kvevict/backends/cpu/compiled.hpp (src/cpu/instantiate.hpp).
#define KVEVICT_COMPILED_UNIT_snapkv 1
#include "instantiate.hpp"
