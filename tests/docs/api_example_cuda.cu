// docs/api.md's program in a CUDA translation unit (compiled only): there run(Auto) can
// also pick the local GPUs or one process per GPU, and the body must compile for those too.
#include "api_example.cpp"  // NOLINT(bugprone-suspicious-include)
