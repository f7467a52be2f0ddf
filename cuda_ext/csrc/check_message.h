// PS_CHECK(cond, parts...): TORCH_CHECK with its message built here as one std::string, numbers
// and shapes through std::to_string, never through an ostream's numeric insert.
//
// NOTE: on the H200 image (torch 2.11.0+cu130, g++ 13.3) the CUDA build linked libstdc++
// statically into the extension (no libstdc++.so.6 among its NEEDED libraries, 1,832 std::
// symbols of its own, num_put's facet id among them), while TORCH_CHECK streams its message
// into an ostringstream that libc10 made with the shared libstdc++. Inserting a number looks up
// the num_put facet by our copy's id in that stream's locale, and every TORCH_CHECK message with
// a number segfaulted: a bad slot, block id or context length, meant as a RuntimeError, killed
// the process (seen 2026-12-04; strings and dtypes were fine). Text alone crosses safely.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace paged_serve::check_message {

inline void add(std::string& s, const char* v) { s += v; }
inline void add(std::string& s, const std::string& v) { s += v; }
inline void add(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
inline void add(std::string& s, const c10::Device& d) { s += d.str(); }  // Device::str lives in libc10
inline void add(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void add(std::string& s, T v) {
  s += std::to_string(v);
}

template <typename... Parts>
std::string text(const Parts&... parts) {
  std::string s;
  (add(s, parts), ...);
  return s;
}

}  // namespace paged_serve::check_message

// Like TORCH_CHECK (a c10::Error, RuntimeError in Python; the message is built only on failure).
#define PS_CHECK(cond, ...) TORCH_CHECK(cond, ::paged_serve::check_message::text(__VA_ARGS__))
