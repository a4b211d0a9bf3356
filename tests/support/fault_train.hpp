#pragma once
// The fault suites' training loop, the same on ThreadComm (tests/cpu/test_fault.cpp) and MPI
// (tests/mpi/fault_mpi.cpp).
#include <cstddef>
#include <vector>

#include "mlp.hpp"

namespace lockstep_test {

//! `steps` steps of dp on rows 0-3 of (x, y); SGD (lr 0.1) after each step that finishes.
template <class DP>
void train_sgd(TestMlp<float>& m, DP& dp, int steps, const std::vector<float>& x, const std::vector<int>& y) {
  const std::vector<std::size_t> rows{0, 1, 2, 3};
  for (int s = 0; s < steps; ++s) {
    auto st = dp.step();
    m.forward_backward(x, y, rows, st.on_gradient_ready());
    if (st.finish()) m.sgd(0.1);
  }
}

}  // namespace lockstep_test
