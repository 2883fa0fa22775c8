// IWYU pragma: private, include "kvevict/kvevict.hpp"
// The library's one error mechanism: `status` values.
//
// kvevict never throws, aborts or prints. Every entry point that can fail returns a
// [[nodiscard]] `status`; on failure the outputs are left untouched and the message names the
// parameter and the offending value, e.g.
//   "invalid_argument: temporal.alpha = 1.5 must be in (0, 1]".
// Engines built with -fno-exceptions can use it as is. See docs/errors.md for the rationale.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "kvevict/core/config.hpp"

namespace kvevict {

/// Error categories. `ok` is zero so that `code() == errc{}` means success.
enum class errc : int {
  ok = 0,
  invalid_argument,        ///< a parameter is out of its documented range
  shape_mismatch,          ///< extents of two inputs disagree
  null_pointer,            ///< a required pointer is null
  non_finite_input,        ///< NaN or +-inf in K, V, Q or W_O
  insufficient_workspace,  ///< the workspace is smaller than get_workspace_size()
  insufficient_capacity,   ///< an output buffer is too small for the selection
  not_supported,           ///< a valid request this build or backend cannot serve
  cuda_error,              ///< a CUDA runtime error (message carries cudaGetErrorString)
  io_error,                ///< a file could not be read
  format_error,            ///< a file has the wrong format, version or sizes
};

/// Name of an error category ("invalid_argument", ...).
inline const char* to_string(errc e) noexcept {
  switch (e) {
    case errc::ok: return "ok";
    case errc::invalid_argument: return "invalid_argument";
    case errc::shape_mismatch: return "shape_mismatch";
    case errc::null_pointer: return "null_pointer";
    case errc::non_finite_input: return "non_finite_input";
    case errc::insufficient_workspace: return "insufficient_workspace";
    case errc::insufficient_capacity: return "insufficient_capacity";
    case errc::not_supported: return "not_supported";
    case errc::cuda_error: return "cuda_error";
    case errc::io_error: return "io_error";
    case errc::format_error: return "format_error";
  }
  return "unknown";
}

/// Result of a fallible call: an error category plus a fixed-size, allocation-free message.
/// Trivially copyable; safe to return from code compiled with -fno-exceptions.
class [[nodiscard]] status {
 public:
  static constexpr int message_capacity = 256;

  /// Success.
  status() noexcept { msg_[0] = '\0'; }

  /// An error whose message is "<category>: <printf-formatted text>".
  static status error(errc code, const char* fmt, ...) noexcept KVEVICT_PRINTF_FORMAT(2, 3) {
    status s;
    s.code_ = code;
    int n = std::snprintf(s.msg_, message_capacity, "%s: ", to_string(code));
    if (n < 0) n = 0;
    if (n < message_capacity) {
      va_list args;
      va_start(args, fmt);
      std::vsnprintf(s.msg_ + n, static_cast<std::size_t>(message_capacity - n), fmt, args);
      va_end(args);
    }
    return s;
  }

  bool ok() const noexcept { return code_ == errc::ok; }
  errc code() const noexcept { return code_; }
  /// "ok" on success, else the full message.
  const char* message() const noexcept { return ok() ? "ok" : msg_; }

 private:
  errc code_ = errc::ok;
  char msg_[message_capacity];
};

}  // namespace kvevict

/// Propagate a failed status to the caller.
#define KVEVICT_TRY(expr)                       \
  do {                                          \
    ::kvevict::status kvevict_try_s_ = (expr);  \
    if (!kvevict_try_s_.ok()) return kvevict_try_s_; \
  } while (0)
