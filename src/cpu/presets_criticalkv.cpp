// kvevict::compiled: the "criticalkv" group of kvevict/backends/cpu/compiled.hpp (src/cpu/instantiate.hpp).
#define KVEVICT_COMPILED_UNIT_criticalkv 1
#include "instantiate.hpp"
