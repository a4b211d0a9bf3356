// expect-error: lockstep::Accumulate<K>: K must be at least 1
// A compile-time accumulation count must be at least 1. (Accumulate<0> is not an error: 0 is
// lockstep::dynamic_steps, i.e. Accumulate<>, whose K is set at run time.)
#include <lockstep/parallel/policies.hpp>

lockstep::Accumulate<-1> policy;
