#pragma once
//! How DataParallel's constructors sort their arguments (internal): the options and the
//! policies come as instances in any order (take_arg), braced options only first, and a `{}`
//! in a policy's place is caught to name the form that replaced the positional one.

#include <type_traits>

#include "lockstep/parallel/policies.hpp"

namespace lockstep::detail {

template <class A>
inline constexpr bool is_options_v = std::is_same_v<std::remove_cvref_t<A>, DataParallelOptions>;
template <class... As>
inline constexpr bool starts_with_options_v = false;
template <class A, class... As>
inline constexpr bool starts_with_options_v<A, As...> = is_options_v<A>;
//! `{}` in a policy's place: the positional form of earlier versions (options, accumulation,
//! scaler, hook, each defaulted with braces), caught to say what replaced it.
struct braced_policy {};
template <class...>
inline constexpr bool positional_form_v = false;

//! The argument of type T among args (at most one), else T{}: DataParallel's constructors
//! take their options and policies in any order.
template <class T, class... Args>
T take_arg(Args&&... args) {
  static_assert(((std::is_same_v<std::remove_cvref_t<Args>, T> ? 1 : 0) + ... + 0) <= 1,
                "lockstep::DataParallel: a policy or DataParallelOptions is given twice");
  T out{};
  (
      [&](auto&& a) {
        if constexpr (std::is_same_v<std::remove_cvref_t<decltype(a)>, T>) out = a;
      }(args),
      ...);
  return out;
}

}  // namespace lockstep::detail
