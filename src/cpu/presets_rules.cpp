// kvevict::compiled: the "rules" group of kvevict/backends/cpu/compiled.hpp (src/cpu/instantiate.hpp).
#define KVEVICT_COMPILED_UNIT_rules 1
#include "instantiate.hpp"
