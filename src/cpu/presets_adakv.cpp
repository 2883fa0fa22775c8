// kvevict::compiled: the "adakv" group of kvevict/backends/cpu/compiled.hpp (src/cpu/instantiate.hpp).
#define KVEVICT_COMPILED_UNIT_adakv 1
#include "instantiate.hpp"
