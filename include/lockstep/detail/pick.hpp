#pragma once
#include <type_traits>

namespace lockstep::detail {

//! The first type in Ts... for which Pred<T>::value holds, else Default.
template <template <class> class Pred, class Default, class... Ts>
struct pick {
  using type = Default;
};
template <template <class> class Pred, class Default, class T, class... Ts>
struct pick<Pred, Default, T, Ts...> {
  using type = std::conditional_t<Pred<T>::value, T, typename pick<Pred, Default, Ts...>::type>;
};
template <template <class> class Pred, class Default, class... Ts>
using pick_t = typename pick<Pred, Default, Ts...>::type;

template <template <class> class Pred, class... Ts>
inline constexpr int count_v = (0 + ... + (Pred<Ts>::value ? 1 : 0));

}  // namespace lockstep::detail
