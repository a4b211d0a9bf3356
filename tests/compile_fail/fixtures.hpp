#pragma once
// Building blocks for the compile-failure tests: a valid model, and a communicator assembled
// from one mixin per requirement of lockstep::communicator, so each bad communicator lacks
// exactly one piece. ok_positive_control.cpp proves the full assembly is a communicator.
// Members are only declared: these sources are compiled, never linked.
#include <cstddef>
#include <span>
#include <vector>

#include <lockstep/core/concepts.hpp>
#include <lockstep/core/host_memory.hpp>
#include <lockstep/core/parameter.hpp>

namespace cf {

struct GoodModel {
  std::vector<float> w = std::vector<float>(8, 0.5f), gw = std::vector<float>(8);
  std::vector<lockstep::parameter> parameters() { return {lockstep::param<float>("w", std::span(w), std::span(gw))}; }
};

struct RankSize {  // requirement 1
  int rank() const;
  int size() const;
};
struct AllReduce {  // requirement 2
  lockstep::ready_work all_reduce(const void*, void*, std::size_t, lockstep::dtype, lockstep::reduce_op);
};
struct OtherCollectives {  // requirements 3-6
  lockstep::ready_work broadcast(void*, std::size_t, lockstep::dtype, int);
  lockstep::ready_work all_gather(const void*, void*, std::size_t, lockstep::dtype);
  lockstep::ready_work reduce_scatter(const void*, void*, std::size_t, lockstep::dtype, lockstep::reduce_op);
  void barrier();
};
struct Memory {  // requirement 7
  lockstep::HostMemory memory() const;
};

struct FullComm : RankSize, AllReduce, OtherCollectives, Memory {};

}  // namespace cf
