// kvevict::compiled: the free function templates of kvevict/backends/cpu/compiled.hpp (src/cpu/instantiate.hpp).
#define KVEVICT_COMPILED_UNIT_functions 1
#include "instantiate.hpp"
